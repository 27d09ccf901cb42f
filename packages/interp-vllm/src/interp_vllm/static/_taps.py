"""Taps and writes made only of tensors, for compiled graphs and CUDA graphs (vllm-static).

A compiled graph (torch.compile, CUDA graph capture) freezes Python control flow at trace time,
so everything that changes per request must live in tensors the host fills before each step:

- :class:`StaticTap` copies the rows it sees into a fixed buffer (``max_tokens x width``),
  allocated before compilation; after the step the host reads each request's real rows.
- :class:`StaticWrites` applies per-token writes from slot tables: token ``t`` uses slot
  ``s = index[t]`` and goes through the core's fixed pipeline that covers every op
  (:class:`~interp_engine.backend.Pipeline`, evaluated by
  :func:`~interp_engine.backend.run_stages` on row ``s`` of each table): an affine map
  ``keep*x + (x.u)m + shift`` (add, set, ablate, rescale, swap), a cap along one direction, a
  norm-scaled add (norm_add, its ``max_fraction`` folded in on the host), and at
  ``router_logits`` entries banned to ``-inf``. The tables are the pipeline's fields
  (:data:`~interp_engine.backend.PIPELINE_TABLES`), one row per slot. Slot 0 is the identity
  and a token at slot 0 gets ``x`` itself back (a ``where``), bit for bit.

Several writes at one address and token compose into one slot (:func:`compose`, each op's fold
in the core's op registry, through :meth:`Pipeline.then <interp_engine.backend.Pipeline.then>`);
a sequence with no such slot (two projections along different directions, a projection after a
cap, two norm_adds, ...) is refused with ``InvalidSteering``. At a head address a "token" is
one head of one token: the table's rows are ``d_head`` wide and its index has one entry per
(token, head). Changing a slot only fills buffers allocated before compilation: it never
recompiles.

Both are ``nn.Module`` s whose ``forward`` is pure tensor work: the same objects serve vLLM's
compiled runner and ``bench/gpu_static_taps.py`` (an HF model under ``torch.cuda.CUDAGraph``).
The host side (slot allocation, :meth:`StaticWrites.fill`, :meth:`StaticWrites.set_index`)
runs between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from interp_engine import Address, InvalidSteering, Write
from interp_engine.backend import PIPELINE_TABLES, Pipeline, run_stages, write_positions


class StaticTap(nn.Module):
    """A fixed capture buffer: ``forward(x)`` copies ``x``'s rows in and returns ``x`` untouched.

    ``x`` is ``[..., tokens, *row]`` with ``width`` values per token (e.g. ``[n, heads, head]``)."""

    buffer: torch.Tensor

    def __init__(self, max_tokens: int, width: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.width = width
        self.register_buffer("buffer", torch.zeros(max_tokens, width, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.width)
        self.buffer[: rows.shape[0]].copy_(rows)
        return x

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the last step, as a float32 CPU copy."""
        return self.buffer[start:end].to("cpu", torch.float32, copy=True)


Step = tuple[Write, torch.Tensor, torch.Tensor | None]
"""A write with the row of its vector (and of its target) that applies at one unit."""


def compose(steps: Sequence[Step], width: int) -> Pipeline:
    """The single slot equal to applying ``(write, vector, target)`` steps in order (the core's algebra)."""
    op = Pipeline.identity(width)
    for write, vector, target in steps:
        op = op.then(
            write.op, write.scale, vector, target=target, lo=write.lo, hi=write.hi, max_fraction=write.max_fraction
        )
    return op


@dataclass
class SitePlan:
    """A request's writes at one address over its units (positions, or positions x heads at a
    head address, unit ``p * heads + h``): ``combo[u]`` is the slot op (1-based into ``ops``)
    unit ``u`` uses, 0 where no write touches it."""

    combo: torch.Tensor  # [n_total * heads] long
    ops: list[Pipeline]
    heads: int = 1


def _rows(per_position: bool, head_rows: int | None, m: int, k: int) -> torch.Tensor:
    """``[m, k]``: for each (position, head) a write touches, the row of a tensor (flattened to
    ``[-1, width]``) that applies there."""
    if per_position:
        return torch.arange(m * k).view(m, k)
    if head_rows is not None:
        return torch.arange(k)[None, :].expand(m, k)
    return torch.zeros(m, k, dtype=torch.long)


def _units(write: Write, n_prompt: int, n_total: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The units a write touches and, for each, the row of its vector and of its target
    (each flattened to ``[-1, width]``; target rows are 0 without a target) that apply there."""
    positions = torch.tensor([p for p in write_positions(write, n_prompt, n_total) if p < n_total], dtype=torch.long)
    selected = torch.tensor(write.heads if write.heads is not None else range(heads), dtype=torch.long)
    m, k = len(positions), len(selected)
    units = positions[:, None] * heads + selected[None, :]
    vector_rows = _rows(write.per_position, write.head_rows, m, k)
    target_rows = _rows(write.target_per_position, write.target_head_rows, m, k)
    return units.flatten(), vector_rows.flatten(), target_rows.flatten()


def plan_writes(
    writes: Sequence[Write], n_prompt: int, n_total: int, heads_of: Callable[[Address], int] | None = None
) -> dict[Address, SitePlan]:
    """Group a request's writes by address and fold each unit's writes into one slot op;
    units touched by the same writes with the same vector (and target) rows share a slot.
    ``heads_of`` gives the number of heads of a head address (per-head writes fold per head)."""
    plans: dict[Address, SitePlan] = {}
    for address in dict.fromkeys(w.address for w in writes):
        here = [w for w in writes if w.address == address]
        heads = heads_of(address) if address.info.per_head and heads_of is not None else 1
        if address.info.per_head and heads_of is None:
            raise ValueError("plan_writes needs heads_of for a head address")
        # rows 2i / 2i+1: write i's vector / target row per unit (-1: untouched)
        rows = torch.full((2 * len(here), n_total * heads), -1, dtype=torch.long)
        for i, write in enumerate(here):
            units, vector_rows, target_rows = _units(write, n_prompt, n_total, heads)
            rows[2 * i, units] = vector_rows
            rows[2 * i + 1, units] = target_rows
        keys, combo = torch.unique(rows, dim=1, return_inverse=True)
        untouched = (keys == -1).all(0)
        # renumber: untouched -> 0, the others 1..k in order of first use
        order = torch.cumsum((~untouched).long(), 0) * (~untouched).long()
        width = here[0].width
        vectors = [write.vector.reshape(-1, width) for write in here]
        targets = [None if write.target is None else write.target.reshape(-1, width) for write in here]
        ops = []
        for column in range(keys.shape[1]):
            if untouched[column]:
                continue
            key = keys[:, column].tolist()
            steps: list[Step] = []
            for i, write in enumerate(here):
                vector_row, target_row = key[2 * i], key[2 * i + 1]
                if vector_row < 0:
                    continue
                target = targets[i]
                steps.append((write, vectors[i][vector_row], None if target is None else target[target_row]))
            ops.append(compose(steps, width))
        if ops:  # writes that touch no position of this sequence (e.g. "generated" in a capture) need nothing
            plans[address] = SitePlan(order[combo], ops, heads)
    return plans


class StaticWrites(nn.Module):
    """Per-token writes at one site from slot tables (slot 0 = no write): one buffer per field
    of :class:`~interp_engine.backend.Pipeline` (``[slots]`` for a number, ``[slots, width]``
    for a vector), one row of each per slot, evaluated by the core's
    :func:`~interp_engine.backend.run_stages`."""

    keep: torch.Tensor
    direction: torch.Tensor
    move: torch.Tensor
    shift: torch.Tensor
    cap: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    grow: torch.Tensor
    index: torch.Tensor
    ban: torch.Tensor

    def __init__(
        self,
        slots: int,
        width: int,
        max_tokens: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        bans: bool = False,
    ) -> None:
        """``bans``: the table also forces entries to ``-inf`` (a ``-inf`` router logit write)."""
        super().__init__()
        if slots < 2:
            raise ValueError("a write table needs slot 0 (identity) and at least one more")
        self.slots, self.width = slots, width

        # every buffer exists before compilation, each row the identity's; filling a slot only
        # writes into them
        identity = Pipeline.identity(width)
        for name in PIPELINE_TABLES:
            value = getattr(identity, name)
            shape = (slots, width) if isinstance(value, torch.Tensor) else (slots,)
            fill = 0.0 if isinstance(value, torch.Tensor) else value
            self.register_buffer(name, torch.full(shape, fill, dtype=dtype, device=device), persistent=False)
        self.register_buffer("index", torch.zeros(max_tokens, dtype=torch.long, device=device), persistent=False)
        self.bans = bans
        if bans:
            self.register_buffer("ban", torch.zeros(slots, width, dtype=torch.bool, device=device), persistent=False)
        self._free = list(range(slots - 1, 0, -1))
        self._dirty = 0  # index rows [0, _dirty) may be non-zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.width)
        slot = self.index[: rows.shape[0]]
        tables = {}
        for name in PIPELINE_TABLES:  # each token's row of each table; a number as [n, 1]
            table = getattr(self, name)
            tables[name] = table[slot] if table.dim() == 2 else table[slot].unsqueeze(-1)
        out = run_stages(rows, **tables, ban=self.ban[slot] if self.bans else None)
        return torch.where((slot != 0).unsqueeze(-1), out, rows).reshape(x.shape)

    def steered(self, n: int) -> torch.Tensor:
        """``[n, 1]`` bool: which of this step's first ``n`` tokens use a write (in-graph)."""
        return (self.index[:n] != 0).unsqueeze(-1)

    # -- host side, between steps -----------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise InvalidSteering(f"the write table has {len(self._free)} free slots, {count} are needed")
        return [self._free.pop() for _ in range(count)]

    def release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.fill(slot, Pipeline.identity(self.width))
            self._free.append(slot)

    def fill(self, slot: int, op: Pipeline, part: slice | None = None) -> None:
        """Write ``op`` into ``slot``; ``part`` picks this shard's columns of its vectors (only
        ``add``/``set`` reach a tensor-parallel shard: the other ops need the whole row)."""
        part = part or slice(None)
        for name in PIPELINE_TABLES:
            table, value = getattr(self, name), getattr(op, name)
            table[slot] = value[part].to(table) if isinstance(value, torch.Tensor) else value
        if self.bans:
            self.ban[slot] = False if op.ban is None else op.ban[part].to(self.ban.device)
        elif op.ban is not None:
            raise InvalidSteering("a -inf entry is only allowed in a write at router_logits")

    def set_index(self, index: torch.Tensor | None) -> None:
        """This step's slot per token (``None``: no token is steered)."""
        n = 0 if index is None else int(index.shape[0])
        if index is not None and n:
            self.index[:n].copy_(index, non_blocking=True)
        if self._dirty > n:
            self.index[n : self._dirty].zero_()
        self._dirty = n

    # -- conveniences for a single host-driven table (benchmarks, tests) ---------------------
    def clear(self) -> None:
        """Every token back to slot 0 and every slot free."""
        self.index.zero_()
        self._dirty = 0
        self.release([s for s in range(1, self.slots) if s not in self._free])

    def assign(self, write: Write, rows: torch.Tensor, vector_rows: torch.Tensor | None = None) -> None:
        """Point token ``rows`` at ``write``; ``vector_rows[i]`` picks the row of a per-position
        ``[n, width]`` vector (and target) for ``rows[i]`` (one slot per distinct row)."""
        vector, target = write.vector, write.target
        if vector.shape[-1] != self.width:
            raise InvalidSteering(f"the vector for {write.address} has width {vector.shape[-1]}, not {self.width}")
        if vector.dim() == 2 or (target is not None and target.dim() == 2):
            if vector_rows is None:
                raise InvalidSteering("a [n, width] write needs the vector row of each token")
            distinct, inverse = torch.unique(vector_rows, return_inverse=True)
            slots = self.allocate(len(distinct))
            for slot, row in zip(slots, distinct.tolist(), strict=True):
                step = (
                    write,
                    vector[row] if vector.dim() == 2 else vector,
                    None if target is None else target[row] if target.dim() == 2 else target,
                )
                self.fill(slot, compose([step], self.width))
            chosen = torch.tensor(slots)[inverse]
        else:
            (slot,) = self.allocate(1)
            self.fill(slot, compose([(write, vector, target)], self.width))
            chosen = torch.full((len(rows),), slot)
        self.index[rows.to(self.index.device)] = chosen.to(self.index.device)
        self._dirty = self.index.shape[0]
