"""A script without ``if __name__ == "__main__":`` that starts a vLLM engine.

vLLM starts its engine core (and, with several workers, each worker) as a new process. Under the
``spawn`` start method, which vLLM's CPU platform always uses and which is the default on macOS,
that process re-imports the caller's main module before it runs anything: a script whose
top-level code starts an engine starts another one in the child, and multiprocessing refuses with
"An attempt has been made to start a new process before the current process has finished its
bootstrapping phase", which reaches the parent only as "Engine core initialization failed".

:func:`check_not_bootstrapping` runs before an engine is built: in such a child it writes a note
for its parent and raises :class:`~interp_engine.UnguardedScript` instead of starting anything.
The parent, whose engine then failed to start, finds the note with :func:`child_reported` and
raises the same error instead of vLLM's.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile
from multiprocessing import process

from interp_engine import UnguardedScript

_NOTE = "interp-vllm-unguarded-{pid}"


def _note(pid: int) -> pathlib.Path:
    """Where a spawned child of process ``pid`` leaves its note."""
    return pathlib.Path(tempfile.gettempdir()) / _NOTE.format(pid=pid)


def bootstrapping() -> bool:
    """Whether this process is a spawned child still importing its parent's main module
    (multiprocessing's own test before it starts a process)."""
    return bool(getattr(process.current_process(), "_inheriting", False))


def _script() -> str:
    """The main module's file, in parentheses: in a spawned child the module being imported is
    ``__mp_main__`` (``__main__`` is multiprocessing's own until the import is done)."""
    for name in ("__mp_main__", "__main__"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            return f" ({path})"
    return ""


def error(*, in_child: bool) -> UnguardedScript:
    """The error that names the fix; ``in_child``: raised in the child that re-imported the script."""
    where = (
        "this process was started by vLLM and is re-importing the main module"
        if in_child
        else "the engine's process re-imported the main module"
    )
    return UnguardedScript(
        f"the vLLM engine cannot start: {where}{_script()}, whose top-level code starts another "
        "engine. vLLM starts its engine processes with the 'spawn' method (always on its CPU build), "
        "and a spawned process imports the script before it runs. Put the script's work under "
        '`if __name__ == "__main__":` (or in a function called from there).'
    )


def check_not_bootstrapping() -> None:
    """Raise :class:`~interp_engine.UnguardedScript` (and leave a note for the parent) when this
    process is a spawned child importing its parent's main module, where no process can start."""
    if not bootstrapping():
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with contextlib.suppress(OSError):  # a note already there, or none possible: the child's error says it
        os.close(os.open(_note(os.getppid()), flags, 0o600))
    raise error(in_child=True)


def clear() -> None:
    """Forget a note left for this process (before it starts an engine)."""
    with contextlib.suppress(OSError):
        _note(os.getpid()).unlink()


def child_reported() -> bool:
    """Whether a spawned child of this process refused to start an engine while importing the
    main module (the note is removed)."""
    note = _note(os.getpid())
    try:
        note.unlink()
    except OSError:
        return False
    return True
