"""The runner seam's V2 implementation, driven through a stand-in runner class that does what V2's
``execute_model`` does (its request table from ``add_requests``, the step's layout from
``prepare_inputs``, the model's forward, ``finish_requests``), and its graph-replay wrapper. No
engine: the real wrappers of ``interp_vllm.worker._runner_v2`` over a small class."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from interp_vllm.worker import _runner_v2
from interp_vllm.worker._runner import StepBatch, drive


class Taps:
    """Records what the seam hands over; each step adds ``shift`` to the forward's output."""

    def __init__(self, shift: float = 1.0) -> None:
        self.shift = shift
        self.batches: list[StepBatch | None] = []
        self.finished: list[set[str]] = []
        self.preempted: list[set[str]] = []
        self.loaded: list[Any] = []
        self.closed = 0

    def step(self, runner: Any, batch: StepBatch | None) -> Iterator[None]:
        self.batches.append(batch)
        try:
            output = yield
        except GeneratorExit:
            self.closed += 1
            raise
        return output + self.shift

    def finished_(self, runner: Any, req_ids: Any) -> None:
        self.finished.append(set(req_ids))
        # the taps find a finished request by its payload: still there when they hear of it
        assert all(_runner_v2.V2.params(runner, r) is not None for r in req_ids)

    def preempted_(self, runner: Any, req_ids: Any) -> None:
        self.preempted.append(set(req_ids))

    def after_load(self, runner: Any) -> None:
        self.loaded.append(runner.model)


class Handlers:
    def __init__(self, taps: Taps) -> None:
        self.taps = taps

    def step(self, runner: Any, batch: StepBatch | None) -> Any:
        return self.taps.step(runner, batch)

    def finished(self, runner: Any, req_ids: Any) -> None:
        self.taps.finished_(runner, req_ids)

    def preempted(self, runner: Any, req_ids: Any) -> None:
        self.taps.preempted_(runner, req_ids)

    def after_load(self, runner: Any) -> None:
        self.taps.after_load(runner)


class Doubler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.raises = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.raises:
            raise RuntimeError("the forward failed")
        return 2.0 * input_ids.float()


def _runner_class() -> type:
    """A class with V2's five wrapped methods, doing what V2 does around them."""

    class Runner:
        def load_model(self) -> None:
            self.model = Doubler()

        def add_requests(self, scheduler_output: Any) -> None:
            self.live = [new.req_id for new in scheduler_output.scheduled_new_reqs]

        def finish_requests(self, scheduler_output: Any) -> None:
            self.gone = set(scheduler_output.finished_req_ids)

        def prepare_inputs(self, scheduler_output: Any) -> Any:
            return scheduler_output.layout

        def execute_model(self, scheduler_output: Any) -> Any:
            self.finish_requests(scheduler_output)
            self.add_requests(scheduler_output)
            batch = self.prepare_inputs(scheduler_output)
            return self.model(input_ids=batch.input_ids, positions=batch.positions)

    return Runner


def _output(new: list[str], done: set[str], layout: Any, preempted: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, sampling_params=f"params of {r}") for r in new],
        finished_req_ids=done,
        preempted_req_ids=preempted,
        layout=layout,
    )


def _layout(req_ids: list[str], starts: list[int], positions: torch.Tensor, padded: int = 0) -> Any:
    n = starts[-1]
    return SimpleNamespace(
        req_ids=[*req_ids, "padding"] if padded else req_ids,
        num_reqs=len(req_ids),
        query_start_loc_np=np.array([*starts, n + padded] if padded else starts, dtype=np.int32),
        positions=positions,
        input_ids=torch.arange(n + padded),
    )


@pytest.fixture
def wrapped() -> tuple[Any, Taps]:
    taps = Taps()
    cls = _runner_class()
    _runner_v2._wrap(cls, Handlers(taps))
    runner = cls()
    runner.load_model()
    return runner, taps


def test_a_step_sees_the_layout_prepare_inputs_made_and_its_payloads(wrapped: tuple[Any, Taps]) -> None:
    runner, taps = wrapped
    assert taps.loaded == [runner.model]  # after load, before anything runs
    positions = torch.tensor([0, 1, 2, 0, 1])
    out = runner.execute_model(_output(["b", "a"], set(), _layout(["b", "a"], [0, 3, 5], positions, padded=1)))
    batch = taps.batches[-1]
    assert batch is not None and batch.req_ids == ["b", "a"] and batch.starts == [0, 3, 5]
    assert torch.equal(batch.positions[: batch.starts[-1]], positions)
    assert torch.equal(out, 2.0 * torch.arange(6).float() + 1.0)  # the step's answer is the model's output
    assert _runner_v2.V2.params(runner, "a") == "params of a"


def test_finished_requests_are_heard_before_they_are_dropped_and_preempted_ones_stay(
    wrapped: tuple[Any, Taps],
) -> None:
    runner, taps = wrapped
    layout = _layout(["a", "b"], [0, 1, 2], torch.tensor([0, 0]))
    runner.execute_model(_output(["a", "b"], set(), layout))
    runner.execute_model(_output([], {"a"}, _layout(["b"], [0, 1], torch.tensor([1])), preempted={"b"}))
    assert taps.finished == [{"a"}] and taps.preempted == [{"b"}]
    assert _runner_v2.V2.params(runner, "a") is None
    assert _runner_v2.V2.params(runner, "b") == "params of b"  # resumes later, added again


def test_mrope_positions_give_the_first_row(wrapped: tuple[Any, Taps]) -> None:
    runner, taps = wrapped
    positions = torch.tensor([[0, 1, 2], [5, 5, 5], [7, 7, 7]])
    runner.execute_model(_output(["a"], set(), _layout(["a"], [0, 3], positions)))
    batch = taps.batches[-1]
    assert batch is not None and torch.equal(batch.positions, torch.tensor([0, 1, 2]))


def test_a_forward_with_no_layout_runs_the_step_of_no_request(wrapped: tuple[Any, Taps]) -> None:
    """A warm-up or profile run calls the model without prepare_inputs: no batch, no stale one."""
    runner, taps = wrapped
    runner.execute_model(_output(["a"], set(), _layout(["a"], [0, 1], torch.tensor([0]))))
    runner.model(input_ids=torch.zeros(2), positions=torch.zeros(2))
    assert taps.batches[-1] is None


def test_a_forward_that_raises_closes_its_step(wrapped: tuple[Any, Taps]) -> None:
    runner, taps = wrapped
    runner.model.raises = True
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.execute_model(_output(["a"], set(), _layout(["a"], [0, 1], torch.tensor([0]))))
    assert taps.closed == 1 and "_interp_step" not in runner.__dict__
    runner.model.raises = False
    runner.execute_model(_output([], set(), _layout(["a"], [0, 1], torch.tensor([1]))))
    assert taps.batches[-1] is not None and taps.batches[-1].req_ids == ["a"]


def test_a_graph_replay_runs_inside_the_step_of_the_executing_runner(wrapped: tuple[Any, Taps]) -> None:
    """A step served from a CUDA graph never calls the model: the replay itself is wrapped."""
    runner, taps = wrapped
    calls: list[str] = []

    def replay(manager: Any, desc: Any) -> torch.Tensor:
        calls.append(desc)
        return runner.model(input_ids=torch.ones(1), positions=torch.zeros(1))  # a piecewise replay calls it

    graph_step = _runner_v2._graph_step(replay, Handlers(taps))
    # outside execute_model (vLLM capturing its graphs): the replay runs as it is
    assert torch.equal(graph_step(None, "capture"), torch.tensor([2.0]) + 1.0)  # the model's own step
    steps = len(taps.batches)

    def execute(scheduler_output: Any) -> Any:
        runner.add_requests(scheduler_output)
        runner.prepare_inputs(scheduler_output)
        return graph_step(None, "replay")

    out = execute_in(runner, execute, _output(["a"], set(), _layout(["a"], [0, 1], torch.tensor([4]))))
    assert calls == ["capture", "replay"]
    assert len(taps.batches) == steps + 1  # one step: the model's hooks inside the replay opened none
    batch = taps.batches[-1]
    assert batch is not None and batch.req_ids == ["a"]
    assert torch.equal(out, torch.tensor([3.0]))


def execute_in(runner: Any, execute: Any, scheduler_output: Any) -> Any:
    """``execute(scheduler_output)`` as the runner's ``execute_model`` on this thread."""
    outer, _runner_v2._EXECUTING.runner = _runner_v2._EXECUTING.runner, runner
    try:
        return execute(scheduler_output)
    finally:
        _runner_v2._EXECUTING.runner = outer


def test_drive_closes_the_step_when_the_forward_raises() -> None:
    taps = Taps()
    with pytest.raises(ValueError):
        drive(taps.step(None, None), lambda: (_ for _ in ()).throw(ValueError("no")))
    assert taps.closed == 1
    assert drive(taps.step(None, None), lambda: torch.tensor(1.0)) == torch.tensor(2.0)
