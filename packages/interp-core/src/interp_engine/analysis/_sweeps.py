"""What a patching sweep and its attribution estimate share: the two prompts, the cells (layers x
positions x heads) checked against the model, the default metric, and the labelled result."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._api import Tokens, token_rows
from .._errors import InvalidOption, InvalidTokens, UnknownKind
from ..addresses._address import Address
from ..addresses._kinds import KINDS, KindInfo
from ..protocol._protocol import InterpModel
from ..results._labelled import Labelled
from ..steering._values import short_repr
from ._metrics import Metric, logit_diff, token_id

Direction = Literal["denoise", "noise"]


def one_row(model: InterpModel, tokens: Tokens, what: str) -> list[int]:
    """``tokens`` as one prompt's ids."""
    rows = token_rows(model, tokens)
    if len(rows) != 1:
        raise InvalidTokens(f"{what} is one prompt (a text or a list of ids), got {len(rows)} rows")
    return list(rows[0])


def indices(given: Iterable[int] | int | None, count: int, what: str) -> list[int]:
    """``given`` (default: all) as indices in ``[0, count)``, negatives counted from the end."""
    if given is None:
        return list(range(count))
    listed: list[Any]
    if isinstance(given, int) and not isinstance(given, bool):
        listed = [given]
    elif isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise InvalidOption(f"{what}s are a list of ints, got {short_repr(given)}")
    else:
        listed = list(given)
    out = []
    for index in listed:
        if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
            raise InvalidOption(
                f"{what} {short_repr(index)} is outside the {count} {what}s (valid: {-count}..{count - 1})"
            )
        out.append(index % count)
    if not out or len(set(out)) != len(out):
        raise InvalidOption(f"{what}s must be a non-empty list without repeats, got {short_repr(listed)}")
    return out


def scalar(value: Any, where: str) -> float:
    """A metric's value as a float (a one-element tensor or a number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidOption(f"the metric must return a scalar, got a tensor of shape {list(value.shape)} {where}")
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise InvalidOption(f"the metric must return a float or a 0-d tensor, got {type(value).__name__} {where}")


@dataclass(frozen=True)
class Cells:
    """The cells of a sweep over ``kind``: every layer in ``layers`` (``[None]`` for a kind
    without layers) x each position in ``positions`` (or all of them at once when not
    ``per_position``) x each head in ``heads`` (``None``: no head axis)."""

    kind: str
    clean: list[int]
    corrupt: list[int]
    layers: list[int | None]
    positions: list[int]
    heads: list[int] | None
    per_position: bool
    direction: Direction

    @property
    def info(self) -> KindInfo:
        return KINDS[self.kind]

    @property
    def addresses(self) -> list[Address]:
        return [Address(self.kind, layer) for layer in self.layers]

    @property
    def source(self) -> list[int]:
        """The prompt whose activations are patched in."""
        return self.clean if self.direction == "denoise" else self.corrupt

    @property
    def patched(self) -> list[int]:
        """The prompt whose run is patched (and whose metric is read)."""
        return self.corrupt if self.direction == "denoise" else self.clean

    def groups(self) -> list[list[int]]:
        """The positions of each cell along the position axis."""
        return [[p] for p in self.positions] if self.per_position else [self.positions]

    def result(
        self,
        model: InterpModel,
        table: torch.Tensor,
        metric: Metric,
        clean: float,
        corrupt: float,
        *,
        normalize: bool,
        method: str,
        offset: bool,
    ) -> Labelled:
        """The finished table: with ``normalize``, ``(table - m_patched) / (m_source -
        m_patched)`` (``offset=False``: a table of changes, divided only), labelled, with the
        metric's values on the two unpatched runs in ``meta``."""
        patched, source = (corrupt, clean) if self.direction == "denoise" else (clean, corrupt)
        if normalize:
            span = source - patched
            if span == 0:
                raise InvalidOption("normalize=True divides by the clean-corrupt metric difference, which is 0 here")
            table = ((table - patched) if offset else table) / span
        meta = {
            "kind": self.kind,
            "direction": self.direction,
            "metric": getattr(metric, "__name__", "metric"),
            "clean": clean,
            "corrupt": corrupt,
            "normalized": normalize,
            "method": method,
        }
        return self.labelled(model, table, meta)

    def labelled(self, model: InterpModel, values: torch.Tensor, meta: dict[str, Any]) -> Labelled:
        """``values`` (``[layers, positions?, heads?]``, the layer axis even for a layerless
        kind) with its axes named and labelled."""
        dims: list[str] = []
        coords: dict[str, list[Any]] = {}
        if self.info.per_layer:
            dims.append("layer")
            coords["layer"] = list(self.layers)
        else:
            values = values[0]
        if self.per_position:
            dims.append("position")
            clean, corrupt = model.to_str_tokens(self.clean), model.to_str_tokens(self.corrupt)
            coords["position"] = [
                f"{p} {clean[p]!r}" if self.clean[p] == self.corrupt[p] else f"{p} {clean[p]!r}/{corrupt[p]!r}"
                for p in self.positions
            ]
        if self.heads is not None:
            dims.append("head")
            coords["head"] = list(self.heads)
        if not dims:  # a layerless kind, every position at once: one cell
            dims, coords, values = ["cell"], {"cell": [self.kind]}, values.reshape(1)
        return Labelled(values, tuple(dims), coords, meta)


def plan_cells(
    model: InterpModel,
    clean: Tokens,
    corrupt: Tokens,
    kind: str,
    *,
    layers: Iterable[int] | None,
    positions: Iterable[int] | str | None,
    heads: bool | Sequence[int],
    by_position: bool | None,
    direction: str,
) -> Cells:
    """The arguments of a sweep checked against ``model`` (typed errors before any compute)."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise UnknownKind(f"unknown address kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    info = KINDS[kind]
    if direction not in ("denoise", "noise"):
        raise InvalidOption(f"direction is 'denoise' or 'noise', got {direction!r}")
    clean_ids = one_row(model, clean, "clean")
    corrupt_ids = one_row(model, corrupt, "corrupt")
    n = len(clean_ids)
    if len(corrupt_ids) != n:
        raise InvalidTokens(
            f"position-wise patching needs prompts of the same length: clean has {n} tokens, corrupt "
            f"{len(corrupt_ids)} (reword one, or pad with tokens the model ignores)"
        )
    if isinstance(positions, str):  # a chat span name, read in the clean prompt (else the corrupt one)
        from ..chat._spans import ChatTokens, select_positions

        chat = next((t for t in (clean, corrupt) if isinstance(t, ChatTokens)), clean_ids)
        positions = select_positions(positions, chat, n, n)
    if not info.per_layer and layers is not None:
        raise InvalidOption(f"{kind} has no layers; leave layers out")
    layer_list: list[int | None] = list(indices(layers, model.info.n_layers, "layer")) if info.per_layer else [None]
    head_list: list[int] | None = None
    if heads is not False:
        if not info.per_head:
            raise InvalidOption(f"heads= sweeps heads at a head address (attn_z, attn_v); {kind} has no head axis")
        count = model.info.n_kv_heads if info.width == "kv_heads x d_head" else model.info.n_heads
        head_list = indices(None if heads is True else heads, count, "head")
    return Cells(
        kind,
        clean_ids,
        corrupt_ids,
        layer_list,
        indices(positions, n, "position"),
        head_list,
        (head_list is None) if by_position is None else bool(by_position),
        direction,  # type: ignore[arg-type]  # checked above
    )


def default_metric(
    model: InterpModel,
    metric: Metric | None,
    answer: int | str | None,
    wrong: int | str | None,
    top_clean: int | None,
    top_corrupt: int | None,
) -> Metric:
    """``metric``, or the logit difference at the last position between ``answer`` and ``wrong``
    (left out: the clean and the corrupt run's top tokens there)."""
    if metric is not None:
        if answer is not None or wrong is not None:
            raise InvalidOption("answer= and wrong= build the default metric; with metric= leave them out")
        if not callable(metric):
            raise InvalidOption(f"metric must be a callable of the logits, got {type(metric).__name__}")
        return metric
    answer_id = top_clean if answer is None else token_id(model, answer, "answer")
    wrong_id = top_corrupt if wrong is None else token_id(model, wrong, "wrong")
    if answer_id is None or wrong_id is None:  # pragma: no cover - callers pass the top tokens they need
        raise InvalidOption("pass answer= and wrong=, or a metric")
    if answer_id == wrong_id:
        raise InvalidOption(
            f"the default metric compares the clean and corrupt runs' top tokens, but both are "
            f"{answer_id} ({model.to_str_tokens([answer_id])[0]!r}); pass answer= and wrong= or a metric"
        )
    return logit_diff(answer_id, wrong_id)
