"""The worker side of vllm-static: the per-step host work around the compiled taps.

The taps, write tables and SAEs traced into the compiled graph are :class:`~._compiled.CompiledTaps`
(:mod:`._compiled`), built when the :class:`StaticTapManager` is, right after the model runner
loads the model and before vLLM compiles it.

Host work per step happens in :meth:`StaticTapManager._step`: fill the indices from each request's
slot plan (slots are held for the request's whole life, allocated when it first appears) and
each SAE's per-token clamps, run the compiled forward, read each capturing request's rows out of
the buffers and each reading request's readouts out of its SAEs' (only the readouts, compacted
as the dynamic worker's, ever leave the worker).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import defaultdict
from typing import Any

import msgspec
import torch

from interp_engine import Address, FeatureWrite, Write, load_sae
from interp_engine.backend import write_positions

from .. import _compat
from .._wire import (
    CONFIG_KEY,
    SERVE_KEY,
    Fetched,
    RequestPayload,
    StaticDeclaration,
    compact,
    from_wire,
    serve_declaration,
    to_wire,
)
from ..model._sites import ROUTER_KIND, SITES, owned_heads
from ..worker._manager import TapManager
from ..worker._request_taps import Hook, RequestTaps, Slice
from ..worker._runner import Step, StepBatch
from ._compiled import CompiledTaps
from ._taps import plan_writes

logger = logging.getLogger(__name__)


def static_config(runner: Any) -> StaticDeclaration | None:
    """The engine's vllm-static declaration (``None``: a ``vllm`` engine): the backend's, or the
    one a ``vllm serve`` declares in ``--additional-config`` (:func:`~.._wire.serve_declaration`).
    A served declaration is written back under :data:`~.._wire.CONFIG_KEY` in this process's copy
    of the config with each SAE's digest, so vLLM's compile-cache key covers the SAEs the graph
    holds. One that cannot be read is logged and leaves the engine to the dynamic taps (the
    plugin's front end reads the same declaration, refuses it with the same message and serves
    the server without interp-engine)."""
    extra = _compat.additional_config(runner)
    data = extra.get(CONFIG_KEY)
    if data is not None:
        return from_wire(StaticDeclaration, data)
    try:
        declared = serve_declaration(extra, _compat.n_layers(runner.model_config))
        if declared is None:
            return None
        saes = {
            name: msgspec.structs.replace(
                entry, digest=hashlib.sha256(load_sae(entry.path).to_bytes()).hexdigest()[:32]
            )
            for name, entry in declared.saes.items()
        }
        declared = msgspec.structs.replace(declared, saes=saes)
    except Exception as exc:
        logger.error("interp-engine: the compiled taps declared in --additional-config are not served: %s", exc)
        return None
    extra[CONFIG_KEY] = to_wire(declared)
    return declared


def served_declaration(runner: Any) -> bool:
    """Whether the engine's declaration is a ``vllm serve`` operator's (``--additional-config``)."""
    config = _compat.additional_config(runner).get(SERVE_KEY)
    return isinstance(config, dict) and config.get("static") is not None


class StaticTapManager(TapManager):
    """The fixed taps of one model runner, and their per-step host work.

    A :class:`~..worker._manager.TapManager` whose own methods it replaces: admission
    (``_admit``: write slots and clamp plans), the step loop (``_step``: fill the indices, run
    the compiled forward, read the buffers) and the front end's ``fetch``, ``release`` and
    ``stats`` (which free a request's slots, or add the compiled-in counts, around the parts'
    answers). It adds one part, ``compiled`` (:class:`~._compiled.CompiledTaps`: the taps,
    tables and SAEs in the graph, installed when it is built); the others are the dynamic
    manager's, used as they are: its reads go through ``captures``, ``recompute`` and ``lens``;
    the shared ``state`` holds the model and the requests. Subclassing the manager, not a part,
    because everything it replaces is the manager's own: the step loop, admission and the
    answers around the fetch part."""

    def __init__(self, runner: Any, config: StaticDeclaration) -> None:
        super().__init__(runner)
        self.declaration = config
        self.compiled = CompiledTaps(self.state, config)
        # per request: per address, its write slots, the slot of each op and the op combination
        # at each position
        self.held: dict[str, dict[Address, tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
        # per request: per SAE, the feature and value clamped at each position (-1: none)
        self.clamps: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    # -- host side ---------------------------------------------------------------------------
    def heads_of(self, address: Address) -> int:
        return self.state.total_heads(SITES[address.kind])

    def _admit(self, payload: RequestPayload) -> RequestTaps:
        from interp_engine import InvalidSteering

        rid = payload.rid
        try:
            if payload.buffers:
                self.state.writer.forget_gone()
            taps = RequestTaps(payload, self.state.saes, len(self.state.layers))
        except Exception as exc:  # an SAE this engine was not built with: reported at the fetch
            self.state.failed[rid] = (
                f"this request cannot be served by this vllm-static engine: {type(exc).__name__}: {exc}"
            )
            logger.warning("interp-engine: request %s refused in the worker: %s", rid, exc)
            taps = RequestTaps(dataclasses.replace(payload, writes=(), readouts=()))
            self.held[rid] = {}
            return taps
        held: dict[Address, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        # the writes at this pipeline stage's layers (every write without pipeline parallelism)
        plain = [
            w for w in payload.writes if isinstance(w, Write) and w.address is not None and self.state.owns(w.address)
        ]
        try:
            self.clamps[rid] = self._clamp_plan(payload, taps)
            for address, plan in plan_writes(plain, taps.n_prompt, taps.n_total, self.heads_of).items():
                table = self.compiled.tables[address]
                part = None
                if table.width != plan.ops[0].width:  # a tensor-parallel shard (mlp_post)
                    part = slice(self.state.rank * table.width, (self.state.rank + 1) * table.width)
                    if any(bool(op.direction.any()) or op.capped or op.grows for op in plan.ops):
                        raise InvalidSteering(f"only add and set can be applied per shard at {address}")
                slots = table.allocate(len(plan.ops))
                for slot, op in zip(slots, plan.ops, strict=True):
                    table.fill(slot, op, part)
                slot_of = torch.tensor([0, *slots], dtype=torch.long)
                combo = plan.combo
                if address.info.per_head:  # [positions, this rank's heads]
                    owned = (
                        owned_heads(self.state.rank, self.state.tp_size, plan.heads) if self.state.tp_size > 1 else None
                    )
                    combo = combo.view(taps.n_total, plan.heads)
                    if owned is not None:
                        combo = combo[:, owned]
                held[address] = (slots, slot_of, combo)
        except Exception as exc:  # never let one request's state stop the engine
            for address, (slots, _, _) in held.items():
                self.compiled.tables[address].release(slots)
            held = {}
            self.clamps.pop(rid, None)
            self.state.failed[rid] = (
                f"this request could not be steered in the compiled graph: {type(exc).__name__}: {exc}"
            )
            logger.warning("interp-engine: request %s cannot be steered in-graph: %s", rid, exc)
        self.held[rid] = held
        return taps

    def _clamp_plan(self, payload: RequestPayload, taps: RequestTaps) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per SAE the request clamps: the feature (-1: none) and the value at each position."""
        from interp_engine import InvalidSteering

        plans: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for write in payload.writes:
            if not isinstance(write, FeatureWrite) or (
                write.address is not None and not self.state.owns(write.address)
            ):
                continue  # a clamp at a layer of another pipeline stage is applied there
            module = self.compiled.sae_modules.get(write.sae)
            if module is None or not module.clamps:
                raise InvalidSteering(f"{write.sae!r} cannot clamp features in this engine's compiled graph")
            feature, value = plans.setdefault(
                write.sae, (torch.full((taps.n_total,), -1, dtype=torch.long), torch.zeros(taps.n_total))
            )
            positions = torch.tensor(
                [p for p in write_positions(write, taps.n_prompt, taps.n_total) if p < taps.n_total], dtype=torch.long
            )
            if bool((feature[positions] >= 0).any()):
                raise InvalidSteering(f"two feature writes of {write.sae!r} at one position")
            feature[positions] = write.feature
            value[positions] = write.value
        return plans

    def _step(self, batch: StepBatch | None) -> Step:
        slices = self._slices(batch)
        self._fill_indices(slices)
        output = yield from self.state.forward()
        if slices:
            try:
                self._read(slices, output)
            except Exception as exc:  # reported at the fetch; the engine goes on
                self.state.fail(slices, exc)
            self._lens_rows(slices)
            self.lens.run(slices)
        return output

    def _lens_rows(self, slices: list[Slice]) -> None:
        """The lens layers' rows out of their ``resid_post`` taps (the front end serves the lens
        only at declared ``resid_post`` points): a layer without a tap is decoded as zeros and
        the request fails (see :meth:`~..worker._lens.Lens.run`)."""
        for sl in slices:
            if sl.lens_keep is None:
                continue
            for address, index in sl.taps.lens_at.items():
                tap = self.compiled.taps.get(address)
                if tap is None:
                    self.state.failed.setdefault(
                        sl.taps.rid, f"{address} is not a capture point of this vllm-static engine"
                    )
                    continue
                rows = tap.buffer[sl.start : sl.end]
                sl.lens_rows[index] = rows[sl.lens_keep.to(rows.device)]

    def _fill_indices(self, slices: list[Slice]) -> None:
        steering: dict[Address, list[tuple[Slice, torch.Tensor, torch.Tensor]]] = {}
        for sl in slices:
            for address, (_, slot_of, combo) in self.held.get(sl.taps.rid, {}).items():
                steering.setdefault(address, []).append((sl, slot_of, combo))
        n = self.state.step_tokens
        for address, table in self.compiled.tables.items():
            members = steering.get(address)
            if not members:
                table.set_index(None)
                continue
            per_token = table.index.shape[0] // self.compiled.max_tokens  # heads per token at a head address
            index = torch.zeros(n, per_token, dtype=torch.long)
            for sl, slot_of, combo in members:
                positions = sl.positions
                inside = positions < combo.shape[0]
                rows = torch.zeros(len(positions), per_token, dtype=torch.long)
                rows[inside] = slot_of[combo[positions[inside]]].view(-1, per_token)
                index[sl.start : sl.end] = rows
            table.set_index(index.flatten().to(table.index.device))
        for name, module in self.compiled.sae_modules.items():
            if not module.clamps:
                continue
            clamped = [
                (sl, *self.clamps[sl.taps.rid][name]) for sl in slices if name in self.clamps.get(sl.taps.rid, {})
            ]
            if not clamped:
                module.set_clamps(None)
                continue
            features = torch.full((n,), -1, dtype=torch.long)
            values = torch.zeros(n)
            for sl, feature, value in clamped:
                positions = sl.positions
                inside = positions < feature.shape[0]
                features[sl.start : sl.end][inside] = feature[positions[inside]]
                values[sl.start : sl.end][inside] = value[positions[inside]]
            on = features >= 0
            device = module.clamp_on.device
            module.set_clamps((on.to(device), features.clamp_min(0).to(device), values.to(device)))

    def _read(self, slices: list[Slice], output: Any) -> None:
        hook = Hook()
        if self.state.rank == 0:  # the SAEs' rows are whole on every rank
            self._readouts(slices)
        tapped: dict[Address, list[Slice]] = defaultdict(list)
        for sl in slices:
            for address in sl.taps.points:
                if not self.state.owns(address):  # another pipeline stage reads it
                    continue
                site = SITES[address.kind]
                if site.where == "model_out":
                    hook.add(address, sl)
                elif site.derived and site.where == "input":  # attn_scores / attn_pattern
                    q, k = self.compiled.qk[address.layer or 0]
                    self.recompute.attention(sl, address, q.buffer[sl.start : sl.end], k.buffer[sl.start : sl.end])
                elif site.routed is not None:  # vLLM's routing of the tapped (possibly written) logits
                    tap = self.compiled.taps[Address(ROUTER_KIND, address.layer)]
                    logits = tap.buffer[sl.start : sl.end]
                    self.recompute.record_routing(
                        self.recompute.route(address.layer or 0, logits, logits),
                        [Slice(sl.taps, 0, sl.end - sl.start, sl.positions)],
                        address,
                    )
                else:
                    tapped[address].append(sl)
        for address, members in tapped.items():  # every capturing request's rows at once
            buffer = self.compiled.taps[address].buffer
            if SITES[address.kind].per_head:
                buffer = buffer.view(buffer.shape[0], -1, self.state.d_head)
            self.captures.capture(address, buffer, members)
        if hook.members:
            self.recompute.read_output(output, hook)

    def _readouts(self, slices: list[Slice]) -> None:
        """This step's readouts, out of the SAEs' buffers: per SAE, one read of every reading
        request's rows and each distinct readout once, then each request's rows of it."""
        readers: dict[str, list[tuple[Slice, torch.Tensor]]] = defaultdict(list)
        for sl in slices:
            keep = sl.positions >= sl.taps.first_readout
            if not sl.taps.readouts_at or not bool(keep.any()):
                continue
            for name in dict.fromkeys(spec.sae for specs in sl.taps.readouts_at.values() for spec in specs):
                readers[name].append((sl, keep))
        for name, group in readers.items():
            module = self.compiled.sae_modules.get(name)
            if module is None:  # an SAE at a layer of another pipeline stage: read there
                continue
            rows = torch.cat([torch.nonzero(keep).flatten() + sl.start for sl, keep in group])
            wanted = [spec for sl, _ in group for specs in sl.taps.readouts_at.values() for spec in specs]
            whole = {
                spec: compact(readout, spec.dtype, module.d_sae)
                for spec, readout in module.readout(rows, [s for s in wanted if s.sae == name]).items()
            }
            start = 0
            for sl, keep in group:
                count = int(keep.sum())
                part = slice(start, start + count)
                start += count
                positions = sl.positions if count == len(keep) else sl.positions[keep]
                for specs in sl.taps.readouts_at.values():
                    for spec in specs:
                        if spec.sae == name:
                            sl.taps.readout_values[spec].append((positions, whole[spec][part]))

    # -- after the request -------------------------------------------------------------------
    def _forget(self, rid: str) -> None:
        self.clamps.pop(rid, None)
        for address, (slots, _, _) in self.held.pop(rid, {}).items():
            self.compiled.tables[address].release(slots)

    def fetch(self, rid: str) -> Fetched:
        # an error (reported to the caller, not raised here: vLLM would log it as a crash)
        # stays in self.state.failed for the base class's fetch
        self._forget(rid)
        return super().fetch(rid)

    def release(self, rid: str) -> None:
        self._forget(rid)
        super().release(rid)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["held_slots"] = sum(len(slots) for held in self.held.values() for slots, _, _ in held.values())
        out["static_taps"] = len(self.compiled.taps) + 2 * len(self.compiled.qk)
        out["static_tables"] = len(self.compiled.tables)
        out["static_saes"] = len(self.compiled.sae_modules)
        return out
