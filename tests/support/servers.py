"""A real uvicorn server on a loopback port, and the decoding of what the server sends (its
tensors, its server-sent event streams)."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import torch

from interp_engine.server import uvicorn_config


class LiveServer:
    """``with LiveServer(app) as server:`` serves ``app`` on ``server.url`` from a thread.

    Configured as ``run`` configures it (``uvicorn_config``: the connection cap, header deadline
    and size), or with ``run_config=False`` as a plain ``uvicorn.Config`` (no caps)."""

    def __init__(self, app: Any, *, run_config: bool = True) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        if run_config:
            config = uvicorn_config(app, log_level="error", timeout_graceful_shutdown=5)
        else:
            config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive(), "the server failed to start"
            assert time.monotonic() < deadline, "the server did not start within 60 s"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"
        self.sock.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


def is_error_body(body: Any) -> bool:
    """The server's one error shape: ``{"error": str, "message": str, ...}``."""
    return isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("message"), str)


def tensor(encoded: dict[str, Any]) -> torch.Tensor:
    """A float32 tensor as the server encodes it (base64 of little-endian floats and a shape)."""
    assert encoded["dtype"] == "float32"
    raw = base64.b64decode(encoded["data"])
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()).reshape(encoded["shape"])


def sse(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """``(event, data)`` pairs of a server-sent event stream."""
    event, data = "message", []
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
