"""Registers the ``vllm`` and ``vllm-static`` backends in the ``interp_engine.backends`` entry points."""

from __future__ import annotations

from typing import Any

from interp_engine import hookimpl

NAME = "vllm"
STATIC = "vllm-static"


@hookimpl
def interp_engine_backends() -> list[str]:
    return [NAME, STATIC]


@hookimpl
def interp_engine_load_model(backend: str, name_or_path: str, options: dict[str, Any]) -> Any:
    if backend == NAME:
        from .frontend._model import VllmModel

        return VllmModel(name_or_path, options)
    if backend == STATIC:
        from .static._model import StaticVllmModel

        return StaticVllmModel(name_or_path, options)
    return None
