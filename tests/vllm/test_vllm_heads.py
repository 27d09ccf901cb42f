"""Attention heads on the vllm backend, against HF ``transformers`` read and edited by hand.

The oracle is HF itself: queries/keys/values as HF's attention function receives them (after
rotary and q/k norms), each head's output as the output projection's input, and head edits
made by hand-written hooks on those modules. The engines are the session's shared ones.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import Address, SteeringSpec, Write
from interp_testkit.suite import PROMPT, VLLM_FAMILIES, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
FAMILIES = VLLM_FAMILIES

# per family: the HF attention module of a layer, its output projection, and where values come from
_HF = {
    "gpt2": ("transformer.h", "attn", "attn.c_proj", ("attn.c_attn", 2)),
    "llama": ("model.layers", "self_attn", "self_attn.o_proj", ("self_attn.v_proj", 0)),
    "qwen2": ("model.layers", "self_attn", "self_attn.o_proj", ("self_attn.v_proj", 0)),
    "qwen3": ("model.layers", "self_attn", "self_attn.o_proj", ("self_attn.v_proj", 0)),
}


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _layer(hf: nn.Module, family: str, layer: int, path: str) -> nn.Module:
    module: nn.Module = _get(_get(hf, _HF[family][0])[layer], path)
    return module


@contextlib.contextmanager
def _hooked(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def hf_heads(family: str, ids: list[int]) -> tuple[dict[Address, torch.Tensor], torch.Tensor]:
    """Per layer ``attn_q/k/v/z`` ``[tokens, heads, d_head]`` as HF computes them, and the logits."""
    hf = hf_for(vllm_model_path(family))
    modeling = importlib.import_module(type(hf).__module__)
    original = modeling.eager_attention_forward
    seen: dict[Address, torch.Tensor] = {}

    def recording(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **k: Any):
        layer = int(module.layer_idx)
        seen[Address("attn_q", layer)] = query[0].transpose(0, 1).clone()
        seen[Address("attn_k", layer)] = key[0].transpose(0, 1).clone()
        seen[Address("attn_v", layer)] = value[0].transpose(0, 1).clone()
        return original(module, query, key, value, *a, **k)

    handles = []
    for layer in range(hf.config.num_hidden_layers):

        def z_hook(module: nn.Module, args: tuple[Any, ...], layer: int = layer) -> None:
            x = args[0][0]
            seen[Address("attn_z", layer)] = x.reshape(x.shape[0], -1, seen[Address("attn_q", layer)].shape[-1])

        handles.append(_layer(hf, family, layer, _HF[family][2]).register_forward_pre_hook(z_hook))
    modeling.eager_attention_forward = recording
    try:
        with _hooked(handles), torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
    finally:
        modeling.eager_attention_forward = original
    return seen, logits


def hf_edited_logits(family: str, ids: list[int], where: str, layer: int, edit: Callable[[torch.Tensor], None]) -> Any:
    """HF logits with ``edit`` applied in place to ``[tokens, heads, d_head]`` of ``attn_z`` (the
    output projection's input) or ``attn_v`` (the value projection's output) at ``layer``."""
    hf = hf_for(vllm_model_path(family))
    d_head = hf.config.hidden_size // hf.config.num_attention_heads
    d_head = getattr(hf.config, "head_dim", None) or d_head
    if where == "attn_z":

        def pre(module: nn.Module, args: tuple[Any, ...]) -> Any:
            x = args[0].clone()
            edit(x[0].view(x.shape[1], -1, d_head))
            return (x, *args[1:])

        handle = _layer(hf, family, layer, _HF[family][2]).register_forward_pre_hook(pre)
    else:
        path, part = _HF[family][3]

        def post(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            out = output.clone()
            width = out.shape[-1] // (3 if part else 1)
            values = out[0, :, part * width : (part + 1) * width]
            heads = values.reshape(values.shape[0], -1, d_head).clone()
            edit(heads)
            out[0, :, part * width : (part + 1) * width] = heads.reshape(values.shape)
            return out

        handle = _layer(hf, family, layer, path).register_forward_hook(post)
    with _hooked([handle]), torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ids(model: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = model.to_tokens(text)[0].tolist()
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_equal_hf(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    info = model.info
    points = [
        Address(kind, layer) for layer in range(info.n_layers) for kind in ("attn_q", "attn_k", "attn_v", "attn_z")
    ]
    acts = model.capture(ids, points)
    expected, _ = hf_heads(family, ids)
    for point in points:
        heads = info.n_kv_heads if point.kind in ("attn_k", "attn_v") else info.n_heads
        assert acts[point].shape == (len(ids), heads, info.d_head), point
        assert rel_diff(acts[point], expected[point]) <= TOL, point
    # heads and the other points in one request, and in a generation
    completion, gen = model.capture_generation(
        ids, ["attn_z.1", "resid_post.0", "attn_k.0"], max_tokens=4, ignore_eos=True
    )
    assert gen[Address("attn_z", 1)].shape == (len(ids) + 4, info.n_heads, info.d_head)
    full, _ = hf_heads(family, ids + completion.token_ids)
    assert rel_diff(gen[Address("attn_z", 1)], full[Address("attn_z", 1)][: len(ids) + 4]) <= TOL
    assert rel_diff(gen[Address("attn_k", 0)], full[Address("attn_k", 0)][: len(ids) + 4]) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_head_writes_equal_hand_written_hf_hooks(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    info = model.info
    d_head = info.d_head
    gen = torch.Generator().manual_seed(3)
    last = info.n_layers - 1

    def zero_head(h: int) -> Callable[[torch.Tensor], None]:
        def edit(x: torch.Tensor) -> None:
            x[:, h] = 0

        return edit

    # zero-ablation of one head
    spec = SteeringSpec([Write(f"attn_z.{last}", torch.zeros(d_head), op="set", heads=[1])])
    logits = model.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]
    assert rel_diff(logits, hf_edited_logits(family, ids, "attn_z", last, zero_head(1))) <= TOL

    # patching a head from another prompt at the first 3 positions
    other = _ids(model, "A completely different sentence about cats and dogs")
    donor = model.capture(other, [f"attn_z.{last}"])[Address("attn_z", last)]
    rows = donor[:3, [2]]  # [positions, 1 head, d_head]
    spec = SteeringSpec([Write(f"attn_z.{last}", rows, op="set", heads=[2], positions=[0, 1, 2])])
    logits = model.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]

    def patch(x: torch.Tensor) -> None:
        x[:3, 2] = rows[:, 0]

    assert rel_diff(logits, hf_edited_logits(family, ids, "attn_z", last, patch)) <= TOL

    # add per head with one row per head, and ablate a direction in one head
    vectors = torch.randn(2, d_head, generator=gen)
    direction = torch.randn(d_head, generator=gen)
    spec = SteeringSpec(
        [
            Write(f"attn_z.{last}", vectors, op="add", scale=2.0, heads=[0, 3]),
            Write(f"attn_z.{last}", direction, op="ablate", heads=[1]),
        ]
    )
    logits = model.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]

    def add_and_ablate(x: torch.Tensor) -> None:
        x[:, 0] += 2.0 * vectors[0]
        x[:, 3] += 2.0 * vectors[1]
        unit = direction / direction.norm()
        x[:, 1] -= (x[:, 1] @ unit)[:, None] * unit

    assert rel_diff(logits, hf_edited_logits(family, ids, "attn_z", last, add_and_ablate)) <= TOL

    # a value head (a key/value head under GQA): the KV cache holds the written values
    v = torch.randn(d_head, generator=gen)
    spec = SteeringSpec([Write("attn_v.0", v, op="add", scale=3.0, heads=[info.n_kv_heads - 1])])
    logits = model.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]

    def add_v(x: torch.Tensor) -> None:
        x[:, info.n_kv_heads - 1] += 3.0 * v

    assert rel_diff(logits, hf_edited_logits(family, ids, "attn_v", 0, add_v)) <= TOL


def test_unwritten_heads_and_positions_are_bit_identical(vllm_engines: Any) -> None:
    model = vllm_engines("llama")
    ids = _ids(model)
    d_head, last = model.info.d_head, model.info.n_layers - 1
    z, v = Address("attn_z", last), Address("attn_v", 0)
    plain = model.capture(ids, [z, v])
    spec = SteeringSpec([Write(z, torch.ones(d_head), op="add", heads=[0])])
    steered = model.capture(ids, [z], steering_spec=spec)[z]
    assert torch.equal(steered[:, 1:], plain[z][:, 1:])  # the other heads of the written layer
    assert rel_diff(steered[:, 0], plain[z][:, 0] + 1) <= TOL
    spec = SteeringSpec([Write(v, torch.ones(d_head), op="set", heads=[0], positions=[2])])
    values = model.capture(ids, [v], steering_spec=spec)[v]
    assert torch.equal(values[2, 0], torch.ones(d_head))
    keep = [p for p in range(len(ids)) if p != 2]
    assert torch.equal(values[keep], plain[v][keep])
    assert torch.equal(values[:, 1:], plain[v][:, 1:])


def test_concurrent_head_requests_equal_their_solo_runs(vllm_engines: Any) -> None:
    import asyncio

    facade = vllm_engines("qwen2")
    model = facade.model
    info = model.info
    gen = torch.Generator().manual_seed(5)
    specs = [
        None,
        SteeringSpec([Write("attn_z.1", torch.zeros(info.d_head), op="set", heads=[0])]),
        SteeringSpec([Write("attn_z.0", torch.randn(2, info.d_head, generator=gen), op="add", heads=[1, 2])]),
        SteeringSpec([Write("attn_v.1", torch.randn(info.d_head, generator=gen), op="ablate", heads=[0])]),
    ]
    prompts = [PROMPT, "Hello there", "A cat sat on the mat and looked at the dog", "Once upon a time"]
    points = [Address("attn_z", 1), Address("attn_q", 0), Address("logits")]
    jobs = [(facade.to_tokens(p)[0].tolist(), s) for p in prompts for s in specs]
    assert len(jobs) == 16

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))

    batched = facade.run(together)
    for (ids, spec), result in zip(jobs, batched, strict=True):
        alone = facade.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(result[point], alone[point]) <= TOL, (spec, point)
    for i in range(1, 4):  # each spec did act
        assert not torch.allclose(batched[i][Address("logits")], batched[0][Address("logits")])
