"""interp-eager: the ``eager`` backend of interp-engine (HF ``transformers`` + PyTorch hooks).

Use it through the core: ``interp_engine.load_model(path, backend="eager")``. To wrap a model
you already hold, use :meth:`EagerModel.from_hf`. The architecture of a model is resolved from
its module tree (``resolve_family(hf_model)``; a loaded model's is ``EagerModel.family``).

The names below are imported on first use, so the plugin discovery that imports this package
(``interp_engine.installed_backends()``) loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._families import FAMILY_DATA, Family, verified_model_types
    from ._load import LOAD_OPTIONS
    from ._model import EagerModel
    from ._resolve import resolve as resolve_family

_LAZY: dict[str, tuple[str, str]] = {
    "FAMILY_DATA": ("._families", "FAMILY_DATA"),
    "Family": ("._families", "Family"),
    "verified_model_types": ("._families", "verified_model_types"),
    "LOAD_OPTIONS": ("._load", "LOAD_OPTIONS"),
    "EagerModel": ("._model", "EagerModel"),
    "resolve_family": ("._resolve", "resolve"),
}
"""Each public name: the module that defines it and its name there."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["FAMILY_DATA", "LOAD_OPTIONS", "EagerModel", "Family", "resolve_family", "verified_model_types"]
