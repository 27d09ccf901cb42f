"""interp-engine: one API for mechanistic interpretability on eager PyTorch and inside vLLM.

from interp_engine import Address, load_model, run_with_cache

model = load_model("path/or/hub-id", backend="eager")   # or "interp:tiny", the shipped model
cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.5"])
"""

from ._address import ALIASES, KINDS, Address, KindInfo, LayerTypeError, PointInfo
from ._api import capture_attention, capture_generation, generate_stream, run_with_cache
from ._base import CheckedRequest, ModelBase, SamplingOptions
from ._cache import Cache
from ._errors import (
    BackendError,
    BackendNotFound,
    ContextTooLong,
    ForeignEventLoop,
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    KindNotInFamily,
    LayerOutOfRange,
    ModelClosed,
    ModelLoadError,
    RunningLoopError,
    StaticConfigError,
    UndeclaredAddress,
    UnknownKind,
    UnknownSae,
    UnsupportedAddress,
    UnsupportedArchitecture,
    UnsupportedSae,
)
from ._plugins import installed_backends, load_model
from ._protocol import (
    BatchCapture,
    Completion,
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
from .hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "ALIASES",
    "KINDS",
    "Address",
    "BackendError",
    "BackendNotFound",
    "BatchCapture",
    "Cache",
    "CheckedRequest",
    "Completion",
    "ContextTooLong",
    "FeatureReadout",
    "FeatureWrite",
    "Features",
    "ForeignEventLoop",
    "InterpError",
    "InterpModel",
    "InvalidActivations",
    "InvalidAddress",
    "InvalidFeatures",
    "InvalidOption",
    "InvalidSteering",
    "InvalidTokens",
    "KindInfo",
    "KindNotInFamily",
    "LayerOutOfRange",
    "LayerTypeError",
    "ModelBase",
    "ModelClosed",
    "ModelInfo",
    "ModelLoadError",
    "PointInfo",
    "Probe",
    "Results",
    "RunningLoopError",
    "Sae",
    "SamplingOptions",
    "StaticConfigError",
    "StaticTaps",
    "SteeringSpec",
    "StreamStep",
    "SyncModel",
    "UndeclaredAddress",
    "UnknownKind",
    "UnknownSae",
    "UnsupportedAddress",
    "UnsupportedArchitecture",
    "UnsupportedSae",
    "WorkerStats",
    "Write",
    "capture_attention",
    "capture_generation",
    "generate_stream",
    "hookimpl",
    "installed_backends",
    "load_model",
    "load_sae",
    "run_with_cache",
    "shipped_models",
    "shipped_saes",
    "sync_model",
    "tiny_model_path",
]
