"""Test-only: vLLM's engine processes forked from a preloaded server instead of spawned.

A vLLM engine on the CPU build starts two processes, each spawned fresh (the platform forces
``spawn``): the engine core, then its worker, and each spends ~8 s importing vLLM and torch
before doing anything. The test suite starts ~50 engines, so :func:`install` makes the suite's
engines start from processes that already hold those imports:

- the engine core comes from a ``forkserver`` whose server imported this module (and with it
  vLLM's engine core, executor, CPU worker and model runner, and the interp-vllm plugin) once,
  at the first engine start;
- the engine core forks its workers (it holds the same imports, and has run no OpenMP region).

Each process still gets the environment of the moment it was created (a forkserver child would
otherwise inherit the server's): :class:`_EnvProcess` carries ``os.environ`` across. What the
server read at its imports stays as it read it, so an engine on another vLLM platform (the Ray
tests') is spawned as vLLM spawns it. The spawned path itself stays covered by those engines and
by the tests whose engines run in a process of their own (command-line, server and lifecycle
scripts), which never call :func:`install`.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

PRELOAD = (
    "interp_testkit.forked_engines",
    "setproctitle",  # vLLM names its processes with it
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "interp_vllm._vllm_entry",
    "interp_vllm.worker._manager",
)
"""What the server imports before it forks its first engine core."""

_USERS = (
    "vllm.utils.system_utils",
    "vllm.v1.engine.utils",
    "vllm.v1.engine.coordinator",
    "vllm.v1.executor.multiproc_executor",
)
"""The vLLM modules that hold ``get_mp_context`` by name."""


class _EnvProcess(ForkServerProcess):
    """A forkserver process that runs with the environment of the moment it was created."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self) -> None:
        # only what differs: rebuilding the whole environment would move it away from argv,
        # where setproctitle writes the title vLLM gives its processes
        for name in set(os.environ) - set(self._environ):
            del os.environ[name]
        for name, value in self._environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        super().run()


class _EnvContext(ForkServerContext):
    Process = _EnvProcess


_CONTEXT = _EnvContext()

_V2_SERVER = forkserver.ForkServer()
"""A second server for engines on vLLM's V2 runner: started inside the V2 runner's environment
(``interp_testkit.runners``), so Python loads the stand-in Triton backend in it before it imports
vLLM, and its children hold that import."""
_V2_SERVER.set_forkserver_preload([*PRELOAD, "vllm.v1.worker.cpu.model_runner"])


class _V2Process(_EnvProcess):
    """A process of :data:`_V2_SERVER` (multiprocessing's forkserver Popen talks to the module's
    one server: it is pointed at the second one while the process starts)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        from multiprocessing import popen_forkserver

        saved = forkserver.connect_to_new_process
        forkserver.connect_to_new_process = _V2_SERVER.connect_to_new_process
        try:
            return popen_forkserver.Popen(process_obj)
        finally:
            forkserver.connect_to_new_process = saved


class _V2Context(ForkServerContext):
    Process = _V2Process


_V2_CONTEXT = _V2Context()


def _get_mp_context() -> Any:
    """The front end's engine cores from the server (those on the V2 runner's harness,
    ``interp_testkit.runners``, from the second server); an engine core's workers by ``fork``.
    An engine on the Ray test platform (``interp_testkit.ray_cpu``) is spawned as vLLM spawns
    it: the server chose its vLLM platform once, at its imports, without that platform."""
    from . import ray_cpu, runners

    if os.environ.get(ray_cpu.ENV) == "1":
        return multiprocessing.get_context("spawn")
    if runners.is_v2() and multiprocessing.parent_process() is None:
        return _V2_CONTEXT
    if multiprocessing.parent_process() is None:
        return _CONTEXT
    return multiprocessing.get_context("fork")


def install() -> None:
    """Route vLLM's process creation in this process (and in the engine cores it starts) through
    :func:`_get_mp_context`."""
    import importlib

    os.environ["_INTERP_FORKED_ENGINES"] = "1"  # the server installs it too, as it imports this module
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    for name in _USERS:
        module = importlib.import_module(name)
        module.get_mp_context = _get_mp_context  # type: ignore[attr-defined]


if os.environ.get("_INTERP_FORKED_ENGINES"):
    install()
