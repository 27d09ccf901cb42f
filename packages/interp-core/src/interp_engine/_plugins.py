"""Backend discovery and ``load_model``."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from ._errors import BackendNotFound, InvalidOption, ModelLoadError
from ._shipped import resolve_model

if TYPE_CHECKING:
    from .protocol._protocol import InterpModel

ENV_BACKEND = "INTERP_ENGINE_BACKEND"
"""Backend used by ``load_model`` when ``backend=`` is not given (default ``eager``)."""
ENV_ALLOWED = "INTERP_ENGINE_BACKENDS"
"""Comma-separated entry-point names: when set, only these backend plugins are loaded."""

_DISTRIBUTIONS = {
    "eager": "interp-eager",
    "vllm": "interp-vllm (with the extra [cuda] or [cpu])",
    "vllm-static": "interp-vllm (with the extra [cuda] or [cpu])",
}

_PUBLIC_BACKENDS = {
    "auto": "the public interp-engine package's ladder (vLLM on CUDA, else eager) is not a backend here: "
    "name one, backend='eager' or backend='vllm' (without backend=, $INTERP_ENGINE_BACKEND, else eager)",
    "vllm-generate": "the public interp-engine package's generation-only backend is not here: backend='vllm' "
    "generates, with capture and steering available per request",
}
"""Backend names of the public ``interp-engine`` package that this one has no backend for, and what
to name instead."""

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_broken: dict[str, str] = {}


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every installed backend loaded (once)."""
    global _manager
    with _lock:
        if _manager is None:
            manager = pluggy.PluginManager(hookspecs.PROJECT)
            manager.add_hookspecs(hookspecs)
            allowed = os.environ.get(ENV_ALLOWED)
            wanted = {n.strip() for n in allowed.split(",") if n.strip()} if allowed else None
            for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
                if wanted is not None and ep.name not in wanted:
                    continue
                try:
                    manager.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP, name=ep.name)
                except Exception as exc:  # a broken plugin must not hide the others
                    _broken[ep.name] = f"{type(exc).__name__}: {exc}"
            _manager = manager
        return _manager


def installed_backends() -> list[str]:
    """The names of every backend the installed plugins serve, sorted."""
    names = plugin_manager().hook.interp_engine_backends()
    return sorted({name for group in names for name in group})


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
"""What a Hugging Face hub id looks like: a name, or one ``owner/name``."""


_sources: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
"""Each model :func:`load_model` returned, mapped to the name it was given and the path it resolved to."""


def loaded_from(model: object) -> tuple[str, str] | None:
    """``(name as given, resolved path)`` of a model :func:`load_model` returned, else ``None``."""
    try:
        return _sources.get(model)
    except TypeError:  # not weakly referenceable
        return None


def local_model(name_or_path: str | os.PathLike[str]) -> str:
    """``name_or_path`` as a backend should see it: a shipped name becomes its directory, a
    leading ``~`` is expanded, and what can only be a local path must exist.

    A path object, or a string that starts with ``/``, ``./``, ``../`` or ``~``, or that is no hub
    id (a name, or one ``owner/name``), is a local path: if it does not exist, ``ModelLoadError``
    says "no such directory" here, before any backend loads, instead of the hub's repo-id error.
    Anything else (a hub id, an existing path) is passed on unchanged.
    """
    path = resolve_model(name_or_path)
    if os.path.exists(path):
        return path
    expanded = os.path.expanduser(path)
    if expanded != path and os.path.exists(expanded):
        return expanded
    looks_local = (
        not isinstance(name_or_path, str)
        or path.startswith(("/", "./", "../", "~"))
        or any(sep in path for sep in (os.sep, os.altsep) if sep and sep != "/")
        or _HUB_ID.fullmatch(path) is None
    )
    if looks_local:
        shown = repr(path) if expanded == path else f"{path!r} ({expanded})"
        raise ModelLoadError(
            f"no such directory: {shown}; a model is a local directory (config.json, weights, tokenizer), "
            "a hub id such as 'owner/name', or interp:tiny"
        )
    return path


def load_model(name_or_path: str | os.PathLike[str], backend: str | None = None, **kwargs: Any) -> InterpModel:
    """Load a model on a backend chosen by name.

    ``name_or_path`` is a local directory, a hub id, or the name of a model that ships with
    interp-core (``"interp:tiny"``), which is resolved here to its installed directory before the
    backend sees it. ``backend`` defaults to ``$INTERP_ENGINE_BACKEND``, else ``"eager"``. Extra keyword
    arguments go to the backend (``dtype``/``device`` for eager, engine arguments for vLLM);
    an argument the backend does not know raises ``InvalidOption``. ``saes={"name": sae_or_folder}``
    attaches SAEs or probes before the engine is built (``model.attach_sae`` for each);
    ``adapters={"name": folder}`` registers LoRA adapters (``model.load_adapter`` for each), which
    requests then name with ``adapter="name"`` (on vLLM, with ``enable_lora=True``).
    """
    chosen = backend or os.environ.get(ENV_BACKEND) or "eager"
    path = local_model(name_or_path)
    available = installed_backends()
    if chosen not in available:
        install = _DISTRIBUTIONS.get(chosen, "a package that registers it in the 'interp_engine.backends' entry points")
        message = (
            f"no installed backend is named {chosen!r}; install {install}. "
            f"Installed backends: {', '.join(available) or 'none'}"
        )
        if chosen in _PUBLIC_BACKENDS:
            message = f"no backend is named {chosen!r}: {_PUBLIC_BACKENDS[chosen]}. Installed backends: " + (
                ", ".join(available) or "none"
            )
        if _broken:
            failed = "; ".join(f"{name} ({why})" for name, why in sorted(_broken.items()))
            message += f". These backend plugins failed to load: {failed}"
        raise BackendNotFound(message)
    saes = kwargs.pop("saes", None) or {}
    if not isinstance(saes, Mapping):
        raise InvalidOption(f"saes= is a mapping of names to SAEs (or SAE folders), got {type(saes).__name__}")
    adapters = kwargs.pop("adapters", None) or {}
    if not isinstance(adapters, Mapping):
        raise InvalidOption(f"adapters= is a mapping of names to adapter folders, got {type(adapters).__name__}")
    model: InterpModel | None = plugin_manager().hook.interp_engine_load_model(
        backend=chosen, name_or_path=path, options=dict(kwargs)
    )
    if model is None:
        raise BackendNotFound(f"the plugins listing backend {chosen!r} did not load a model for it")
    with contextlib.suppress(TypeError):  # a model that cannot be weakly referenced keeps no source
        _sources[model] = (os.fspath(name_or_path), path)
    if saes:
        attach = getattr(model, "attach_sae", None)
        if attach is None:
            raise InvalidOption(f"the {chosen} backend's models do not take SAEs (no attach_sae)")
        for name, sae in saes.items():
            attach(name, sae)
    if adapters:
        register = getattr(model, "load_adapter", None)
        if register is None:
            raise InvalidOption(f"the {chosen} backend's models do not take adapters (no load_adapter)")
        for name, folder in adapters.items():
            register(name, folder)
    return model
