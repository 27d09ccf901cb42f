"""interp-engine: one API for mechanistic interpretability on eager PyTorch and inside vLLM.

from interp_engine import Address, load_model, run_with_cache

model = load_model("path/or/hub-id", backend="eager")   # or "interp:tiny", the shipped model
cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.5"])
"""

from ._address import ALIASES, KINDS, Address, KindInfo, LayerTypeError, PointInfo
from ._api import (
    capture_attention,
    capture_generation,
    chat_tokens,
    decode_residuals,
    generate_stream,
    run_with_cache,
)
from ._attribution import attribution_patch
from ._base import CheckedRequest, ModelBase, SamplingOptions
from ._cache import Cache
from ._dla import accumulated_resid, decompose_resid, logit_attribution
from ._errors import (
    BackendError,
    BackendNotFound,
    ContextTooLong,
    ForeignEventLoop,
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidChat,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    KindNotInFamily,
    LayerOutOfRange,
    ModelClosed,
    ModelLoadError,
    NoChatTemplate,
    RunningLoopError,
    StaticConfigError,
    UndeclaredAddress,
    UnknownKind,
    UnknownSae,
    UnknownWeight,
    UnsupportedAddress,
    UnsupportedArchitecture,
    UnsupportedOperation,
    UnsupportedSae,
)
from ._gradients import GradientResult, run_with_gradients
from ._labelled import Labelled
from ._lens import LensRequest, LensResult, LensTopK, lens_top_k
from ._plugins import installed_backends, load_model
from ._protocol import (
    BatchCapture,
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
from ._readouts import FeatureReadout, Features
from ._sae import Probe, Sae, load_sae
from ._shipped import shipped_models, shipped_saes, tiny_model_path
from ._steering import FeatureWrite, SteeringSpec, Write
from ._sync import SyncModel, sync_model
from ._weights import WEIGHT_NAMES, FinalNorm, WeightAccess, WeightInfo, Weights, weights
from .chat import ChatTokens, Span
from .hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "ALIASES",
    "KINDS",
    "WEIGHT_NAMES",
    "Address",
    "BackendError",
    "BackendNotFound",
    "BatchCapture",
    "Cache",
    "ChatTokens",
    "CheckedRequest",
    "Completion",
    "ContextTooLong",
    "FeatureReadout",
    "FeatureWrite",
    "Features",
    "FinalNorm",
    "ForeignEventLoop",
    "GradientCapture",
    "GradientMetric",
    "GradientResult",
    "InterpError",
    "InterpModel",
    "InvalidActivations",
    "InvalidAddress",
    "InvalidChat",
    "InvalidFeatures",
    "InvalidOption",
    "InvalidSteering",
    "InvalidTokens",
    "KindInfo",
    "KindNotInFamily",
    "Labelled",
    "LayerOutOfRange",
    "LayerTypeError",
    "LensRequest",
    "LensResult",
    "LensTopK",
    "ModelBase",
    "ModelClosed",
    "ModelInfo",
    "ModelLoadError",
    "NoChatTemplate",
    "PointInfo",
    "Probe",
    "Results",
    "RunningLoopError",
    "Sae",
    "SamplingOptions",
    "Span",
    "StaticConfigError",
    "StaticTaps",
    "SteeringSpec",
    "StreamStep",
    "SyncModel",
    "UndeclaredAddress",
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
    "attribution_patch",
    "capture_attention",
    "capture_generation",
    "chat_tokens",
    "decode_residuals",
    "decompose_resid",
    "generate_stream",
    "hookimpl",
    "installed_backends",
    "lens_top_k",
    "load_model",
    "load_sae",
    "logit_attribution",
    "run_with_cache",
    "run_with_gradients",
    "shipped_models",
    "shipped_saes",
    "sync_model",
    "tiny_model_path",
    "weights",
]
