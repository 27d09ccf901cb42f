"""The backend SDK: everything a backend imports from the core, and the contract it keeps.

A backend is a package that registers an entry point in the group ``interp_engine.backends``
naming a module with :data:`hookimpl`-marked functions (the specs are in
:mod:`interp_engine.hookspecs`): one answers with the backend names it serves, one builds a
model for one of those names (``load_model(path, backend="mine")``). The model it builds is a
:class:`ModelBase` subclass and imports only the names below (and the public errors and values
of :mod:`interp_engine`); the modules behind them are private and move without notice.

What a backend implements (each an ``async def`` on the model; the base class checks every
request first and raises the core's typed errors, so a backend receives checked input only):

- ``capture(token_ids, points, *, steering_spec)``: one forward, call ``self._check_capture``
  first; return ``request.keyed(values)``;
- ``generate``: call ``self._check_generation``; end a completion with ``self._stop_index`` /
  ``self._completion``;
- ``_stream(request)``: yield the steps of a request the base class's ``stream`` checked;
- ``_capture_generation(request)``: the completion and results of a request the base class's
  ``capture_generation`` checked;
- ``_decode_residuals(residuals)``: the final norm and unembedding of one checked tensor;
- ``_close_resources()``: release what the model holds, once, on the first ``shutdown()``;
- optionally ``_load_adapter(adapter)`` (an :class:`Adapter` the core read and checked: load it,
  or raise ``InvalidAdapter``) and ``_max_adapter_rank()``, to serve LoRA adapters per request:
  each checked request then names its adapter (``request.adapter``, ``None``: the base model),
  and the methods above take ``adapter=``;
- optionally ``_served_kinds()`` (the kinds the loaded family has), ``weights`` access
  (:class:`WeightInfo`, :func:`check_weight_request`) and ``chat_tokens`` through
  :class:`TokenizerMixin`.

The helpers a backend calls while it serves a checked request:

- **what a family serves**: :data:`KINDS` (one row per kind: its ``needs`` and why it may be
  ``missing``), :data:`Need` / :data:`NEEDS`, :func:`lacking` (the kinds a family with these
  needs cannot serve), :func:`requirements` (a kind's needs, implied ones included: :data:`IMPLIED`),
  :func:`needing`, :func:`missing_reason`;
- **positions and heads of a write**: :func:`write_positions`, :func:`heads_of`,
  :func:`requested_points`; one token's value shape at an address: :func:`value_shape`;
- **the write algebra**: :meth:`Write.apply` for one write, :class:`Pipeline` for several writes
  folded into one per-token map (how a compiled graph applies them from a table:
  :data:`PIPELINE_TABLES` are its fields, :func:`run_stages` evaluates them),
  :data:`WHOLE_ROW_OPS` for the ops a tensor-parallel shard cannot apply alone and
  :data:`ELEMENTWISE_OPS` for those it can;
- **SAE readouts**: :func:`read_features` (encode and select), :func:`select_features` (select
  from encoded activations);
- **the lens**: :func:`lens_top_k` over the decoded residuals of :class:`CheckedLens` layers;
- **weights**: :data:`WEIGHT_NAMES`, :func:`probe_norm`, :func:`norm_parameters`;
- **tokens**: :class:`TokenizerMixin`, :class:`TextPieces`, :func:`pad_rows`.

``tests/toy_backend`` is a complete backend written against this module alone.

Like :mod:`interp_engine`, this module imports no torch until a tensor-holding name is used: a
backend's light modules (its plugin, its family tables) can import the kind rows from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
from .addresses._kinds import (
    IMPLIED,
    KINDS,
    NEEDS,
    Need,
    lacking,
    missing_reason,
    needing,
    requirements,
)
from .hookspecs import (
    hookimpl,
)

if TYPE_CHECKING:
    from . import (
        WEIGHT_NAMES,
        Adapter,
        BatchCapture,
        BlockingCapture,
        CheckedRequest,
        Completion,
        FeatureReadout,
        Features,
        FeatureWrite,
        GradientCapture,
        GradientMetric,
        InterpModel,
        LensRequest,
        LensResult,
        LensTopK,
        ModelBase,
        ModelInfo,
        Results,
        Sae,
        SamplingOptions,
        StaticTaps,
        SteeringSpec,
        StreamStep,
        WeightInfo,
        WorkerStats,
        Write,
        lens_top_k,
    )
    from .analysis._weights import (
        check_weight_request,
        norm_parameters,
        probe_norm,
    )
    from .protocol._checks import (
        heads_of,
        requested_points,
        value_shape,
        write_positions,
    )
    from .protocol._protocol import RowAdapters
    from .protocol._requests import (
        CheckedLens,
    )
    from .sae._readouts import (
        read_features,
        select_features,
    )
    from .steering._spec import AnyWrite, RowSpecs
    from .steering._writes import (
        ELEMENTWISE_OPS,
        PIPELINE_TABLES,
        WHOLE_ROW_OPS,
        Pipeline,
        apply_op,
        run_stages,
    )
    from .tokens import (
        TextPieces,
        TokenizerMixin,
        pad_rows,
    )

_LAZY: dict[str, str] = {
    "check_weight_request": ".analysis._weights",
    "norm_parameters": ".analysis._weights",
    "probe_norm": ".analysis._weights",
    "heads_of": ".protocol._checks",
    "requested_points": ".protocol._checks",
    "value_shape": ".protocol._checks",
    "write_positions": ".protocol._checks",
    "CheckedLens": ".protocol._requests",
    "RowAdapters": ".protocol._protocol",
    "read_features": ".sae._readouts",
    "select_features": ".sae._readouts",
    "AnyWrite": ".steering._spec",
    "RowSpecs": ".steering._spec",
    "ELEMENTWISE_OPS": ".steering._writes",
    "PIPELINE_TABLES": ".steering._writes",
    "Pipeline": ".steering._writes",
    "WHOLE_ROW_OPS": ".steering._writes",
    "apply_op": ".steering._writes",
    "run_stages": ".steering._writes",
    "TextPieces": ".tokens",
    "TokenizerMixin": ".tokens",
    "pad_rows": ".tokens",
    "Adapter": ".",
    "BatchCapture": ".",
    "BlockingCapture": ".",
    "CheckedRequest": ".",
    "Completion": ".",
    "FeatureReadout": ".",
    "FeatureWrite": ".",
    "Features": ".",
    "GradientCapture": ".",
    "GradientMetric": ".",
    "InterpModel": ".",
    "LensRequest": ".",
    "LensResult": ".",
    "LensTopK": ".",
    "ModelBase": ".",
    "ModelInfo": ".",
    "Results": ".",
    "Sae": ".",
    "SamplingOptions": ".",
    "StaticTaps": ".",
    "SteeringSpec": ".",
    "StreamStep": ".",
    "WEIGHT_NAMES": ".",
    "WeightInfo": ".",
    "WorkerStats": ".",
    "Write": ".",
    "lens_top_k": ".",
}
"""Each tensor-holding name, imported on first use, and the module that defines it (``"."``: a
name :mod:`interp_engine` itself exports, taken from there)."""


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)

__all__ = [
    "ELEMENTWISE_OPS",
    "IMPLIED",
    "KINDS",
    "NEEDS",
    "PIPELINE_TABLES",
    "WEIGHT_NAMES",
    "WHOLE_ROW_OPS",
    "Adapter",
    "AnyWrite",
    "BatchCapture",
    "BlockingCapture",
    "CheckedLens",
    "CheckedRequest",
    "Completion",
    "FeatureReadout",
    "FeatureWrite",
    "Features",
    "GradientCapture",
    "GradientMetric",
    "InterpModel",
    "LensRequest",
    "LensResult",
    "LensTopK",
    "ModelBase",
    "ModelInfo",
    "Need",
    "Pipeline",
    "Results",
    "RowAdapters",
    "RowSpecs",
    "Sae",
    "SamplingOptions",
    "StaticTaps",
    "SteeringSpec",
    "StreamStep",
    "TextPieces",
    "TokenizerMixin",
    "WeightInfo",
    "WorkerStats",
    "Write",
    "apply_op",
    "check_weight_request",
    "heads_of",
    "hookimpl",
    "lacking",
    "lens_top_k",
    "missing_reason",
    "needing",
    "norm_parameters",
    "pad_rows",
    "probe_norm",
    "read_features",
    "requested_points",
    "requirements",
    "run_stages",
    "select_features",
    "value_shape",
    "write_positions",
]
