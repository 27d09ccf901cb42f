"""The vocabulary beyond the residual stream on the vllm backend, against HF ``transformers``.

The oracle is HF itself, read and edited by hand-written hooks on its own modules: the sublayer
inputs after their norms, the MLP's gate and up projections (vLLM fuses them into one
``gate_up_proj``), the q/k norms, the pre-softmax scores from the queries and keys HF's attention
function receives, and the bare unembedding. The engines are the session's shared ones.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import Address, KindNotInFamily, SteeringSpec, Write
from interp_testkit.suite import PROMPT, VLLM_FAMILIES, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
FAMILIES = (*VLLM_FAMILIES, "gemma2", "gemma3_text")

# per family: the decoder layers, and per kind the module (relative to a layer) and which of its
# tensors holds the value: "in" (first input, or the hidden_states keyword) or "out" (its output)
_LAYERS = {family: "model.layers" for family in FAMILIES} | {"gpt2": "transformer.h"}
_LLAMA = {
    "attn_in": ("self_attn", "in"),
    "mlp_in": ("mlp", "in"),
    "mlp_pre": ("mlp.gate_proj", "out"),
    "mlp_pre_linear": ("mlp.up_proj", "out"),
    "mlp_gate_act": ("mlp.act_fn", "out"),  # HF applies the gate's activation on its own
}
_QK_NORMS = {
    "q_norm_in": ("self_attn.q_norm", "in"),
    "q_norm_out": ("self_attn.q_norm", "out"),
    "k_norm_in": ("self_attn.k_norm", "in"),
    "k_norm_out": ("self_attn.k_norm", "out"),
}
_SANDWICH = {
    "attn_out_post": ("post_attention_layernorm", "out"),
    "mlp_out_post": ("post_feedforward_layernorm", "out"),
}
_HF: dict[str, dict[str, tuple[str, str]]] = {
    "gpt2": {"attn_in": ("attn", "in"), "mlp_in": ("mlp", "in"), "mlp_pre": ("mlp.c_fc", "out")},
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORMS},
    "gemma2": {**_LLAMA, **_SANDWICH},  # and soft-capped attention scores and logits
    "gemma3_text": {**_LLAMA, **_QK_NORMS, **_SANDWICH},
}
HEAD_KINDS = ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out")
HEADS_FIRST = ("gemma3_text",)
"""Families whose HF q/k norms see ``[batch, heads, tokens, d_head]`` (Qwen3's: tokens first)."""


def _rows(family: str, value: torch.Tensor, d_head: int) -> torch.Tensor:
    """``[tokens, heads, d_head]`` of an HF q/k-norm tensor (batch row 0)."""
    if family in HEADS_FIRST:
        return value[0].transpose(0, 1)
    return value[0].reshape(value.shape[1], -1, d_head)


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


@contextlib.contextmanager
def _hooked(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _module(hf: nn.Module, family: str, layer: int, kind: str) -> tuple[nn.Module, str]:
    path, side = _HF[family][kind]
    module: nn.Module = _get(_get(hf, _LAYERS[family])[layer], path)
    return module, side


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    value: torch.Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return value


def hf_points(family: str, ids: list[int]) -> dict[Address, torch.Tensor]:
    """Every new kind the family has at every layer, ``[tokens, ...]`` as HF computes them, plus
    the scores (from the queries and keys HF's attention function receives), the attention
    weights HF returns and the bare unembedding."""
    hf = hf_for(vllm_model_path(family))
    modeling = importlib.import_module(type(hf).__module__)
    original = modeling.eager_attention_forward
    d_head = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    seen: dict[Address, torch.Tensor] = {}

    def recording(module: nn.Module, query: torch.Tensor, key: torch.Tensor, *a: Any, **k: Any) -> Any:
        layer = int(module.layer_idx)
        groups = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(groups, dim=1)
        scores = (query @ keys.transpose(-1, -2))[0] * float(module.scaling)
        cap = k.get("softcap")
        if cap:
            scores = torch.tanh(scores / cap) * cap
        n = scores.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        seen[Address("attn_scores", layer)] = scores.masked_fill(causal, float("-inf"))
        out = original(module, query, key, *a, **k)
        seen[Address("attn_pattern", layer)] = out[1][0]
        return out

    handles = []
    for layer in range(hf.config.num_hidden_layers):
        for kind in _HF[family]:
            module, side = _module(hf, family, layer, kind)

            def record(value: torch.Tensor, kind: str = kind, layer: int = layer) -> None:
                address = Address(kind, layer)
                value = _rows(family, value, d_head) if kind in HEAD_KINDS else value[0]
                seen[address] = value.detach().clone()

            if side == "in":
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, a, k, record=record: record(_input_of(a, k)), with_kwargs=True
                    )
                )
            else:
                handles.append(module.register_forward_hook(lambda m, a, o, record=record: record(o)))
    handles.append(
        hf.get_output_embeddings().register_forward_hook(
            lambda m, a, o: seen.__setitem__(Address("logits_raw"), o[0].detach().clone())
        )
    )
    modeling.eager_attention_forward = recording
    try:
        with _hooked(handles), torch.no_grad():
            hf(torch.tensor([ids]), output_attentions=True)
    finally:
        modeling.eager_attention_forward = original
    return seen


def hf_edited_logits(family: str, ids: list[int], kind: str, layer: int, edit: Callable[[torch.Tensor], None]) -> Any:
    """HF logits with ``edit`` applied in place to ``[tokens, ...]`` of ``kind`` at ``layer`` (head
    kinds as ``[tokens, heads, d_head]``)."""
    hf = hf_for(vllm_model_path(family))
    d_head = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    module, side = _module(hf, family, layer, kind)

    def edited(value: torch.Tensor) -> torch.Tensor:
        out = value.clone()
        if kind not in HEAD_KINDS:
            edit(out[0])
        elif family in HEADS_FIRST:  # [1, heads, tokens, d_head]: edit a [tokens, heads, d_head] view
            edit(out[0].transpose(0, 1))
        else:
            edit(out[0].view(out.shape[1], -1, d_head))
        return out

    if side == "in":

        def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": edited(kwargs["hidden_states"])}
            return (edited(args[0]), *args[1:]), kwargs

        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        handle = module.register_forward_hook(lambda m, a, o: edited(o))
    with _hooked([handle]), torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ids(model: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = model.to_tokens(text)[0].tolist()
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_new_points_equal_hf(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    info = model.info
    kinds = [*_HF[family], "attn_scores", "attn_pattern"]
    points = [Address(kind, layer) for layer in range(info.n_layers) for kind in kinds] + [Address("logits_raw")]
    acts = model.capture(ids, points)
    expected = hf_points(family, ids)
    for point in points:
        value = acts[point]
        if point.kind == "attn_scores":
            assert value.shape == (info.n_heads, len(ids), len(ids))
            finite = torch.isfinite(expected[point])
            assert torch.equal(torch.isfinite(value), finite), point  # -inf exactly where masked
            assert rel_diff(value[finite], expected[point][finite]) <= TOL, point
            assert rel_diff(value.softmax(-1), acts[Address("attn_pattern", point.layer)]) <= TOL
        else:
            assert rel_diff(value, expected[point]) <= TOL, point
    # the logits are the bare unembedding, soft-capped where the family caps them (Gemma 2)
    raw, logits = acts[Address("logits_raw")], model.capture(ids, ["logits"])[Address("logits")]
    cap = getattr(hf_for(vllm_model_path(family)).config, "final_logit_softcapping", None)
    if cap:
        assert not torch.allclose(raw, logits, atol=1e-3)
        raw = torch.tanh(raw / cap) * cap
    assert rel_diff(raw, logits) <= TOL
    if "attn_out_post" in _HF[family]:  # sandwich norms: what each sublayer adds is the post-norm's output
        for layer in range(info.n_layers):
            mid = model.capture(ids, [f"resid_pre.{layer}", f"resid_mid.{layer}", f"resid_post.{layer}"])
            added = acts[Address("attn_out_post", layer)]
            assert rel_diff(mid[Address("resid_mid", layer)], mid[Address("resid_pre", layer)] + added) <= TOL
            added = acts[Address("mlp_out_post", layer)]
            assert rel_diff(mid[Address("resid_post", layer)], mid[Address("resid_mid", layer)] + added) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_new_points_over_generation_and_chunked_prefill(family: str, vllm_engines: Any) -> None:
    """Decode steps (and, on llama's engine, a prompt prefilled in 64-token chunks) give the same
    values as HF on the whole sequence; scores see the keys of earlier steps."""
    model = vllm_engines(family)
    ids = _ids(model, " ".join([PROMPT] * 4))[:100]
    points = ["attn_scores.1", "mlp_pre.0", "mlp_pre_linear.1", "attn_in.1", "mlp_in.0", "logits_raw"]
    completion, acts = model.capture_generation(ids, points, max_tokens=4, ignore_eos=True)
    n = len(ids) + 4
    full = hf_points(family, ids + completion.token_ids)
    for point in map(Address.parse, points):
        expected = full[point][..., :n, :n] if point.kind == "attn_scores" else full[point][:n]
        value = acts[point]
        if point.kind == "attn_scores":
            finite = torch.isfinite(expected)
            assert torch.equal(torch.isfinite(value), finite), point
            value, expected = value[finite], expected[finite]
        assert rel_diff(value, expected) <= TOL, point


def _writes(family: str, info: Any) -> list[tuple[str, Write, Callable[[torch.Tensor], None]]]:
    """(kind, write, the same edit by hand) for the writable new kinds of ``family``."""
    gen = torch.Generator().manual_seed(11)
    d, d_mlp, d_head = info.d_model, info.d_mlp, info.d_head
    v, u, w = torch.randn(d, generator=gen), torch.randn(d_mlp, generator=gen), torch.randn(d_mlp, generator=gen)
    rows = torch.randn(3, d, generator=gen)
    out: list[tuple[str, Write, Callable[[torch.Tensor], None]]] = []

    def add(x: torch.Tensor) -> None:
        x += 2.0 * v

    def set_rows(x: torch.Tensor) -> None:
        x[1:4] = rows

    def ablate(x: torch.Tensor) -> None:
        unit = u / u.norm()
        x -= (x @ unit)[:, None] * unit

    def add_up(x: torch.Tensor) -> None:
        x[-2:] += w

    out.append(("attn_in", Write("attn_in.1", v, scale=2.0), add))
    out.append(("mlp_in", Write("mlp_in.0", rows, op="set", positions=[1, 2, 3]), set_rows))
    out.append(("mlp_pre", Write("mlp_pre.1", u, op="ablate"), ablate))
    if "attn_out_post" in _HF[family]:
        out.append(("attn_out_post", Write("attn_out_post.0", v, scale=2.0), add))
        out.append(("mlp_out_post", Write("mlp_out_post.1", rows, op="set", positions=[1, 2, 3]), set_rows))
    if "mlp_pre_linear" in _HF[family]:
        out.append(("mlp_pre_linear", Write("mlp_pre_linear.0", w, positions=[-2, -1]), add_up))
    if "q_norm_out" in _HF[family]:
        q = torch.randn(d_head, generator=gen)
        k = torch.randn(2, d_head, generator=gen)

        def add_q(x: torch.Tensor) -> None:
            x[:, 1] += q

        def add_k(x: torch.Tensor) -> None:
            x[:, :2] += 3.0 * k

        out.append(("q_norm_out", Write("q_norm_out.1", q, heads=[1]), add_q))
        out.append(("k_norm_in", Write("k_norm_in.0", k, scale=3.0, heads=[0, 1]), add_k))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_writes_at_new_points_equal_hand_written_hf_hooks(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    for kind, write, edit in _writes(family, model.info):
        logits = model.capture(ids, ["logits"], steering_spec=SteeringSpec([write]))[Address("logits")]
        assert rel_diff(logits, hf_edited_logits(family, ids, kind, write.address.layer, edit)) <= TOL, kind


def test_points_lists_what_the_family_has(vllm_engines: Any) -> None:
    gpt2, qwen3 = vllm_engines("gpt2"), vllm_engines("qwen3")
    assert {"q_norm_in", "mlp_pre_linear", "attn_out_post", "mlp_out_post"}.isdisjoint(gpt2.points())
    assert {"q_norm_out", "k_norm_in", "mlp_pre", "mlp_pre_linear", "attn_scores"} <= set(qwen3.points())
    assert "attn_out_post" not in qwen3.points()
    gemma2 = vllm_engines("gemma2")
    assert {"attn_out_post", "mlp_out_post", "mlp_pre_linear"} <= set(gemma2.points())
    assert "q_norm_out" not in gemma2.points() and gemma2.points()["logits_raw"].how == "recompute"
    info = qwen3.points()["k_norm_out"]
    assert info.shape == (qwen3.info.n_kv_heads, qwen3.info.d_head) and info.writable and info.how == "hook"
    assert qwen3.points()["attn_scores"].how == "recompute" and not qwen3.points()["attn_scores"].writable
    ids = _ids(gpt2)
    for bad in ("mlp_pre_linear.0", "mlp_gate_act.1", "q_norm_out.1", "attn_out_post.0"):
        with pytest.raises(KindNotInFamily, match="gpt2") as err:
            gpt2.capture(ids, [bad])
        assert "mlp_pre" in err.value.valid
    with pytest.raises(KindNotInFamily, match="sandwich"):
        gpt2.capture(ids, ["logits"], steering_spec=SteeringSpec([Write("mlp_out_post.0", torch.ones(128))]))
    # the public interp-engine's names are the same addresses
    acts = qwen3.capture(_ids(qwen3), ["z.1", "mlp_act.0", "lm_head", "attn_probs.1"])
    expected = {Address("attn_z", 1), Address("mlp_post", 0), Address("logits_raw"), Address("attn_pattern", 1)}
    assert set(acts) == expected


def test_gradients_need_the_eager_backend(vllm_engines: Any) -> None:
    """vLLM runs its forwards under inference mode: gradients and attribution patching raise
    ``UnsupportedOperation`` naming the eager backend, before any compute (vllm-static too)."""
    from interp_engine import GradientCapture, UnsupportedOperation, attribution_patch, run_with_gradients
    from interp_vllm.static._model import StaticVllmModel

    gpt2 = vllm_engines("gpt2")
    assert not isinstance(gpt2.model, GradientCapture)
    assert not issubclass(StaticVllmModel, GradientCapture)
    ids = _ids(gpt2)
    refusal = r"gradients need the eager backend.*load_model\(path, backend='eager'\)"
    with pytest.raises(UnsupportedOperation, match=refusal):
        run_with_gradients(gpt2, [ids], ["resid_post.0"], lambda logits: logits.sum())
    with pytest.raises(UnsupportedOperation, match="backend='eager'"):
        attribution_patch(gpt2, ids, ids, "resid_post", metric=lambda logits: logits.sum())


def test_vllm_static_serves_the_sandwich_norms_and_the_bare_unembedding(vllm_engines: Any) -> None:
    """vllm-static on Gemma 2 (compiled; sandwich norms, soft-capped scores and logits): the
    post-sublayer norms, the raw unembedding and the scores from its fixed taps, and writes at
    the post-norms and at resid_mid applied in-graph, equal to the vllm backend (itself checked
    against HF above)."""
    from interp_engine import load_model, sync_model

    dynamic = vllm_engines("gemma2")
    points = ["attn_out_post.0", "mlp_out_post.1", "resid_mid.1", "attn_scores.1", "mlp_pre_linear.0", "logits_raw"]
    writes = ["attn_out_post.0", "mlp_out_post.1", "resid_mid.1", "mlp_pre_linear.0"]
    static = sync_model(
        load_model(vllm_model_path("gemma2"), backend="vllm-static", static_points=points, static_writes=writes)
    )
    try:
        static.warmup()
        ids = _ids(static)
        gen = torch.Generator().manual_seed(5)
        d, d_mlp = static.info.d_model, static.info.d_mlp
        specs = [
            None,
            SteeringSpec(
                [
                    Write("attn_out_post.0", torch.randn(d, generator=gen), scale=2.0),
                    Write("mlp_out_post.1", torch.randn(d, generator=gen), op="ablate"),
                    Write("resid_mid.1", torch.randn(2, d, generator=gen), op="set", positions=[1, 3]),
                    Write("mlp_pre_linear.0", torch.randn(d_mlp, generator=gen), op="rescale", scale=0.5),
                ]
            ),
        ]
        for spec in specs:
            got = static.capture(ids, points, steering_spec=spec)
            expected = dynamic.capture(ids, points, steering_spec=spec)
            for point in map(Address.parse, points):
                assert rel_diff(got[point], expected[point]) <= TOL, (spec is not None, point)
    finally:
        static.shutdown()
