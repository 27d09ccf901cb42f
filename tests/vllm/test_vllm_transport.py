"""Captured values through shared memory on a running engine: bit-identical to the RPC path,
regions back in the slab after every way a request ends (fetched, cancelled, failed), the cap on
capture memory as a typed error with the engine serving on, and memory flat over many large
captures."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import pytest
import torch

from interp_engine import Address, CaptureMemoryExceeded, InvalidOption, InvalidTokens, SteeringSpec, Write, load_model
from interp_testkit.suite import vllm_model_path

from ..support.engines import assert_no_leaks, started_engine

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(37)]
POINTS = [
    Address("resid_post", 0),
    Address("resid_mid", 1),
    Address("attn_z", 1),
    Address("mlp_post", 0),
    Address("attn_pattern", 1),  # the RPC path beside the slab in one request
    Address("final_norm"),
    Address("logits"),
]


def _slab(facade: Any) -> Any:
    slab = facade.model.capture_memory.slab
    assert slab is not None, "the shared engine should carry values through shared memory"
    return slab


def _settled(facade: Any) -> None:
    """Every region back in the slab and no reservation held."""
    gc.collect()
    memory = facade.model.capture_memory
    assert memory.used == 0
    assert all(segment.used == 0 for segment in _slab(facade).segments.values())


def test_values_are_bit_identical_to_the_rpc_path(vllm_engines: Any) -> None:
    shm = vllm_engines("llama")
    rpc = vllm_engines("llama", capture_transport="rpc")
    assert rpc.model.capture_memory.slab is None
    spec = SteeringSpec([Write(Address("resid_post", 0), torch.ones(shm.info.d_model), op="add")])
    for kwargs in ({}, {"steering_spec": spec}):
        a = shm.capture(PROMPT, POINTS, **kwargs)
        b = rpc.capture(PROMPT, POINTS, **kwargs)
        for point in POINTS:
            assert torch.equal(a[point], b[point]), point
    completion_a, gen_a = shm.capture_generation(PROMPT, POINTS, max_tokens=6)
    completion_b, gen_b = rpc.capture_generation(PROMPT, POINTS, max_tokens=6)
    assert completion_a.token_ids == completion_b.token_ids
    for point in POINTS:
        assert torch.equal(gen_a[point], gen_b[point]), point
    del a, gen_a
    _settled(shm)
    assert_no_leaks(shm)


def test_regions_return_after_a_cancelled_request(vllm_engines: Any) -> None:
    facade = vllm_engines("llama")
    model = facade.model

    async def cancelled() -> None:
        task = asyncio.ensure_future(model.capture_generation(PROMPT, POINTS[:2], max_tokens=200))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run_coroutine_threadsafe(cancelled(), facade._loop).result(60)
    with pytest.raises(InvalidTokens):  # refused before anything is reserved
        facade.capture([10**9], POINTS[:2])
    _settled(facade)
    assert_no_leaks(facade)
    # and it serves on
    assert facade.capture(PROMPT, POINTS[:1])[POINTS[0]].shape[0] == len(PROMPT)


def test_a_capture_larger_than_the_cap_is_a_typed_error() -> None:
    facade = started_engine(vllm_model_path("llama"), capture_memory_bytes=4096)
    try:
        with pytest.raises(CaptureMemoryExceeded) as caught:
            facade.capture(PROMPT, POINTS)
        assert caught.value.limit == 4096 and caught.value.option == "capture_memory_bytes"
        assert "capture_memory_bytes" in str(caught.value)
        small = facade.capture(PROMPT[:2], [Address("resid_post", 0)])  # 2 x d_model floats fit
        assert small[Address("resid_post", 0)].shape[0] == 2
        assert facade.generate(PROMPT, max_tokens=2).token_ids
    finally:
        facade.shutdown()


def test_bad_transport_options_are_refused() -> None:
    with pytest.raises(InvalidOption, match="capture_transport"):
        load_model(vllm_model_path("llama"), backend="vllm", capture_transport="carrier-pigeon")
    with pytest.raises(InvalidOption, match="capture_memory_bytes"):
        load_model(vllm_model_path("llama"), backend="vllm", capture_memory_bytes=-1)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
# the slab and the front end, not the model runner: 1,100 requests take minutes under V2's interpreter
@pytest.mark.runners("v1")
def test_memory_is_flat_over_a_thousand_large_captures(vllm_engines: Any) -> None:
    """1,000 captures of every layer's residual stream over 200 positions (~1.5 MB each): the
    front end's and the workers' RSS and the slab's size stay where 100 of them left them."""
    import psutil

    facade = vllm_engines("llama")
    model = facade.model
    layers = [Address("resid_post", layer) for layer in range(facade.info.n_layers)]
    prompt = (PROMPT * 6)[:200]

    async def burst(n: int) -> None:
        for _ in range(0, n, 25):  # 25 at a time, each result dropped as it comes
            results = await asyncio.gather(*(model.capture(prompt, layers) for _ in range(25)))
            assert all(r[layers[-1]].shape == (200, facade.info.d_model) for r in results)
            del results

    def run(n: int) -> None:
        asyncio.run_coroutine_threadsafe(burst(n), facade._loop).result(600)

    me = psutil.Process(os.getpid())
    workers = [p for p in me.children(recursive=True) if "VLLM::Worker" in " ".join(p.cmdline())]
    assert workers
    run(100)
    gc.collect()
    before = (me.memory_info().rss, [_rss(p.pid) for p in workers], _slab(facade).size)
    run(1000)
    gc.collect()
    after = (me.memory_info().rss, [_rss(p.pid) for p in workers], _slab(facade).size)
    assert after[2] == before[2], f"the slab grew: {before[2]} -> {after[2]} bytes"
    assert after[0] - before[0] < 64 << 20, f"front end RSS {before[0]} -> {after[0]}"
    for was, now in zip(before[1], after[1], strict=True):
        assert now - was < 64 << 20, f"worker RSS {was} -> {now}"
    _settled(facade)
    assert_no_leaks(facade)
