"""The logits resolver: the final norm, anything between it and the unembedding, and a constant
logit scale.

- the final norm found by the static pass is kept if its input is the last layer's output;
- a linear layer whose input is the final norm's output (or the last layer's) and whose output is
  the unembedding's input sits between them (OPT's ``project_out``);
- a constant the model multiplies the unembedding's output by (Cohere's ``logit_scale``, Granite's
  ``1 / logits_scaling``) is read off the recorded logits, snapped to the config's own number;
  a soft-cap (``final_logit_softcapping``) is applied after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._trace import Traced, close, config_numbers, same
from ._tree import linear_io, refuse


def resolve_logits(traced: Traced) -> dict[str, Any]:
    model, record = traced.model, traced.record
    unembed = model.get_output_embeddings()  # type: ignore[operator]
    names = {id(m): n for n, m in model.named_modules()}
    unembed_in = record.inputs.get(names[id(unembed)])
    last = traced.at("", len(traced.layers) - 1)
    last_out = record.outputs.get(last)
    final_norm = traced.static.final_norm
    before_unembed: tuple[str, ...] = ()
    if final_norm is not None and not same(record.inputs.get(final_norm), last_out):
        final_norm = None
    start = record.outputs.get(final_norm) if final_norm is not None else last_out
    if not same(start, unembed_in):  # a projection between them (OPT's project_out)
        between = [
            n
            for n, m in model.named_modules()
            if linear_io(m) is not None
            and same(record.inputs.get(n), start)
            and same(record.outputs.get(n), unembed_in)
        ]
        if len(between) != 1:
            after = final_norm or f"the last layer {last}"
            raise refuse(model, f"could not place what sits between {after} and the unembedding")
        before_unembed = (between[0],)
    multiplier = _logit_multiplier(model, record.outputs.get(names[id(unembed)]), record.logits)
    return {"final_norm": final_norm, "before_unembed": before_unembed, "logit_multiplier": multiplier}


def _logit_multiplier(model: nn.Module, raw: torch.Tensor | None, logits: torch.Tensor | None) -> float:
    """The constant the model multiplies the unembedding's output by (Cohere's ``logit_scale``), 1.0
    if none; a soft-cap (``final_logit_softcapping``) is applied by the plan after it."""
    if raw is None or logits is None:
        raise refuse(model, "the traced forward produced no logits")
    cap = getattr(model.config, "final_logit_softcapping", None)
    raw = raw.reshape(logits.shape).double()

    def post(scale: float) -> torch.Tensor:
        scaled = raw * scale
        return torch.tanh(scaled / cap) * cap if cap else scaled

    if close(post(1.0).to(logits.dtype), logits):
        return 1.0
    target = logits.double()
    if cap:
        target = torch.atanh((target / cap).clamp(-1 + 1e-6, 1 - 1e-6)) * cap
    scale = float((raw * target).sum() / (raw * raw).sum())
    for value in config_numbers(model.config):  # the config's own number, exactly (logit_scale, 1 / logits_scaling)
        for candidate in (value, 1.0 / value):
            if abs(candidate - scale) <= 1e-3 * abs(scale):
                scale = candidate
    if close(post(scale).to(logits.dtype), logits):
        return scale
    raise refuse(model, "its logits are not its unembedding's output (nor a constant multiple of it)")
