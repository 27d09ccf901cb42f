"""``run``: serve an app with uvicorn until SIGINT or SIGTERM, with the server's connection bounds
and an API key required off loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Collection
from typing import Any

from .._errors import InvalidOption
from ..protocol._protocol import InterpModel
from ._app import create_app
from ._guard import API_KEY_ENV, LOOPBACK_HOSTS, is_loopback, uvicorn_config
from ._limits import ServerLimits


def run(
    model_or_path: InterpModel | str | os.PathLike[str],
    *,
    backend: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    insecure_no_auth: bool = False,
    trusted_hosts: Collection[str] | None = None,
    trust_request_chat_template: bool = False,
    **load_options: Any,
) -> None:
    """Serve the model with uvicorn until SIGINT or SIGTERM, then return: in-flight requests get
    ``GRACEFUL_SHUTDOWN_S`` seconds to finish, streams still open are cancelled (their engine
    requests aborted) and the lifespan shuts the model down.

    ``api_key`` (default: the ``INTERP_API_KEY`` environment variable) is required of every
    request but ``GET /v1/health``, as ``Authorization: Bearer <key>``. Binds to loopback unless
    ``host`` says otherwise; a non-loopback ``host`` without a key is refused (``InvalidOption``)
    unless ``insecure_no_auth=True``. ``trusted_hosts`` (default: the loopback names on a
    loopback bind, any otherwise) are the ``Host`` names answered. ``trust_request_chat_template``:
    see :func:`create_app`."""
    import uvicorn

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(host) and not insecure_no_auth:
        raise InvalidOption(
            f"refusing to serve {host!r} (not loopback) without an API key: give one (--api-key-file FILE, "
            f"${API_KEY_ENV}, run(api_key=...)) or say --insecure-no-auth / insecure_no_auth=True"
        )
    if trusted_hosts is None and is_loopback(host):
        trusted_hosts = LOOPBACK_HOSTS
    app = create_app(
        model_or_path,
        backend=backend,
        limits=limits,
        api_key=api_key,
        trusted_hosts=trusted_hosts,
        trust_request_chat_template=trust_request_chat_template,
        **load_options,
    )
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    if threading.current_thread() is not threading.main_thread():
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        return
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it
    # found; with the default one the process would die by the signal after a clean shutdown.
    # Ours ends run() instead, so the caller exits normally (as on SIGINT).
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.run()
    except (_Stopped, KeyboardInterrupt):  # uvicorn raises the signal again once shut down
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Stopped(Exception):
    """SIGTERM was received: ``run`` returns."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped


GRACEFUL_SHUTDOWN_S = 10
"""Seconds ``run`` lets open requests (streams) finish on shutdown before cancelling them."""
