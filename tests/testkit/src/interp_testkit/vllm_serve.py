"""``vllm serve`` in a subprocess on a loopback port, for the tests and benchmarks of interp-vllm's
endpoint plugin (``tests/vllm/test_vllm_serve.py``, ``bench/vllm_serve_overhead.py``)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""What the suite's engines run with on a CPU: 1 GiB of KV cache, no thread pinning."""


def serve_command() -> list[str]:
    """``vllm serve``: the ``vllm`` script where it works, else the module it runs. The CPU build's
    script looks up the version of a distribution named ``vllm`` (this one is ``vllm-cpu``) and
    exits before parsing anything; the server module takes the same arguments."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    return [str(pathlib.Path(sys.executable).parent / "vllm"), "serve"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServe:
    """``vllm serve MODEL ARGS`` with ``env`` added to this process's environment (e.g.
    ``VLLM_PLUGINS``), its output in ``log``; :meth:`wait` until ``/health`` answers."""

    def __init__(
        self, model: str | os.PathLike[str], args: Sequence[str], log: pathlib.Path, env: Mapping[str, str] = {}
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
            *serve_command(),
            "--model",
            os.fspath(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.out = log.open("wb")
        self.process = subprocess.Popen(
            command, stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, **CPU_ENV, **env}
        )

    def wait(self, timeout: float = 300) -> VllmServe:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.process.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve did not answer within {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.out.close()

    def __enter__(self) -> VllmServe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
