"""Captured rows, written where they go: a request's region of the front end's slab
(:mod:`.._transport`), or, without one, a float32 CPU chunk kept until the fetch.

Per hook and address, :meth:`Captures.capture` writes the rows of every request capturing
there into the slab: a request with a long run of rows in the step (a prefill chunk) is one
plain copy into its region; the other requests' rows (decode steps, short chunks) go in one
indexed copy per slab segment, whose slab rows are each request's first row plus the absolute
positions of its rows (one tensor expression over the step's positions, no loop over rows) and
whose source is the step's value itself where their rows are one run of the batch (else one
gather of them). Which rows go where is worked out once per step and shared by every address.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from interp_engine import Address, BackendError

from ..hooks import copy_rows
from ..model._sites import SITES, VllmSite, owned_heads
from ._request_taps import Slice
from ._state import TapState

LONG_RUN = 16
"""A request with at least this many rows in a step, at consecutive positions, is copied as one
block (a plain copy is about twice as fast as an indexed one per byte); shorter ones, decode rows
above all, go in the group's one indexed copy."""


@dataclass(frozen=True)
class StepRows:
    """Where a group of requests' rows are in one step's batch, worked out once per step and
    group and shared by every address they capture.

    ``runs``: the requests copied as one block each, as ``(index in the group, first source row,
    last source row + 1, first position)``. The others (``rest``, indices in the group) share one
    indexed copy: their source rows (one run ``[lo, hi)`` of the value, or ``gather``), each row's
    absolute position (``at``) and its request's index in ``rest`` (``owner``). Per request: the
    last position written plus one (``ends``) and the spans of positions written."""

    runs: list[tuple[int, int, int, int]]
    rest: list[int]
    lo: int
    hi: int
    gather: torch.Tensor | None
    at: torch.Tensor
    owner: torch.Tensor
    ends: list[int]
    spans: list[list[tuple[int, int]]]


class Captures:
    """The part of the taps that writes captured rows where they go (the slab writer of the
    shared :class:`~._state.TapState`, or chunks kept on the request), with the step's row
    layout per group of requests."""

    def __init__(self, state: TapState) -> None:
        self.state = state
        self._rows_of: torch.Tensor | None = None  # the step positions ``_rows`` was filled for
        self._rows: dict[tuple[int, ...], StepRows] = {}

    def capture(self, address: Address, value: torch.Tensor, members: list[Slice], base: int = 0) -> None:
        """Record ``members``' rows of ``value`` at ``address``. Row ``r`` of ``value`` is row
        ``r + base`` of the step's batch (``base``: a value computed for one request's rows)."""
        site = SITES[address.kind]
        writes_here = site.shard is not None or self.state.rank == 0  # a replicated value: rank 0 writes it
        to_slab: dict[str, list[Slice]] = {}
        for sl in members:
            region = sl.taps.regions.get(address)
            if region is None:
                sl.taps.values[address].append((sl.positions, copy_rows(value[sl.start - base : sl.end - base])))
            elif writes_here:
                group = to_slab.get(region.segment)
                if group is None:
                    to_slab[region.segment] = [sl]
                else:
                    group.append(sl)
        began = time.perf_counter_ns()
        for group in to_slab.values():
            self._write(address, site, value, group, base)
        self.state.timing["copy_ns"] += time.perf_counter_ns() - began

    def step_rows(self, group: list[Slice], base: int) -> StepRows:
        """The rows of ``group`` in this step (cached for the step: every address the group
        captures shares them)."""
        if self._rows_of is not self.state.step_positions:
            self._rows_of, self._rows = self.state.step_positions, {}
        key = (base, *map(id, group))
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = self._step_rows(group, base)
        return rows

    def _step_rows(self, group: list[Slice], base: int) -> StepRows:
        runs, rest = [], []
        ends, spans = [], []
        for k, sl in enumerate(group):
            if sl.span is not None:
                ends.append(sl.span[1])
                spans.append([sl.span])
                if sl.end - sl.start >= LONG_RUN:
                    runs.append((k, sl.start - base, sl.end - base, sl.span[0]))
                    continue
            else:
                listed = sl.positions.tolist()
                ends.append(max(listed) + 1)
                spans.append([(p, p + 1) for p in listed])
            rest.append(k)
        starts = [group[k].start - base for k in rest]
        lengths = [group[k].end - group[k].start for k in rest]
        lo, hi = (starts[0], starts[-1] + lengths[-1]) if rest else (0, 0)
        if all(starts[i] + lengths[i] == starts[i + 1] for i in range(len(rest) - 1)):
            gather = None
            at = self.state.step_positions[lo + base : hi + base]
        else:
            gather = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            at = self.state.step_positions[gather + base]
        owner = torch.repeat_interleave(torch.arange(len(rest)), torch.tensor(lengths, dtype=torch.long))
        return StepRows(runs, rest, lo, hi, gather, at, owner, ends, spans)

    def _write(self, address: Address, site: VllmSite, value: torch.Tensor, group: list[Slice], base: int) -> None:
        """``group``'s rows written into their regions at ``address`` (one segment): slab row =
        the request's first row there + the row's absolute position; one indexed copy for the
        short runs and one plain copy per long one."""
        rows = self.step_rows(group, base)
        regions = [sl.taps.regions[address] for sl in group]
        for region, end in zip(regions, rows.ends, strict=True):
            if end > region.rows:
                raise BackendError(f"position {end - 1} is past the end of its request's buffer at {address}")
        region = regions[0]
        block = self._block(site, tuple(value.shape[1:]), tuple(region.shape))
        if block is None and tuple(value.shape[1:]) != tuple(region.shape):
            # a row the front end did not expect (never in practice): kept as chunks instead
            for sl in group:
                sl.taps.values[address].append((sl.positions, copy_rows(value[sl.start - base : sl.end - base])))
            return
        if block == (0, region.shape[0]):
            block = None
        if rows.rest:
            src = (
                value[rows.lo : rows.hi] if rows.gather is None else value.index_select(0, rows.gather.to(value.device))
            )
            if len(rows.rest) == 1:
                index = rows.at + group[rows.rest[0]].taps.first_rows[address]
            else:
                firsts = torch.tensor([group[k].taps.first_rows[address] for k in rows.rest])
                index = rows.at + firsts.index_select(0, rows.owner)
            self.state.writer.write(region, index, src, block)
        for k, lo, hi, first in rows.runs:
            self.state.writer.write(region, group[k].taps.first_rows[address] + first, value[lo:hi], block)
        for sl, spans in zip(group, rows.spans, strict=True):
            sl.taps.spans[address].extend(spans)

    def _block(self, site: VllmSite, local: tuple[int, ...], whole: tuple[int, ...]) -> tuple[int, int] | None:
        """The heads (per-head values) or columns this rank holds of a row of shape ``whole``
        (``None``: the row is not split, or ``local`` does not fit it)."""
        if self.state.tp_size == 1 or site.shard is None or len(local) != len(whole):
            return None
        if site.per_head:
            owned = owned_heads(self.state.rank, self.state.tp_size, self.state.total_heads(site))
            block = (owned[0], owned[-1] + 1)
        else:
            width = local[0]
            block = (self.state.rank * width, (self.state.rank + 1) * width)
        fits = block[1] - block[0] == local[0] and block[1] <= whole[0] and local[1:] == whole[1:]
        return block if fits else None
