"""Who may ask, and how long a request may take to arrive.

- :class:`Guard`, ASGI middleware: the trusted ``Host`` check (a browser page cannot reach a
  loopback server by DNS rebinding), the API key (``Authorization: Bearer <key>``, compared in
  constant time, on every path but ``/v1/health``), and the body's size and deadline.
- :func:`guarded_protocol`: uvicorn's HTTP protocol with a connection cap, a deadline for a
  request's line and headers, and a bound on their size (uvicorn has neither of the first two).
- :func:`uvicorn_config`: the uvicorn configuration that applies an app's :class:`ServerLimits`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import ApiError
from ._limits import ServerLimits

if TYPE_CHECKING:
    import uvicorn

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The ``Host`` names a loopback server answers to by default."""
OPEN_PATHS = frozenset({"/v1/health"})
"""Paths served without the API key (a load balancer's health check)."""
API_KEY_ENV = "INTERP_API_KEY"
"""The environment variable ``run`` and ``interp serve`` read the API key from."""
ERROR_SCOPE_KEY = "interp_engine.error"
"""Where an error response's type is left in the ASGI scope (read by the metrics)."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_api_key(key: str) -> str:
    """``key`` if it can travel in an ``Authorization`` header, else ``ValueError``."""
    if not key or not key.isascii() or not key.isprintable() or key != key.strip() or " " in key:
        raise ValueError("an API key is printable ASCII with no spaces, at least one character")
    return key


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _host_name(value: bytes) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Guard:
    """ASGI middleware in front of the app (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: ServerLimits,
        api_key: str | None,
        trusted_hosts: Collection[str] | None,
    ) -> None:
        self.app = app
        self.limits = limits
        self._key = None if api_key is None else _digest(b"Bearer " + api_key.encode("ascii"))
        self._hosts = None if trusted_hosts is None else frozenset(h.strip("[]").lower() for h in trusted_hosts)
        self._buffered = 0  # bytes of bodies still arriving, over every connection

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        scope[ERROR_SCOPE_KEY] = error.error
        await error.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name, value)
        if self._hosts is not None:
            host = _host_name(headers.get(b"host", b""))
            if host not in self._hosts:
                message = (
                    f"the Host header names {host!r}, which this server does not answer to "
                    f"(it answers to {', '.join(sorted(self._hosts))})"
                )
                await self._refuse(scope, receive, send, ApiError(400, "UntrustedHost", message, field="Host"))
                return
        if self._key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization")
            if given is None or not hmac.compare_digest(_digest(given), self._key):
                said = "no Authorization header" if given is None else "a wrong API key"
                error = ApiError(
                    401,
                    "Unauthorized",
                    f"this server needs an API key: send 'Authorization: Bearer <key>' ({said} was sent)",
                    field="Authorization",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await self._refuse(scope, receive, send, error)
                return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await self._refuse(scope, receive, send, ApiError(400, "BadRequest", "invalid Content-Length header"))
                return
            if length > self.limits.max_body_bytes:
                await self._refuse(scope, receive, send, self._too_large(str(length)))
                return
        bounded, release = self._bounded(receive)
        try:
            await self.app(scope, bounded, send)
        finally:
            release()

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            "LimitExceeded",
            f"the request body is {size} bytes; the server's limit is {self.limits.max_body_bytes}",
            field="body",
            valid=self.limits.max_body_bytes,
            headers={"Connection": "close"},
        )

    def _bounded(self, receive: Receive) -> tuple[Receive, Callable[[], None]]:
        """``receive`` with the body's size bound and deadline (from the first read: the end of
        the headers) and its share of ``max_buffered_bytes`` while it arrives; once the body is
        in, messages pass through untouched. The second function gives the share back."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        received = held = 0
        done = False
        timeout = self.limits.body_timeout_s

        def release() -> None:
            nonlocal held
            self._buffered -= held
            held = 0

        async def bounded() -> Message:
            nonlocal deadline, received, done, held
            if done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                done = True
                release()
                raise ApiError(
                    408,
                    "RequestTimeout",
                    f"the request body did not arrive within {timeout:g} s",
                    field="body",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                received += size
                if received > self.limits.max_body_bytes:
                    done = True
                    release()
                    raise self._too_large(f"over {received}")
                done = not message.get("more_body", False)
                if done:
                    release()
                else:
                    held += size
                    self._buffered += size
                    if self._buffered > self.limits.max_buffered_bytes:
                        done = True
                        release()
                        raise ApiError(
                            503,
                            "Overloaded",
                            f"request bodies still arriving hold the server's limit of "
                            f"{self.limits.max_buffered_bytes} bytes; retry later",
                            headers={"Retry-After": "1", "Connection": "close"},
                        )
            else:
                done = True
                release()
            return message

        return bounded, release


def _raw_response(status: int, reason: str, body: Mapping[str, Any], headers: Mapping[str, str] = {}) -> bytes:
    content = json.dumps(body, ensure_ascii=True).encode("ascii")
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(content)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + content


def guarded_protocol(base: type[Any], limits: ServerLimits) -> type[Any]:
    """``base`` (uvicorn's httptools or h11 protocol) with ``limits.max_connections``,
    ``limits.header_timeout_s`` and ``limits.max_header_bytes`` applied to each connection."""

    class GuardedProtocol(base):  # type: ignore[misc]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                body = {
                    "error": "Overloaded",
                    "message": f"the server holds its limit of {limits.max_connections} connections; retry later",
                }
                self._refuse(503, "Service Unavailable", body, {"retry-after": "1"})
                return
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_bytes = 0
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, status: int, reason: str, body: Mapping[str, Any], headers: Mapping[str, str] = {}) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(_raw_response(status, reason, body, headers))
                self.transport.close()

        def _header_timeout(self) -> None:
            self._header_timer = None
            message = f"the request line and headers did not arrive within {limits.header_timeout_s:g} s"
            self._refuse(408, "Request Timeout", {"error": "RequestTimeout", "message": message})

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            waiting = before is None or before.response_complete
            if waiting:
                self._arm()
                self._header_bytes += len(data)
            super().data_received(data)
            if self.cycle is not before:  # a request's headers are complete
                self._disarm()
            elif waiting and self._header_bytes > limits.max_header_bytes:
                message = f"the request line and headers exceed {limits.max_header_bytes} bytes"
                self._refuse(431, "Request Header Fields Too Large", {"error": "LimitExceeded", "message": message})

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request uvicorn's parser cannot read: the server's error shape, not plain text."""
            self._refuse(400, "Bad Request", {"error": "BadRequest", "message": f"not an HTTP/1.1 request ({msg})"})

    return GuardedProtocol


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> uvicorn.Config:
    """A uvicorn configuration serving ``app`` (from :func:`create_app`) under its
    :class:`ServerLimits`: the connection cap, the header deadline and size, the keep-alive
    time, no WebSocket upgrades. ``options`` go to ``uvicorn.Config`` (``log_level``, ...)."""
    import uvicorn

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is optional in uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    served = getattr(getattr(app, "state", None), "served", None)
    limits: ServerLimits = served.limits if served is not None else ServerLimits()
    options.setdefault("timeout_graceful_shutdown", 10)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(base, limits),
        ws="none",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works (call_later)
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **options,
    )
