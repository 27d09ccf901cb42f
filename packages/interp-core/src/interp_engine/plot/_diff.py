"""Model diffing (:func:`~interp_engine.compare`): per-layer norms and cosines, the logit lens of
the difference, and the SAE features that changed most."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._draw import is_labelled, new_axes, put_ticks, put_title, require

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _labelled(result: Any, dims: tuple[str, str], what: str) -> tuple[torch.Tensor, list[Any], list[Any]]:
    require(
        is_labelled(result) and tuple(result.dims) == dims,
        f"{what} draws a Labelled result with axes {dims} (from ModelDiff.{what.removeprefix('diff_')}), "
        f"got {type(result).__name__}" + (f" with axes {result.dims}" if is_labelled(result) else ""),
    )
    return result.values.detach().float().cpu(), result.labels(dims[0]), result.labels(dims[1])


def _sides(meta: Any) -> str:
    adapter, reference = meta.get("adapter"), meta.get("reference")
    return f"{adapter or 'base'} vs {reference or 'base'}"


def diff_norms(result: Any, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Per layer, the norm of the difference and that relative to the reference's norm (left
    axis), and the cosine of the two sides (right axis): ``ModelDiff.norms()``."""
    values, layers, stats = _labelled(result, ("layer", "stat"), "diff_norms")
    require(stats == ["norm", "relative", "cosine"], f"diff_norms: unexpected stats {stats}")
    fig, ax = new_axes(ax, (6.5, 3.6))
    xs = list(range(len(layers)))
    ax.plot(xs, values[:, 0].numpy(), marker="o", color="#2166ac", label="‖adapted - reference‖")
    ax.plot(xs, values[:, 1].numpy(), marker="s", color="#4393c3", linestyle="--", label="relative to ‖reference‖")
    ax.set_xticks(xs, [str(layer) for layer in layers])
    ax.set_xlabel("layer", fontsize=10)
    ax.set_ylabel("norm of the difference", fontsize=10)
    right = ax.twinx()
    right.plot(xs, values[:, 2].numpy(), marker="^", color="#b2182b", label="cosine(adapted, reference)")
    right.set_ylim(min(-0.05, float(values[:, 2].min()) - 0.05), 1.05)
    right.set_ylabel("cosine", fontsize=10)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    put_title(ax, title or f"{result.meta.get('kind', 'resid_post')}: {_sides(result.meta)}")
    return fig


def diff_lens(result: Any, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """The logit lens of the difference: layers (rows) x tokens (columns), each cell the change
    of the token's log-probability, red where the adapter promotes it and blue where it demotes
    it, the value written in each cell: ``ModelDiff.lens()``."""
    values, layers, tokens = _labelled(result, ("layer", "token"), "diff_lens")
    span = float(values.abs().max()) or 1.0
    fig, ax = new_axes(ax, (max(4.5, 0.9 * len(tokens) + 2.5), max(2.6, 0.45 * len(layers) + 1.6)))
    image = ax.imshow(values.numpy(), aspect="auto", cmap="RdBu_r", vmin=-span, vmax=span)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            ax.text(j, i, f"{float(values[i, j]):+.1f}", ha="center", va="center", fontsize=7)
    put_ticks(ax, "x", [str(t) for t in tokens], rotate=True)
    put_ticks(ax, "y", [str(layer) for layer in layers])
    ax.set_xlabel("token", fontsize=10)
    ax.set_ylabel("layer (resid_post)", fontsize=10)
    put_title(ax, title or f"logit lens of the difference: {_sides(result.meta)}", 10.0)
    fig.colorbar(image, ax=ax, label="change of log-probability")
    return fig


def diff_features(result: Any, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """The SAE features whose mean activation changed most: per feature, the reference's and the
    adapted side's mean activation side by side: ``ModelDiff.features()``."""
    values, ids, sides = _labelled(result, ("feature", "side"), "diff_features")
    require(sides == ["reference", "adapted", "change"], f"diff_features: unexpected sides {sides}")
    n = len(ids)
    fig, ax = new_axes(ax, (max(4.5, 0.55 * n + 2.5), 3.6))
    xs = torch.arange(n).float()
    ax.bar(
        (xs - 0.2).numpy(),
        values[:, 0].numpy(),
        width=0.4,
        color="#92c5de",
        label=result.meta.get("reference") or "base",
    )
    ax.bar(
        (xs + 0.2).numpy(), values[:, 1].numpy(), width=0.4, color="#b2182b", label=result.meta.get("adapter") or "base"
    )
    put_ticks(ax, "x", [str(i) for i in ids], rotate=True)
    ax.set_xlabel("feature", fontsize=10)
    ax.set_ylabel("mean activation", fontsize=10)
    ax.legend(fontsize=8)
    put_title(ax, title or f"SAE features that changed most: {_sides(result.meta)}", 10.0)
    return fig
