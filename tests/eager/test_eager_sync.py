"""The sync facade, the async methods' use of the event loop, concurrency and shutdown, on eager.

Shared session models (``eager_model``) are never shut down here; the shutdown tests load
their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InterpError,
    ModelClosed,
    RunningLoopError,
    SteeringSpec,
    StreamStep,
    SyncModel,
    Write,
    capture_attention,
    capture_generation,
    generate_stream,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import MODELS, PROMPT, hf_oracle, rel_diff, tiny_model_path

from ..support.engines import eager_model

POINTS = [Address("resid_post", 0), Address("mlp_post", 1), Address("resid_post", -1)]
PROMPTS = [
    PROMPT,
    "The capital of France is",
    "Hello world",
    "one two three four five six seven eight",
]


def _vec(seed: int, width: int = 64) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def specs() -> list[SteeringSpec | None]:
    """Four different per-request specs (one of them no steering at all)."""
    return [
        None,
        SteeringSpec([Write(Address("resid_post", 0), _vec(1), op="add", scale=4.0)]),
        SteeringSpec([Write("mlp_out.1", torch.zeros(2, 64), op="set", positions=[0, 1])]),
        SteeringSpec(
            [
                Write(Address("resid_pre", 1), _vec(3), op="ablate"),
                Write(Address("mlp_post", 1), _vec(4, 256), op="add", scale=2.0, positions="prompt"),
            ]
        ),
    ]


def assert_same(a: dict[Address, torch.Tensor], b: dict[Address, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def ids_of(prompt: str, family: str = "gpt2") -> list[int]:
    ids: list[int] = eager_model(family).to_tokens(prompt)[0].tolist()
    return ids


def own_model(family: str = "gpt2") -> Any:
    """A model of this test's own, which it may shut down."""
    return load_model(tiny_model_path(family), backend="eager")


# ---------------------------------------------------------------------------------------------
# the facade
# ---------------------------------------------------------------------------------------------


def test_sync_model_is_cached() -> None:
    model = eager_model("gpt2")
    facade = sync_model(model)
    assert isinstance(facade, SyncModel)
    assert sync_model(model) is facade
    assert sync_model(facade) is facade
    assert facade.model is model
    assert sync_model(eager_model("llama")) is not facade


def test_sync_facade_mirrors_async_methods() -> None:
    model = eager_model("gpt2")
    sync = sync_model(model)
    ids = ids_of(PROMPT)
    reference = asyncio.run(model.capture(ids, POINTS))
    assert_same(sync.capture(ids, POINTS), reference)
    completion = sync.generate(ids, max_tokens=5)
    assert len(completion.token_ids) <= 5
    gen_completion, acts = sync.capture_generation(ids, ["resid_post.1"], max_tokens=5)
    assert gen_completion == completion
    assert acts[Address("resid_post", 1)].shape == (len(ids) + len(completion.token_ids), 64)
    attn = sync.capture_attention(ids, [0, -1])
    assert attn[Address("attn_pattern", 0)].shape == (model.info.n_heads, len(ids), len(ids))
    logits = sync.decode_residuals(reference[Address("resid_post", -1)])
    assert logits.shape == (len(ids), model.info.vocab_size)
    assert sync.to_tokens(PROMPT)[0].tolist() == ids
    assert sync.to_string(ids) == model.to_string(ids)


def test_sync_facade_equals_hf() -> None:
    sync = sync_model(eager_model("gpt2"))
    ids = ids_of(PROMPT)
    acts = sync.capture(ids, ["resid_post.1"])
    with torch.no_grad():
        hidden = hf_oracle("gpt2")(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert rel_diff(acts[Address("resid_post", 1)], hidden[2][0]) <= 1e-4


# ---------------------------------------------------------------------------------------------
# refusing inside a running loop, never hanging
# ---------------------------------------------------------------------------------------------


def _in_fresh_loop_thread(body: Callable[[], Any], limit: float = 1.0) -> None:
    """Run ``asyncio.run(body())`` on a daemon thread; fail if it does not finish within ``limit``
    seconds (a deadlocked loop would otherwise hang the test run) and re-raise its failure."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(body())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    started = time.perf_counter()
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"the call hung for more than {limit} s inside a running loop"
    assert time.perf_counter() - started < limit
    if failure:
        raise failure[0]


def _refused(call: Callable[[], Any]) -> RunningLoopError:
    started = time.perf_counter()
    with pytest.raises(RunningLoopError) as info:
        call()
    assert time.perf_counter() - started < 1.0
    error = info.value
    assert isinstance(error, RuntimeError) and isinstance(error, InterpError)
    assert "running event loop" in str(error) and "await" in str(error)
    return error


def test_run_with_cache_captures_without_the_facades_loop() -> None:
    """The eager model captures blocking (``BlockingCapture``): ``run_with_cache`` calls it from
    the caller's thread, never through the facade's loop, and gets what the async path gets."""
    model = own_model()
    sync = sync_model(model)
    ids = [ids_of(p) for p in PROMPTS[:2]]
    spec = specs()[1]
    expected = asyncio.run(model.capture_batch(ids, POINTS, steering_spec=spec))

    def no_loop(make: Any) -> Any:
        raise AssertionError("run_with_cache went through the facade's event loop")

    sync.run = no_loop  # type: ignore[method-assign]
    try:
        cache = run_with_cache(model, ids, POINTS, steering_spec=spec)
    finally:
        del sync.run
    assert len(cache) == len(expected) == len(POINTS)
    for point in POINTS:
        assert torch.equal(cache[point], expected[point])
    sync.shutdown()


def _forward_threads(model: Any, call: Callable[[], Any]) -> tuple[Any, list[tuple[str, bool, bool]]]:
    """``call()``'s result and, for each forward it ran, the thread it ran on and whether inference
    mode and grad mode were on there."""
    seen: list[tuple[str, bool, bool]] = []

    def spy(module: Any, args: Any) -> None:
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    handle = model.arch.layers[0].register_forward_pre_hook(spy)
    try:
        return call(), seen
    finally:
        handle.remove()


class _SeenMode(torch.overrides.TorchFunctionMode):
    """Keeps the name of every torch function called in its thread while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_blocking_capture_runs_in_the_calling_thread_under_inference_mode() -> None:
    """With torch's per-thread state as a fresh thread has it, the forward runs in the caller's
    thread (no handoff), under inference mode whatever grad mode the caller is in."""
    model = eager_model("gpt2")
    with torch.enable_grad():
        cache, seen = _forward_threads(model, lambda: run_with_cache(model, PROMPT, ["resid_post.0"]))
    assert seen == [(threading.current_thread().name, True, False)]
    assert cache["resid_post.0"].is_inference()


@pytest.mark.parametrize("state", ["autocast", "function mode"])
def test_a_caller_under_autocast_or_a_torch_mode_is_served_on_the_worker_thread(state: str) -> None:
    """Autocast and torch-function modes are per thread: a caller in one has the forward run on the
    model's worker thread, outside it, so the values are the ones a plain call gets."""
    model = eager_model("gpt2")
    points = ["resid_post.0", "mlp_post.1"]
    plain = run_with_cache(model, PROMPT, points)
    mode = _SeenMode()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if state == "autocast" else mode
    with context:
        cache, seen = _forward_threads(model, lambda: run_with_cache(model, PROMPT, points))
    assert len(seen) == 1 and seen[0][0].startswith("interp-eager") and seen[0][1]
    forward_ops = {"layer_norm", "linear", "addmm", "scaled_dot_product_attention", "embedding"}
    assert not forward_ops & set(mode.seen)  # the mode saw none of the forward's operations
    for point in points:
        assert cache[point].dtype == torch.float32 and torch.equal(cache[point], plain[point])


def test_blocking_captures_from_four_threads_equal_serial_calls() -> None:
    model = eager_model("gpt2")
    jobs = [(ids_of(p), spec) for p, spec in zip(PROMPTS, specs(), strict=True)] * 2
    serial = [run_with_cache(model, ids, POINTS, steering_spec=spec) for ids, spec in jobs]
    barrier = threading.Barrier(4)

    def work(job: tuple[list[int], SteeringSpec | None]) -> Any:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=2)
        return run_with_cache(model, job[0], POINTS, steering_spec=job[1])

    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(work, jobs))
    for got, expected in zip(threaded, serial, strict=True):
        assert all(torch.equal(got[p], expected[p]) for p in POINTS)


def test_sync_calls_refuse_inside_a_running_loop() -> None:
    model = eager_model("gpt2")
    sync = sync_model(model)  # built outside any loop
    ids = ids_of(PROMPT)

    async def body() -> None:
        _refused(lambda: sync_model(model))
        _refused(lambda: sync.capture(ids, POINTS))
        _refused(lambda: sync.generate(ids, max_tokens=2))
        _refused(lambda: sync.warmup())
        _refused(lambda: sync.decode_residuals(torch.zeros(2, 64)))
        _refused(lambda: next(sync.stream(ids, max_tokens=2)))
        _refused(lambda: run_with_cache(model, ids, POINTS))
        _refused(lambda: capture_attention(model, ids, [0]))
        _refused(lambda: capture_generation(model, ids, POINTS, max_tokens=2))
        _refused(lambda: list(generate_stream(model, ids, max_tokens=2)))
        # the right way, on the same loop, works
        acts = await model.capture(ids, POINTS)
        assert set(acts) == set(POINTS)

    _in_fresh_loop_thread(body, limit=5.0)
    # and the facade still works afterwards
    assert_same(sync.capture(ids, POINTS), asyncio.run(model.capture(ids, POINTS)))


async def test_sync_calls_refuse_inside_pytest_loop() -> None:
    """The same refusal from a coroutine test, timed with ``asyncio.wait_for``."""
    model = eager_model("gpt2")
    sync = await asyncio.wait_for(asyncio.to_thread(sync_model, model), timeout=5)
    ids = ids_of(PROMPT)

    async def attempt() -> None:
        sync.capture(ids, POINTS)

    started = time.perf_counter()
    with pytest.raises(RunningLoopError):
        await asyncio.wait_for(attempt(), timeout=1.0)
    with pytest.raises(RunningLoopError):
        sync_model(model)
    assert time.perf_counter() - started < 1.0


def test_sync_call_from_the_facades_own_loop_is_refused() -> None:
    """A coroutine running on the facade's background loop that calls the facade would deadlock.
    (Its own model: were the refusal missing, the deadlocked loop would hang every later test.)"""
    model = own_model()
    sync = sync_model(model)
    ids = ids_of(PROMPT)

    async def reentrant() -> str:
        try:
            sync.capture(ids, POINTS)
        except RunningLoopError as exc:
            return type(exc).__name__
        return "no error"

    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(sync.run(reentrant)), daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "a facade call from the facade's own loop deadlocked"
    assert outcome == ["RunningLoopError"]

    # the facade's shutdown refuses inside a running loop too, and leaves the model whole
    async def close_inside_a_loop() -> None:
        _refused(lambda: sync.shutdown())

    _in_fresh_loop_thread(close_inside_a_loop, limit=5.0)
    assert_same(sync.capture(ids, POINTS), asyncio.run(model.capture(ids, POINTS)))
    sync.shutdown()


# ---------------------------------------------------------------------------------------------
# threads, streams
# ---------------------------------------------------------------------------------------------


def test_facade_from_four_threads_equals_serial_calls() -> None:
    sync = sync_model(eager_model("gpt2"))
    jobs = [(ids_of(p), spec) for p, spec in zip(PROMPTS, specs(), strict=True)] * 3
    serial = [sync.capture(ids, POINTS, steering_spec=spec) for ids, spec in jobs]
    serial_gen = [sync.generate(ids, max_tokens=4, steering_spec=spec) for ids, spec in jobs[:4]]
    # the four specs really do different things
    unsteered = serial[0]
    for result in serial[1:4]:
        assert not torch.equal(result[Address("resid_post", -1)], unsteered[Address("resid_post", -1)])

    barrier = threading.Barrier(4)

    def work(job: tuple[list[int], SteeringSpec | None]) -> dict[Address, torch.Tensor]:
        ids, spec = job
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=2)  # start the four threads' calls together
        return sync.capture(ids, POINTS, steering_spec=spec)

    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(work, jobs))
        threaded_gen = list(pool.map(lambda j: sync.generate(j[0], max_tokens=4, steering_spec=j[1]), jobs[:4]))
    for got, expected in zip(threaded, serial, strict=True):
        assert_same(got, expected)
    assert threaded_gen == serial_gen


def test_sync_stream_yields_steps_and_can_be_abandoned() -> None:
    model = eager_model("gpt2")
    sync = sync_model(model)
    ids = ids_of(PROMPT)
    completion = sync.generate(ids, max_tokens=6)

    steps = list(sync.stream(ids, max_tokens=6, n_logprobs=3))
    assert all(isinstance(step, StreamStep) for step in steps)
    assert [s.token_id for s in steps] == completion.token_ids
    assert "".join(s.text for s in steps) == completion.text
    assert all(len(s.logprobs) == 3 and s.logprobs[0][0] == s.token_id for s in steps)
    collected = sync.collect_steps(ids, max_tokens=6, n_logprobs=3)
    assert [(s.token_id, s.text, s.logprobs) for s in collected] == [(s.token_id, s.text, s.logprobs) for s in steps]

    # break out early, several times, with the generator dropped or still referenced
    for _ in range(3):
        for step in sync.stream(ids, max_tokens=6, n_logprobs=3):
            assert step.token_id == completion.token_ids[0]
            break
    held = sync.stream(ids, max_tokens=6)
    assert next(held).token_id == completion.token_ids[0]
    held.close()

    # later calls are unaffected
    again = list(sync.stream(ids, max_tokens=6, n_logprobs=3))
    assert [(s.token_id, s.text, s.logprobs) for s in again] == [(s.token_id, s.text, s.logprobs) for s in steps]
    assert sync.generate(ids, max_tokens=6) == completion
    assert_same(sync.capture(ids, POINTS), asyncio.run(model.capture(ids, POINTS)))
    free = list(generate_stream(model, ids, max_tokens=6, n_logprobs=3))
    assert [s.token_id for s in free] == completion.token_ids


# ---------------------------------------------------------------------------------------------
# the event loop stays free; concurrent requests stay separate
# ---------------------------------------------------------------------------------------------


@functools.cache
def long_context_model() -> Any:
    """A tiny gpt2 with room for a few hundred tokens (the shared one has ``n_ctx`` 128)."""
    from interp_testkit import build_tiny_model

    path = build_tiny_model("gpt2", MODELS / "gpt2-ctx512", n_layers=4, d_model=128, max_positions=512)
    return load_model(path, backend="eager")


async def test_async_capture_keeps_the_event_loop_free() -> None:
    model = long_context_model()
    assert model.info.n_ctx == 512
    ids = [(i * 37) % 500 + 3 for i in range(480)]
    points = ["attn_pattern.0", "attn_pattern.-1", "logits"]
    await model.warmup()

    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    ticks = 0
    started = time.perf_counter()
    for _ in range(3):
        acts = await model.capture(ids, points)
    elapsed = time.perf_counter() - started
    during = ticks
    running = False
    await task

    assert acts[Address("logits")].shape == (480, model.info.vocab_size)
    # a forward run on the loop itself would let the ticker in at most once per capture
    assert during >= 10, f"the ticker ran {during} times during {elapsed * 1000:.0f} ms of captures"


async def test_concurrent_gather_with_different_specs_equals_solo_runs() -> None:
    model = eager_model("gpt2")
    jobs = [(ids_of(p), spec) for p in PROMPTS for spec in specs()]
    together = await asyncio.gather(*(model.capture(ids, POINTS, steering_spec=spec) for ids, spec in jobs))
    for (ids, spec), got in zip(jobs, together, strict=True):
        alone = await model.capture(ids, POINTS, steering_spec=spec)
        assert_same(got, alone)
        assert got[Address("resid_post", 0)].shape == (len(ids), 64)


async def test_concurrent_generation_with_different_specs_equals_solo_runs() -> None:
    model = eager_model("llama")
    steer = SteeringSpec([Write(Address("resid_post", 1), _vec(7), op="add", scale=8.0, positions="generated")])
    jobs = [(ids_of(p, "llama"), spec) for p in PROMPTS[:3] for spec in (None, steer)]
    together = await asyncio.gather(
        *(model.capture_generation(ids, ["resid_post.2"], max_tokens=5, steering_spec=spec) for ids, spec in jobs)
    )
    for (ids, spec), (completion, acts) in zip(jobs, together, strict=True):
        alone_completion, alone_acts = await model.capture_generation(
            ids, ["resid_post.2"], max_tokens=5, steering_spec=spec
        )
        assert completion == alone_completion
        assert_same(acts, alone_acts)


# ---------------------------------------------------------------------------------------------
# shutdown
# ---------------------------------------------------------------------------------------------


async def _assert_closed(model: Any) -> None:
    ids = [1, 2, 3]
    calls: list[Callable[[], Any]] = [
        lambda: model.warmup(),
        lambda: model.capture(ids, ["resid_post.0"]),
        lambda: model.generate(ids, max_tokens=2),
        lambda: model.capture_generation(ids, ["resid_post.0"], max_tokens=2),
        lambda: model.capture_attention(ids, [0]),
        lambda: model.decode_residuals(torch.zeros(3, 64)),
    ]
    for call in calls:
        with pytest.raises(ModelClosed) as info:
            await call()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, InterpError)
        assert "shut down" in str(info.value)
    with pytest.raises(ModelClosed):
        async for _ in model.stream(ids, max_tokens=2):
            pass


async def test_shutdown_is_idempotent_and_closes_every_method() -> None:
    model = own_model()
    ids = ids_of(PROMPT)
    await model.capture(ids, POINTS)
    await model.shutdown()
    await model.shutdown()
    await _assert_closed(model)
    await model.shutdown()


async def test_shutdown_from_another_thread_and_loop() -> None:
    model = own_model()
    ids = ids_of(PROMPT)
    await model.capture(ids, POINTS)  # used on this loop
    thread = threading.Thread(target=lambda: asyncio.run(model.shutdown()), daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive()
    await _assert_closed(model)
    await model.shutdown()  # and again, on this loop


def test_shutdown_from_another_loop_while_facade_holds_the_model() -> None:
    model = own_model("llama")
    sync = sync_model(model)
    ids = ids_of(PROMPT, "llama")
    sync.capture(ids, POINTS)
    asyncio.run(model.shutdown())  # a loop that is not the facade's
    with pytest.raises(ModelClosed):
        sync.capture(ids, POINTS)
    with pytest.raises(ModelClosed):
        sync.generate(ids, max_tokens=2)
    sync.shutdown()  # still fine: idempotent on the model, stops the facade's loop
    sync.shutdown()
    with pytest.raises(ModelClosed):
        sync.capture(ids, POINTS)


def test_sync_facade_shutdown_then_calls_raise_model_closed() -> None:
    model = own_model()
    sync = sync_model(model)
    ids = ids_of(PROMPT)
    sync.warmup()
    sync.capture(ids, POINTS)
    sync.shutdown()
    sync.shutdown()
    for call in (
        lambda: sync.capture(ids, POINTS),
        lambda: sync.generate(ids, max_tokens=2),
        lambda: sync.capture_generation(ids, POINTS, max_tokens=2),
        lambda: sync.capture_attention(ids, [0]),
        lambda: sync.decode_residuals(torch.zeros(3, 64)),
        lambda: sync.warmup(),
        lambda: list(sync.stream(ids, max_tokens=2)),
        lambda: run_with_cache(model, ids, POINTS),
        lambda: list(generate_stream(model, ids, max_tokens=2)),
    ):
        with pytest.raises(ModelClosed):
            call()
    assert sync_model(model) is sync
    # the model itself is shut down too, on any loop
    asyncio.run(_assert_closed(model))


def test_shutdown_from_a_plain_thread_while_requests_run() -> None:
    """Shutting down while captures are in flight: each either finishes or raises ModelClosed."""
    model = own_model()
    sync = sync_model(model)
    ids = ids_of(PROMPT)
    expected = sync.capture(ids, POINTS)
    outcomes: list[str] = []

    def request() -> None:
        try:
            assert_same(sync.capture(ids, POINTS), expected)
            outcomes.append("ok")
        except ModelClosed:
            outcomes.append("closed")

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(request) for _ in range(8)]
        closer = threading.Thread(target=lambda: asyncio.run(model.shutdown()), daemon=True)
        closer.start()
        closer.join(10)
        for future in futures:
            future.result(timeout=10)
    assert not closer.is_alive()
    assert sorted(set(outcomes)) <= ["closed", "ok"] and len(outcomes) == 8
    with pytest.raises(ModelClosed):
        sync.capture(ids, POINTS)
    sync.shutdown()


def test_sync_facade_does_not_keep_the_model_alive() -> None:
    """A model dropped by the user is freed even after a sync call (the facade cache is weak):
    a notebook that reloads models must not accumulate weights and background threads."""
    model = own_model()
    ids = ids_of(PROMPT)
    run_with_cache(model, ids, POINTS)  # creates the model's facade
    ref = weakref.ref(model)
    del model
    for _ in range(3):
        gc.collect()
    assert ref() is None, "sync_model's facade cache keeps every model it has seen alive"
