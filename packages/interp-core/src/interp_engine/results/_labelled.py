"""A tensor with named axes and a label per index: what patching sweeps, attribution and direct
logit attribution return, ready to print, index and plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class Labelled:
    """``values`` with one name per axis (``dims``) and one label per index of each axis
    (``coords[dim]``): layers as ints, positions as ``"3 ' Paris'"``, heads as ints, components
    as names (``"embed"``, ``"attn_out.0"``, ``"L1H3"``). ``meta`` holds what the numbers are
    relative to (a sweep's baselines, the metric's name)."""

    values: torch.Tensor
    dims: tuple[str, ...]
    coords: Mapping[str, Sequence[Any]]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.dims) != self.values.dim():
            raise ValueError(f"{len(self.dims)} axis names for a tensor of {self.values.dim()} axes")
        for axis, dim in enumerate(self.dims):
            labels = self.coords.get(dim)
            if labels is None or len(labels) != self.values.shape[axis]:
                raise ValueError(f"axis {dim!r} has {self.values.shape[axis]} entries but {labels!r} as labels")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def labels(self, dim: str) -> list[Any]:
        """The labels along ``dim``."""
        return list(self.coords[dim])

    def index(self, dim: str, label: Any) -> int:
        """The index of ``label`` along ``dim`` (a layer number, a component name, ...)."""
        labels = self.labels(dim)
        if label not in labels:
            raise KeyError(f"{label!r} is not a label of {dim!r}; labels: {labels[:20]}")
        return labels.index(label)

    def at(self, **where: Any) -> float | Labelled:
        """The value (or the sub-table) at the given labels: ``result.at(layer=2, position=5)``."""
        values = self.values
        dims = list(self.dims)
        for dim, label in where.items():
            if dim not in dims:
                raise KeyError(f"no axis {dim!r}; axes: {dims}")
            axis = dims.index(dim)
            values = values.select(axis, self.index(dim, label))
            dims.pop(axis)
        if not dims:
            return float(values)
        return Labelled(values, tuple(dims), {d: self.coords[d] for d in dims}, self.meta)

    def top(self, k: int = 10) -> list[tuple[tuple[Any, ...], float]]:
        """The ``k`` entries of largest magnitude, as ``((label per axis), value)``, largest first."""
        flat = self.values.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        out = []
        for i in order.tolist():
            index = []
            rest = i
            for size in reversed(self.values.shape):
                index.append(rest % size)
                rest //= size
            index.reverse()
            out.append((tuple(self.coords[d][j] for d, j in zip(self.dims, index, strict=True)), float(flat[i])))
        return out

    def plot(self, **options: Any) -> Any:
        """A matplotlib figure (the ``plots`` extra): a heatmap of two axes
        (:func:`interp_engine.plot.patching`), bars of one (:func:`interp_engine.plot.dla`);
        ``options`` go to that function (``ax=``, ``title=``, ...). Slice a third axis away
        first with :meth:`at`."""
        from .. import plot

        if self.values.dim() == 1 and self.dims[0] == "component":
            return plot.dla(self, **options)
        return plot.patching(self, **options)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "dims": list(self.dims),
            "coords": {d: [_plain(c) for c in self.coords[d]] for d in self.dims},
            "values": self.values.tolist(),
            "meta": {k: v for k, v in self.meta.items() if isinstance(v, (int, float, str, bool, list, type(None)))},
        }

    def __repr__(self) -> str:
        axes = ", ".join(f"{d}={self.values.shape[i]}" for i, d in enumerate(self.dims))
        return f"Labelled({axes}, meta={dict(self.meta)!r})"


def _plain(label: Any) -> Any:
    return label if isinstance(label, (int, float, str)) else str(label)
