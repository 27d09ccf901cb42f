"""The ``vllm.general_plugins`` entry point: loaded in every vLLM process, workers included.

It wraps vLLM's model runners through the runner seam (:func:`.worker._runner.install`: the V1
and the V2 runner, whichever the installed vLLM has) so each forward runs with the taps of the
requests in that step, the taps learn which requests vLLM finished or aborted, and a
vllm-static engine gets its fixed taps right after the model is loaded (before vLLM compiles
it); and it adds the RPC methods the front end calls through ``collective_rpc``, one per name of
:data:`._wire.RPC_NAMES` (:data:`WORKER_RPCS`). In vLLM's own processes (its engine core and workers) it also skips the
interpreter's final garbage collection at exit, which over a loaded engine's heap takes seconds
(:func:`_skip_final_collection`). Safe to call more than once.

A runner whose shape the seam does not expect is left unpatched (vLLM serves plain requests as
ever); the workers' ping then carries the :class:`~interp_engine.IncompatibleDependency` message, which
the front end raises.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from . import _compat
from . import _wire as wire
from ._transport import sees
from ._wire import CONFIG_KEY

logger = logging.getLogger(__name__)

_SKIPPING: list[bool] = []
"""Whether this process skips its final collection (:func:`register`)."""

_INCOMPATIBLE: list[str] = []
"""Why a runner of this process's vLLM could not be patched (empty: every one was, or it was never
tried); the ping reports it where the runner in use is one of them."""


def _taps(runner: Any) -> Any:
    taps = getattr(runner, "_interp_taps", None)
    if taps is None:
        from .worker._manager import tap_manager

        taps = runner._interp_taps = tap_manager(runner)
    return taps


class _Handlers:
    """What the runner seam calls in this process: the taps of the runner it serves."""

    def step(self, runner: Any, batch: Any) -> Any:
        return _taps(runner).step(batch)

    def finished(self, runner: Any, req_ids: Any) -> None:
        _taps(runner).finished(req_ids)

    def preempted(self, runner: Any, req_ids: Any) -> None:
        _taps(runner).preempted(req_ids)

    def after_load(self, runner: Any) -> None:
        """Install a vllm-static engine's taps right after the model is loaded (before compiling);
        where vLLM captures breakable CUDA graphs, the taps with their islands (before capture);
        where it compiles without graphs, the taps with their compiled islands (before compiling)."""
        from .static._worker import StaticTapManager, served_declaration, static_config
        from .worker._compiled import islands_wanted
        from .worker._islands import breakable_enabled
        from .worker._manager import tap_manager

        config = static_config(runner)
        vllm_config = getattr(runner, "vllm_config", None)
        if config is not None:
            try:
                runner._interp_taps = StaticTapManager(runner, config)
                return
            except Exception as exc:
                if not served_declaration(runner):
                    raise  # the vllm-static backend's front end checked its declaration
                # a `vllm serve` operator's declaration: the server starts without it, and the
                # plugin's front end reports why (the workers' ping says they are not static)
                logger.error("interp-engine: the compiled taps declared in --additional-config failed: %s", exc)
                _compat.additional_config(runner).pop(CONFIG_KEY, None)
        if breakable_enabled(vllm_config) or islands_wanted(vllm_config):
            runner._interp_taps = tap_manager(runner)


_HANDLERS = _Handlers()


def interp_ping(self: Any, probe: str | None = None, issuer: str | None = None) -> Any:
    """Which runner serves this worker, whether it carries the taps, and whether it sees the
    front end's shared-memory ``probe`` file (a :class:`~._wire.Ping`). ``issuer``: the calling
    front end's secret; requests whose payload carries it are served from now on."""
    from .worker._seam import seam_of

    runner = self.model_runner
    seam = seam_of(runner)
    if seam is None:
        return wire.to_wire(
            wire.Ping(
                runner=type(runner).__qualname__,
                patched=False,
                v2_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                incompatible="; ".join(_INCOMPATIBLE) if _INCOMPATIBLE else None,
            )
        )
    taps = _taps(runner)
    if issuer and isinstance(getattr(taps, "issuers", None), set):
        taps.issuers.add(issuer)
    # a worker without taps has no declaration (its placeholder raises on any other attribute)
    declaration = None if getattr(taps, "unsupported", None) else getattr(taps, "declaration", None)
    return wire.to_wire(
        wire.Ping(
            runner=type(runner).__qualname__,
            seam=seam.name,
            patched=True,
            static=_is_static(taps),
            static_points=tuple(getattr(declaration, "points", ())),
            static_writes=tuple(getattr(declaration, "writes", ())),
            rank=taps.rank,
            tp_size=taps.tp_size,
            lacks=tuple(sorted(taps.family.lacks())) if taps.family is not None else None,
            unsupported=getattr(taps, "unsupported", None),
            pp_rank=getattr(taps, "pp_rank", 0),
            pp_size=getattr(taps, "pp_size", 1),
            layers=tuple(getattr(taps, "owned", ())),
            # what picked the runner in this worker (a Ray worker on another node has its own env)
            v2_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
            sees_probe=sees(probe),
        )
    )


def _is_static(taps: Any) -> bool:
    from .static._worker import StaticTapManager

    return isinstance(taps, StaticTapManager)


def interp_fetch_many(self: Any, rids: list[str]) -> list[Any]:
    """Finished requests' captured values (a :class:`~._wire.FetchedWire` each): one
    engine-core round trip for every request the front end is waiting on."""
    taps = _taps(self.model_runner)
    return [wire.to_wire(taps.fetch(rid).encode()) for rid in rids]


def interp_drain_many(self: Any, rids: list[str]) -> list[Any]:
    """Streaming requests' readouts so far (a :class:`~._wire.FetchedWire` each), dropped from the worker."""
    taps = _taps(self.model_runner)
    return [wire.to_wire(taps.drain(rid).encode()) for rid in rids]


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
    logits = _taps(self.model_runner).decode(wire.unpack_residuals(data))
    return wire.pack_logits(logits)  # nothing from a stage before the last


def interp_weight_info(self: Any) -> Any:
    """What this worker's pipeline stage holds of the weights (a :class:`~._wire.WeightsHeld`)."""
    from .worker._weights import worker_info

    return wire.to_wire(worker_info(_taps(self.model_runner).state))


def interp_weight(self: Any, name: str, layer: int | None, vocab: list[int] | None) -> bytes:
    """This worker's shard of a weight the front end checked, as safetensors bytes (empty where
    its stage does not hold it)."""
    from .worker._weights import worker_weight

    return wire.pack(worker_weight(_taps(self.model_runner).state, name, layer, vocab))


def interp_stats(self: Any) -> dict[str, int]:
    """Per-worker bookkeeping (live per-request states), for leak checks."""
    return dict(_taps(self.model_runner).stats())


WORKER_RPCS: dict[str, Callable[..., Any]] = {
    wire.PING: interp_ping,
    wire.FETCH_MANY: interp_fetch_many,
    wire.DRAIN_MANY: interp_drain_many,
    wire.ATTACH: interp_attach,
    wire.DETACH: interp_detach,
    wire.RELEASE: interp_release,
    wire.DECODE: interp_decode,
    wire.WEIGHT_INFO: interp_weight_info,
    wire.WEIGHT: interp_weight,
    wire.STATS: interp_stats,
}
"""The worker's method for each RPC name of the wire."""


_VLLM_PROCESSES = ("EngineCore", "VllmWorker")
"""The names vLLM gives the processes it starts (its engine core, one per data-parallel rank, and
its workers)."""


def _skip_final_collection() -> None:
    """At exit: collect once (a fraction of a second: the garbage there is now, vLLM's
    shared-memory caches among it, is finalised and unlinks its segments), then move every object
    to the permanent generation, so that the interpreter's final cyclic collections after its
    modules are torn down have nothing to scan (over a loaded engine's heap they take seconds; the
    process's memory goes back to the system whole). Extensions built with nanobind (Triton's,
    which vLLM imports through torch) then report their still-alive objects as leaks on stderr
    as the interpreter ends: that report is of objects the exit frees anyway, so stderr is closed
    after everything else the process wrote is flushed."""
    gc.collect()
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)


def register() -> None:
    """Wrap vLLM's model runners and add the RPC methods to its worker base (idempotent). In a
    process vLLM started, the interpreter's final garbage collection is skipped: over the heap of
    a loaded engine it takes seconds, and vLLM's process manager kills an engine core that
    outlives its shutdown grace. Where the installed vLLM's AOT compile artifacts never load, its
    AOT compile is turned off for the processes this one starts (:func:`._compat.aot_compile_env`)."""
    if multiprocessing.current_process().name.startswith(_VLLM_PROCESSES) and not _SKIPPING:
        atexit.register(_skip_final_collection)
        _SKIPPING.append(True)
    from .worker._seam import install

    for problem in install(_HANDLERS):
        if problem not in _INCOMPATIBLE:
            logger.error("interp-engine: a model runner is left unpatched: %s", problem)
            _INCOMPATIBLE.append(problem)
    _compat.add_worker_methods(WORKER_RPCS.items())
    # before the processes this one starts read it: a compiled engine's graphs come from a cache
    # that loads (in every process, so an engine vLLM's own server starts gets it too)
    for name, value in _compat.aot_compile_env().items():
        os.environ.setdefault(name, value)


__all__ = ["WORKER_RPCS", "register"]
