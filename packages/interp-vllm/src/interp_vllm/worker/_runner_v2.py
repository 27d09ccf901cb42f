"""The runner seam on vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``).

V2 keeps no table of ``SamplingParams`` between steps and has no method around the forward
alone, so the seam takes each piece where V2 has it (every target in :mod:`interp_vllm._compat`,
``V2_*``):

- ``add_requests(scheduler_output)``: each new request's ``SamplingParams``, kept by vLLM's id
  until the request finishes (a preempted request comes back here when it resumes);
- ``finish_requests(scheduler_output)``: the finished and aborted requests (its
  ``finished_req_ids``; preempted ones, its ``preempted_req_ids``, are not finished: V2 drops
  their state and adds them again when they resume), heard before V2 drops them;
- ``prepare_inputs(...) -> InputBatch``: the step's layout (``req_ids`` in the batch's order,
  sorted by V2 and never the scheduler's; ``query_start_loc_np``; ``positions``);
- the forward: a pre-hook and a hook on the runner's model, added right after ``load_model``,
  start the step's taps with the batch ``prepare_inputs`` laid out and end them with the model's
  output (a forward with no batch before it, a warm-up or profile run, runs the taps of no
  request); ``execute_model`` closes a step its forward left open (it raised);
- ``load_model``: the model before vLLM compiles it (vllm-static's taps);
- ``ModelCudaGraphManager.run_fullgraph`` and ``CudaGraphManager.run_pw_graph``: a step served
  from CUDA graphs replays them without calling the model (its hooks do not run), so the step of
  the taps opens around the replay instead, for the runner whose ``execute_model`` is running on
  this thread (there, the taps run as eager islands of a breakable graph,
  :mod:`._islands`, and what cannot run is reported by the step).

The CPU build's runners are covered too: ``vllm/v1/worker/cpu/model_runner.py``'s
``CPUModelRunner`` subclasses the V2 runner, and vLLM 0.34's ``StandaloneCPUModelRunner``
(``vllm/v1/worker/cpu/standalone_model_runner.py``) has the same methods.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from typing import Any

from .. import _compat
from ._runner import StepBatch, TapsHandlers, drive

_PARAMS = "_interp_params"
_BATCH = "_interp_batch"
_STEP = "_interp_step"
_HOOKED = "_interp_hooked_model"
_GRAPH = "_interp_graph_step"


class _Executing(threading.local):
    runner: Any = None


_EXECUTING = _Executing()
"""The runner whose ``execute_model`` runs on this thread (graph replays find their runner here)."""


def _step_of(runner: Any) -> Any:
    return runner.__dict__.get(_STEP)


class _V2:
    name = "v2"

    def available(self) -> bool:
        try:
            return importlib.util.find_spec(_compat.V2_MODULE) is not None
        except ImportError:
            return False

    def runner_classes(self) -> list[Any]:
        """The V2 runner classes of the installed vLLM (the GPU runner, and a standalone CPU
        runner where vLLM has one), each checked against the shape the seam expects."""
        classes = []
        for patches in _compat.V2_RUNNERS:
            owner = None
            for patch in patches:
                found = patch.check()
                owner = found if owner is None else owner
            if owner is not None:
                classes.append(owner)
        return classes

    def install(self, handlers: TapsHandlers) -> None:
        classes = self.runner_classes()  # every target is checked before any is wrapped
        graphs = [patch.check() for patch in _compat.V2_GRAPH_RUNS]
        for cls in classes:
            if not cls.__dict__.get(_compat.PATCHED, False):
                _wrap(cls, handlers)
                setattr(cls, _compat.PATCHED, True)
        for owner, patch in zip(graphs, _compat.V2_GRAPH_RUNS, strict=True):
            name = patch.target.rpartition(".")[2]
            if not getattr(owner.__dict__[name], "_interp_graph_step", False):
                setattr(owner, name, _graph_step(owner.__dict__[name], handlers))

    def serves(self, runner: Any) -> bool:
        if not getattr(type(runner), _compat.PATCHED, False):
            return False
        try:
            return any(isinstance(runner, cls) for cls in self.runner_classes())
        except Exception:  # a runner whose shape moved is one this seam did not wrap
            return False

    def check(self, runner: Any) -> None:
        _compat.check_state(runner, _compat.V2_RUNNER_STATE, _compat.V2_EXECUTE_MODEL)

    def params(self, runner: Any, req_id: str) -> Any:
        return runner.__dict__.get(_PARAMS, {}).get(req_id)


V2 = _V2()


def _wrap(cls: Any, handlers: TapsHandlers) -> None:
    add_requests = cls.__dict__["add_requests"]
    finish_requests = cls.__dict__["finish_requests"]
    prepare_inputs = cls.__dict__["prepare_inputs"]
    execute_model = cls.__dict__["execute_model"]
    load_model = cls.__dict__["load_model"]

    @functools.wraps(add_requests)
    def _add_requests(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        table = self.__dict__.setdefault(_PARAMS, {})
        for new in scheduler_output.scheduled_new_reqs:
            table[new.req_id] = new.sampling_params
        return add_requests(self, scheduler_output, *args, **kwargs)

    @functools.wraps(finish_requests)
    def _finish_requests(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        done = scheduler_output.finished_req_ids
        if done:
            handlers.finished(self, done)
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            handlers.preempted(self, preempted)
        try:
            return finish_requests(self, scheduler_output, *args, **kwargs)
        finally:
            table = self.__dict__.get(_PARAMS, {})
            for req_id in done or ():
                table.pop(req_id, None)

    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = prepare_inputs(self, *args, **kwargs)
        num_reqs = int(batch.num_reqs)
        positions = batch.positions
        self.__dict__[_BATCH] = StepBatch(
            req_ids=list(batch.req_ids[:num_reqs]),
            starts=[int(s) for s in batch.query_start_loc_np[: num_reqs + 1]],
            positions=positions if positions.dim() == 1 else positions[0],
        )
        return batch

    @functools.wraps(execute_model)
    def _execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, _EXECUTING.runner = _EXECUTING.runner, self
        try:
            return execute_model(self, *args, **kwargs)
        finally:
            _EXECUTING.runner = outer
            self.__dict__[_BATCH] = None
            step = self.__dict__.pop(_STEP, None)
            if step is not None:  # the forward raised: its hooks come out
                step.close()

    @functools.wraps(load_model)
    def _load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_model(self, *args, **kwargs)
        handlers.after_load(self)
        _hook_model(self, handlers)
        return result

    cls.add_requests = _add_requests
    cls.finish_requests = _finish_requests
    cls.prepare_inputs = _prepare_inputs
    cls.execute_model = _execute_model
    cls.load_model = _load_model


def _hook_model(runner: Any, handlers: TapsHandlers) -> None:
    """The step's taps around each call of the runner's model (once per model)."""
    model = runner.model
    if getattr(model, _HOOKED, False):
        return

    def before(module: Any, args: Any, kwargs: Any) -> None:
        if _step_of(runner) is not None or runner.__dict__.get(_GRAPH):  # the step is running
            return
        batch = runner.__dict__.get(_BATCH)
        runner.__dict__[_BATCH] = None
        step = handlers.step(runner, batch)
        next(step)
        runner.__dict__[_STEP] = step

    def after(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        step = runner.__dict__.pop(_STEP, None)
        if step is None:
            return None
        try:
            step.send(output)
        except StopIteration as done:
            return done.value
        raise RuntimeError("a step of the taps did not end after the forward")  # pragma: no cover

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    setattr(model, _HOOKED, True)


def _graph_step(replay: Any, handlers: TapsHandlers) -> Any:
    """``replay`` (a graph manager's method) inside the step of the runner executing on this
    thread, where no step is open yet (outside ``execute_model``, e.g. while vLLM captures its
    graphs, it runs as it is)."""

    @functools.wraps(replay)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner = _EXECUTING.runner
        if runner is None or _step_of(runner) is not None or runner.__dict__.get(_GRAPH):
            return replay(self, *args, **kwargs)
        batch = runner.__dict__.get(_BATCH)
        runner.__dict__[_BATCH] = None
        runner.__dict__[_GRAPH] = True
        try:
            return drive(handlers.step(runner, batch), lambda: replay(self, *args, **kwargs))
        finally:
            runner.__dict__.pop(_GRAPH, None)

    run._interp_graph_step = True  # type: ignore[attr-defined]
    return run


__all__ = ["V2"]
