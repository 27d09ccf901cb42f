"""Every address a model serves, and one write at each kind it can steer: what the vLLM family
tests capture and steer on each family (against the eager backend)."""

from __future__ import annotations

from typing import Any

import torch

from interp_engine import Address, Write


def every_point(model: Any) -> list[Address]:
    """Every address the model serves, at every layer."""
    out = []
    for kind, info in model.points().items():
        layers: Any = (info.layers or range(model.info.n_layers)) if info.per_layer else [None]
        out += [Address(kind, layer) for layer in layers]
    return out


def writes_at_every_kind(model: Any) -> list[Write]:
    """One write at each writable kind the family has (heads included), each changing the logits."""
    info, kinds = model.info, model.points()
    gen = torch.Generator().manual_seed(17)

    def vec(width: int) -> torch.Tensor:
        return torch.randn(width, generator=gen)

    d, d_head = info.d_model, info.d_head
    writes = [
        Write("resid_pre.1", vec(d), scale=3.0),
        Write("resid_mid.1", vec(d), positions=[1, 2, -1]),
        Write("attn_out.0", vec(d), op="ablate"),
        Write("mlp_out.2", vec(d), scale=2.0),
        Write("attn_in.1", vec(d)),
        Write("mlp_in.0", vec(d), scale=0.5),
        Write("attn_z.1", torch.zeros(d_head), op="set", heads=[0]),
        Write("attn_v.0", vec(d_head), heads=[info.n_kv_heads - 1], scale=2.0),  # the last key/value head
    ]
    if "mlp_post" in kinds:
        writes.append(Write("mlp_post.1", vec(info.d_mlp), scale=0.5))
    if "mlp_pre" in kinds:
        writes.append(Write("mlp_pre.0", vec(info.d_mlp), op="ablate"))
    if "mlp_pre_linear" in kinds:
        writes.append(Write("mlp_pre_linear.2", vec(info.d_mlp), positions=[-2, -1]))
    if "attn_out_post" in kinds:
        writes += [Write("attn_out_post.0", vec(d), scale=2.0), Write("mlp_out_post.1", vec(d), op="ablate")]
    if "q_norm_out" in kinds:
        writes += [Write("q_norm_out.1", vec(d_head), heads=[1]), Write("k_norm_in.0", vec(d_head), heads=[0])]
    if "router_logits" in kinds:  # ablate expert 0 at layer 1: every token routes elsewhere
        ablate = torch.zeros(info.n_experts)
        ablate[0] = -torch.inf
        writes.append(Write("router_logits.1", ablate))
    return writes
