"""Captured values in shared memory: the workers write each request's rows into a slab the front
end owns, and only metadata crosses vLLM's RPC path.

The front end keeps a slab of shared-memory segments (files in ``/dev/shm``, created with
``posix_fallocate``: a full directory is an error at the front end, never a ``SIGBUS`` in a
worker) and gives each capturing request, before it is submitted, one :class:`Region` per
captured address: ``rows`` rows of the address's whole value (float32, every head and column),
at a byte offset that is a multiple of the row's size. The payload carries the regions; in each
step a worker writes every capturing request's rows at their absolute positions
(:class:`SlabWriter`): a long run of one request's rows as one plain copy, the other requests'
rows in one ``index_copy_`` per address and segment, whatever their number; under tensor
parallelism each rank writes its own heads or columns of the row (a replicated value: rank 0
alone), and a pipeline stage writes the layers it holds. A recomputed position is written again
(it keeps its last value). The fetch answers, per address, which positions were written
(:class:`Written`); the front end hands out tensors viewing the rows in place (:meth:`Slab.read`)
and the region returns to the slab when they are freed, its pages still mapped and warm for the
next request.

Bytes copied per captured value: one, the worker's write into the slab (two where a step's
short runs of capturing rows are not one run of the batch: they are gathered first). On a GPU
the rows are gathered on the device, copied to pinned host staging buffers by non-blocking
copies on a side stream, and written into the slab once per step, after the stream is
synchronised (:class:`HostCopier`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import glob
import mmap
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

import msgspec
import torch

from interp_engine import BackendError

DTYPE = torch.float32
"""Captured values are float32 (as the chunks the RPC path returns)."""
ITEM = 4


class Region(msgspec.Struct, frozen=True, array_like=True):
    """Where one request's values at one address go: ``rows`` rows of shape ``shape`` (float32)
    from byte ``offset`` of the segment file ``segment`` (a multiple of the row's size)."""

    segment: str
    offset: int
    rows: int
    shape: list[int]

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.shape)

    @property
    def first_row(self) -> int:
        return self.offset // self.row_bytes


class Written(msgspec.Struct, frozen=True, array_like=True):
    """What a worker wrote of one address: positions ``[0, covered)`` form one run."""

    address: str
    covered: int


def row_bytes(shape: Iterable[int]) -> int:
    size = ITEM
    for n in shape:
        size *= int(n)
    return size


def directory() -> str | None:
    """The shared-memory directory of this machine (``None``: none that is writable)."""
    for candidate in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


def new_prefix(where: str) -> str:
    """A fresh path prefix for one engine's files."""
    return os.path.join(where, f"interp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def hold(prefix: str) -> int:
    """Mark ``prefix`` as in use for as long as this process lives: an exclusive ``flock`` on
    ``prefix.lock``, released by the kernel when the process ends however it ends (the returned
    descriptor stays open until then). :func:`sweep_orphans` leaves held prefixes alone."""
    fd = os.open(f"{prefix}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def sweep_orphans(where: str) -> int:
    """Unlink the files of every prefix under ``where`` whose owner died without removing them
    (a front end killed by a signal): its lock is no longer held. A lock is checked with a
    non-blocking ``flock``, which holds across PID namespaces sharing the directory. Returns how
    many files went."""
    removed = 0
    for lock in glob.glob(os.path.join(glob.escape(where), "interp-*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner is alive
            os.close(fd)
            continue
        try:
            removed += sweep(lock[: -len(".lock")])
        finally:
            os.close(fd)
    return removed


def make_probe(prefix: str) -> str:
    """A file under ``prefix`` the workers look for (:func:`sees`), removed by :func:`sweep`."""
    path = f"{prefix}.probe"
    with open(path, "wb"):
        pass
    return path


def sees(path: str | None) -> bool:
    """Whether this process sees ``path`` (a worker checking the front end's probe file)."""
    return path is not None and os.path.exists(path)


def sweep(prefix: str) -> int:
    """Unlink every file under ``prefix``."""
    removed = 0
    for path in glob.glob(glob.escape(prefix) + ".*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


def covered(spans: Iterable[tuple[int, int]]) -> int:
    """How many leading positions ``[start, stop)`` spans cover without a gap."""
    end = 0
    for start, stop in sorted(spans):
        if start > end:
            break
        end = max(end, stop)
    return end


# -- the worker's side -----------------------------------------------------------------------------
class CudaRuntime:
    """What :class:`HostCopier` uses of ``torch.cuda`` (a test passes a stand-in with the same methods)."""

    def stream_for(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=DTYPE, pin_memory=True)


class HostCopier:
    """Rows of a step's values written into slab rows: ``dst.index_copy_(0, index, src)``, or,
    where ``index`` is an int, ``src`` as one block of rows from row ``index`` (a plain copy).

    On the CPU each write runs as it is issued. On a CUDA device the source rows are gathered on
    the device on the forward's stream (a snapshot: vLLM's fused norms later work in place on
    tensors the hooks read), a side stream that waits for the gather copies them to a pinned host
    staging buffer without blocking (the transfer overlaps the rest of the forward; the snapshot
    is recorded on the side stream so its memory is not reused before the copy), and
    :meth:`step_done` synchronises the side stream once per step, after the forward, and writes
    the staged rows into the slab."""

    def __init__(self, device: torch.device, cuda: CudaRuntime | None = None) -> None:
        self.device = device
        self.cuda = cuda if cuda is not None else (CudaRuntime() if device.type == "cuda" else None)
        self.stream: Any = None
        self.staged: list[tuple[torch.Tensor, torch.Tensor | int, torch.Tensor]] = []

    def write(self, dst: torch.Tensor, index: torch.Tensor | int, src: torch.Tensor) -> None:
        if self.cuda is None:
            _put(dst, index, src)
            return
        if self.stream is None:
            self.stream = self.cuda.stream_for(self.device)
        snapshot = src.to(DTYPE, copy=True)
        host = self.cuda.pinned(snapshot)
        self.stream.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.use(self.stream):
            host.copy_(snapshot, non_blocking=True)
        self.cuda.record(snapshot, self.stream)
        self.staged.append((dst, index, host))

    def step_done(self) -> None:
        """Wait for the step's transfers and write them into the slab (once per step)."""
        if not self.staged:
            return
        self.stream.synchronize()
        staged, self.staged = self.staged, []
        for dst, index, host in staged:
            _put(dst, index, host)


def _put(dst: torch.Tensor, index: torch.Tensor | int, src: torch.Tensor) -> None:
    """``src``'s rows into ``dst`` at rows ``index`` (a tensor), or from row ``index`` on (an int)."""
    if isinstance(index, int):
        dst.narrow(0, index, src.shape[0]).copy_(src)
    else:
        dst.index_copy_(0, index, src if src.dtype == DTYPE else src.to(DTYPE))


class SlabWriter:
    """A worker's mappings of the front end's segments, and its writes into them."""

    def __init__(self, copier: HostCopier) -> None:
        self.copier = copier
        self.segments: dict[str, torch.Tensor] = {}  # path -> the whole file, uint8
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def view(self, region: Region) -> torch.Tensor:
        """The segment of ``region`` as rows of its shape (``[segment rows, *shape]``, float32)."""
        shape = tuple(region.shape)
        key = (region.segment, shape)
        view = self.views.get(key)
        if view is None:
            data = self.segments.get(region.segment)
            if data is None:
                size = os.path.getsize(region.segment)
                data = torch.from_file(region.segment, shared=True, size=size, dtype=torch.uint8)
                self.segments[region.segment] = data
            rows = data.numel() // region.row_bytes
            view = data[: rows * region.row_bytes].view(DTYPE).view(rows, *shape)
            self.views[key] = view
        return view

    def forget_gone(self) -> None:
        """Drop the mappings of segments the front end removed (their memory goes back)."""
        for path in [p for p in self.segments if not os.path.exists(p)]:
            del self.segments[path]
            for key in [k for k in self.views if k[0] == path]:
                del self.views[key]

    def write(
        self, region: Region, index: torch.Tensor | int, src: torch.Tensor, block: tuple[int, int] | None
    ) -> None:
        """``src`` rows at slab rows ``index`` of ``region``'s segment (an int: from that row on);
        ``block``: the heads (or columns) of the row this rank holds."""
        dst = self.view(region)
        if block is not None:
            dst = dst[:, block[0] : block[1]]
        self.copier.write(dst, index, src)


# -- the front end's side --------------------------------------------------------------------------
SEGMENT_BYTES = 256 << 20
"""The smallest segment the slab adds (a larger region gets a segment of its own size)."""


class _Segment:
    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        with open(path, "r+b") as file:
            self.map = mmap.mmap(file.fileno(), size)
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset
        self.used = 0

    def allocate(self, length: int, align: int) -> int | None:
        for i, (start, size) in enumerate(self.free):
            offset = -(-start // align) * align
            if offset + length <= start + size:
                pieces = [(start, offset - start), (offset + length, start + size - offset - length)]
                self.free[i : i + 1] = [p for p in pieces if p[1] > 0]
                self.used += length
                return offset
        return None

    def release(self, offset: int, length: int) -> None:
        self.used -= length
        self.free.append((offset, length))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged


class Slab:
    """The front end's shared-memory segments under one prefix.

    A region is allocated for a request before it is submitted and, once its values are read
    (:meth:`read`), belongs to the tensor it became: it returns to the slab when that tensor (and
    every view of it) is freed, and is then reused, its pages already mapped in the workers. A
    region whose request never reached :meth:`read` returns at :meth:`release`. Thread-safe (a
    tensor may be freed on any thread, and by the garbage collector in the middle of any
    allocation, this slab's own included: a freed tensor's region is queued, and returned under
    the lock by whichever call holds it next). ``held``: the descriptor of the prefix's lock
    (:func:`hold`), closed with the slab."""

    def __init__(self, prefix: str, held: int | None = None) -> None:
        self.prefix = prefix
        self.held = held
        self.segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()
        self._read: set[tuple[str, int]] = set()
        self._live: set[tuple[str, int]] = set()  # allocated and not yet freed: a region is freed once
        self._dropped: collections.deque[Region] = collections.deque()  # freed tensors' regions, to return

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments.values())

    def allocate(self, shapes: list[tuple[int, list[int]]]) -> list[Region]:
        """A region per ``(rows, shape)`` (new segments as needed; ``OSError``: the directory has
        no room for one)."""
        with self._lock:
            self._return_dropped()
            regions: list[Region] = []
            try:
                for rows, shape in shapes:
                    regions.append(self._one(rows, shape))
            except BaseException:
                self._free(regions)
                raise
            return regions

    def _one(self, rows: int, shape: list[int]) -> Region:
        step = row_bytes(shape)
        length = rows * step
        for segment in self.segments.values():
            offset = segment.allocate(length, step)
            if offset is not None:
                self._live.add((segment.path, offset))
                return Region(segment.path, offset, rows, list(shape))
        segment = self._add(max(SEGMENT_BYTES, length + step))
        offset = segment.allocate(length, step)
        if offset is None:  # pragma: no cover - a fresh segment is larger than the region
            raise BackendError(f"a new slab segment of {segment.size} bytes cannot hold {length}")
        self._live.add((segment.path, offset))
        return Region(segment.path, offset, rows, list(shape))

    def _add(self, size: int) -> _Segment:
        path = f"{self.prefix}.slab-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        segment = _Segment(path, size)
        self.segments[path] = segment
        return segment

    def release(self, regions: Iterable[Region]) -> None:
        """Return the regions that were not read (their request failed or was cancelled); a read
        one whose tensor is already freed is already back."""
        with self._lock:
            self._return_dropped()
            self._free([r for r in regions if (r.segment, r.offset) not in self._read])

    def _free(self, regions: Iterable[Region]) -> None:
        for region in regions:
            key = (region.segment, region.offset)
            if key not in self._live:  # freed already: its tensor went before the request's release
                continue
            self._live.discard(key)
            self._read.discard(key)
            segment = self.segments.get(region.segment)
            if segment is not None:
                segment.release(region.offset, region.rows * region.row_bytes)

    def _dropped_tensor(self, region: Region) -> None:
        """A read region's tensor was freed: queue its region, and return it now unless a call
        holds the lock (another thread's, or this thread's own when the garbage collector runs
        inside it), which returns it before it next allocates or releases."""
        self._dropped.append(region)
        if self._lock.acquire(blocking=False):
            try:
                self._return_dropped()
            finally:
                self._lock.release()

    def _return_dropped(self) -> None:
        while self._dropped:
            self._free([self._dropped.popleft()])

    def read(self, region: Region, n: int) -> torch.Tensor:
        """``region``'s first ``n`` rows, as a tensor viewing the slab (nothing is copied); the
        region is the tensor's until it is freed."""
        import numpy as np

        segment = self.segments[region.segment]
        with self._lock:
            self._read.add((region.segment, region.offset))
        count = n * region.row_bytes // ITEM
        array = np.frombuffer(segment.map, dtype=np.float32, count=count, offset=region.offset)
        weakref.finalize(array, self._dropped_tensor, region)
        return torch.from_numpy(array).view(n, *region.shape)

    def trim(self) -> None:
        """Remove the segments nothing is allocated in."""
        with self._lock:
            self._return_dropped()
            for path in [p for p, s in self.segments.items() if s.used == 0]:
                del self.segments[path]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self) -> None:
        """Unlink every segment (tensors still viewing one keep its memory until they are freed),
        then the prefix's lock."""
        with self._lock:
            for path in list(self.segments):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.segments.clear()
            if self.held is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self.prefix}.lock")
                os.close(self.held)
                self.held = None
