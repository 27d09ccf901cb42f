"""ASGI plumbing of the server: the body-size limit, request slots, and what happens when a
client goes away (a stream's model generator is closed, a pending model call is cancelled;
either makes the backend abort its engine request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import ApiError

T = TypeVar("T")


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413, by Content-Length up front, or
    while reading a body sent without one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            "LimitExceeded",
            f"the request body is {size} bytes; the server's limit is {self.max_bytes}",
            field="body",
            valid=self.max_bytes,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await ApiError(400, "BadRequest", "invalid Content-Length header").response()(scope, receive, send)
                return
            if length > self.max_bytes:
                await self._too_large(str(length)).response()(scope, receive, send)
                return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"over {received}")
            return message

        await self.app(scope, limited, send)


class EventStream(StreamingResponse):
    """Server-sent events whose model stream is closed however the response ends: finished,
    failed, or cancelled because the client went away (closing it makes the backend abort)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._close()


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first: a cancelled model call
    aborts its engine request, so a client that gives up frees the engine."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:  # the body is read: the next message is the disconnect
            if (await request.receive())["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


class Slots:
    """At most ``n`` requests on the model at once; the others wait. ``in_flight`` counts holders."""

    def __init__(self, n: int) -> None:
        self._semaphore = asyncio.Semaphore(n)
        self.in_flight = 0

    async def acquire(self) -> None:
        await self._semaphore.acquire()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._semaphore.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
