"""Padded batches with an attention mask (``run_with_cache(..., attention_mask=...)``): each row's
real tokens run as that prompt alone, and the values come back in the caller's padded layout.

A row's real tokens are one contiguous run (left or right padding); each counts its positions
from 0 at its first real token, as Hugging Face ``generate`` does (:func:`position_ids_from_mask`),
so a left-padded row gives exactly the values of its prompt alone. Masked positions hold zeros
(attention scores ``-inf``): they are not computed, and never to be read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._errors import InvalidTokens
from .addresses._address import Address
from .sae._readouts import FeatureReadout


def position_ids_from_mask(attention_mask: Any) -> torch.Tensor:
    """The position ids Hugging Face ``generate`` builds from a ``[batch, seq]`` attention mask:
    each row counts from 0 at its first real token (``1`` in the mask); masked positions get 0.
    A left-padded row so gets the positions of its prompt alone, which is what a padded
    ``run_with_cache(..., attention_mask=mask)`` computes with."""
    mask = _as_mask(attention_mask)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _as_mask(attention_mask: Any) -> torch.Tensor:
    try:
        mask = torch.as_tensor(attention_mask)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidTokens(f"attention_mask is a [batch, seq] tensor of 0 and 1: {exc}") from None
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.dim() != 2 or not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidTokens(f"attention_mask is a [batch, seq] tensor of 0 and 1, got shape {list(mask.shape)}")
    return mask.long()


def unpad(tokens: Any, attention_mask: Any, position_ids: Any) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Each row's real ids, the positions they sit at in the padded layout, and the padded width.

    ``InvalidTokens`` unless ``tokens`` is ``[batch, seq]`` ids of the mask's shape, every row has
    one contiguous run of real tokens, and ``position_ids`` (if given) equals
    :func:`position_ids_from_mask` at the real tokens."""
    mask = _as_mask(attention_mask)
    try:
        ids = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidTokens(f"with attention_mask, tokens are [batch, seq] ids: {exc}") from None
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape != mask.shape:
        raise InvalidTokens(
            f"attention_mask has shape {list(mask.shape)} and the tokens have shape {list(ids.shape)}; they must match"
        )
    expected = position_ids_from_mask(mask)
    if position_ids is not None:
        given = torch.as_tensor(position_ids)
        if given.numel() != expected.numel() or not bool(
            ((given.reshape(expected.shape) == expected) | (mask == 0)).all()
        ):
            raise InvalidTokens(
                "position_ids must count from 0 at each row's first real token (position_ids_from_mask(mask)): "
                "each row runs as its prompt alone, so other positions cannot be served; leave position_ids out"
            )
    rows, where = [], []
    for i in range(mask.shape[0]):
        real = torch.nonzero(mask[i]).flatten()
        if real.numel() == 0:
            raise InvalidTokens(f"row {i} of attention_mask has no real token (no 1)")
        if int(real[-1] - real[0]) + 1 != real.numel():
            raise InvalidTokens(
                f"row {i} of attention_mask has padding between real tokens; pad on the left or the right only"
            )
        rows.append([int(t) for t in ids[i, real].tolist()])
        where.append(real)
    return rows, where, int(mask.shape[1])


def repad(values: Mapping[Any, Any], where: list[torch.Tensor], width: int) -> dict[Any, Any]:
    """Right-padded batched values (``[batch, n_max, ...]``; attention ``[batch, heads, q, k]``)
    moved to the caller's padded layout of ``width`` positions, each row's values at ``where``."""
    out: dict[Any, Any] = {}
    for key, value in values.items():
        if isinstance(value, FeatureReadout):
            out[key] = FeatureReadout(
                _place(value.values, where, width, (1,), 0.0),
                None if value.ids is None else _place(value.ids, where, width, (1,), -1),
                None if value.error_norm is None else _place(value.error_norm, where, width, (1,), 0.0),
            )
            continue
        square = isinstance(key, Address) and key.info.width == "heads x keys"
        fill = float("-inf") if isinstance(key, Address) and key.kind == "attn_scores" else 0.0
        out[key] = _place(value, where, width, (2, 3) if square else (1,), fill)
    return out


def _place(
    value: torch.Tensor, where: list[torch.Tensor], width: int, axes: tuple[int, ...], fill: float
) -> torch.Tensor:
    shape = list(value.shape)
    for axis in axes:
        shape[axis] = width
    out = torch.full(shape, fill, dtype=value.dtype)
    for i, real in enumerate(where):
        n = real.numel()
        if axes == (1,):
            out[i, real] = value[i, :n]
        else:
            row = out[i]  # a view: [heads, width, width]
            row[:, real.unsqueeze(-1), real] = value[i, :, :n, :n]
    return out
