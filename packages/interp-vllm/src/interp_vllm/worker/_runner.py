"""The one seam between the taps and vLLM's model runner, with an implementation per runner.

Everything the taps need of a model runner goes through a :class:`RunnerSeam`:

- the step's requests in the order of the flattened token batch, each request's first row and
  every token's position (:class:`StepBatch`, read where the runner has laid the step out);
- each live request's ``SamplingParams`` (its ``extra_args`` carry the request's payload);
- one call around each forward (:meth:`TapsHandlers.step`), which installs the step's hooks
  before the forward and reads or rewrites its output after it;
- the requests vLLM finished or aborted, before the runner forgets them (preempted requests are
  not among them: they come back and are recomputed);
- the model right after it is loaded, before vLLM compiles it (vllm-static's taps).

vLLM has two runners: V1 (``vllm/v1/worker/gpu_model_runner.py``, the CPU runner subclassing
it; removed in vLLM 0.34) and V2 (``vllm/v1/worker/gpu/model_runner.py``, the default since
0.33; the CPU build's ``vllm/v1/worker/cpu/model_runner.py`` subclasses it). :mod:`._runner_v1`
and :mod:`._runner_v2` implement the seam for each; :mod:`._seam`'s ``install`` patches every runner
class the installed vLLM has, and its ``seam_of`` says which one serves a runner instance. The runner
is the one vLLM picks; nothing here pins either. What each implementation touches of vLLM is
declared in :mod:`interp_vllm._compat` with the versions it is written for.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Step = Generator[None, Any, Any]
"""One step of the taps: advanced once before the forward (the hooks go in), then sent the
forward's output, which it returns (as ``StopIteration.value``) after its reads and writes there.
Closed instead if the forward raised."""


@dataclass(frozen=True)
class StepBatch:
    """The requests of one forward, as the runner laid them out.

    ``req_ids``: vLLM's request ids in the order of the flattened token batch (this order changes
    from step to step and is never the scheduler's); ``starts``: each request's first row in the
    batch and, last, the number of rows (``len(req_ids) + 1`` entries); ``positions``: each row's
    absolute position in its request (a 1-D tensor on any device, at least ``starts[-1]`` long)."""

    req_ids: list[str]
    starts: list[int]
    positions: torch.Tensor


class TapsHandlers(Protocol):
    """What a runner implementation calls: the taps of the runner it serves."""

    def step(self, runner: Any, batch: StepBatch | None) -> Step:
        """The taps of one forward over ``batch`` (``None``: a forward with no requests of its
        own, a warm-up or profile run)."""
        ...

    def finished(self, runner: Any, req_ids: Any) -> None:
        """vLLM finished or aborted these requests (its own ids)."""
        ...

    def preempted(self, runner: Any, req_ids: Any) -> None:
        """vLLM preempted these requests: their KV cache is freed and they will be recomputed
        from where its prefix cache still holds them (their taps stay)."""
        ...

    def after_load(self, runner: Any) -> None:
        """The runner has loaded its model (not compiled yet)."""
        ...


class RunnerSeam(Protocol):
    """One model runner of vLLM, as the taps see it."""

    name: str
    """``"v1"`` or ``"v2"``."""

    def available(self) -> bool:
        """Whether the installed vLLM has this runner."""
        ...

    def install(self, handlers: TapsHandlers) -> None:
        """Wrap the runner's classes (idempotent). Raises :class:`IncompatibleDependency`,
        patching nothing, where a target has moved."""
        ...

    def serves(self, runner: Any) -> bool:
        """Whether ``runner`` is an instance of this runner, with its wrappers in place."""
        ...

    def check(self, runner: Any) -> None:
        """That a loaded runner has the state the taps read."""
        ...

    def params(self, runner: Any, req_id: str) -> Any:
        """The ``SamplingParams`` of a live request (``None`` for an unknown one)."""
        ...


def drive(step: Step, forward: Callable[[], Any]) -> Any:
    """Run ``forward`` inside ``step``: the step's hooks are in place while it runs; its output
    goes through the step's reads and writes."""
    next(step)
    try:
        output = forward()
    except BaseException:
        step.close()
        raise
    try:
        step.send(output)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a step of the taps did not end after the forward")  # pragma: no cover


__all__ = ["RunnerSeam", "Step", "StepBatch", "TapsHandlers", "drive"]
