"""The usage examples of ``shared/seed/000_a942dfcd25f444cd.txt`` ("Async and servers"), run as written.

Each snippet is copied verbatim except for the model: a hub id becomes a local tiny model and
``backend="vllm"`` becomes ``backend="eager"`` (this file covers the eager backend; the vLLM variants
of the same snippets are tested with the vLLM backend elsewhere). The snippets name layers 5 and 10,
so they run on 12-layer tiny models (``seed_model_path``) built beside the shared 3-layer ones; the
numbers are checked against the same checkpoint in plain ``transformers``.

The ``vllm-static`` example ("Declaring taps after load") is vLLM-only: it runs in
``test_vllm_static.py``.
"""

import asyncio
import functools
import pathlib
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from interp_engine import (
    Address,
    BackendNotFound,
    Cache,
    Completion,
    InterpError,
    ModelClosed,
    SteeringSpec,
    StreamStep,
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

TOL = 1e-4
SEED_LAYERS = 12


@functools.cache
def seed_model_path(family: str) -> pathlib.Path:
    """A 12-layer tiny ``family`` model, so the seed's layers 5 and 10 exist."""
    from interp_testkit import build_tiny_model

    return build_tiny_model(family, MODELS / f"seed-{family}-{SEED_LAYERS}", n_layers=SEED_LAYERS)


@functools.cache
def seed_eager(family: str) -> Any:
    """The session's eager model of the 12-layer checkpoint (never shut down)."""
    return load_model(seed_model_path(family), backend="eager")


@functools.cache
def seed_oracle(family: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(seed_model_path(family), attn_implementation="eager")
    return model.eval()


def hf_forward(oracle: Any, ids: list[int] | torch.Tensor) -> Any:
    ids = torch.as_tensor(ids).reshape(1, -1)
    with torch.no_grad():
        return oracle(ids, output_hidden_states=True, output_attentions=True)


def hf_resid_post(oracle: Any, ids: list[int] | torch.Tensor, layer: int) -> torch.Tensor:
    """HF's residual stream leaving ``layer`` ([1, n, d]); not valid for the last layer (HF applies
    the final norm to its last hidden state)."""
    n_layers = oracle.config.num_hidden_layers
    assert layer < n_layers - 1
    return hf_forward(oracle, ids).hidden_states[layer + 1]


# ---------------------------------------------------------------------------------------------
# "The sync free functions"
# ---------------------------------------------------------------------------------------------


def test_sync_free_functions_block() -> None:
    # -- seed snippet (hub id -> local 12-layer tiny gpt2; vLLM variant tested elsewhere) --
    model = load_model(seed_model_path("gpt2"), backend="eager")  # or backend="vllm"
    tokens = model.to_tokens("The capital of France is")

    cache = run_with_cache(model, tokens, ["resid_post.5"])
    completion, gen_cache = capture_generation(model, tokens, ["resid_post.5"], max_tokens=8)
    attn = capture_attention(model, tokens, [5])
    steps = list(generate_stream(model, tokens, max_tokens=8, n_logprobs=5))
    # -- end of snippet --

    try:
        oracle = seed_oracle("gpt2")
        ids = tokens[0].tolist()
        n = len(ids)
        point = Address("resid_post", 5)
        reference = hf_forward(oracle, ids)

        # Cache: batch axis kept, Address or string lookup, numbers equal HF
        assert isinstance(cache, Cache)
        assert list(cache.keys()) == [point]
        assert cache[point] is cache["resid_post.5"]
        assert point in cache and "resid_post.5" in cache
        assert cache[point].shape == (1, n, model.info.d_model)
        assert rel_diff(cache["resid_post.5"], reference.hidden_states[6]) <= TOL

        # capture_generation: a Completion plus activations over prompt + generated tokens
        assert isinstance(completion, Completion)
        generated = completion.token_ids
        assert 1 <= len(generated) <= 8
        assert len(generated) == 8 or completion.finish_reason == "stop"
        assert isinstance(gen_cache, Cache)
        full = ids + generated
        assert gen_cache[point].shape == (1, len(full), model.info.d_model)
        teacher = hf_forward(oracle, full)
        assert rel_diff(gen_cache["resid_post.5"], teacher.hidden_states[6]) <= TOL
        # greedy: each generated token is HF's argmax after the tokens before it
        assert teacher.logits[0, n - 1 : len(full) - 1].argmax(-1).tolist() == generated
        assert completion.text == model.to_string(generated)

        # capture_attention: [batch, heads, q, k], equal to HF's eager attention probabilities
        assert isinstance(attn, Cache)
        pattern = attn[Address("attn_pattern", 5)]
        assert pattern is attn["attn_pattern.5"]
        assert pattern.shape == (1, model.info.n_heads, n, n)
        assert rel_diff(pattern, reference.attentions[5]) <= TOL

        # generate_stream: one StreamStep per generated token, top-5 logprobs, best first
        assert all(isinstance(step, StreamStep) for step in steps)
        assert [step.token_id for step in steps] == generated
        assert "".join(step.text for step in steps) == completion.text
        for i, step in enumerate(steps):
            assert len(step.logprobs) == 5
            assert step.logprobs[0][0] == step.token_id
            values = [lp for _, lp in step.logprobs]
            assert values == sorted(values, reverse=True)
            expected = torch.log_softmax(teacher.logits[0, n - 1 + i], dim=-1)
            for token_id, logprob in step.logprobs:
                assert abs(logprob - float(expected[token_id])) <= 1e-4
    finally:
        sync_model(model).shutdown()


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_free_functions_equal_hf(family: str) -> None:
    """The same free functions on the shared 3-layer models, against ``hf_oracle``."""
    model = eager_model(family)
    oracle = hf_oracle(family)
    tokens = model.to_tokens(PROMPT)
    ids = tokens[0].tolist()
    reference = hf_forward(oracle, ids)
    points = ["embed", "resid_post.0", Address("resid_post", 1), "final_norm"]
    cache = run_with_cache(model, tokens, points)
    assert cache["embed"].shape == (1, len(ids), model.info.d_model)
    assert rel_diff(cache[Address("embed")], reference.hidden_states[0]) <= TOL
    assert rel_diff(cache["resid_post.0"], reference.hidden_states[1]) <= TOL
    assert rel_diff(cache[Address("resid_post", 1)], reference.hidden_states[2]) <= TOL
    assert rel_diff(cache["final_norm"], reference.hidden_states[3]) <= TOL  # HF's last state is normed
    attn = capture_attention(model, tokens, [0, 1, 2])
    for layer in range(3):
        assert rel_diff(attn[f"attn_pattern.{layer}"], reference.attentions[layer]) <= TOL


# ---------------------------------------------------------------------------------------------
# "Methods without a loop"
# ---------------------------------------------------------------------------------------------


def test_sync_model_block() -> None:
    from transformers import AutoTokenizer

    path = seed_model_path("llama")
    token_ids = AutoTokenizer.from_pretrained(path)("The capital of France is")["input_ids"]

    # -- seed snippet (hub id -> local 12-layer tiny llama; vLLM variant tested elsewhere) --
    sync = sync_model(load_model(path, backend="eager"))
    sync.warmup()
    acts = sync.capture(token_ids, ["resid_post.10"])
    logits = sync.decode_residuals(acts[next(iter(acts))])
    sync.shutdown()
    # -- end of snippet --

    oracle = seed_oracle("llama")
    point = Address("resid_post", 10)
    assert list(acts) == [point]
    assert acts[point].shape == (len(token_ids), 64)
    hidden = hf_resid_post(oracle, token_ids, 10)
    assert rel_diff(acts[point], hidden[0]) <= TOL
    with torch.no_grad():
        lens = oracle.lm_head(oracle.model.norm(hidden))[0]  # logit lens: final norm + unembedding
    assert logits.shape == (len(token_ids), oracle.config.vocab_size)
    assert rel_diff(logits, lens) <= TOL

    # shut down: the facade refuses further work with ModelClosed, and shutting down again is a no-op
    sync.shutdown()
    with pytest.raises(ModelClosed):
        sync.capture(token_ids, ["resid_post.10"])
    assert sync_model(sync) is sync


def test_sync_model_decode_last_layer_equals_hf_logits() -> None:
    """Logit lens on the last layer's ``resid_post`` is the model's own output logits."""
    model = eager_model("llama")
    sync = sync_model(model)
    assert sync_model(model) is sync
    token_ids = sync.to_tokens(PROMPT)[0].tolist()
    acts = sync.capture(token_ids, ["resid_post.-1", "logits"])
    last = Address("resid_post", -1)  # results are keyed by the address as requested
    assert set(acts) == {last, Address("logits")}
    logits = sync.decode_residuals(acts[last])
    expected = hf_forward(hf_oracle("llama"), token_ids).logits[0]
    assert rel_diff(logits, expected) <= TOL
    assert rel_diff(acts[Address("logits")], expected) <= TOL


# ---------------------------------------------------------------------------------------------
# "Async methods"
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


def _check_read(acts: torch.Tensor, family: str) -> None:
    model = seed_eager(family)
    token_ids = model.to_tokens("The capital of France is")[0].tolist()
    assert isinstance(acts, torch.Tensor)
    assert acts.shape == (len(token_ids), 64)  # no batch axis
    assert acts.dtype == torch.float32 and acts.device.type == "cpu"
    assert rel_diff(acts, hf_resid_post(seed_oracle(family), token_ids, 10)[0]) <= TOL


async def test_read_default_backend_is_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INTERP_ENGINE_BACKEND", raising=False)
    _check_read(await read(str(seed_model_path("gpt2"))), "gpt2")


async def test_read_backend_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERP_ENGINE_BACKEND", "eager")
    _check_read(await read(str(seed_model_path("llama"))), "llama")
    # the variable is really consulted: a backend that is not installed is named in the error
    monkeypatch.setenv("INTERP_ENGINE_BACKEND", "no-such-backend")
    with pytest.raises(BackendNotFound, match="no-such-backend"):
        await read(str(seed_model_path("llama")))


# ---------------------------------------------------------------------------------------------
# "One model, one event loop": the FastAPI lifespan
# ---------------------------------------------------------------------------------------------

# -- seed snippet (hub id -> local tiny qwen3; vLLM variant tested elsewhere) --
model = None


@asynccontextmanager
async def lifespan(app: FastAPI):
    global model
    model = load_model(tiny_model_path("qwen3"), backend="eager")
    await model.warmup()  # on the serving loop, not a throwaway one
    yield
    await model.shutdown()


app = FastAPI(lifespan=lifespan)
# -- end of snippet --

SERVED_POINT = Address("resid_post", 1)


class CaptureRequest(BaseModel):
    prompt: str
    steering: dict[str, Any] | None = None
    point: str = str(SERVED_POINT)


@app.exception_handler(InterpError)
async def bad_request(request: Any, exc: InterpError) -> JSONResponse:
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=400)


@app.post("/capture")
async def capture_route(body: CaptureRequest) -> dict[str, Any]:
    """Awaits ``model.capture`` on the serving loop; the spec arrives as JSON."""
    spec = SteeringSpec.from_dict(body.steering) if body.steering is not None else None
    point = Address.parse(body.point)
    token_ids = model.to_tokens(body.prompt)[0].tolist()
    acts = await model.capture(token_ids, [point], steering_spec=spec)
    value = acts[next(iter(acts))]
    return {"n_tokens": len(token_ids), "norm": float(value.norm()), "last": value[-1].tolist()}


async def test_fastapi_lifespan_serves_concurrent_requests() -> None:
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1))
    spec = SteeringSpec([Write(Address("resid_post", 0), vector, op="add", scale=4.0)])
    prompts = [PROMPT, "The capital of France is", "Hello world", "one two three four five six"]
    requests = [{"prompt": p} for p in prompts] + [{"prompt": p, "steering": spec.to_dict()} for p in prompts]

    async with app.router.lifespan_context(app):
        served = model
        assert served is not None and served.backend == "eager"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            responses = await asyncio.gather(*(client.post("/capture", json=r) for r in requests))
            # bad input is a clear 400 and the next request still succeeds
            bad = await client.post("/capture", json={"prompt": PROMPT, "point": "resid_post.7"})
            assert bad.status_code == 400 and bad.json()["error"] == "LayerOutOfRange"
            again = await client.post("/capture", json={"prompt": PROMPT})
            assert again.status_code == 200 and again.json() == responses[0].json()

        oracle = hf_oracle("qwen3")
        for request, response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            got = response.json()
            ids = served.to_tokens(request["prompt"])[0].tolist()
            assert got["n_tokens"] == len(ids)
            steering = SteeringSpec.from_dict(request["steering"]) if "steering" in request else None
            alone = (await served.capture(ids, [SERVED_POINT], steering_spec=steering))[SERVED_POINT]
            assert got["norm"] == pytest.approx(float(alone.norm()), rel=1e-6)
            torch.testing.assert_close(torch.tensor(got["last"]), alone[-1], rtol=0, atol=1e-6)
            if steering is None:
                assert rel_diff(alone, hf_resid_post(oracle, ids, 1)[0]) <= TOL
        # steering changed the steered requests and only those
        for i in range(len(prompts)):
            assert responses[i].json()["norm"] != responses[i + len(prompts)].json()["norm"]

    # the lifespan's shutdown ran on the way out
    with pytest.raises(ModelClosed):
        await served.capture([1, 2, 3], [SERVED_POINT])


# ---------------------------------------------------------------------------------------------
# "Concurrency"
# ---------------------------------------------------------------------------------------------


# -- seed snippet, verbatim --
async def many(model, prompts, spec):
    point = Address("resid_post", 10)
    return await asyncio.gather(
        *(model.capture(model.to_tokens(p)[0].tolist(), [point], steering_spec=spec) for p in prompts)
    )


# -- end of snippet --


def _steer_hf(oracle: Any, ids: list[int], layer: int, vector: torch.Tensor, scale: float) -> torch.Tensor:
    """HF hidden states [n_layers+1] with ``scale * vector`` added to layer ``layer``'s output."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + scale * vector
        return (output[0] + scale * vector, *output[1:])

    handle = oracle.model.layers[layer].register_forward_hook(hook)
    try:
        return hf_forward(oracle, ids).hidden_states
    finally:
        handle.remove()


async def test_many_concurrent_captures_equal_solo_runs() -> None:
    model_ = seed_eager("llama")
    oracle = seed_oracle("llama")
    point = Address("resid_post", 10)
    vector = torch.randn(64, generator=torch.Generator().manual_seed(2))
    spec = SteeringSpec([Write(Address("resid_post", 3), vector, op="add", scale=4.0)])
    assert SteeringSpec.from_json(spec.to_json()) == spec
    prompts = [PROMPT, "The capital of France is", "Hello", "A much longer prompt, with commas, and more words in it"]

    # steered and unsteered batches in flight together: neither spec leaks into the other
    steered, plain = await asyncio.gather(many(model_, prompts, spec), many(model_, prompts, None))
    assert len(steered) == len(plain) == len(prompts)
    for prompt, got, unsteered in zip(prompts, steered, plain, strict=True):
        ids = model_.to_tokens(prompt)[0].tolist()
        alone = await model_.capture(ids, [point], steering_spec=spec)
        assert list(got) == [point]
        assert got[point].shape == (len(ids), 64)
        torch.testing.assert_close(got[point], alone[point], rtol=0, atol=1e-6)
        alone_plain = await model_.capture(ids, [point])
        torch.testing.assert_close(unsteered[point], alone_plain[point], rtol=0, atol=1e-6)
        assert not torch.allclose(got[point], unsteered[point], atol=1e-3)
        # and both equal HF, with the steering written by a hand-made hook
        assert rel_diff(got[point], _steer_hf(oracle, ids, 3, vector, 4.0)[11][0]) <= TOL
        assert rel_diff(unsteered[point], hf_resid_post(oracle, ids, 10)[0]) <= TOL
