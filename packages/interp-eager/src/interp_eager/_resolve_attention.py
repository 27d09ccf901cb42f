"""The attention resolver: how a layer's attention function is read, its heads, its output
projection and where its values are made.

- the heads and their width are those of the queries, keys and values the attention function
  receives: transformers' attention interface, or else an own ``_attn(query, key, value, ...)``
  method of the attention module or a module inside it (GPT-J, GPT-Neo, CodeGen; its
  ``attn_scores`` are then read where its softmax receives them, unless
  :data:`~interp_eager._families.FAMILY_DATA` says how it scales them), or else the attention
  module's own forward (Bloom, Falcon, MPT, XGLM): the operands of the ``q @ k^T`` product whose
  result its softmax normalises, what that softmax receives (ALiBi biases and masks included) and
  the operand its output multiplies (or the arguments of ``scaled_dot_product_attention``); keys and
  values repeated for each query head they serve (Falcon's new decoder architecture) are read once
  per key/value head; whether it also normalises over learned sink logits (gpt-oss's ``s_aux``: no
  ``attn_scores``);
- the output projection is the attention linear whose output *is* the attention's output, or
  whose output plus ``resid_pre`` is (Bloom's attention adds the residual inside: ``attn_out`` is
  then that projection's output);
- the values are where the tensor the attention function receives as ``value`` is found in a
  projection's output (``v_proj``; or the last third of ``[q | k | v]``; or per-head ``[q k v]``;
  or per key/value head after its queries; or CodeGen's model-parallel groups of ``[q | v | k]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._families import FAMILY_DATA, QkvLayout
from ._sites import VALUE_SLICES
from ._trace import Traced, close, same, trace, trace_ids
from ._tree import Static, refuse


def trace_model(model: nn.Module, static: Static) -> Traced:
    """One traced forward of ``model``, its attention function tapped where it is called:
    transformers' attention interface, an own ``_attn`` method, or the attention module's forward."""
    config: Any = model.config
    data = FAMILY_DATA.get(str(getattr(config, "model_type", type(model).__name__)), {})
    layers: nn.ModuleList = model.get_submodule(static.layers)  # type: ignore[assignment]
    config_heads = getattr(config, "num_attention_heads", None)
    avoid = {int(v) for v in (config_heads, getattr(config, "num_key_value_heads", None)) if isinstance(v, int)}
    attn_modules = [layer.get_submodule(static.attn) for layer in layers]
    attn_fn = data.get("attn_fn")
    ids = trace_ids(model, avoid)
    record = trace(model, ids, attn_modules, attn_fn)
    scores_at_softmax = bool(data.get("attn_scores_at_softmax", False))
    if 0 not in record.attention and attn_fn is None:
        # no call of transformers' attention interface: an own ``_attn(query, key, value, mask)``
        # method (GPT-J's and GPT-Neo's kind), whose scores are read where its softmax gets them
        own = _own_attention_method(attn_modules[0])
        if own is not None:
            attn_fn, scores_at_softmax = own, True
            record = trace(model, ids, attn_modules, attn_fn)
    if 0 not in record.attention and attn_fn is None:
        # the attention module computes attention in its own forward (Bloom, Falcon, MPT, XGLM):
        # read at its q @ k^T product, its softmax and the product of the softmax with the values
        attn_fn, scores_at_softmax = "forward", True
        record = trace(model, ids, attn_modules, attn_fn)
    if 0 not in record.attention:
        raise refuse(
            model,
            f"its attention {type(attn_modules[0]).__name__} does not call transformers' attention interface, "
            "an own _attn(query, key, value, mask) method, nor a q @ k^T product whose result a softmax "
            "normalises (queries, keys and scores cannot be read)",
        )
    return Traced(model, static, layers, ids, record, attn_fn, scores_at_softmax)


@dataclass
class Attention:
    """What the attention resolver found: :class:`~interp_eager._families.Family` fields, and the
    tensors the other resolvers compare with."""

    fields: dict[str, Any]
    output: torch.Tensor | None
    """What the attention sublayer returns to its layer (``attn_out``), in the traced forward."""
    o_in: torch.Tensor
    """The output projection's input (the heads' weighted values)."""
    n_heads: int
    n_kv_heads: int
    d_head: int


def resolve_attention(traced: Traced) -> Attention:
    model, static, record = traced.model, traced.static, traced.record
    attention = traced.layers[0].get_submodule(static.attn)
    what = type(attention).__name__
    query, key, value = record.attention[0]
    # keys and values repeated for each query head they serve (Falcon's new decoder architecture)
    kv_repeat = _kv_repeat(key, value, int(query.shape[1]))
    key, value = key[:, ::kv_repeat], value[:, ::kv_repeat]
    # heads and their width as the attention function sees them: [batch, heads, tokens, d_head]
    n_heads, d_head = int(query.shape[1]), int(query.shape[-1])
    if int(key.shape[-1]) != d_head or int(value.shape[-1]) != d_head:
        raise refuse(
            model,
            f"its attention {what} gives queries, keys and values different head widths "
            f"({d_head}, {int(key.shape[-1])}, {int(value.shape[-1])}): one d_head cannot address them",
        )

    # the output projection: the attention linear whose output is the attention's output (or, where
    # the attention adds the residual to it inside -- Bloom --, whose output plus resid_pre is)
    attn_output = traced.output(static.attn)
    resid_pre = record.inputs[traced.at("")]
    o_proj = next((name for name, _ in static.attn_linears if same(traced.output(name), attn_output)), None)
    attn_out_at = None
    if o_proj is None and attn_output is not None:
        for name, _ in static.attn_linears:
            out = traced.output(name)
            if out is not None and out.shape == attn_output.shape and close(out + resid_pre, attn_output):
                o_proj, attn_out_at = name, name
                attn_output = out
                break
    if o_proj is None:
        raise refuse(
            model,
            f"the output of its attention {what} is none of its projections' outputs "
            "(it adds something other than the residual inside the attention module)",
        )
    o_in = traced.input(o_proj)
    if o_in is None or int(o_in.shape[-1]) != n_heads * d_head:
        raise refuse(model, f"the input of {o_proj} is not {n_heads} heads of {d_head} (attn_z cannot be split)")

    # the values: the projection output in which the attention function's values are found
    attn_v: str | None = None
    layout: QkvLayout = "v"
    n_kv_heads = n_heads
    qkv_groups = 1
    for name, _ in static.attn_linears:
        out = traced.output(name)
        if name == o_proj or out is None:
            continue
        found = _value_layout(out, value, n_heads, int(value.shape[1]), d_head)
        if found is not None:
            attn_v, (layout, n_kv_heads, qkv_groups) = name, found
            break
    if attn_v is None:
        raise refuse(model, f"could not find where its attention {what} makes the values it attends")
    fields = {
        "attn_o": o_proj,
        "attn_out_at": attn_out_at,
        "attn_v": attn_v,
        "qkv_layout": layout,
        "qkv_groups": qkv_groups,
        "kv_repeat": kv_repeat,
        "n_kv_heads": n_kv_heads,
        "n_heads": n_heads,
        "d_head": d_head,
        "attn_fn": traced.attn_fn,
        "attn_scores_at_softmax": traced.scores_at_softmax,
        "attention_sinks": record.sinks,
    }
    return Attention(fields, attn_output, o_in, n_heads, n_kv_heads, d_head)


def _value_layout(
    out: torch.Tensor, value: torch.Tensor, heads: int, kv_heads: int, d: int
) -> tuple[QkvLayout, int, int] | None:
    """Where the values ``value`` (``[batch, kv_heads, tokens, d]`` as the attention function got
    them) sit in a projection's output ``out``: ``(layout, kv_heads, groups)``."""
    want = value.transpose(1, 2)
    width = out.shape[-1]
    for layout, slicer in VALUE_SLICES.items():
        view_heads = kv_heads
        if layout == "v" and width % d == 0:
            view_heads = width // d
        if layout == "per-group q|k|v" and (kv_heads in (1, heads) or heads % kv_heads):
            continue  # with one or every head it is "q|k|v" or "per-head q|k|v"
        options = [g for g in (2, 4, 8, 16) if kv_heads % g == 0] if layout == "grouped q|v|k" else [1]
        for groups in options:
            try:
                got = slicer(heads, view_heads, d, groups).of(out.reshape(*want.shape[:2], width))
            except RuntimeError:
                continue
            if got.shape == want.shape and torch.equal(got, want):
                return layout, view_heads, groups
    return None


def _kv_repeat(key: torch.Tensor, value: torch.Tensor, heads: int) -> int:
    """How many times each key/value head is repeated in ``key``/``value`` (``[batch, heads, tokens,
    d]``) as the attention product received them: the largest ``r`` with every ``r`` consecutive
    heads equal (Falcon's new decoder architecture broadcasts its key/value heads), else 1."""
    n = int(key.shape[1])
    if n != heads or int(value.shape[1]) != n:
        return 1
    for r in sorted((r for r in range(2, n + 1) if n % r == 0), reverse=True):
        if all(torch.equal(t, t[:, ::r].repeat_interleave(r, dim=1)) for t in (key, value)):
            return r
    return 1


def _own_attention_method(attention: nn.Module) -> str | None:
    """The path (relative to ``attention``) of an own ``_attn(query, key, value, ...)`` method of
    the attention module or of a module inside it, else ``None``."""
    import inspect

    for name, module in attention.named_modules():
        method = getattr(type(module), "_attn", None)
        if not callable(method):
            continue
        parameters = list(inspect.signature(method).parameters)[1:4]
        if parameters == ["query", "key", "value"]:
            return f"{name}._attn" if name else "_attn"
    return None
