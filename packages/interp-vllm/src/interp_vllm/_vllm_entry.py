"""The ``vllm.general_plugins`` entry point: loaded in every vLLM process, workers included.

It wraps the V1 model runner's ``_model_forward`` (the CPU runner inherits it) so each forward
runs with the taps of the requests in that step, and its ``_update_states`` so the taps learn
which requests vLLM finished or aborted; it wraps ``load_model`` (the GPU runner's and the
CPU runner's own) so a vllm-static engine gets its fixed taps before vLLM compiles the model,
and adds the RPC methods the front end calls through ``collective_rpc``. Safe to call more than
once.
"""

from __future__ import annotations

import os
from typing import Any

PATCHED = "_interp_engine_patched"


def _taps(runner: Any) -> Any:
    taps = getattr(runner, "_interp_taps", None)
    if taps is None:
        from ._worker import tap_manager

        taps = runner._interp_taps = tap_manager(runner)
    return taps


def _after_load(runner: Any) -> None:
    """Install a vllm-static engine's taps right after the model is loaded (before compiling)."""
    from ._static_worker import StaticTapManager, static_config

    _pipeline_buffers(runner)

    config = static_config(runner)
    if config is not None:
        runner._interp_taps = StaticTapManager(runner, config)


def _pipeline_buffers(runner: Any) -> None:
    """Allocate the buffers a pipeline stage after the first receives the previous stage's
    hidden states in. vLLM allocates them in its warm-up forward, which its CPU worker skips
    for an uncompiled model (``enforce_eager``): the first step would then fail."""
    if getattr(runner, "intermediate_tensors", True) is not None:
        return
    try:
        from vllm.distributed import get_pp_group

        first = get_pp_group().is_first_rank
    except Exception:  # not distributed
        return
    make = getattr(runner.model, "make_empty_intermediate_tensors", None)
    if first or make is None:
        return
    runner.intermediate_tensors = make(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def interp_ping(self: Any) -> dict[str, Any]:
    """Which runner serves this worker, and whether it carries the taps."""
    runner = self.model_runner
    taps = _taps(runner)
    return {
        "runner": type(runner).__qualname__,
        "patched": bool(getattr(type(runner), PATCHED, False)),
        "static": _is_static(taps),
        "rank": taps.rank,
        "tp_size": taps.tp_size,
        "lacks": sorted(taps.family.lacks()) if taps.family is not None else None,
        "unsupported": getattr(taps, "unsupported", None),
        "pp_rank": getattr(taps, "pp_rank", 0),
        "pp_size": getattr(taps, "pp_size", 1),
        "layers": list(getattr(taps, "owned", ())),
        # what picked the runner in this worker (a Ray worker on another node has its own env)
        "v2_runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    }


def _is_static(taps: Any) -> bool:
    from ._static_worker import StaticTapManager

    return isinstance(taps, StaticTapManager)


def interp_fetch_many(self: Any, rids: list[str]) -> list[dict[str, Any]]:
    """Finished requests' captured values (``Fetched.encode()`` each): one engine-core round
    trip for every request the front end is waiting on."""
    taps = _taps(self.model_runner)
    return [taps.fetch(rid).encode() for rid in rids]


def interp_drain_many(self: Any, rids: list[str]) -> list[dict[str, Any]]:
    """Streaming requests' readouts so far (``Fetched.encode()`` each), dropped from the worker."""
    taps = _taps(self.model_runner)
    return [taps.drain(rid).encode() for rid in rids]


def interp_attach(self: Any, name: str, blob: bytes) -> None:
    """Hold an SAE or probe (``Sae.to_bytes()``) under ``name`` for readouts and feature writes."""
    _taps(self.model_runner).attach(name, blob)


def interp_detach(self: Any, name: str) -> None:
    _taps(self.model_runner).detach(name)


def interp_release(self: Any, rid: str) -> None:
    """Forget a request's values (cancelled or failed requests)."""
    _taps(self.model_runner).release(rid)


def interp_decode(self: Any, data: bytes) -> bytes:
    """Final norm + unembedding of residuals sent as safetensors bytes."""
    from ._wire import pack, unpack

    residuals = unpack(data)["residuals"]
    logits = _taps(self.model_runner).decode(residuals)
    return pack({} if logits is None else {"logits": logits})  # nothing from a stage before the last


def interp_weight_info(self: Any) -> dict[str, Any]:
    """What this worker's pipeline stage holds of the weights (``interp_vllm._weights``)."""
    from ._weights import worker_info

    return worker_info(_taps(self.model_runner))


def interp_weight(self: Any, name: str, layer: int | None, vocab: list[int] | None) -> bytes:
    """This worker's shard of a weight the front end checked, as safetensors bytes (empty where
    its stage does not hold it)."""
    from ._weights import worker_weight
    from ._wire import pack

    return pack(worker_weight(_taps(self.model_runner), name, layer, vocab))


def interp_stats(self: Any) -> dict[str, int]:
    """Per-worker bookkeeping (live per-request states), for leak checks."""
    return dict(_taps(self.model_runner).stats())


def _runner_classes(base: Any) -> list[Any]:
    """The GPU runner and the CPU runner, which overrides ``load_model`` without calling it."""
    classes = [base]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except Exception:  # a CUDA build without the CPU runner
        return classes
    return [*classes, CPUModelRunner]


def _wrap_load_model(runner_class: Any) -> None:
    original = runner_class.__dict__.get("load_model")
    if original is None:
        return

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _after_load(self)
        return result

    runner_class.load_model = load_model


def _wrap_update_states(runner_class: Any) -> None:
    """Tell the taps which requests vLLM finished (or aborted) before the runner drops them."""
    original = runner_class._update_states

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            _taps(self).finished(finished)
        return original(self, scheduler_output)

    runner_class._update_states = _update_states


_RPCS = (
    interp_ping,
    interp_fetch_many,
    interp_drain_many,
    interp_attach,
    interp_detach,
    interp_release,
    interp_decode,
    interp_weight_info,
    interp_weight,
    interp_stats,
)


def register() -> None:
    """Patch vLLM's V1 model runner and worker base (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(GPUModelRunner, PATCHED, False):
        return
    original = GPUModelRunner._model_forward

    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _taps(self).run(lambda *a, **k: original(self, *a, **k), args, kwargs)

    GPUModelRunner._model_forward = _model_forward  # type: ignore[method-assign]
    _wrap_update_states(GPUModelRunner)
    for runner_class in _runner_classes(GPUModelRunner):
        _wrap_load_model(runner_class)
    setattr(GPUModelRunner, PATCHED, True)
    for rpc in _RPCS:
        setattr(WorkerBase, rpc.__name__, rpc)


__all__ = ["register"]
