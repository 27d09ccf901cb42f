"""What every plot shares: new figures and axes, token labels, ticks and titles, the shapes of the
results it draws (read by their fields), and the checks of its inputs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from .._errors import InvalidActivations

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


INSTALL = "pip install 'interp-core[plots]'"
"""How to get matplotlib, as the error says it."""

EDGE_SPACE = "\u2423"  # ␣
ESCAPES = {"\n": "\u21b5", "\t": "\u21e5"}  # ↵ ⇥
MAX_ANNOTATED = 40
"""Heatmaps write a value or token in each cell up to this many rows and columns."""


def figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"interp_engine.plot draws with matplotlib, which is not installed: {INSTALL}") from exc
    return Figure


def new_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its figure, or a new figure (constrained layout) with one Axes."""
    figure = figure_class()
    if ax is not None:
        return root_figure(ax), ax
    fig = figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def root_figure(ax: Axes) -> Figure:
    fig: Any = ax.figure
    while not isinstance(fig, figure_class()):  # a SubFigure: its parent figure
        fig = fig.figure
    return fig


def token_label(piece: str, width: int = 14) -> str:
    """A token as a plot shows it: a space at its start or end as ``␣`` (so ``" Paris"`` and
    ``"Paris"`` differ), a newline ``↵``, a tab ``⇥``, other control characters escaped, an empty
    token ``''``; cut to ``width`` characters with ``…``."""
    if not piece:
        return "''"
    core = piece.strip(" ")
    if not core:
        text = EDGE_SPACE * len(piece)
    else:
        lead = len(piece) - len(piece.lstrip(" "))
        trail = len(piece) - len(piece.rstrip(" "))
        inner = "".join(ESCAPES.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in core)
        text = EDGE_SPACE * lead + inner + EDGE_SPACE * trail
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def tick_size(n: int) -> float:
    """A readable tick-label size for ``n`` labels on one axis."""
    return 10.0 if n <= 12 else 9.0 if n <= 24 else 8.0 if n <= 40 else 7.0


def tick_step(n: int, most: int = 48) -> int:
    """Label every ``step``-th tick, so at most about ``most`` labels show."""
    return max(1, math.ceil(n / most))


def put_ticks(ax: Axes, axis: str, labels: Sequence[str], *, rotate: bool = False) -> None:
    """Ticks at every index (labelled every few when there are many), readable sizes, text
    drawn as is (``$`` in a token is not math)."""
    step = tick_step(len(labels))
    where = list(range(0, len(labels), step))
    shown = [labels[i] for i in where]
    size = tick_size(len(where))
    if axis == "x":
        ax.set_xticks(where)
        ax.set_xticklabels(shown, fontsize=size, rotation=60 if rotate else 0, ha="right" if rotate else "center")
        for text in ax.get_xticklabels():
            text.set_parse_math(False)
    else:
        ax.set_yticks(where)
        ax.set_yticklabels(shown, fontsize=size)
        for text in ax.get_yticklabels():
            text.set_parse_math(False)


def put_title(ax: Axes, title: str | None, size: float = 11.0) -> None:
    if title:
        ax.set_title(title, fontsize=size).set_parse_math(False)


class Labelled(Protocol):
    """What the plots read of a :class:`~interp_engine.Labelled` (this module draws results without
    importing them: the results call it from their own ``plot()``)."""

    @property
    def values(self) -> torch.Tensor: ...
    @property
    def dims(self) -> tuple[str, ...]: ...
    @property
    def coords(self) -> Mapping[str, Sequence[Any]]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...

    def labels(self, dim: str) -> list[Any]: ...


class LensResult(Protocol):
    """What :func:`lens` reads of a :class:`~interp_engine.LensResult`."""

    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def positions(self) -> tuple[int, ...]: ...
    @property
    def ids(self) -> torch.Tensor: ...

    @property
    def probs(self) -> torch.Tensor: ...


class FeatureReadout(Protocol):
    """What :func:`features` reads of a :class:`~interp_engine.FeatureReadout`."""

    @property
    def values(self) -> torch.Tensor: ...
    @property
    def ids(self) -> torch.Tensor | None: ...


def is_labelled(value: object) -> TypeGuard[Labelled]:
    """Whether ``value`` is a :class:`~interp_engine.Labelled` (told by its fields)."""
    return all(hasattr(value, name) for name in ("values", "dims", "coords", "meta", "labels"))


def is_lens_result(value: object) -> TypeGuard[LensResult]:
    """Whether ``value`` is a :class:`~interp_engine.LensResult` (told by its fields)."""
    return all(hasattr(value, name) for name in ("layers", "positions", "ids", "probs", "labelled"))


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidActivations(message)


def as_2d(values: torch.Tensor | Any, what: str) -> torch.Tensor:
    tensor = torch.as_tensor(values).detach().float().cpu()
    require(tensor.dim() == 2, f"{what} takes a 2-D tensor, got shape {list(tensor.shape)}")
    return tensor
