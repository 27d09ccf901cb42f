"""Plots of interpretability results: the logit lens, attention patterns, induction, patching
sweeps, direct logit attribution and SAE features, drawn with matplotlib.

matplotlib is the optional extra ``interp-core[plots]``. ``import interp_engine.plot`` works
without it; a function called without it raises ``ImportError`` naming the install command.

Every function takes plain tensors (or a :class:`~interp_engine.Labelled` result) and labels,
never a model, so it draws what you computed. It draws on a new ``Figure`` (no pyplot state:
safe in scripts, servers and threads) or on ``ax=`` (an ``Axes`` of yours, e.g. from
``plt.subplots()``), and returns the figure: ``fig.savefig("lens.png")``, or leave it as a
notebook cell's value to show it. Tokens keep their edges visible (``token_label``: ``" Paris"``
is drawn ``␣Paris``), and every heatmap has a colorbar.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from ._errors import InvalidActivations

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage


__all__ = ["attention", "dla", "features", "induction", "lens", "logit_lens", "patching", "token_label"]

INSTALL = "pip install 'interp-core[plots]'"
"""How to get matplotlib, as the error says it."""

_EDGE_SPACE = "\u2423"  # ␣
_ESCAPES = {"\n": "\u21b5", "\t": "\u21e5"}  # ↵ ⇥
_MAX_ANNOTATED = 40
"""Heatmaps write a value or token in each cell up to this many rows and columns."""


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"interp_engine.plot draws with matplotlib, which is not installed: {INSTALL}") from exc
    return Figure


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its figure, or a new figure (constrained layout) with one Axes."""
    figure = _figure_class()
    if ax is not None:
        return _root(ax), ax
    fig = figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _root(ax: Axes) -> Figure:
    fig: Any = ax.figure
    while not isinstance(fig, _figure_class()):  # a SubFigure: its parent figure
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
        text = _EDGE_SPACE * len(piece)
    else:
        lead = len(piece) - len(piece.lstrip(" "))
        trail = len(piece) - len(piece.rstrip(" "))
        inner = "".join(_ESCAPES.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in core)
        text = _EDGE_SPACE * lead + inner + _EDGE_SPACE * trail
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _tick_size(n: int) -> float:
    """A readable tick-label size for ``n`` labels on one axis."""
    return 10.0 if n <= 12 else 9.0 if n <= 24 else 8.0 if n <= 40 else 7.0


def _tick_step(n: int, most: int = 48) -> int:
    """Label every ``step``-th tick, so at most about ``most`` labels show."""
    return max(1, math.ceil(n / most))


def _ticks(ax: Axes, axis: str, labels: Sequence[str], *, rotate: bool = False) -> None:
    """Ticks at every index (labelled every few when there are many), readable sizes, text
    drawn as is (``$`` in a token is not math)."""
    step = _tick_step(len(labels))
    where = list(range(0, len(labels), step))
    shown = [labels[i] for i in where]
    size = _tick_size(len(where))
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


def _title(ax: Axes, title: str | None, size: float = 11.0) -> None:
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


def _is_labelled(value: object) -> TypeGuard[Labelled]:
    """Whether ``value`` is a :class:`~interp_engine.Labelled` (told by its fields)."""
    return all(hasattr(value, name) for name in ("values", "dims", "coords", "meta", "labels"))


def _is_lens_result(value: object) -> TypeGuard[LensResult]:
    """Whether ``value`` is a :class:`~interp_engine.LensResult` (told by its fields)."""
    return all(hasattr(value, name) for name in ("layers", "positions", "ids", "probs", "labelled"))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidActivations(message)


def _as_2d(values: torch.Tensor | Any, what: str) -> torch.Tensor:
    tensor = torch.as_tensor(values).detach().float().cpu()
    _check(tensor.dim() == 2, f"{what} takes a 2-D tensor, got shape {list(tensor.shape)}")
    return tensor


# -- the logit lens ------------------------------------------------------------------------------


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
    _check(
        values.dim() == 3,
        f"logit_lens takes logits [layers, positions, vocab], got shape {list(values.shape)} "
        "(one row of a batch: logits[:, row])",
    )
    n_rows, n_pos, vocab = values.shape
    _check(len(tokens) == n_pos, f"{len(tokens)} tokens for {n_pos} positions")
    row_labels = [str(r) for r in layers] if layers is not None else [str(i) for i in range(n_rows)]
    _check(len(row_labels) == n_rows, f"{len(row_labels)} layer labels for {n_rows} rows")
    probs = values.softmax(-1)
    top = probs.max(-1)
    if target is not None:
        _check(0 <= target < vocab, f"target {target} is outside the vocabulary (0..{vocab - 1})")
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
    fig, ax = _new_axes(ax, (max(5.0, 0.75 * n_cols + 2.5), max(3.0, 0.42 * n_rows + 1.8)))
    image = ax.imshow(shown.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    if decode is not None and n_cols <= _MAX_ANNOTATED and n_rows <= _MAX_ANNOTATED:
        size = 8.0 if n_cols <= 16 else 6.5
        for row in range(n_rows):
            for col in range(n_cols):
                piece = token_label(decode([int(top_ids[row, col])])[0], 9)
                dark = float(shown[row, col]) < 0.6
                ax.text(
                    col, row, piece, ha="center", va="center", fontsize=size, color="white" if dark else "black"
                ).set_parse_math(False)
    _ticks(ax, "x", list(cols), rotate=True)
    _ticks(ax, "y", list(rows))
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    _title(ax, title)
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
    _check(_is_lens_result(result), f"plot.lens draws a LensResult, got {type(result).__name__}")
    if tokens is not None:
        longest = max(result.positions, default=-1)
        _check(len(tokens) > longest, f"{len(tokens)} tokens for positions up to {longest}")
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


# -- attention -------------------------------------------------------------------------------------


def _heads(pattern: torch.Tensor | Any, heads: Sequence[int] | None, what: str) -> tuple[torch.Tensor, list[int]]:
    values = torch.as_tensor(pattern).detach().float().cpu()
    if values.dim() == 2:
        values = values[None]
        chosen = [0] if heads is None else list(heads)
        _check(len(chosen) == 1, f"{what}: a 2-D pattern is one head; heads= names one")
        return values, chosen
    _check(
        values.dim() == 3 and values.shape[1] == values.shape[2],
        f"{what} takes a pattern [heads, q, k] or [q, k] (one row of a batch: cache['attn_pattern.L'][row]), "
        f"got shape {list(values.shape)}",
    )
    chosen = list(range(values.shape[0])) if heads is None else list(heads)
    _check(bool(chosen), f"{what}: heads= is empty")
    for head in chosen:
        _check(0 <= head < values.shape[0], f"{what}: head {head} is outside 0..{values.shape[0] - 1}")
    return values[chosen], chosen


def _panels(ax: Axes | None, n: int, side: float, cols: int | None) -> tuple[Figure, list[Axes], int]:
    """One Axes per head: ``ax`` for a single one, else a grid on a new figure."""
    if ax is not None:
        _check(n == 1, f"ax= takes one head; {n} were asked for (pick one with heads=[h], or leave ax out)")
        return _root(ax), [ax], 1
    cols = min(n, cols or 4)
    rows = math.ceil(n / cols)
    fig = _figure_class()(figsize=(side * cols + 1.2, side * rows + 0.8), layout="constrained")
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
    _check(len(labels) == n, f"attention: {len(labels)} tokens for a pattern over {n} positions")
    side = min(7.0, max(3.4, 0.26 * n + 1.6))
    fig, axes, cols = _panels(ax, len(chosen), side, cols)
    image: AxesImage | None = None
    for i, (panel, head) in enumerate(zip(axes, chosen, strict=True)):
        image = panel.imshow(values[i].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        _ticks(panel, "x", labels, rotate=True)
        _ticks(panel, "y", labels)
        if i % cols == 0:
            panel.set_ylabel("query", fontsize=10)
        if len(chosen) - i <= cols:  # the bottom row of panels
            panel.set_xlabel("key", fontsize=10)
        _title(panel, f"head {head}", 10.0)
    if title:
        if ax is None:
            fig.suptitle(title, fontsize=12).set_parse_math(False)
        else:
            _title(ax, f"{title}, head {chosen[0]}")
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
    _check(
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
        _title(panel, f"head {head}: induction {float(scores[i]):.2f}", 10.0)
    axes[0].legend(loc="lower left", fontsize=8, framealpha=0.85)
    if title:
        if ax is None:
            fig.suptitle(title, fontsize=12).set_parse_math(False)
        else:
            _title(ax, f"{title}\nhead {chosen[0]}: induction {float(scores[0]):.2f}")
    if image is not None:
        fig.colorbar(image, ax=axes, label="attention probability", shrink=0.9)
    return fig


# -- patching and attribution --------------------------------------------------------------------


def _labelled_2d(values: torch.Tensor | Labelled, rows: Sequence[Any] | None, cols: Sequence[Any] | None) -> Any:
    if _is_labelled(values):
        _check(
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
    tensor = _as_2d(tensor, "patching")
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
    _check(len(row_labels) == n_rows, f"patching: {len(row_labels)} row labels for {n_rows} rows")
    _check(len(col_labels) == n_cols, f"patching: {len(col_labels)} column labels for {n_cols} columns")
    from matplotlib.colors import CenteredNorm

    fig, ax = _new_axes(ax, (max(4.5, 0.7 * n_cols + 2.8), max(3.0, 0.45 * n_rows + 1.8)))
    finite = table[torch.isfinite(table)]
    half = float(finite.abs().max()) if finite.numel() else 1.0
    image = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", norm=CenteredNorm(vcenter=0.0, halfrange=half or 1.0))
    if n_rows <= _MAX_ANNOTATED and n_cols <= _MAX_ANNOTATED:
        size = 8.0 if n_cols <= 16 else 6.5
        for r in range(n_rows):
            for c in range(n_cols):
                value = float(table[r, c])
                strong = half > 0 and abs(value) > 0.6 * half
                ax.text(
                    c, r, f"{value:.2f}", ha="center", va="center", fontsize=size, color="white" if strong else "black"
                )
    _ticks(ax, "x", [str(c) for c in col_labels], rotate=any(len(str(c)) > 3 for c in col_labels))
    _ticks(ax, "y", [str(r) for r in row_labels])
    if col_label or col_dim:
        ax.set_xlabel(col_label or col_dim or "", fontsize=10)
    if row_label or row_dim:
        ax.set_ylabel(row_label or row_dim or "", fontsize=10)
    metric = str(meta.get("metric", "")) if meta else ""
    if title is None and meta:
        title = f"activation patching: {meta.get('kind', '')} ({meta.get('direction', '')})".replace(" ()", "")
    _title(ax, title)
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
    if _is_labelled(contributions):
        _check(
            contributions.values.dim() == 1,
            f"dla draws one axis of components; this result has axes {contributions.dims}: pick one with "
            f".at({contributions.dims[0]}=...) first",
        )
        values = contributions.values.detach().float().cpu()
        names = [str(x) for x in contributions.labels(contributions.dims[0])]
    else:
        values = torch.as_tensor(contributions).detach().float().cpu()
        _check(values.dim() == 1, f"dla takes contributions [components], got shape {list(values.shape)}")
        names = [str(x) for x in labels] if labels is not None else [str(i) for i in range(values.shape[0])]
    _check(len(names) == values.shape[0], f"dla: {len(names)} labels for {values.shape[0]} components")
    order = list(range(values.shape[0]))
    if top is not None and top < len(order):
        kept = set(values.abs().argsort(descending=True)[:top].tolist())
        order = [i for i in order if i in kept]
    shown = values[order]
    n = len(order)
    fig, ax = _new_axes(ax, (7.0, max(2.5, 0.32 * n + 1.4)))
    colours = ["#2166ac" if float(v) >= 0 else "#b2182b" for v in shown]
    ax.barh(range(n), shown.numpy(), color=colours)
    ax.axvline(0.0, color="black", linewidth=0.8)
    _ticks(ax, "y", [names[i] for i in order])
    ax.set_ylim(n - 0.5, -0.5)
    if n <= _MAX_ANNOTATED:
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
    _title(ax, title or ("direct logit attribution" + (f" (top {n})" if top is not None else "")))
    return fig


# -- SAE features ----------------------------------------------------------------------------------

MAX_FEATURES = 48
""":func:`features` draws at most this many features (the strongest)."""


def features(
    readout: FeatureReadout,
    *,
    tokens: Sequence[str],
    names: Mapping[int, str] | None = None,
    max_features: int = MAX_FEATURES,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """An SAE's features per token: tokens (rows) x the union of the features read at them
    (columns, at most ``max_features``, the strongest, ordered by the token each is strongest
    on), coloured by activation, named features labelled ``id (name)``, and a colorbar.

    ``readout``: one prompt's top-k or ids readout (``values``/``ids`` ``[tokens, k]``, e.g.
    ``sync.capture(ids, [spec])[spec]``); ids ``-1`` (fewer fired) are left out."""
    values = readout.values.detach().float().cpu()
    _check(values.dim() == 2, f"features takes one prompt's readout [tokens, k], got {list(values.shape)}")
    dense = readout.ids is None
    ids = torch.arange(values.shape[1]).expand_as(values) if readout.ids is None else readout.ids.cpu()
    _check(len(tokens) == values.shape[0], f"features: {len(tokens)} tokens for {values.shape[0]} positions")
    strongest: dict[int, tuple[float, int]] = {}  # feature -> (its largest value, at which token)
    cells: list[dict[int, float]] = []
    for position in range(values.shape[0]):
        pairs = zip(ids[position].tolist(), values[position].tolist(), strict=True)
        row = {int(i): float(v) for i, v in pairs if i >= 0 and (v != 0 or not dense)}
        cells.append(row)
        for feature, value in row.items():
            if feature not in strongest or value > strongest[feature][0]:
                strongest[feature] = (value, position)
    chosen = sorted(strongest, key=lambda f: -strongest[f][0])[:max_features]
    columns = sorted(chosen, key=lambda f: (strongest[f][1], -strongest[f][0]))
    grid = torch.zeros(len(tokens), len(columns))
    for position, row in enumerate(cells):
        for col, feature in enumerate(columns):
            grid[position, col] = row.get(feature, 0.0)
    named = names or {}
    fig, ax = _new_axes(ax, (max(4.5, 0.3 * len(columns) + 3.0), max(2.8, 0.34 * len(tokens) + 2.0)))
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="magma", vmin=0.0)
    _ticks(ax, "x", [f"{f} ({named[f]})" if f in named else str(f) for f in columns], rotate=True)
    _ticks(ax, "y", [token_label(t) for t in tokens])
    ax.set_xlabel("feature", fontsize=10)
    ax.set_ylabel("token", fontsize=10)
    shown = "" if len(columns) == len(strongest) else f" (the {len(columns)} strongest of {len(strongest)})"
    _title(ax, f"{title or 'SAE features per token'}{shown}", 10.0)
    fig.colorbar(image, ax=ax, label="activation (0: not read at that token)")
    return fig
