"""The runner seam on vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``; the CPU
build's ``cpu_model_runner.py`` subclasses it). vLLM 0.34 removed it; 0.33 still runs it where
``VLLM_USE_V2_MODEL_RUNNER=0`` asks for it, and 0.32 by default.

V1 keeps its batch state between steps, so the seam reads it where it is (every target in
:mod:`interp_vllm._compat`, ``V1_*``):

- ``_model_forward(input_ids, positions, ...)``: wrapped whole; the step's requests are
  ``input_batch.req_ids`` in the batch's order, their rows ``query_start_loc``, their positions
  the forward's ``positions``;
- ``requests[req_id].sampling_params``: each live request's ``SamplingParams``;
- ``_update_states(scheduler_output)``: its ``finished_req_ids``, heard before V1 drops them, and
  its ``preempted_req_ids``;
- ``load_model``: the model before vLLM compiles it (the CPU runner overrides it without calling
  the GPU runner's, so both are wrapped).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from .. import _compat
from ._runner import StepBatch, TapsHandlers, drive


class _V1:
    name = "v1"

    def available(self) -> bool:
        try:
            return importlib.util.find_spec(_compat.V1_MODULE) is not None
        except ImportError:
            return False

    def install(self, handlers: TapsHandlers) -> None:
        runner = _compat.V1_MODEL_FORWARD.owner()
        if runner.__dict__.get(_compat.PATCHED, False):
            return
        for patch in _compat.V1_PATCHES:
            patch.check()
        original_forward = runner._model_forward

        @functools.wraps(original_forward)  # the shape checks see vLLM's signature through the wrapper
        def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            positions = kwargs["positions"] if "positions" in kwargs else (args[1] if len(args) > 1 else None)
            step = handlers.step(self, _batch(self, positions))
            return drive(step, lambda: original_forward(self, *args, **kwargs))

        original_update = runner._update_states

        @functools.wraps(original_update)
        def _update_states(self: Any, scheduler_output: Any) -> Any:
            done = getattr(scheduler_output, "finished_req_ids", None)
            if done:
                handlers.finished(self, done)
            preempted = getattr(scheduler_output, "preempted_req_ids", None)
            if preempted:
                handlers.preempted(self, preempted)
            return original_update(self, scheduler_output)

        runner._model_forward = _model_forward
        runner._update_states = _update_states
        owners = (_compat.V1_LOAD_MODEL.check(), _compat.V1_CPU_LOAD_MODEL.check())
        for owner in dict.fromkeys(o for o in owners if o is not None):
            _wrap_load_model(owner, handlers)
        setattr(runner, _compat.PATCHED, True)

    def serves(self, runner: Any) -> bool:
        try:
            owner = _compat.V1_MODEL_FORWARD.owner()
        except Exception:  # no V1 runner in this vLLM
            return False
        return isinstance(runner, owner) and bool(owner.__dict__.get(_compat.PATCHED, False))

    def check(self, runner: Any) -> None:
        _compat.check_state(runner, _compat.V1_RUNNER_STATE, _compat.V1_MODEL_FORWARD)

    def params(self, runner: Any, req_id: str) -> Any:
        return getattr(runner.requests.get(req_id), "sampling_params", None)


V1 = _V1()


def _batch(runner: Any, positions: Any) -> StepBatch | None:
    """The step's layout from V1's persistent batch (``None``: no request in the step)."""
    batch = runner.input_batch
    num_reqs = int(batch.num_reqs)
    if num_reqs == 0 or positions is None:
        return None
    starts: list[int] = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
    return StepBatch(
        req_ids=list(batch.req_ids[:num_reqs]),
        starts=starts,
        positions=positions if positions.dim() == 1 else positions[0],
    )


def _wrap_load_model(runner_class: Any, handlers: TapsHandlers) -> None:
    original = runner_class.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _compat.pipeline_buffers(self)
        handlers.after_load(self)
        return result

    runner_class.load_model = load_model


__all__ = ["V1"]
