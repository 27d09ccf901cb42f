"""Only the requested points are hooked and kept, and a capture computes nothing past its last point."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import Address, run_with_cache
from interp_testkit.suite import PROMPT

from ..support.engines import eager_model


def _hooked_modules(root: nn.Module) -> list[str]:
    return [name for name, module in root.named_modules() if module._forward_hooks or module._forward_pre_hooks]


class _Counter:
    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls += 1


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt"])
def test_capture_hooks_only_its_points_and_removes_them(family: str) -> None:
    model = eager_model(family)
    hf = model.hf_model
    seen: list[list[str]] = []
    layer = model.arch.layers[1]

    def spy(module: nn.Module, args: Any, output: Any) -> None:
        seen.append(_hooked_modules(hf))

    handle = layer.register_forward_hook(spy)
    try:
        cache = run_with_cache(model, PROMPT, ["resid_post.1"])
    finally:
        handle.remove()
    assert list(cache.keys()) == [Address("resid_post", 1)]
    # during the forward: the spy's module is the only one hooked (the capture shares its site)
    assert len(seen) == 1 and len(seen[0]) == 1
    assert _hooked_modules(hf) == []  # nothing left behind


def test_capture_stops_after_its_last_point() -> None:
    model = eager_model("llama")
    last_layer = _Counter(model.arch.layers[-1])
    unembed = _Counter(model.arch.unembed)
    try:
        run_with_cache(model, PROMPT, ["resid_post.0", "mlp_post.1"])
        assert (last_layer.calls, unembed.calls) == (0, 0)
        run_with_cache(model, PROMPT, ["final_norm"])
        assert (last_layer.calls, unembed.calls) == (1, 0)
        run_with_cache(model, PROMPT, ["logits"])
        assert (last_layer.calls, unembed.calls) == (2, 1)
    finally:
        last_layer.handle.remove()
        unembed.handle.remove()


def test_capture_returns_only_what_was_asked_and_results_are_independent_copies() -> None:
    model = eager_model("gpt2")
    points = [Address("resid_mid", 1), Address("resid_pre", 1)]
    first = run_with_cache(model, PROMPT, points)
    assert set(first.keys()) == set(points)  # resid_mid's internal parts are not kept
    second = run_with_cache(model, PROMPT, points)
    first[points[1]].add_(1.0)  # mutating one result must not leak into another
    assert not torch.equal(first[points[1]], second[points[1]])


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3"])
def test_captured_values_are_contiguous_even_where_read_as_views(family: str) -> None:
    # queries and keys are read transposed (Phi-3's from a fused projection), heads as views of a
    # wider tensor: each value is one contiguous copy
    model = eager_model(family)
    points = [f"{kind}.0" if info.per_layer else kind for kind, info in model.points().items()]
    cache = run_with_cache(model, [PROMPT, PROMPT], points)
    assert [point for point in points if not cache[point].is_contiguous()] == []


def test_attention_lookups_are_wrapped_only_while_a_capture_reads_attention() -> None:
    # the lookup is process-wide: outside a capture that taps attention, every model in the process
    # (another tool's, a plain HF one) gets transformers' own attention function
    from transformers import modeling_utils

    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    model = eager_model("gpt2")
    attention = model.hf_model.transformer.h[0].attn
    looked_up: list[Any] = []

    def lookup(module: nn.Module, args: Any) -> None:
        looked_up.append(interface.get_interface("sdpa", None))

    handle = attention.register_forward_pre_hook(lookup)
    try:
        run_with_cache(model, PROMPT, ["attn_q.0"])  # the interface is patched from here on
        run_with_cache(model, PROMPT, ["resid_post.0"])
    finally:
        handle.remove()
    own = interface["sdpa"]
    assert looked_up[0] is not own and looked_up[1] is own
    assert interface.get_interface("sdpa", None) is own
