"""Captured rows, written where they go: a request's region of the front end's slab
(:mod:`._buffers`), or, without one, a float32 CPU chunk kept until the fetch.

Per hook and address, :meth:`CaptureTaps._capture` writes the rows of every request capturing
there with one batched index per slab segment: the slab rows are each request's first row plus
the absolute positions of its rows in the step (one tensor expression over the step's positions,
no loop over rows), and the source is the step's value itself where the requests' rows are one
run of the batch (else one gather of them).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from interp_engine import Address, BackendError

from ._buffers import Region, SlabWriter
from ._request_taps import Slice
from ._sites import SITES, VllmSite, owned_heads
from ._tap_base import TapBase
from .hooks import copy_rows


class CaptureTaps(TapBase):
    """Where captured rows are written."""

    writer: SlabWriter

    def _capture(self, address: Address, value: torch.Tensor, members: list[Slice], base: int = 0) -> None:
        """Record ``members``' rows of ``value`` at ``address``. Row ``r`` of ``value`` is row
        ``r + base`` of the step's batch (``base``: a value computed for one request's rows)."""
        site = SITES[address.kind]
        to_slab: dict[str, list[tuple[Slice, Region]]] = defaultdict(list)
        for sl in members:
            region = sl.taps.regions.get(address)
            if region is None:
                sl.taps.values[address].append((sl.positions, copy_rows(value[sl.start - base : sl.end - base])))
            elif site.shard is not None or self.rank == 0:  # a replicated value: rank 0 writes it
                to_slab[region.segment].append((sl, region))
        began = time.perf_counter_ns()
        for group in to_slab.values():
            self._write(address, site, value, group, base)
        self.timing["copy_ns"] += time.perf_counter_ns() - began

    def _write(
        self, address: Address, site: VllmSite, value: torch.Tensor, group: list[tuple[Slice, Region]], base: int
    ) -> None:
        starts = [sl.start - base for sl, _ in group]
        lengths = [sl.end - sl.start for sl, _ in group]
        for sl, region in group:
            last = sl.span[1] if sl.span is not None else int(sl.positions.max()) + 1
            if last > region.rows:
                raise BackendError(f"position {last - 1} is past the end of its request's buffer at {address}")
        one_run = all(starts[i] + lengths[i] == starts[i + 1] for i in range(len(group) - 1))
        lo, hi = starts[0], starts[-1] + lengths[-1]
        if one_run:
            src = value[lo:hi]
            at = self.step_positions[lo + base : hi + base]
            offsets = torch.tensor(starts) - lo
        else:
            rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            src = value.index_select(0, rows.to(value.device))
            at = self.step_positions[rows + base]
            offsets = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
        # each row's request's first slab row: a step at each request's first row, summed up
        firsts = torch.tensor([region.first_row for _, region in group])
        steps = torch.zeros(at.shape[0], dtype=torch.long)
        steps[offsets] = torch.diff(firsts, prepend=firsts.new_zeros(1))
        index = steps.cumsum(0) + at
        region = group[0][1]
        block = self._block(site, tuple(src.shape[1:]), tuple(region.shape))
        if block is None and tuple(src.shape[1:]) != tuple(region.shape):
            # a row the front end did not expect (never in practice): kept as chunks instead
            for sl, _ in group:
                sl.taps.values[address].append((sl.positions, copy_rows(value[sl.start - base : sl.end - base])))
            return
        self.writer.write(region, index, src, block if block != (0, region.shape[0]) else None)
        for sl, _ in group:
            spans = sl.taps.spans[address]
            if sl.span is not None:
                spans.append(sl.span)
            else:
                spans.extend((p, p + 1) for p in sl.positions.tolist())

    def _block(self, site: VllmSite, local: tuple[int, ...], whole: tuple[int, ...]) -> tuple[int, int] | None:
        """The heads (per-head values) or columns this rank holds of a row of shape ``whole``
        (``None``: the row is not split, or ``local`` does not fit it)."""
        if self.tp_size == 1 or site.shard is None or len(local) != len(whole):
            return None
        if site.per_head:
            owned = owned_heads(self.rank, self.tp_size, self.total_heads(site))
            block = (owned[0], owned[-1] + 1)
        else:
            width = local[0]
            block = (self.rank * width, (self.rank + 1) * width)
        fits = block[1] - block[0] == local[0] and block[1] <= whole[0] and local[1:] == whole[1:]
        return block if fits else None
