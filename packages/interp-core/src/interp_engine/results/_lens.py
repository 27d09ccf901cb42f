"""The logit lens during generation: what a caller asks for (:class:`LensRequest`) and what comes
back, per step (:class:`LensTopK`) and over many positions (:class:`LensResult`).

The lens at layer ``L`` and position ``p`` is the final norm and unembedding of ``resid_post.L``
at ``p`` (what ``decode_residuals`` computes, soft-cap included), softmaxed over the whole
vocabulary in float32; only its top ``k`` ids and probabilities are kept. A step's lens is read
at the position whose forward pass produced the step's token (``StreamStep.position``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import InvalidActivations, InvalidOption, InvalidSteering
from ..steering._values import as_positions, short_repr
from ._labelled import Labelled

MAX_LENS_TOP_K = 100
"""The most tokens a lens keeps per layer and position."""
MAX_LENS_LAYERS = 256
"""The most layers one lens request reads."""


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


@dataclass(frozen=True, init=False)
class LensRequest:
    """The logit lens to read while generating: at ``layers`` (``resid_post`` of each; negative
    layers count from the end), the ``top_k`` tokens and probabilities, at every position that
    produces a generated token and, with ``positions``, at those prompt positions too (read once
    the prompt is processed: ``"prompt"`` for every prompt token, explicit indices — negative
    ones count back from the prompt's end — or a chat span name such as ``"user[-1].last"``).

    Serialisable: ``LensRequest.from_json(lens.to_json()) == lens``."""

    layers: tuple[int, ...]
    top_k: int
    positions: str | tuple[int, ...] | None

    def __init__(self, layers: int | Iterable[int], top_k: int = 5, positions: Any = None) -> None:
        if isinstance(layers, (str, bytes)) or _int(layers) is not None:
            layers = [layers] if _int(layers) is not None else layers  # type: ignore[list-item]
        try:
            listed = list(layers)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidOption(f"lens layers must be a list of ints, got {short_repr(layers)}") from None
        checked = [_int(layer) for layer in listed]
        if not checked or any(layer is None for layer in checked):
            raise InvalidOption(f"lens layers must be a non-empty list of ints, got {short_repr(listed)}")
        if len(checked) > MAX_LENS_LAYERS:
            raise InvalidOption(f"a lens reads at most {MAX_LENS_LAYERS} layers, got {len(checked)}")
        if len(set(checked)) != len(checked):
            raise InvalidOption(f"lens layers repeat a layer: {short_repr(listed)}")
        k = _int(top_k)
        if k is None or not 1 <= k <= MAX_LENS_TOP_K:
            raise InvalidOption(f"lens top_k must be an int from 1 to {MAX_LENS_TOP_K}, got {short_repr(top_k)}")
        object.__setattr__(self, "layers", tuple(int(layer) for layer in checked if layer is not None))
        object.__setattr__(self, "top_k", k)
        object.__setattr__(self, "positions", _lens_positions(positions))

    def to_json(self) -> dict[str, Any]:
        positions: Any = self.positions if not isinstance(self.positions, tuple) else list(self.positions)
        return {"layers": list(self.layers), "top_k": self.top_k, "positions": positions}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LensRequest:
        if not isinstance(data, Mapping):
            raise InvalidOption(f"a lens request is an object with 'layers' and 'top_k', got {short_repr(data)}")
        unknown = sorted(set(data) - {"layers", "top_k", "positions"})
        if unknown:
            raise InvalidOption(f"unknown lens field(s) {', '.join(unknown)}; valid: layers, top_k, positions")
        if "layers" not in data:
            raise InvalidOption("a lens request needs 'layers' (a list of layer indices)")
        return cls(data["layers"], data.get("top_k", 5), data.get("positions"))


def _lens_positions(value: Any) -> str | tuple[int, ...] | None:
    """``None``, ``"prompt"``, a chat span name, or explicit prompt indices (checked as a
    steering write's positions are)."""
    if value is None:
        return None
    if isinstance(value, str) and value in ("all", "generated"):
        raise InvalidOption(
            f"lens positions name prompt positions to read once the prompt is processed ('prompt', indices or a "
            f"chat span); every generated token is read already, so {value!r} is not needed"
        )
    try:
        parsed = as_positions(value)
    except InvalidSteering as exc:
        raise InvalidOption(f"lens positions: {exc}") from None
    return parsed


@dataclass(frozen=True)
class LensTopK:
    """The lens at one position: for each of ``layers`` (absolute), the top-k ids ``[n_layers, k]``
    (int64, best first) and their probabilities ``[n_layers, k]`` (float32, over the whole
    vocabulary)."""

    position: int
    layers: tuple[int, ...]
    ids: torch.Tensor
    probs: torch.Tensor

    def top(self, layer: int) -> list[tuple[int, float]]:
        """``(token_id, probability)`` pairs at ``layer`` (absolute), best first."""
        row = self.layers.index(layer)
        return [(int(i), float(p)) for i, p in zip(self.ids[row], self.probs[row], strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "layers": list(self.layers),
            "ids": self.ids.tolist(),
            "probs": self.probs.tolist(),
        }


@dataclass(frozen=True)
class LensResult:
    """The lens over many positions: ``ids`` and ``probs`` ``[n_layers, n_positions, k]`` at
    ``positions`` (absolute sequence indices, ascending) and ``layers`` (absolute)."""

    layers: tuple[int, ...]
    positions: tuple[int, ...]
    ids: torch.Tensor
    probs: torch.Tensor

    def at(self, position: int) -> LensTopK:
        """The lens at one sequence position."""
        if position not in self.positions:
            raise KeyError(f"the lens was not read at position {position}; it holds {list(self.positions)}")
        col = self.positions.index(position)
        return LensTopK(position, self.layers, self.ids[:, col], self.probs[:, col])

    @classmethod
    def stack(cls, steps: Sequence[LensTopK]) -> LensResult:
        """One result of per-position lenses (same layers), ordered by position."""
        if not steps:
            raise ValueError("no lens steps to stack")
        ordered = sorted(steps, key=lambda s: s.position)
        layers = ordered[0].layers
        if any(s.layers != layers for s in ordered):
            raise ValueError("lens steps read different layers")
        return cls(
            layers,
            tuple(s.position for s in ordered),
            torch.stack([s.ids for s in ordered], dim=1),
            torch.stack([s.probs for s in ordered], dim=1),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "positions": list(self.positions),
            "ids": self.ids.tolist(),
            "probs": self.probs.tolist(),
        }

    def labelled(self, decode: Callable[[list[int]], Sequence[str]] | None = None) -> Labelled:
        """The probabilities as a :class:`~interp_engine.Labelled` ``[layer, position, rank]``
        (layers and positions absolute, rank 0 the top-1), for tables and plots:
        ``.at(layer=3, position=7, rank=0)``. ``meta["ids"]`` holds the token ids in the same
        shape (nested lists) and, with ``decode`` (ids to strings, e.g. ``model.to_str_tokens``,
        called once), ``meta["tokens"]`` their strings."""
        meta: dict[str, Any] = {"what": "logit lens (resid_post)", "ids": self.ids.tolist()}
        if decode is not None:
            flat = [int(i) for i in self.ids.flatten().tolist()]
            pieces = list(decode(flat))
            if len(pieces) != len(flat):
                raise InvalidActivations(
                    f"decode returned {len(pieces)} strings for {len(flat)} ids; it maps a list of ids to one "
                    "string per id (as model.to_str_tokens does)"
                )
            n_layers, n_pos, k = self.ids.shape
            meta["tokens"] = [
                [pieces[(layer * n_pos + pos) * k : (layer * n_pos + pos + 1) * k] for pos in range(n_pos)]
                for layer in range(n_layers)
            ]
        coords = {
            "layer": list(self.layers),
            "position": list(self.positions),
            "rank": list(range(self.ids.shape[-1])),
        }
        return Labelled(self.probs.detach().float().cpu(), ("layer", "position", "rank"), coords, meta)

    def plot(self, **options: Any) -> Any:
        """A matplotlib figure (the ``plots`` extra) of the top-1 token per layer and position:
        :func:`interp_engine.plot.lens`; ``options`` go to it (``decode=``, ``tokens=``, ``ax=``,
        ``title=``)."""
        from .. import plot

        return plot.lens(self, **options)


def lens_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` ids (int64) and probabilities (float32) of logits ``[..., vocab]``: softmax
    over the whole vocabulary in float32 first. Every backend's lens goes through this."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    return ids.to(torch.int64), top
