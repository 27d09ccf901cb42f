"""The logit lens: a prompt's lens and the lens read during a generation, as heatmaps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ._draw import (
    MAX_ANNOTATED,
    LensResult,
    is_lens_result,
    new_axes,
    put_ticks,
    put_title,
    require,
    token_label,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def logit_lens(
    logits: torch.Tensor,
    *,
    tokens: Sequence[str],
    layers: Sequence[str] | None = None,
    decode: Callable[[list[int]], Sequence[str]] | None = None,
    target: int | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """A logit-lens heatmap: rows are residual streams (``layers``, e.g.
    ``cache.stack_labels("resid_post", include_embed=True)``), columns the input ``tokens``;
    each cell is coloured by the probability of the top-1 next token (or of the token id
    ``target``) decoded there, and, with ``decode`` (ids to strings, e.g.
    ``model.to_str_tokens``), names that token.

    ``logits``: ``[len(layers), len(tokens), vocab]`` (log-probabilities work too), e.g.
    ``decode_residuals(model, cache.stack("resid_post", include_embed=True))[:, 0]``."""
    values = torch.as_tensor(logits).detach().float().cpu()
    require(
        values.dim() == 3,
        f"logit_lens takes logits [layers, positions, vocab], got shape {list(values.shape)} "
        "(one row of a batch: logits[:, row])",
    )
    n_rows, n_pos, vocab = values.shape
    require(len(tokens) == n_pos, f"{len(tokens)} tokens for {n_pos} positions")
    row_labels = [str(r) for r in layers] if layers is not None else [str(i) for i in range(n_rows)]
    require(len(row_labels) == n_rows, f"{len(row_labels)} layer labels for {n_rows} rows")
    probs = values.softmax(-1)
    top = probs.max(-1)
    if target is not None:
        require(0 <= target < vocab, f"target {target} is outside the vocabulary (0..{vocab - 1})")
        shown = probs[..., target]
    else:
        shown = top.values
    if title is None:
        title = "logit lens: " + ("top-1 next token" if target is None else f"P(token {target})")
    return _top1_heatmap(
        shown,
        top.indices,
        decode,
        rows=row_labels,
        cols=[token_label(t) for t in tokens],
        xlabel="input token (each column predicts the token after it)",
        ylabel="residual stream",
        ax=ax,
        title=title,
        colorbar_label="probability of the top-1 token" if target is None else f"probability of token {target}",
    )


def _top1_heatmap(
    shown: torch.Tensor,
    top_ids: torch.Tensor,
    decode: Callable[[list[int]], Sequence[str]] | None,
    *,
    rows: Sequence[str],
    cols: Sequence[str],
    xlabel: str,
    ylabel: str,
    ax: Axes | None,
    title: str,
    colorbar_label: str,
) -> Figure:
    """The lens heatmaps' drawing: ``shown`` ``[rows, cols]`` probabilities coloured 0..1, and
    with ``decode`` the token ``top_ids[row, col]`` written in each cell (up to 40 x 40)."""
    n_rows, n_cols = shown.shape
    fig, ax = new_axes(ax, (max(5.0, 0.75 * n_cols + 2.5), max(3.0, 0.42 * n_rows + 1.8)))
    image = ax.imshow(shown.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    if decode is not None and n_cols <= MAX_ANNOTATED and n_rows <= MAX_ANNOTATED:
        size = 8.0 if n_cols <= 16 else 6.5
        for row in range(n_rows):
            for col in range(n_cols):
                piece = token_label(decode([int(top_ids[row, col])])[0], 9)
                dark = float(shown[row, col]) < 0.6
                ax.text(
                    col, row, piece, ha="center", va="center", fontsize=size, color="white" if dark else "black"
                ).set_parse_math(False)
    put_ticks(ax, "x", list(cols), rotate=True)
    put_ticks(ax, "y", list(rows))
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    put_title(ax, title)
    fig.colorbar(image, ax=ax, label=colorbar_label)
    return fig


def lens(
    result: LensResult,
    *,
    decode: Callable[[list[int]], Sequence[str]] | None = None,
    tokens: Sequence[str] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """The logit lens read during a generation (a :class:`~interp_engine.LensResult`, e.g.
    ``cache.lens`` of ``capture_generation(..., lens=LensRequest(...))``) as a heatmap: rows its
    layers (``resid_post``), columns its positions; each cell coloured by the top-1 token's
    probability and, with ``decode`` (ids to strings, e.g. ``model.to_str_tokens``), naming it.

    ``tokens``: one string per token of the whole sequence (prompt + generated, e.g.
    ``model.to_str_tokens(prompt_ids + completion.token_ids)``): the columns are then labelled
    by the token read at each position (whose lens predicts the token after it), else by the
    position."""
    require(is_lens_result(result), f"plot.lens draws a LensResult, got {type(result).__name__}")
    if tokens is not None:
        longest = max(result.positions, default=-1)
        require(len(tokens) > longest, f"{len(tokens)} tokens for positions up to {longest}")
        cols = [f"{p} {token_label(tokens[p])}" for p in result.positions]
    else:
        cols = [str(p) for p in result.positions]
    return _top1_heatmap(
        result.probs[..., 0].detach().float().cpu(),
        result.ids[..., 0],
        decode,
        rows=[f"resid_post.{layer}" for layer in result.layers],
        cols=cols,
        xlabel="position (each column predicts the token after it)",
        ylabel="residual stream",
        ax=ax,
        title="logit lens during generation: top-1 next token" if title is None else title,
        colorbar_label="probability of the top-1 token",
    )
