"""Attention patterns per head, and the induction view."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._draw import (
    figure_class,
    put_ticks,
    put_title,
    require,
    root_figure,
    token_label,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage


def _heads(pattern: torch.Tensor | Any, heads: Sequence[int] | None, what: str) -> tuple[torch.Tensor, list[int]]:
    values = torch.as_tensor(pattern).detach().float().cpu()
    if values.dim() == 2:
        values = values[None]
        chosen = [0] if heads is None else list(heads)
        require(len(chosen) == 1, f"{what}: a 2-D pattern is one head; heads= names one")
        return values, chosen
    require(
        values.dim() == 3 and values.shape[1] == values.shape[2],
        f"{what} takes a pattern [heads, q, k] or [q, k] (one row of a batch: cache['attn_pattern.L'][row]), "
        f"got shape {list(values.shape)}",
    )
    chosen = list(range(values.shape[0])) if heads is None else list(heads)
    require(bool(chosen), f"{what}: heads= is empty")
    for head in chosen:
        require(0 <= head < values.shape[0], f"{what}: head {head} is outside 0..{values.shape[0] - 1}")
    return values[chosen], chosen


def _panels(ax: Axes | None, n: int, side: float, cols: int | None) -> tuple[Figure, list[Axes], int]:
    """One Axes per head: ``ax`` for a single one, else a grid on a new figure."""
    if ax is not None:
        require(n == 1, f"ax= takes one head; {n} were asked for (pick one with heads=[h], or leave ax out)")
        return root_figure(ax), [ax], 1
    cols = min(n, cols or 4)
    rows = math.ceil(n / cols)
    fig = figure_class()(figsize=(side * cols + 1.2, side * rows + 0.8), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes, cols


def attention(
    pattern: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    cols: int | None = None,
) -> Figure:
    """Attention patterns, one heatmap per head (query rows, key columns), token labels on both
    axes (``tokens``; positions without them) and one colorbar (attention probability, 0..1).

    ``pattern``: ``[heads, q, k]`` (``cache["attn_pattern.1"][0]``) or one head's ``[q, k]``;
    ``heads`` picks which to draw (default all); ``ax`` draws one head on your Axes."""
    values, chosen = _heads(pattern, heads, "attention")
    n = values.shape[-1]
    labels = [token_label(t, 12) for t in tokens] if tokens is not None else [str(i) for i in range(n)]
    require(len(labels) == n, f"attention: {len(labels)} tokens for a pattern over {n} positions")
    side = min(7.0, max(3.4, 0.26 * n + 1.6))
    fig, axes, cols = _panels(ax, len(chosen), side, cols)
    image: AxesImage | None = None
    for i, (panel, head) in enumerate(zip(axes, chosen, strict=True)):
        image = panel.imshow(values[i].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        put_ticks(panel, "x", labels, rotate=True)
        put_ticks(panel, "y", labels)
        if i % cols == 0:
            panel.set_ylabel("query", fontsize=10)
        if len(chosen) - i <= cols:  # the bottom row of panels
            panel.set_xlabel("key", fontsize=10)
        put_title(panel, f"head {head}", 10.0)
    if title:
        if ax is None:
            fig.suptitle(title, fontsize=12).set_parse_math(False)
        else:
            put_title(ax, f"{title}, head {chosen[0]}")
    if image is not None:
        fig.colorbar(image, ax=axes, label="attention probability", shrink=0.9)
    return fig


def induction(
    pattern: torch.Tensor,
    *,
    repeat_start: int,
    length: int | None = None,
    heads: Sequence[int] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    cols: int | None = None,
) -> Figure:
    """Attention on a sequence that repeats: one heatmap per head with position ticks, a
    colorbar, dashed lines where the repeat starts (``repeat_start``, the first position of the
    second copy) and the induction stripe dotted (each token of the second copy looking at the
    token after its earlier occurrence), and each head's induction score (the mean attention on
    that stripe) in its title.

    ``length`` is the repeated block's length (default: ``seq - repeat_start``); ``pattern`` is
    ``[heads, q, k]`` or ``[q, k]``."""
    values, chosen = _heads(pattern, heads, "induction")
    n = values.shape[-1]
    block = n - repeat_start if length is None else length
    require(
        0 < block <= repeat_start < n and repeat_start + block <= n,
        f"induction: the repeat starts at {repeat_start} and is {block} long, which does not fit {n} positions "
        "after its first copy",
    )
    queries = torch.arange(repeat_start, repeat_start + block)
    keys = queries - block + 1
    scores = values[:, queries, keys].mean(-1)
    side = min(6.5, max(3.6, 0.09 * n + 2.6))
    fig, axes, cols = _panels(ax, len(chosen), side, cols)
    step = max(1, math.ceil(n / 12))
    image: AxesImage | None = None
    for i, (panel, head) in enumerate(zip(axes, chosen, strict=True)):
        image = panel.imshow(values[i].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        ticks = list(range(0, n, step))
        panel.set_xticks(ticks)
        panel.set_xticklabels([str(t) for t in ticks], fontsize=9)
        panel.set_yticks(ticks)
        panel.set_yticklabels([str(t) for t in ticks], fontsize=9)
        edge = repeat_start - 0.5
        panel.axvline(edge, color="crimson", linestyle="--", linewidth=1.2, label=f"repeat starts ({repeat_start})")
        panel.axhline(edge, color="crimson", linestyle="--", linewidth=1.2)
        panel.plot(
            keys.numpy(), queries.numpy(), linestyle=":", color="orange", linewidth=1.4, label="induction target"
        )
        panel.set_xlim(-0.5, n - 0.5)
        panel.set_ylim(n - 0.5, -0.5)
        if i % cols == 0:
            panel.set_ylabel("query position", fontsize=10)
        if len(chosen) - i <= cols:
            panel.set_xlabel("key position", fontsize=10)
        put_title(panel, f"head {head}: induction {float(scores[i]):.2f}", 10.0)
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.85)
    if title:
        if ax is None:
            fig.suptitle(title, fontsize=12).set_parse_math(False)
        else:
            put_title(ax, f"{title}\nhead {chosen[0]}: induction {float(scores[0]):.2f}")
    if image is not None:
        fig.colorbar(image, ax=axes, label="attention probability", shrink=0.9)
    return fig
