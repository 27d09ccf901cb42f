"""Registers the ``toy`` backend in the ``interp_engine.backends`` entry points.

The backend is the test suite's: the plugin is installed in a dev environment (``scripts/setup.sh``
installs ``tests/toy_backend``), but it serves ``toy`` only where ``$INTERP_TOY_BACKEND`` is
``1``, which ``tests/conftest.py`` sets for the test session (and the subprocesses it starts). A
user of a dev install never sees ``toy`` among the installed backends; the tests still reach it
through the real entry point.
"""

from __future__ import annotations

import os
from typing import Any

from interp_engine import InvalidOption, hookimpl

NAME = "toy"
OPTIONS = ("seed", "n_layers", "d_model")
ENABLE = "INTERP_TOY_BACKEND"
"""``1``: the plugin serves ``toy`` (the test session sets it); anything else: it serves nothing."""


def enabled() -> bool:
    return os.environ.get(ENABLE) == "1"


@hookimpl
def interp_engine_backends() -> list[str]:
    return [NAME] if enabled() else []


@hookimpl
def interp_engine_load_model(backend: str, name_or_path: str, options: dict[str, Any]) -> Any:
    if backend != NAME or not enabled():
        return None
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidOption(f"the toy backend does not know {unknown}; it takes {', '.join(OPTIONS)}")
    from .model import ToyModel

    return ToyModel(name_or_path, **options)
