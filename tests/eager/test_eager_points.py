"""The finer points of the address vocabulary on the eager backend, against HF itself.

``attn_in``/``mlp_in``, ``mlp_pre``/``mlp_pre_linear``, ``attn_scores``, the q/k-norm points,
the sandwich norms' ``attn_out_post``/``mlp_out_post`` and ``logits_raw``, for every family: each
value against HF's own intermediates, read by hooks written here from this file's own table of
where each family keeps them (norm outputs, projection outputs, the q/k its attention function
receives, the lm_head output; no code shared with the backend); the identities between points;
``model.points()`` and the typed error for a kind a family lacks; and every writable new point
written with add / set / ablate (per position, per head where there are heads) against the same
edit made by a hand-written hook on the HF oracle. StableLM and Phi build q/k norms only with
``qk_layernorm``, and sliding windows are inert at the tiny models' lengths: both are checked on
models built here from the same configs with those options on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidSteering,
    KindNotInFamily,
    SteeringSpec,
    UnsupportedAddress,
    Write,
    capture_generation,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import ALL_FAMILIES, PROMPT, hf_oracle, rel_diff, tiny_model_path

from ..support.engines import eager_model

TOL = 1e-4

NEW_KINDS = (
    "attn_in",
    "mlp_in",
    "mlp_pre",
    "mlp_gate_act",
    "mlp_pre_linear",
    "attn_scores",
    "q_norm_in",
    "q_norm_out",
    "k_norm_in",
    "k_norm_out",
    "attn_out_post",
    "mlp_out_post",
    "logits_raw",
)
BASE_KINDS = {
    "embed",
    "resid_pre",
    "resid_mid",
    "resid_post",
    "attn_out",
    "mlp_out",
    "mlp_post",
    "attn_pattern",
    "final_norm",
    "logits",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_z",
    "attn_in",
    "mlp_in",
    "mlp_pre",
    "attn_scores",
    "logits_raw",
}
QK_KINDS = {"q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"}
GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "stablelm", "phi3"}
SANDWICH = {"gemma2", "gemma3_text", "olmo2"}


# -- the oracle's own table of where HF keeps each part ---------------------------------------


@dataclass(frozen=True)
class Parts:
    """Paths relative to one HF decoder layer (``None``: the family has no such module)."""

    attn: str = "self_attn"
    mlp: str = "mlp"  # the module whose input is the MLP's input
    mlp_out: str = "mlp"  # the module whose output is the MLP's output
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    gate: str = "mlp.gate_proj"
    up: str | None = "mlp.up_proj"
    fused: bool = False  # gate and up are the halves of ``gate``'s output
    act: str = "mlp.act_fn"
    q_norm: str | None = None
    k_norm: str | None = None
    qk_layout: str = "heads x tokens"
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None


_SANDWICH = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
_NOT_GATED = {"up": None}
PARTS: dict[str, Parts] = {
    "gpt2": Parts(attn="attn", attn_norm="ln_1", mlp_norm="ln_2", gate="mlp.c_fc", act="mlp.act", **_NOT_GATED),
    "gptj": Parts(attn="attn", attn_norm="ln_1", mlp_norm="ln_1", gate="mlp.fc_in", act="mlp.act", **_NOT_GATED),
    "gpt_neox": Parts(attn="attention", gate="mlp.dense_h_to_4h", act="mlp.act", **_NOT_GATED),
    "opt": Parts(
        mlp="fc1",
        mlp_out="fc2",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        gate="fc1",
        act="activation_fn",
        **_NOT_GATED,
    ),
    "phi": Parts(mlp_norm="input_layernorm", gate="mlp.fc1", act="mlp.activation_fn", **_NOT_GATED),
    "phi3": Parts(gate="mlp.gate_up_proj", up="mlp.gate_up_proj", fused=True, act="mlp.activation_fn"),
    "llama": Parts(),
    "mistral": Parts(),
    "qwen2": Parts(),
    "qwen3": Parts(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="tokens x heads"),
    "gemma": Parts(),
    "gemma2": Parts(mlp_norm="pre_feedforward_layernorm", **_SANDWICH),
    "gemma3_text": Parts(
        mlp_norm="pre_feedforward_layernorm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_SANDWICH
    ),
    "olmo2": Parts(
        attn_norm=None,
        mlp_norm=None,
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        qk_layout="flat",
        **_SANDWICH,
    ),
    "stablelm": Parts(),
}
QK_LAYERNORM = Parts(q_norm="self_attn.q_layernorm", k_norm="self_attn.k_layernorm")  # StableLM, Phi: qk_layernorm
LAYERS = {
    "gpt2": "transformer.h",
    "gptj": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "opt": "model.decoder.layers",
}


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _layer(hf: Any, family: str, layer: int) -> Any:
    return _get(hf, LAYERS.get(family, "model.layers"))[layer]


def _scaling(family: str, hf: Any, d_head: int) -> float:
    if family == "opt":  # OPT scales its queries in q_proj and the product by 1
        return 1.0
    pre_attn = getattr(hf.config, "query_pre_attn_scalar", None)  # Gemma 2/3
    return float(pre_attn) ** -0.5 if pre_attn else d_head**-0.5


def _expected_kinds(family: str, parts: Parts) -> set[str]:
    kinds = set(BASE_KINDS)
    if parts.up is not None:
        kinds |= {"mlp_pre_linear", "mlp_gate_act"}
    if parts.q_norm is not None:
        kinds |= QK_KINDS
    if parts.post_attn_norm is not None:
        kinds |= {"attn_out_post", "mlp_out_post"}
    return kinds


# -- reading HF's intermediates ----------------------------------------------------------------


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    value: torch.Tensor = args[0] if args else kwargs["hidden_states"]
    return value


def _first(output: Any) -> torch.Tensor:
    value: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return value


def _heads_view(x: torch.Tensor, layout: str, heads: int, d: int) -> torch.Tensor:
    """``[batch, tokens, heads, d]`` view of the tensor a q/k norm sees."""
    if layout == "flat":
        return x.view(*x.shape[:-1], heads, d)
    if layout == "heads x tokens":
        return x.transpose(1, 2)
    return x


@contextmanager
def _record_attention(family: str, attn: Any) -> Iterator[dict[str, Any]]:
    """The query and key HF's eager attention function receives for module ``attn``."""
    seen: dict[str, Any] = {}
    if family == "gptj":  # GPT-J computes attention in its own method
        original = attn._attn

        def method(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None) -> Any:
            seen.update(q=query.clone(), k=key.clone())
            return original(query, key, value, mask)

        attn.__dict__["_attn"] = method
        try:
            yield seen
        finally:
            del attn.__dict__["_attn"]
        return
    namespace = type(attn).forward.__globals__
    original_fn = namespace["eager_attention_forward"]

    def function(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is attn:
            seen.update(q=query.clone(), k=key.clone())
        return original_fn(module, query, key, *args, **kwargs)

    namespace["eager_attention_forward"] = function
    try:
        yield seen
    finally:
        namespace["eager_attention_forward"] = original_fn


def _oracle_scores(family: str, hf: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Pre-softmax scores ``[heads, q, k]`` of one causal prompt from HF's own queries and keys."""
    q, k = q[0].double(), k[0].double()
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    scores = q @ k.transpose(-1, -2) * _scaling(family, hf, q.shape[-1])
    cap = getattr(hf.config, "attn_logit_softcapping", None)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    n = scores.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).float()


def hf_intermediates(family: str, hf: Any, parts: Parts, ids: list[int], layer: int) -> dict[str, torch.Tensor]:
    """HF's own values of the new kinds at ``layer`` (and of attn_out/mlp_out) for one prompt."""
    block = _layer(hf, family, layer)
    config = hf.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    got: dict[str, torch.Tensor] = {}

    def out_hook(name: str, pick: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            got[name] = pick(_first(output)).clone()

        return hook

    with ExitStack() as stack, torch.no_grad():

        def hook_out(path: str, name: str, pick: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
            stack.callback(_get(block, path).register_forward_hook(out_hook(name, pick)).remove)

        def hook_in(path: str, name: str, pick: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
            def pre(module: Any, args: Any, kwargs: Any) -> None:
                got[name] = pick(_hidden(args, kwargs)).clone()

            stack.callback(_get(block, path).register_forward_pre_hook(pre, with_kwargs=True).remove)

        if parts.attn_norm is not None:
            hook_out(parts.attn_norm, "attn_in")
        if parts.mlp_norm is not None:
            hook_out(parts.mlp_norm, "mlp_in")
        hook_out(parts.attn, "attn_out")
        hook_out(parts.mlp_out, "mlp_out")
        if parts.fused:
            hook_out(parts.gate, "mlp_pre", lambda t: t.chunk(2, dim=-1)[0])
            hook_out(parts.gate, "mlp_pre_linear", lambda t: t.chunk(2, dim=-1)[1])
        else:
            hook_out(parts.gate, "mlp_pre")
            if parts.up is not None:
                hook_out(parts.up, "mlp_pre_linear")
        if parts.up is not None:  # a gated MLP: its activation module's output is act(gate)
            hook_out(parts.act, "mlp_gate_act")
        for norm, name, n in ((parts.q_norm, "q", heads), (parts.k_norm, "k", kv_heads)):
            if norm is not None:
                view = functools.partial(_heads_view, layout=parts.qk_layout, heads=n, d=d)
                hook_in(norm, f"{name}_norm_in", view)
                hook_out(norm, f"{name}_norm_out", view)
        if parts.post_attn_norm is not None and parts.post_mlp_norm is not None:
            hook_out(parts.post_attn_norm, "attn_out_post")
            hook_out(parts.post_mlp_norm, "mlp_out_post")
        stack.callback(hf.lm_head.register_forward_hook(out_hook("logits_raw")).remove)
        qk = stack.enter_context(_record_attention(family, _get(block, parts.attn)))
        out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    values = {
        name: value.reshape(1, len(ids), *value.shape[-2 if "norm_" in name else -1 :])[0]
        for name, value in got.items()
    }
    if parts.attn_norm is None:  # no pre-attention norm (OLMo 2): the attention reads the residual itself
        values["attn_in"] = out.hidden_states[layer][0]
    if parts.mlp_norm is None:  # and the MLP the residual after attention
        values["mlp_in"] = out.hidden_states[layer][0] + values["attn_out_post"]
    values["attn_scores"] = _oracle_scores(family, hf, qk["q"], qk["k"])
    values["attn_pattern"] = out.attentions[layer][0]
    act = _get(block, parts.act)
    values["mlp_post_from_parts"] = act(values["mlp_pre"]) * values.get("mlp_pre_linear", 1.0)
    return values


def _compare(got: torch.Tensor, want: torch.Tensor, what: Any) -> None:
    if want.isinf().any():
        assert torch.equal(got.isinf(), want.isinf()), what
        finite = ~want.isinf()
        got, want = got[finite], want[finite]
    assert rel_diff(got, want) <= TOL, what


def _check_reads(model: Any, family: str, hf: Any, parts: Parts, ids: list[int]) -> None:
    sync = sync_model(model)
    n_layers = model.info.n_layers
    served = [k for k in NEW_KINDS if k in model.points()]
    for layer in (0, n_layers - 1):
        kinds = [k for k in served if k != "logits_raw"] + ["attn_out", "mlp_out", "attn_pattern", "mlp_post"]
        points = [Address(k, layer) for k in kinds] + [Address("logits_raw")]
        got = sync.capture(ids, points)
        want = hf_intermediates(family, hf, parts, ids, layer)
        for point in points:
            if point.kind != "mlp_post":
                _compare(got[point], want[point.kind], (family, str(point)))
        # softmax(attn_scores) is the attention pattern; the MLP's hidden is its parts combined
        scores = got[Address("attn_scores", layer)]
        assert scores.shape == (model.info.n_heads, len(ids), len(ids))
        assert rel_diff(scores.softmax(-1), got[Address("attn_pattern", layer)]) <= 1e-6
        assert rel_diff(got[Address("mlp_post", layer)], want["mlp_post_from_parts"]) <= TOL


# -- reading: every family -----------------------------------------------------------------------


def _ids(family: str, n: int = 10, seed: int = 0) -> list[int]:
    vocab = eager_model(family).info.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_new_points_equal_hfs_own_intermediates(family: str) -> None:
    model = eager_model(family)
    _check_reads(model, family, hf_oracle(family), PARTS[family], model.to_tokens(PROMPT)[0].tolist())


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_points_lists_exactly_what_the_family_has(family: str) -> None:
    model = eager_model(family)
    points = model.points()
    expected = _expected_kinds(family, PARTS[family])
    if family == "opt" and not model.hf_model.config.do_layer_norm_before:  # pragma: no cover - post-LN OPT
        expected.discard("resid_mid")
    assert set(points) == expected
    order = [Address(k, 0 if p.per_layer else None).sort_key() for k, p in points.items()]
    assert order == sorted(order)  # forward order
    info = model.info
    assert not points["attn_scores"].writable and not points["logits_raw"].writable
    assert points["attn_scores"].shape == (info.n_heads,)
    assert points["logits_raw"].shape == (info.vocab_size,) and not points["logits_raw"].per_layer
    assert points["mlp_pre"].shape == (info.d_mlp,) and points["mlp_pre"].writable
    for kind in ("attn_in", "mlp_in"):
        assert points[kind].shape == (info.d_model,) and points[kind].writable
    if "q_norm_in" in points:
        assert points["q_norm_in"].shape == (info.n_heads, info.d_head)
        assert points["k_norm_out"].shape == (info.n_kv_heads, info.d_head)
    # attn_scores is rebuilt from the queries, keys and mask the attention got; the rest are hooked
    assert {k: p.how for k, p in points.items() if p.how != "hook"} == {"attn_scores": "recompute"}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_identities_between_points(family: str) -> None:
    model = eager_model(family)
    n = model.info.n_layers
    kinds = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_pre", "mlp_post"]
    if family in SANDWICH:
        kinds += ["attn_out_post", "mlp_out_post"]
    if family in GATED:
        kinds += ["mlp_pre_linear", "mlp_gate_act"]
    cache = run_with_cache(model, PROMPT, [f"{k}.{layer}" for k in kinds for layer in range(n)])
    block = _layer(hf_oracle(family), family, 0)
    act = _get(block, PARTS[family].act)
    for layer in range(n):

        def at(kind: str, layer: int = layer) -> torch.Tensor:
            value: torch.Tensor = cache[f"{kind}.{layer}"]
            return value

        if family in SANDWICH:  # the residual gets the post-norms' outputs, not the sublayers'
            assert rel_diff(at("resid_mid"), at("resid_pre") + at("attn_out_post")) <= TOL, layer
            assert rel_diff(at("resid_post"), at("resid_mid") + at("mlp_out_post")) <= TOL, layer
            assert rel_diff(at("resid_mid"), at("resid_pre") + at("attn_out")) > 1e-3, layer
        else:
            assert rel_diff(at("resid_mid"), at("resid_pre") + at("attn_out")) <= TOL, layer
        linear = at("mlp_pre_linear") if family in GATED else 1.0
        assert rel_diff(at("mlp_post"), act(at("mlp_pre")) * linear) <= TOL, layer
        if family in GATED:  # the gate's activation times the linear branch is the MLP's hidden
            assert rel_diff(at("mlp_gate_act"), act(at("mlp_pre"))) <= TOL, layer
            assert rel_diff(at("mlp_post"), at("mlp_gate_act") * linear) <= TOL, layer


def test_sandwich_families_read_the_sublayers_own_outputs_before_the_post_norms() -> None:
    """attn_out / mlp_out are the attention's and the MLP's own outputs on every family."""
    for family in sorted(SANDWICH):
        model = eager_model(family)
        ids = _ids(family)
        got = sync_model(model).capture(ids, ["attn_out.1", "mlp_out.1", "attn_out_post.1", "mlp_out_post.1"])
        want = hf_intermediates(family, hf_oracle(family), PARTS[family], ids, 1)
        for kind in ("attn_out", "mlp_out", "attn_out_post", "mlp_out_post"):
            assert rel_diff(got[Address(kind, 1)], want[kind]) <= TOL, (family, kind)


# -- families with options the tiny checkpoints leave off --------------------------------------


@functools.cache
def built(family: str, **overrides: Any) -> tuple[Any, Any]:
    """An eager model and its HF oracle (the same weights, eager attention) for ``family``'s tiny
    config with ``overrides`` (e.g. ``qk_layernorm=True``), weights drawn as the testkit does."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from interp_eager import EagerModel
    from interp_testkit import randomize_weights

    path = tiny_model_path(family)
    config = AutoConfig.from_pretrained(path)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_weights(hf, seed=1)
    hf.eval()
    return EagerModel.from_hf(hf, AutoTokenizer.from_pretrained(path)), hf


@pytest.mark.parametrize("family", ["stablelm", "phi"])
def test_qk_layernorm_families_serve_the_norm_points(family: str) -> None:
    model, hf = built(family, qk_layernorm=True)
    parts = dataclasses.replace(PARTS[family], q_norm=QK_LAYERNORM.q_norm, k_norm=QK_LAYERNORM.k_norm)
    assert set(model.points()) == _expected_kinds(family, parts)
    _check_reads(model, family, hf, parts, _ids(family, 9, seed=3))
    _check_writes(model, family, hf, parts, ["q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"])
    # without the option the same family has no q/k norm
    assert not QK_KINDS & set(eager_model(family).points())


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_scores_carry_the_sliding_window_mask(family: str) -> None:
    window = 3
    model, hf = built(family, sliding_window=window)
    ids = _ids(family, 9, seed=4)
    n = len(ids)
    layers = range(model.info.n_layers)
    got = sync_model(model).capture(ids, [Address("attn_scores", layer) for layer in layers])
    with torch.no_grad():
        attentions = hf(torch.tensor([ids]), output_attentions=True).attentions
    layer_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * len(layers)
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    for layer in layers:
        scores = got[Address("attn_scores", layer)]
        assert rel_diff(scores.softmax(-1), attentions[layer][0]) <= 1e-6, layer
        masked = (k > q) | ((k <= q - window) if layer_types[layer] == "sliding_attention" else False)
        assert torch.equal(scores.isinf(), masked.expand_as(scores)), layer
        assert bool((scores[~masked.expand_as(scores)] > float("-inf")).all())


# -- writing -----------------------------------------------------------------------------------


def _vector(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@contextmanager
def _edit_at(
    family: str, hf: Any, parts: Parts, kind: str, layer: int, edit: Callable[[torch.Tensor], None]
) -> Iterator[None]:
    """Call ``edit(rows)`` on HF's value of ``kind`` at ``layer`` (``rows``: ``[tokens, width]`` or
    ``[tokens, heads, d_head]``, a view into a copy that replaces the original)."""
    block = _layer(hf, family, layer)
    config = hf.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        if kind in QK_KINDS:
            return _heads_view(x, parts.qk_layout, heads if kind.startswith("q") else kv_heads, d)[0]
        if kind in ("mlp_pre", "mlp_pre_linear") and parts.fused:
            x = x.chunk(2, dim=-1)[kind == "mlp_pre_linear"]
        return x.reshape(-1, x.shape[-1]) if x.dim() == 2 else x[0]  # OPT's fc1 sees [tokens, width]

    def post(module: Any, args: Any, output: Any) -> Any:
        value = _first(output).clone()
        edit(rows_of(value))
        return (value, *output[1:]) if isinstance(output, tuple) else value

    def pre(module: Any, args: Any, kwargs: Any) -> Any:
        value = _hidden(args, kwargs).clone()
        edit(rows_of(value))
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    if kind == "attn_in":
        handle = _get(block, parts.attn).register_forward_pre_hook(pre, with_kwargs=True)
    elif kind == "mlp_in":
        handle = _get(block, parts.mlp).register_forward_pre_hook(pre, with_kwargs=True)
    elif kind in QK_KINDS:
        norm = _get(block, parts.q_norm if kind.startswith("q") else parts.k_norm)
        handle = (
            norm.register_forward_pre_hook(pre, with_kwargs=True)
            if kind.endswith("_in")
            else norm.register_forward_hook(post)
        )
    else:
        path = {
            "mlp_pre": parts.gate,
            "mlp_pre_linear": parts.up,
            "attn_out_post": parts.post_attn_norm,
            "mlp_out_post": parts.post_mlp_norm,
        }[kind]
        handle = _get(block, path).register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _spec_and_edit(model: Any, kind: str, n: int, seed: int) -> tuple[SteeringSpec, Callable[[torch.Tensor], None]]:
    """add (scaled, at two positions), set (one row per position) and ablate, in this order; at
    head kinds each on chosen heads."""
    point = Address(kind, 1)
    info = model.info
    if kind in QK_KINDS:
        n_heads, d = (info.n_heads if kind.startswith("q") else info.n_kv_heads), info.d_head
        last = n_heads - 1
        added, rows, direction = _vector(d, seed=seed), _vector(2, 1, d, seed=seed + 1), _vector(d, seed=seed + 2)
        writes = [
            Write(point, added, op="add", scale=1.5, heads=[0], positions=[1, -1]),
            Write(point, rows, op="set", heads=[1], positions=[0, 2]),
            Write(point, direction, op="ablate", heads=[0, last]),
        ]
        unit = direction / direction.norm()

        def edit_heads(x: torch.Tensor) -> None:
            for pos in (1, n - 1):
                x[pos, 0] += 1.5 * added
            x[0, 1], x[2, 1] = rows[0, 0], rows[1, 0]
            for head in (0, last):
                x[:, head] -= (x[:, head] @ unit).unsqueeze(-1) * unit

        return SteeringSpec(writes), edit_heads
    width = info.d_mlp if kind.startswith("mlp_pre") else info.d_model
    added, rows, direction = _vector(width, seed=seed), _vector(2, width, seed=seed + 1), _vector(width, seed=seed + 2)
    writes = [
        Write(point, added, op="add", scale=1.5, positions=[1, -1]),
        Write(point, rows, op="set", positions=[0, 2]),
        Write(point, direction, op="ablate"),
    ]
    unit = direction / direction.norm()

    def edit(x: torch.Tensor) -> None:
        for pos in (1, n - 1):
            x[pos] += 1.5 * added
        x[0], x[2] = rows[0], rows[1]
        x -= (x @ unit).unsqueeze(-1) * unit

    return SteeringSpec(writes), edit


def _check_writes(model: Any, family: str, hf: Any, parts: Parts, kinds: list[str]) -> None:
    sync = sync_model(model)
    ids = _ids(family, 8, seed=7)
    with torch.no_grad():
        plain = hf(torch.tensor([ids])).logits[0]
    for i, kind in enumerate(kinds):
        spec, edit = _spec_and_edit(model, kind, len(ids), seed=10 * i)
        got = sync.capture(ids, ["logits", Address(kind, 1)], steering_spec=spec)
        seen: dict[str, torch.Tensor] = {}

        def edit_and_keep(x: torch.Tensor, edit: Callable[[torch.Tensor], None] = edit, seen: dict = seen) -> None:
            edit(x)
            seen["value"] = x.clone()

        with _edit_at(family, hf, parts, kind, 1, edit_and_keep), torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        assert rel_diff(got[Address("logits")], expected) <= TOL, (family, kind)
        assert rel_diff(got[Address(kind, 1)], seen["value"]) <= TOL, (
            family,
            kind,
        )  # the value read is the written one
        assert rel_diff(expected, plain) > 1e-3, (family, kind)  # the write mattered


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_writes_at_the_new_points_match_an_oracle_hook(family: str) -> None:
    model = eager_model(family)
    points = model.points()
    kinds = [k for k in NEW_KINDS if k in points and points[k].writable]
    assert "attn_scores" not in kinds and "logits_raw" not in kinds
    _check_writes(model, family, hf_oracle(family), PARTS[family], kinds)


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2"])
def test_a_resid_mid_write_is_exact_on_sandwich_and_plain_families(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    ids = _ids(family, 8, seed=8)
    vector = _vector(model.info.d_model, seed=9)
    base = sync.capture(ids, ["resid_mid.1", "resid_post.1"])
    spec = SteeringSpec([Write("resid_mid.1", vector, op="add", scale=2.0)])
    steered = sync.capture(ids, ["resid_mid.1", "logits"], steering_spec=spec)
    assert rel_diff(steered[Address("resid_mid", 1)], base[Address("resid_mid", 1)] + 2.0 * vector) <= TOL
    parts = PARTS[family]
    hf = hf_oracle(family)
    # the residual after attention is what the post-attention norm (sandwich) or the attention adds
    module = _get(_layer(hf, family, 1), parts.post_attn_norm or parts.attn)

    def hook(mod: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + 2.0 * vector, *output[1:])
        return output + 2.0 * vector

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    assert rel_diff(steered[Address("logits")], expected) <= TOL


# -- during generation and in batches ----------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "olmo2", "gptj", "opt", "phi3"])
def test_new_points_during_generation_equal_one_forward_over_the_final_sequence(family: str) -> None:
    model = eager_model(family)
    served = model.points()
    kinds = [k for k in NEW_KINDS if k in served and served[k].per_layer]
    points = [f"{k}.1" for k in kinds] + ["logits_raw"]
    ids = _ids(family, 6, seed=11)
    completion, cache = capture_generation(model, [ids], points, max_tokens=4, ignore_eos=True)
    whole = run_with_cache(model, [ids + completion.token_ids], points)
    for point in points:
        got, want = cache[point], whole[point]
        assert got.shape == want.shape, point
        _compare(got, want, point)  # attn_scores: the keys a step had not made yet are masked, -inf


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_batched_scores_equal_solo_runs(family: str) -> None:
    model = eager_model(family)
    texts = ["Hello", PROMPT]
    points = ["attn_scores.1", "mlp_pre.0", "logits_raw"]
    cache = run_with_cache(model, texts, points)
    for row, text in enumerate(texts):
        n = len(model.to_tokens(text)[0])
        solo = run_with_cache(model, text, points)
        for point in points:
            got = cache[point][row]
            if point.startswith("attn_scores"):
                _compare(got[:, :n, :n], solo[point][0], point)
                # right-padding is masked, -inf (as the core's pad_rows pads scores)
                assert bool((got[:, n:] == float("-inf")).all() and (got[:, :, n:] == float("-inf")).all())
            else:
                assert rel_diff(got[:n], solo[point][0]) <= TOL, point
                assert not got[n:].any()


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "kind"),
    [("gpt2", "mlp_pre_linear"), ("llama", "q_norm_out"), ("llama", "attn_out_post"), ("opt", "mlp_out_post")],
)
async def test_a_kind_the_family_lacks_is_a_typed_error(family: str, kind: str) -> None:
    model = eager_model(family)
    ids = _ids(family, 5)
    served = set(model.points())
    with pytest.raises(KindNotInFamily, match=rf"{family}.*{kind}") as caught:
        await model.capture(ids, [f"{kind}.1"])
    assert set(caught.value.valid) == served and caught.value.address == Address(kind, 1)
    assert "mlp_pre" in str(caught.value)  # the message lists what the model serves
    width = model.info.d_head if kind in QK_KINDS else model.info.d_model
    write = Write(f"{kind}.0", torch.zeros(width), heads=[0] if kind in QK_KINDS else None)
    with pytest.raises(KindNotInFamily):
        await model.capture(ids, ["logits"], steering_spec=SteeringSpec([write]))


async def test_read_only_points_refuse_writes() -> None:
    model = eager_model("llama")
    ids = _ids("llama", 5)
    for point, width in (("attn_scores.1", 4), ("logits_raw", model.info.vocab_size)):
        with pytest.raises((InvalidSteering, UnsupportedAddress), match=point.split(".")[0]):
            await model.capture(ids, ["logits"], steering_spec=SteeringSpec([Write(point, torch.zeros(width))]))
    # nothing was left behind: a plain capture is the plain model
    plain = await model.capture(ids, ["logits_raw", "logits"])
    assert torch.equal(plain[Address("logits_raw")], plain[Address("logits")])  # llama has no soft-cap


def test_logits_raw_is_before_the_final_soft_cap() -> None:
    model = eager_model("gemma2")
    cap = model.hf_model.config.final_logit_softcapping
    assert cap
    got = sync_model(model).capture(_ids("gemma2"), ["logits_raw", "logits"])
    raw = got[Address("logits_raw")]
    assert rel_diff(torch.tanh(raw / cap) * cap, got[Address("logits")]) <= TOL
    assert not torch.allclose(raw, got[Address("logits")])
    assert math.isfinite(float(raw.abs().max()))
