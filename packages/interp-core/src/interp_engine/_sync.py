"""The sync facade: every async method of a model, minus the ``await``.

One background event loop per model runs the model's coroutines, so a vLLM engine built
through the facade belongs to that loop; a model with a blocking batched capture
(:class:`~interp_engine.BlockingCapture`, the eager backend's) is called for ``run_with_cache``
from the calling thread instead. Calls from several threads are safe; a call from inside a
running event loop is refused instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ._errors import ModelClosed, RunningLoopError, UnsupportedOperation
from .addresses._address import Address
from .chat._spans import ChatTokens
from .protocol._protocol import Activations, BlockingCapture, Completion, InterpModel, Points, Results, StreamStep
from .results._lens import LensRequest
from .steering._spec import SteeringSpec

T = TypeVar("T")

_facades: weakref.WeakKeyDictionary[Any, SyncModel] = weakref.WeakKeyDictionary()
_facades_lock = threading.Lock()


def _in_notebook_kernel() -> bool:
    """Whether this thread runs an IPython kernel's cells (Jupyter): its loop is the kernel's,
    never a model's, so blocking it on a model's own background loop cannot deadlock."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def refuse_inside_running_loop(what: str) -> None:
    """Raise ``RunningLoopError`` if the calling thread is running an event loop (except a
    Jupyter kernel's, where the sync surface is what a notebook user wants)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    if _in_notebook_kernel():
        return
    raise RunningLoopError(
        f"{what} is synchronous and was called from inside a running event loop, where it would "
        "block that loop (and deadlock if the model lives on it); await the model's async method "
        "instead, e.g. `await model.capture(...)`"
    )


class SyncModel:
    """A blocking mirror of an async model, driving it on one background event loop."""

    def __init__(self, model: InterpModel) -> None:
        self.model = model
        self.blocking: BlockingCapture | None = model if isinstance(model, BlockingCapture) else None
        """The model, when it captures without an event loop (:class:`BlockingCapture`): batched
        captures then go to it from the calling thread (:meth:`call`), not through this loop."""
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(
            target=_serve_forever,
            args=(self._loop,),
            name=f"interp-sync-{model.backend}",
            daemon=True,
        )
        self._thread.start()
        # when the facade is collected (with its model), its loop thread ends too
        weakref.finalize(self, _stop, self._loop)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SyncModel {state} over {self.model!r}>"

    # -- plumbing -------------------------------------------------------------------------
    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run the awaitable ``make()`` on this facade's loop and wait for its result."""
        refuse_inside_running_loop("this sync model call")
        if self._closed:
            raise ModelClosed("this sync model was shut down; load a new model")

        async def call() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` -- a blocking method of the model -- in the calling thread, refused where
        :meth:`run` would refuse it."""
        refuse_inside_running_loop("this sync model call")
        if self._closed:
            raise ModelClosed("this sync model was shut down; load a new model")
        return fn()

    def __getattr__(self, name: str) -> Any:
        # Anything the protocol does not name (backend extras) passes through; coroutine
        # methods are run on the loop.
        attr = getattr(self.model, name)
        if asyncio.iscoroutinefunction(attr):

            def call(*args: Any, **kwargs: Any) -> Any:
                return self.run(lambda: attr(*args, **kwargs))

            return call
        return attr

    # -- sync pass-through ---------------------------------------------------------------
    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        return self.model.to_tokens(text)

    def to_string(self, tokens: Any) -> str | list[str]:
        return self.model.to_string(tokens)

    def to_str_tokens(self, tokens: Any) -> list[str]:
        return self.model.to_str_tokens(tokens)

    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        **template_kwargs: Any,
    ) -> ChatTokens:
        """The model's ``chat_tokens`` (sync already: it renders and tokenizes, no compute)."""
        render = getattr(self.model, "chat_tokens", None)
        if render is None:
            raise UnsupportedOperation(
                f"the {self.model.backend} backend's model has no chat_tokens; the eager and vllm backends render chats"
            )
        result: ChatTokens = render(
            messages, add_generation_prompt=add_generation_prompt, template=template, **template_kwargs
        )
        return result

    # -- the async protocol, blocking ----------------------------------------------------
    def warmup(self) -> None:
        self.run(self.model.warmup)

    def capture(
        self,
        token_ids: Sequence[int],
        points: Points,
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Results:
        extra = _adapter(adapter)  # a backend written before adapters still works on the base model
        return self.run(lambda: self.model.capture(token_ids, points, steering_spec=steering_spec, **extra))

    def generate(self, token_ids: Sequence[int], *, max_tokens: int, **sampling: Any) -> Completion:
        if sampling.get("adapter", 0) is None:
            del sampling["adapter"]
        return self.run(lambda: self.model.generate(token_ids, max_tokens=max_tokens, **sampling))

    def capture_generation(
        self,
        token_ids: Sequence[int],
        points: Points,
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> tuple[Completion, Results]:
        extra: dict[str, Any] = {"lens": lens} if lens is not None else {}  # a backend without the lens still works
        extra.update(_adapter(adapter))
        return self.run(
            lambda: self.model.capture_generation(
                token_ids, points, max_tokens=max_tokens, steering_spec=steering_spec, **extra, **sampling
            )
        )

    def capture_attention(
        self,
        token_ids: Sequence[int],
        layers: Iterable[int],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Activations:
        extra: dict[str, Any] = _adapter(adapter)
        if steering_spec is not None:  # a backend written before the keyword still works unsteered
            extra["steering_spec"] = steering_spec
        return self.run(lambda: self.model.capture_attention(token_ids, layers, **extra))

    def decode_residuals(
        self, acts: torch.Tensor | Mapping[Address, torch.Tensor]
    ) -> torch.Tensor | dict[Address, torch.Tensor]:
        return self.run(lambda: self.model.decode_residuals(acts))

    def stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
        features: Iterable[Any] = (),
        lens: LensRequest | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> Iterator[StreamStep]:
        """Generated steps as a plain iterator (each step is produced on the background loop);
        ``features=[Features(...)]``: each step's readouts; ``lens=LensRequest(...)``: each
        step's ``lens``, the logit lens where it was produced."""
        extra: dict[str, Any] = {"lens": lens} if lens is not None else {}  # a backend without the lens streams
        extra.update(_adapter(adapter))
        if features:  # a backend without readouts still streams
            extra["features"] = features
        return self._iterate(
            lambda: self.model.stream(
                token_ids,
                max_tokens=max_tokens,
                n_logprobs=n_logprobs,
                steering_spec=steering_spec,
                **extra,
                **sampling,
            )
        )

    def generate_text(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        """The model's ``generate_text`` (the completion's text, sampling from the checkpoint's
        recommendation where a knob is left unset)."""
        method = self._method("generate_text")
        result: str = self.run(lambda: method(token_ids, **kwargs))
        return result

    def generate_stream(self, token_ids: Sequence[int], **kwargs: Any) -> Iterator[str]:
        """The model's ``generate_stream`` as a plain iterator of text deltas."""
        method = self._method("generate_stream")
        return self._iterate(lambda: method(token_ids, **kwargs))

    def collect_steps(self, token_ids: Sequence[int], **kwargs: Any) -> list[StreamStep]:
        """The model's ``collect_steps``: every step ``stream`` yields, at once."""
        method = self._method("collect_steps")
        result: list[StreamStep] = self.run(lambda: method(token_ids, **kwargs))
        return result

    def capture_generation_stream(
        self, token_ids: Sequence[int], points: Points, **kwargs: Any
    ) -> Iterator[tuple[Results, list[int]]]:
        """The model's ``capture_generation_stream`` as a plain iterator of ``(new_rows, token_ids)``."""
        method = self._method("capture_generation_stream")
        return self._iterate(lambda: method(token_ids, points, **kwargs))

    def _method(self, name: str) -> Any:
        method = getattr(self.model, name, None)
        if method is None:
            raise UnsupportedOperation(
                f"the {self.model.backend} backend's model has no {name}; the built-in backends' models "
                "(interp_engine.ModelBase) have it"
            )
        return method

    def _iterate(self, make: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
        """The async iterator ``make()`` as a plain iterator, each item produced on the
        background loop; closed there when the caller stops early."""
        refuse_inside_running_loop("this sync model call")
        steps = make()
        finished = False
        try:
            while True:
                try:
                    step = self.run(lambda: anext(steps))
                except StopAsyncIteration:
                    finished = True
                    return
                yield step
        finally:
            close = getattr(steps, "aclose", None)
            if not finished and close is not None and not self._closed:
                self.run(close)

    def shutdown(self) -> None:
        """Shut the model down, then stop the background loop. Idempotent."""
        if self._closed:
            return
        self.run(self.model.shutdown)
        self._closed = True
        _stop(self._loop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


def _adapter(adapter: str | None) -> dict[str, Any]:
    """``{"adapter": adapter}``, or nothing for the base model (a backend before adapters takes no keyword)."""
    return {} if adapter is None else {"adapter": adapter}


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # already closed
        loop.call_soon_threadsafe(loop.stop)


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


_FACADE_ATTRIBUTE = "_interp_sync_facade"


def sync_model(model: InterpModel | SyncModel) -> SyncModel:
    """The blocking facade of ``model``; the same object every time for the same model.

    The facade is kept on the model itself, so the pair is freed together when the caller lets
    go of the model (a weak-key table would keep it alive through the facade's reference).
    """
    if isinstance(model, SyncModel):
        return model
    refuse_inside_running_loop("sync_model()")
    with _facades_lock:
        namespace = getattr(model, "__dict__", None)
        facade = namespace.get(_FACADE_ATTRIBUTE) if namespace is not None else _facades.get(model)
        if facade is None:
            facade = SyncModel(model)
            if namespace is not None:
                namespace[_FACADE_ATTRIBUTE] = facade
            else:
                _facades[model] = facade
        return facade
