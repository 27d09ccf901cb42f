"""The TapManager's step loop with islands (``interp_vllm.worker._manager`` over
``interp_vllm.worker._islands``), with no engine and no GPU.

A real :class:`~interp_vllm.worker._manager.TapManager` is built over the vLLM-shaped model of
``tests/support/islands.py`` (layers that take ``(positions, hidden_states=, residual=)`` and defer
the residual add), through a stand-in runner seam that hands over each request's payload. Its
step is driven as the runner seam drives it (:func:`~interp_vllm.worker._runner.drive`): once
while the fake breakable capture records the forward (no requests: vLLM's dummy batch), then
around each replay of the captured graph. The oracle is the same step loop with no islands (the
step's functions registered as module hooks) over an eager forward of an identical model.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import Address, Write
from interp_vllm._wire import RequestPayload
from interp_vllm.worker import _state
from interp_vllm.worker._islands import Breakable
from interp_vllm.worker._manager import MISSED, TapManager
from interp_vllm.worker._runner import StepBatch, drive

from ..support.islands import LAYERS, ClosureCapture, D, Model, PlainCapture, T, inputs, vec

ISSUER = "test-issuer"
POSITIONS = torch.arange(T, dtype=torch.float32)
"""What the model's kernels read as positions (the same in every step)."""


def _family() -> Any:
    """What the step loop reads of a family, for the test model's layers."""
    return SimpleNamespace(
        layers="layers",
        attn_kernel="kernel",
        attn_post_norm=None,
        n_kv_heads=1,
        hidden_arg=(1, "hidden_states"),
        residual_arg=(2, "residual"),
        deferred_residual=True,
        batched=False,
    )


def _manager(monkeypatch: pytest.MonkeyPatch, breakable: Breakable | None) -> tuple[TapManager, Model, dict[str, Any]]:
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        layer.kernel = nn.Module()  # where the step loop reads the head size
        layer.kernel.head_size = D
    params: dict[str, Any] = {}
    seam = SimpleNamespace(name="fake", check=lambda runner: None, params=lambda runner, rid: params.get(rid))
    monkeypatch.setattr(_state, "seam_of", lambda runner: seam)
    monkeypatch.setattr(_state, "resolve", lambda model, config: _family())
    config = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1, hidden_size=D)
    runner = SimpleNamespace(get_model=lambda: model, model_config=SimpleNamespace(hf_config=config))
    manager = TapManager(runner, breakable)
    manager.issuers.add(ISSUER)
    return manager, model, params


# request a: rows 0-4 (positions 0-4), request b: rows 5-11 (positions 0-6)
READS = {"a": (Address("resid_post", 1), Address("resid_pre", 3)), "b": (Address("resid_post", 3),)}
WRITES = {"a": (Write(Address("resid_post", 2), vec(1)),), "b": (Write(Address("resid_pre", 1), vec(2), op="set"),)}
ROWS = {"a": (0, 5), "b": (5, 12)}


def _batch(params: dict[str, Any], step: int) -> StepBatch:
    for name, (start, end) in ROWS.items():
        n = end - start
        payload = RequestPayload(f"{name}{step}", READS[name], WRITES[name], n, n + 1, issuer=ISSUER)
        params[name] = SimpleNamespace(extra_args=payload.extra_args())
    positions = torch.cat([torch.arange(end - start) for start, end in ROWS.values()])
    return StepBatch(list(ROWS), [0, 5, 12], positions)


def _fetched(manager: TapManager, step: int) -> dict[str, Any]:
    out = {}
    for name in ROWS:
        got = manager.fetch(f"{name}{step}")
        out[name] = got
    return out


def _breakable() -> Breakable:
    return Breakable(api=ClosureCapture, weak=lambda t: t.view(t.shape), plain_capturing=lambda: PlainCapture.capturing)


def _reference(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The same step with no islands: the functions as module hooks over an eager forward."""
    manager, model, params = _manager(monkeypatch, None)
    assert manager.islands is None
    out = drive(manager.step(_batch(params, step)), lambda: model(POSITIONS, x))
    return out, _fetched(manager, step)


def test_the_step_loop_runs_its_taps_as_islands_at_every_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, model, params = _manager(monkeypatch, _breakable())
    assert manager.islands is not None and len(manager.islands) == 2 * LAYERS
    static_x = torch.zeros(T, D)
    capture = ClosureCapture()
    with capture:  # vLLM captures with a dummy batch: a step with no requests
        static_out = drive(manager.step(None), lambda: model(POSITIONS, static_x))
    assert capture.kinds.count("eager") == 2 * LAYERS

    def replay(x: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            static_x.copy_(x)
            capture.replay()
            return static_out.clone()

        return run

    for step in range(3):  # one graph serves every step, each with its own requests
        x = inputs(step)
        out = drive(manager.step(_batch(params, step)), replay(x))
        got = _fetched(manager, step)
        ref_out, ref = _reference(monkeypatch, x, step)
        assert torch.equal(out, ref_out)
        assert not torch.equal(out, Model()(POSITIONS, x))  # the writes reached the graph's tensors
        for name in ROWS:
            assert got[name].error is None and ref[name].error is None
            assert set(got[name].values) == set(READS[name]) == set(ref[name].values)
            for address in READS[name]:
                positions, values = got[name].values[address]
                ref_positions, ref_values = ref[name].values[address]
                assert torch.equal(positions, torch.arange(ROWS[name][1] - ROWS[name][0]))
                assert torch.equal(positions, ref_positions) and torch.equal(values, ref_values), (name, address)
    assert manager.stats()["islands_captured"] == 2 * LAYERS
    assert manager.stats()["live_requests"] == 0


def test_a_step_whose_islands_did_not_run_fails_its_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, model, params = _manager(monkeypatch, _breakable())
    static_x = torch.zeros(T, D)
    full = PlainCapture()  # a graph that cannot break: no Python runs at its replay
    with full:
        static_out = drive(manager.step(None), lambda: model(POSITIONS, static_x))
    assert manager.stats()["islands_sealed"] == 2 * LAYERS

    def run() -> torch.Tensor:
        static_x.copy_(inputs(5))
        full.replay()
        return static_out.clone()

    out = drive(manager.step(_batch(params, 0)), run)
    assert torch.equal(out, Model()(POSITIONS, inputs(5)))  # the graph's own output: nothing written
    for name, got in _fetched(manager, 0).items():
        assert got.error is not None and MISSED in got.error and "BackendError" in got.error, name
        assert "layer" in got.error


def test_an_eager_forward_with_islands_equals_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, model, params = _manager(monkeypatch, _breakable())
    x = inputs(7)
    out = drive(manager.step(_batch(params, 0)), lambda: model(POSITIONS, x))
    got = _fetched(manager, 0)
    ref_out, ref = _reference(monkeypatch, x, 0)
    assert torch.equal(out, ref_out)
    for name in ROWS:
        assert got[name].error is None
        for address in READS[name]:
            assert torch.equal(got[name].values[address][1], ref[name].values[address][1])
