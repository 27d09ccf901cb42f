"""A toy interp-engine backend: character tokens and a few tanh layers, no transformers.

``ToyModel`` is imported on first use, so discovering the plugin loads no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import ToyModel


def __getattr__(name: str) -> Any:
    if name != "ToyModel":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(".model", __name__).ToyModel


__all__ = ["ToyModel"]
