"""A script that starts a vLLM engine from its top-level code, with no ``if __name__ == "__main__":``.

vLLM's CPU platform starts the engine core with the ``spawn`` method, which re-imports the script
in the new process; there the script would start a second engine. Run as a user runs it
(``python script.py``, a subprocess of its own), it must fail at once with
:class:`~interp_engine.UnguardedScript` naming the guard, in the child (which starts nothing) and
in the parent, and leave no process behind. The guarded form of the same work is
``test_vllm_lifecycle.test_a_script_that_shuts_down_exits_without_a_traceback``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from interp_engine import UnguardedScript
from interp_testkit.suite import vllm_model_path

UNGUARDED = """
from interp_engine import load_model, sync_model

sync = sync_model(load_model({path!r}, backend="vllm"))
sync.warmup()
print("warmed up")
sync.shutdown()
"""

GUARD = 'if __name__ == "__main__":'


def _session(sid: int) -> list[str]:
    """The processes still in session ``sid`` (the script's and its children's)."""
    left = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {proc.info['name']}")
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return left


@pytest.mark.runners("v1")  # spawn re-importing the script, before any model runner exists
def test_an_unguarded_script_fails_with_the_fix(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(path=str(vllm_model_path("gpt2"))))
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    elapsed = time.monotonic() - started
    assert proc.returncode != 0, out + err[-4000:]
    assert "warmed up" not in out
    # the child that re-imported the script says so and starts nothing (no second engine whose
    # start multiprocessing would refuse) ...
    child = "UnguardedScript: the vLLM engine cannot start: this process was started by vLLM and is re-importing"
    assert f"{child} the main module ({script})" in err, err[-4000:]
    assert "An attempt has been made to start a new process" not in err, err[-4000:]
    # ... and the parent's error is the same, not vLLM's "Engine core initialization failed"
    last = err.strip().splitlines()[-1]  # vLLM may prefix its processes' stderr lines ("[rank0]: ")
    parent = "interp_engine._errors.UnguardedScript: the vLLM engine cannot start: the engine's process re-imported"
    assert f"{parent} the main module ({script})" in last and GUARD in last, last
    assert elapsed < 300
    deadline = time.monotonic() + 15
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session(proc.pid), _session(proc.pid)
    assert not (pathlib.Path(tempfile.gettempdir()) / f"interp-vllm-unguarded-{proc.pid}").exists()  # the note is gone


def test_the_check_outside_a_spawned_import(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check passes in a process that is not importing its parent's script; in one that is
    (multiprocessing's ``_inheriting``, set while a spawned child imports the main module) it
    raises and leaves the note its parent reads once."""
    from multiprocessing import process

    from interp_vllm.frontend import _spawn

    monkeypatch.setattr(_spawn, "_note", lambda pid: tmp_path / f"note-{pid}")
    _spawn.check_not_bootstrapping()
    assert not _spawn.child_reported()
    monkeypatch.setattr(process.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(UnguardedScript, match=f"this process was started by vLLM.*{GUARD}"):
        _spawn.check_not_bootstrapping()
    assert (tmp_path / f"note-{os.getppid()}").exists()
    monkeypatch.setattr(os, "getpid", os.getppid)  # this process as the parent that reads the note
    assert _spawn.child_reported() and not _spawn.child_reported()
