"""The lifecycle every backend's model shares (:class:`~interp_engine.protocol._base.ModelBase`
extends it): ``shutdown()`` / ``close()`` are idempotent and callable from any loop or thread, an
engine found dead (by a failed call or the backend's cheap probe) stays dead, and every call
after either answers ``ModelClosed``."""

from __future__ import annotations

import asyncio
import threading

from .._errors import ModelClosed


class ModelLifecycle:
    """Open, dead (its engine gone) or closed: the state a model's calls check first
    (:meth:`_check_open`), and its release (``_close_resources``, once)."""

    backend: str

    def __init__(self) -> None:
        self._closed = False
        self._dead: str | None = None
        self._lifecycle_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether the model was shut down."""
        return self._closed

    @property
    def dead(self) -> str | None:
        """Why the model's engine died (its process gone, ...), or ``None`` while it lives (the
        backend is asked: :meth:`_probe_engine`). A dead model answers every call with
        ``ModelClosed``; ``shutdown()`` still reaps it."""
        if self._dead is None and not self._closed:
            self._probe_engine()
        return self._dead

    def _probe_engine(self) -> None:
        """A backend with an engine in another process checks it here, cheaply, and calls
        :meth:`_engine_died` if it is gone (default: only failed calls find out)."""

    def _engine_died(self, reason: str) -> ModelClosed:
        """Mark the engine dead (every later call raises ``ModelClosed`` at once) and return the
        error for the call that found out."""
        if self._dead is None:
            self._dead = reason
        return self._closed_error()

    def _check_open(self) -> None:
        if self._closed or self._dead is not None:
            raise self._closed_error()

    def _closed_error(self) -> ModelClosed:
        if self._dead is not None and not self._closed:
            return ModelClosed(f"the {self.backend} engine died ({self._dead}); shut this model down and load it again")
        return ModelClosed(f"this {self.backend} model was shut down; load it again")

    async def shutdown(self) -> None:
        """Release the model; idempotent, callable from any loop or thread (the release runs
        off the event loop)."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Release the model now, blocking; idempotent and thread-safe. Every later call on the
        model raises ``ModelClosed``."""
        with self._lifecycle_lock:
            if self._closed:
                return
            self._closed = True
        self._close_resources()

    def _close_resources(self) -> None:
        """Free what the model holds (weights, engine, processes); runs once, on the first close."""
