"""Fixtures every test folder shares: ``interp:tiny`` on eager, and the session's pool of started
vLLM engines.

The helpers behind them are importable from the dev-only ``interp_testkit`` package
(``interp_testkit.suite``: tiny models, the HF oracle, family lists, ``rel_diff``) and from
``tests/support`` (what needs the engine itself). Each folder's own fixtures are in its
``conftest.py``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from .support.engines import EnginePool

# The session's vLLM engines start their processes from a preloaded forkserver (test-only; see
# interp_testkit.forked_engines): a start is ~5 s instead of ~25 s of spawning and importing.
if importlib.util.find_spec("vllm") is not None:
    from interp_testkit import forked_engines

    forked_engines.install()

# The test suite's third-party backend (tests/toy_backend) serves "toy" only where this is set:
# for this session and the subprocesses it starts, never for a user of the dev install.
os.environ["INTERP_TOY_BACKEND"] = "1"


@pytest.fixture(scope="module")
def direct() -> Iterator[Any]:
    """``interp:tiny`` on eager behind a sync facade, one per module (to compare a served or
    command-line answer with the model's own); a module may define its own ``direct``."""
    from interp_engine import load_model, sync_model

    model = sync_model(load_model("interp:tiny", backend="eager"))
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    """The session's shared vLLM engines (:class:`support.engines.EnginePool`); all shut down at the end."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def vllm_engines(engine_pool: EnginePool) -> Any:
    """``get(family, **engine_args)``: one started vLLM engine per (family, args) for the whole
    session, behind its sync facade (the facade's loop owns the engine)."""
    return engine_pool.get
