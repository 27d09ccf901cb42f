"""ASGI plumbing of the server: request slots, and what happens when a client goes away (a
stream's model generator is closed, a pending model call is cancelled;
either makes the backend abort its engine request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..protocol._protocol import StreamStep
from ..steering._spec import SteeringSpec
from ._errors import ApiError, ClientGone
from ._render import check_finite_steps

T = TypeVar("T")


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
    """At most ``n`` requests on the model at once; the others wait, at most ``timeout`` seconds
    (then ``503 Overloaded`` with ``Retry-After``). ``in_flight`` counts holders, ``queued`` waiters."""

    def __init__(self, n: int, timeout: float = 30.0) -> None:
        self._semaphore = asyncio.Semaphore(n)
        self.n = n
        self.timeout = timeout
        self.in_flight = 0
        self.queued = 0

    async def acquire(self) -> None:
        self.queued += 1
        try:
            await asyncio.wait_for(self._semaphore.acquire(), self.timeout)
        except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
            raise ApiError(
                503,
                "Overloaded",
                f"no request slot came free within {self.timeout:g} s ({self.n} requests are running); retry later",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            self.queued -= 1
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._semaphore.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class ModelStream:
    """A model's stream of steps holding a request slot. :meth:`next` pulls a step under the
    request's error mapping (``fields``) and refuses one holding inf or NaN; :meth:`close` closes
    the stream (the backend aborts its request) and frees the slot, once, however often it is
    called."""

    def __init__(
        self,
        steps: AsyncIterator[StreamStep],
        slots: Slots,
        fields: AbstractContextManager[None],
        spec: SteeringSpec | None,
    ) -> None:
        self.steps = steps
        self._slots = slots
        self._fields = fields
        self._spec = spec
        self._closed = False

    async def next(self) -> StreamStep | None:
        """The next step, or None once the stream has ended."""
        try:
            with self._fields:
                step = await anext(self.steps)
        except StopAsyncIteration:
            return None
        check_finite_steps([step], self._spec)
        return step

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            aclose = getattr(self.steps, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._slots.release()
