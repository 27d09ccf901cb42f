"""SAE features per token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ._draw import (
    FeatureReadout,
    new_axes,
    put_ticks,
    put_title,
    require,
    token_label,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
    require(values.dim() == 2, f"features takes one prompt's readout [tokens, k], got {list(values.shape)}")
    dense = readout.ids is None
    ids = torch.arange(values.shape[1]).expand_as(values) if readout.ids is None else readout.ids.cpu()
    require(len(tokens) == values.shape[0], f"features: {len(tokens)} tokens for {values.shape[0]} positions")
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
    fig, ax = new_axes(ax, (max(4.5, 0.3 * len(columns) + 3.0), max(2.8, 0.34 * len(tokens) + 2.0)))
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="magma", vmin=0.0)
    put_ticks(ax, "x", [f"{f} ({named[f]})" if f in named else str(f) for f in columns], rotate=True)
    put_ticks(ax, "y", [token_label(t) for t in tokens])
    ax.set_xlabel("feature", fontsize=10)
    ax.set_ylabel("token", fontsize=10)
    shown = "" if len(columns) == len(strongest) else f" (the {len(columns)} strongest of {len(strongest)})"
    put_title(ax, f"{title or 'SAE features per token'}{shown}", 10.0)
    fig.colorbar(image, ax=ax, label="activation (0: not read at that token)")
    return fig
