"""The declarations of the vllm-static engines ``tests/vllm_static`` shares (its conftest starts
them, once per folder): the llama engine's taps and writes, and the SAEs compiled into its graph
(a TopK SAE at ``resid_post.1``, a ReLU SAE at ``mlp_out.1``, a JumpReLU SAE with layer-norm
input normalisation at ``resid_pre.2`` and a sigmoid probe on ``attn_z.0``), and the transcoders
compiled in beside them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from interp_engine import Address, Probe, Sae, load_model, sync_model
from interp_engine.addresses._address import as_address
from interp_engine.circuits import TranscoderSet
from interp_testkit.suite import PROMPT, vllm_model_path

# the taps and writes of test_vllm_static's llama and qwen2 engines
POINTS = [
    "embed",
    "resid_pre.1",
    "resid_mid.1",
    "resid_post.0",
    "resid_post.1",
    "resid_post.2",
    "attn_out.1",
    "mlp_out.2",
    "mlp_post.0",
    "attn_pattern.1",
    "attn_q.1",
    "attn_k.1",
    "attn_v.0",
    "attn_z.1",
    "attn_z.2",
    "final_norm",
    "logits",
]
WRITES = [
    "embed",
    "resid_pre.1",
    "resid_mid.1",
    "resid_post.1",
    "attn_out.1",
    "mlp_out.2",
    "mlp_post.0",
    "attn_v.0",
    "attn_z.1",
]

# the SAEs of test_vllm_static_sae, compiled into the llama engine
TOP_K, DENSE_MAX = 16, 256
PREFIX = "tvss"  # the SAEs' attachment names (on the session's dynamic llama engine too)
TOPK, RELU, JUMP, PROBE = (f"{PREFIX}-{n}" for n in ("topk", "relu", "jump", "probe"))
# name -> (architecture, hook, d_sae, extra constructor arguments)
SPECS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    TOPK: ("topk", "blocks.1.hook_resid_post", 512, {"k": 8}),
    RELU: ("standard", "blocks.1.hook_mlp_out", 200, {"apply_b_dec_to_input": True}),
    JUMP: ("jumprelu", "blocks.2.hook_resid_pre", 384, {"normalize_activations": "layer_norm"}),
}
SAE_POINTS = ["resid_post.1", "mlp_out.1", "resid_pre.2", "attn_z.0", "resid_post.2", "logits"]


@functools.cache
def saes() -> dict[str, Sae]:
    """Random SAEs scaled to the checkpoint's activations (pre-activations about N(0, 1))."""
    eager = sync_model(load_model(vllm_model_path("llama"), backend="eager"))
    try:
        ids = eager.to_tokens(PROMPT)[0].tolist()
        out: dict[str, Sae] = {}
        for seed, (name, (arch, hook, d_sae, extra)) in enumerate(SPECS.items()):
            address = as_address(hook)
            rows = eager.capture(ids, [address])[address].flatten(1).float()
            d_in, norm = rows.shape[-1], float(rows.norm(dim=-1).mean())
            gen = torch.Generator().manual_seed(seed)
            if arch == "jumprelu":
                extra = {**extra, "threshold": torch.rand(d_sae, generator=gen) * 0.4 + 0.1}
                norm = d_in**0.5  # layer-normed inputs
            out[name] = Sae(
                arch,
                torch.randn(d_in, d_sae, generator=gen) / norm,
                torch.randn(d_sae, generator=gen) * 0.1,
                torch.randn(d_sae, d_in, generator=gen) * float(rows.norm(dim=-1).mean()) / (4 * d_in**0.5),
                torch.randn(d_in, generator=gen) * 0.05,
                hook,
                **extra,
            )
        z = eager.capture(ids, ["attn_z.0"])[Address("attn_z", 0)].flatten(1)
        gen = torch.Generator().manual_seed(9)
        w = torch.randn(6, z.shape[-1], generator=gen) / float(z.norm(dim=-1).mean())
        out[PROBE] = Probe(w, torch.randn(6, generator=gen), activation="sigmoid", address="blocks.0.attn.hook_z")
        return out
    finally:
        eager.shutdown()


# the transcoders compiled into the llama engine (test_vllm_static_circuits): ReLU transcoders
# mlp_in.L -> mlp_out.L on every layer, and a JumpReLU one resid_mid.1 -> mlp_out.1
TC_PREFIX = "tvstc"
MID_TC = f"{TC_PREFIX}-mid"


@functools.cache
def transcoders() -> tuple[TranscoderSet, Sae]:
    """The per-layer set (attached as ``tvstc.L``) and the ``resid_mid`` transcoder (``tvstc-mid``),
    scaled to the llama checkpoint's activations."""
    from .circuits import scaled_plt
    from .readouts import eager_twin

    eager = eager_twin("llama")
    plt = scaled_plt(eager, prefix=TC_PREFIX, seed=31)
    mid = scaled_plt(eager, kind="resid_mid", prefix=MID_TC, seed=32, jumprelu=True)[1]
    return plt, mid
