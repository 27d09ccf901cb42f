"""The front end's cap on capture memory: the bytes of captured values in flight (written by the
workers, not yet fetched), reserved per request before it is submitted, with the request's regions
of the shared-memory slab (:mod:`.._transport`) where values travel that way.

A request's reservation is what its values take at most: every captured address's value shape
over all its positions (float32, as the workers keep them). A request that needs more than the
whole cap is refused with :class:`~interp_engine.CaptureMemoryExceeded`, which names the option
that raises it; one that fits waits until enough of the cap is free (its values are fetched, or
its request released), so a burst of large captures queues instead of exhausting the machine's
memory in a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Sequence

from interp_engine import Address, CaptureMemoryExceeded, ModelInfo
from interp_engine.backend import value_shape

from .._transport import Region, Slab
from ..model._sites import SITES

OPTION = "capture_memory_bytes"


def default_limit(directory: str | None) -> int:
    """A quarter of the machine's memory, and at most half of what the shared-memory directory
    has free (where captured values are written)."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    if directory is not None:
        stats = os.statvfs(directory)
        limit = min(limit, stats.f_bavail * stats.f_frsize // 2)
    return int(limit)


def needed_bytes(points: Iterable[Address], n_total: int, info: ModelInfo) -> int:
    """The most a request's captured values take: per address, its value shape at every position
    (an attention pattern's key axis as long as the request)."""
    total = 0
    for address in points:
        size = 4 * n_total
        for n in value_shape(address, info):
            size *= n
        if address.info.width == "heads x keys":
            size *= n_total
        total += size
    return total


def slab_shape(address: Address, info: ModelInfo) -> list[int] | None:
    """The row an address's values take in the slab (``None``: returned through the fetch RPC:
    attention patterns, whose key axis grows, and routing, whose ids are integers)."""
    if address.info.width == "heads x keys" or SITES[address.kind].routed is not None:
        return None
    return list(value_shape(address, info))


class CaptureMemory:
    """Bytes reserved by the requests in flight, at most ``limit``, and their regions of the
    slab (when captured values travel through shared memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.slab: Slab | None = None
        self._freed: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def reserved(
        self, points: Sequence[Address], n_total: int, info: ModelInfo
    ) -> AsyncIterator[dict[Address, Region]]:
        """Hold the memory of a request's captured values for the block (waiting for it to be
        free), and its slab regions, by address."""
        needed = needed_bytes(points, n_total, info)
        if needed <= 0:
            yield {}
            return
        if needed > self.limit:
            raise CaptureMemoryExceeded(
                f"this request's captured values need {needed} bytes and the capture memory cap is {self.limit} "
                f"bytes: capture fewer addresses or positions, or raise the cap (load_model(..., {OPTION}=N))",
                needed=needed,
                limit=self.limit,
                option=OPTION,
            )
        slabbed = [(a, shape) for a in points if (shape := slab_shape(a, info)) is not None]
        if self._freed is None:
            self._freed = asyncio.Condition()
        freed = self._freed
        shapes = [(n_total, shape) for _, shape in slabbed]
        got: list[list[Region] | None] = []

        def ready() -> bool:  # the cap has room: take the slab's regions (if any) for the request
            if self.used + needed > self.limit:
                return False
            got.append(self._regions(shapes) if self.slab is not None and shapes else [])
            return True

        async with freed:
            await freed.wait_for(ready)
            self.used += needed
        regions = got[0]
        try:
            yield {} if not regions else {a: r for (a, _), r in zip(slabbed, regions, strict=True)}
        finally:
            self.used -= needed
            if self.slab is not None and regions:
                self.slab.release(regions)  # those not read; a read one returns with its tensor
            async with freed:
                freed.notify_all()

    def _regions(self, shapes: list[tuple[int, list[int]]]) -> list[Region] | None:
        """Regions for ``shapes`` (``None``: the directory cannot hold them: their values travel
        through the RPC)."""
        slab = self.slab
        if slab is None:
            return None
        try:
            return slab.allocate(shapes)
        except OSError:
            slab.trim()
            try:
                return slab.allocate(shapes)
            except OSError:
                return None
