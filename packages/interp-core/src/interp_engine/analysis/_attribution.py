"""Attribution patching: the linear estimate of an activation-patching sweep from one backward.

Patching the activation ``a_src`` of a *source* run into a *patched* run at one cell changes the
metric by about ``(a_src - a_patched) . dmetric/da`` (first order in the difference), with the
gradient taken on the patched run. One forward + backward on the patched run and one forward on
the source run give the estimate for every layer, position and head at once (Nanda 2023,
"Attribution Patching"; Syed et al. 2023). The directions and cells are those of
:func:`interp_engine.patching.sweep`: by default the clean activation into the corrupt run
(``direction="denoise"``: gradient on the corrupt run); ``"noise"``, the corrupt activation
into the clean run (gradient on the clean run). Each cell is the estimated *change* of the
metric, ``sweep(...) - meta["corrupt"]`` for a denoising sweep.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .._api import Tokens, run_with_cache
from .._sync import SyncModel
from ..addresses._address import Address
from ..protocol._protocol import InterpModel
from ..results._labelled import Labelled
from ._gradients import gradient_model, run_with_gradients
from ._metrics import Metric, evaluate
from ._sweeps import Direction, default_metric, plan_cells, scalar


def attribution_patch(
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
) -> Labelled:
    """The attribution-patching estimate of ``patching.sweep`` with the same arguments: per
    cell, ``(a_source - a_patched) . grad_patched`` summed over the width (and ``d_head`` at a
    head address), as a :class:`~interp_engine.Labelled` tensor (eager backend only).

    - cells: each layer (``layers``, default all; a kind without layers has none) x each position
      (``positions``, default all, or a chat span name) and, with ``heads`` (``True`` or a list) at a head address,
      each head; ``by_position=False`` (the default with ``heads``) sums the positions: the
      estimate of patching them all at once. Dims ``("layer", "position")``, ``("layer",
      "head")``, ``("layer", "position", "head")`` ... as the sweep's.
    - ``direction="denoise"`` (default): the clean activation into the corrupt run, the
      gradient taken on the corrupt run; ``"noise"``: the corrupt activation into the clean run,
      the gradient on the clean run.
    - ``metric``: logits ``[batch, n, vocab]`` to a scalar tensor; default the logit difference
      at the last position between ``answer`` and ``wrong`` (by default the clean and the
      corrupt run's top tokens there).
    - ``normalize=True`` divides by ``m_source - m_patched`` (1: the estimate restores the source
      run's metric).

    Costs one forward on the source run (two prompts in one batch when the default metric needs
    the patched run's top token) and one forward and backward on the patched run. ``meta`` holds
    ``clean``/``corrupt`` (the metric on each run), ``metric``, ``kind``, ``direction`` and
    ``method="attribution"``.
    """
    facade, _ = gradient_model(model)  # UnsupportedOperation before any compute off eager
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
    n = len(cells.clean)
    needs_patched_top = metric is None and (wrong is None if cells.direction == "denoise" else answer is None)
    rows = [cells.source, cells.patched] if needs_patched_top else [cells.source]
    runs = run_with_cache(facade, rows, [*cells.addresses, Address("logits")])
    logits = runs["logits"].float()
    top_source = int(logits[0, -1].argmax())
    top_patched = int(logits[1, -1].argmax()) if needs_patched_top else None
    top_clean, top_corrupt = (top_source, top_patched) if cells.direction == "denoise" else (top_patched, top_source)
    metric = default_metric(base, metric, answer, wrong, top_clean, top_corrupt)

    source_value = scalar(evaluate(metric, logits[0:1], torch.tensor([n])), "on the source run")
    grads = run_with_gradients(facade, [cells.patched], cells.addresses, metric)
    patched_value = grads.metric

    per_layer = []
    for address in cells.addresses:
        diff = runs[address][0, :n] - grads.activations[address][0]  # [n, width] or [n, heads, d_head]
        product = diff * grads.gradients[address][0]
        # [n, heads] per head, else [n]
        per = product.sum(-1)[:, cells.heads] if cells.heads is not None else product.flatten(1).sum(-1)
        per = per[cells.positions]
        per_layer.append(per if cells.per_position else per.sum(0))
    table = torch.stack(per_layer)  # [layers, (positions), (heads)]
    clean_value, corrupt_value = (
        (source_value, patched_value) if cells.direction == "denoise" else (patched_value, source_value)
    )
    return cells.result(
        base, table, metric, clean_value, corrupt_value, normalize=normalize, method="attribution", offset=False
    )
