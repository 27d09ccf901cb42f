"""Bad input on the vllm backend: a typed error with a useful message, and the engine keeps serving.

Runs on the session's gpt2 engine (3 layers, d_model 128, d_mlp 512, vocab 512, context 256). After
every error a normal capture on the same engine succeeds and equals the HF oracle, and no request
state is left behind in the workers (``interp_stats``). Bad engine arguments and unsupported
architectures fail at load or warmup without leaving child processes behind.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    BackendError,
    ContextTooLong,
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    LayerOutOfRange,
    ModelClosed,
    SteeringSpec,
    UnknownKind,
    UnsupportedArchitecture,
    Write,
    capture_generation,
    generate_stream,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import PROMPT, hf_for, rel_diff, vllm_model_path

from ..support import procs as _procs

FAMILY = "gpt2"
CHECK = Address("resid_post", 1)
D_MODEL, D_MLP, VOCAB, N_CTX = 128, 512, 512, 256
SPEC = SteeringSpec([Write(Address("resid_post", 0), torch.ones(D_MODEL), op="add", scale=0.5)])


@pytest.fixture(scope="module")
def engine(vllm_engines: Any) -> Any:
    """The session's gpt2 engine behind its sync facade (never shut down here)."""
    facade = vllm_engines(FAMILY)
    assert facade.model.info.n_ctx == N_CTX and facade.model.info.d_mlp == D_MLP
    return facade


@pytest.fixture
def ids(engine: Any) -> list[int]:
    out: list[int] = engine.to_tokens(PROMPT)[0].tolist()
    return out


def hf_hidden(token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = hf_for(vllm_model_path(FAMILY))(torch.tensor([token_ids]), output_hidden_states=True)
    return tuple(out.hidden_states)


def live_requests(engine: Any) -> list[int]:
    """Per-worker count of requests still holding tap state."""
    stats = engine.run(lambda: engine.model._engine.collective_rpc("interp_stats"))
    return [s["live_requests"] for s in stats]


def assert_still_works(engine: Any) -> None:
    """A normal capture succeeds and equals HF, and no request state leaked into the workers."""
    token_ids = engine.to_tokens(PROMPT)[0].tolist()
    acts = engine.capture(token_ids, [CHECK])
    assert rel_diff(acts[CHECK], hf_hidden(token_ids)[2][0]) <= 1e-4
    assert live_requests(engine) == [0]


def raises(engine: Any, call: Callable[[], Any], error: type[Exception], *words: str) -> Exception:
    """Run ``call`` (a sync facade call), check the error's type and message, then that the
    engine still serves."""
    with pytest.raises(error) as info:
        call()
    exc = info.value
    assert isinstance(exc, InterpError), f"{type(exc).__name__} is not an InterpError"
    message = str(exc)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in the message: {message}"
    assert_still_works(engine)
    return exc


def drain(steps: Iterator[Any]) -> list[Any]:
    return list(steps)


# ---------------------------------------------------------------------------------------------
# addresses
# ---------------------------------------------------------------------------------------------


def test_unknown_kind(engine: Any, ids: list[int]) -> None:
    exc = raises(engine, lambda: engine.capture(ids, ["resid_poost.1"]), UnknownKind, "resid_poost", "resid_post")
    assert isinstance(exc, ValueError) and isinstance(exc, InvalidAddress)
    raises(engine, lambda: engine.capture(ids, [CHECK, "mlp_mid.0"]), UnknownKind, "mlp_mid")


@pytest.mark.parametrize("point", ["resid_post.3", "resid_post.-4", Address("mlp_out", 3), Address("attn_pattern", 99)])
def test_layer_out_of_range(engine: Any, ids: list[int], point: Any) -> None:
    exc = raises(engine, lambda: engine.capture(ids, [point]), LayerOutOfRange, "out of range", "3 layers", "-3..2")
    assert isinstance(exc, ValueError)


def test_layer_out_of_range_in_attention_generation_and_steering(engine: Any, ids: list[int]) -> None:
    raises(engine, lambda: engine.capture_attention(ids, [3]), LayerOutOfRange, "attn_pattern.3")
    raises(engine, lambda: engine.capture_generation(ids, ["mlp_post.7"], max_tokens=2), LayerOutOfRange, "mlp_post.7")
    spec = SteeringSpec([Write(Address("resid_post", 5), torch.ones(D_MODEL))])
    raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), LayerOutOfRange, "resid_post.5")
    raises(engine, lambda: engine.generate(ids, max_tokens=2, steering_spec=spec), LayerOutOfRange, "resid_post.5")


def test_string_key_on_a_capture_result_is_a_key_error(engine: Any, ids: list[int]) -> None:
    acts = engine.capture(ids, ["resid_post.1"])
    assert list(acts) == [CHECK]  # keyed by Address even when a string was asked for
    with pytest.raises(KeyError):
        acts["resid_post.1"]  # by design: a plain dict keyed by Address
    assert_still_works(engine)


# ---------------------------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------------------------


def test_empty_token_list(engine: Any) -> None:
    exc = raises(engine, lambda: engine.capture([], [CHECK]), InvalidTokens, "empty")
    assert isinstance(exc, ValueError)
    raises(engine, lambda: engine.generate([], max_tokens=2), InvalidTokens, "empty")
    raises(engine, lambda: drain(engine.stream([], max_tokens=2)), InvalidTokens, "empty")


@pytest.mark.parametrize("bad", [VOCAB, 10_000, -1])
def test_token_id_outside_the_vocabulary(engine: Any, ids: list[int], bad: int) -> None:
    token_ids = [*ids[:3], bad, 5]
    raises(engine, lambda: engine.capture(token_ids, [CHECK]), InvalidTokens, str(bad), "vocabulary", str(VOCAB))
    raises(engine, lambda: engine.generate(token_ids, max_tokens=2), InvalidTokens, str(bad))
    raises(engine, lambda: engine.capture_attention(token_ids, [0]), InvalidTokens, str(bad))
    raises(engine, lambda: engine.capture_generation(token_ids, [CHECK], max_tokens=2), InvalidTokens, str(bad))
    raises(engine, lambda: drain(engine.stream(token_ids, max_tokens=2)), InvalidTokens, str(bad))


def test_token_ids_of_the_wrong_type(engine: Any) -> None:
    raises(engine, lambda: engine.capture("The capital", [CHECK]), InvalidTokens, "string", "to_tokens")
    raises(engine, lambda: engine.capture([1.0, 2.0], [CHECK]), InvalidTokens, "int")
    raises(engine, lambda: engine.capture(torch.zeros(2, 3, dtype=torch.long), [CHECK]), InvalidTokens, "[2, 3]")


def test_prompt_longer_than_the_context(engine: Any) -> None:
    exc = raises(engine, lambda: engine.capture([5] * (N_CTX + 1), [CHECK]), ContextTooLong, str(N_CTX + 1), str(N_CTX))
    assert isinstance(exc, InvalidTokens) and isinstance(exc, ValueError)
    raises(engine, lambda: engine.capture_attention([5] * 1000, [0]), ContextTooLong, "1000", str(N_CTX))


def test_prompt_exactly_the_context_is_served(engine: Any) -> None:
    token_ids = [(7 * i) % VOCAB for i in range(N_CTX)]
    acts = engine.capture(token_ids, [CHECK])
    assert acts[CHECK].shape == (N_CTX, D_MODEL)
    assert rel_diff(acts[CHECK], hf_hidden(token_ids)[2][0]) <= 1e-4
    assert_still_works(engine)


def test_prompt_plus_max_tokens_longer_than_the_context(engine: Any) -> None:
    raises(engine, lambda: engine.generate([5] * 250, max_tokens=7), ContextTooLong, "250", "7", str(N_CTX))
    raises(
        engine,
        lambda: engine.capture_generation([5] * 200, [CHECK], max_tokens=57),
        ContextTooLong,
        "200",
        "57",
        str(N_CTX),
    )
    raises(engine, lambda: drain(engine.stream([5] * N_CTX, max_tokens=1)), ContextTooLong, str(N_CTX))
    # exactly filling the context is fine
    completion = engine.generate([5] * 250, max_tokens=6, ignore_eos=True)
    assert len(completion.token_ids) == 6
    assert_still_works(engine)


def test_capture_generation_exactly_filling_the_context(engine: Any) -> None:
    """Prompt + max_tokens == context: the activations cover every token, the last generated one
    included (vLLM never runs a forward past max_model_len, so the backend has to get them
    another way)."""
    prompt = [(11 * i + 3) % VOCAB for i in range(N_CTX - 8)]
    completion, acts = engine.capture_generation(prompt, [CHECK], max_tokens=8, ignore_eos=True)
    assert len(completion.token_ids) == 8
    full = prompt + completion.token_ids
    assert acts[CHECK].shape == (N_CTX, D_MODEL)
    assert rel_diff(acts[CHECK], hf_hidden(full)[2][0]) <= 1e-4
    assert_still_works(engine)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_must_be_positive(engine: Any, ids: list[int], max_tokens: int) -> None:
    raises(engine, lambda: engine.generate(ids, max_tokens=max_tokens), InvalidTokens, "max_tokens", str(max_tokens))
    raises(engine, lambda: engine.capture_generation(ids, [CHECK], max_tokens=max_tokens), InvalidTokens, "max_tokens")


# ---------------------------------------------------------------------------------------------
# steering
# ---------------------------------------------------------------------------------------------


def test_steering_vector_of_the_wrong_width(engine: Any, ids: list[int]) -> None:
    spec = SteeringSpec([Write(CHECK, torch.ones(32), op="add")])
    exc = raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), InvalidSteering, "32", "128")
    assert isinstance(exc, ValueError)
    # mlp_post is d_mlp (512) wide, not d_model
    spec = SteeringSpec([Write(Address("mlp_post", 0), torch.ones(D_MODEL))])
    raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), InvalidSteering, "128", "512")
    # in generation and streaming too, before any token is produced
    spec = SteeringSpec([Write(CHECK, torch.ones(D_MODEL + 1))])
    raises(engine, lambda: engine.generate(ids, max_tokens=3, steering_spec=spec), InvalidSteering, "129", "128")
    raises(
        engine,
        lambda: drain(engine.stream(ids, max_tokens=3, steering_spec=spec)),
        InvalidSteering,
        "129",
    )
    raises(
        engine,
        lambda: engine.capture_generation(ids, [CHECK], max_tokens=3, steering_spec=spec),
        InvalidSteering,
        "129",
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_steering_vector_with_nan(engine: Any, bad: float) -> None:
    vector = torch.ones(D_MODEL)
    vector[7] = bad
    exc = raises(engine, lambda: Write(CHECK, vector), InvalidSteering, "nan")
    assert isinstance(exc, ValueError)
    # the same vector arriving as JSON (a server's path) is refused the same way
    data = SteeringSpec([Write(CHECK, torch.ones(D_MODEL))]).to_dict()
    data["writes"][0]["vector"][7] = bad
    raises(engine, lambda: SteeringSpec.from_dict(data), InvalidSteering, "nan")


def test_set_tensor_with_the_wrong_number_of_rows(engine: Any, ids: list[int]) -> None:
    spec = SteeringSpec([Write(CHECK, torch.zeros(3, D_MODEL), op="set", positions=[0, 1])])
    raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), InvalidSteering, "3 rows", "2 positions")
    n = len(ids)
    spec = SteeringSpec([Write(CHECK, torch.zeros(n + 1, D_MODEL), op="set")])
    raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), InvalidSteering, str(n + 1), str(n))
    # one row per prompt token is not enough once generation adds positions ("all")
    spec = SteeringSpec([Write(CHECK, torch.zeros(n, D_MODEL), op="set")])
    raises(
        engine,
        lambda: engine.capture_generation(ids, [CHECK], max_tokens=2, steering_spec=spec),
        InvalidSteering,
        str(n),
    )
    # positions beyond the prompt
    spec = SteeringSpec([Write(CHECK, torch.zeros(D_MODEL), op="set", positions=[n])])
    raises(engine, lambda: engine.capture(ids, [CHECK], steering_spec=spec), InvalidSteering, str(n))


# ---------------------------------------------------------------------------------------------
# decoding and generation options
# ---------------------------------------------------------------------------------------------


def test_decode_residuals_of_the_wrong_width(engine: Any) -> None:
    exc = raises(engine, lambda: engine.decode_residuals(torch.zeros(4, 32)), InvalidActivations, "128", "32")
    assert isinstance(exc, ValueError)
    raises(engine, lambda: engine.decode_residuals({CHECK: torch.zeros(4, 129)}), InvalidActivations, "129")
    raises(engine, lambda: engine.decode_residuals([0.0] * D_MODEL), InvalidActivations, "tensor")
    raises(engine, lambda: engine.decode_residuals(torch.tensor(1.0)), InvalidActivations, "128")


def test_unknown_sampling_option(engine: Any, ids: list[int]) -> None:
    exc = raises(
        engine, lambda: engine.generate(ids, max_tokens=2, temprature=0.5), InvalidOption, "temprature", "temperature"
    )
    assert isinstance(exc, TypeError)
    raises(engine, lambda: engine.capture_generation(ids, [CHECK], max_tokens=2, beams=4), InvalidOption, "beams")
    raises(engine, lambda: drain(engine.stream(ids, max_tokens=2, n_logprobs=-1)), InvalidOption, "n_logprobs")
    raises(engine, lambda: drain(engine.stream(ids, max_tokens=2, best_of=2)), InvalidOption, "best_of")


def test_sampling_values_vllm_rejects(engine: Any, ids: list[int]) -> None:
    raises(engine, lambda: engine.generate(ids, max_tokens=2, temperature=-1.0), InvalidOption, "temperature")
    raises(engine, lambda: engine.generate(ids, max_tokens=2, top_p=2.0), InvalidOption, "top_p")


def test_errors_through_the_sync_free_functions(engine: Any, ids: list[int]) -> None:
    model = engine.model
    assert sync_model(model) is engine
    with pytest.raises(InvalidOption, match="temprature"):
        capture_generation(model, ids, [CHECK], max_tokens=2, temprature=0.5)
    with pytest.raises(InvalidTokens, match="max_tokens"):
        list(generate_stream(model, ids, max_tokens=0))
    with pytest.raises(ContextTooLong):
        run_with_cache(model, [[5] * (N_CTX + 1)], [CHECK])
    with pytest.raises(UnknownKind):
        run_with_cache(model, [ids, ids[:3]], ["resid_poost.0"])
    cache = run_with_cache(model, ids, [CHECK])
    assert cache["resid_post.1"].shape == (1, len(ids), D_MODEL)
    assert_still_works(engine)


def test_a_cancelled_request_leaves_nothing_behind(engine: Any) -> None:
    """A caller that gives up (timeout, client disconnect) aborts the request in vLLM; the worker
    keeps no state for it and the next request is served."""
    model = engine.model
    long_prompt = [(5 * i + 1) % VOCAB for i in range(200)]

    async def give_up() -> None:
        await asyncio.wait_for(model.capture(long_prompt, [CHECK, "mlp_post.0", "attn_pattern.2"]), 0.01)

    with pytest.raises(TimeoutError):
        engine.run(give_up)

    async def give_up_generating() -> None:
        await asyncio.wait_for(model.capture_generation(long_prompt, [CHECK], max_tokens=55, ignore_eos=True), 0.05)

    with pytest.raises(TimeoutError):
        engine.run(give_up_generating)

    steps = engine.stream(long_prompt, max_tokens=50, ignore_eos=True, steering_spec=SPEC)
    next(steps)  # a client that reads one step and disconnects
    steps.close()
    assert_still_works(engine)


# ---------------------------------------------------------------------------------------------
# loading, engine arguments, shutdown
# ---------------------------------------------------------------------------------------------


def test_unknown_engine_argument_fails_at_load() -> None:
    before = _procs.children()
    with pytest.raises(InvalidOption) as info:
        load_model(vllm_model_path(FAMILY), backend="vllm", not_an_engine_arg=1)
    assert isinstance(info.value, TypeError)
    assert "not_an_engine_arg" in str(info.value)
    assert "max_model_len" in str(info.value)  # says what the options are
    assert _procs.new_children(before) == {}


@pytest.mark.parametrize(
    ("engine_args", "words"),
    [
        ({"max_model_len": 10**9}, ("max_model_len",)),
        ({"tensor_parallel_size": 0}, ("tensor_parallel_size",)),
        ({"dtype": "not-a-dtype"}, ("dtype",)),
    ],
)
def test_engine_arguments_vllm_rejects(engine_args: dict[str, Any], words: tuple[str, ...]) -> None:
    """Arguments vLLM refuses: a typed error (at load, or from warmup when only vLLM can tell),
    no processes left, and the model can be shut down afterwards (warming it up again fails the
    same way; it never hangs)."""
    before = _procs.children()
    try:
        model = load_model(vllm_model_path(FAMILY), backend="vllm", **engine_args)
    except InvalidOption as exc:  # refused before any engine exists: fine too
        assert all(word in str(exc) for word in words), str(exc)
        assert _procs.new_children(before) == {}
        return
    facade = sync_model(model)
    for _ in range(2):
        with pytest.raises((InvalidOption, BackendError)) as info:
            facade.warmup()
        message = str(info.value)
        for word in words:
            assert word in message, message
    assert _procs.left_over(_procs.new_children(before), timeout=10) == []
    facade.shutdown()
    with pytest.raises(ModelClosed):
        facade.capture([1, 2, 3], [CHECK])
    assert _procs.new_children(before) == {}


@pytest.mark.parametrize(
    ("family", "named"),
    [
        ("codegen", "CodeGenForCausalLM"),  # vLLM has no model class for it
        ("bitnet", "BitNetAttention"),  # vLLM runs it; its attention holds a norm the resolver cannot place
    ],
)
def test_unsupported_architecture(family: str, named: str) -> None:
    """Refused before any engine starts, naming the architecture or the module it cannot place."""
    before = _procs.children()
    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(vllm_model_path(family), backend="vllm")
    exc = info.value
    assert isinstance(exc, ValueError) and isinstance(exc, InterpError)
    assert named in str(exc), str(exc)
    assert _procs.new_children(before) == {}


def test_request_after_shutdown(engine: Any) -> None:
    """A model shut down before its engine started: every call is ModelClosed, nothing spawns."""
    before = _procs.children()
    model = load_model(vllm_model_path(FAMILY), backend="vllm")
    asyncio.run(model.shutdown())
    token_ids = model.to_tokens(PROMPT)[0].tolist()
    for call in (
        lambda: model.warmup(),
        lambda: model.capture(token_ids, [CHECK]),
        lambda: model.generate(token_ids, max_tokens=2),
        lambda: model.decode_residuals(torch.zeros(D_MODEL)),
    ):
        with pytest.raises(ModelClosed) as info:
            asyncio.run(call())
        assert isinstance(info.value, RuntimeError)
        assert "shut down" in str(info.value)
    facade = sync_model(model)
    with pytest.raises(ModelClosed):
        facade.capture(token_ids, [CHECK])
    facade.shutdown()
    asyncio.run(model.shutdown())  # idempotent
    assert _procs.new_children(before) == {}
    assert_still_works(engine)  # other models are untouched


# ---------------------------------------------------------------------------------------------
# the KV cache's size on a CPU machine
# ---------------------------------------------------------------------------------------------


def test_the_kv_cache_is_an_engine_argument(monkeypatch: pytest.MonkeyPatch, engine: Any) -> None:
    """On a CPU machine the KV cache defaults to 1 GiB as the engine argument
    ``kv_cache_memory_bytes``, which a caller's own value replaces and which the engine uses;
    where the caller's environment sets vLLM's ``VLLM_CPU_KVCACHE_SPACE``, that decides."""
    from interp_testkit.suite import KV_CACHE_BYTES

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    path = vllm_model_path(FAMILY)
    assert load_model(path, backend="vllm").engine_kwargs["kv_cache_memory_bytes"] == 1 << 30
    assert load_model(path, backend="vllm", kv_cache_memory_bytes=64 << 20).engine_kwargs["kv_cache_memory_bytes"] == (
        64 << 20
    )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert "kv_cache_memory_bytes" not in load_model(path, backend="vllm").engine_kwargs
    # the session's engine was built with the suite's size, and holds it
    assert engine.model._engine.vllm_config.cache_config.kv_cache_memory_bytes == KV_CACHE_BYTES
