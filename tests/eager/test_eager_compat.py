"""The eager backend's patches of third-party private APIs (``interp_eager._compat``): each is
written for the installed version, checks its target's shape, and refuses with a typed error naming
the versions when the target has moved; and its read of torch's per-thread state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import modeling_utils

from interp_eager import _compat
from interp_eager._compat import ATTENTION_INTERFACE, IncompatibleDependency, Patch
from interp_engine import BackendError


def test_every_patch_is_written_for_the_installed_version() -> None:
    """Fails once the pinned package leaves a patch's range: the patch must be checked (or dropped)."""
    for patch in (ATTENTION_INTERFACE,):
        assert patch.covers(), f"{patch.package} {patch.version()} is outside {patch.since}..{patch.before}"


def test_a_range_is_half_open() -> None:
    patch = Patch("transformers", "X", "5.0", "6")
    assert patch.covers("5.0") and patch.covers("5.19.0")
    assert not patch.covers("4.57.1") and not patch.covers("6.0")


def test_the_installed_attention_interface_has_the_shape_the_patch_expects() -> None:
    assert _compat.attention_interface() is modeling_utils.ALL_ATTENTION_FUNCTIONS


class _Interface:
    """A stand-in for ``AttentionInterface`` whose lookup takes other arguments."""

    def get_interface(self, name: str) -> Callable[..., Any]:  # pragma: no cover - never called
        raise AssertionError


def test_a_moved_lookup_is_a_typed_error_naming_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", _Interface())
    with pytest.raises(IncompatibleDependency, match=r"transformers >=5\.0,<6.*get_interface\(name\)") as caught:
        _compat.tap_attention_interface(lambda f: f)
    assert isinstance(caught.value, BackendError)
    assert f"installed transformers {transformers.__version__}" in str(caught.value)


def test_a_missing_lookup_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", object())
    with pytest.raises(IncompatibleDependency, match=r"has no ALL_ATTENTION_FUNCTIONS\.get_interface"):
        _compat.tap_attention_interface(lambda f: f)


class _Lookup:
    """A stand-in with the expected ``get_interface(attn_implementation, default)``."""

    def get_interface(self, attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return default


def test_the_patched_lookup_hands_out_wrapped_functions_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lookup = _Lookup()
    monkeypatch.setattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", lookup)
    wrapped: list[Callable[..., Any]] = []

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        wrapped.append(function)
        return lambda *a: ("wrapped", function(*a))

    _compat.tap_attention_interface(wrap)
    _compat.tap_attention_interface(wrap)  # a second call patches nothing more

    def eager(x: int) -> int:
        return x + 1

    assert lookup.get_interface("eager", eager)(1) == ("wrapped", 2)
    assert wrapped == [eager]


def test_a_patch_of_the_lookups_class_made_later_is_seen_through_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's Transformers modeling backend patches the class's get_interface while it traces a model
    # (to see attention as one call): the tapped lookup must hand out what that patch returns
    class Lookup(_Lookup):
        pass

    lookup = Lookup()
    monkeypatch.setattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", lookup)
    _compat.tap_attention_interface(lambda function: function)

    def eager(x: int) -> int:
        return x + 1

    def leaf(x: int) -> int:
        return -x

    assert lookup.get_interface("eager", eager) is eager
    monkeypatch.setattr(Lookup, "get_interface", lambda self, attn_implementation, default: leaf)
    assert lookup.get_interface("eager", eager) is leaf


def test_a_fresh_threads_torch_state_is_told_apart_from_a_callers_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert _compat.default_thread_state(cpu)
    with torch.device("meta"):  # a torch-function mode: factory calls would land on the meta device
        assert not _compat.default_thread_state(cpu)
    with FlopCounterMode(display=False):  # a dispatch mode
        assert not _compat.default_thread_state(cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _compat.default_thread_state(cpu)
    with torch.no_grad(), torch.inference_mode():  # grad modes: a forward sets its own
        assert _compat.default_thread_state(cpu)
    assert not _compat.default_thread_state(torch.device("meta"))  # only CPU and CUDA are known
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")  # a torch without the count: the safe answer
    assert not _compat.default_thread_state(cpu)
