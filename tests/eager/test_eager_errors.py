"""Bad input on the eager backend: a typed error with a useful message, and the model still works.

Every error is an ``InterpError`` and also the builtin a Python user would catch; after each one
a normal capture on the same (shared) model succeeds and still equals the HF oracle.
"""

from __future__ import annotations

import asyncio
import math
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    BackendNotFound,
    ContextTooLong,
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    LayerOutOfRange,
    LayerTypeError,
    ModelLoadError,
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
from interp_testkit.suite import PROMPT, hf_oracle, rel_diff, tiny_model_path

from ..support.engines import eager_model

FAMILY = "gpt2"
CHECK = Address("resid_post", 1)


def model() -> Any:
    return eager_model(FAMILY)


def ids() -> list[int]:
    out: list[int] = model().to_tokens(PROMPT)[0].tolist()
    return out


async def assert_still_works() -> None:
    """A normal capture succeeds and equals the HF oracle (bad input never kills the model)."""
    token_ids = ids()
    acts = await model().capture(token_ids, [CHECK])
    with torch.no_grad():
        hidden = hf_oracle(FAMILY)(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    assert rel_diff(acts[CHECK], hidden[2][0]) <= 1e-4


async def raises(
    call: Callable[[], Awaitable[Any]] | Callable[[], Any], error: type[Exception], *words: str
) -> Exception:
    """Run ``call`` (awaiting it if it returns an awaitable) and check the error's type and message."""
    with pytest.raises(error) as info:
        result = call()
        if asyncio.iscoroutine(result):
            await result
    exc = info.value
    assert isinstance(exc, InterpError), f"{type(exc).__name__} is not an InterpError"
    message = str(exc)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in the message: {message}"
    await assert_still_works()
    return exc


# ---------------------------------------------------------------------------------------------
# addresses
# ---------------------------------------------------------------------------------------------


async def test_unknown_kind_as_a_point_string() -> None:
    exc = await raises(lambda: model().capture(ids(), ["resid_poost.1"]), UnknownKind, "resid_poost", "resid_post")
    assert isinstance(exc, ValueError) and isinstance(exc, InvalidAddress)
    assert "resid_post" in exc.valid


async def test_unknown_kind_as_an_address() -> None:
    exc = await raises(lambda: Address("nope"), UnknownKind, "nope", "valid kinds")
    assert exc.address == "nope"


async def test_unknown_kind_through_the_sync_free_function() -> None:
    points = ["resid_poost.1"]
    await raises(lambda: asyncio.to_thread(run_with_cache, model(), ids(), points), UnknownKind, "resid_poost")
    cache = await asyncio.to_thread(run_with_cache, model(), ids(), [CHECK])
    assert list(cache) == [CHECK]  # the facade survives too


@pytest.mark.parametrize("point", ["resid_post.3", "resid_post.-4", Address("mlp_out", 3), Address("attn_pattern", 99)])
async def test_layer_out_of_range(point: Any) -> None:
    exc = await raises(lambda: model().capture(ids(), [point]), LayerOutOfRange, "out of range", "3 layers", "-3..2")
    assert isinstance(exc, ValueError)
    assert exc.valid == "-3..2"


async def test_layer_out_of_range_in_capture_attention_and_steering() -> None:
    await raises(lambda: model().capture_attention(ids(), [3]), LayerOutOfRange, "attn_pattern.3")
    spec = SteeringSpec([Write(Address("resid_post", 5), torch.ones(64))])
    await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), LayerOutOfRange, "resid_post.5")


async def test_layer_of_the_wrong_type() -> None:
    exc = await raises(lambda: Address("resid_post", "1"), LayerTypeError, "int")
    assert isinstance(exc, TypeError) and isinstance(exc, InvalidAddress)
    await raises(lambda: Address("resid_post", 1.0), LayerTypeError, "int")
    await raises(lambda: model().capture(ids(), ["resid_post.one"]), LayerTypeError, "one")


async def test_string_key_on_a_capture_result_is_a_key_error() -> None:
    acts = await model().capture(ids(), [CHECK])
    assert CHECK in acts
    with pytest.raises(KeyError):
        acts["resid_post.1"]  # by design: results are a plain dict keyed by Address
    await assert_still_works()


# ---------------------------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------------------------


async def test_empty_token_list() -> None:
    exc = await raises(lambda: model().capture([], [CHECK]), InvalidTokens, "empty")
    assert isinstance(exc, ValueError)
    await raises(lambda: model().generate([], max_tokens=2), InvalidTokens, "empty")


@pytest.mark.parametrize("bad", [512, 10_000, -1])
async def test_token_id_outside_the_vocabulary(bad: int) -> None:
    assert model().info.vocab_size == 512
    token_ids = [*ids()[:3], bad, 5]
    await raises(lambda: model().capture(token_ids, [CHECK]), InvalidTokens, str(bad), "vocabulary", "512")
    await raises(lambda: model().generate(token_ids, max_tokens=2), InvalidTokens, str(bad))
    await raises(lambda: model().capture_attention(token_ids, [0]), InvalidTokens, str(bad))


async def test_prompt_longer_than_the_context() -> None:
    assert model().info.n_ctx == 128
    exc = await raises(lambda: model().capture([5] * 129, [CHECK]), ContextTooLong, "129", "128")
    assert isinstance(exc, InvalidTokens) and isinstance(exc, ValueError)
    # exactly the context is fine
    acts = await model().capture([5] * 128, [CHECK])
    assert acts[CHECK].shape == (128, 64)


async def test_prompt_plus_max_tokens_longer_than_the_context() -> None:
    await raises(lambda: model().generate([5] * 120, max_tokens=9), ContextTooLong, "120", "9", "128")
    await raises(
        lambda: model().capture_generation([5] * 100, [CHECK], max_tokens=29), ContextTooLong, "100", "29", "128"
    )

    async def drain() -> None:
        async for _ in model().stream([5] * 128, max_tokens=1):
            pass

    await raises(drain, ContextTooLong, "128")
    # exactly filling the context is fine, activations included
    completion, acts = await model().capture_generation([5] * 120, [CHECK], max_tokens=8, ignore_eos=True)
    assert len(completion.token_ids) == 8
    assert acts[CHECK].shape == (128, 64)


@pytest.mark.parametrize("max_tokens", [0, -3])
async def test_max_tokens_must_be_positive(max_tokens: int) -> None:
    await raises(lambda: model().generate(ids(), max_tokens=max_tokens), InvalidTokens, "max_tokens", str(max_tokens))
    await raises(lambda: model().capture_generation(ids(), [CHECK], max_tokens=max_tokens), InvalidTokens, "max_tokens")


# ---------------------------------------------------------------------------------------------
# steering
# ---------------------------------------------------------------------------------------------


async def test_steering_vector_of_the_wrong_width() -> None:
    spec = SteeringSpec([Write(CHECK, torch.ones(32), op="add")])
    exc = await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), InvalidSteering, "32", "64")
    assert isinstance(exc, ValueError)
    # mlp_post is d_mlp (256) wide, not d_model
    spec = SteeringSpec([Write(Address("mlp_post", 0), torch.ones(64))])
    await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), InvalidSteering, "64", "256")
    # in generation too, before any token is produced
    spec = SteeringSpec([Write(CHECK, torch.ones(65))])
    await raises(lambda: model().generate(ids(), max_tokens=3, steering_spec=spec), InvalidSteering, "65", "64")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
async def test_steering_vector_with_nan_fails_at_write_construction(bad: float) -> None:
    vector = torch.ones(64)
    vector[7] = bad
    exc = await raises(lambda: Write(CHECK, vector), InvalidSteering, "nan")
    assert isinstance(exc, ValueError)


async def test_set_tensor_with_the_wrong_number_of_rows() -> None:
    patch = torch.zeros(3, 64)
    spec = SteeringSpec([Write(CHECK, patch, op="set", positions=[0, 1])])
    await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), InvalidSteering, "3 rows", "2 positions")
    n = len(ids())
    spec = SteeringSpec([Write(CHECK, torch.zeros(n + 1, 64), op="set")])
    await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), InvalidSteering, str(n + 1), str(n))
    # positions beyond the prompt
    spec = SteeringSpec([Write(CHECK, torch.zeros(64), op="set", positions=[n])])
    await raises(lambda: model().capture(ids(), [CHECK], steering_spec=spec), InvalidSteering, str(n))


async def test_steering_errors_through_the_sync_facade() -> None:
    sync = await asyncio.to_thread(sync_model, model())
    spec = SteeringSpec([Write(CHECK, torch.ones(32))])
    await raises(
        lambda: asyncio.to_thread(sync.capture, ids(), [CHECK], steering_spec=spec), InvalidSteering, "32", "64"
    )
    acts = await asyncio.to_thread(sync.capture, ids(), [CHECK])
    assert acts[CHECK].shape == (len(ids()), 64)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


async def test_unknown_backend() -> None:
    exc = await raises(
        lambda: load_model(tiny_model_path(FAMILY), backend="no-such-backend"), BackendNotFound, "no-such-backend"
    )
    assert isinstance(exc, LookupError)
    assert "eager" in str(exc)  # names what is installed


async def test_unknown_load_option() -> None:
    exc = await raises(
        lambda: load_model(tiny_model_path(FAMILY), backend="eager", nonsense=1), InvalidOption, "nonsense", "dtype"
    )
    assert isinstance(exc, TypeError)


async def test_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    from transformers import BloomConfig, BloomForCausalLM

    # Bloom adding its normalised input, not the residual stream, back after each sublayer
    config = BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    config.apply_residual_connection_post_layernorm = True
    BloomForCausalLM(config).save_pretrained(tmp_path)
    exc = await raises(lambda: load_model(tmp_path, backend="eager"), UnsupportedArchitecture, "bloom", "gpt2", "llama")
    assert isinstance(exc, ValueError)


async def test_missing_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    exc = await raises(lambda: load_model(missing, backend="eager"), ModelLoadError, str(missing))
    assert isinstance(exc, OSError)


async def test_directory_without_a_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "README.md").write_text("not a model\n")
    exc = await raises(lambda: load_model(tmp_path, backend="eager"), ModelLoadError, str(tmp_path))
    assert isinstance(exc, OSError)


# ---------------------------------------------------------------------------------------------
# decoding and generation options
# ---------------------------------------------------------------------------------------------


async def test_decode_residuals_of_the_wrong_width() -> None:
    exc = await raises(lambda: model().decode_residuals(torch.zeros(4, 32)), InvalidActivations, "64", "32")
    assert isinstance(exc, ValueError)
    await raises(lambda: model().decode_residuals({CHECK: torch.zeros(4, 65)}), InvalidActivations, "65")
    await raises(lambda: model().decode_residuals([0.0] * 64), InvalidActivations, "tensor")


async def test_unknown_sampling_option() -> None:
    exc = await raises(
        lambda: model().generate(ids(), max_tokens=2, temprature=0.5), InvalidOption, "temprature", "temperature"
    )
    assert isinstance(exc, TypeError)
    await raises(lambda: model().capture_generation(ids(), [CHECK], max_tokens=2, beams=4), InvalidOption, "beams")

    async def drain() -> None:
        async for _ in model().stream(ids(), max_tokens=2, n_logprobs=-1):
            pass

    await raises(drain, InvalidOption, "n_logprobs")


def test_errors_through_the_sync_free_functions() -> None:
    with pytest.raises(InvalidOption, match="temprature"):
        capture_generation(model(), ids(), [CHECK], max_tokens=2, temprature=0.5)
    with pytest.raises(InvalidTokens, match="max_tokens"):
        list(generate_stream(model(), ids(), max_tokens=0))
    with pytest.raises(ContextTooLong):
        run_with_cache(model(), [[5] * 129], [CHECK])
    cache = run_with_cache(model(), ids(), [CHECK])
    assert cache["resid_post.1"].shape == (1, len(ids()), 64)
