"""The worker side: per-step taps inside vLLM's model runner.

Runs in vLLM's worker process(es). Before each forward, the runner seam (:mod:`._runner`: the
V1 or the V2 runner, whichever vLLM runs) says which requests are in the step, which rows of the
flattened token batch are theirs and each token's absolute position (a
:class:`~._runner.StepBatch`). Requests that carry a :class:`~.._wire.RequestPayload` get hooks for
exactly their addresses for that forward, placed by the site table (:mod:`..model._sites`): reads
are copied out per request, writes change only that request's rows. Values wait in the
worker until the front end fetches them (``interp_fetch_many``), once the request is done.

:class:`TapManager` owns the step loop and admits requests; it is composed of one shared state
and parts over it, each a class in a module of its own, each holding the parts it calls:

- :class:`~._state.TapState` (``state``) -- the model, its family, this worker's ranks, the
  requests' states and what every part records into (failures, timing, the slab writer);
- :class:`~._capture.Captures` (``captures``) -- captured rows written into the slab or kept;
- :class:`~._recompute.Recompute` (``recompute``) -- routing, attention recompute and the
  model-output reads;
- :class:`~._saes.Saes` (``saes``) -- SAEs held by key, batched readouts and feature clamps;
- :class:`~._hooks.Hooks` (``hooks``) -- each step's hook functions and what they read and write
  at each value, and their registration as torch hooks;
- :class:`~._lens.Lens` (``lens``) -- the logit lens: a request's lens layers' ``resid_post``
  hooks keep only the rows of the positions it reads; after the forward the step's kept rows of
  every request and layer go through one final norm and served unembedding, and only the top-k
  ids and probabilities are kept, drained like streamed readouts (``interp_drain_many``) or
  fetched with the request's values;
- :class:`~._fetch.Fetch` (``fetching``) -- what leaves the worker (fetch, drain, release,
  stats, decode).

The RPC functions of :mod:`interp_vllm._vllm_entry` call the manager's own methods (``fetch``,
``drain``, ``attach``, ...), which hand over to the parts, and read the ping's attributes
(``rank``, ``tp_size``, ``family``, ``pp_rank``, ``pp_size``, ``owned``, ``issuers``) from it.

vLLM's decoder layers defer the residual add: a layer returns ``(hidden, residual)`` and the
true residual stream is their sum. Reads take the sum; a write replaces the pair by
``(new_stream, 0)``, which the next fused add-norm turns back into exactly ``new_stream``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from interp_engine import BackendError, IncompatibleDependency, UnsupportedArchitecture

from .. import _compat
from .._wire import Fetched, RequestPayload
from ..hooks import tp_position
from ..model._families import VllmFamily
from ..model._sites import HookKey
from ._capture import Captures
from ._compiled import CompiledIslands, compiles, islands_wanted, mark_config
from ._fetch import Fetch
from ._hooks import Hooks
from ._islands import Breakable, IslandSet, breakable_enabled, layer_sites, vllm_breakable
from ._lens import Lens
from ._recompute import Recompute
from ._request_taps import Hook, RequestTaps, Slice
from ._runner import Step, StepBatch
from ._saes import Saes
from ._state import TapState

logger = logging.getLogger(__name__)


def tap_manager(runner: Any) -> TapManager | UntappedRunner:
    """The taps of a model runner, or, for a model whose structure cannot be resolved, a runner
    that serves vLLM's plain requests untouched (installing interp-vllm never breaks vLLM). Where
    vLLM captures breakable CUDA graphs (:func:`~._islands.breakable_enabled`), the taps get
    islands in them (:mod:`._islands`); built before vLLM captures, they are in its graphs. On an
    engine that compiles without CUDA graphs (:func:`~._compiled.islands_wanted`), the taps get
    compiled islands (:mod:`._compiled`); built before vLLM compiles, they are in its graph."""
    try:
        config = getattr(runner, "vllm_config", None)
        enabled = breakable_enabled(config)
        return TapManager(
            runner, vllm_breakable() if enabled else None, compiled=not enabled and islands_wanted(config)
        )
    except (UnsupportedArchitecture, IncompatibleDependency) as exc:
        logger.warning("interp-engine: no taps for this model: %s", exc)
        return UntappedRunner(str(exc))


class UntappedRunner:
    """A model runner's forwards, untouched: the model could not be resolved (requests with
    taps are refused by the front end, which resolves it first)."""

    family = None
    pp_rank, pp_size = 0, 1
    owned: tuple[int, ...] = ()
    """What a ping reports of the pipeline stage: no layers are tapped here."""

    def __init__(self, unsupported: str) -> None:
        self.unsupported = unsupported
        self.rank, self.tp_size = tp_position()
        self.issuers: set[str] = set()  # a front end's ping registers its secret here too: nothing uses it

    def step(self, batch: StepBatch | None) -> Step:
        return (yield)

    def finished(self, req_ids: Any) -> None:
        return None

    def preempted(self, req_ids: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise BackendError(f"this vLLM worker has no taps: {self.unsupported}")


class TapManager:
    """The taps of one model runner: the shared :class:`~._state.TapState` and the parts over
    it. :meth:`step` runs around each forward; the front end's calls are answered by the parts."""

    def __init__(self, runner: Any, breakable: Breakable | None = None, compiled: bool = False) -> None:
        self.state = state = TapState(runner)
        self.captures = Captures(state)
        self.recompute = Recompute(state, self.captures)
        self.saes = Saes(state)
        self.hooks = Hooks(state, self.captures, self.recompute, self.saes)
        self.lens = Lens(state)
        self.fetching = Fetch(state)
        # with ``breakable`` (vLLM captures breakable CUDA graphs): an island at every layer's
        # input and output of this stage, placed now, before vLLM captures its graphs
        self.islands: IslandSet | None = None
        if breakable is not None:
            self.islands = IslandSet(layer_sites(state.owned), state.module, breakable).place()
        # with ``compiled`` (vLLM compiles the model, no CUDA graphs; ``in_graph``): an island at every
        # layer's input and output, placed now, before vLLM compiles (:mod:`._compiled`); the
        # config names them, so vLLM's compile cache never serves a graph without them
        self.in_graph = compiled
        self.compiles = compiles(getattr(runner, "vllm_config", None))
        """Whether vLLM compiles the model (a step with module hooks then runs uncompiled)."""
        self.islands_in_graph = True
        """Whether the compiled graph runs the islands (a step they missed says it does not)."""
        if compiled:
            mark_config(runner.vllm_config)
            self.islands = CompiledIslands(layer_sites(state.owned), state.module, state.family).place()

    # -- what a ping reads ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def tp_size(self) -> int:
        return self.state.tp_size

    @property
    def pp_rank(self) -> int:
        return self.state.pp_rank

    @property
    def pp_size(self) -> int:
        return self.state.pp_size

    @property
    def family(self) -> VllmFamily:
        return self.state.family

    @property
    def owned(self) -> tuple[int, ...]:
        return self.state.owned

    @property
    def issuers(self) -> set[str]:
        """The secrets of the front ends that pinged this worker (a ping adds its own)."""
        return self.state.issuers

    # -- the front end's calls --------------------------------------------------------------
    def fetch(self, rid: str) -> Fetched:
        return self.fetching.fetch(rid)

    def drain(self, rid: str) -> Fetched:
        return self.fetching.drain(rid)

    def release(self, rid: str) -> None:
        self.fetching.release(rid)

    def stats(self) -> dict[str, int]:
        out = self.fetching.stats()
        if self.islands is not None:
            out.update({f"islands_{name}": count for name, count in self.islands.counts().items()})
        return out

    def decode(self, residuals: torch.Tensor) -> torch.Tensor | None:
        return self.fetching.decode(residuals)

    def attach(self, key: str, blob: bytes) -> None:
        self.saes.attach(key, blob)

    def detach(self, key: str) -> None:
        self.saes.detach(key)

    # -- the step's requests ------------------------------------------------------------
    def _slices(self, batch: StepBatch | None) -> list[Slice]:
        if batch is None or not batch.req_ids:
            return []
        req_ids = batch.req_ids
        wanted: list[tuple[int, RequestTaps]] = []
        for index, req_id in enumerate(req_ids):
            params = self._params(req_id)
            rid = RequestPayload.rid_of(params, self.state.issuers)
            if rid is None or rid in self.state.retired:
                continue
            taps = self.state.requests.get(rid)
            if taps is None:
                taps = self._admit_safely(rid, params)
                if taps is None:  # pragma: no cover - rid_of just found a payload
                    continue
                self.state.requests[rid] = taps
            wanted.append((index, taps))
        if not wanted:
            return []
        starts = batch.starts
        self.state.step_tokens = starts[-1]

        # a copy: the runner reuses its positions buffer every step
        flat_positions = batch.positions[: starts[-1]].to("cpu", copy=True)
        self.state.step_positions = flat_positions
        # each request's first and last position (one run when they are as far apart as its rows)
        present = [(index, taps) for index, taps in wanted if starts[index + 1] > starts[index]]
        ends = torch.tensor([(starts[index], starts[index + 1] - 1) for index, _ in present], dtype=torch.long)
        bounds = flat_positions[ends.flatten()].tolist() if present else []
        slices = []
        for i, (index, taps) in enumerate(present):
            start, end = starts[index], starts[index + 1]
            taps.steps += 1
            first, last = bounds[2 * i], bounds[2 * i + 1]
            span = (first, last + 1) if last + 1 - first == end - start else None
            sl = Slice(taps, start, end, flat_positions[start:end], span=span)
            if taps.lens_at and self.state.last_stage:  # the final norm and unembedding live there
                keep = taps.lens_keep(sl.positions)
                sl.lens_keep = keep if bool(keep.any()) else None
            slices.append(sl)
        return slices

    def _admit_safely(self, rid: str, params: Any) -> RequestTaps | None:
        """:meth:`_admit`, or if the request's taps cannot be set up here (a payload this worker
        cannot read, an SAE it does not hold), a request that reads and writes nothing, its error
        reported at its fetch: one request's state never stops the engine."""
        try:
            payload = RequestPayload.of(params)
            return None if payload is None else self._admit(payload)
        except Exception as exc:
            self.state.failed[rid] = (
                f"this request's taps could not be set up in vLLM's worker: {type(exc).__name__}: {exc}"
            )
            logger.warning("interp-engine: request %s refused in the worker: %s", rid, exc)
            taps = RequestTaps(RequestPayload(rid))
            taps.awaits_fetch = RequestPayload.awaits_fetch_of(params)
            return taps

    def _params(self, req_id: str) -> Any:
        """The ``SamplingParams`` of a live vLLM request."""
        return self.state.seam.params(self.state.runner, req_id)

    def finished(self, req_ids: Any) -> None:
        """vLLM finished or aborted these requests (its own ids). A request that captured
        nothing (steering only) is forgotten now, with no round trip from the front end;
        captured values and readouts wait for their fetch."""
        for req_id in req_ids:
            rid = RequestPayload.rid_of(self._params(req_id), self.state.issuers)
            taps = self.state.requests.get(rid) if rid is not None else None
            if taps is not None and not taps.awaits_fetch:
                self.release(taps.rid)

    def preempted(self, req_ids: Any) -> None:
        """vLLM preempted these requests (counted in the stats as ``preempted``): a request's
        taps stay, and the positions it recomputes are read and written again."""
        self.state.timing["preempted"] += len(req_ids)

    def _admit(self, payload: RequestPayload) -> RequestTaps:
        """The state of a request seen for the first time."""
        if payload.buffers:
            self.state.writer.forget_gone()  # segments the front end removed since
        return RequestTaps(payload, self.state.saes, len(self.state.layers))

    # -- one forward ----------------------------------------------------------------------
    def step(self, batch: StepBatch | None) -> Step:
        """The taps of one forward over ``batch`` (a :data:`~._runner.Step`): the hooks of the
        step's requests go in before it, its output is read (and written at ``final_norm``)
        after it, and the hooks come out whatever happens."""
        began = time.perf_counter_ns()
        try:
            return (yield from self._step(batch))
        finally:
            self.state.copier.step_done()
            self.state.timing["steps"] += 1
            self.state.timing["step_ns"] += time.perf_counter_ns() - began

    def _step(self, batch: StepBatch | None) -> Step:
        slices = self._slices(batch)
        if not slices:
            return (yield from self.state.forward())
        hooks: dict[HookKey, Hook] = defaultdict(Hook)
        for sl in slices:
            for address, role in sl.taps.roles.items():
                key = self.state.hook_key(address)
                if key is None:  # another pipeline stage serves it
                    continue
                if sl.lens_keep is None and not (role.writes or role.captures or role.reads or role.keeps):
                    continue  # a lens layer with no row to read in this step (an early prefill chunk)
                hooks[key].add(address, sl)
                if address.kind == "resid_mid":  # needs this layer's resid_pre
                    stash = hooks[("layer_in", None, address.layer or 0)]
                    if sl not in stash.stash_for:
                        stash.stash_for.append(sl)
        islands = self.islands
        if islands is None:
            handles = [
                self.hooks.register(key, self.hooks.tap(key, hook))
                for key, hook in hooks.items()
                if key[0] != "model_out"
            ]
            # module hooks run only in an uncompiled forward: on an engine that compiles, a
            # step with hooks is vLLM's uncompiled forward (steps no request taps run compiled)
            inside = self.compiles and bool(handles)
        else:
            handles = self._begin_islands(islands, hooks)
            # compiled islands serve the layers' inputs and outputs inside the compiled graph;
            # a step that also needs module hooks (sites inside a layer) runs uncompiled
            inside = self.in_graph and (bool(handles) or not self.islands_in_graph)
        missed: list[HookKey] = []
        try:
            with _compat.uncompiled_forward() if inside else contextlib.nullcontext(False) as switched:
                self.state.timing["uncompiled_steps"] += int(bool(switched))
                output = yield from self.state.forward()
        finally:
            for handle in handles:
                handle.remove()
            if islands is not None:
                missed = islands.end()
        if missed and self.in_graph and not inside:
            # a compiled graph without the islands (one compiled before they were placed)
            self.islands_in_graph = False
            logger.warning("interp-engine: vLLM's compiled graph has no islands; tapped steps run uncompiled")
        for key in missed:
            self.state.fail(_members(hooks[key]), BackendError(f"{_site(key)}: {MISSED}"))
        out_hook = hooks.get(("model_out", None, 0))
        if out_hook is not None:
            try:
                output = self.hooks.model_out(output, out_hook)
            except Exception as exc:
                self.state.fail([sl for members in out_hook.members.values() for sl in members], exc)
        self.lens.run(slices)
        return output

    def _begin_islands(self, islands: IslandSet, hooks: dict[HookKey, Hook]) -> list[Any]:
        """The step's functions handed to the islands for the sites they serve (they run them at
        capture, at each replay and in an eager forward); the others registered as module hooks,
        which run only in an eager forward. The registered hooks' handles."""
        taps = {key: self.hooks.tap(key, hook) for key, hook in hooks.items() if key[0] != "model_out"}

        def on_error(key: HookKey, exc: Exception) -> None:
            self.state.fail(_members(hooks[key]), exc)

        undeclared = islands.begin(taps, on_error=on_error)
        return [self.hooks.register(key, islands.marked(key, taps[key])) for key in undeclared]


MISSED = (
    "its taps did not run in this step: vLLM replayed a CUDA graph with no island there (a FULL graph, "
    "a site no island was declared at, or one inside a region vLLM compiles)"
)
"""Why a request whose taps the islands report missed (:meth:`~._islands.IslandSet.end`) fails."""


def _members(hook: Hook) -> list[Slice]:
    """The requests a hook serves (its addresses' and those it stashes ``resid_pre`` for)."""
    return [sl for members in hook.members.values() for sl in members] + hook.stash_for


def _site(key: HookKey) -> str:
    where, attr, layer = key
    names = {
        "layer_in": "the input of",
        "layer_out": "the output of",
        "input": "the input of",
        "output": "the output of",
    }
    part = f"{attr} of layer {layer}" if attr is not None else f"layer {layer}"
    return f"{names.get(where, where)} {part}"
