"""The worker side of vllm-static: taps and writes installed before vLLM compiles the model.

Installed right after the model runner loads the model (before ``warming_up_model()`` traces
and compiles it, and before CUDA graphs are captured), so the taps are part of the compiled
graph. Every hook is pure tensor work on buffers registered on the hooked modules:

- a capture point copies its rows into a :class:`StaticTap` buffer every step;
- a write point runs a :class:`StaticWrites` table whose per-token index the host fills
  before each step (slot 0 everywhere for tokens of unsteered requests: bit-identical);
- ``attn_pattern`` taps the post-rotary queries and keys; ``final_norm`` and ``logits`` are read
  from the forward's output, as in the dynamic backend.

Host work per step happens in :meth:`StaticTapManager.run`: fill the indices from each request's
slot plan (slots are held for the request's whole life, allocated when it first appears),
run the compiled forward, read each capturing request's rows out of the buffers.

vLLM's deferred residual is handled in-graph: a write on ``resid_pre``/``resid_post`` gives
``(where(steered, new_stream, hidden), where(steered, 0, residual))``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from interp_engine import Address, SteeringSpec

from ._static import StaticTap, StaticWrites, plan_writes
from ._wire import Fetched, RequestPayload
from ._worker import RequestTaps, TapManager, _arg, _get, _Hook, _set_arg, _Slice

logger = logging.getLogger(__name__)

CONFIG_KEY = "interp_engine_static"
"""The ``additional_config`` entry that declares the static taps (part of vLLM's compile hash)."""

# where each kind lives: (site, the module hooked relative to the decoder layer)
_SITE = {
    "embed": "layer_pre",
    "resid_pre": "layer_pre",
    "resid_post": "layer_post",
    "attn_out": "attn",
    "resid_mid": "attn",
    "mlp_out": "mlp",
    "mlp_post": "down",
    "attn_pattern": "kernel",
}
OUTPUT_KINDS = ("final_norm", "logits")
STATIC_WRITE_KINDS = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_post")
STATIC_POINT_KINDS = (*_SITE, *OUTPUT_KINDS)


def static_config(runner: Any) -> dict[str, Any] | None:
    extra = getattr(runner.vllm_config, "additional_config", None)
    return extra.get(CONFIG_KEY) if isinstance(extra, dict) else None


def _tap(module: nn.Module, name: str) -> StaticTap:
    tap: StaticTap = getattr(module, name)
    return tap


def _table(module: nn.Module, name: str) -> StaticWrites:
    table: StaticWrites = getattr(module, name)
    return table


Names = list[tuple[str | None, str | None]]
"""Per address at a site: the attribute names of its write table and of its tap (or None)."""


def _chain(module: nn.Module, names: Names, x: torch.Tensor) -> torch.Tensor:
    """Apply each address's writes, then copy it into its tap (in-graph)."""
    for write, tap in names:
        if write is not None:
            x = _table(module, write)(x)
        if tap is not None:
            _tap(module, tap)(x)
    return x


def _steered(module: nn.Module, names: Names, n: Any) -> torch.Tensor:
    """``[n, 1]``: tokens any write at this site touches this step (in-graph)."""
    masks = [_table(module, write).steered(n) for write, _ in names if write is not None]
    mask = masks[0]
    for other in masks[1:]:
        mask = mask | other
    return mask


class StaticTapManager(TapManager):
    """The fixed taps of one model runner, and their per-step host work."""

    def __init__(self, runner: Any, config: dict[str, Any]) -> None:
        super().__init__(runner)
        self.points = [Address.parse(p) for p in config.get("points", [])]
        self.write_addresses = [Address.parse(a) for a in config.get("writes", [])]
        self.slots = int(config.get("slots", 256))
        self.max_tokens = int(runner.max_num_tokens)
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.d_model = int(runner.model_config.hf_config.hidden_size)
        self.taps: dict[Address, StaticTap] = {}
        self.tables: dict[Address, StaticWrites] = {}
        self.qk: dict[int, tuple[StaticTap, StaticTap]] = {}
        self.held: dict[str, dict[Address, tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
        self.failed: dict[str, str] = {}
        self._install_static()

    # -- installation (before compilation) ------------------------------------------------
    def _install_static(self) -> None:
        by_layer: dict[int, set[str]] = {}
        for address in [*self.points, *self.write_addresses]:
            if address.kind in OUTPUT_KINDS:
                continue
            by_layer.setdefault(address.layer or 0, set()).add(address.kind)
        for layer, kinds in sorted(by_layer.items()):
            block = self.layers[layer]
            if kinds & {"embed", "resid_pre", "resid_mid"}:
                block.register_forward_pre_hook(self._layer_pre_hook(block, layer, kinds), with_kwargs=True)
            if "resid_post" in kinds:
                block.register_forward_hook(self._layer_post_hook(block, layer))
            if kinds & {"attn_out", "resid_mid"}:
                attn = _get(block, self.family.attn)
                attn.register_forward_hook(self._attn_hook(attn, layer, kinds))
            if "mlp_out" in kinds:
                mlp = _get(block, self.family.mlp)
                mlp.register_forward_hook(self._block_hook(mlp, Address("mlp_out", layer)))
            if "mlp_post" in kinds:
                down = _get(block, self.family.mlp_down)
                width = int(getattr(down, "input_size_per_partition", 0) or down.weight.shape[1])
                down.register_forward_pre_hook(self._down_hook(down, Address("mlp_post", layer), width))
            if "attn_pattern" in kinds:
                kernel = _get(block, self.family.attn_kernel)
                head = int(kernel.head_size)
                q = self._new_tap(kernel, "interp_q", int(kernel.num_heads) * head)
                k = self._new_tap(kernel, "interp_k", int(kernel.num_kv_heads) * head)
                self.qk[layer] = (q, k)
                kernel.register_forward_pre_hook(self._kernel_hook())

    def _new_tap(self, module: nn.Module, name: str, width: int) -> StaticTap:
        tap = StaticTap(self.max_tokens, width, dtype=self.dtype, device=self.device)
        setattr(module, name, tap)  # a submodule: its buffer is part of the traced model
        return tap

    def _site(self, module: nn.Module, address: Address, width: int) -> tuple[str | None, str | None]:
        """Register the table and tap of ``address`` on ``module``; their attribute names."""
        write = tap = None
        if address in self.write_addresses:
            write = f"interp_w_{address.kind}"
            table = StaticWrites(self.slots, width, self.max_tokens, dtype=self.dtype, device=self.device)
            setattr(module, write, table)
            self.tables[address] = table
        if address in self.points:
            tap = f"interp_t_{address.kind}"
            self.taps[address] = self._new_tap(module, tap, width)
        return write, tap

    # -- the hooks: tensor work only, traced into the compiled graph ------------------------
    def _layer_pre_hook(self, block: nn.Module, layer: int, kinds: set[str]) -> Callable[..., Any]:
        kinds_here = (["embed"] if layer == 0 and "embed" in kinds else []) + ["resid_pre"]
        names = [self._site(block, Address(k, None if k == "embed" else layer), self.d_model) for k in kinds_here]
        attn_path = self.family.attn
        stash = self._new_tap(_get(block, attn_path), "interp_stash", self.d_model) if "resid_mid" in kinds else None
        deferred = self.family.deferred_residual
        hidden_at = (1, "hidden_states") if deferred else (0, "hidden_states")
        writes = any(w is not None for w, _ in names)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = _arg(args, kwargs, *hidden_at)
            residual = _arg(args, kwargs, 2, "residual") if deferred else None
            stream = hidden if residual is None else hidden + residual
            new = _chain(module, names, stream)
            if stash is not None:
                _tap(_get(module, attn_path), "interp_stash")(new)
            if not writes:
                return None
            if residual is None:
                return _set_arg(args, kwargs, *hidden_at, new)
            mask = _steered(module, names, new.shape[0])
            args, kwargs = _set_arg(args, kwargs, *hidden_at, torch.where(mask, new, hidden))
            return _set_arg(args, kwargs, 2, "residual", torch.where(mask, 0.0, residual))

        return hook

    def _layer_post_hook(self, block: nn.Module, layer: int) -> Callable[..., Any]:
        names = [self._site(block, Address("resid_post", layer), self.d_model)]
        writes = names[0][0] is not None

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                hidden, residual = output[0], output[1]
                stream = hidden if residual is None else hidden + residual
                new = _chain(module, names, stream)
                if not writes:
                    return None
                if residual is None:
                    return (new, *output[1:])
                mask = _steered(module, names, new.shape[0])
                return (torch.where(mask, new, hidden), torch.where(mask, 0.0, residual), *output[2:])
            new = _chain(module, names, output)
            return new if writes else None

        return hook

    def _attn_hook(self, attn: nn.Module, layer: int, kinds: set[str]) -> Callable[..., Any]:
        out_names = [self._site(attn, Address("attn_out", layer), self.d_model)] if "attn_out" in kinds else []
        mid_names = [self._site(attn, Address("resid_mid", layer), self.d_model)] if "resid_mid" in kinds else []
        out_writes = any(w is not None for w, _ in out_names)
        mid_writes = any(w is not None for w, _ in mid_names)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            value = output[0] if isinstance(output, tuple) else output
            new = _chain(module, out_names, value)
            if mid_names:
                n = new.shape[0]
                before = _tap(module, "interp_stash").buffer[:n].to(new.dtype)
                mid = before + new.reshape(n, -1)
                moved = _chain(module, mid_names, mid)
                if mid_writes:
                    mask = _steered(module, mid_names, n)
                    new = torch.where(mask, moved - before, new.reshape(n, -1)).reshape(value.shape)
            if not (out_writes or mid_writes):
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    def _block_hook(self, module: nn.Module, address: Address) -> Callable[..., Any]:
        names = [self._site(module, address, self.d_model)]
        writes = names[0][0] is not None

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            value = output[0] if isinstance(output, tuple) else output
            new = _chain(module, names, value)
            if not writes:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    def _down_hook(self, module: nn.Module, address: Address, width: int) -> Callable[..., Any]:
        names = [self._site(module, address, width)]
        writes = names[0][0] is not None

        def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            new = _chain(module, names, args[0])
            return (new, *args[1:]) if writes else None

        return hook

    @staticmethod
    def _kernel_hook() -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            _tap(module, "interp_q")(args[0])
            _tap(module, "interp_k")(args[1])

        return hook

    # -- host side ---------------------------------------------------------------------------
    def _admit(self, payload: RequestPayload) -> RequestTaps:
        taps = RequestTaps(payload)
        rid = payload.rid
        spec = SteeringSpec(payload.writes)
        held: dict[Address, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        try:
            for address, plan in plan_writes(list(spec.writes), taps.n_prompt, taps.n_total).items():
                table = self.tables[address]
                slots = table.allocate(len(plan.ops))
                part = None
                if table.width != plan.ops[0].shift.shape[0]:  # a tensor-parallel shard (mlp_post)
                    part = slice(self.rank * table.width, (self.rank + 1) * table.width)
                for slot, op in zip(slots, plan.ops, strict=True):
                    table.fill(slot, op, part)
                slot_of = torch.tensor([0, *slots], dtype=torch.long)
                held[address] = (slots, slot_of, plan.combo)
        except Exception as exc:  # never let one request's state stop the engine
            for address, (slots, _, _) in held.items():
                self.tables[address].release(slots)
            held = {}
            self.failed[rid] = f"{type(exc).__name__}: {exc}"
            logger.warning("interp-engine: request %s cannot be steered in-graph: %s", rid, exc)
        self.held[rid] = held
        return taps

    def _run(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        slices = self._slices(kwargs.get("positions"))
        self._fill_indices(slices)
        output = self._timed_forward(forward, args, kwargs)
        if slices:
            self._read(slices, output)
        return output

    def _fill_indices(self, slices: list[_Slice]) -> None:
        steering: dict[Address, list[tuple[_Slice, torch.Tensor, torch.Tensor]]] = {}
        for sl in slices:
            for address, (_, slot_of, combo) in self.held.get(sl.taps.rid, {}).items():
                steering.setdefault(address, []).append((sl, slot_of, combo))
        n = self.step_tokens
        for address, table in self.tables.items():
            members = steering.get(address)
            if not members:
                table.set_index(None)
                continue
            index = torch.zeros(n, dtype=torch.long)
            for sl, slot_of, combo in members:
                positions = sl.positions
                inside = positions < combo.shape[0]
                rows = torch.zeros(len(positions), dtype=torch.long)
                rows[inside] = slot_of[combo[positions[inside]]]
                index[sl.start : sl.end] = rows
            table.set_index(index.to(table.index.device))

    def _read(self, slices: list[_Slice], output: Any) -> None:
        for sl in slices:
            for address in sl.taps.points:
                if address.kind == "attn_pattern":
                    q, k = self.qk[address.layer or 0]
                    self._pattern(sl, address.layer or 0, q.buffer[sl.start : sl.end], k.buffer[sl.start : sl.end])
                elif address.kind not in OUTPUT_KINDS:
                    sl.taps.values[address].append((sl.positions, self.taps[address].read(sl.start, sl.end)))
        hook = _Hook()
        for sl in slices:
            for address in sl.taps.points:
                if address.kind in OUTPUT_KINDS:
                    hook.add(address, sl)
        if hook.members:
            self._read_output(output, hook)

    # -- after the request -------------------------------------------------------------------
    def _forget(self, rid: str) -> str | None:
        for address, (slots, _, _) in self.held.pop(rid, {}).items():
            self.tables[address].release(slots)
        return self.failed.pop(rid, None)

    def fetch(self, rid: str) -> Fetched:
        error = self._forget(rid)
        values = super().fetch(rid)
        if error is not None:  # reported to the caller, not raised here: vLLM would log it as a crash
            return Fetched(error=f"this request could not be steered in the compiled graph: {error}")
        return values

    def release(self, rid: str) -> None:
        self._forget(rid)
        super().release(rid)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["held_slots"] = sum(len(slots) for held in self.held.values() for slots, _, _ in held.values())
        out["static_taps"] = len(self.taps) + 2 * len(self.qk)
        out["static_tables"] = len(self.tables)
        return out
