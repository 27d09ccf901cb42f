"""The shared-memory transport of captured values, without an engine: the front end's slab
(allocation, reuse, regions that return with their tensors), the worker's batched writes into
it (positions, several requests at once, a gather where their rows are not one run, the heads a
tensor-parallel rank holds), the GPU path's staging through a stand-in CUDA runtime, and the
cap on capture memory."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections import defaultdict
from typing import Any

import pytest
import torch

from interp_engine import Address, CaptureMemoryExceeded, ModelInfo
from interp_vllm._transport import HostCopier, Region, Slab, SlabWriter, covered, new_prefix, sweep
from interp_vllm.frontend._capture_memory import CaptureMemory, needed_bytes, slab_shape
from interp_vllm.model._sites import VllmSite
from interp_vllm.worker._capture import Captures
from interp_vllm.worker._request_taps import Slice

INFO = ModelInfo(
    architecture="llama",
    n_layers=4,
    d_model=64,
    d_mlp=128,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=100,
    n_ctx=256,
    d_head=16,
)


@pytest.fixture
def slab(tmp_path: Any) -> Any:
    made = Slab(new_prefix(str(tmp_path)))
    yield made
    made.close()
    assert not os.listdir(tmp_path)


class _Taps:
    """What the capture code reads of a request's state."""

    def __init__(self, regions: dict[Address, Region]) -> None:
        self.regions = regions
        self.first_rows = {address: region.first_row for address, region in regions.items()}
        self.values: dict[Address, list[Any]] = defaultdict(list)
        self.spans: dict[Address, list[tuple[int, int]]] = defaultdict(list)


class _State:
    """What the capture part reads of the taps' shared state."""

    def __init__(self, rank: int, tp_size: int, copier: HostCopier | None) -> None:
        self.rank, self.tp_size, self.d_head = rank, tp_size, INFO.d_head
        self.n_heads, self.n_kv_heads = INFO.n_heads, INFO.n_kv_heads
        self.writer = SlabWriter(copier or HostCopier(torch.device("cpu")))
        self.timing: dict[str, int] = defaultdict(int)
        self.step_positions = torch.zeros(0, dtype=torch.long)

    def total_heads(self, site: VllmSite) -> int:
        return self.n_kv_heads if site.shard == "kv_heads" else self.n_heads


def _captures(rank: int = 0, tp_size: int = 1, copier: HostCopier | None = None) -> Captures:
    return Captures(_State(rank, tp_size, copier))  # type: ignore[arg-type]


def _step(worker: Captures, parts: list[tuple[_Taps, int, int]]) -> list[Slice]:
    """A step whose rows are ``parts``' positions ``[p0, p1)``, request after request."""
    slices, row, flat = [], 0, []
    for taps, p0, p1 in parts:
        positions = torch.arange(p0, p1)
        slices.append(Slice(taps, row, row + p1 - p0, positions, span=(p0, p1)))  # type: ignore[arg-type]
        row += p1 - p0
        flat.append(positions)
    worker.state.step_positions = torch.cat(flat)
    return slices


def test_rows_land_at_their_positions_for_every_request_at_once(slab: Slab) -> None:
    address = Address("resid_post", 1)
    a, b = (_Taps(dict(zip([address], slab.allocate([(n, [64])]), strict=True))) for n in (7, 5))
    worker = _captures()
    values = torch.randn(20, 64)
    # a prefill chunk of both, then a decode step, then a recomputed position of b
    worker.capture(address, values[:7], _step(worker, [(a, 0, 4), (b, 0, 3)]))
    worker.capture(address, values[7:9], _step(worker, [(a, 4, 5), (b, 3, 4)]))
    worker.capture(address, values[9:10], _step(worker, [(b, 3, 4)]))
    assert covered(a.spans[address]) == 5 and covered(b.spans[address]) == 4
    got_a = slab.read(a.regions[address], 5)
    got_b = slab.read(b.regions[address], 4)
    assert torch.equal(got_a, torch.cat([values[0:4], values[7:8]]))
    assert torch.equal(got_b, torch.cat([values[4:7], values[9:10]]))  # the recomputed row won
    assert not a.values and not b.values  # nothing kept as chunks


def test_rows_that_are_not_one_run_are_gathered(slab: Slab) -> None:
    address = Address("resid_post", 0)
    a, c = (_Taps(dict(zip([address], slab.allocate([(4, [64])]), strict=True))) for _ in range(2))
    worker = _captures()
    values = torch.randn(6, 64)
    slices = _step(worker, [(a, 0, 2), (_Taps({}), 0, 2), (c, 0, 2)])
    worker.capture(address, values, [slices[0], slices[2]])  # the middle request does not capture
    assert torch.equal(slab.read(a.regions[address], 2), values[0:2])
    assert torch.equal(slab.read(c.regions[address], 2), values[4:6])


def test_without_a_region_rows_are_kept_as_chunks() -> None:
    address = Address("resid_post", 0)
    taps = _Taps({})
    worker = _captures()
    values = torch.randn(3, 64, dtype=torch.float64)
    worker.capture(address, values, _step(worker, [(taps, 0, 3)]))
    positions, chunk = taps.values[address][0]
    assert torch.equal(positions, torch.arange(3)) and chunk.dtype == torch.float32


def test_a_position_past_the_region_is_refused(slab: Slab) -> None:
    address = Address("resid_post", 0)
    taps = _Taps(dict(zip([address], slab.allocate([(2, [64])]), strict=True)))
    worker = _captures()
    with pytest.raises(Exception, match="past the end"):
        worker.capture(address, torch.randn(3, 64), _step(worker, [(taps, 0, 3)]))


def test_each_tensor_parallel_rank_writes_its_heads_and_rank_0_the_replicated_values(slab: Slab) -> None:
    heads, resid = Address("attn_z", 0), Address("resid_post", 0)
    regions = dict(zip([heads, resid], slab.allocate([(3, [4, 16]), (3, [64])]), strict=True))
    whole = torch.randn(3, 4, 16)
    stream = torch.randn(3, 64)
    for rank in (0, 1):
        taps = _Taps(regions)
        worker = _captures(rank=rank, tp_size=2)
        worker.capture(heads, whole[:, 2 * rank : 2 * rank + 2], _step(worker, [(taps, 0, 3)]))
        worker.capture(resid, stream if rank == 0 else torch.zeros(3, 64), _step(worker, [(taps, 0, 3)]))
        assert (resid in taps.spans) == (rank == 0)
    assert torch.equal(slab.read(regions[heads], 3), whole)
    assert torch.equal(slab.read(regions[resid], 3), stream)


def test_a_read_region_returns_with_its_tensor_and_is_reused(slab: Slab) -> None:
    [region] = slab.allocate([(8, [64])])
    view = slab.read(region, 8)
    slab.release([region])  # read: it is the tensor's now, not the request's
    [other] = slab.allocate([(8, [64])])
    assert (other.segment, other.offset) != (region.segment, region.offset)
    slab.release([other])
    del view
    gc.collect()
    [again] = slab.allocate([(8, [64])])
    assert (again.segment, again.offset) == (region.segment, region.offset)
    slab.release([again])
    assert all(segment.used == 0 for segment in slab.segments.values())


def test_a_region_whose_tensor_went_before_its_release_is_freed_once(slab: Slab) -> None:
    """A request that drops what it read before its reservation ends (a server answer made of a
    few of the rows): the release that follows must not free the region a second time, or two
    later requests would share it."""
    [region] = slab.allocate([(8, [64])])
    view = slab.read(region, 8)
    del view
    gc.collect()  # back in the slab
    slab.release([region])  # and not again
    first, second = slab.allocate([(8, [64]), (8, [64])])
    assert (first.segment, first.offset) != (second.segment, second.offset)
    slab.release([first, second])
    assert all(segment.used == 0 for segment in slab.segments.values())


def test_a_tensor_collected_inside_the_slabs_own_allocation_does_not_deadlock(slab: Slab) -> None:
    """The garbage collector may free a read tensor while this thread is inside ``allocate``
    (which holds the slab's lock): its region is returned by the next call, not by waiting for
    the lock this thread holds."""
    [region] = slab.allocate([(8, [64])])
    view = slab.read(region, 8)
    slab.release([region])
    collected = threading.Event()
    one = slab._one

    def collecting(rows: int, shape: list[int]) -> Any:
        nonlocal view
        if view is not None:
            del view  # its finalizer runs here, inside allocate, under the lock
            view = None
            gc.collect()
            collected.set()
        return one(rows, shape)

    slab._one = collecting  # type: ignore[method-assign]
    done = threading.Event()
    worker = threading.Thread(target=lambda: (slab.allocate([(8, [64])]), done.set()), daemon=True)
    worker.start()
    assert done.wait(10), "allocate deadlocked on a tensor freed inside it"
    assert collected.is_set()
    slab._one = one  # type: ignore[method-assign]
    [again] = slab.allocate([(8, [64])])  # the collected tensor's region, returned by this call
    assert (again.segment, again.offset) == (region.segment, region.offset)


def test_regions_are_aligned_to_their_rows_and_segments_grow(slab: Slab, monkeypatch: Any) -> None:
    monkeypatch.setattr("interp_vllm._transport.SEGMENT_BYTES", 1 << 16)
    regions = slab.allocate([(3, [5]), (400, [64]), (1, [7, 3])])
    for region in regions:
        assert region.offset % region.row_bytes == 0
    assert len(slab.segments) >= 2  # 400 rows of 64 floats do not fit the first 64 KiB
    slab.release(regions)
    slab.trim()
    assert not slab.segments


def test_sweep_removes_an_engines_files(tmp_path: Any) -> None:
    prefix = new_prefix(str(tmp_path))
    for name in ("probe", "slab-1", "slab-2"):
        (tmp_path / f"{os.path.basename(prefix)}.{name}").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert sweep(prefix) == 3
    assert os.listdir(tmp_path) == ["other"]


class _Stream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait_stream(self, other: Any) -> None:
        self.log.append("wait")

    def synchronize(self) -> None:
        self.log.append("sync")


class _FakeCuda:
    """A stand-in for ``torch.cuda``: records what the copier asks of it (tensors stay on the CPU)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.side = _Stream(self.log)

    def stream_for(self, device: Any) -> _Stream:
        self.log.append("stream")
        return self.side

    def current_stream(self, device: Any) -> str:
        return "main"

    def use(self, stream: Any) -> Any:
        log = self.log

        class _Use:
            def __enter__(self) -> None:
                log.append("enter")

            def __exit__(self, *exc: Any) -> None:
                log.append("exit")

        return _Use()

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        assert stream is self.side
        self.log.append("record")

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        self.log.append("pinned")
        return torch.empty(like.shape)


def test_on_a_gpu_rows_are_staged_on_a_side_stream_and_written_once_per_step(slab: Slab) -> None:
    cuda = _FakeCuda()
    copier = HostCopier(torch.device("cuda"), cuda=cuda)  # type: ignore[arg-type]
    address = Address("resid_post", 2)
    taps = _Taps(dict(zip([address], slab.allocate([(4, [64])]), strict=True)))
    worker = _captures(copier=copier)
    values = torch.randn(4, 64)
    worker.capture(address, values[:2], _step(worker, [(taps, 0, 2)]))
    worker.capture(address, values[2:], _step(worker, [(taps, 2, 4)]))
    assert cuda.log == [
        "stream",
        "pinned",
        "wait",
        "enter",
        "exit",
        "record",
        "pinned",
        "wait",
        "enter",
        "exit",
        "record",
    ]
    assert not torch.equal(slab.read(taps.regions[address], 4)[:2], values[:2])  # not written before the step ends
    copier.step_done()
    assert cuda.log[-1] == "sync"
    assert torch.equal(slab.read(taps.regions[address], 4), values)
    copier.step_done()  # nothing staged: no second synchronisation
    assert cuda.log.count("sync") == 1


def test_needed_bytes_and_slab_shapes() -> None:
    points = [Address("resid_post", 0), Address("attn_z", 1), Address("attn_pattern", 0), Address("expert_indices", 0)]
    assert slab_shape(points[0], INFO) == [64]
    assert slab_shape(points[1], INFO) == [4, 16]
    assert slab_shape(points[2], INFO) is None  # its key axis grows: the RPC path
    assert slab_shape(points[3], INFO) is None  # integer ids: the RPC path
    assert needed_bytes(points[:3], 10, INFO) == 4 * 10 * (64 + 64 + 4 * 10)


def test_a_request_larger_than_the_cap_is_refused_and_others_wait(slab: Slab) -> None:
    points = [Address("resid_post", 0)]
    memory = CaptureMemory(limit=needed_bytes(points, 10, INFO))
    memory.slab = slab

    async def run() -> list[str]:
        with pytest.raises(CaptureMemoryExceeded) as caught:
            async with memory.reserved(points, 11, INFO):
                pass
        assert caught.value.option == "capture_memory_bytes" and caught.value.limit == memory.limit
        order: list[str] = []

        async def one(name: str) -> None:
            async with memory.reserved(points, 10, INFO) as regions:
                assert list(regions) == points
                order.append(f"{name} in")
                await asyncio.sleep(0.01)
                order.append(f"{name} out")

        await asyncio.gather(one("a"), one("b"))
        return order

    assert asyncio.run(run()) == ["a in", "a out", "b in", "b out"]
    assert memory.used == 0


def test_long_runs_are_copied_whole_beside_the_indexed_short_rows(slab: Slab) -> None:
    from interp_vllm.worker._capture import LONG_RUN

    address = Address("resid_post", 3)
    n = LONG_RUN + 4
    a, b, c = (_Taps(dict(zip([address], slab.allocate([(n + 2, [64])]), strict=True))) for _ in range(3))
    worker = _captures()
    values = torch.randn(n + 1 + n, 64)
    # a's prefill chunk (a long run), b's decode row, c's prefill chunk from position 2 on
    slices = _step(worker, [(a, 0, n), (b, 5, 6), (c, 2, n + 2)])
    rows = worker.step_rows(slices, 0)
    assert [k for k, *_ in rows.runs] == [0, 2] and rows.rest == [1]
    worker.capture(address, values, slices)
    assert torch.equal(slab.read(a.regions[address], n), values[:n])
    assert torch.equal(slab.read(b.regions[address], 6)[5], values[n])
    assert torch.equal(slab.read(c.regions[address], n + 2)[2:], values[n + 1 :])
    assert a.spans[address] == [(0, n)] and b.spans[address] == [(5, 6)] and c.spans[address] == [(2, n + 2)]


def test_a_long_run_on_a_tensor_parallel_rank_writes_its_heads_only(slab: Slab) -> None:
    from interp_vllm.worker._capture import LONG_RUN

    heads = Address("attn_z", 1)
    n = LONG_RUN
    [region] = slab.allocate([(n, [4, 16])])
    whole = torch.randn(n, 4, 16)
    for rank in (0, 1):
        taps = _Taps({heads: region})
        worker = _captures(rank=rank, tp_size=2)
        worker.capture(heads, whole[:, 2 * rank : 2 * rank + 2], _step(worker, [(taps, 0, n)]))
    assert torch.equal(slab.read(region, n), whole)


def test_on_a_gpu_a_long_run_is_staged_and_written_as_one_block(slab: Slab) -> None:
    from interp_vllm.worker._capture import LONG_RUN

    cuda = _FakeCuda()
    copier = HostCopier(torch.device("cuda"), cuda=cuda)  # type: ignore[arg-type]
    address = Address("resid_post", 0)
    n = LONG_RUN + 1
    a, b = (_Taps(dict(zip([address], slab.allocate([(n + 1, [64])]), strict=True))) for _ in range(2))
    worker = _captures(copier=copier)
    values = torch.randn(n + 1, 64)
    worker.capture(address, values, _step(worker, [(a, 1, n + 1), (b, 0, 1)]))
    assert cuda.log.count("pinned") == 2  # the short row's indexed copy and the long run's block
    assert not torch.equal(slab.read(a.regions[address], n + 1)[1:], values[:n])  # not before the step ends
    copier.step_done()
    assert torch.equal(slab.read(a.regions[address], n + 1)[1:], values[:n])
    assert torch.equal(slab.read(b.regions[address], 1), values[n:])


def test_segments_a_killed_front_end_left_are_swept_and_live_ones_kept(tmp_path: Any) -> None:
    import subprocess
    import sys

    from interp_vllm._transport import hold, sweep_orphans

    root = str(tmp_path)
    # a front end that allocates a region and is then killed: nothing of its own removes its files
    script = (
        "import os, signal, sys\n"
        "from interp_vllm._transport import Slab, hold, new_prefix\n"
        "prefix = new_prefix(sys.argv[1])\n"
        "slab = Slab(prefix, held=hold(prefix))\n"
        "slab.allocate([(4, [64])])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script, root], check=False)
    dead = set(os.listdir(root))
    assert any(name.endswith(".lock") for name in dead) and any(".slab-" in name for name in dead)
    prefix = new_prefix(root)
    live = Slab(prefix, held=hold(prefix))
    live.allocate([(4, [64])])
    mine = set(os.listdir(root)) - dead
    assert sweep_orphans(root) == len(dead)
    assert set(os.listdir(root)) == mine  # the live slab's lock and segment stay
    live.close()
    assert not os.listdir(root)
