"""Child processes of the test process, for checks that an engine leaves nothing behind.

A vLLM engine runs as children of the caller (the engine core, which starts the workers). After
``shutdown()`` they must be gone *and reaped*: a zombie still counts as left behind. Python's own
``multiprocessing`` helpers — its resource tracker, and the forkserver the suite's engines are
forked from (``interp_testkit.forked_engines``), each started with the first child and kept for
the life of the process — are not an engine's and are ignored.
"""

from __future__ import annotations

import time

import psutil

_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")

EXIT_FAULTS = ("Traceback", "TypeError", "Exception ignored")
"""What the stderr of a script that shut its engine down and exited never holds (vLLM's
``AsyncLLM.__del__`` at interpreter teardown used to print ``TypeError: 'NoneType' object is not
callable`` after every shutdown)."""


def _is_multiprocessing_helper(proc: psutil.Process) -> bool:
    try:
        command = " ".join(proc.cmdline())
        return any(helper in command for helper in _HELPERS)
    except psutil.ZombieProcess:
        return False
    except psutil.Error:
        return False


def children() -> dict[int, psutil.Process]:
    """This process's descendants (zombies included), by pid."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        if not _is_multiprocessing_helper(proc):
            out[proc.pid] = proc
    return out


def _state(proc: psutil.Process) -> str | None:
    """``None`` if the process is gone (and reaped), else its name and status."""
    try:
        if not proc.is_running():
            return None
        return f"{proc.pid} {proc.name()} ({proc.status()})"
    except psutil.NoSuchProcess:  # ZombieProcess is a NoSuchProcess: check it first
        return None if not psutil.pid_exists(proc.pid) else f"{proc.pid} (zombie)"


def left_over(procs: dict[int, psutil.Process], timeout: float = 15.0) -> list[str]:
    """Poll up to ``timeout`` seconds until every process in ``procs`` is gone; return those
    still there (running or unreaped zombies), described."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = [s for s in (_state(p) for p in procs.values()) if s is not None]
        if not remaining or time.monotonic() >= deadline:
            return remaining
        time.sleep(0.25)


def new_children(before: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """Descendants that were not there in ``before``."""
    return {pid: p for pid, p in children().items() if pid not in before}
