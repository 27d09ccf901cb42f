"""interp-engine: one API for mechanistic interpretability on eager PyTorch and inside vLLM.

from interp_engine import Address, load_model, run_with_cache

model = load_model("path/or/hub-id", backend="eager")   # or "interp:tiny", the shipped model
cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.5"])

Importing this package imports neither torch nor safetensors: the addresses, the kind vocabulary,
the error tree and backend discovery are imported at once, and every name that holds tensors
(results, steering values, SAEs, the model protocol, the free functions) is imported on first
use (PEP 562 ``__getattr__``), so tooling that only reads addresses stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import (
    BackendError,
    BackendNotFound,
    CaptureMemoryExceeded,
    ContextTooLong,
    ForeignEventLoop,
    HarvestMismatch,
    IncompatibleDependency,
    InsufficientDiskSpace,
    InterpError,
    InvalidActivations,
    InvalidAdapter,
    InvalidAddress,
    InvalidChat,
    InvalidCorpus,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    KindNotInFamily,
    LayerOutOfRange,
    ModelClosed,
    ModelLoadError,
    NoChatTemplate,
    NotInThisEngine,
    RunningLoopError,
    StaticConfigError,
    UndeclaredAddress,
    UnguardedScript,
    UnknownAdapter,
    UnknownKind,
    UnknownSae,
    UnknownWeight,
    UnsupportedAddress,
    UnsupportedArchitecture,
    UnsupportedOperation,
    UnsupportedSae,
)
from ._lazy import lazy_attributes
from ._plugins import (
    installed_backends,
    load_model,
)
from ._shipped import (
    shipped_adapters,
    shipped_models,
    shipped_saes,
    tiny_model_path,
)
from .addresses._address import (
    Address,
    LayerTypeError,
    PointInfo,
    format_address,
    parse_address,
    to_address,
)
from .addresses._kinds import ALIASES, KINDS, KindInfo
from .hookspecs import hookimpl

if TYPE_CHECKING:
    from ._api import (
        capture_attention,
        capture_generation,
        chat_tokens,
        generate_stream,
        run_with_cache,
    )
    from ._padded import position_ids_from_mask
    from ._public import capture, decode_residuals, steer, vllm_installed
    from ._sync import (
        SyncModel,
        sync_model,
    )
    from .adapters._adapter import Adapter
    from .analysis._attribution import attribution_patch
    from .analysis._compare import ModelDiff, compare
    from .analysis._dla import (
        accumulated_resid,
        decompose_resid,
        logit_attribution,
    )
    from .analysis._gradients import (
        GradientResult,
        run_with_gradients,
    )
    from .analysis._weights import (
        WEIGHT_NAMES,
        FinalNorm,
        WeightAccess,
        WeightInfo,
        Weights,
        weights,
    )
    from .chat._spans import ChatTokens, Span
    from .chat._tokenize import Tokenize, TokenSpan
    from .circuits._attribute import attribution_graph
    from .circuits._formats import load_transcoders
    from .circuits._graph import AttributionGraph
    from .circuits._transcoders import CrossLayerTranscoder, TranscoderSet
    from .protocol._base import ModelBase
    from .protocol._protocol import (
        BatchCapture,
        BlockingCapture,
        Completion,
        GradientCapture,
        GradientMetric,
        InterpModel,
        ModelInfo,
        Results,
        StaticTaps,
        StreamStep,
        WorkerStats,
    )
    from .protocol._requests import CheckedRequest, SamplingOptions
    from .protocol._sampling import RecommendedSampling, SamplingSettings
    from .results._attention import AttentionCache, AttentionPatterns
    from .results._cache import Cache
    from .results._labelled import Labelled
    from .results._lens import (
        LensRequest,
        LensResult,
        LensTopK,
        lens_top_k,
    )
    from .sae._readouts import (
        FeatureReadout,
        Features,
    )
    from .sae._sae import (
        Probe,
        Sae,
        load_sae,
    )
    from .steering._block import SteerMask
    from .steering._ops import (
        AblateSpec,
        AddSpec,
        LayerSteeringSpec,
        NormScaledAddSpec,
        OpSpec,
        OrthogonalDecompSpec,
        ProjectionCapSpec,
        SteerSpec,
        SwapSpec,
    )
    from .steering._spec import FeatureWrite, SteeringSpec, Write

NoChatTemplateError = NoChatTemplate
"""The public ``interp-engine`` package's name for :class:`NoChatTemplate` (the same class)."""

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "capture_attention": "._api",
    "capture_generation": "._api",
    "chat_tokens": "._api",
    "decode_residuals": "._public",
    "capture": "._public",
    "steer": "._public",
    "vllm_installed": "._public",
    "position_ids_from_mask": "._padded",
    "generate_stream": "._api",
    "run_with_cache": "._api",
    "SyncModel": "._sync",
    "sync_model": "._sync",
    "Adapter": ".adapters._adapter",
    "attribution_patch": ".analysis._attribution",
    "ModelDiff": ".analysis._compare",
    "compare": ".analysis._compare",
    "accumulated_resid": ".analysis._dla",
    "decompose_resid": ".analysis._dla",
    "logit_attribution": ".analysis._dla",
    "GradientResult": ".analysis._gradients",
    "run_with_gradients": ".analysis._gradients",
    "FinalNorm": ".analysis._weights",
    "WEIGHT_NAMES": ".analysis._weights",
    "WeightAccess": ".analysis._weights",
    "WeightInfo": ".analysis._weights",
    "Weights": ".analysis._weights",
    "weights": ".analysis._weights",
    "ChatTokens": ".chat._spans",
    "Tokenize": ".chat._tokenize",
    "TokenSpan": ".chat._tokenize",
    "AttributionGraph": ".circuits._graph",
    "CrossLayerTranscoder": ".circuits._transcoders",
    "TranscoderSet": ".circuits._transcoders",
    "attribution_graph": ".circuits._attribute",
    "load_transcoders": ".circuits._formats",
    "Span": ".chat._spans",
    "CheckedRequest": ".protocol._requests",
    "ModelBase": ".protocol._base",
    "SamplingOptions": ".protocol._requests",
    "RecommendedSampling": ".protocol._sampling",
    "SamplingSettings": ".protocol._sampling",
    "BatchCapture": ".protocol._protocol",
    "BlockingCapture": ".protocol._protocol",
    "Completion": ".protocol._protocol",
    "GradientCapture": ".protocol._protocol",
    "GradientMetric": ".protocol._protocol",
    "InterpModel": ".protocol._protocol",
    "ModelInfo": ".protocol._protocol",
    "Results": ".protocol._protocol",
    "StaticTaps": ".protocol._protocol",
    "StreamStep": ".protocol._protocol",
    "WorkerStats": ".protocol._protocol",
    "AttentionCache": ".results._attention",
    "AttentionPatterns": ".results._attention",
    "Cache": ".results._cache",
    "Labelled": ".results._labelled",
    "LensRequest": ".results._lens",
    "LensResult": ".results._lens",
    "LensTopK": ".results._lens",
    "lens_top_k": ".results._lens",
    "FeatureReadout": ".sae._readouts",
    "Features": ".sae._readouts",
    "Probe": ".sae._sae",
    "Sae": ".sae._sae",
    "load_sae": ".sae._sae",
    "AblateSpec": ".steering._ops",
    "AddSpec": ".steering._ops",
    "LayerSteeringSpec": ".steering._ops",
    "NormScaledAddSpec": ".steering._ops",
    "OpSpec": ".steering._ops",
    "OrthogonalDecompSpec": ".steering._ops",
    "ProjectionCapSpec": ".steering._ops",
    "SteerSpec": ".steering._ops",
    "SwapSpec": ".steering._ops",
    "SteerMask": ".steering._block",
    "FeatureWrite": ".steering._spec",
    "SteeringSpec": ".steering._spec",
    "Write": ".steering._spec",
}
"""Each name imported on first use, and the module (relative to this package) that defines it."""


_NOT_HERE: dict[str, str] = {
    "SteerMethod": "SteerSpec(method=...) takes the method's name as a string ('additive', 'orthogonal', "
    "'projection_cap', 'norm_scaled_add', 'ablate', 'swap')",
    "hf_generate_kwargs": "there is no transformers.generate bridge; generate with the model itself "
    "(await model.generate_text(ids, ...), generate_stream(model, tokens, n_logprobs=k)), whose sampling "
    "defaults come from model.sampling_settings(...)",
    "GenStep": "the free generate_stream yields StreamStep values (token_id, token_str, logprobs with "
    "n_logprobs=k; no logits): annotate with StreamStep",
    "CAPABILITIES": "there is no capability table to read; the model-types reference lists what each backend "
    "serves, and a call a backend cannot serve raises a typed error naming it (UnsupportedOperation, "
    "KindNotInFamily, UnsupportedAddress)",
    "CapabilityUnsupported": "a call a backend cannot serve raises UnsupportedOperation (or, for a point, "
    "UnsupportedAddress / KindNotInFamily); catch InterpError for all of them",
    "check_flashinfer": "there is no preflight check here; load the model and call model.warmup(), which starts "
    "the engine",
    "check_cuda_driver": "there is no preflight check here; load the model and call model.warmup(), which starts "
    "the engine",
    "VLLMModel": "models are made by load_model(model_id, backend='vllm') (or 'vllm-static'), not by a class",
    "EagerModel": "models are made by load_model(model_id, backend='eager'), not by a class",
}
"""Names the public ``interp-engine`` package exports that this one lacks, each with what differs
and what to use here (:class:`NotInThisEngine` carries the text)."""

__getattr__, __dir__ = lazy_attributes(globals(), _LAZY, _NOT_HERE)

__all__ = [
    "ALIASES",
    "KINDS",
    "WEIGHT_NAMES",
    "AblateSpec",
    "Adapter",
    "AddSpec",
    "Address",
    "AttentionCache",
    "AttentionPatterns",
    "AttributionGraph",
    "BackendError",
    "BackendNotFound",
    "BatchCapture",
    "BlockingCapture",
    "Cache",
    "CaptureMemoryExceeded",
    "ChatTokens",
    "CheckedRequest",
    "Completion",
    "ContextTooLong",
    "CrossLayerTranscoder",
    "FeatureReadout",
    "FeatureWrite",
    "Features",
    "FinalNorm",
    "ForeignEventLoop",
    "GradientCapture",
    "GradientMetric",
    "GradientResult",
    "HarvestMismatch",
    "IncompatibleDependency",
    "InsufficientDiskSpace",
    "InterpError",
    "InterpModel",
    "InvalidActivations",
    "InvalidAdapter",
    "InvalidAddress",
    "InvalidChat",
    "InvalidCorpus",
    "InvalidFeatures",
    "InvalidOption",
    "InvalidSteering",
    "InvalidTokens",
    "KindInfo",
    "KindNotInFamily",
    "Labelled",
    "LayerOutOfRange",
    "LayerSteeringSpec",
    "LayerTypeError",
    "LensRequest",
    "LensResult",
    "LensTopK",
    "ModelBase",
    "ModelClosed",
    "ModelDiff",
    "ModelInfo",
    "ModelLoadError",
    "NoChatTemplate",
    "NoChatTemplateError",
    "NormScaledAddSpec",
    "NotInThisEngine",
    "OpSpec",
    "OrthogonalDecompSpec",
    "PointInfo",
    "Probe",
    "ProjectionCapSpec",
    "RecommendedSampling",
    "Results",
    "RunningLoopError",
    "Sae",
    "SamplingOptions",
    "SamplingSettings",
    "Span",
    "StaticConfigError",
    "StaticTaps",
    "SteerMask",
    "SteerSpec",
    "SteeringSpec",
    "StreamStep",
    "SwapSpec",
    "SyncModel",
    "TokenSpan",
    "Tokenize",
    "TranscoderSet",
    "UndeclaredAddress",
    "UnguardedScript",
    "UnknownAdapter",
    "UnknownKind",
    "UnknownSae",
    "UnknownWeight",
    "UnsupportedAddress",
    "UnsupportedArchitecture",
    "UnsupportedOperation",
    "UnsupportedSae",
    "WeightAccess",
    "WeightInfo",
    "Weights",
    "WorkerStats",
    "Write",
    "accumulated_resid",
    "attribution_graph",
    "attribution_patch",
    "capture",
    "capture_attention",
    "capture_generation",
    "chat_tokens",
    "compare",
    "decode_residuals",
    "decompose_resid",
    "format_address",
    "generate_stream",
    "hookimpl",
    "installed_backends",
    "lens_top_k",
    "load_model",
    "load_sae",
    "load_transcoders",
    "logit_attribution",
    "parse_address",
    "position_ids_from_mask",
    "run_with_cache",
    "run_with_gradients",
    "shipped_adapters",
    "shipped_models",
    "shipped_saes",
    "steer",
    "sync_model",
    "tiny_model_path",
    "to_address",
    "vllm_installed",
    "weights",
]
