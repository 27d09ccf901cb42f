"""Activation patching sweeps (the public face is :mod:`interp_engine.patching`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._api import Tokens, run_with_cache
from .._errors import InvalidOption
from .._sync import SyncModel, sync_model
from ..addresses._address import Address
from ..protocol._protocol import InterpModel
from ..results._labelled import Labelled
from ..steering._spec import SteeringSpec, Write
from ..steering._values import short_repr
from ._attribution import attribution_patch
from ._metrics import Metric, evaluate, logit_diff
from ._sweeps import Cells, Direction, default_metric, plan_cells, scalar

__all__ = ["Direction", "Metric", "attribution_patch", "logit_diff", "sweep"]


class _Progress:
    """A progress bar: tqdm when installed (the ``progress`` extra), else a counter on stderr."""

    def __init__(self, total: int, enabled: bool, what: str) -> None:
        self.bar: Any = None
        self.enabled = enabled
        self.total, self.done, self.what = total, 0, what
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=what, unit="cell")

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            end = "\n" if self.done >= self.total else ""
            print(f"\r{self.what}: {self.done}/{self.total} cells", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sweep(
    model: InterpModel | SyncModel,
    clean: Tokens,
    corrupt: Tokens,
    kind: str = "resid_post",
    *,
    metric: Metric | None = None,
    answer: int | str | None = None,
    wrong: int | str | None = None,
    layers: Iterable[int] | None = None,
    positions: Iterable[int] | str | None = None,
    heads: bool | Sequence[int] = False,
    by_position: bool | None = None,
    direction: Direction = "denoise",
    normalize: bool = False,
    batch_size: int = 16,
    progress: bool = True,
) -> Labelled:
    """Patch ``kind`` cell by cell between two prompts of the same length and return the metric
    per cell as a :class:`~interp_engine.Labelled` tensor.

    - cells: each layer (``layers``, default all; kinds without a layer, such as ``embed``, have
      none) times each position (``positions``, default all; indices, or a chat span name such as
      ``"user[-1]"`` when a prompt is ``model.chat_tokens(...)``) and, with ``heads`` (``True``:
      every head, or a list) at a head address (``attn_z``, ``attn_v``), each head. With
      ``by_position=False`` a cell patches all the chosen positions at once (the default when
      ``heads`` is given: TransformerLens's ``*_all_pos``); dims are then ``("layer", "head")``.
    - ``direction="denoise"`` (default): the clean activation ``set`` into the corrupt run;
      ``"noise"``: the corrupt activation into the clean run. The metric is read from the
      patched run.
    - ``metric``: logits ``[batch, n, vocab]`` (and optionally the rows' lengths) to a scalar;
      default :func:`~interp_engine.metrics.logit_diff` of ``answer`` over ``wrong`` at the last
      position (by default the clean run's and the corrupt run's top tokens there).
    - ``normalize=True``: ``(m - m_patched_run) / (m_source_run - m_patched_run)``, 0 where the
      patch changed nothing, 1 where it restored the source run's metric.
    - ``batch_size`` cells per call (one spec per row: one forward on eager, concurrent
      requests on vLLM); ``progress`` draws a bar (tqdm when installed).

    ``meta`` holds ``clean``/``corrupt`` (the unpatched runs' metric), ``metric``, ``kind`` and
    ``direction``. :func:`attribution_patch` estimates the same table from one backward pass.
    """
    facade = sync_model(model)
    base = facade.model
    cells = plan_cells(
        base,
        clean,
        corrupt,
        kind,
        layers=layers,
        positions=positions,
        heads=heads,
        by_position=by_position,
        direction=direction,
    )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidOption(f"batch_size must be an int >= 1, got {short_repr(batch_size)}")
    n = len(cells.clean)
    # the unpatched runs: their logits (the metric's baselines) and the source activations
    runs = run_with_cache(facade, [cells.clean, cells.corrupt], [*cells.addresses, Address("logits")])
    logits = runs["logits"].float()
    metric = default_metric(base, metric, answer, wrong, int(logits[0, -1].argmax()), int(logits[1, -1].argmax()))
    lengths = torch.tensor([n])
    clean_value = scalar(evaluate(metric, logits[0:1], lengths), "on the clean run")
    corrupt_value = scalar(evaluate(metric, logits[1:2], lengths), "on the corrupt run")
    source_row = 0 if cells.direction == "denoise" else 1
    sources = {a: runs[a][source_row, :n] for a in cells.addresses}

    grid = [
        (layer, group, head)
        for layer in cells.layers
        for group in cells.groups()
        for head in (cells.heads if cells.heads is not None else [None])
    ]
    values: list[float] = []
    bar = _Progress(len(grid), progress, f"patching {cells.kind}")
    try:
        for start in range(0, len(grid), batch_size):
            chunk = grid[start : start + batch_size]
            specs = [_patch(cells, sources, *cell) for cell in chunk]
            patched = run_with_cache(facade, [cells.patched] * len(chunk), ["logits"], steering_spec=specs)
            rows = patched["logits"].float()
            for i, cell in enumerate(chunk):
                values.append(scalar(evaluate(metric, rows[i : i + 1], lengths), f"at cell {cell}"))
            bar.update(len(chunk))
    finally:
        bar.close()

    shape = [len(cells.layers), *([len(cells.positions)] if cells.per_position else [])]
    shape += [len(cells.heads)] if cells.heads is not None else []
    table = torch.tensor(values, dtype=torch.float32).reshape(shape)
    return cells.result(
        base, table, metric, clean_value, corrupt_value, normalize=normalize, method="patching", offset=True
    )


def _patch(
    cells: Cells, sources: dict[Address, torch.Tensor], layer: int | None, group: list[int], head: int | None
) -> SteeringSpec:
    """The spec of one cell: the source run's activation ``set`` at its positions (and head)."""
    address = Address(cells.kind, layer)
    value = sources[address][group]  # [len(group), width] or [len(group), heads, d_head]
    if head is None:
        return SteeringSpec([Write(address, value, op="set", positions=group)])
    one = value[:, head : head + 1]  # [len(group), 1, d_head]
    return SteeringSpec([Write(address, one, op="set", positions=group, heads=[head])])
