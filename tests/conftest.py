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

from interp_testkit import runners

from .support.engines import EnginePool


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The session's vLLM engines start their processes from a preloaded forkserver (test-only;
    see interp_testkit.forked_engines): a start is ~5 s instead of ~25 s of spawning and
    importing. Not in pytest-xdist's controller, which runs no test (installing imports vLLM)."""
    controller = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
    if not controller and importlib.util.find_spec("vllm") is not None:
        from interp_testkit import forked_engines

        forked_engines.install()


# The test suite's third-party backend (tests/toy_backend) serves "toy" only where this is set:
# for this session and the subprocesses it starts, never for a user of the dev install.
os.environ["INTERP_TOY_BACKEND"] = "1"


WHOLE_FOLDERS = ("vllm_static",)
"""Folders that run whole in one test process: their modules share engines a folder-scoped
fixture starts (vllm-static's compiled engines, about a minute each)."""

FOLDER_ORDER = ("vllm_static", "vllm", "server", "docs", "cli", "analysis", "eager", "core")
"""The folders by how long their tests take, longest first; the others come after these (the
order of the collection, which decides among groups of as many tests: below)."""

LONG_MODULES = (
    "vllm/test_vllm_lifecycle.py",
    "vllm/test_vllm_ray.py",
    "vllm/test_vllm_families.py",
    "vllm/test_vllm_compiled_families.py",
)
"""The modules that start the most engines of their own (scripts, a Ray cluster, every family,
every family compiled):
first in their folder's part of the collection."""


V1_SLICE = (
    "vllm/test_vllm_parity.py",
    "vllm/test_vllm_points.py",
    "vllm/test_vllm_serving.py",
    "vllm/test_vllm_sae.py",
    "vllm/test_vllm_compiled.py",
)
"""The modules whose tests also run on vLLM's V1 model runner by default (every vLLM test runs
on V2). vllm-static is among them through test_vllm_points (a vllm-static engine whose taps V1's
model load installs before it compiles) and test_vllm_compiled. The runner modules hold nothing
for tensor parallelism (each rank's seam is a single worker's), so test_vllm_tp runs on V2 only.
``INTERP_TEST_RUNNERS`` chooses otherwise: ``v1``, ``v2``, or ``all`` (both, everywhere)."""


def _runners(module: str, marked: pytest.Mark | None = None) -> list[str]:
    """The model runners the vLLM tests of ``module`` (``vllm/test_x.py``) run on; a test marked
    ``@pytest.mark.runners("v1")`` runs on those by default (a test whose subject is not the
    model runner, too slow under V2's Triton interpreter to run there as well)."""
    chosen = os.environ.get("INTERP_TEST_RUNNERS", "")
    if chosen in ("", "default"):
        if marked is not None:
            named = list(marked.args)
            if not named or any(name not in runners.RUNNERS for name in named):
                raise pytest.UsageError(f"@pytest.mark.runners{tuple(named)!r}: name v1, v2 or both")
            return named
        return ["v2", "v1"] if module in V1_SLICE else ["v2"]
    if chosen == "all":
        return list(runners.RUNNERS)
    picked = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = [name for name in picked if name not in runners.RUNNERS]
    if unknown or not picked:
        raise pytest.UsageError(f"INTERP_TEST_RUNNERS={chosen!r}: name v1, v2, both (v1,v2) or all")
    return picked


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses a vLLM engine (through the ``vllm_runner`` fixture, autouse in the
    vLLM folders) runs once per model runner of :func:`_runners`."""
    if "vllm_runner" in metafunc.fixturenames:
        module = metafunc.definition.nodeid.split("::", 1)[0].removeprefix("tests/")
        marked = metafunc.definition.get_closest_marker("runners")
        metafunc.parametrize("vllm_runner", _runners(module, marked), indirect=True, scope="session")


def _folder(nodeid: str) -> str:
    """``vllm`` for ``tests/vllm/test_x.py::test_y``; ``""`` for a module directly in ``tests``."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 else ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the tests by :data:`FOLDER_ORDER` and :data:`LONG_MODULES` (each folder otherwise
    keeps its own order)."""

    def rank(item: pytest.Item) -> tuple[int, int, bool]:
        name = _folder(item.nodeid)
        module = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        # a folder's tests on one runner, then on the other: each switch restarts its engines
        callspec = getattr(item, "callspec", None)
        runner = callspec.params.get("vllm_runner") if callspec is not None else None
        order = runners.RUNNERS.index(runner) if runner in runners.RUNNERS else -1
        folder = FOLDER_ORDER.index(name) if name in FOLDER_ORDER else len(FOLDER_ORDER)
        return folder, -order, module not in LONG_MODULES

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler for ``pytest -n 2`` (scripts/test.sh): a module goes to one
    process whole (its module-scoped fixtures are set up once), and so does a folder of
    :data:`WHOLE_FOLDERS`. pytest-xdist sends the groups with the most tests first (its
    default), and among groups of as many tests, in the collection's order. That mixes the
    engine-heavy groups with the thousands of quick ones: sending the collection's order
    instead (``config.option.loadscopereorder = False``) had both processes start
    engine-heavy folders at once, overloading the two cores, and the run was slower."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrFolder(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            folder = _folder(nodeid)
            return f"tests/{folder}" if folder in WHOLE_FOLDERS else module

    return ModuleOrFolder(config, log)


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
def vllm_runner(request: pytest.FixtureRequest, engine_pool: EnginePool) -> Iterator[str]:
    """The vLLM model runner of this test (``"v1"`` or ``"v2"``, parametrized by
    :func:`pytest_generate_tests`, else :func:`interp_testkit.runners.current`): the engines
    started while it is in place run on it (``interp_testkit.runners``), the pool's among them.
    When the session moves to the other runner, the pool's engines on this one are shut down: a
    process holds one runner's engines at a time (each ~1 GB; both runners' overflow memory)."""
    # a test that asks for an engine at run time (getfixturevalue) is not parametrized: it runs
    # on the runner the environment names, or vLLM's own choice
    runner = getattr(request, "param", None) or runners.current()
    with runners.using(runner):
        yield runner
    engine_pool.release(keep=lambda engine_runner, args: engine_runner != runner)


@pytest.fixture(scope="session")
def vllm_engines(engine_pool: EnginePool, vllm_runner: str) -> Any:
    """``get(family, **engine_args)``: one started vLLM engine per (runner, family, args) for the
    whole session, behind its sync facade (the facade's loop owns the engine)."""
    return engine_pool.get
