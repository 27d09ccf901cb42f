"""What ``capture_attention`` returns: our attention patterns keyed by ``Address("attn_pattern",
L)``, which also answer the public ``interp-engine`` package's lookup by layer number.

``result[Address("attn_pattern", 5)]`` (or ``"attn_pattern.5"`` on a :class:`AttentionCache`) is
the pattern, as it always was; ``result[5]`` is ``{"scores", "probs", "value"}`` for layer 5, the
public package's form: the pre-softmax scores and the probabilities ``[heads, q, k]`` and the values
``[pos, kv_heads, d_head]`` (what ``probs @ value`` reads), one prompt's, without a batch axis.
Iterating, ``keys()`` and ``len()`` see the patterns only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._errors import InvalidOption
from ..addresses._address import Address
from ._cache import Cache

ATTENTION_PARTS = {"scores": "attn_scores", "probs": "attn_pattern", "value": "attn_v"}
"""The public package's names for one layer's attention values, and the kinds they are read from."""


def attention_extras(layers: list[int], served: Mapping[str, Any] | None) -> list[Address]:
    """The addresses besides the patterns that ``result[layer]`` reads (scores and values), of the
    kinds ``served`` holds (``None``: none)."""
    if served is None:
        return []
    kinds = [kind for kind in ("attn_scores", "attn_v") if kind in served]
    return [Address(kind, layer) for layer in layers for kind in kinds]


def _layer_parts(values: Mapping[Address, torch.Tensor], layer: int, batched: bool) -> dict[str, torch.Tensor]:
    pattern = Address("attn_pattern", layer)
    if pattern not in values:
        held = sorted({a.layer for a in values if a.kind == "attn_pattern" and a.layer is not None})
        raise KeyError(f"layer {layer} is not in these attention results; they hold layers {held}")
    out = {}
    for name, kind in ATTENTION_PARTS.items():
        address = Address(kind, layer)
        if address not in values:
            raise KeyError(
                f"{name!r} of layer {layer} was not captured: this model does not serve {kind} here; "
                f"the pattern is result[Address('attn_pattern', {layer})]"
            )
        value = values[address]
        if batched:
            if value.shape[0] != 1:
                raise InvalidOption(
                    f"result[{layer}] is one prompt's {{'scores', 'probs', 'value'}} (the public interp-engine form); "
                    f"these results hold {value.shape[0]} prompts: read result['attn_pattern.{layer}'][row] instead"
                )
            value = value[0]
        out[name] = value
    return out


class AttentionPatterns(dict[Address, torch.Tensor]):
    """The model method's ``capture_attention`` result: a dict of patterns ``[heads, q, k]``
    keyed by ``Address("attn_pattern", L)``; ``result[L]`` (an int) is layer ``L``'s
    ``{"scores", "probs", "value"}`` (module docstring)."""

    def __init__(self, values: Mapping[Address, torch.Tensor]) -> None:
        super().__init__({a: v for a, v in values.items() if a.kind == "attn_pattern"})
        self._values = dict(values)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            return _layer_parts(self._values, key, batched=False)
        return super().__getitem__(key)


class AttentionCache(Cache):
    """The free function's ``capture_attention`` result: a :class:`Cache` of patterns
    ``[batch, heads, q, k]``; ``cache[L]`` (an int) is layer ``L``'s ``{"scores", "probs",
    "value"}`` of a one-prompt batch, without the batch axis (module docstring)."""

    __slots__ = ("_parts",)

    def __init__(self, values: Mapping[Address, torch.Tensor], **kwargs: Any) -> None:
        super().__init__({a: v for a, v in values.items() if a.kind == "attn_pattern"}, **kwargs)
        self._parts = dict(values)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            return _layer_parts(self._parts, key, batched=True)
        return super().__getitem__(key)
