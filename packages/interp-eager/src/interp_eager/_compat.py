"""Every patch the eager backend makes to a third-party private API, and every private API it
reads, in one place.

Each patch names the versions it is written for (:class:`Patch`), checks before patching that its
target still has the shape it expects, and otherwise raises :class:`IncompatibleDependency` naming
the installed version and the range, instead of an ``AttributeError`` deep inside a forward.

- :data:`ATTENTION_INTERFACE`: transformers' ``ALL_ATTENTION_FUNCTIONS.get_interface`` (the
  lookup every attention module makes, in each forward, for its attention function) is replaced on
  that instance by one handing out wrapped functions, so the eager backend's attention taps see the
  queries, keys and mask each call receives (:mod:`interp_eager._intercept`).

:func:`default_thread_state` reads torch's private counts of the torch-function and dispatch modes
active in the calling thread, and its JIT tracing state; where torch lacks them it answers
``False``, the safe answer.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version

from interp_engine import IncompatibleDependency


@dataclass(frozen=True)
class Patch:
    """A patch of ``target`` (a private API of ``package``), written for versions
    ``[since, before)``."""

    package: str
    target: str
    since: str
    before: str

    def version(self) -> str:
        return importlib.metadata.version(self.package)

    def covers(self, version: str | None = None) -> bool:
        """Whether ``version`` (default: the installed one) is in the range the patch is written for."""
        found = Version(version or self.version())
        return Version(self.since) <= found < Version(self.before)

    def incompatible(self, what: str) -> IncompatibleDependency:
        return IncompatibleDependency(
            f"the eager backend patches {self.package}'s {self.target}, written for {self.package} "
            f">={self.since},<{self.before}; the installed {self.package} {self.version()} {what}"
        )


ATTENTION_INTERFACE = Patch("transformers", "ALL_ATTENTION_FUNCTIONS.get_interface", "5.0", "6")
"""The attention-function lookup (``AttentionInterface.get_interface(attn_implementation,
default)``) every attention module of transformers 5 calls in its forward."""

_PATCHED = "_interp_engine_tapped"
_lock = threading.Lock()


def attention_interface() -> Any:
    """transformers' ``ALL_ATTENTION_FUNCTIONS``, checked to have the ``get_interface(attn_implementation,
    default)`` method the patch replaces."""
    try:
        from transformers import modeling_utils

        interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    except (ImportError, AttributeError) as exc:
        raise ATTENTION_INTERFACE.incompatible("has no modeling_utils.ALL_ATTENTION_FUNCTIONS") from exc
    method = getattr(interface, "get_interface", None)
    if not callable(method):
        raise ATTENTION_INTERFACE.incompatible("has no ALL_ATTENTION_FUNCTIONS.get_interface")
    if not getattr(interface, _PATCHED, False):
        parameters = list(inspect.signature(method).parameters)
        if parameters[:2] != ["attn_implementation", "default"]:
            raise ATTENTION_INTERFACE.incompatible(
                f"has ALL_ATTENTION_FUNCTIONS.get_interface({', '.join(parameters)}), "
                "not get_interface(attn_implementation, default)"
            )
    return interface


def tap_attention_interface(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make ``ALL_ATTENTION_FUNCTIONS.get_interface`` return ``wrap(function)`` for the function it
    would return (once per process; later calls do nothing). The implementation (eager, SDPA, ...)
    and its masks stay the model's own; ``wrap`` decides what else runs.

    The function is looked up through the class's ``get_interface`` as it is at each call, so that
    another library patching the class for a while still sees its patch: vLLM's Transformers
    modeling backend does, while it traces a model's attention to find its output projection."""
    interface = attention_interface()
    with _lock:
        if getattr(interface, _PATCHED, False):
            return
        own = interface.__dict__.get("get_interface")  # an instance's own patch, kept if there is one

        def get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
            if own is not None:
                return wrap(own(attn_implementation, default))
            return wrap(type(interface).get_interface(interface, attn_implementation, default))

        setattr(interface, "get_interface", get_interface)  # noqa: B010 - an instance attribute, on purpose
        setattr(interface, _PATCHED, True)


def default_thread_state(device: torch.device) -> bool:
    """Whether a forward on ``device`` run in the calling thread sees what it would see on a thread
    of its own: no torch-function or dispatch mode active (``with torch.device(...)``, a FLOP
    counter, a tracer), no autocast on the CPU or ``device``, no JIT trace, and on CUDA, ``device``
    current with its default stream. Grad and inference mode are not asked: a forward sets its own."""
    function_modes = getattr(torch._C, "_len_torch_function_stack", None)
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    tracing = getattr(torch._C, "_get_tracing_state", None)
    if function_modes is None or dispatch_modes is None or tracing is None:
        return False
    if function_modes() or dispatch_modes() or tracing() is not None:
        return False
    try:
        if torch.is_autocast_enabled("cpu") or (device.type != "cpu" and torch.is_autocast_enabled(device.type)):
            return False
    except RuntimeError:  # a device type autocast does not know
        return False
    if device.type == "cuda":
        return bool(
            torch.cuda.current_device() == device.index
            and torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
        )
    return device.type == "cpu"
