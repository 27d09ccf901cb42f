"""Gradients of a scalar metric of the logits with respect to activations (the eager backend).

``run_with_gradients`` runs one forward with autograd on and one backward of the metric; the
backend adds a zero tensor that requires grad at each requested address (``x + delta``), so the
gradient with respect to ``delta`` is the gradient with respect to the activation there, after
any steering writes. vLLM runs its forwards under inference mode and has no backward:
``UnsupportedOperation`` names the eager backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._api import Tokens, model_points, token_rows
from .._errors import UnsupportedOperation
from .._sync import SyncModel, sync_model
from ..protocol._protocol import GradientCapture, InterpModel, Points
from ..results._cache import Cache
from ..steering._spec import RowSpecs
from ._metrics import Metric, as_gradient_metric


@dataclass(frozen=True)
class GradientResult:
    """What :func:`run_with_gradients` returns: ``activations`` and ``gradients`` (two
    :class:`Cache` of the same shapes, ``[batch, n, width]``; head addresses ``[batch, n, heads,
    d_head]``; zero at padded positions) and ``metric``, the metric's value on the run."""

    activations: Cache
    gradients: Cache
    metric: float


def gradient_model(model: InterpModel | SyncModel) -> tuple[SyncModel, GradientCapture]:
    """The sync facade of ``model`` and the model as a :class:`GradientCapture`, or
    ``UnsupportedOperation`` naming the eager backend."""
    facade = sync_model(model)
    base = facade.model
    if not isinstance(base, GradientCapture):
        backend = getattr(base, "backend", type(base).__name__)
        raise UnsupportedOperation(
            f"gradients need the eager backend (the {backend} backend runs no backward pass): "
            "load_model(path, backend='eager')"
        )
    return facade, base


def run_with_gradients(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    points: Points,
    metric: Metric,
    *,
    steering_spec: RowSpecs = None,
) -> GradientResult:
    """The activations at ``points`` and the gradient of ``metric`` with respect to each, for
    one prompt or a batch (eager backend only).

    ``metric`` maps the logits ``[batch, n, vocab]`` (float32) to a scalar tensor, e.g.
    :func:`interp_engine.metrics.logit_diff`; a metric with a second positional parameter also
    gets each row's length (prompts of different lengths are right-padded: their padded
    positions' logits are zeros, so no gradient flows from them). Gradients can be taken at every
    writable kind, and at ``attn_q``/``attn_k``; ``steering_spec`` (one spec, or one per row)
    applies first, and the gradient is with respect to the value after the writes. The model's
    parameters gather no ``.grad``."""
    facade, base = gradient_model(model)
    rows = token_rows(facade.model, tokens)
    listed = model_points(facade.model, points)  # one point or a list, layers resolved once
    wrapped = as_gradient_metric(metric)
    acts, grads, value = facade.run(lambda: base.capture_gradients(rows, listed, wrapped, steering_spec=steering_spec))
    lengths = torch.tensor([len(r) for r in rows])
    n_layers = facade.model.info.n_layers
    return GradientResult(
        Cache(acts, lengths=lengths, n_layers=n_layers), Cache(grads, lengths=lengths, n_layers=n_layers), value
    )
