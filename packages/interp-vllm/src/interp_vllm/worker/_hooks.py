"""The dynamic worker's hooks: per step, one hook per site the step's requests use.

Each hook applies its requests' writes to their own rows and records their reads
(:meth:`Hooks._visit`), at the layer's input and output (the residual stream, with vLLM's
deferred residual add undone: a layer returns ``(hidden, residual)`` and the stream is their
sum; a write replaces the pair by ``(new_stream, 0)``, which the next fused add-norm turns back
into exactly ``new_stream``), at a module's input or output (a column block of a fused output),
and after the forward at the model's output. A hook that raises marks its requests failed and
leaves the forward's values as they were.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from interp_engine import Address, BackendError, FeatureWrite, Write

from ..hooks import arg_slot, arg_value, flat, forward_pre_hook, part_of, set_arg
from ..model._sites import SITES, HookKey, VllmSite, added_scale, columns, gate_activation, local_write
from ._capture import Captures
from ._recompute import Recompute
from ._request_taps import Hook, LocalWrite, Slice, WriteTable, touched_rows, touches_run
from ._saes import Saes
from ._state import TapState


class Hooks:
    """The part of the taps that builds each step's hook functions (:meth:`tap`: one per site
    the step's requests use) and what they do to each value: writes applied here, captures,
    recomputed values and SAE readouts handed to their parts. :meth:`register` puts a function
    on its module as a torch hook."""

    def __init__(self, state: TapState, captures: Captures, recompute: Recompute, saes: Saes) -> None:
        self.state = state
        self.captures = captures
        self.recompute = recompute
        self.saes = saes

    def model_out(self, output: Any, hook: Hook) -> Any:
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
        rest = Hook(members=defaultdict(list, {a: m for a, m in hook.members.items() if a != final}))
        self.recompute.read_output(output, rest)
        return output

    def tap(self, key: HookKey, hook: Hook) -> Callable[..., Any]:
        """The step's function at site ``key`` (guarded): ``fn(module, args, output)`` at a
        ``layer_out`` / ``output`` site, ``fn(module, args, kwargs)`` at a ``layer_in`` / ``input``
        one, returning ``None`` or a replacement, as a torch forward hook / pre-hook does."""
        where, attr, layer = key
        if where == "layer_in":
            return self._guarded(hook, self._layer_in(layer, hook))
        if where == "layer_out":
            return self._guarded(hook, self._layer_out(hook))
        module = self.state.module(key)
        if where == "input" and attr == "attn_kernel":  # [tokens, ...] on every model
            return self._guarded(hook, self._input(module, layer, hook))
        batched = self.state.family.batched  # HF's modules see [1, tokens, ...]
        if where == "input":
            return self._guarded(hook, self._input(module, layer, hook, batched))
        return self._guarded(hook, self._output(layer, hook, batched))

    def register(self, key: HookKey, function: Callable[..., Any]) -> Any:
        """``function`` (:meth:`tap`'s) as a torch hook on the module of site ``key``; its handle."""
        where, attr, _ = key
        module = self.state.module(key)
        if where == "layer_out" or where == "output":
            return module.register_forward_hook(function)
        if where == "input" and attr == "attn_kernel":  # called as kernel.forward(...) by some models
            return forward_pre_hook(module, function)
        return module.register_forward_pre_hook(function, with_kwargs=True)

    def _guarded(self, hook: Hook, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (a hook) that, if it raises, leaves the forward's values as they were and
        marks the hook's requests failed instead of taking vLLM's engine down."""

        timing = self.state.timing

        def guarded(*args: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return function(*args)
            except Exception as exc:
                self.state.fail([sl for members in hook.members.values() for sl in members] + hook.stash_for, exc)
                return None
            finally:
                timing["hook_ns"] += time.perf_counter_ns() - began

        return guarded

    def _visit(self, value: torch.Tensor, members: list[Slice], address: Address) -> bool:
        """Apply each member's writes at ``address`` to ``value`` (in place), then record its
        reads. Returns whether anything was written."""
        site = SITES[address.kind]
        writers: list[tuple[Slice, tuple[WriteTable, ...]]] = []
        capturing: list[Slice] = []
        readers: list[Slice] = []
        lensing: list[tuple[Slice, int]] = []
        keeping: list[Slice] = []
        whole = self.state.rank == 0  # SAE readouts: the residual is whole on every rank
        for sl in members:  # one look at each member's role here
            role = sl.taps.roles.get(address)
            if role is None:
                continue
            if role.keeps:
                keeping.append(sl)
            if role.writes:
                writers.append((sl, role.writes))
            if role.captures:
                capturing.append(sl)
            if role.reads and whole:
                readers.append(sl)
            if role.lens is not None and sl.lens_keep is not None:
                lensing.append((sl, role.lens))
        changed = self._write_all(value, writers, site) if writers else False
        for sl in keeping:  # a clamped transcoder's input, as the sublayer gets it (after the writes)
            sl.sources[address] = value[sl.start : sl.end].clone()
        if capturing:
            self.captures.capture(
                address, value.reshape(value.shape[0], -1, self.state.d_head) if site.per_head else value, capturing
            )
        for sl, index in lensing:  # a mask picks a copy of the rows
            rows = value[sl.start : sl.end]
            sl.lens_rows[index] = rows[sl.lens_keep.to(rows.device)]  # type: ignore[union-attr]
        if readers:
            began = time.perf_counter_ns()
            self.saes.read_features_many(readers, value, address)
            self.state.timing["sae_ns"] += time.perf_counter_ns() - began
        return changed

    def _write_all(
        self, value: torch.Tensor, writers: list[tuple[Slice, tuple[WriteTable, ...]]], site: VllmSite
    ) -> bool:
        """The writers' writes, write ``i`` of every writer in one round (their rows are disjoint,
        so only each writer's own order matters): a round's feature clamps of one SAE are one batch."""
        changed = False
        for i in range(max(len(tables) for _, tables in writers)):
            clamps: dict[int, list[tuple[Slice, WriteTable]]] = defaultdict(list)
            for sl, tables in writers:
                if i >= len(tables):
                    continue
                write = tables[i].write
                if isinstance(write, FeatureWrite):
                    clamps[id(sl.taps.saes[write.sae])].append((sl, tables[i]))
                else:
                    changed |= self._apply(value, sl, tables[i], site)
            for group in clamps.values():
                began = time.perf_counter_ns()
                changed |= self.saes.apply_features(value, group)
                self.state.timing["sae_ns"] += time.perf_counter_ns() - began
        return changed

    def _local(self, table: WriteTable, site: VllmSite, value: torch.Tensor) -> LocalWrite | None:
        """This rank's part of a write, its vector and target on ``value``'s device (cached)."""
        if not isinstance(table.write, Write):
            raise BackendError(f"a feature write where a plain write was expected: {table.write!r}")
        key = (int(value.shape[-1]), value.device, value.dtype)
        if key not in table.local:
            write = local_write(
                table.write, site, self.state.rank, self.state.tp_size, self.state.total_heads(site), key[0]
            )
            if write is None:
                table.local[key] = None
            else:
                target = None if write.target is None else write.target.to(value.device, value.dtype)
                table.local[key] = (write, write.vector.to(value.device, value.dtype), target)
        return table.local[key]

    def _apply(self, value: torch.Tensor, sl: Slice, table: WriteTable, site: VllmSite) -> bool:
        if isinstance(table.write, FeatureWrite):
            return self.saes.apply_features(value, [(sl, table)])
        local = self._local(table, site, value)
        if local is None:
            return False
        write, vec, target = local
        if not (write.per_position or write.target_per_position) and touches_run(sl, table):
            current = value[sl.start : sl.end]  # a view: every row of the request in this step
            if site.per_head:
                current = current.reshape(sl.end - sl.start, -1, self.state.d_head)
            value[sl.start : sl.end] = write.apply(current, vec, target).reshape(sl.end - sl.start, -1).to(value.dtype)
            return True
        positions = sl.positions
        local_rows = touched_rows(sl, table)
        if local_rows is None:
            return False
        rows = (local_rows + sl.start).to(value.device)
        if write.per_position or write.target_per_position:
            picked = table.row[positions[local_rows]].to(value.device)
            if write.per_position:
                vec = vec[picked]
            if target is not None and write.target_per_position:
                target = target[picked]
        current = value[rows]
        if site.per_head:
            current = current.reshape(len(rows), -1, self.state.d_head)
        value[rows] = write.apply(current, vec, target).reshape(len(rows), -1).to(value.dtype)
        return True

    # -- hooks ----------------------------------------------------------------------------
    def _stream(self, hidden: torch.Tensor, residual: torch.Tensor | None, writes: bool) -> torch.Tensor:
        """The residual stream: the deferred add done (a new tensor), else the layer's own tensor,
        copied only where the hook writes to it."""
        if residual is not None:
            return hidden + residual
        return hidden.clone() if writes else hidden

    def _layer_in(self, layer: int, hook: Hook) -> Callable[..., Any]:
        # the layer's hidden-states argument and, where it defers the add, its residual one
        hidden_at, residual_at = self.state.family.hidden_arg, self.state.family.residual_arg
        writes = hook.writes()

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = arg_value(args, kwargs, *hidden_at)
            residual = arg_value(args, kwargs, *residual_at) if residual_at is not None else None
            stream = self._stream(hidden, residual, writes)
            rows = stream[0] if self.state.family.batched else stream  # a view: writes reach the stream
            changed = False
            for address, _, members in hook.ordered():
                changed |= self._visit(rows, members, address)
            for sl in hook.stash_for:
                sl.stash[layer] = rows[sl.start : sl.end].clone()
            if not changed:
                return None
            args, kwargs = set_arg(args, kwargs, *hidden_at, stream)
            if residual is not None and residual_at is not None:
                args, kwargs = set_arg(args, kwargs, *residual_at, torch.zeros_like(residual))
            return args, kwargs

        return pre

    def _layer_out(self, hook: Hook) -> Callable[..., Any]:
        deferred = self.state.family.deferred_residual
        writes = hook.writes()

        def post(module: nn.Module, args: Any, output: Any) -> Any:
            # a deferring layer returns (hidden, residual); others the stream (or a tuple starting with it)
            if deferred and isinstance(output, tuple):
                stream = self._stream(output[0], output[1], writes)
            else:
                stream = self._stream(output[0] if isinstance(output, tuple) else output, None, writes)
            rows = stream[0] if self.state.family.batched else stream  # a view: writes reach the stream
            changed = False
            for address, _, members in hook.ordered():
                changed |= self._visit(rows, members, address)
            if not changed:
                return None
            if deferred and isinstance(output, tuple):
                return (stream, torch.zeros_like(output[1]), *output[2:])
            return (stream, *output[1:]) if isinstance(output, tuple) else stream

        return post

    def _input(self, module: nn.Module, layer: int, hook: Hook, batched: bool = False) -> Callable[..., Any]:
        slots = {address: arg_slot(module, site) for address, site, _ in hook.ordered()}

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            changed = False
            for address, site, members in hook.ordered():
                if site.derived:  # attn_scores / attn_pattern, from the queries and keys
                    q, k = arg_value(args, kwargs, 0, "query"), arg_value(args, kwargs, 1, "key")
                    for sl in members:
                        if address in sl.taps.points:
                            self.recompute.attention(sl, address, q[sl.start : sl.end], k[sl.start : sl.end])
                    continue
                index, name = slots[address]
                value = arg_value(args, kwargs, index, name)
                writes = any(address in sl.taps.writes for sl in members)
                if writes:  # never write into vLLM's own (possibly shared) tensors
                    value = value.clone(memory_format=torch.contiguous_format)
                if self._visit(flat(value[0] if batched else value), members, address):
                    args, kwargs = set_arg(args, kwargs, index, name, value)
                    changed = True
            return (args, kwargs) if changed else None

        return pre

    def _output(self, layer: int, hook: Hook, batched: bool = False) -> Callable[..., Any]:
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
                        routed = self.recompute.route(layer, args[0] if args else rows, rows)
                    self.recompute.record_routing(routed, members, address)
                elif site.activated:  # read only: act(gate), through the family's own activation
                    self._visit(
                        gate_activation(self.state.gate_act(layer), part_of(rows, columns(site, self.state.family))),
                        members,
                        address,
                    )
                else:
                    part = part_of(rows, columns(site, self.state.family))
                    factor = added_scale(site, self.state.family)
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

    def _mid(self, attn_out: torch.Tensor, members: list[Slice], layer: int) -> bool:
        """resid_mid = resid_pre + attn_out (times the layer's residual multiplier, where it has
        one); a write there moves what attention adds by the same amount."""
        address = Address("resid_mid", layer)
        scale = self.state.family.attn_scale
        changed = False
        for sl in members:
            mid = torch.zeros_like(attn_out)
            mid[sl.start : sl.end] = sl.stash[layer].to(attn_out.dtype) + scale * attn_out[sl.start : sl.end]
            if self._visit(mid, [sl], address):
                added = mid[sl.start : sl.end] - sl.stash[layer].to(attn_out.dtype)
                attn_out[sl.start : sl.end] = added / scale if scale != 1.0 else added
                changed = True
        return changed
