"""The worker side: per-step taps inside vLLM's model runner.

Runs in vLLM's worker process(es). Before each forward, the runner's own batch state says which
requests are in the step and which rows of the flattened token batch are theirs
(``input_batch.req_ids`` and ``query_start_loc``); the positions tensor gives each token's
absolute position. Requests that carry a :class:`~._wire.RequestPayload` get hooks for exactly
their addresses for that forward, placed by the site table (:mod:`._sites`): reads are copied
out per request, writes change only that request's rows. Values wait in the worker until the
front end fetches them (``interp_fetch_many``), once the request is done.

A request's logit lens (``RequestPayload.lens_layers``) keeps, at each lens layer's
``resid_post`` hook, only the rows of the positions it reads; after the forward the step's kept
rows of every request and layer go through one final norm and served unembedding
(:meth:`TapManager._lens`), and only the top-k ids and probabilities are kept, drained like
streamed readouts (``interp_drain_many``) or fetched with the request's values.

vLLM's decoder layers defer the residual add: a layer returns ``(hidden, residual)`` and the
true residual stream is their sum. Reads take the sum; a write replaces the pair by
``(new_stream, 0)``, which the next fused add-norm turns back into exactly ``new_stream``.
"""

from __future__ import annotations

import collections
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from interp_engine import (
    Address,
    BackendError,
    FeatureReadout,
    Features,
    FeatureWrite,
    Sae,
    UnknownSae,
    UnsupportedArchitecture,
    Write,
)
from interp_engine.backend import lens_top_k, write_positions

from ._families import VllmFamily
from ._resolve import resolve
from ._sites import SITES, HookKey, VllmSite, added_scale, columns, hook_key, local_write
from ._static import SaeLayout, SaeMath, pick
from ._wire import PAYLOAD_KEY, Fetched, LensChunk, RequestPayload, compact, compact_ids, merge_lens

logger = logging.getLogger(__name__)


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def arg_slot(module: nn.Module, site: VllmSite) -> tuple[int, str]:
    """``(position, name)`` of an ``input`` site's argument in ``module.forward``: by the site's
    ``arg_name`` where the signature has it (callers may pass it either way), else ``arg``."""
    key = (type(module).__qualname__, type(module).__module__, site)
    if key not in _ARG_SLOTS:  # once per module class: the dynamic worker builds its hooks every step
        _ARG_SLOTS[key] = _arg_slot(type(module), site)
    return _ARG_SLOTS[key]


_ARG_SLOTS: dict[tuple[str, str, VllmSite], tuple[int, str]] = {}


def _arg_slot(cls: type[nn.Module], site: VllmSite) -> tuple[int, str]:
    if site.arg_name is not None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            params = []
        names = [p.name for p in params]
        if site.arg_name in names:
            return names.index(site.arg_name), site.arg_name
        if len(params) == 1:  # a single-argument forward, whatever its name
            return 0, names[0]
    return site.arg, site.arg_name or f"arg{site.arg}"


class _ForwardHook:
    """A pre-hook run by the module's ``forward`` itself (see :func:`forward_pre_hook`)."""

    def __init__(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            changed = hook(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            return inner(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous


def forward_pre_hook(module: nn.Module, hook: Callable[..., Any]) -> _ForwardHook:
    """``hook(module, args, kwargs)`` before every call of ``module``'s forward, returning
    ``(args, kwargs)`` to change them (or ``None``). Unlike ``register_forward_pre_hook`` it also
    runs when the caller calls ``module.forward(...)`` directly, as vLLM's Transformers modeling
    backend calls its attention kernels."""
    return _ForwardHook(module, hook)


def flat(value: torch.Tensor) -> torch.Tensor:
    """``[tokens, everything else]`` (a view when ``value`` is contiguous: writes go through)."""
    return value.reshape(value.shape[0], -1)


def part_of(value: torch.Tensor, cols: tuple[int, int] | None) -> torch.Tensor:
    """Column block ``cols = (index, parts)`` of ``[tokens, width]`` (a view), or all of it."""
    if cols is None:
        return value
    index, parts = cols
    width = value.shape[-1] // parts
    return value[:, index * width : (index + 1) * width]


def _set_arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if len(args) > index:
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def _copy(value: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy that never aliases the runner's reused buffers."""
    return value.detach().to("cpu", torch.float32, copy=True)


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # not initialised (tests) or not distributed
        return 0, 1


def _pp() -> tuple[int, int]:
    """This worker's pipeline-parallel stage and the number of stages."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # not initialised (tests) or not distributed
        return 0, 1


def owned_layers(layers: Any) -> tuple[int, ...]:
    """The layers this pipeline stage holds: vLLM puts a ``PPMissingLayer`` where a layer lives
    on another stage (every layer without pipeline parallelism)."""
    try:
        from vllm.model_executor.models.utils import PPMissingLayer
    except ImportError:  # pragma: no cover - a vLLM without it has no pipeline parallelism
        return tuple(range(len(layers)))
    return tuple(i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer))


_Local = tuple[Write, torch.Tensor, torch.Tensor | None]
"""This rank's part of a write, with its vector and target on the value's device and dtype."""


@dataclass
class _WriteTable:
    """One write, resolved over the request's whole sequence."""

    write: Write | FeatureWrite
    mask: torch.Tensor  # [n_total] bool: positions the write touches
    row: torch.Tensor  # [n_total] long: the (per-position) vector and target row for each touched position
    local: dict[tuple[int, torch.device, torch.dtype], _Local | None] = field(default_factory=dict)


class RequestTaps:
    """One request's points, writes, readouts and captured values, for its whole life in the worker."""

    def __init__(self, payload: RequestPayload, saes: dict[str, Sae] | None = None) -> None:
        self.payload = payload
        self.rid = payload.rid
        self.points = list(payload.points)
        self.n_prompt = payload.n_prompt
        self.n_total = payload.n_total
        # the SAEs by the names the request uses, each the one it was checked with (held by
        # reference: a detach or re-attach in the worker does not reach an admitted request)
        self.saes: dict[str, Sae] = {}
        self.readouts_at: dict[Address, list[Features]] = defaultdict(list)
        for spec in payload.readouts:
            self.saes[spec.sae] = _held(saes, spec.sae, payload.sae_keys)
            self.readouts_at[self.saes[spec.sae].address].append(spec)
        for write in payload.writes:
            if isinstance(write, FeatureWrite):
                self.saes[write.sae] = _held(saes, write.sae, payload.sae_keys)
        # the logit lens: per lens layer's resid_post, the rows of the positions it reads (every
        # position from the prompt's last on, and the prompt positions asked) are decoded after
        # the forward; only their top-k ids and probabilities are kept
        self.lens_at = {Address("resid_post", layer): i for i, layer in enumerate(payload.lens_layers)}
        self.lens_k = payload.lens_top_k
        self.lens_prompt = torch.tensor(sorted(payload.lens_positions), dtype=torch.long)
        self.lens_values: list[LensChunk] = []
        # the front end fetches (or releases) what a request captured or read; the others are
        # forgotten when vLLM finishes them
        self.awaits_fetch = bool(payload.points or payload.readouts or payload.lens_layers)
        self.readout_values: dict[Features, list[tuple[torch.Tensor, FeatureReadout]]] = defaultdict(list)
        self.first_readout = payload.n_prompt - 1 if payload.stream else 0
        self.writes: dict[Address, list[_WriteTable]] = defaultdict(list)
        for write in payload.writes:
            positions = write_positions(write, self.n_prompt, self.n_total)
            mask = torch.zeros(self.n_total, dtype=torch.bool)
            row = torch.zeros(self.n_total, dtype=torch.long)
            index = torch.tensor([p for p in positions if p < self.n_total], dtype=torch.long)
            mask[index] = True
            row[index] = torch.arange(len(index))
            if write.address is None:  # the front end binds feature writes
                raise BackendError(f"an unbound feature write reached the worker: {write!r}")
            self.writes[write.address].append(_WriteTable(write, mask, row))
        self.values: dict[Address, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.keys: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> (positions, keys, step)
        self.steps = 0

    def addresses(self) -> set[Address]:
        return set(self.points) | set(self.writes) | set(self.readouts_at) | set(self.lens_at)

    def serves(self, address: Address) -> bool:
        """Whether the request reads or writes ``address`` besides its lens."""
        return address in self.points or address in self.writes or address in self.readouts_at

    def lens_keep(self, positions: torch.Tensor) -> torch.Tensor:
        """Which of ``positions`` the lens reads."""
        keep = positions >= self.n_prompt - 1
        if len(self.lens_prompt):
            keep |= torch.isin(positions, self.lens_prompt)
        return keep


def _held(saes: dict[str, Sae] | None, name: str, keys: Mapping[str, str] | None = None) -> Sae:
    """The SAE this worker holds for ``name``: under the request's key for it, or under the name
    (the front end sends it before any request names it)."""
    key = (keys or {}).get(name, name)
    if saes is None or key not in saes:
        raise UnknownSae(
            f"this vLLM worker holds no SAE named {name!r} (key {key!r})", name=name, valid=list(saes or ())
        )
    return saes[key]


@dataclass(eq=False)  # compared by identity
class _Slice:
    """A request's rows in this step's flattened batch."""

    taps: RequestTaps
    start: int
    end: int
    positions: torch.Tensor  # [end - start] absolute positions, on the CPU
    stash: dict[int, torch.Tensor] = field(default_factory=dict)
    lens_keep: torch.Tensor | None = None  # [end - start] bool: rows the lens reads this step
    lens_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # lens layer index -> its kept rows


@dataclass
class _Hook:
    """Everything one hook does this step: per address, the requests that read or write it."""

    members: dict[Address, list[_Slice]] = field(default_factory=lambda: defaultdict(list))
    stash_for: list[_Slice] = field(default_factory=list)  # resid_mid needs this layer's resid_pre

    def add(self, address: Address, sl: _Slice) -> None:
        if sl not in self.members[address]:
            self.members[address].append(sl)

    def ordered(self) -> list[tuple[Address, VllmSite, list[_Slice]]]:
        """The hook's addresses in the order their values are computed (the site table's)."""
        order = {kind: i for i, kind in enumerate(SITES)}
        return [
            (address, SITES[address.kind], members)
            for address, members in sorted(self.members.items(), key=lambda kv: order[kv[0].kind])
        ]


def tap_manager(runner: Any) -> TapManager | UntappedRunner:
    """The taps of a model runner, or, for a model whose structure cannot be resolved, a runner
    that serves vLLM's plain requests untouched (installing interp-vllm never breaks vLLM)."""
    try:
        return TapManager(runner)
    except UnsupportedArchitecture as exc:
        logger.warning("interp-engine: no taps for this model: %s", exc)
        return UntappedRunner(str(exc))


class UntappedRunner:
    """A model runner's forwards, untouched: the model could not be resolved (requests with
    taps are refused by the front end, which resolves it first)."""

    family = None

    def __init__(self, unsupported: str) -> None:
        self.unsupported = unsupported
        self.rank, self.tp_size = _tp()

    def run(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return forward(*args, **kwargs)

    def finished(self, req_ids: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise BackendError(f"this vLLM worker has no taps: {self.unsupported}")


class TapManager:
    """The taps of one model runner. ``run`` wraps each ``_model_forward`` call."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model: nn.Module = runner.get_model()
        self.family: VllmFamily = resolve(self.model, runner.model_config.hf_config)
        self.layers = _get(self.model, self.family.layers)
        self.rank, self.tp_size = _tp()
        # under pipeline parallelism this stage holds some layers (and the last stage the final
        # norm and the unembedding): hooks go only where the layer lives, reads come from there
        self.pp_rank, self.pp_size = _pp()
        self.owned = owned_layers(self.layers)
        self.last_stage = self.pp_rank == self.pp_size - 1
        if not self.owned:
            raise BackendError(f"pipeline stage {self.pp_rank} of {self.pp_size} holds none of the model's layers")
        config = runner.model_config.hf_config
        self.n_heads = int(config.num_attention_heads)
        # the config's count where it names one (key/value heads replicated over more ranks than
        # there are heads), else the kernels' (Falcon's multi-query attention: num_kv_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.family.n_kv_heads)
        self.d_head = int(_get(self.layers[self.owned[0]], self.family.attn_kernel).head_size)
        self.requests: dict[str, RequestTaps] = {}
        self.step_tokens = 0  # rows of the flattened batch in the current step
        # ids already fetched or released: a step scheduled before an abort landed must not
        # bring their state back
        self.retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        # where the worker's time goes (nanoseconds), reported by stats(): the whole of each
        # forward call with taps, the forward alone (SAE readouts and feature clamps in it:
        # sae_ns), and answering fetches
        self.timing = {
            "steps": 0,
            "step_ns": 0,
            "forward_ns": 0,
            "sae_ns": 0,
            "lens_ns": 0,
            "fetch_ns": 0,
            "fetches": 0,
        }
        # requests whose taps raised in this worker: the error, reported at their fetch (the
        # hook gave the forward its values back unchanged, so the engine and the rest of the
        # batch go on)
        self.failed: dict[str, str] = {}
        # SAEs and probes the front end attached, on the model's device (interp_attach)
        self.saes: dict[str, Sae] = {}
        self._sae_math: dict[tuple[int, str], tuple[Sae, SaeMath]] = {}  # batched encoders, per SAE

    def attach(self, key: str, blob: bytes) -> None:
        """Hold an SAE sent once by the front end (``Sae.to_bytes``) under ``key``, on the
        model's device."""
        param = next(self.model.parameters())
        self.saes[key] = Sae.from_bytes(blob).to(device=param.device)

    def detach(self, key: str) -> None:
        """Drop the SAE held under ``key`` (requests already admitted keep their reference)."""
        self.saes.pop(key, None)

    def total_heads(self, site: VllmSite) -> int:
        return self.n_kv_heads if site.shard == "kv_heads" else self.n_heads

    def owns(self, address: Address) -> bool:
        """Whether ``address`` is computed on this pipeline stage (the model's output kinds on
        the last stage, the others where their layer lives; ``embed`` with layer 0)."""
        if SITES[address.kind].where == "model_out":
            return self.last_stage
        return (address.layer or 0) in self.owned

    def module(self, key: HookKey) -> nn.Module:
        """The module a hook attaches to."""
        _, attr, layer = key
        block: nn.Module = self.layers[layer]
        if attr is None:
            return block
        module: nn.Module = _get(block, getattr(self.family, attr))
        return module

    def _timed_forward(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        began = time.perf_counter_ns()
        try:
            return forward(*args, **kwargs)
        finally:
            self.timing["forward_ns"] += time.perf_counter_ns() - began

    # -- the step's requests ------------------------------------------------------------
    def _slices(self, positions: torch.Tensor | None) -> list[_Slice]:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0 or positions is None:
            return []
        wanted: list[tuple[int, RequestTaps]] = []
        for index, req_id in enumerate(batch.req_ids[:num_reqs]):
            params = self._params(req_id)
            rid = RequestPayload.rid_of(params)
            if rid is None or rid in self.retired:
                continue
            taps = self.requests.get(rid)
            if taps is None:
                taps = self._admit_safely(rid, params)
                if taps is None:  # pragma: no cover - rid_of just found a payload
                    continue
                self.requests[rid] = taps
            wanted.append((index, taps))
        if not wanted:
            return []
        starts = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        self.step_tokens = starts[-1]

        # a copy: the runner reuses its positions buffer every step
        flat_positions = (positions if positions.dim() == 1 else positions[0])[: starts[-1]].to("cpu", copy=True)
        slices = []
        for index, taps in wanted:
            start, end = starts[index], starts[index + 1]
            if end > start:
                taps.steps += 1
                sl = _Slice(taps, start, end, flat_positions[start:end])
                if taps.lens_at and self.last_stage:  # the final norm and unembedding live there
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
            self.failed[rid] = f"this request's taps could not be set up in vLLM's worker: {type(exc).__name__}: {exc}"
            logger.warning("interp-engine: request %s refused in the worker: %s", rid, exc)
            data = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY) or {}
            taps = RequestTaps(RequestPayload(rid))
            taps.awaits_fetch = bool(data.get("points") or data.get("readouts") or data.get("lens"))
            return taps

    def _params(self, req_id: str) -> Any:
        """The ``SamplingParams`` of a live vLLM request."""
        return getattr(self.runner.requests.get(req_id), "sampling_params", None)

    def finished(self, req_ids: Any) -> None:
        """vLLM finished or aborted these requests (its own ids). A request that captured
        nothing (steering only) is forgotten now, with no round trip from the front end;
        captured values and readouts wait for their fetch."""
        for req_id in req_ids:
            rid = RequestPayload.rid_of(self._params(req_id))
            taps = self.requests.get(rid) if rid is not None else None
            if taps is not None and not taps.awaits_fetch:
                self.release(taps.rid)

    def _admit(self, payload: RequestPayload) -> RequestTaps:
        """The state of a request seen for the first time."""
        return RequestTaps(payload, self.saes)

    # -- one forward ----------------------------------------------------------------------
    def run(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        began = time.perf_counter_ns()
        try:
            return self._run(forward, args, kwargs)
        finally:
            self.timing["steps"] += 1
            self.timing["step_ns"] += time.perf_counter_ns() - began

    def _run(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        slices = self._slices(kwargs.get("positions"))
        if not slices:
            return self._timed_forward(forward, args, kwargs)
        hooks: dict[HookKey, _Hook] = defaultdict(_Hook)
        for sl in slices:
            for address in sl.taps.addresses():
                if not self.owns(address):  # another pipeline stage serves it
                    continue
                if sl.lens_keep is None and address in sl.taps.lens_at and not sl.taps.serves(address):
                    continue  # a lens layer with no row to read in this step (an early prefill chunk)
                hooks[hook_key(address, self.family)].add(address, sl)
                if address.kind == "resid_mid":  # needs this layer's resid_pre
                    stash = hooks[("layer_in", None, address.layer or 0)]
                    if sl not in stash.stash_for:
                        stash.stash_for.append(sl)
        handles = [self._install(key, hook) for key, hook in hooks.items() if key[0] != "model_out"]
        try:
            output = self._timed_forward(forward, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
        out_hook = hooks.get(("model_out", None, 0))
        if out_hook is not None:
            try:
                output = self._model_out(output, out_hook)
            except Exception as exc:
                self._fail([sl for members in out_hook.members.values() for sl in members], exc)
        self._lens(slices)
        return output

    # -- the logit lens ----------------------------------------------------------------------
    def _lens(self, slices: list[_Slice]) -> None:
        """The step's logit lens for every request that reads it: the rows its lens layers'
        hooks kept, all requests and layers together through ONE final norm and served
        unembedding (under tensor parallelism a collective: every rank of this stage joins with
        the same rows, a row whose hook failed as zeros), then :func:`lens_top_k` per top-k on
        rank 0, which keeps only the ids and probabilities."""
        readers = [sl for sl in slices if sl.lens_keep is not None]
        if not readers:
            return
        began = time.perf_counter_ns()
        param = next(self.model.parameters())
        width = int(self.runner.model_config.hf_config.hidden_size)
        blocks: list[torch.Tensor] = []
        spans: list[tuple[_Slice, int, int]] = []  # per reader: its first row in the batch, its rows per layer
        start = 0
        for sl in readers:
            keep = sl.lens_keep
            if keep is None:  # pragma: no cover - filtered above
                continue
            count = int(keep.sum())
            for index in range(len(sl.taps.lens_at)):
                rows = sl.lens_rows.get(index)
                if rows is None or rows.shape[0] != count:  # its hook failed: zeros keep the ranks' shapes equal
                    rows = torch.zeros(count, width, dtype=param.dtype, device=param.device)
                blocks.append(rows)
            spans.append((sl, start, count))
            start += count * len(sl.taps.lens_at)
        try:
            logits = self._lens_logits(torch.cat(blocks))
            if logits is not None:  # rank 0 (and every rank where vLLM all-gathers) records
                self._record_lens(spans, logits)
        except Exception as exc:
            self._fail(readers, exc)
        finally:
            for sl in readers:
                sl.lens_rows.clear()
            self.timing["lens_ns"] += time.perf_counter_ns() - began

    def _lens_logits(self, residuals: torch.Tensor) -> torch.Tensor | None:
        """The served final norm and logits of ``residuals`` (``None`` on a rank that vLLM's
        gather leaves without them)."""
        norm = _get(self.model, self.family.final_norm)
        with torch.inference_mode():
            logits: torch.Tensor | None = self.model.compute_logits(norm(residuals))  # type: ignore[operator]
        return logits

    def _record_lens(self, spans: list[tuple[_Slice, int, int]], logits: torch.Tensor) -> None:
        if self.rank != 0:
            return
        vocab = int(logits.shape[-1])
        by_k: dict[int, list[tuple[_Slice, int, int]]] = defaultdict(list)
        for span in spans:
            by_k[span[0].taps.lens_k].append(span)
        for k, group in by_k.items():  # one softmax and top-k per distinct k
            index = torch.cat(
                [torch.arange(start, start + count * len(sl.taps.lens_at)) for sl, start, count in group]
            ).to(logits.device)
            try:
                ids, probs = lens_top_k(logits[index], k)
            except Exception as exc:  # these requests fail alone (rank 0's own work: no collective)
                self._fail([sl for sl, _, _ in group], exc)
                continue
            ids, probs = compact_ids(ids, vocab).to("cpu"), probs.to("cpu", torch.float32)
            offset = 0
            for sl, _, count in group:
                n_layers = len(sl.taps.lens_at)
                part = slice(offset, offset + count * n_layers)
                offset += count * n_layers
                keep = sl.lens_keep if sl.lens_keep is not None else torch.ones_like(sl.positions, dtype=torch.bool)
                # [layers * count, k] -> [count, layers, k]
                mine_ids = ids[part].view(n_layers, count, k).transpose(0, 1).contiguous()
                mine_probs = probs[part].view(n_layers, count, k).transpose(0, 1).contiguous()
                sl.taps.lens_values.append((sl.positions[keep], mine_ids, mine_probs))

    def _model_out(self, output: Any, hook: _Hook) -> Any:
        """The forward's output with the step's writes at ``final_norm`` applied (to a copy: vLLM
        computes the logits from what this returns), its reads and readouts there recorded, then
        the logits read from it."""
        final = Address("final_norm")
        members = hook.members.get(final, [])
        if members:
            hidden = output[0] if isinstance(output, tuple) else output
            if any(final in sl.taps.writes for sl in members):
                hidden = hidden.clone()
            if self._visit(hidden, members, final):
                output = (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        rest = _Hook(members=defaultdict(list, {a: m for a, m in hook.members.items() if a != final}))
        self._read_output(output, rest)
        return output

    def _install(self, key: HookKey, hook: _Hook) -> Any:
        where, attr, layer = key
        module = self.module(key)
        if where == "layer_in":
            return module.register_forward_pre_hook(self._guarded(hook, self._layer_in(layer, hook)), with_kwargs=True)
        if where == "layer_out":
            return module.register_forward_hook(self._guarded(hook, self._layer_out(hook)))
        if where == "input" and attr == "attn_kernel":  # [tokens, ...] on every model
            return forward_pre_hook(module, self._guarded(hook, self._input(module, layer, hook)))
        batched = self.family.batched  # HF's modules see [1, tokens, ...]
        if where == "input":
            return module.register_forward_pre_hook(
                self._guarded(hook, self._input(module, layer, hook, batched)), with_kwargs=True
            )
        return module.register_forward_hook(self._guarded(hook, self._output(layer, hook, batched)))

    def _guarded(self, hook: _Hook, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (a hook) that, if it raises, leaves the forward's values as they were and
        marks the hook's requests failed instead of taking vLLM's engine down."""

        def guarded(*args: Any) -> Any:
            try:
                return function(*args)
            except Exception as exc:
                self._fail([sl for members in hook.members.values() for sl in members] + hook.stash_for, exc)
                return None

        return guarded

    def _fail(self, slices: list[_Slice], exc: Exception) -> None:
        for sl in slices:
            self.failed.setdefault(sl.taps.rid, f"a tap failed in vLLM's worker: {type(exc).__name__}: {exc}")
        logger.warning("interp-engine: a tap failed for %d request(s): %s", len(slices), exc, exc_info=True)

    # -- applying a request's writes and reads to one value -------------------------------
    def _visit(self, value: torch.Tensor, members: list[_Slice], address: Address) -> bool:
        """Apply each member's writes at ``address`` to ``value`` (in place), then record its
        reads. Returns whether anything was written."""
        site = SITES[address.kind]
        changed = False
        # write i of every member in one round (members' rows are disjoint, so only each
        # member's own order matters): the round's feature clamps of one SAE are one batch
        depth = max((len(sl.taps.writes.get(address, ())) for sl in members), default=0)
        for i in range(depth):
            clamps: dict[int, list[tuple[_Slice, _WriteTable]]] = defaultdict(list)
            for sl in members:
                tables = sl.taps.writes.get(address, ())
                if i >= len(tables):
                    continue
                write = tables[i].write
                if isinstance(write, FeatureWrite):
                    clamps[id(sl.taps.saes[write.sae])].append((sl, tables[i]))
                else:
                    changed |= self._apply(value, sl, tables[i], site)
            for group in clamps.values():
                began = time.perf_counter_ns()
                changed |= self._apply_features(value, group)
                self.timing["sae_ns"] += time.perf_counter_ns() - began
        readers = []
        for sl in members:
            if address in sl.taps.points:
                rows = value[sl.start : sl.end]
                if site.per_head:
                    rows = rows.reshape(rows.shape[0], -1, self.d_head)
                sl.taps.values[address].append((sl.positions, _copy(rows)))
            if address in sl.taps.readouts_at and self.rank == 0:  # the residual is whole on every rank
                readers.append(sl)
            if sl.lens_keep is not None and address in sl.taps.lens_at:  # a mask picks a copy of the rows
                rows = value[sl.start : sl.end]
                sl.lens_rows[sl.taps.lens_at[address]] = rows[sl.lens_keep.to(rows.device)]
        if readers:
            began = time.perf_counter_ns()
            self._read_features_many(readers, value, address)
            self.timing["sae_ns"] += time.perf_counter_ns() - began
        return changed

    def _math(self, sae: Sae, device: torch.device) -> SaeMath:
        """``sae``'s batched encoder (:class:`~._static.SaeMath`) on ``device``, built once."""
        key = (id(sae), str(device))
        held = self._sae_math.get(key)
        if held is None or held[0] is not sae:
            held = self._sae_math[key] = (sae, SaeMath(sae, device, onednn=True))
        return held[1]

    def _read_features_many(self, readers: list[_Slice], value: torch.Tensor, address: Address) -> None:
        """The readouts of every reader at ``address`` this step: per SAE, one encode of all
        their kept rows (keeping what the widest readout asks for) and one copy to the CPU;
        only the readouts are kept."""
        keeps = [sl.positions >= sl.taps.first_readout for sl in readers]
        users: dict[int, tuple[Sae, list[int]]] = {}  # per SAE: it, and the readers reading it
        for index, sl in enumerate(readers):
            if not bool(keeps[index].any()):
                continue
            for spec in sl.taps.readouts_at[address]:
                sae = sl.taps.saes[spec.sae]
                entry = users.setdefault(id(sae), (sae, []))
                if not entry[1] or entry[1][-1] != index:
                    entry[1].append(index)
        for sae, indices in users.values():
            specs = [
                spec
                for index in indices
                for spec in readers[index].taps.readouts_at[address]
                if readers[index].taps.saes[spec.sae] is sae
            ]
            math = self._math(sae, value.device)
            width = max((spec.width(sae.d_sae) for spec in specs if spec.top_k is not None), default=1)
            dense = any(spec.top_k is None for spec in specs)
            rows = torch.cat([torch.nonzero(keeps[i]).flatten() + readers[i].start for i in indices])
            enc = math.encode(value[rows.to(value.device)], width, dense=dense)
            kept = math.kept(width)
            layout = SaeLayout(kept, complete=kept >= width or kept == sae.k, dense=dense)
            error = math.error(enc).to("cpu") if math.has_error else None
            top, ids = enc.top[:, :kept].to("cpu"), enc.ids[:, :kept].to("cpu")
            features = enc.features.to("cpu") if dense and enc.features is not None else None
            whole = {  # each distinct readout once over the batch, then each reader's rows of it
                spec: compact(
                    pick(spec, layout, sae.d_sae, math.sparse, top, ids, error, features), spec.dtype, sae.d_sae
                )
                for spec in dict.fromkeys(specs)
            }
            start = 0
            for index in indices:
                sl, keep = readers[index], keeps[index]
                count = int(keep.sum())
                part = slice(start, start + count)
                start += count
                positions = sl.positions if count == len(keep) else sl.positions[keep]
                for spec in sl.taps.readouts_at[address]:
                    if sl.taps.saes[spec.sae] is sae:
                        sl.taps.readout_values[spec].append((positions, whole[spec][part]))

    def _apply_features(self, value: torch.Tensor, group: list[tuple[_Slice, _WriteTable]]) -> bool:
        """Feature clamps (or ablations) of one SAE for several requests, in one encode (whole
        rows: the SAE's address is never sharded)."""
        rows, features, targets = [], [], []
        for sl, table in group:
            local_rows = self._picked(sl, table)
            if local_rows is None:
                continue
            write = table.write
            if not isinstance(write, FeatureWrite):
                raise BackendError(f"a plain write among feature clamps: {write!r}")
            rows.append(local_rows + sl.start)
            features.append(torch.full((len(local_rows), 1), write.feature, dtype=torch.long))
            targets.append(torch.full((len(local_rows), 1), write.value))
        if not rows:
            return False
        sl, table = group[0]
        if not isinstance(table.write, FeatureWrite):
            raise BackendError(f"a plain write among feature clamps: {table.write!r}")
        math = self._math(sl.taps.saes[table.write.sae], value.device)
        index = torch.cat(rows).to(value.device)
        current = value[index]
        enc = math.encode(current, 0, dense=math.k is None)  # no readout: keep no top features
        out = math.clamp(enc, torch.cat(features).to(value.device), torch.cat(targets).to(value.device))
        value[index] = out.reshape(current.shape).to(value.dtype)
        return True

    def _picked(self, sl: _Slice, table: _WriteTable) -> torch.Tensor | None:
        """The rows of ``sl`` (within the step's batch) that ``table``'s write touches, or ``None``."""
        positions = sl.positions
        inside = positions < sl.taps.n_total
        picked = inside.clone()
        picked[inside] = table.mask[positions[inside]]
        if not bool(picked.any()):
            return None
        return torch.nonzero(picked).flatten()

    def _local(self, table: _WriteTable, site: VllmSite, value: torch.Tensor) -> _Local | None:
        """This rank's part of a write, its vector and target on ``value``'s device (cached)."""
        if not isinstance(table.write, Write):
            raise BackendError(f"a feature write where a plain write was expected: {table.write!r}")
        key = (int(value.shape[-1]), value.device, value.dtype)
        if key not in table.local:
            write = local_write(table.write, site, self.rank, self.tp_size, self.total_heads(site), key[0])
            if write is None:
                table.local[key] = None
            else:
                target = None if write.target is None else write.target.to(value.device, value.dtype)
                table.local[key] = (write, write.vector.to(value.device, value.dtype), target)
        return table.local[key]

    def _apply(self, value: torch.Tensor, sl: _Slice, table: _WriteTable, site: VllmSite) -> bool:
        if isinstance(table.write, FeatureWrite):
            return self._apply_features(value, [(sl, table)])
        local = self._local(table, site, value)
        if local is None:
            return False
        positions = sl.positions
        local_rows = self._picked(sl, table)
        if local_rows is None:
            return False
        rows = (local_rows + sl.start).to(value.device)
        write, vec, target = local
        if write.per_position or write.target_per_position:
            picked = table.row[positions[local_rows]].to(value.device)
            if write.per_position:
                vec = vec[picked]
            if target is not None and write.target_per_position:
                target = target[picked]
        current = value[rows]
        if site.per_head:
            current = current.reshape(len(rows), -1, self.d_head)
        value[rows] = write.apply(current, vec, target).reshape(len(rows), -1).to(value.dtype)
        return True

    # -- hooks ----------------------------------------------------------------------------
    def _stream(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return hidden + residual if residual is not None else hidden.clone()

    def _layer_in(self, layer: int, hook: _Hook) -> Callable[..., Any]:
        # the layer's hidden-states argument and, where it defers the add, its residual one
        hidden_at, residual_at = self.family.hidden_arg, self.family.residual_arg

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = _arg(args, kwargs, *hidden_at)
            residual = _arg(args, kwargs, *residual_at) if residual_at is not None else None
            stream = self._stream(hidden, residual)
            rows = stream[0] if self.family.batched else stream  # a view: writes reach the stream
            changed = False
            for address, _, members in hook.ordered():
                changed |= self._visit(rows, members, address)
            for sl in hook.stash_for:
                sl.stash[layer] = rows[sl.start : sl.end].clone()
            if not changed:
                return None
            args, kwargs = _set_arg(args, kwargs, *hidden_at, stream)
            if residual is not None and residual_at is not None:
                args, kwargs = _set_arg(args, kwargs, *residual_at, torch.zeros_like(residual))
            return args, kwargs

        return pre

    def _layer_out(self, hook: _Hook) -> Callable[..., Any]:
        deferred = self.family.deferred_residual

        def post(module: nn.Module, args: Any, output: Any) -> Any:
            # a deferring layer returns (hidden, residual); others the stream (or a tuple starting with it)
            if deferred and isinstance(output, tuple):
                stream = self._stream(output[0], output[1])
            else:
                stream = (output[0] if isinstance(output, tuple) else output).clone()
            rows = stream[0] if self.family.batched else stream  # a view: writes reach the stream
            changed = False
            for address, _, members in hook.ordered():
                changed |= self._visit(rows, members, address)
            if not changed:
                return None
            if deferred and isinstance(output, tuple):
                return (stream, torch.zeros_like(output[1]), *output[2:])
            return (stream, *output[1:]) if isinstance(output, tuple) else stream

        return post

    def _input(self, module: nn.Module, layer: int, hook: _Hook, batched: bool = False) -> Callable[..., Any]:
        slots = {address: arg_slot(module, site) for address, site, _ in hook.ordered()}

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            changed = False
            for address, site, members in hook.ordered():
                if site.derived:  # attn_scores / attn_pattern, from the queries and keys
                    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
                    for sl in members:
                        if address in sl.taps.points:
                            self._attention(sl, address, q[sl.start : sl.end], k[sl.start : sl.end])
                    continue
                index, name = slots[address]
                value = _arg(args, kwargs, index, name)
                writes = any(address in sl.taps.writes for sl in members)
                if writes:  # never write into vLLM's own (possibly shared) tensors
                    value = value.clone(memory_format=torch.contiguous_format)
                if self._visit(flat(value[0] if batched else value), members, address):
                    args, kwargs = _set_arg(args, kwargs, index, name, value)
                    changed = True
            return (args, kwargs) if changed else None

        return pre

    def _output(self, layer: int, hook: _Hook, batched: bool = False) -> Callable[..., Any]:
        def post(module: nn.Module, args: Any, output: Any) -> Any:
            value = output[0] if isinstance(output, tuple) else output
            # the next fused norm works in place on this tensor
            value = value.clone(memory_format=torch.contiguous_format)
            rows = flat(value[0] if batched else value)
            changed = False
            routed: tuple[torch.Tensor, torch.Tensor] | None = None
            for address, site, members in hook.ordered():
                if site.kind == "resid_mid":
                    changed |= self._mid(rows, members, layer)
                elif site.routed is not None:  # vLLM's routing of the router's logits, after any write there
                    if routed is None:
                        routed = self.route(layer, args[0] if args else rows, rows)
                    self._record_routing(routed, members, address)
                else:
                    part = part_of(rows, columns(site, self.family))
                    factor = added_scale(site, self.family)
                    if factor == 1.0:
                        changed |= self._visit(part, members, address)
                    else:  # the value as added to the residual (Granite's residual multiplier)
                        added = part * factor
                        if self._visit(added, members, address):
                            part.copy_(added / factor)
                            changed = True
            if not changed:
                return None
            return (value, *output[1:]) if isinstance(output, tuple) else value

        return post

    def _mid(self, attn_out: torch.Tensor, members: list[_Slice], layer: int) -> bool:
        """resid_mid = resid_pre + attn_out (times the layer's residual multiplier, where it has
        one); a write there moves what attention adds by the same amount."""
        address = Address("resid_mid", layer)
        scale = self.family.attn_scale
        changed = False
        for sl in members:
            mid = torch.zeros_like(attn_out)
            mid[sl.start : sl.end] = sl.stash[layer].to(attn_out.dtype) + scale * attn_out[sl.start : sl.end]
            if self._visit(mid, [sl], address):
                added = mid[sl.start : sl.end] - sl.stash[layer].to(attn_out.dtype)
                attn_out[sl.start : sl.end] = added / scale if scale != 1.0 else added
                changed = True
        return changed

    def route(self, layer: int, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert weights, expert indices)`` for router logits at ``layer``: vLLM's own routing
        function (the fused-MoE runner's router: its top-k, scoring and renormalisation)."""
        runner = _get(self.layers[layer], self.family.experts or "")
        weights, ids = runner.router.select_experts(hidden_states=hidden, router_logits=logits)
        return weights, ids

    def _record_routing(
        self, routed: tuple[torch.Tensor, torch.Tensor], members: list[_Slice], address: Address
    ) -> None:
        weights, ids = routed
        for sl in members:
            if address in sl.taps.points:
                if SITES[address.kind].routed == "ids":  # the experts' indices, int64
                    value = ids[sl.start : sl.end].to("cpu", torch.int64, copy=True)
                else:
                    value = _copy(weights[sl.start : sl.end])
                sl.taps.values[address].append((sl.positions, value))

    def _kernel_geometry(self, layer: int) -> tuple[int, float, float | None, int | None]:
        kernel = _get(self.layers[layer], self.family.attn_kernel)
        head = int(kernel.head_size)
        scale = float(getattr(kernel.impl, "scale", head**-0.5))
        cap = getattr(kernel.impl, "logits_soft_cap", None)
        window = getattr(kernel, "sliding_window", None)
        return head, scale, cap, window

    def _attention(self, sl: _Slice, address: Address, query: torch.Tensor, key: torch.Tensor) -> None:
        """Record ``attn_scores`` or ``attn_pattern`` of ``sl``'s queries from the post-rotary
        ``query`` and ``key`` rows of this step; earlier steps' keys are kept per request (once
        per step, however many of the two are asked for)."""
        layer = address.layer or 0
        head, scale, cap, window = self._kernel_geometry(layer)
        n = sl.end - sl.start
        q = query.float().reshape(n, -1, head)
        step = int(sl.taps.steps)
        seen = sl.taps.keys.get(layer)
        if seen is None or seen[2] != step:  # this step's keys are not in yet
            k = key.to("cpu", torch.float32, copy=True).reshape(n, -1, head)  # kept across steps: never a view
            if seen is not None and int(sl.positions[0]) > 0:
                key_pos, keys = torch.cat([seen[0], sl.positions]), torch.cat([seen[1], k])
            else:
                key_pos, keys = sl.positions.clone(), k
            sl.taps.keys[layer] = (key_pos, keys, step)
        key_pos, keys, _ = sl.taps.keys[layer]
        keys = keys.to(q.device).repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        q_pos = sl.positions.to(q.device)[:, None]
        k_pos = key_pos.to(q.device)[None, :]
        hidden_keys = k_pos > q_pos
        if window:
            hidden_keys |= k_pos <= q_pos - int(window)
        scores = scores.masked_fill(hidden_keys, float("-inf"))
        if address.kind == "attn_pattern":
            sinks = getattr(_get(self.layers[layer], self.family.attn_kernel).impl, "sinks", None)
            if sinks is None:
                value = scores.softmax(-1)  # [heads, q, keys], keys in position order
            else:  # one more logit per head in the softmax's denominator (gpt-oss), then dropped
                sink = sinks.float().to(scores.device)[:, None, None].expand(-1, scores.shape[1], 1)
                value = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            fill = 0.0
        else:
            value, fill = scores, float("-inf")
        full = torch.full((value.shape[0], value.shape[1], int(key_pos.max()) + 1), fill)
        full[:, :, key_pos] = value.cpu()
        sl.taps.values[address].append((sl.positions, full.permute(1, 0, 2)))

    def _read_output(self, output: Any, hook: _Hook) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        for sl in hook.members.get(Address("final_norm"), ()):
            sl.taps.values[Address("final_norm")].append((sl.positions, _copy(hidden[sl.start : sl.end])))
        for sl in hook.members.get(Address("logits_raw"), ()):  # every rank joins the gather (a TP collective)
            raw = self.unembed(hidden[sl.start : sl.end])
            sl.taps.values[Address("logits_raw")].append((sl.positions, _copy(raw)))
        for sl in hook.members.get(Address("logits"), ()):  # every rank computes logits (a TP collective)
            logits = self.model.compute_logits(hidden[sl.start : sl.end])  # type: ignore[operator]
            sl.taps.values[Address("logits")].append((sl.positions, _copy(logits)))

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The bare unembedding of final-norm outputs: what vLLM's logits processor computes
        before its soft-cap and scaling (gathered over ranks, vocabulary padding removed)."""
        processor = getattr(self.model, "logits_processor", None)
        head = _get(self.model, self.family.unembed)
        get_logits = getattr(processor, "_get_logits", None)
        if get_logits is None:  # pragma: no cover - a vLLM without it
            raise RuntimeError("this vLLM model's logits processor has no _get_logits")
        bias = getattr(head, "bias", None)  # a biased unembedding (GPT-J, Phi): part of the bare logits
        logits: torch.Tensor = get_logits(hidden, head, bias if isinstance(bias, torch.Tensor) else None)
        return logits

    # -- after the request ------------------------------------------------------------------
    def fetch(self, rid: str) -> Fetched:
        """A request's values, ordered by position (a recomputed position keeps its last
        value); then forget it."""
        began = time.perf_counter_ns()
        try:
            error = self.failed.pop(rid, None)
            values = self._collect(rid)
            return values if error is None else Fetched(error=error)
        finally:
            self.timing["fetches"] += 1
            self.timing["fetch_ns"] += time.perf_counter_ns() - began

    def _collect(self, rid: str) -> Fetched:
        taps = self.requests.pop(rid, None)
        self._retire(rid)
        if taps is None:
            return Fetched()
        out: dict[Address, tuple[torch.Tensor, torch.Tensor]] = {}
        for address, chunks in taps.values.items():
            positions = torch.cat([p for p, _ in chunks])
            if address.info.width == "heads x keys":  # pad the key axis: probabilities 0, scores -inf
                fill = float("-inf") if address.kind == "attn_scores" else 0.0
                width = max(v.shape[-1] for _, v in chunks)
                values = torch.cat(
                    [torch.nn.functional.pad(v, (0, width - v.shape[-1]), value=fill) for _, v in chunks]
                )
            else:
                values = torch.cat([v for _, v in chunks])
            order = torch.argsort(positions, stable=True)
            positions, values = positions[order], values[order]
            last = torch.ones_like(positions, dtype=torch.bool)
            last[:-1] = positions[1:] != positions[:-1]
            out[address] = (positions[last], values[last])
        return Fetched(out, readouts=_merged_readouts(taps), lens=merge_lens(taps.lens_values))

    def drain(self, rid: str) -> Fetched:
        """A streaming request's readouts so far (then dropped here); the request lives on."""
        error = self.failed.get(rid)
        if error is not None:
            return Fetched(error=error)
        taps = self.requests.get(rid)
        if taps is None:
            return Fetched()
        merged = _merged_readouts(taps)
        taps.readout_values.clear()
        lens = merge_lens(taps.lens_values)
        taps.lens_values.clear()
        return Fetched(readouts=merged, lens=lens)

    def release(self, rid: str) -> None:
        self.failed.pop(rid, None)
        self.requests.pop(rid, None)
        self._retire(rid)

    def _retire(self, rid: str) -> None:
        self.retired[rid] = None
        while len(self.retired) > 4096:
            self.retired.popitem(last=False)

    def stats(self) -> dict[str, int]:
        """How many requests hold state in this worker and how many SAEs it holds (for leak
        checks), and vLLM's and Dynamo's compilation counters (for recompilation checks)."""
        out = {"live_requests": len(self.requests), "saes": len(self.saes), **self.timing}
        try:
            from vllm.compilation.counter import compilation_counter

            out.update({f"vllm_{k}": int(v) for k, v in vars(compilation_counter).items() if isinstance(v, int)})
        except ImportError:  # pragma: no cover - vLLM without the compilation package
            pass
        from torch._dynamo.utils import counters

        out["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
        out["dynamo_calls_captured"] = int(counters["stats"]["calls_captured"])
        return out

    def decode(self, residuals: torch.Tensor) -> torch.Tensor | None:
        """Final norm + the served unembedding (gathered over tensor-parallel ranks); ``None`` on
        a pipeline stage before the last, which holds neither."""
        if not self.last_stage:
            return None
        param = next(self.model.parameters())
        norm = _get(self.model, self.family.final_norm)
        with torch.inference_mode():
            x = residuals.to(device=param.device, dtype=param.dtype)
            logits: torch.Tensor = self.model.compute_logits(norm(x))  # type: ignore[operator]
        return logits.to("cpu", torch.float32)


def _merged_readouts(taps: RequestTaps) -> dict[Features, tuple[torch.Tensor, FeatureReadout]]:
    """Each readout's chunks in position order (a recomputed position keeps its last value)."""
    out = {}
    for spec, chunks in taps.readout_values.items():
        positions = torch.cat([p for p, _ in chunks])
        parts = [r for _, r in chunks]
        values = torch.cat([r.values for r in parts])
        ids = None if parts[0].ids is None else torch.cat([r.ids for r in parts if r.ids is not None])
        errors = [r.error_norm for r in parts if r.error_norm is not None]
        error = torch.cat(errors) if len(errors) == len(parts) else None
        order = torch.argsort(positions, stable=True)
        positions = positions[order]
        last = torch.ones_like(positions, dtype=torch.bool)
        last[:-1] = positions[1:] != positions[:-1]
        keep = order[last]
        out[spec] = (
            positions[last],
            FeatureReadout(values[keep], None if ids is None else ids[keep], None if error is None else error[keep]),
        )
    return out
