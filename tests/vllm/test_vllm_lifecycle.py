"""The vllm backend's lifecycle: loop binding, shutdown from anywhere, and the seed's examples.

The seed's snippets (``shared/seed/000_a942dfcd25f444cd.txt``, "Async and servers") run here with
``backend="vllm"``, verbatim except for the model: a hub id becomes a local tiny model. They name
``resid_post.10``, so they run on a 12-layer tiny gpt2 (``seed_path``); the FastAPI example serves
the tiny 3-layer qwen2. Numbers are checked against the same checkpoint in plain ``transformers``.
Every engine started here is shut down here, and its child processes must then be gone and
reaped (``tests/support/procs.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import pathlib
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psutil
import pytest
import torch
from fastapi import FastAPI
from pydantic import BaseModel

from interp_engine import (
    Address,
    Completion,
    ForeignEventLoop,
    InterpError,
    ModelClosed,
    SteeringSpec,
    Write,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import MODELS, PROMPT, hf_for, rel_diff, vllm_model_path

from ..support import procs as _procs

TOL = 1e-4
SEED_LAYERS = 12
D_MODEL = 128


@functools.cache
def seed_path() -> pathlib.Path:
    """A 12-layer tiny gpt2 with vLLM-friendly heads, so the seed's ``resid_post.10`` exists."""
    from interp_testkit import build_tiny_model

    return build_tiny_model(
        "gpt2", MODELS / "gpt2-vllm-12", n_layers=SEED_LAYERS, d_model=D_MODEL, head_dim=32, max_positions=256
    )


def hf_forward(path: pathlib.Path, ids: list[int]) -> Any:
    with torch.no_grad():
        return hf_for(path)(torch.tensor([ids]), output_hidden_states=True)


def hf_resid_post(path: pathlib.Path, ids: list[int], layer: int) -> torch.Tensor:
    """HF's residual stream leaving ``layer`` ([n, d]); not the last layer (HF norms that one)."""
    assert layer < hf_for(path).config.num_hidden_layers - 1
    return hf_forward(path, ids).hidden_states[layer + 1][0]


def engine_started_in_children(call: Callable[[], Any]) -> tuple[Any, set[str]]:
    """Run ``call()`` while watching this process's children; returns its result and the names of
    the child processes seen meanwhile (proof that vLLM, not the eager backend, served it)."""
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for proc in _procs.children().values():
                with contextlib.suppress(Exception):
                    seen.add(proc.name())
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return call(), seen
    finally:
        done.set()
        watcher.join()


# ---------------------------------------------------------------------------------------------
# one model, one event loop
# ---------------------------------------------------------------------------------------------


def _foreign_calls(model: Any, ids: list[int]) -> dict[str, Callable[[], Any]]:
    async def stream() -> None:
        async for _ in model.stream(ids, max_tokens=2):
            pass

    point = Address("resid_post", 1)
    return {
        "capture": lambda: model.capture(ids, [point]),
        "generate": lambda: model.generate(ids, max_tokens=2),
        "capture_generation": lambda: model.capture_generation(ids, [point], max_tokens=2),
        "capture_attention": lambda: model.capture_attention(ids, [0]),
        "decode_residuals": lambda: model.decode_residuals(torch.zeros(len(ids), D_MODEL)),
        "stream": stream,
        "warmup": lambda: model.warmup(),
    }


def test_foreign_loop_raises_within_a_second(vllm_engines: Any) -> None:
    facade = vllm_engines("gpt2")
    model = facade.model  # the async model; its engine belongs to the facade's loop
    ids = model.to_tokens(PROMPT)[0].tolist()
    for name, call in _foreign_calls(model, ids).items():

        async def on_a_fresh_loop(call: Callable[[], Any] = call) -> None:
            await asyncio.wait_for(call(), 20)  # a hang fails as TimeoutError, not ForeignEventLoop

        start = time.monotonic()
        with pytest.raises(ForeignEventLoop) as info:
            asyncio.run(on_a_fresh_loop())
        elapsed = time.monotonic() - start
        assert elapsed < 1.0, f"{name}: ForeignEventLoop took {elapsed:.2f} s"
        exc = info.value
        assert isinstance(exc, RuntimeError) and isinstance(exc, InterpError)
        assert "event loop" in str(exc) and "sync_model" in str(exc), str(exc)

    # the engine is untouched: its own loop still serves, and equals HF
    acts = facade.capture(ids, [Address("resid_post", 1)])
    expected = hf_forward(vllm_model_path("gpt2"), ids).hidden_states[2][0]
    assert rel_diff(acts[Address("resid_post", 1)], expected) <= TOL


async def test_foreign_loop_from_an_async_caller(vllm_engines: Any) -> None:
    facade = await asyncio.to_thread(vllm_engines, "gpt2")
    model = facade.model
    ids = model.to_tokens(PROMPT)[0].tolist()
    start = time.monotonic()
    with pytest.raises(ForeignEventLoop):
        await asyncio.wait_for(model.capture(ids, ["resid_post.0"]), 20)
    assert time.monotonic() - start < 1.0
    # the sync facade refuses inside a running loop instead of deadlocking; awaiting the facade's
    # loop from here through a thread is the way
    acts = await asyncio.to_thread(facade.capture, ids, ["resid_post.0"])
    assert acts[Address("resid_post", 0)].shape == (len(ids), D_MODEL)


# ---------------------------------------------------------------------------------------------
# "Async methods": the seed's read(hf_id), backend from INTERP_ENGINE_BACKEND
# ---------------------------------------------------------------------------------------------


# -- seed snippet, verbatim --
async def read(hf_id: str):
    model = load_model(hf_id)
    await model.warmup()

    point = Address("resid_post", 10)
    token_ids = model.to_tokens("The capital of France is")[0].tolist()
    acts = await model.capture(token_ids, [point])

    await model.shutdown()
    return acts[point]


# -- end of snippet --


def test_read_with_the_vllm_backend_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERP_ENGINE_BACKEND", "vllm")
    before = _procs.children()
    acts, seen = engine_started_in_children(lambda: asyncio.run(read(str(seed_path()))))
    assert "VLLM::EngineCore" in seen, f"no vLLM engine process ran (children seen: {sorted(seen)})"

    ids = hf_tokens(seed_path(), "The capital of France is")
    assert isinstance(acts, torch.Tensor)
    assert acts.shape == (len(ids), D_MODEL) and acts.dtype == torch.float32 and acts.device.type == "cpu"
    assert rel_diff(acts, hf_forward(seed_path(), ids).hidden_states[11][0]) <= TOL
    # read() shut the engine down: nothing of it is left, not even a zombie
    assert _procs.left_over(_procs.new_children(before), timeout=10) == []


def hf_tokens(path: pathlib.Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    out: list[int] = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    return out


# ---------------------------------------------------------------------------------------------
# shutdown from anywhere
# ---------------------------------------------------------------------------------------------


def _started(family: str = "gpt2") -> tuple[Any, Any, dict[int, Any]]:
    """A fresh engine through its facade, and the child processes it started."""
    before = _procs.children()
    model = load_model(vllm_model_path(family), backend="vllm")
    facade = sync_model(model)
    facade.warmup()
    engine_children = _procs.new_children(before)
    assert engine_children, "the engine started no child processes"
    return model, facade, engine_children


def test_shutdown_from_another_thread() -> None:
    model, facade, engine_children = _started()
    ids = model.to_tokens(PROMPT)[0].tolist()
    point = Address("resid_post", 1)
    assert facade.capture(ids, [point])[point].shape == (len(ids), D_MODEL)

    errors: list[BaseException] = []

    def stop() -> None:
        try:
            asyncio.run(model.shutdown())  # a loop that is not the engine's: shutdown is exempt
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=stop)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "shutdown from another thread hung"
    assert errors == []
    assert _procs.left_over(engine_children, timeout=15) == []

    # every method afterwards: ModelClosed (a RuntimeError), at once
    for name, call in _foreign_calls(model, ids).items():
        start = time.monotonic()
        with pytest.raises(ModelClosed) as info:
            asyncio.run(asyncio.wait_for(call(), 20))
        assert isinstance(info.value, RuntimeError), name
        assert time.monotonic() - start < 1.0, name
    for sync_call in {
        "capture": lambda: facade.capture(ids, [point]),
        "generate": lambda: facade.generate(ids, max_tokens=2),
        "capture_generation": lambda: facade.capture_generation(ids, [point], max_tokens=2),
        "capture_attention": lambda: facade.capture_attention(ids, [0]),
        "decode_residuals": lambda: facade.decode_residuals(torch.zeros(D_MODEL)),
        "stream": lambda: list(facade.stream(ids, max_tokens=2)),
        "warmup": facade.warmup,
        "run_with_cache": lambda: run_with_cache(model, ids, [point]),
    }.values():
        with pytest.raises(ModelClosed, match="shut down"):
            sync_call()

    # idempotent: again from a fresh loop, from the facade, and from the facade once more
    asyncio.run(model.shutdown())
    facade.shutdown()
    facade.shutdown()
    asyncio.run(model.shutdown())
    with pytest.raises(ModelClosed):
        facade.capture(ids, [point])
    assert _procs.left_over(engine_children, timeout=1) == []


def test_calls_in_flight_during_shutdown_raise_model_closed() -> None:
    """Requests pending when another thread shuts the engine down fail with ModelClosed; they
    never hang."""
    model, facade, engine_children = _started()
    ids = model.to_tokens("Hello")[0].tolist()
    budget = model.info.n_ctx - len(ids)  # as long as the context allows: still running at shutdown
    outcomes: dict[str, Any] = {}
    streaming = threading.Event()

    def generate() -> None:
        try:
            outcomes["generate"] = facade.generate(ids, max_tokens=budget, ignore_eos=True)
        except BaseException as exc:
            outcomes["generate"] = exc

    def stream() -> None:
        try:
            steps = []
            for step in facade.stream(ids, max_tokens=budget, ignore_eos=True):
                steps.append(step)
                streaming.set()
            outcomes["stream"] = steps
        except BaseException as exc:
            outcomes["stream"] = exc
        finally:
            streaming.set()

    pending = [threading.Thread(target=generate, daemon=True), threading.Thread(target=stream, daemon=True)]
    for thread in pending:
        thread.start()
    assert streaming.wait(timeout=30), "the stream produced no step"

    stopper = threading.Thread(target=lambda: asyncio.run(model.shutdown()), daemon=True)
    stopper.start()
    stopper.join(timeout=60)
    assert not stopper.is_alive(), "shutdown hung"
    try:
        for thread in pending:
            thread.join(timeout=20)
        hung = [name for name, thread in zip(("generate", "stream"), pending, strict=True) if thread.is_alive()]
        assert hung == [], f"calls in flight at shutdown never returned: {hung}"
        for name in ("generate", "stream"):
            assert isinstance(outcomes[name], ModelClosed), f"{name}: {outcomes[name]!r}"
        # and a new call after that: ModelClosed at once
        start = time.monotonic()
        with pytest.raises(ModelClosed):
            facade.generate(ids, max_tokens=2)
        assert time.monotonic() - start < 1.0
    finally:
        facade.shutdown()
    assert _procs.left_over(engine_children, timeout=15) == []


def test_shutdown_reaps_an_engine_core_that_ignores_sigterm() -> None:
    """A stuck engine core: vLLM sends SIGTERM, waits its grace period, then SIGKILLs it without
    waiting for it. The model's shutdown must still reap it: no zombie is left behind."""
    model, facade, engine_children = _started()
    cores = [p for p in engine_children.values() if p.name().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, [p.name() for p in engine_children.values()]
    core = cores[0]
    core.suspend()  # SIGSTOP: it cannot act on SIGTERM
    stopper = threading.Thread(target=facade.shutdown, daemon=True)
    try:
        stopper.start()
        stopper.join(timeout=60)
        assert not stopper.is_alive(), "shutdown hung on a stuck engine core"
    finally:
        with contextlib.suppress(psutil.Error):
            core.resume()
    assert _procs.left_over(engine_children, timeout=15) == []
    with pytest.raises(ModelClosed):
        asyncio.run(model.capture([1, 2, 3], ["resid_post.0"]))


# ---------------------------------------------------------------------------------------------
# "One model, one event loop": the seed's FastAPI lifespan on vLLM
# ---------------------------------------------------------------------------------------------

# -- seed snippet, verbatim except the model (Qwen/Qwen3-8B -> the local tiny qwen2) --
model = None


@asynccontextmanager
async def lifespan(app: FastAPI):
    global model
    model = load_model(vllm_model_path("qwen2"), backend="vllm")
    await model.warmup()  # on the serving loop, not a throwaway one
    yield
    await model.shutdown()


app = FastAPI(lifespan=lifespan)
# -- end of snippet --

SERVED = Address("resid_post", 1)


class CaptureRequest(BaseModel):
    prompt: str
    steering: dict[str, Any] | None = None


@app.post("/capture")
async def capture_route(body: CaptureRequest) -> dict[str, Any]:
    """Awaits ``model.capture`` on the serving loop and returns numbers."""
    spec = SteeringSpec.from_dict(body.steering) if body.steering is not None else None
    token_ids = model.to_tokens(body.prompt)[0].tolist()
    acts = await model.capture(token_ids, [SERVED], steering_spec=spec)
    value = acts[SERVED]
    return {"n_tokens": len(token_ids), "norm": float(value.norm()), "last": value[-1].tolist()}


async def test_fastapi_lifespan_on_vllm() -> None:
    path = vllm_model_path("qwen2")
    prompts = [
        PROMPT,
        "The capital of France is",
        "Hello world",
        "one two three four five six seven eight nine ten",
        "A",
        "Mechanistic interpretability reads the residual stream.",
    ]
    vector = torch.randn(D_MODEL, generator=torch.Generator().manual_seed(3))
    spec = SteeringSpec([Write(Address("resid_post", 0), vector, op="add", scale=2.0)])
    requests = [{"prompt": p} for p in prompts] + [{"prompt": p, "steering": spec.to_dict()} for p in prompts[:2]]
    assert len(requests) == 8

    before = _procs.children()
    async with app.router.lifespan_context(app):
        served = model
        assert served is not None and served.backend == "vllm"
        engine_children = _procs.new_children(before)
        assert engine_children, "the lifespan started no engine processes"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            responses = await asyncio.gather(*(client.post("/capture", json=r) for r in requests))
        for request, response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            got = response.json()
            ids = served.to_tokens(request["prompt"])[0].tolist()
            assert got["n_tokens"] == len(ids)
            if "steering" not in request:
                expected = hf_resid_post(path, ids, 1)
                assert abs(got["norm"] - float(expected.norm())) <= TOL * float(expected.norm())
                assert rel_diff(torch.tensor(got["last"]), expected[-1]) <= TOL
            else:  # equals the same steered request alone, on the same loop
                alone = (await served.capture(ids, [SERVED], steering_spec=spec))[SERVED]
                assert got["norm"] == pytest.approx(float(alone.norm()), rel=1e-5)
                assert got["norm"] != pytest.approx(responses[prompts.index(request["prompt"])].json()["norm"])
    # the lifespan's shutdown ran on the way out: the engine is closed and its processes are gone
    with pytest.raises(ModelClosed):
        await served.capture([1, 2, 3], [SERVED])
    assert _procs.left_over(engine_children, timeout=15) == []


# ---------------------------------------------------------------------------------------------
# "Methods without a loop": the seed's sync_model snippet on vLLM
# ---------------------------------------------------------------------------------------------


def test_sync_model_snippet_on_vllm() -> None:
    path = seed_path()
    token_ids = hf_tokens(path, "The capital of France is")
    before = _procs.children()

    # -- seed snippet (hub id -> local 12-layer tiny gpt2) --
    sync = sync_model(load_model(path, backend="vllm"))
    sync.warmup()
    acts = sync.capture(token_ids, ["resid_post.10"])
    logits = sync.decode_residuals(acts[next(iter(acts))])
    sync.shutdown()
    # -- end of snippet --

    assert _procs.left_over(_procs.new_children(before), timeout=15) == []
    point = Address("resid_post", 10)
    assert list(acts) == [point]
    assert acts[point].shape == (len(token_ids), D_MODEL)
    hidden = hf_resid_post(path, token_ids, 10)
    assert rel_diff(acts[point], hidden) <= TOL
    oracle = hf_for(path)
    with torch.no_grad():
        lens = oracle.lm_head(oracle.transformer.ln_f(hidden))  # logit lens: final norm + unembedding
    assert logits.shape == (len(token_ids), oracle.config.vocab_size)
    assert rel_diff(logits, lens) <= TOL
    with pytest.raises(ModelClosed):
        sync.capture(token_ids, ["resid_post.10"])
    assert sync_model(sync) is sync


# ---------------------------------------------------------------------------------------------
# "Concurrency": the seed's many() on vLLM, and the logit lens on the last layer
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_engine() -> Any:
    """This module's own 12-layer engine (the session fixture only builds 3-layer models)."""
    facade = sync_model(load_model(seed_path(), backend="vllm"))
    facade.warmup()
    yield facade
    facade.shutdown()


# -- seed snippet, verbatim --
async def many(model, prompts, spec):
    point = Address("resid_post", 10)
    return await asyncio.gather(
        *(model.capture(model.to_tokens(p)[0].tolist(), [point], steering_spec=spec) for p in prompts)
    )


# -- end of snippet --


def _steered_hf(path: pathlib.Path, ids: list[int], layer: int, vector: torch.Tensor, scale: float) -> torch.Tensor:
    """HF's residual stream leaving layer 10 with ``scale * vector`` added to ``layer``'s output."""
    oracle = hf_for(path)

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + scale * vector
        return (output[0] + scale * vector, *output[1:])

    handle = oracle.transformer.h[layer].register_forward_hook(hook)
    try:
        return hf_forward(path, ids).hidden_states[11][0]
    finally:
        handle.remove()


def test_many_concurrent_captures_equal_solo_runs(seed_engine: Any) -> None:
    path = seed_path()
    model_ = seed_engine.model
    point = Address("resid_post", 10)
    vector = torch.randn(D_MODEL, generator=torch.Generator().manual_seed(2))
    spec = SteeringSpec([Write(Address("resid_post", 3), vector, op="add", scale=4.0)])
    prompts = [
        PROMPT,
        "The capital of France is",
        "Hello",
        "A much longer prompt, with commas, and more words in it than the others have",
        "x y z",
    ]

    async def both() -> tuple[list[Any], list[Any]]:
        # steered and unsteered batches in flight together: neither spec leaks into the other
        steered, plain = await asyncio.gather(many(model_, prompts, spec), many(model_, prompts, None))
        return steered, plain

    steered, plain = seed_engine.run(both)
    assert len(steered) == len(plain) == len(prompts)
    for prompt, got, unsteered in zip(prompts, steered, plain, strict=True):
        ids = model_.to_tokens(prompt)[0].tolist()
        assert list(got) == [point] and got[point].shape == (len(ids), D_MODEL)
        alone = seed_engine.capture(ids, [point], steering_spec=spec)[point]
        alone_plain = seed_engine.capture(ids, [point])[point]
        assert rel_diff(got[point], alone) <= 1e-5, prompt
        assert rel_diff(unsteered[point], alone_plain) <= 1e-5, prompt
        assert not torch.allclose(got[point], unsteered[point], atol=1e-3)
        assert rel_diff(unsteered[point], hf_resid_post(path, ids, 10)) <= TOL
        assert rel_diff(got[point], _steered_hf(path, ids, 3, vector, 4.0)) <= TOL


def test_decode_last_layer_resid_post_equals_hf_logits(seed_engine: Any) -> None:
    path = seed_path()
    ids = hf_tokens(path, PROMPT)
    acts = seed_engine.capture(ids, ["resid_post.-1", "logits"])
    last = Address("resid_post", -1)  # keyed as requested
    assert set(acts) == {last, Address("logits")}
    logits = seed_engine.decode_residuals(acts[last])
    expected = hf_forward(path, ids).logits[0]
    assert logits.shape == expected.shape
    assert rel_diff(logits, expected) <= TOL
    assert rel_diff(acts[Address("logits")], expected) <= TOL
    # a Completion from the same engine is HF's greedy continuation
    completion = seed_engine.generate(ids, max_tokens=4, ignore_eos=True)
    assert isinstance(completion, Completion)
    full = ids + completion.token_ids
    assert hf_forward(path, full).logits[0, len(ids) - 1 : -1].argmax(-1).tolist() == completion.token_ids


EXIT_SCRIPT = """
import asyncio
import sys

from interp_engine import load_model


async def main(path):
    model = load_model(path, backend="vllm")
    completion = await model.generate(model.to_tokens("Hello there")[0].tolist(), max_tokens=3)
    assert completion.token_ids
    await model.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
    print("exiting")
"""


@pytest.mark.runners("v1")  # the front end's teardown, not the model runner: an engine started by a script
def test_a_script_that_shuts_down_exits_without_a_traceback(tmp_path: pathlib.Path) -> None:
    """Load, generate, shut down (awaited) and exit: nothing on stderr from vLLM's
    ``AsyncLLM.__del__`` at interpreter teardown (:data:`procs.EXIT_FAULTS`). The same through a
    sync facade's shutdown is the script of tests/docs/test_packaging.py, which checks its exit
    the same way (one engine start per script: each is ~40 s of CPU here)."""
    import subprocess
    import sys

    script = tmp_path / "generate_and_exit.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(vllm_model_path("gpt2"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("exiting")
    for marker in _procs.EXIT_FAULTS:
        assert marker not in done.stderr, done.stderr[-4000:]
