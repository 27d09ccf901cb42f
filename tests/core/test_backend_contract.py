"""The same bad input gets the same typed error on every backend.

Each test runs on the eager backend (the shared tiny gpt2), the third-party toy backend
(``tests/toy_backend``) and vLLM (the session's gpt2 engine from ``vllm_engines``). All three
build on the core's ``ModelBase``, so the checks at the top of a request are one code path; these
tests pin that down from the outside: same exception type, a message naming the problem, and the
model still serving afterwards. The after-shutdown case uses a separate cheap model per backend
(on vLLM, one shut down before its engine was built: no second engine is started).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    BatchCapture,
    BlockingCapture,
    ContextTooLong,
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidOption,
    InvalidTokens,
    ModelBase,
    ModelClosed,
    StaticTaps,
    SyncModel,
    UnsupportedAddress,
    WorkerStats,
    load_model,
    sync_model,
)
from interp_testkit.suite import tiny_model_path, vllm_model_path

from ..support.engines import eager_model

BACKENDS = [
    "eager",
    "toy",
    "vllm",  # the test setup installs vLLM's CPU build: never skipped
]
POINT = Address("resid_post", 0)


@dataclass
class Subject:
    """One backend's model and the loop that owns it (its sync facade's)."""

    name: str
    facade: SyncModel

    @property
    def model(self) -> Any:
        return self.facade.model

    @property
    def ids(self) -> list[int]:
        return [3, 1, 4, 1, 5, 9, 2, 6]

    def call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``make()`` on the model's own loop."""
        return self.facade.run(make)


async def _drain(steps: AsyncIterator[Any]) -> list[Any]:
    return [step async for step in steps]


@pytest.fixture(params=BACKENDS)
def subject(request: pytest.FixtureRequest) -> Subject:
    name: str = request.param
    if name == "eager":
        return Subject(name, sync_model(eager_model("gpt2")))
    if name == "toy":
        return Subject(name, sync_model(load_model("toy-model", backend="toy")))
    return Subject(name, request.getfixturevalue("vllm_engines")("gpt2"))


def fresh_model(name: str) -> Any:
    """A separate model of the backend to shut down (on vLLM: its engine is never built)."""
    if name == "eager":
        return load_model(tiny_model_path("gpt2"), backend="eager")
    if name == "toy":
        return load_model("toy-model", backend="toy")
    return load_model(vllm_model_path("gpt2"), backend="vllm")


def raises(subject: Subject, make: Callable[[], Awaitable[Any]], error: type[Exception], *words: str) -> Exception:
    """``make()`` fails with ``error`` (an ``InterpError``) whose message holds ``words``; then a
    normal capture on the same model still succeeds."""
    with pytest.raises(error) as info:
        subject.call(make)
    exc = info.value
    assert isinstance(exc, InterpError), f"{type(exc).__name__} is not an InterpError"
    message = str(exc).lower()
    for word in words:
        assert word.lower() in message, f"{subject.name}: {word!r} not in the message: {exc}"
    acts = subject.call(lambda: subject.model.capture(subject.ids, [POINT]))
    assert acts[POINT].shape == (len(subject.ids), subject.model.info.d_model)
    return exc


def test_every_backend_builds_on_the_core_base(subject: Subject) -> None:
    assert isinstance(subject.model, ModelBase)


CAPABILITIES = {"eager": {BatchCapture, BlockingCapture}, "toy": set(), "vllm": {WorkerStats}}


def test_optional_capabilities_are_declared_protocols(subject: Subject) -> None:
    model = subject.model
    protocols = (BatchCapture, BlockingCapture, StaticTaps, WorkerStats)
    held = {protocol for protocol in protocols if isinstance(model, protocol)}
    assert held == CAPABILITIES[subject.name]


def test_vllm_static_declares_its_taps() -> None:
    model = load_model(vllm_model_path("gpt2"), backend="vllm-static", static_points=["resid_post.1"])
    try:  # never built: no engine starts
        assert isinstance(model, StaticTaps) and isinstance(model, WorkerStats)
        assert not isinstance(model, BatchCapture)
        assert model.static_points == [Address("resid_post", 1)]
    finally:
        asyncio.run(model.shutdown())


# -- points --------------------------------------------------------------------------------------


def test_empty_points(subject: Subject) -> None:
    model, ids = subject.model, subject.ids
    exc = raises(subject, lambda: model.capture(ids, []), UnsupportedAddress, "no capture points", "resid_post.0")
    assert isinstance(exc, InvalidAddress) and isinstance(exc, ValueError)
    raises(subject, lambda: model.capture(ids, ()), UnsupportedAddress, "no capture points")
    raises(subject, lambda: model.capture_attention(ids, []), UnsupportedAddress, "at least one layer")


def test_points_that_are_not_a_list(subject: Subject) -> None:
    raises(subject, lambda: subject.model.capture(subject.ids, 7), InvalidAddress, "points", "int")


def test_generation_without_points_captures_nothing(subject: Subject) -> None:
    completion, acts = subject.call(
        lambda: subject.model.capture_generation(subject.ids, [], max_tokens=2, ignore_eos=True)
    )
    assert acts == {}
    assert len(completion.token_ids) == 2 and completion.finish_reason == "length"


def test_results_are_keyed_as_requested(subject: Subject) -> None:
    n_layers = subject.model.info.n_layers
    acts = subject.call(lambda: subject.model.capture(subject.ids, ["resid_post.-1", Address("resid_pre", 0)]))
    assert list(acts) == [Address("resid_post", -1), Address("resid_pre", 0)]
    again = subject.call(lambda: subject.model.capture(subject.ids, [Address("resid_post", n_layers - 1)]))
    assert torch.equal(again[Address("resid_post", n_layers - 1)], acts[Address("resid_post", -1)])


# -- generation options -------------------------------------------------------------------------


@pytest.mark.parametrize("n_logprobs", [-1, 1.5, True, "3", 10**6])
def test_bad_n_logprobs(subject: Subject, n_logprobs: Any) -> None:
    steps = lambda: _drain(subject.model.stream(subject.ids, max_tokens=2, n_logprobs=n_logprobs))  # noqa: E731
    exc = raises(subject, steps, InvalidOption, "n_logprobs", repr(n_logprobs))
    assert isinstance(exc, TypeError)


@pytest.mark.parametrize("max_tokens", [0, -3, 2.0, True, None])
def test_bad_max_tokens(subject: Subject, max_tokens: Any) -> None:
    model, ids = subject.model, subject.ids
    exc = raises(subject, lambda: model.generate(ids, max_tokens=max_tokens), InvalidTokens, "max_tokens")
    assert isinstance(exc, ValueError) and repr(max_tokens) in str(exc)
    raises(subject, lambda: model.capture_generation(ids, [POINT], max_tokens=max_tokens), InvalidTokens, "max_tokens")
    raises(subject, lambda: _drain(model.stream(ids, max_tokens=max_tokens)), InvalidTokens, "max_tokens")


def test_unknown_sampling_option(subject: Subject) -> None:
    model, ids = subject.model, subject.ids
    exc = raises(subject, lambda: model.generate(ids, max_tokens=2, temprature=0.5), InvalidOption, "temprature")
    assert isinstance(exc, TypeError) and "valid" in str(exc)
    raises(subject, lambda: model.capture_generation(ids, [POINT], max_tokens=2, beams=4), InvalidOption, "beams")
    raises(subject, lambda: _drain(model.stream(ids, max_tokens=2, best_of=2)), InvalidOption, "best_of")


@pytest.mark.parametrize(("option", "value"), [("temperature", -1.0), ("top_p", 2.0), ("top_k", -2), ("seed", "x")])
def test_bad_sampling_value(subject: Subject, option: str, value: Any) -> None:
    """Refused before any compute (the toy backend, greedy only, refuses the option itself)."""
    sampling = {option: value}
    raises(subject, lambda: subject.model.generate(subject.ids, max_tokens=2, **sampling), InvalidOption, option)


def test_finish_reason_is_length_when_eos_is_ignored(subject: Subject) -> None:
    completion = subject.call(lambda: subject.model.generate(subject.ids, max_tokens=3, ignore_eos=True))
    assert len(completion.token_ids) == 3 and completion.finish_reason == "length"
    assert completion.text == subject.model.completion_text(completion.token_ids)


# -- token ids -----------------------------------------------------------------------------------


def _token_calls(model: Any, token_ids: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "capture": lambda: model.capture(token_ids, [POINT]),
        "capture_attention": lambda: model.capture_attention(token_ids, [0]),
        "generate": lambda: model.generate(token_ids, max_tokens=2),
        "capture_generation": lambda: model.capture_generation(token_ids, [POINT], max_tokens=2),
        "stream": lambda: _drain(model.stream(token_ids, max_tokens=2)),
    }


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ([], ("empty",)),
        ([1, "vocab", 2], ("vocab", "vocabulary")),  # "vocab" stands for the model's vocabulary size
        ([1, -1, 2], ("-1", "vocabulary")),
        ("some text", ("string", "to_tokens")),
        ([1.0, 2.0], ("int",)),
        (torch.zeros(2, 3, dtype=torch.long), ("[2, 3]",)),
        (None, ("list of ints",)),
    ],
)
def test_bad_token_ids(subject: Subject, bad: Any, words: tuple[str, ...]) -> None:
    vocab = subject.model.info.vocab_size
    if isinstance(bad, list):
        bad = [vocab if t == "vocab" else t for t in bad]
        words = tuple(str(vocab) if w == "vocab" else w for w in words)
    for name, make in _token_calls(subject.model, bad).items():
        exc = raises(subject, make, InvalidTokens, *words)
        assert isinstance(exc, ValueError), name


def test_prompt_longer_than_the_context(subject: Subject) -> None:
    n_ctx = subject.model.info.n_ctx
    for make in _token_calls(subject.model, [5] * (n_ctx + 1)).values():
        raises(subject, make, ContextTooLong, str(n_ctx + 1), str(n_ctx))


# -- the logit lens ------------------------------------------------------------------------------


def test_decode_of_the_wrong_width(subject: Subject) -> None:
    model, d_model = subject.model, subject.model.info.d_model
    exc = raises(
        subject, lambda: model.decode_residuals(torch.zeros(4, d_model + 1)), InvalidActivations, str(d_model + 1)
    )
    assert isinstance(exc, ValueError) and str(d_model) in str(exc)
    mapping = {POINT: torch.zeros(3, d_model), Address("resid_post", 1): torch.zeros(3, 7)}
    raises(subject, lambda: model.decode_residuals(mapping), InvalidActivations, "7")  # checked before any decode
    raises(subject, lambda: model.decode_residuals([0.0] * d_model), InvalidActivations, "tensor", "list")
    raises(subject, lambda: model.decode_residuals(torch.tensor(1.0)), InvalidActivations, str(d_model))


def test_decode_keeps_the_shape_of_its_input(subject: Subject) -> None:
    model, info = subject.model, subject.model.info
    one = subject.call(lambda: model.decode_residuals(torch.randn(2, 3, info.d_model)))
    assert one.shape == (2, 3, info.vocab_size)
    both = subject.call(lambda: model.decode_residuals({POINT: torch.randn(4, info.d_model)}))
    assert list(both) == [POINT] and both[POINT].shape == (4, info.vocab_size)


# -- after shutdown ------------------------------------------------------------------------------


def test_calls_after_shutdown(subject: Subject) -> None:
    model = fresh_model(subject.name)
    ids = subject.ids
    assert not model.closed
    asyncio.run(model.shutdown())
    assert model.closed
    calls = {
        "warmup": model.warmup,
        **_token_calls(model, ids),
        "decode_residuals": lambda: model.decode_residuals(torch.zeros(model.info.d_model)),
    }
    for name, make in calls.items():
        with pytest.raises(ModelClosed) as info:
            asyncio.run(make())
        assert isinstance(info.value, RuntimeError), name
        assert "shut down" in str(info.value), f"{name}: {info.value}"
    with pytest.raises(ModelClosed):  # bad input on a closed model: the state is checked first
        asyncio.run(model.capture([], []))
    asyncio.run(model.shutdown())  # idempotent, from another loop
    model.close()
    facade = sync_model(model)
    with pytest.raises(ModelClosed):
        facade.capture(ids, [POINT])
    facade.shutdown()
