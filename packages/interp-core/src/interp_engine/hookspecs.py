"""The backend plugin seam: two hooks, found through the ``interp_engine.backends`` entry points.

A backend package registers a module (or object) in the entry-point group
``interp_engine.backends``; it implements these hooks with ``@interp_engine.hookimpl``::

    [project.entry-points."interp_engine.backends"]
    mybackend = "my_package.plugin"

Backends are chosen by name, never by registration order: ``interp_engine_load_model`` is a
``firstresult`` hook, and each implementation answers only for the names it lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .protocol._protocol import InterpModel

PROJECT = "interp_engine"
ENTRY_POINT_GROUP = "interp_engine.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def interp_engine_backends() -> list[str]:  # type: ignore[empty-body]
    """Called to list backends: return the backend names this plugin serves."""


@hookspec(firstresult=True)
def interp_engine_load_model(backend: str, name_or_path: str, options: dict[str, Any]) -> InterpModel | None:
    """Called by ``load_model``: return a model if ``backend`` is one of this plugin's names,
    else ``None``. ``options`` are the caller's extra keyword arguments; reject unknown ones
    with ``InvalidOption`` rather than dropping them."""
