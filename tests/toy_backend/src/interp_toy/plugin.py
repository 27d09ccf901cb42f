"""Registers the ``toy`` backend in the ``interp_engine.backends`` entry points."""

from __future__ import annotations

from typing import Any

from interp_engine import InvalidOption, hookimpl

NAME = "toy"
OPTIONS = ("seed", "n_layers", "d_model")


@hookimpl
def interp_engine_backends() -> list[str]:
    return [NAME]


@hookimpl
def interp_engine_load_model(backend: str, name_or_path: str, options: dict[str, Any]) -> Any:
    if backend != NAME:
        return None
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidOption(f"the toy backend does not know {unknown}; it takes {', '.join(OPTIONS)}")
    from .model import ToyModel

    return ToyModel(name_or_path, **options)
