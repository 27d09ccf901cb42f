"""Registers the ``eager`` backend in the ``interp_engine.backends`` entry points."""

from __future__ import annotations

from typing import Any

from interp_engine import hookimpl

NAME = "eager"


@hookimpl
def interp_engine_backends() -> list[str]:
    return [NAME]


@hookimpl
def interp_engine_load_model(backend: str, name_or_path: str, options: dict[str, Any]) -> Any:
    if backend != NAME:
        return None
    from ._load import load

    return load(name_or_path, options)
