"""The eager backend's breadth sweep: model types it resolves from their module tree, against HF.

For each model type of ``interp_testkit.suite.SWEEP_FAMILIES`` (tiny random-weight models from
``interp_testkit``): every address the loaded model serves, at the first, second and last layer,
equals HF's own intermediate read by hooks written here from this file's own table of where each
model keeps its parts (:data:`WHERE`; no code shared with the backend); the residual identities
hold; greedy generation equals HF's; a write at every writable kind equals the same edit made by
a hand-written hook on HF; on mixtures of experts, the router points equal what HF's router
returns, and steering ``router_logits`` reroutes exactly like the same edit made inside HF's router.

Each model type's outcome is written to ``.cache/family-results/eager/<model_type>.json`` by the
last test of this module (:func:`test_result_file`), once every check of that type has passed.
Every model type's tiny default config resolves; ``interp_testkit.suite.REFUSED_VARIANTS`` are config variants
refused with an ``UnsupportedArchitecture`` that says why.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    KindNotInFamily,
    SteeringSpec,
    UnsupportedAddress,
    UnsupportedArchitecture,
    Write,
    capture_generation,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import (
    ALL_FAMILIES,
    REFUSED_VARIANTS,
    ROOT,
    SWEEP_FAMILIES,
    SWEEP_MOE,
    hf_oracle,
    rel_diff,
    tiny_model_path,
)

from ..support.engines import eager_model

TOL = 1e-4
RESULTS = ROOT / ".cache" / "family-results" / "eager"
CHECKS = ("addresses", "points", "identities", "generation", "capture_generation", "writes")
MOE_CHECKS = ("router_steering",)
_PASSED: dict[str, set[str]] = defaultdict(set)
_KINDS: dict[str, set[str]] = defaultdict(set)


# -- the oracle's own table of where HF keeps each part ---------------------------------------


@dataclass(frozen=True)
class Where:
    """Paths in an HF model (``layers``) and relative to one of its decoder layers."""

    layers: str = "model.layers"
    attn: str = "self_attn"
    o_proj: str = "o_proj"
    v: str = "v_proj"
    v_layout: str = "v"  # "v", "q|k|v" (values last), "per-head" ([q k v] per head)
    attn_norm: str | None = "input_layernorm"  # its output is the attention's input (None: the residual)
    mlp_norm: str | None = "post_attention_layernorm"  # its output is the MLP's input (None: the MLP's input)
    mlp: str = "mlp"
    mlp_out: str = "mlp"
    gate: str | None = "mlp.gate_proj"
    up: str | None = "mlp.up_proj"
    fused: bool = False  # gate and up are the halves of ``gate``'s output
    down: str | None = "mlp.down_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    qk_layout: str = "heads x tokens"
    post_attn: str | None = None
    post_mlp: str | None = None
    router: str | None = None  # returns (logits, weights, indices)
    router_weight: str | None = None  # the weight the router's logits are computed with
    attn_out: str | None = None  # the module whose output is attn_out, where the attention adds the residual


_SANDWICH = {
    "attn_norm": None,
    "mlp_norm": None,
    "post_attn": "post_attention_layernorm",
    "post_mlp": "post_feedforward_layernorm",
}
_NO_GATE = {"up": None}


def _moe(router: str = "mlp.gate", weight: str | None = None, **kw: Any) -> Where:
    return Where(gate=None, up=None, down=None, router=router, router_weight=weight or f"{router}.weight", **kw)


WHERE: dict[str, Where] = {
    # the families the eager backend served before structural resolution (also in test_eager_parity)
    "gpt2": Where(
        layers="transformer.h",
        attn="attn",
        o_proj="c_proj",
        v="c_attn",
        v_layout="q|k|v",
        attn_norm="ln_1",
        mlp_norm="ln_2",
        gate="mlp.c_fc",
        down="mlp.c_proj",
        **_NO_GATE,
    ),
    "gptj": Where(
        layers="transformer.h",
        attn="attn",
        o_proj="out_proj",
        attn_norm="ln_1",
        mlp_norm="ln_1",
        gate="mlp.fc_in",
        down="mlp.fc_out",
        **_NO_GATE,
    ),
    "gpt_neox": Where(
        layers="gpt_neox.layers",
        attn="attention",
        o_proj="dense",
        v="query_key_value",
        v_layout="per-head",
        gate="mlp.dense_h_to_4h",
        down="mlp.dense_4h_to_h",
        **_NO_GATE,
    ),
    "opt": Where(
        layers="model.decoder.layers",
        o_proj="out_proj",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        mlp="fc1",
        mlp_out="fc2",
        gate="fc1",
        down="fc2",
        **_NO_GATE,
    ),
    "phi": Where(o_proj="dense", mlp_norm="input_layernorm", gate="mlp.fc1", down="mlp.fc2", **_NO_GATE),
    "phi3": Where(v="qkv_proj", v_layout="q|k|v", gate="mlp.gate_up_proj", up="mlp.gate_up_proj", fused=True),
    "llama": Where(),
    "mistral": Where(),
    "qwen2": Where(),
    "qwen3": Where(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="tokens x heads"),
    "gemma": Where(),
    "gemma2": Where(
        mlp_norm="pre_feedforward_layernorm",
        post_attn="post_attention_layernorm",
        post_mlp="post_feedforward_layernorm",
    ),
    "gemma3_text": Where(
        mlp_norm="pre_feedforward_layernorm",
        post_attn="post_attention_layernorm",
        post_mlp="post_feedforward_layernorm",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    ),
    "olmo2": Where(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="flat", **_SANDWICH),
    "stablelm": Where(),
    # the breadth sweep
    "apertus": Where(
        attn_norm="attention_layernorm",
        mlp_norm="feedforward_layernorm",
        gate="mlp.up_proj",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        **_NO_GATE,
    ),
    "arcee": Where(gate="mlp.up_proj", **_NO_GATE),
    "biogpt": Where(
        layers="biogpt.layers",
        o_proj="out_proj",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        mlp="fc1",
        mlp_out="fc2",
        gate="fc1",
        down="fc2",
        **_NO_GATE,
    ),
    "cohere": Where(mlp_norm="input_layernorm"),  # parallel blocks sharing one norm
    "cohere2": Where(mlp_norm="input_layernorm"),
    "ernie4_5": Where(),
    "exaone4": Where(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_SANDWICH),
    "glm": Where(gate="mlp.gate_up_proj", up="mlp.gate_up_proj", fused=True),
    "glm4": Where(
        gate="mlp.gate_up_proj",
        up="mlp.gate_up_proj",
        fused=True,
        post_attn="post_self_attn_layernorm",  # post_attention_layernorm is the pre-MLP norm here
        post_mlp="post_mlp_layernorm",
    ),
    "gpt_bigcode": Where(
        layers="transformer.h",
        attn="attn",
        o_proj="c_proj",
        v="c_attn",
        v_layout="q|k|v",
        attn_norm="ln_1",
        mlp_norm="ln_2",
        gate="mlp.c_fc",
        down="mlp.c_proj",
        **_NO_GATE,
    ),
    "granite": Where(),
    "helium": Where(),
    "hunyuan_v1_dense": Where(q_norm="self_attn.query_layernorm", k_norm="self_attn.key_layernorm"),
    "ministral": Where(),
    "nemotron": Where(gate="mlp.up_proj", **_NO_GATE),
    "gpt_neo": Where(
        layers="transformer.h",
        attn="attn",
        o_proj="attention.out_proj",
        v="attention.v_proj",
        attn_norm="ln_1",
        mlp_norm="ln_2",
        gate="mlp.c_fc",
        down="mlp.c_proj",
        **_NO_GATE,
    ),
    "olmo": Where(),
    "olmo3": Where(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="flat", **_SANDWICH),
    "persimmon": Where(
        o_proj="dense",
        v="query_key_value",
        v_layout="per-head",
        gate="mlp.dense_h_to_4h",
        down="mlp.dense_4h_to_h",
        q_norm="self_attn.q_layernorm",
        k_norm="self_attn.k_layernorm",
        qk_layout="tokens x heads",
        **_NO_GATE,
    ),
    "seed_oss": Where(),
    "smollm3": Where(),
    "starcoder2": Where(gate="mlp.c_fc", down="mlp.c_proj", **_NO_GATE),
    # attention computed in the attention module's own forward (see OWN_ATTENTION), ALiBi or rotary
    "bloom": Where(  # its attention and MLP add the residual to their own outputs
        layers="transformer.h",
        attn="self_attention",
        attn_out="self_attention.dense",
        o_proj="dense",
        v="query_key_value",
        v_layout="per-head",
        mlp_out="mlp.dense_4h_to_h",
        gate="mlp.dense_h_to_4h",
        down="mlp.dense_4h_to_h",
        **_NO_GATE,
    ),
    "falcon": Where(  # the tiny config: multi-query, parallel attention and MLP sharing one norm, rotary
        layers="transformer.h",
        attn="self_attention",
        o_proj="dense",
        v="query_key_value",
        v_layout="q|k|v",
        mlp_norm="input_layernorm",
        gate="mlp.dense_h_to_4h",
        down="mlp.dense_4h_to_h",
        **_NO_GATE,
    ),
    "mpt": Where(
        layers="transformer.blocks",
        attn="attn",
        o_proj="out_proj",
        v="Wqkv",
        v_layout="q|k|v",
        attn_norm="norm_1",
        mlp_norm="norm_2",
        mlp="ffn",
        mlp_out="ffn.down_proj",  # its MLP adds the residual to its own output
        gate="ffn.up_proj",
        down="ffn.down_proj",
        **_NO_GATE,
    ),
    "xglm": Where(
        o_proj="out_proj",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        mlp="fc1",
        mlp_out="fc2",
        gate="fc1",
        down="fc2",
        **_NO_GATE,
    ),
    "codegen": Where(  # an own _attn method; qkv_proj holds [q | v | k] in 4 model-parallel groups
        layers="transformer.h",
        attn="attn",
        o_proj="out_proj",
        v="qkv_proj",
        v_layout="codegen",
        attn_norm="ln_1",
        mlp_norm="ln_1",
        gate="mlp.fc_in",
        down="mlp.fc_out",
        **_NO_GATE,
    ),
    # norms inside the sublayers: attn_z is what attn_sub_norm receives, mlp_post what ffn_sub_norm does
    "bitnet": Where(o_proj="attn_sub_norm", down="mlp.ffn_sub_norm"),
    # mixtures of experts
    "ernie4_5_moe": _moe(),  # layer 0 is dense (moe_layer_start_index 1): see _dense_at
    "flex_olmo": _moe(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="flat", **_SANDWICH),
    "hunyuan_v1_moe": _moe(
        weight="mlp.gate.wg.weight", q_norm="self_attn.query_layernorm", k_norm="self_attn.key_layernorm"
    ),
    "gpt_oss": _moe(router="mlp.router"),  # and a learned sink logit per head: see SINKS
    "mixtral": _moe(),
    "olmoe": _moe(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="flat"),
    "phimoe": _moe(router="mlp.router"),
    "qwen2_moe": _moe(),
    "qwen3_moe": _moe(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_layout="tokens x heads"),
}
ALIBI_FROM_LAST_KEY = {"mpt"}
"""ALiBi biases counted back from the last key (MPT): the scores its softmax sees for a query shift
by a constant per row when more keys follow (a padded batch, a longer sequence); patterns do not."""
SINKS = {"gpt_oss"}
"""Attention that also normalises over a per-head sink logit: no attn_scores (the softmax over the
keys' scores is not the pattern); its pattern rows sum to less than 1."""
DENSE_MLP = {"ernie4_5_moe": Where()}
"""The dense MLP of the models whose first layers are dense (where the layer has no router)."""

PER_HEAD = {"attn_q", "attn_k", "attn_v", "attn_z", "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"}
MOE_KINDS = {"router_logits", "expert_indices", "expert_weights"}
DENSE_MLP_KINDS = {"mlp_pre", "mlp_gate_act", "mlp_pre_linear", "mlp_post"}
BASE_KINDS = {
    "embed",
    "resid_pre",
    "resid_mid",
    "resid_post",
    "attn_in",
    "attn_out",
    "attn_pattern",
    "attn_scores",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_z",
    "mlp_in",
    "mlp_out",
    "final_norm",
    "logits",
    "logits_raw",
}


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _has(root: Any, path: str | None) -> bool:
    if path is None:
        return False
    try:
        _get(root, path)
    except AttributeError:
        return False
    return True


def _block(hf: Any, family: str, layer: int) -> Any:
    return _get(hf, WHERE[family].layers)[layer]


_VARIANT_WHERE: dict[int, Where] = {}
"""The table of a config variant's HF model (by ``id``), where it differs from its family's."""


def _where_at(hf: Any, family: str, layer: int) -> Where:
    """The table for ``layer``: a layer without the router has the family's dense MLP."""
    where = _VARIANT_WHERE.get(id(hf), WHERE[family])
    if where.router is not None and not _has(_block(hf, family, layer), where.router):
        dense = DENSE_MLP[family]
        return Where(**{**where.__dict__, "gate": dense.gate, "up": dense.up, "down": dense.down, "router": None})
    return where


def _expected_kinds(family: str) -> set[str]:
    where = WHERE[family]
    kinds = set(BASE_KINDS)
    dense = where.router is None or family in DENSE_MLP
    if dense:
        kinds |= {"mlp_pre", "mlp_post"}
        if (DENSE_MLP.get(family) or where).up is not None:
            kinds |= {"mlp_pre_linear", "mlp_gate_act"}
    if where.router is not None:
        kinds |= MOE_KINDS
    if where.q_norm is not None:
        kinds |= {"q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"}
    if where.post_attn is not None:
        kinds |= {"attn_out_post", "mlp_out_post"}
    if family in SINKS:
        kinds.discard("attn_scores")
    return kinds


def _shape(hf: Any) -> tuple[int, int, int]:
    config = hf.config
    heads = int(config.num_attention_heads)
    kv = getattr(config, "num_key_value_heads", None)
    if getattr(config, "multi_query", False):
        kv = 1
    d = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if getattr(config, "new_decoder_architecture", False):  # Falcon's grouped key/value heads
        kv = config.num_kv_heads
    return heads, int(kv or heads), d


def _first(output: Any) -> torch.Tensor:
    value: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return value


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    value: torch.Tensor = args[0] if args else kwargs["hidden_states"]
    return value


def _values_of(out: torch.Tensor, layout: str, heads: int, kv: int, d: int) -> torch.Tensor:
    """The values ``[tokens, kv, d]`` in the output ``[1, tokens, width]`` of the value source."""
    out = out[0]
    if layout == "q|k|v":
        return out[:, (heads + kv) * d :].unflatten(-1, (kv, d))
    if layout == "per-group":  # [q ... q k v] per key/value head
        return out.unflatten(-1, (kv, heads // kv + 2, d))[:, :, -1]
    if layout == "codegen":  # 4 groups of [q | v | k], each of heads / 4 heads
        return out.unflatten(-1, (4, 3, heads // 4, d))[:, :, 1].flatten(1, 2)
    if layout == "per-head":
        return out.unflatten(-1, (heads, 3 * d))[..., 2 * d :]
    return out.unflatten(-1, (kv, d))


def _heads_of(x: torch.Tensor, layout: str, heads: int, d: int) -> torch.Tensor:
    """``[tokens, heads, d]`` of a tensor a q/k norm sees (batch 1)."""
    if layout == "flat":
        return x[0].unflatten(-1, (heads, d))
    if layout == "heads x tokens":
        return x[0].transpose(0, 1)
    return x[0]


OWN_ATTENTION = {"bloom", "falcon", "mpt", "xglm"}
"""Families whose attention module computes attention in its own forward: the oracle recomputes
queries, keys and the scores its softmax sees from the projections' outputs and the arguments
(ALiBi biases, masks, rotary tables) the attention module receives."""


def _own_attention(hf: Any, attn: Any, projected: dict[str, torch.Tensor], kw: dict[str, Any]) -> dict[str, Any]:
    """Queries and keys ``[batch, heads, tokens, d]`` and the scores ``[batch, heads, q, k]`` (masked:
    ``-inf``) of one call of an own-forward attention (:data:`OWN_ATTENTION`), in float64."""
    config = hf.config
    family = config.model_type
    heads, kv, d = _shape(hf)
    mask = kw.get("attention_mask")
    if family == "bloom":  # [q k v] per head; alibi + q k^T / sqrt(d), then the float mask
        qkv = projected["query_key_value"].unflatten(-1, (heads, 3, d)).double()
        q, k = qkv[..., 0, :].transpose(1, 2), qkv[..., 1, :].transpose(1, 2)
        alibi = kw["alibi"].double().view(q.shape[0], heads, 1, -1)
        scores = q @ k.transpose(-1, -2) * attn.inv_norm_factor + alibi + mask.double()
        masked = mask <= torch.finfo(mask.dtype).min
    elif family == "falcon":
        out = projected["query_key_value"].double()
        if config.new_decoder_architecture:
            groups = out.unflatten(-1, (kv, heads // kv + 2, d))
            q, k = groups[:, :, :, :-2].flatten(2, 3), groups[:, :, :, -2]
        elif config.multi_query:
            flat = out.unflatten(-1, (heads + 2, d))
            q, k = flat[:, :, :heads], flat[:, :, heads : heads + 1]
        else:
            per_head = out.unflatten(-1, (heads, 3, d))
            q, k = per_head[..., 0, :], per_head[..., 1, :]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if kw.get("alibi") is None:  # rotary; scores / sqrt(d) + mask
            cos, sin = (t.double() for t in kw["position_embeddings"])
            q, k = type(attn).forward.__globals__["apply_rotary_pos_emb"](q, k, cos, sin)
            scores = q @ k.repeat_interleave(heads // k.shape[1], 1).transpose(-1, -2) / d**0.5 + mask.double()
        else:  # (q k^T + alibi) / sqrt(d) + mask (which also holds alibi / sqrt(d))
            alibi = kw["alibi"].double().view(q.shape[0], heads, 1, -1)
            raw = q @ k.repeat_interleave(heads // k.shape[1], 1).transpose(-1, -2)
            scores = (raw + alibi) * attn.inv_norm_factor + mask.double()
        masked = mask <= torch.finfo(mask.dtype).min
    elif family == "mpt":  # q k^T * softmax_scale + the ALiBi position bias; mask True where masked
        q, k, _ = (t.unflatten(-1, (heads, d)).transpose(1, 2).double() for t in projected["Wqkv"].chunk(3, dim=-1))
        bias = kw["position_bias"].double()
        n = q.shape[2]
        scores = q @ k.transpose(-1, -2) * attn.softmax_scale + bias[:, bias.shape[1] - n :, bias.shape[2] - n :]
        masked = mask
    else:  # xglm: the queries are scaled before the product; + the float mask
        q = (projected["q_proj"] * attn.scaling).unflatten(-1, (heads, d)).transpose(1, 2).double()
        k = projected["k_proj"].unflatten(-1, (heads, d)).transpose(1, 2).double()
        scores = q @ k.transpose(-1, -2) + mask.double()
        masked = mask <= torch.finfo(mask.dtype).min
    scores = scores.masked_fill(masked, float("-inf"))
    return {"q": q.float(), "k": k.float(), "direct": scores.float()}


@contextmanager
def _attention_call(hf: Any, attn: Any) -> Iterator[dict[str, Any]]:
    """What HF's eager attention function receives for module ``attn`` (GPT-J: its ``_attn``
    method, which divides ``q @ k^T`` by ``scale_attn`` in float32)."""
    seen: dict[str, Any] = {}
    if hf.config.model_type in OWN_ATTENTION:
        projected: dict[str, torch.Tensor] = {}
        given: dict[str, Any] = {}
        handles = []
        for name in ("query_key_value", "Wqkv", "q_proj", "k_proj"):
            if hasattr(attn, name):
                hook = lambda m, a, o, name=name: projected.__setitem__(name, o)  # noqa: E731
                handles.append(getattr(attn, name).register_forward_hook(hook))
        handles.append(attn.register_forward_pre_hook(lambda m, a, kw: given.update(kw), with_kwargs=True))
        handles.append(attn.register_forward_hook(lambda m, a, o: seen.update(_own_attention(hf, m, projected, given))))
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()
        return
    if hf.config.model_type == "codegen":  # its own _attn: (q k^T + mask) / scale_attn, in float32
        method = attn._attn

        def codegen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None) -> Any:
            scores = (query.double() @ key.double().transpose(-1, -2) + mask.double()) / attn.scale_attn
            scores = scores.masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))
            seen.update(q=query.clone(), k=key.clone(), direct=scores.float())
            return method(query, key, value, mask)

        attn.__dict__["_attn"] = codegen
        try:
            yield seen
        finally:
            del attn.__dict__["_attn"]
        return
    if hf.config.model_type == "gptj":
        method = attn._attn

        def own(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None) -> Any:
            seen.update(q=query.clone(), k=key.clone(), mask=mask, scaling=1.0 / float(attn.scale_attn), softcap=None)
            return method(query, key, value, mask)

        attn.__dict__["_attn"] = own
        try:
            yield seen
        finally:
            del attn.__dict__["_attn"]
        return
    if hf.config.model_type == "gpt_neo":  # its inner attention's _attn: unscaled, its own causal/local band
        inner = attn.attention
        method = inner._attn

        def neo(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None) -> Any:
            scores = query.float() @ key.float().transpose(-1, -2)
            n_q, n_k = query.shape[-2], key.shape[-2]
            band = inner.bias[:, :, n_k - n_q : n_k, :n_k]
            scores = scores.masked_fill(~band, float("-inf"))
            if mask is not None:
                scores = scores.masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))
            seen.update(q=query.clone(), k=key.clone(), direct=scores)
            return method(query, key, value, mask)

        inner.__dict__["_attn"] = neo
        try:
            yield seen
        finally:
            del inner.__dict__["_attn"]
        return
    namespace = type(attn).forward.__globals__
    original = namespace["eager_attention_forward"]

    def function(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any) -> Any:
        if module is attn:
            seen.update(q=query.clone(), k=key.clone(), mask=mask, scaling=kw.get("scaling"), softcap=kw.get("softcap"))
        return original(module, query, key, value, mask, **kw)

    namespace["eager_attention_forward"] = function
    try:
        yield seen
    finally:
        namespace["eager_attention_forward"] = original


def _scores(call: dict[str, Any]) -> torch.Tensor:
    """Pre-softmax scores ``[heads, q, k]`` from what HF's attention function received."""
    if "direct" in call:
        direct: torch.Tensor = call["direct"][0]
        return direct
    q, k = call["q"][0].double(), call["k"][0].double()
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    scaling = call["scaling"] if call["scaling"] is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scaling
    if call["softcap"]:
        scores = call["softcap"] * torch.tanh(scores / call["softcap"])
    mask = call["mask"]
    n = scores.shape[-1]
    if mask is None:
        masked = torch.ones(n, n, dtype=torch.bool).triu(1)
    elif mask.dtype == torch.bool:
        masked = ~mask[0, 0, :, :n]
    else:
        masked = mask[0, 0, :, :n] <= torch.finfo(mask.dtype).min
    return scores.masked_fill(masked, float("-inf")).float()


def hf_values(family: str, ids: list[int], layer: int, hf: Any = None) -> dict[str, torch.Tensor]:
    """HF's own value of every kind at ``layer`` for one prompt, ``[tokens, ...]`` (of ``hf``, a
    config variant of ``family``'s model, where given)."""
    hf = hf if hf is not None else hf_oracle(family)
    where = _where_at(hf, family, layer)
    block = _block(hf, family, layer)
    heads, kv, d = _shape(hf)
    got: dict[str, Any] = {}

    with ExitStack() as stack, torch.no_grad():

        def out(path: str, name: str, module: Any = None) -> None:
            def hook(m: Any, args: Any, output: Any) -> None:
                got[name] = output if name == "router" else _first(output).clone()

            target = module if module is not None else _get(block, path)
            stack.callback(target.register_forward_hook(hook).remove)

        def inp(path: str, name: str, module: Any = None) -> None:
            def hook(m: Any, args: Any, kwargs: Any) -> None:
                got[name] = _hidden(args, kwargs).clone()

            target = module if module is not None else _get(block, path)
            stack.callback(target.register_forward_pre_hook(hook, with_kwargs=True).remove)

        out("", "resid_post", module=block)
        if where.attn_norm:
            out(where.attn_norm, "attn_in")
        out(where.attn_out or where.attn, "attn_out")
        out(f"{where.attn}.{where.v}", "v_source")
        inp(f"{where.attn}.{where.o_proj}", "attn_z")
        if where.mlp_norm:
            out(where.mlp_norm, "mlp_in")
        else:
            inp(where.mlp, "mlp_in")
        out(where.mlp_out, "mlp_out")
        if where.gate is not None:
            out(where.gate, "gate")
        if where.up is not None and not where.fused:
            out(where.up, "mlp_pre_linear")
        if where.down is not None:
            inp(where.down, "mlp_post")
        if where.router is not None:
            out(where.router, "router")
        for norm, name in ((where.q_norm, "q_norm"), (where.k_norm, "k_norm")):
            if norm is not None:
                inp(norm, f"{name}_in")
                out(norm, f"{name}_out")
        if where.post_attn is not None and where.post_mlp is not None:
            out(where.post_attn, "attn_out_post")
            out(where.post_mlp, "mlp_out_post")
        out("", "logits_raw", module=hf.get_output_embeddings())
        call = stack.enter_context(_attention_call(hf, _get(block, where.attn)))
        result = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    hidden = result.hidden_states
    values: dict[str, torch.Tensor] = {
        "embed": hidden[0][0],
        "resid_pre": hidden[layer][0],
        "resid_post": got["resid_post"][0],
        "attn_in": got["attn_in"][0] if "attn_in" in got else hidden[layer][0],
        "attn_out": got["attn_out"][0],
        "attn_pattern": result.attentions[layer][0],
        "attn_scores": _scores(call),
        "attn_q": call["q"][0].transpose(0, 1),
        "attn_k": call["k"][0].transpose(0, 1),
        "attn_v": _values_of(got["v_source"], where.v_layout, heads, kv, d),
        "attn_z": got["attn_z"][0].unflatten(-1, (heads, d)),
        "mlp_in": got["mlp_in"].reshape(len(ids), -1),
        "mlp_out": got["mlp_out"].reshape(len(ids), -1),
        "final_norm": hidden[-1][0],
        "logits": result.logits[0],
        "logits_raw": got["logits_raw"][0],
    }
    if "gate" in got:
        gate = got["gate"].reshape(len(ids), -1)
        values["mlp_pre"] = gate.chunk(2, dim=-1)[0] if where.fused else gate
        if where.fused:
            values["mlp_pre_linear"] = gate.chunk(2, dim=-1)[1]
    if "mlp_pre_linear" in got:
        values["mlp_pre_linear"] = got["mlp_pre_linear"].reshape(len(ids), -1)
    if "mlp_post" in got:
        values["mlp_post"] = got["mlp_post"].reshape(len(ids), -1)
    if "mlp_pre_linear" in values:  # a gated MLP: the config's activation of the gate
        values["mlp_gate_act"] = _activation(hf.config)(values["mlp_pre"])
    if "router" in got:
        logits, weights, indices = got["router"]
        values["router_logits"] = logits.reshape(len(ids), -1)
        values["expert_weights"] = weights.reshape(len(ids), -1)
        values["expert_indices"] = indices.reshape(len(ids), -1)
    for name, n in (("q_norm", heads), ("k_norm", kv)):
        for end in ("in", "out"):
            if f"{name}_{end}" in got:
                values[f"{name}_{end}"] = _heads_of(got[f"{name}_{end}"], where.qk_layout, n, d)
    if "attn_out_post" in got:
        values["attn_out_post"] = got["attn_out_post"][0]
        values["mlp_out_post"] = got["mlp_out_post"][0]
    values["resid_mid"] = values["resid_pre"] + values.get("attn_out_post", values["attn_out"])
    return values


def _activation(config: Any) -> Any:
    """The activation a config names for its MLP, from transformers' own registry."""
    from transformers.activations import ACT2FN

    name = next(
        value
        for key in ("hidden_act", "hidden_activation", "activation_function")
        if isinstance(value := getattr(config, key, None), str)
    )
    return ACT2FN[name]


def _ids(family: str, n: int = 10, seed: int = 0) -> list[int]:
    vocab = eager_model(family).info.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _compare(got: torch.Tensor, want: torch.Tensor, what: Any) -> None:
    if not want.is_floating_point():
        assert got.dtype == torch.int64 and torch.equal(got, want.to(torch.int64)), what
        return
    assert rel_diff(got, want) <= TOL, what


def _layers(model: Any) -> list[int]:
    return sorted({0, 1, model.info.n_layers - 1})


def _kinds_at(family: str, layer: int, served: set[str]) -> list[str]:
    where = _where_at(hf_oracle(family), family, layer)
    kinds = []
    for kind in sorted(served):
        if kind in MOE_KINDS and where.router is None:
            continue
        if kind in DENSE_MLP_KINDS and where.router is not None:
            continue
        kinds.append(kind)
    return kinds


# -- the sweep --------------------------------------------------------------------------------

EAGER_VERIFIED = ALL_FAMILIES + SWEEP_FAMILIES
sweep = pytest.mark.parametrize("family", EAGER_VERIFIED)


@sweep
def test_every_address_equals_hfs_own_value(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    ids = model.to_tokens("The quick brown fox jumps over the lazy dog because")[0].tolist()
    served = set(model.points())
    compared: set[str] = set()
    for layer in _layers(model):
        kinds = _kinds_at(family, layer, served)
        points = [Address(k, layer if model.points()[k].per_layer else None) for k in kinds]
        got = sync.capture(ids, points)
        want = hf_values(family, ids, layer)
        for point in points:
            _compare(got[point], want[point.kind], (family, str(point)))
            compared.add(point.kind)
        if "attn_scores" in served:  # softmax(attn_scores) is the attention pattern
            assert rel_diff(got[Address("attn_scores", layer)].softmax(-1), want["attn_pattern"]) <= 1e-6
    assert compared == served, served - compared
    _PASSED[family].add("addresses")
    _KINDS[family] = compared


@sweep
def test_points_are_what_the_model_has(family: str) -> None:
    model = eager_model(family)
    assert set(model.points()) == _expected_kinds(family)
    moe = WHERE[family].router is not None
    assert (model.info.n_experts, model.info.experts_per_token) == ((4, 2) if moe else (0, 0))
    if moe:
        assert model.points()["router_logits"].writable and not model.points()["expert_indices"].writable
    _PASSED[family].add("points")


@sweep
def test_residual_identities(family: str) -> None:
    model = eager_model(family)
    n = model.info.n_layers
    sandwich = "attn_out_post" in model.points()
    attn, mlp = ("attn_out_post", "mlp_out_post") if sandwich else ("attn_out", "mlp_out")
    points = [f"{k}.{layer}" for layer in range(n) for k in ("resid_pre", "resid_mid", "resid_post", attn, mlp)]
    cache = run_with_cache(model, "Once upon a time there was a village", points)
    for layer in range(n):
        pre, mid, post = (cache[f"{k}.{layer}"] for k in ("resid_pre", "resid_mid", "resid_post"))
        assert rel_diff(pre + cache[f"{attn}.{layer}"] + cache[f"{mlp}.{layer}"], post) <= TOL, layer
        assert rel_diff(mid + cache[f"{mlp}.{layer}"], post) <= TOL, layer
        if layer < n - 1:
            assert torch.equal(post, cache[f"resid_pre.{layer + 1}"])
    _PASSED[family].add("identities")


@sweep
def test_greedy_generation_matches_hf(family: str) -> None:
    model = eager_model(family)
    tokens = model.to_tokens("Once upon a time")
    completion = sync_model(model).generate(tokens[0].tolist(), max_tokens=10, ignore_eos=True)
    with torch.no_grad():
        out = hf_oracle(family).generate(
            tokens, max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=None
        )
    assert completion.token_ids == out[0, tokens.shape[1] :].tolist()
    assert len(set(completion.token_ids)) > 1  # the tiny model does not repeat one token
    _PASSED[family].add("generation")


@sweep
def test_capture_generation_equals_one_forward_over_the_final_sequence(family: str) -> None:
    model = eager_model(family)
    served = model.points()
    optional = ("router_logits", "expert_indices", "attn_scores")
    kinds = ["resid_post", "attn_k", "attn_v", "mlp_out", *(k for k in optional if k in served)]
    points = [f"{k}.1" for k in kinds] + ["logits_raw"]
    ids = _ids(family, 6, seed=11)
    completion, cache = capture_generation(model, [ids], points, max_tokens=4, ignore_eos=True)
    whole = run_with_cache(model, [ids + completion.token_ids], points)
    for point in points:
        if point.startswith("attn_scores") and family in ALIBI_FROM_LAST_KEY:  # shifted per row
            _compare(cache[point].softmax(-1), whole[point].softmax(-1), point)
        else:
            _compare(cache[point], whole[point], point)
    _PASSED[family].add("capture_generation")


# -- writes -------------------------------------------------------------------------------------


@contextmanager
def _hf_edit(family: str, kind: str, layer: int, vector: torch.Tensor, hf: Any = None) -> Iterator[None]:
    """Add ``vector`` to HF's value of ``kind`` at ``layer`` with a hook written here."""
    hf = hf if hf is not None else hf_oracle(family)
    where = _where_at(hf, family, layer)
    block = _block(hf, family, layer)

    def add(x: torch.Tensor) -> torch.Tensor:
        if kind == "mlp_pre" and where.fused:
            return x + torch.cat([vector, torch.zeros_like(vector)])
        if kind == "mlp_pre_linear" and where.fused:
            return x + torch.cat([torch.zeros_like(vector), vector])
        return x + vector

    def post(module: Any, args: Any, output: Any) -> Any:
        return (add(output[0]), *output[1:]) if isinstance(output, tuple) else add(output)

    def pre(module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            return (add(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": add(kwargs["hidden_states"])}

    sites: dict[str, tuple[Any, str]] = {
        "resid_pre": (block, "pre"),
        "resid_post": (block, "post"),
        "attn_in": (_get(block, where.attn), "pre"),
        "attn_out": (_get(block, where.attn_out or where.attn), "post"),
        # what the attention sublayer adds to the residual (its post-norm's output on sandwich models)
        "resid_mid": (_get(block, where.post_attn or where.attn_out or where.attn), "post"),
        "mlp_in": (_get(block, where.mlp), "pre"),
        "mlp_out": (_get(block, where.mlp_out), "post"),
    }
    if where.gate is not None:
        sites["mlp_pre"] = (_get(block, where.gate), "post")
    if where.up is not None:
        sites["mlp_pre_linear"] = (_get(block, where.up), "post")
    if where.down is not None:
        sites["mlp_post"] = (_get(block, where.down), "pre")
    if where.post_attn is not None and where.post_mlp is not None:
        sites["attn_out_post"] = (_get(block, where.post_attn), "post")
        sites["mlp_out_post"] = (_get(block, where.post_mlp), "post")
    module, when = sites[kind]
    if when == "pre":
        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        handle = module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


@sweep
def test_writes_equal_the_same_edit_by_a_hook_on_hf(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    points = model.points()
    layer = 1
    served_here = _kinds_at(family, layer, set(points))
    kinds = [k for k in served_here if points[k].writable and points[k].per_layer and k not in PER_HEAD | MOE_KINDS]
    assert {"resid_pre", "resid_mid", "attn_out", "mlp_in", "mlp_out", "resid_post"} <= set(kinds)
    ids = _ids(family, 8, seed=7)
    with torch.no_grad():
        plain = hf_oracle(family)(torch.tensor([ids])).logits[0]
    for i, kind in enumerate(kinds):
        width = model.info.d_mlp if kind in DENSE_MLP_KINDS else model.info.d_model
        vector = torch.randn(width, generator=torch.Generator().manual_seed(100 + i))
        spec = SteeringSpec([Write(Address(kind, layer), vector, op="add", scale=2.0)])
        got = sync.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]
        with _hf_edit(family, kind, layer, 2.0 * vector), torch.no_grad():
            want = hf_oracle(family)(torch.tensor([ids])).logits[0]
        assert rel_diff(got, want) <= TOL, (family, kind)
        assert rel_diff(want, plain) > 1e-3, (family, kind)  # the write mattered
    _PASSED[family].add("writes")


# -- mixtures of experts ---------------------------------------------------------------------------


@contextmanager
def _hf_router_edit(family: str, layer: int, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Edit the logits HF's router at ``layer`` computes, where it computes them: the result of the
    ``torch.nn.functional.linear`` call made with the router's weight, before softmax and top-k."""
    hf = hf_oracle(family)
    weight = _get(_block(hf, family, layer), WHERE[family].router_weight or "")
    functional = torch.nn.functional
    original = functional.linear

    def linear(x: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(x, w, *args, **kwargs)
        return edit(out) if w is weight else out

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = original


@pytest.mark.parametrize("family", SWEEP_MOE)
def test_steering_router_logits_reroutes_like_the_same_edit_in_hf(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    ids = _ids(family, 9, seed=5)
    layer = 1
    points = [Address(k, layer) for k in ("router_logits", "expert_indices", "expert_weights")] + [Address("logits")]
    plain = sync.capture(ids, points)
    # ablate the expert most tokens chose: its logit at -inf
    expert = int(plain[points[1]].flatten().mode().values)
    ablate = torch.zeros(model.info.n_experts)
    ablate[expert] = -torch.inf
    spec = SteeringSpec([Write(points[0], ablate, op="add")])
    got = sync.capture(ids, points, steering_spec=spec)
    with _hf_router_edit(family, layer, lambda logits: logits + ablate), torch.no_grad():
        want = hf_values(family, ids, layer)
    assert rel_diff(got[Address("logits")], want["logits"]) <= TOL
    for point in points[:3]:
        _compare(got[point], want[point.kind], point)
    assert not (got[points[1]] == expert).any()  # rerouted: nobody picks the ablated expert
    assert (plain[points[1]] == expert).any()
    assert rel_diff(got[Address("logits")], plain[Address("logits")]) > 1e-3
    # a set at some positions: the router's logits become the written rows there
    rows = torch.randn(2, model.info.n_experts, generator=torch.Generator().manual_seed(3)) * 4
    spec = SteeringSpec([Write(points[0], rows, op="set", positions=[2, 5])])
    got = sync.capture(ids, points, steering_spec=spec)

    def put(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[[2, 5]] = rows.to(logits.dtype)
        return logits

    with _hf_router_edit(family, layer, put), torch.no_grad():
        want = hf_values(family, ids, layer)
    assert rel_diff(got[Address("logits")], want["logits"]) <= TOL
    assert torch.equal(got[points[0]][[2, 5]], rows)
    _compare(got[points[1]], want["expert_indices"], "expert_indices")
    _PASSED[family].add("router_steering")


async def test_router_points_on_a_dense_model_and_mlp_hidden_on_moe_layers_are_typed_errors() -> None:
    dense, moe, mixed = eager_model("olmo"), eager_model("mixtral"), eager_model("ernie4_5_moe")
    with pytest.raises(KindNotInFamily, match="not a mixture of experts"):
        await dense.capture([5, 6, 7], [Address("router_logits", 0)])
    for kind in ("mlp_pre", "mlp_pre_linear", "mlp_post"):
        with pytest.raises(KindNotInFamily, match="mixture of experts"):
            await moe.capture([5, 6, 7], [Address(kind, 0)])
    # a model whose first layer is dense: the MLP hidden there, the router points on the others
    served = mixed.points()
    moe_layers = tuple(range(1, mixed.info.n_layers))
    assert served["router_logits"].layers == served["expert_weights"].layers == moe_layers
    assert served["mlp_post"].layers == (0,) and served["resid_post"].layers is None
    assert moe.points()["router_logits"].layers is None  # every layer a mixture of experts
    got = await mixed.capture([5, 6, 7], [Address("mlp_post", 0), Address("router_logits", 1)])
    assert got[Address("mlp_post", 0)].shape == (3, mixed.info.d_mlp)
    with pytest.raises(KindNotInFamily, match=r"layer 1 .* mixture of experts"):
        await mixed.capture([5, 6, 7], [Address("mlp_pre", 1)])
    with pytest.raises(KindNotInFamily, match=r"layer 0 .* dense MLP"):
        await mixed.capture([5, 6, 7], [Address("expert_indices", 0)])
    # gpt-oss's attention also normalises over a sink logit per head: no scores over the keys alone
    with pytest.raises(KindNotInFamily, match="sink logit"):
        await eager_model("gpt_oss").capture([5, 6, 7], [Address("attn_scores", 0)])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_router_points_of_a_padded_batch_equal_solo_runs(family: str) -> None:
    model = eager_model(family)
    rows = [_ids(family, 4, seed=1), _ids(family, 9, seed=2)]
    points = ["router_logits.1", "expert_indices.1", "expert_weights.2"]
    batch = run_with_cache(model, rows, points)
    for row, ids in enumerate(rows):
        solo = run_with_cache(model, [ids], points)
        for point in points:
            _compare(batch[point][row, : len(ids)], solo[point][0], point)
    assert bool((batch["expert_indices.1"][0, 4:] == -1).all())  # padding: no expert


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gemma2", "cohere", "mixtral", "gpt_neox", "olmo3", "bloom", "falcon", "codegen"])
def test_half_precision_resolves_to_the_same_table(family: str, dtype: torch.dtype) -> None:
    """Resolution compares tensors up to their dtype's rounding: the same table in half precision."""
    from transformers import AutoModelForCausalLM

    from interp_eager import resolve_family

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path(family), dtype=dtype)
    assert resolve_family(hf) == eager_model(family).family


def _variant(family: str, **overrides: Any) -> tuple[Any, Any]:
    """An eager model and its HF oracle for ``family``'s tiny config with ``overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from interp_eager import EagerModel
    from interp_testkit import randomize_weights

    path = tiny_model_path(family)
    config = AutoConfig.from_pretrained(path)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_weights(hf, seed=1)
    return EagerModel.from_hf(hf, AutoTokenizer.from_pretrained(path)), hf


VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # Falcon 40B/180B's layout: grouped key/value heads, each after the queries it serves in
    # query_key_value ([q q k v] per group), broadcast to every query head; two parallel norms
    "falcon-new-gqa": (
        "falcon",
        {"new_decoder_architecture": True, "num_kv_heads": 2},
        {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp", "v_layout": "per-group"},
    ),
    # the same with one key/value head and one shared norm
    "falcon-new-mqa": (
        "falcon",
        {"new_decoder_architecture": True, "num_kv_heads": 1, "num_ln_in_parallel_attn": 1},
        {},
    ),
    # Falcon-RW's layout: ALiBi, [q k v] per head, sequential blocks, biases
    "falcon-rw-alibi": (
        "falcon",
        {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        {"v_layout": "per-head", "mlp_norm": "post_attention_layernorm"},
    ),
    "falcon-alibi-mqa": ("falcon", {"alibi": True}, {}),  # ALiBi, multi-query, parallel
    "bloom-tied-8-heads": ("bloom", {"tie_word_embeddings": True, "n_head": 8}, {}),
    "mpt-8-heads": ("mpt", {"n_heads": 8}, {}),  # other ALiBi slopes
    "xglm-tied-unscaled": ("xglm", {"scale_embedding": False, "tie_word_embeddings": True}, {}),
    "codegen-8-heads-full-rotary": ("codegen", {"n_head": 8}, {}),  # 2 heads per model-parallel group
    "bitnet-mqa-bias": ("bitnet", {"num_key_value_heads": 1, "attention_bias": True}, {}),
}
"""Config variants of the families whose attention is read at its own products or whose layout is
unusual: ``(family, config overrides, oracle table overrides)``."""


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variants_equal_hf(name: str) -> None:
    """Every address at every layer equals HF's own value; softmax(attn_scores) is the pattern;
    greedy generation and a write at ``attn_out`` and ``resid_mid`` equal HF's; captures during
    generation (through the KV cache) equal one forward over the final sequence."""
    family, overrides, table = VARIANTS[name]
    model, hf = _variant(family, **overrides)
    _VARIANT_WHERE[id(hf)] = Where(**{**WHERE[family].__dict__, **table})
    try:
        sync = sync_model(model)
        ids = _ids(family, 9, seed=4)
        served = set(model.points())
        for layer in range(model.info.n_layers):
            kinds = _kinds_at(family, layer, served)
            points = [Address(k, layer if model.points()[k].per_layer else None) for k in kinds]
            got = sync.capture(ids, points)
            want = hf_values(family, ids, layer, hf=hf)
            for point in points:
                _compare(got[point], want[point.kind], (name, str(point)))
            assert rel_diff(got[Address("attn_scores", layer)].softmax(-1), want["attn_pattern"]) <= 1e-6
        tokens = torch.tensor([ids])
        completion = sync.generate(ids, max_tokens=8, ignore_eos=True)
        with torch.no_grad():
            out = hf.generate(tokens, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None)
        assert completion.token_ids == out[0, len(ids) :].tolist()
        points = ["attn_k.1", "attn_v.1", "attn_scores.1", "resid_post.1"]
        completion, cache = capture_generation(model, [ids], points, max_tokens=3, ignore_eos=True)
        whole = run_with_cache(model, [ids + completion.token_ids], points)
        for point in points:
            if point.startswith("attn_scores") and family in ALIBI_FROM_LAST_KEY:
                _compare(cache[point].softmax(-1), whole[point].softmax(-1), (name, point))
            else:
                _compare(cache[point], whole[point], (name, point))
        for i, kind in enumerate(("attn_out", "resid_mid")):
            vector = torch.randn(model.info.d_model, generator=torch.Generator().manual_seed(i))
            spec = SteeringSpec([Write(Address(kind, 1), vector, op="add", scale=2.0)])
            steered = sync.capture(ids, ["logits"], steering_spec=spec)[Address("logits")]
            with _hf_edit(family, kind, 1, 2.0 * vector, hf=hf), torch.no_grad():
                edited = hf(tokens).logits[0]
            assert rel_diff(steered, edited) <= TOL, kind
    finally:
        del _VARIANT_WHERE[id(hf)]


@pytest.mark.parametrize("family", ["bloom", "codegen", "falcon", "mpt", "xglm"])
def test_own_attention_points_of_a_padded_batch_equal_solo_runs(family: str) -> None:
    """Attention read at the family's own products (ALiBi built from the padding mask, too): a
    right-padded row's points equal the row run alone; its padded keys are masked (-inf)."""
    model = eager_model(family)
    rows = [_ids(family, 4, seed=1), _ids(family, 9, seed=2)]
    points = ["attn_scores.1", "attn_q.1", "attn_k.2", "attn_v.0", "attn_z.1", "resid_post.2"]
    batch = run_with_cache(model, rows, points)
    for row, ids in enumerate(rows):
        n = len(ids)
        solo = run_with_cache(model, [ids], points)
        for point in points:
            got = batch[point][row]
            if point.startswith("attn_scores"):  # [heads, queries, keys]
                if family in ALIBI_FROM_LAST_KEY:  # its bias counts back from the padded length
                    _compare(got[:, :n, :n].softmax(-1), solo[point][0].softmax(-1), point)
                else:
                    _compare(got[:, :n, :n], solo[point][0], point)
                assert bool((got[:, :, n:] == float("-inf")).all())
            else:
                _compare(got[:n], solo[point][0], point)


@pytest.mark.parametrize("family", ["bloom", "codegen", "falcon", "mpt"])
def test_a_value_head_write_in_a_fused_projection_equals_the_same_edit_in_hf(family: str) -> None:
    """A write to one value head lands where that head's values sit in the fused projection
    (per-head, model-parallel groups, multi-query), as the same edit made by hand in HF."""
    model = eager_model(family)
    hf = hf_oracle(family)
    where = WHERE[family]
    heads, kv, d = _shape(hf)
    head = kv - 1
    vector = torch.randn(d, generator=torch.Generator().manual_seed(9)) * 3
    ids = _ids(family, 7, seed=3)
    spec = SteeringSpec([Write(Address("attn_v", 1), vector, op="set", heads=[head])])
    got = sync_model(model).capture(ids, ["logits"], steering_spec=spec)[Address("logits")]

    def put(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        if where.v_layout == "codegen":  # 4 groups of [q | v | k], heads / 4 heads each
            group, index = divmod(head, heads // 4)
            out.view(*out.shape[:-1], 4, 3, heads // 4, d)[..., group, 1, index, :] = vector
        else:
            _values_of(out, where.v_layout, heads, kv, d)[:, head] = vector  # a view of batch row 0
        return out

    handle = _get(_block(hf, family, 1), f"{where.attn}.{where.v}").register_forward_hook(put)
    try:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    assert rel_diff(got, want) <= TOL
    with torch.no_grad():
        assert rel_diff(want, hf(torch.tensor([ids])).logits[0]) > 1e-3


def test_an_sdpa_falcon_held_by_the_user_serves_queries_and_says_why_not_scores() -> None:
    """Falcon cannot switch to eager attention at run time: held in SDPA, its queries and keys are
    read where ``scaled_dot_product_attention`` gets them; scores and patterns are a clear error
    (``load_model`` loads it with eager attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interp_eager import EagerModel

    path = tiny_model_path("falcon")
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert hf.config._attn_implementation == "sdpa"
    model = EagerModel.from_hf(hf, AutoTokenizer.from_pretrained(path))
    ids = [_ids("falcon", 6, seed=8)]
    points = ["attn_q.1", "attn_k.1", "attn_v.1", "resid_post.2"]
    got, want = run_with_cache(model, ids, points), run_with_cache(eager_model("falcon"), ids, points)
    for point in points:
        _compare(got[point], want[point], point)
    with pytest.raises(UnsupportedAddress, match="attn_implementation='eager'"):
        run_with_cache(model, ids, ["attn_scores.1"])


async def test_a_post_norm_model_with_a_projection_before_the_unembedding() -> None:
    """OPT-350m's layout: each block normalises the residual after adding (no final norm), and
    ``project_out`` maps the last layer's output to the narrower unembedding."""
    model, hf = _variant("opt", do_layer_norm_before=False, word_embed_proj_dim=32)
    family = model.family
    assert family.post_norm and family.final_norm is None
    assert family.before_unembed == ("model.decoder.project_out",)
    ids = [5, 9, 17, 33, 8, 70, 12]
    points = [Address("resid_pre", 1), Address("resid_post", 2), Address("logits")]
    got = await model.capture(ids, points)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    assert rel_diff(got[points[0]], out.hidden_states[1][0]) <= TOL
    assert rel_diff(got[points[2]], out.logits[0]) <= TOL
    lens = await model.decode_residuals(got[points[1]])
    assert rel_diff(lens, out.logits[0]) <= TOL
    with pytest.raises(UnsupportedAddress, match="post-LN"):
        await model.capture(ids, [Address("resid_mid", 1)])


def test_cohere_with_qk_norms_serves_them() -> None:
    """Cohere's per-head q/k ``LayerNorm`` holds a ``[heads, d_head]`` weight: still a norm."""
    model, hf = _variant("cohere", use_qk_norm=True)
    assert (model.family.q_norm, model.family.k_norm) == ("self_attn.q_norm", "self_attn.k_norm")
    ids = [5, 9, 17, 33, 8, 70]
    got = run_with_cache(model, [ids], ["q_norm_out.1", "k_norm_in.1", "logits"])
    seen: dict[str, torch.Tensor] = {}
    attn = hf.model.layers[1].self_attn
    handles = [
        attn.q_norm.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
        attn.k_norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("k", a[0])),
    ]
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits
    finally:
        for handle in handles:
            handle.remove()
    assert rel_diff(got["q_norm_out.1"][0], seen["q"][0]) <= TOL  # [tokens, heads, d_head]
    assert rel_diff(got["k_norm_in.1"][0], seen["k"][0]) <= TOL
    assert rel_diff(got["logits"][0], logits[0]) <= TOL


@pytest.mark.parametrize("family", ["glm4", "gpt_neo", "qwen2_moe", "bloom", "codegen", "bitnet"])
def test_resolution_does_not_read_the_model_type(family: str) -> None:
    """The same modules under a model_type nobody registered resolve to the same table."""
    from interp_eager import resolve_family

    hf = hf_oracle(family)
    known = resolve_family(hf)
    original = hf.config.model_type
    hf.config.model_type = "never_seen_before"
    try:
        unknown = resolve_family(hf)
    finally:
        hf.config.model_type = original
    fields = {k: v for k, v in known.__dict__.items() if k not in ("name", "model_types")}
    assert {k: v for k, v in unknown.__dict__.items() if k not in ("name", "model_types")} == fields
    if family == "glm4":  # its post_attention_layernorm is the pre-MLP norm; the sandwich norms are these
        assert (known.attn_post_norm, known.mlp_post_norm) == ("post_self_attn_layernorm", "post_mlp_layernorm")


# -- refused ------------------------------------------------------------------------------------

REFUSAL = {
    "bloom": "the output of its attention BloomAttention is none of its projections' outputs",
}
"""Why each of ``interp_testkit.suite.REFUSED_VARIANTS`` is refused (every tiny default config resolves)."""


@pytest.mark.parametrize("family", sorted(REFUSED_VARIANTS))
def test_refused_config_variants_say_why(family: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from interp_eager import resolve_family

    config = AutoConfig.from_pretrained(tiny_model_path(family))
    for name, value in REFUSED_VARIANTS[family].items():
        setattr(config, name, value)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(UnsupportedArchitecture) as info:
        resolve_family(hf)
    assert REFUSAL[family] in str(info.value) and repr(family) in str(info.value)


def test_granite_multipliers_that_keep_the_residual_identity_are_served() -> None:
    """Granite's attention, embedding and logit multipliers: the scores carry the attention's own
    scaling, ``embed`` the scaled embedding and the logits the constant scale."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from interp_eager import EagerModel
    from interp_testkit import randomize_weights

    path = tiny_model_path("granite")
    config = AutoConfig.from_pretrained(path)
    config.attention_multiplier, config.embedding_multiplier, config.logits_scaling = 0.3, 2.0, 4.0
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_weights(hf, seed=1)
    model = EagerModel.from_hf(hf, AutoTokenizer.from_pretrained(path))
    assert model.family.logit_multiplier == pytest.approx(0.25)
    ids = [5, 9, 17, 33, 8, 70]
    got = run_with_cache(model, [ids], ["embed", "attn_scores.1", "logits", "resid_post.2"])
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    assert rel_diff(got["embed"][0], out.hidden_states[0][0]) <= TOL
    assert rel_diff(got["attn_scores.1"][0].softmax(-1), out.attentions[1][0]) <= 1e-6
    assert rel_diff(got["logits"][0], out.logits[0]) <= TOL
    lens = sync_model(model).decode_residuals(got["resid_post.2"][0])
    assert rel_diff(lens, out.logits[0]) <= TOL


# -- the result files docs/reference/model-types.md's table is rendered from -----------------------------


def _write(family: str, status: str, kinds: list[str], reason: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"model_type": family, "backend": "eager", "status": status, "kinds": kinds, "reason": reason}
    (RESULTS / f"{family}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


@sweep
def test_result_file(family: str) -> None:
    """Written last: every check of this model type passed in this run (run the whole module)."""
    needed = set(CHECKS) | (set(MOE_CHECKS) if family in SWEEP_MOE else set())
    missing = needed - _PASSED[family]
    assert not missing, f"{family}: these checks did not pass in this run: {sorted(missing)}"
    _write(family, "verified", sorted(_KINDS[family]), "")
