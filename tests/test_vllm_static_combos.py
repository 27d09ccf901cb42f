"""vllm-static on vLLM's compiled path under big, deliberately nasty combinations of taps and
writes, checked value by value against HF ``transformers``.

A static tap or write is only as right as the compiled code around it: Inductor fuses the
hooks' tensor work with vLLM's own kernels, and which fusions happen depends on the whole
declared set. Two of the combinations below (taps at ``resid_pre.0``, ``resid_pre.2`` and
``resid_post.1`` with a write declared at ``resid_post.1`` on a 2-head, 1-KV-head Llama; every
point with that one write on Qwen3) captured ``resid_post.1`` 0.58 and 0.78 off HF with no
steering at all, and steered logits 0.4-0.5 off: torch 2.13's Inductor (CPU) lost the ordering
between vLLM's ``onednn_mm`` (which writes the MLP's output into a preallocated buffer) and the
hook's ``hidden + residual`` when it re-derived that read's loop body to fuse it
(pytorch#185509), and ran the read first. ``_static_worker.keep_inductor_mutation_order``
repairs that in every worker before vLLM compiles.

The engines: those two, and on Llama (deferred residual) and GPT-2 every capture kind at every
layer with a write at every writable kind at every layer (writes at the same and at
neighbouring layers, writes and taps on both sides of vLLM's deferred residual). On each:
every unsteered capture against HF (forward hooks on HF's modules), then, for every declared
write alone and for all of them at once, every capture and the logits against HF with the same
edit made by hand-written HF forward hooks. A compiled engine start is ~50 s on a 2-core CPU,
so the engines are few and each declares a lot.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import Address, SteeringSpec, Write, load_model, sync_model

from .conftest import MODELS, PROMPT, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
N_LAYERS = 3
READ_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post", "attn_pattern")
WRITE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post")

# HF module paths: (decoder layers, attention, MLP, MLP down projection, final norm)
HF_PARTS = {
    "llama": ("model.layers", "self_attn", "mlp", "mlp.down_proj", "model.norm"),
    "qwen3": ("model.layers", "self_attn", "mlp", "mlp.down_proj", "model.norm"),
    "gpt2": ("transformer.h", "attn", "mlp", "mlp.c_proj", "transformer.ln_f"),
}

EVERY_POINT = [
    "embed",
    *(f"{kind}.{layer}" for layer in range(N_LAYERS) for kind in READ_KINDS),
    "final_norm",
    "logits",
]
EVERY_WRITE = ["embed", *(f"{kind}.{layer}" for layer in range(N_LAYERS) for kind in WRITE_KINDS)]


@functools.cache
def reported_model_path() -> pathlib.Path:
    """The reported shape: Llama, d_model 128, 2 heads of 64 sharing 1 KV head."""
    from interp_testkit import build_tiny_model

    return build_tiny_model("llama", MODELS / "llama-vllm-h64", d_model=128, head_dim=64, max_positions=256)


# name -> (family, model path, points, writes)
ENGINES: dict[str, tuple[str, Callable[[], pathlib.Path], list[str], list[str]]] = {
    "llama-reported": (
        "llama",
        reported_model_path,
        ["resid_pre.0", "resid_pre.2", "resid_post.1", "logits"],
        ["resid_post.1"],
    ),
    # every point, and one write between two layers' resid taps
    "qwen3-one-write": ("qwen3", lambda: vllm_model_path("qwen3"), EVERY_POINT, ["resid_post.1"]),
    "llama-every": ("llama", lambda: vllm_model_path("llama"), EVERY_POINT, EVERY_WRITE),
    "gpt2-every": ("gpt2", lambda: vllm_model_path("gpt2"), EVERY_POINT, EVERY_WRITE),
}


# -- HF with hand-written hooks: the oracle ---------------------------------------------------
def _module(root: nn.Module, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _edit(x: torch.Tensor, writes: list[Write]) -> torch.Tensor:
    """``x`` ``[n, width]`` after ``writes`` in order (the Write semantics, written out by hand)."""
    x = x.detach().float().clone()
    n = x.shape[0]
    for write in writes:
        positions = list(range(n)) if write.positions in ("all", "prompt") else [p % n for p in write.positions]
        rows = torch.tensor(positions)
        vector = write.vector.float()
        if write.op == "add":
            x[rows] = x[rows] + write.scale * vector
        elif write.op == "set":
            x[rows] = (write.scale * vector).expand(len(positions), -1)
        else:
            unit = vector / vector.norm(dim=-1, keepdim=True)
            x[rows] = x[rows] - write.scale * (x[rows] * unit).sum(-1, keepdim=True) * unit
    return x


def hf_run(family: str, path: pathlib.Path, ids: list[int], writes: list[Write]) -> dict[Address, torch.Tensor]:
    """Every point of ``EVERY_POINT`` from HF, with ``writes`` made by forward hooks."""
    model = hf_for(path)
    layers_at, attn_at, mlp_at, down_at, norm_at = HF_PARTS[family]
    by_address: dict[Address, list[Write]] = {}
    for write in writes:
        by_address.setdefault(write.address, []).append(write)
    got: dict[Address, torch.Tensor] = {}
    before_attn: dict[int, torch.Tensor] = {}

    def point(address: Address, x: torch.Tensor) -> torch.Tensor:
        """Apply the writes at ``address`` to ``x`` ``[1, n, width]``, record the result."""
        if address in by_address:
            x = _edit(x[0], by_address[address]).to(x.dtype).unsqueeze(0)
        got[address] = x[0].detach().clone()
        return x

    def layer_pre(layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            if layer == 0:
                hidden = point(Address("embed"), hidden)
            hidden = point(Address("resid_pre", layer), hidden)
            before_attn[layer] = hidden
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return hook

    def attn_post(layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            out = output[0] if isinstance(output, tuple) else output
            out = point(Address("attn_out", layer), out)
            mid = before_attn[layer] + out
            moved = point(Address("resid_mid", layer), mid)
            out = out + (moved - mid)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    def down_pre(layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            return (point(Address("mlp_post", layer), args[0]), *args[1:])

        return hook

    def output_hook(address: Address) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (point(address, output[0]), *output[1:])
            return point(address, output)

        return hook

    handles = []
    try:
        for layer, block in enumerate(_module(model, layers_at)):
            handles.append(block.register_forward_pre_hook(layer_pre(layer), with_kwargs=True))
            handles.append(_module(block, attn_at).register_forward_hook(attn_post(layer)))
            handles.append(_module(block, down_at).register_forward_pre_hook(down_pre(layer)))
            handles.append(_module(block, mlp_at).register_forward_hook(output_hook(Address("mlp_out", layer))))
            handles.append(block.register_forward_hook(output_hook(Address("resid_post", layer))))
        handles.append(_module(model, norm_at).register_forward_hook(output_hook(Address("final_norm"))))
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    for layer, pattern in enumerate(out.attentions):
        got[Address("attn_pattern", layer)] = pattern[0]
    got[Address("logits")] = out.logits[0]
    return got


# -- the steering requests -----------------------------------------------------------------
def _specs(writes: list[Address], d_model: int, d_mlp: int, n: int) -> list[SteeringSpec]:
    """One spec per declared write (an add everywhere), then one with every write at once,
    cycling through add, ablate and set at all, explicit and per-row positions."""
    gen = torch.Generator().manual_seed(7)

    def vec(address: Address, rows: int = 0) -> torch.Tensor:
        width = d_mlp if address.kind == "mlp_post" else d_model
        return torch.randn(*((rows,) if rows else ()), width, generator=gen)

    specs = [SteeringSpec([Write(address, vec(address), op="add", scale=2.0)]) for address in writes]
    every = []
    for i, address in enumerate(writes):
        if i % 4 == 0:
            every.append(Write(address, vec(address), op="add", scale=3.0))
        elif i % 4 == 1:
            every.append(Write(address, vec(address), op="ablate", positions=[0, 2, -1]))
        elif i % 4 == 2:
            every.append(Write(address, vec(address, rows=2), op="set", positions=[1, n - 2]))
        else:
            every.append(Write(address, vec(address), op="ablate", scale=0.5))
            every.append(Write(address, vec(address), op="add", positions=[-1]))
    specs.append(SteeringSpec(every))
    return specs


@pytest.fixture(params=list(ENGINES), scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, pathlib.Path, Any]]:
    """One compiled vllm-static engine at a time, shut down before the next one starts."""
    family, path_of, points, writes = ENGINES[request.param]
    path = path_of()
    model = load_model(path, backend="vllm-static", static_points=points, static_writes=writes)
    facade = sync_model(model)
    try:
        facade.warmup()
        yield family, path, facade
    finally:
        facade.shutdown()


def _compare(got: dict[Address, torch.Tensor], expected: dict[Address, torch.Tensor], label: str) -> None:
    diffs = {str(address): rel_diff(value, expected[address]) for address, value in got.items()}
    bad = {address: diff for address, diff in diffs.items() if not diff <= TOL}
    assert not bad, f"{label}: {bad}"


def test_unsteered_captures_equal_hf(engine: tuple[str, pathlib.Path, Any]) -> None:
    family, path, facade = engine
    for text in (PROMPT, "A cat sat on the mat, and then it looked at the dog for a long time."):
        ids = facade.to_tokens(text)[0].tolist()
        got = facade.capture(ids, facade.model.static_points)
        assert list(got) == facade.model.static_points
        _compare(got, hf_run(family, path, ids, []), f"unsteered {text!r}")


def test_steered_captures_and_logits_equal_hf_with_the_same_edit(engine: tuple[str, pathlib.Path, Any]) -> None:
    family, path, facade = engine
    ids = facade.to_tokens(PROMPT)[0].tolist()
    info = facade.info
    points = facade.model.static_points
    plain = hf_run(family, path, ids, [])[Address("logits")]
    for spec in _specs(facade.model.static_writes, info.d_model, info.d_mlp, len(ids)):
        expected = hf_run(family, path, ids, list(spec.writes))
        assert not torch.allclose(expected[Address("logits")], plain)  # the edit changes the output
        got = facade.capture(ids, points, steering_spec=spec)
        _compare(got, expected, f"steered by {[(str(w.address), w.op, w.positions) for w in spec.writes]}")
