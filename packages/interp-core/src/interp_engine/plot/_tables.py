"""Signed tables: patching heatmaps and direct logit attribution bars."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._draw import (
    MAX_ANNOTATED,
    Labelled,
    as_2d,
    is_labelled,
    new_axes,
    put_ticks,
    put_title,
    require,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _labelled_2d(values: torch.Tensor | Labelled, rows: Sequence[Any] | None, cols: Sequence[Any] | None) -> Any:
    if is_labelled(values):
        require(
            values.values.dim() in (1, 2),
            f"patching draws a 2-D table; this result has axes {values.dims}: pick one slice with "
            f".at({values.dims[-1]}=...) first",
        )
        if values.values.dim() == 1:
            return values.values[None], [""], values.labels(values.dims[0]), "", values.dims[0], values.meta
        return values.values, values.labels(values.dims[0]), values.labels(values.dims[1]), *values.dims, values.meta
    tensor = torch.as_tensor(values)
    if tensor.dim() == 1:
        tensor = tensor[None]
        rows = rows if rows is not None else [""]
    tensor = as_2d(tensor, "patching")
    row_labels = list(rows) if rows is not None else list(range(tensor.shape[0]))
    col_labels = list(cols) if cols is not None else list(range(tensor.shape[1]))
    return tensor, row_labels, col_labels, None, None, {}


def patching(
    values: torch.Tensor | Labelled,
    *,
    rows: Sequence[Any] | None = None,
    cols: Sequence[Any] | None = None,
    row_label: str | None = None,
    col_label: str | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    colorbar_label: str | None = None,
) -> Figure:
    """A patching heatmap (or any signed table): a diverging colormap centred at 0 (red below,
    blue above, white at 0, symmetric limits) and a colorbar; each cell's value is written in it
    for tables up to 40 x 40.

    ``values``: a :class:`~interp_engine.Labelled` result of two axes (a patching sweep,
    ``layer x position``; its axis names and labels are used) or a 2-D tensor with ``rows`` and
    ``cols`` labels (e.g. layers x positions)."""
    table, row_labels, col_labels, row_dim, col_dim, meta = _labelled_2d(values, rows, cols)
    table = table.detach().float().cpu()
    n_rows, n_cols = table.shape
    require(len(row_labels) == n_rows, f"patching: {len(row_labels)} row labels for {n_rows} rows")
    require(len(col_labels) == n_cols, f"patching: {len(col_labels)} column labels for {n_cols} columns")
    from matplotlib.colors import CenteredNorm

    fig, ax = new_axes(ax, (max(4.5, 0.7 * n_cols + 2.8), max(3.0, 0.45 * n_rows + 1.8)))
    finite = table[torch.isfinite(table)]
    half = float(finite.abs().max()) if finite.numel() else 1.0
    image = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", norm=CenteredNorm(vcenter=0.0, halfrange=half or 1.0))
    if n_rows <= MAX_ANNOTATED and n_cols <= MAX_ANNOTATED:
        size = 8.0 if n_cols <= 16 else 6.5
        for r in range(n_rows):
            for c in range(n_cols):
                value = float(table[r, c])
                strong = half > 0 and abs(value) > 0.6 * half
                ax.text(
                    c, r, f"{value:.2f}", ha="center", va="center", fontsize=size, color="white" if strong else "black"
                )
    put_ticks(ax, "x", [str(c) for c in col_labels], rotate=any(len(str(c)) > 3 for c in col_labels))
    put_ticks(ax, "y", [str(r) for r in row_labels])
    if col_label or col_dim:
        ax.set_xlabel(col_label or col_dim or "", fontsize=10)
    if row_label or row_dim:
        ax.set_ylabel(row_label or row_dim or "", fontsize=10)
    metric = str(meta.get("metric", "")) if meta else ""
    if title is None and meta:
        title = f"activation patching: {meta.get('kind', '')} ({meta.get('direction', '')})".replace(" ()", "")
    put_title(ax, title)
    if colorbar_label is None:
        colorbar_label = metric + (" (normalised)" if meta.get("normalized") else "") if metric else "value"
    fig.colorbar(image, ax=ax, label=textwrap.fill(colorbar_label, 28))
    return fig


def dla(
    contributions: torch.Tensor | Labelled,
    *,
    labels: Sequence[str] | None = None,
    top: int | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    xlabel: str = "contribution to the logit difference",
) -> Figure:
    """A bar chart of each component's contribution (direct logit attribution): one horizontal
    bar per component (names on the y axis, in the order given, first at the top), blue above 0
    and red below, a line at 0, the value at each bar's end.

    ``contributions``: ``[components]`` with ``labels``, or a one-axis
    :class:`~interp_engine.Labelled`; ``top=k`` keeps the ``k`` largest in magnitude (in their
    order)."""
    if is_labelled(contributions):
        require(
            contributions.values.dim() == 1,
            f"dla draws one axis of components; this result has axes {contributions.dims}: pick one with "
            f".at({contributions.dims[0]}=...) first",
        )
        values = contributions.values.detach().float().cpu()
        names = [str(x) for x in contributions.labels(contributions.dims[0])]
    else:
        values = torch.as_tensor(contributions).detach().float().cpu()
        require(values.dim() == 1, f"dla takes contributions [components], got shape {list(values.shape)}")
        names = [str(x) for x in labels] if labels is not None else [str(i) for i in range(values.shape[0])]
    require(len(names) == values.shape[0], f"dla: {len(names)} labels for {values.shape[0]} components")
    order = list(range(values.shape[0]))
    if top is not None and top < len(order):
        kept = set(values.abs().argsort(descending=True)[:top].tolist())
        order = [i for i in order if i in kept]
    shown = values[order]
    n = len(order)
    fig, ax = new_axes(ax, (7.0, max(2.5, 0.32 * n + 1.4)))
    colours = ["#2166ac" if float(v) >= 0 else "#b2182b" for v in shown]
    ax.barh(range(n), shown.numpy(), color=colours)
    ax.axvline(0.0, color="black", linewidth=0.8)
    put_ticks(ax, "y", [names[i] for i in order])
    ax.set_ylim(n - 0.5, -0.5)
    if n <= MAX_ANNOTATED:
        span = float(shown.abs().max()) if n else 0.0
        for i, value in enumerate(shown.tolist()):
            pad = 0.01 * span
            ax.text(
                value + (pad if value >= 0 else -pad),
                i,
                f"{value:.2f}",
                va="center",
                ha="left" if value >= 0 else "right",
                fontsize=8,
            )
        if span:
            ax.set_xlim(min(0.0, float(shown.min())) - 0.15 * span, max(0.0, float(shown.max())) + 0.15 * span)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel("component", fontsize=10)
    ax.tick_params(axis="x", labelsize=9)
    put_title(ax, title or ("direct logit attribution" + (f" (top {n})" if top is not None else "")))
    return fig
