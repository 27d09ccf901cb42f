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
(pytorch#185509), and ran the read first. ``_compat.keep_inductor_mutation_order``
repairs that in every worker before vLLM compiles.

The engines: those two, and on Llama (deferred residual, grouped-query attention) and GPT-2
every capture kind at every layer, the attention-head kinds included (``attn_q``, ``attn_k``,
``attn_v``, ``attn_z``: the attention kernel's inputs and the output projection's input, per
head), with a write at every writable kind at every layer (``attn_v`` and ``attn_z`` next to the
residual-type kinds: writes at the same and at neighbouring layers, writes and taps on both
sides of vLLM's deferred residual, head writes in the same hooks as head taps and the
attention-pattern tap). On each: every unsteered capture against HF (forward hooks on HF's
modules; queries, keys and values as HF's ``eager_attention_forward`` receives them, each head's
output at the output projection's input), then every declared write alone (at a head address:
zero-ablating one head, per-head rows on two heads, a direction ablated in one head, another
run's head patched in at some positions; adding to one value head, a direction per value head)
and all of them at once, each time every capture and the logits against HF with the same edit
made by hand-written HF hooks (head edits at the output projection's input and at the value
projection's output, GPT-2's fused ``c_attn`` included). A compiled engine start is ~50 s on a
2-core CPU, so the engines are few and each declares a lot.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from interp_engine import Address, SteeringSpec, Write, load_model, sync_model
from interp_testkit.suite import KV_CACHE_BYTES, MODELS, PROMPT, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
N_LAYERS = 3
HEAD_READS = ("attn_q", "attn_k", "attn_v", "attn_z")
HEAD_WRITES = ("attn_v", "attn_z")
NEW_KINDS = ("attn_in", "mlp_in", "mlp_pre", "mlp_pre_linear", *(f"{w}_norm_{s}" for w in "qk" for s in ("in", "out")))
"""The kinds beyond the residual stream and the heads (each where the family has it)."""
READ_KINDS = (
    "resid_pre",
    *HEAD_READS,
    "resid_mid",
    "resid_post",
    "attn_out",
    "mlp_out",
    "mlp_post",
    "attn_pattern",
    "attn_scores",
    *NEW_KINDS,
    "mlp_gate_act",
)
WRITE_KINDS = ("resid_pre", *HEAD_WRITES, "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post", *NEW_KINDS)
HEAD_KINDS = (*HEAD_READS, "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out")


class HfParts(NamedTuple):
    """Where things are in an HF model: module paths (``layers`` and ``norm`` in the model, the rest in a layer)."""

    layers: str  # the decoder layers
    attn: str  # a layer's attention
    mlp: str
    down: str  # the MLP's down projection (its input: mlp_post)
    norm: str  # the final norm
    o_proj: str  # the attention's output projection (its input: attn_z)
    values: tuple[str, int, int]  # the module whose output holds the values: (path, part, of how many parts)
    gate: str  # the projection whose output is mlp_pre
    up: str | None = None  # the projection whose output is mlp_pre_linear (gated MLPs)
    q_norm: str | None = None
    k_norm: str | None = None
    act: str | None = None  # the module applying the gate's activation (gated MLPs): mlp_gate_act

    def lacks(self) -> set[str]:
        missing = set() if self.up else {"mlp_pre_linear", "mlp_gate_act"}
        return missing | (set() if self.q_norm else {f"{w}_norm_{s}" for w in "qk" for s in ("in", "out")})


_LLAMA_LIKE = HfParts(
    "model.layers",
    "self_attn",
    "mlp",
    "mlp.down_proj",
    "model.norm",
    "self_attn.o_proj",
    ("self_attn.v_proj", 0, 1),
    "mlp.gate_proj",
    "mlp.up_proj",
    act="mlp.act_fn",
)
HF_PARTS = {
    "llama": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE._replace(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    # GPT-2's c_attn computes [q | k | v]
    "gpt2": HfParts(
        "transformer.h",
        "attn",
        "mlp",
        "mlp.c_proj",
        "transformer.ln_f",
        "attn.c_proj",
        ("attn.c_attn", 2, 3),
        "mlp.c_fc",
    ),
}


def every_point(family: str) -> list[str]:
    kinds = [kind for kind in READ_KINDS if kind not in HF_PARTS[family].lacks()]
    per_layer = [f"{kind}.{layer}" for layer in range(N_LAYERS) for kind in kinds]
    return ["embed", *per_layer, "final_norm", "logits_raw", "logits"]


def every_write(family: str) -> list[str]:
    kinds = [kind for kind in WRITE_KINDS if kind not in HF_PARTS[family].lacks()]
    return ["embed", *(f"{kind}.{layer}" for layer in range(N_LAYERS) for kind in kinds)]


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
    "qwen3-one-write": ("qwen3", lambda: vllm_model_path("qwen3"), every_point("qwen3"), ["resid_post.1"]),
    "llama-every": ("llama", lambda: vllm_model_path("llama"), every_point("llama"), every_write("llama")),
    "gpt2-every": ("gpt2", lambda: vllm_model_path("gpt2"), every_point("gpt2"), every_write("gpt2")),
    # the q/k norms, written at every layer
    "qwen3-norms": (
        "qwen3",
        lambda: vllm_model_path("qwen3"),
        [f"{k}.{layer}" for layer in range(N_LAYERS) for k in ("q_norm_in", "q_norm_out", "k_norm_out", "attn_q")]
        + ["logits"],
        [f"{k}.{layer}" for layer in range(N_LAYERS) for k in ("q_norm_in", "k_norm_out", "mlp_pre_linear")],
    ),
}


# -- HF with hand-written hooks: the oracle ---------------------------------------------------
def _module(root: nn.Module, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _positions(write: Write, n: int) -> list[int]:
    """The rows of an ``n``-token prompt ``write`` touches (a capture generates nothing)."""
    if isinstance(write.positions, str):
        assert write.positions in ("all", "prompt")
        return list(range(n))
    return [p % n for p in write.positions]


def _edit(x: torch.Tensor, writes: list[Write]) -> torch.Tensor:
    """``x`` ``[n, width]`` after ``writes`` in order (the Write semantics, written out by hand)."""
    x = x.detach().float().clone()
    for write in writes:
        rows = torch.tensor(_positions(write, x.shape[0]))
        vector = write.vector.float()
        if write.op == "add":
            x[rows] = x[rows] + write.scale * vector
        elif write.op == "set":
            x[rows] = (write.scale * vector).expand(len(rows), -1)
        else:
            unit = vector / vector.norm(dim=-1, keepdim=True)
            x[rows] = x[rows] - write.scale * (x[rows] * unit).sum(-1, keepdim=True) * unit
    return x


def _edit_heads(x: torch.Tensor, writes: list[Write]) -> torch.Tensor:
    """``x`` ``[n, heads, d_head]`` after head ``writes`` in order, one (position, head) at a time."""
    x = x.detach().float().clone()
    for write in writes:
        heads = list(write.heads) if write.heads is not None else list(range(x.shape[1]))
        vector = write.vector.float()
        for i, p in enumerate(_positions(write, x.shape[0])):
            for j, h in enumerate(heads):
                # [d_head] for every head, [heads, d_head] per head, [positions, heads, d_head]
                v = vector[i, j] if vector.dim() == 3 else vector[j] if vector.dim() == 2 else vector
                if write.op == "add":
                    x[p, h] = x[p, h] + write.scale * v
                elif write.op == "set":
                    x[p, h] = write.scale * v
                else:
                    unit = v / v.norm()
                    x[p, h] = x[p, h] - write.scale * (x[p, h] @ unit) * unit
    return x


def hf_run(family: str, path: pathlib.Path, ids: list[int], writes: list[Write]) -> dict[Address, torch.Tensor]:
    """Every point of ``every_point(family)`` from HF, with ``writes`` made by forward hooks."""
    model = hf_for(path)
    parts = HF_PARTS[family]
    config = model.config
    d_head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    by_address: dict[Address, list[Write]] = {}
    for write in writes:
        by_address.setdefault(write.address, []).append(write)
    got: dict[Address, torch.Tensor] = {}
    before_attn: dict[int, torch.Tensor] = {}

    def point(address: Address, x: torch.Tensor) -> torch.Tensor:
        """Apply the writes at ``address`` to ``x`` ``[1, n, width]`` (``[1, n, heads, d_head]``
        at a head kind), record the result."""
        if address.kind in HEAD_KINDS:
            heads = x[0].reshape(x.shape[1], -1, d_head)
            if address in by_address:
                heads = _edit_heads(heads, by_address[address]).to(x.dtype)
            got[address] = heads.detach().clone()
            return heads.reshape(x.shape)
        if address in by_address:
            x = _edit(x[0], by_address[address]).to(x.dtype).unsqueeze(0)
        got[address] = x[0].detach().clone()
        return x

    def input_hook(address: Address) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": point(address, kwargs["hidden_states"])}
            return (point(address, args[0]), *args[1:]), kwargs

        return hook

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

    def values_post(layer: int) -> Callable[..., Any]:
        """Edit the value heads in the output of the module that computes them (the kernel's
        input; recorded there, by ``recording``)."""
        address = Address("attn_v", layer)
        _, part, of = parts.values

        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> Any:
            if address not in by_address:
                return None
            width = output.shape[-1] // of
            columns = slice(part * width, (part + 1) * width)
            heads = output[0, :, columns].reshape(output.shape[1], -1, d_head)
            out = output.clone()
            out[0, :, columns] = _edit_heads(heads, by_address[address]).reshape(heads.shape[0], -1).to(out.dtype)
            return out

        return hook

    def z_pre(layer: int) -> Callable[..., Any]:
        """Edit and record each head's output at the output projection's input."""
        address = Address("attn_z", layer)

        def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            x = args[0]
            heads = x[0].reshape(x.shape[1], -1, d_head)
            if address in by_address:
                heads = _edit_heads(heads, by_address[address]).to(x.dtype)
            got[address] = heads.detach().clone()
            return (heads.reshape(x.shape), *args[1:])

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

    # queries, keys and values as HF's attention function receives them (after rotary, q/k norms
    # and the value edits): [n, heads, d_head]
    modeling: Any = importlib.import_module(type(model).__module__)
    original = modeling.eager_attention_forward

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **k: Any) -> Any:
        layer = int(module.layer_idx)
        for kind, x in (("attn_q", query), ("attn_k", key), ("attn_v", value)):
            got[Address(kind, layer)] = x[0].transpose(0, 1).detach().clone()
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scores = (query @ keys.transpose(-1, -2))[0] * float(module.scaling)
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        got[Address("attn_scores", layer)] = scores.masked_fill(causal, float("-inf")).detach()
        return original(module, query, key, value, *a, **k)

    handles = []
    modeling.eager_attention_forward = recording
    try:
        for layer, block in enumerate(_module(model, parts.layers)):
            handles.append(block.register_forward_pre_hook(layer_pre(layer), with_kwargs=True))
            handles.append(_module(block, parts.values[0]).register_forward_hook(values_post(layer)))
            handles.append(_module(block, parts.o_proj).register_forward_pre_hook(z_pre(layer)))
            handles.append(_module(block, parts.attn).register_forward_hook(attn_post(layer)))
            handles.append(_module(block, parts.down).register_forward_pre_hook(down_pre(layer)))
            handles.append(_module(block, parts.mlp).register_forward_hook(output_hook(Address("mlp_out", layer))))
            handles.append(block.register_forward_hook(output_hook(Address("resid_post", layer))))
            for kind, path in (("attn_in", parts.attn), ("mlp_in", parts.mlp)):
                hook = input_hook(Address(kind, layer))
                handles.append(_module(block, path).register_forward_pre_hook(hook, with_kwargs=True))
            for kind, path in (("mlp_pre", parts.gate), ("mlp_pre_linear", parts.up), ("mlp_gate_act", parts.act)):
                if path is not None:
                    handles.append(_module(block, path).register_forward_hook(output_hook(Address(kind, layer))))
            for which, path in (("q", parts.q_norm), ("k", parts.k_norm)):
                if path is not None:
                    norm = _module(block, path)
                    hook = input_hook(Address(f"{which}_norm_in", layer))
                    handles.append(norm.register_forward_pre_hook(hook, with_kwargs=True))
                    handles.append(norm.register_forward_hook(output_hook(Address(f"{which}_norm_out", layer))))
        handles.append(_module(model, parts.norm).register_forward_hook(output_hook(Address("final_norm"))))
        handles.append(model.get_output_embeddings().register_forward_hook(output_hook(Address("logits_raw"))))
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        modeling.eager_attention_forward = original
        for handle in handles:
            handle.remove()
    for layer, pattern in enumerate(out.attentions):
        got[Address("attn_pattern", layer)] = pattern[0]
    got[Address("logits")] = out.logits[0]
    return got


# -- the steering requests -----------------------------------------------------------------
def _specs(writes: list[Address], info: Any, n: int) -> list[SteeringSpec]:
    """One spec per declared write (an add everywhere; at a head address, one per kind of head
    edit), then one with every write at once: residual-type writes cycle through add, ablate and
    set at all, explicit and per-row positions; head writes mix per-head rows, one-head and
    every-head writes, and ablations in several heads (never two directions on one head and
    token: vllm-static refuses those)."""
    gen = torch.Generator().manual_seed(7)
    n_heads, n_kv, d_head = info.n_heads, info.n_kv_heads, info.d_head

    def vec(address: Address, *rows: int) -> torch.Tensor:
        mlp = address.info.width == "d_mlp"
        width = d_head if address.info.per_head else info.d_mlp if mlp else info.d_model
        return torch.randn(*rows, width, generator=gen)

    def alone(address: Address) -> list[Write]:
        h = (address.layer or 0) % n_heads
        if address.kind == "attn_z":
            return [
                Write(address, torch.zeros(d_head), op="set", heads=[h]),  # zero-ablate one head
                Write(address, vec(address, 2), op="add", scale=2.0, heads=[0, n_heads - 1]),  # a row per head
                Write(address, vec(address), op="ablate", heads=[(h + 1) % n_heads]),  # a direction in one head
                # another run's head at three positions: [positions, 1 head, d_head]
                Write(address, vec(address, 3, 1), op="set", heads=[(h + 2) % n_heads], positions=[0, 2, -1]),
            ]
        if address.kind == "attn_v":
            return [
                Write(address, vec(address), op="add", scale=3.0, heads=[n_kv - 1]),  # one value head
                Write(address, vec(address, n_kv), op="ablate"),  # a direction per value head, every head
            ]
        return [Write(address, vec(address), op="add", scale=2.0)]

    def together_heads(address: Address) -> list[Write]:
        if address.kind == "attn_z":
            assert n_heads >= 4, "the combined attn_z writes use heads 0, 1, 2 and the last"
            last = n_heads - 1
            return [
                Write(address, vec(address, 2), op="add", scale=3.0, heads=[0, last]),
                Write(address, vec(address), op="ablate", heads=[1], positions=[0, 2, -1]),
                # heads 2 and the last each along their own direction (the last after its add)
                Write(address, vec(address, 2), op="ablate", scale=0.5, heads=[2, last]),
                Write(address, torch.zeros(d_head), op="set", heads=[2], positions=[1, n - 2]),  # after an ablation
                Write(address, vec(address, 2, 1), op="set", heads=[1], positions=[1, -1]),
                Write(address, vec(address), op="add", positions=[-1]),  # every head, after the sets
            ]
        n_h = n_kv if address.info.width == "kv_heads x d_head" else n_heads
        return [
            Write(address, vec(address), op="add", scale=3.0, heads=[n_h - 1]),
            Write(address, vec(address, n_h), op="ablate", positions=[0, -1]),  # after the add on the last head
            Write(address, vec(address, 2, 1), op="set", heads=[0], positions=[2, 3]),
        ]

    specs = [SteeringSpec([write]) for address in writes for write in alone(address)]
    every = []
    residual = [address for address in writes if not address.info.per_head]
    for address in writes:
        if address.info.per_head:
            every += together_heads(address)
            continue
        i = residual.index(address)
        if i % 4 == 0:
            every.append(Write(address, vec(address), op="add", scale=3.0))
        elif i % 4 == 1:
            every.append(Write(address, vec(address), op="ablate", positions=[0, 2, -1]))
        elif i % 4 == 2:
            every.append(Write(address, vec(address, 2), op="set", positions=[1, n - 2]))
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
    model = load_model(
        path, backend="vllm-static", static_points=points, static_writes=writes, kv_cache_memory_bytes=KV_CACHE_BYTES
    )
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


def _label(spec: SteeringSpec) -> list[Any]:
    return [(str(w.address), w.op, w.positions, w.heads) for w in spec.writes]


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
    points = facade.model.static_points
    plain = hf_run(family, path, ids, [])[Address("logits")]
    for spec in _specs(facade.model.static_writes, facade.info, len(ids)):
        expected = hf_run(family, path, ids, list(spec.writes))
        assert not torch.allclose(expected[Address("logits")], plain)  # the edit changes the output
        got = facade.capture(ids, points, steering_spec=spec)
        _compare(got, expected, f"steered by {_label(spec)}")
