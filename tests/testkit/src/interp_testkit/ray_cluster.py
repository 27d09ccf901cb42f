"""A local Ray cluster on loopback for the tests: ``ray start --head --block`` in a session of its
own, the way a cluster's head node starts, stopped (with every process of its session) when the
context ends. Its workers run this environment's Python, so they import what the tests import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

LOOPBACK_ENV = {
    # Ray resolves 127.0.0.1 to the machine's address unless clusters are "disabled", which keeps
    # every Ray process (and vLLM's, through VLLM_HOST_IP) on loopback
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # no token authentication, whatever ~/.ray/auth_token holds (a local `ray.init()` writes one;
    # a driver that finds it turns token auth on and a cluster started without it refuses it)
    "RAY_AUTH_MODE": "disabled",
}
"""The environment of the cluster's processes (:func:`local_ray_cluster` also sets the auth mode
in this process while the cluster runs, for a driver that joins it)."""


STARTUP_TIMEOUT = "The current node timed out during startup"
"""What ``ray start`` says when its raylet did not register within Ray's fixed 30 s."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def head_command(port: int, folder: str, num_cpus: int, num_gpus: int) -> list[str]:
    """``ray start --head --block`` on loopback, on ``port``, its files under ``folder``."""
    return [
        *(sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"),
        *("--node-ip-address", "127.0.0.1", "--port", str(port), "--temp-dir", folder),
        *("--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--object-store-memory", str(10**8)),
        *("--include-dashboard", "false", "--disable-usage-stats"),
        # ports of its own where Ray's defaults are fixed (another cluster on this machine may hold them)
        *("--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())),
    ]


def _stop(head: subprocess.Popen[bytes], folder: str) -> None:
    """Stop the head (``ray start --block`` stops the cluster's processes), anything left in its
    session, and remove its folder."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)  # the head's own session: only the cluster's processes
        head.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)  # anything of the cluster left in its session
    shutil.rmtree(folder, ignore_errors=True)


def _start_head(num_cpus: int, num_gpus: int, env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], str, int]:
    """A started head ``(process, folder, port)``, its node registered; stopped again and
    :class:`RuntimeError` (with its log) if it exits or does not register within 240 s (a machine
    busy starting engines beside it has left a head at its first log lines for two minutes)."""
    folder = tempfile.mkdtemp(prefix="ir-", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    log_path = os.path.join(folder, "start.log")
    with open(log_path, "w") as log:
        # like a node of its own: nothing of vLLM's environment here (the front end's reaches the
        # workers through vLLM's executor)
        inherited = {name: value for name, value in os.environ.items() if not name.startswith("VLLM_")}
        head = subprocess.Popen(
            head_command(port, folder, num_cpus, num_gpus),
            env={**inherited, **LOOPBACK_ENV, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    while True:  # the head's port open and its node registered (a loaded machine lags between them)
        with socket.socket() as s, open(log_path) as started:
            if s.connect_ex(("127.0.0.1", port)) == 0 and "Ray runtime started" in started.read():
                return head, folder, port
        if head.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as failed:
                text = failed.read()
            _stop(head, folder)
            raise RuntimeError(f"the local Ray cluster did not start:\n{text[-3000:]}")
        time.sleep(0.25)


@contextlib.contextmanager
def local_ray_cluster(
    *, num_cpus: int = 2, num_gpus: int = 0, env: Mapping[str, str] = {}, retries: int = 2
) -> Iterator[str]:
    """A one-node Ray cluster on loopback with ``num_cpus`` CPUs and ``num_gpus`` logical GPUs
    (Ray only counts them), its processes started with ``env`` added; its address. A head whose
    raylet missed Ray's startup deadline (:data:`STARTUP_TIMEOUT`: a fixed 30 s, which a loaded
    machine can miss) is started again, up to ``retries`` times."""
    for attempt in range(retries + 1):
        try:
            head, folder, port = _start_head(num_cpus, num_gpus, env)
            break
        except RuntimeError as exc:
            if attempt == retries or STARTUP_TIMEOUT not in str(exc):
                raise
    # a driver in this process (or started from it) joins with the cluster's auth mode
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = LOOPBACK_ENV["RAY_AUTH_MODE"]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before
        _stop(head, folder)
