"""Module attributes imported on first use (PEP 562), for the package and the backend SDK: both
import no torch until a tensor-holding name is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import NotInThisEngine


def lazy_attributes(
    namespace: dict[str, Any], names: Mapping[str, str], absent: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` serving ``names`` (each name: the module, relative
    to ``interp_engine``, that defines it); ``namespace`` is the module's ``globals()``, where each
    value is kept once imported. A name in ``absent`` (the public ``interp-engine`` package's names
    this one lacks, each with what to use instead) raises :class:`NotInThisEngine` with that text."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            if absent is not None and name in absent:
                error = NotInThisEngine(
                    f"{name} is a name of the public interp-engine package that this engine does not have: "
                    f"{absent[name]} (docs: guides/public-interp-engine.md)",
                    name=name,
                )
                raise error
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, "interp_engine"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
