"""The norms resolver: the norms inside the attention (q/k norms, a sub-norm before the output
projection) and around the sublayers (sandwich norms, post-norm blocks), and how the sublayers
meet the residual stream (parallel or sequential, the residual identity).

- a norm of the attention named for queries or keys (``q_norm``, ``k_layernorm``, ...) is a q/k
  norm; the layout of the heads in the tensors it sees is read off them; a norm whose output is the
  output projection's input is a sub-norm (BitNet's ``attn_sub_norm``): ``attn_z`` is what it
  receives;
- a norm of the layer whose input is the attention's (MLP's) output is a sandwich norm
  (``attn_out_post``/``mlp_out_post``) -- Gemma 2's ``post_attention_layernorm`` -- whatever its
  name; the layer's output being a norm's output is a post-norm (OPT-350m) block;
- a second forward with the attention's output shifted tells parallel blocks (the MLP's input does
  not move) from sequential ones;
- the residual identity ``resid_post = resid_pre + attention part + MLP part`` is checked (up to
  the dtype's rounding); where it holds with both parts times one constant (Granite's
  ``residual_multiplier``, read as the config's number), that is the family's residual multiplier
  (``attn_out``/``mlp_out`` are then read after it); a model it does not hold for is refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ._families import QkNormLayout
from ._resolve_attention import Attention
from ._trace import Record, Traced, close, config_numbers, recording, run, same
from ._tree import refuse

_Q_NAME = re.compile(r"^(q|query)(_|$)|^q[a-z]*norm", re.IGNORECASE)
_K_NAME = re.compile(r"^(k|key)(_|$)|^k[a-z]*norm", re.IGNORECASE)


def resolve_attention_norms(traced: Traced, attention: Attention) -> dict[str, Any]:
    """The q/k norms, their heads' layout, and a sub-norm before the output projection."""
    model = traced.model
    n_heads, n_kv_heads, d_head = attention.n_heads, attention.n_kv_heads, attention.d_head
    tokens = int(traced.ids.shape[1])
    q_norm = k_norm = attn_sub_norm = None
    qk_layout: QkNormLayout = "heads x tokens"
    for path in traced.static.attn_norms:
        short = path.rsplit(".", 1)[-1]
        x = traced.input(path)
        if x is None:
            continue
        is_q, is_k = bool(_Q_NAME.search(short)), bool(_K_NAME.search(short))
        if is_q == is_k:
            if same(traced.output(path), attention.o_in):
                # it normalises the heads' weighted values before the output projection (BitNet's
                # attn_sub_norm): attn_z is what it receives
                if int(x.shape[-1]) != n_heads * d_head:
                    raise refuse(model, f"the input of {path} is not {n_heads} heads of {d_head}")
                attn_sub_norm = path
            continue  # a norm of both queries and keys (Llama 4's qk_norm): no q/k-norm points, q/k read after it
        found_layout = _norm_layout(x, n_heads if is_q else n_kv_heads, d_head, tokens)
        if found_layout is None:
            raise refuse(model, f"could not read the head layout of the tensors the norm {path} sees")
        qk_layout = found_layout
        if is_q:
            q_norm = path
        else:
            k_norm = path
    return {"q_norm": q_norm, "k_norm": k_norm, "qk_norm_layout": qk_layout, "attn_sub_norm": attn_sub_norm}


def resolve_residual(
    traced: Traced, attn_output: torch.Tensor | None, mlp_in: str, mlp_output: torch.Tensor | None
) -> dict[str, Any]:
    """The sandwich norms, a post-norm block, parallel blocks, and the residual identity checked."""
    model, static, record = traced.model, traced.static, traced.record
    layer_output = traced.output("")
    attn_post_norm = mlp_post_norm = None
    post_norm = False
    for path in static.layer_norms:
        x = traced.input(path)
        if same(x, attn_output):
            attn_post_norm = path
        elif same(x, mlp_output):
            mlp_post_norm = path
        elif same(traced.output(path), layer_output):
            post_norm = True
    if (attn_post_norm is None) != (mlp_post_norm is None):
        raise refuse(model, "it has a sandwich norm after one sublayer but not after the other")

    # parallel or sequential: does the MLP's input move when the attention's output does?
    shifted = Record()

    def shift(output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + 1.0
        return (output[0] + 1.0, *output[1:])

    with recording(model, shifted, [], None, edits={traced.at(static.attn): shift}):
        run(model, traced.ids)
    parallel = same(shifted.inputs.get(traced.at(mlp_in)), traced.input(mlp_in))

    # the residual identity: resid_post = resid_pre + what each sublayer adds (times a multiplier)
    multiplier = 1.0
    if not post_norm:
        resid_pre = record.inputs[traced.at("")]
        attn_part = traced.output(attn_post_norm) if attn_post_norm else attn_output
        mlp_part = traced.output(mlp_post_norm) if mlp_post_norm else mlp_output
        if attn_part is None or mlp_part is None or layer_output is None:
            raise refuse(model, "the traced forward did not reach its attention and MLP")
        added = attn_part.reshape(-1) + mlp_part.reshape(-1)
        if not close(resid_pre.reshape(-1) + added, layer_output):
            fitted = None if attn_post_norm else _multiplier(model, resid_pre, added, layer_output)
            if fitted is None:
                raise refuse(
                    model,
                    f"its {type(traced.layers[0]).__name__} output is not its input plus its attention's and MLP's "
                    "outputs (a residual multiplier or another operation between them)",
                )
            multiplier = fitted
    return {
        "attn_post_norm": attn_post_norm,
        "mlp_post_norm": mlp_post_norm,
        "post_norm": post_norm,
        "parallel": parallel,
        "residual_multiplier": multiplier,
    }


def _multiplier(model: Any, resid_pre: torch.Tensor, added: torch.Tensor, layer_output: torch.Tensor) -> float | None:
    """The constant both sublayers' outputs are multiplied by before the residual add (Granite's
    ``residual_multiplier``): fitted to ``resid_post - resid_pre``, snapped to the config's own
    number; ``None`` if no constant makes the layer's output its input plus that multiple."""
    delta = layer_output.reshape(-1).double() - resid_pre.reshape(-1).double()
    added = added.double()
    scale = float((delta * added).sum() / (added * added).sum().clamp_min(1e-30))
    for value in config_numbers(model.config):  # the config's own number, exactly
        if abs(value - scale) <= 1e-3 * abs(scale):
            scale = value
    total = resid_pre.reshape(-1) + (added * scale).to(resid_pre.dtype)
    return scale if close(total, layer_output) else None


def _norm_layout(x: torch.Tensor, heads: int, d: int, tokens: int) -> QkNormLayout | None:
    if x.dim() == 4 and x.shape[1] == tokens and x.shape[2] == heads and x.shape[3] == d:
        return "tokens x heads"
    if x.dim() == 4 and x.shape[2] == tokens and x.shape[1] == heads and x.shape[3] == d:
        return "heads x tokens"
    if x.dim() == 3 and x.shape[-1] == heads * d:
        return "flat"
    return None
