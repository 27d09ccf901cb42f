"""Backend discovery through entry points, the third-party ``toy`` backend driven through the
core's free functions, and the shape of the public surface (SPEC §1, §2, §7, §8).

The ``toy`` backend is ``tests/toy_backend`` (distribution ``interp-toy-backend``), installed
into the environment: ``pip install -e tests/toy_backend``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import interp_engine
from interp_engine import (
    Address,
    BackendNotFound,
    Cache,
    Completion,
    ContextTooLong,
    InterpError,
    InterpModel,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    LayerOutOfRange,
    ModelClosed,
    RunningLoopError,
    SteeringSpec,
    StreamStep,
    UnsupportedAddress,
    Write,
    capture_attention,
    capture_generation,
    generate_stream,
    installed_backends,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_engine import _errors as errors_module


@pytest.fixture(scope="module")
def toy() -> Iterator[Any]:
    model = load_model("toy-model", backend="toy")
    yield model
    sync_model(model).shutdown()


def ids(text: str) -> list[int]:
    return [ord(c) % 128 for c in text]


def run_fresh(code: str, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter; it prints one JSON value, which is returned."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- discovery ---------------------------------------------------------------------------


def test_installed_backends_lists_eager_and_the_third_party_toy() -> None:
    names = installed_backends()
    assert "eager" in names
    assert "toy" in names
    assert names == sorted(set(names))


def test_load_model_on_the_toy_backend(toy: Any) -> None:
    assert type(toy).__module__ == "interp_toy.model"
    assert toy.backend == "toy"
    assert isinstance(toy, InterpModel)
    assert toy.info.n_layers == 3 and toy.info.d_model == 16
    assert not hasattr(toy, "capture_batch")  # so run_with_cache takes the core's gather-and-pad path


def test_load_model_passes_options_to_the_backend() -> None:
    other = load_model("toy-model", backend="toy", seed=1, n_layers=2)
    assert other.info.n_layers == 2
    with pytest.raises(InvalidOption, match="bogus"):
        load_model("toy-model", backend="toy", bogus=True)


def test_env_var_picks_the_default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERP_ENGINE_BACKEND", "toy")
    assert load_model("toy-model").backend == "toy"
    monkeypatch.setenv("INTERP_ENGINE_BACKEND", "no-such-backend")
    with pytest.raises(BackendNotFound, match="no-such-backend"):
        load_model("toy-model")
    # an explicit backend= wins over the environment
    assert load_model("toy-model", backend="toy").backend == "toy"


def test_env_var_restricts_which_plugins_load() -> None:
    code = "import json, interp_engine; print(json.dumps(interp_engine.installed_backends()))"
    assert run_fresh(code, INTERP_ENGINE_BACKENDS="toy") == ["toy"]


def test_unknown_backend_names_the_distribution_to_install() -> None:
    # with only eager and toy loaded (as where interp-vllm is not installed), ask for vllm
    code = """
import json
from interp_engine import BackendNotFound, InterpError, load_model
try:
    load_model("some/model", backend="vllm")
except BackendNotFound as error:
    print(json.dumps([isinstance(error, LookupError), isinstance(error, InterpError), str(error)]))
"""
    is_lookup, is_interp, message = run_fresh(code, INTERP_ENGINE_BACKENDS="eager,toy")
    assert is_lookup and is_interp
    assert "'vllm'" in message
    assert "interp-vllm" in message
    assert "eager" in message and "toy" in message  # the installed backends


def test_unknown_backend_generic_message() -> None:
    with pytest.raises(BackendNotFound) as info:
        load_model("some/model", backend="nope")
    message = str(info.value)
    assert "'nope'" in message
    assert "interp_engine.backends" in message
    assert "interp-vllm" not in message and "interp-eager" not in message
    assert "eager" in message and "toy" in message


# -- the core's free functions on a third-party backend -----------------------------------


def test_run_with_cache_pads_a_batch_with_the_generic_path(toy: Any) -> None:
    cache = run_with_cache(toy, ["ab", "abcd"], ["resid_post.0"])
    assert isinstance(cache, Cache)
    assert list(cache) == [Address("resid_post", 0)]
    values = cache["resid_post.0"]
    assert values.shape == (2, 4, 16)
    assert cache.lengths is not None and cache.lengths.tolist() == [2, 4]
    facade = sync_model(toy)
    for row, text in enumerate(["ab", "abcd"]):
        solo = facade.capture(ids(text), ["resid_post.0"])[Address("resid_post", 0)]
        n = len(text)
        assert torch.equal(values[row, :n], solo)
    assert torch.equal(values[0, 2:], torch.zeros(2, 16))  # right-padded with zeros
    assert values[0, :2].abs().sum() > 0


def test_run_with_cache_accepts_every_token_form(toy: Any) -> None:
    points = ["resid_pre.0", "resid_post.-1", "final_norm", "logits"]
    by_text = run_with_cache(toy, "hello", points)
    assert by_text["resid_post.-1"].shape == (1, 5, 16)  # resolved against the model, found by either spelling
    assert by_text["logits"].shape == (1, 5, 128)
    for tokens in (ids("hello"), torch.tensor(ids("hello")), toy.to_tokens("hello"), [ids("hello")]):
        other = run_with_cache(toy, tokens, points)
        assert list(other) == list(by_text)
        for address in by_text:
            assert torch.equal(other[address], by_text[address])


def test_run_with_cache_passes_the_steering_spec(toy: Any) -> None:
    vector = torch.linspace(-1.0, 1.0, 16)
    spec = SteeringSpec([Write("resid_post.0", vector, op="set")])
    plain = run_with_cache(toy, ["ab", "abc"], ["resid_post.0", "resid_post.1"])
    steered = run_with_cache(toy, ["ab", "abc"], ["resid_post.0", "resid_post.1"], steering_spec=spec)
    assert torch.equal(steered["resid_post.0"][1], vector.expand(3, 16))
    assert torch.equal(steered["resid_post.0"][0, :2], vector.expand(2, 16))
    assert torch.equal(steered["resid_post.0"][0, 2], torch.zeros(16))  # padding is not steered
    assert not torch.allclose(steered["resid_post.1"], plain["resid_post.1"])


def test_a_third_party_backend_gets_every_op_from_write_apply(toy: Any) -> None:
    """Per-position vectors and swap targets: the toy backend hands each position its rows."""
    gen = torch.Generator().manual_seed(1)
    vectors, targets = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    swap = Write("resid_post.0", vectors, op="swap", target=targets, positions=[0, 1, 2])
    plain = run_with_cache(toy, "abc", ["resid_post.0"])["resid_post.0"][0]
    steered = run_with_cache(toy, "abc", ["resid_post.0"], steering_spec=SteeringSpec([swap]))["resid_post.0"][0]
    for p in range(3):
        d, t = vectors[p] / vectors[p].norm(), targets[p] / targets[p].norm()
        expected = plain[p] + (plain[p] @ d) * (t - d)
        torch.testing.assert_close(steered[p], expected, rtol=1e-5, atol=1e-5)


def test_sync_model_is_one_facade_per_model(toy: Any) -> None:
    facade = sync_model(toy)
    assert sync_model(toy) is facade
    assert sync_model(facade) is facade
    assert facade.model is toy
    assert facade.to_tokens("ab").tolist() == [ids("ab")]
    completion = facade.generate(ids("hi"), max_tokens=4)
    assert isinstance(completion, Completion)
    assert len(completion.token_ids) == 4
    assert completion.text == toy.to_string(completion.token_ids)
    assert facade.generate(ids("hi"), max_tokens=4) == completion  # greedy: deterministic


def test_sync_model_decode_residuals_is_the_logit_lens(toy: Any) -> None:
    facade = sync_model(toy)
    acts = facade.capture(ids("abc"), ["resid_post.-1", "logits"])
    lens = facade.decode_residuals(acts[Address("resid_post", -1)])
    torch.testing.assert_close(lens, acts[Address("logits")])


def test_capture_generation_free_function(toy: Any) -> None:
    prompt = ids("hello")
    completion, cache = capture_generation(toy, prompt, ["resid_post.1", "logits"], max_tokens=3)
    assert isinstance(completion, Completion) and isinstance(cache, Cache)
    assert completion == sync_model(toy).generate(prompt, max_tokens=3)
    assert cache["resid_post.1"].shape == (1, 8, 16)
    assert cache.lengths is not None and cache.lengths.tolist() == [8]
    solo = sync_model(toy).capture(prompt + completion.token_ids, ["resid_post.1", "logits"])
    for address in cache:
        assert torch.equal(cache[address][0], solo[address])
    # the last prompt position's logits chose the first generated token
    assert int(cache["logits"][0, len(prompt) - 1].argmax()) == completion.token_ids[0]


def test_generate_stream_free_function(toy: Any) -> None:
    steps = list(generate_stream(toy, "hello", max_tokens=4, n_logprobs=3))
    assert len(steps) == 4 and all(isinstance(s, StreamStep) for s in steps)
    assert [s.token_id for s in steps] == sync_model(toy).generate(ids("hello"), max_tokens=4).token_ids
    for step in steps:
        assert step.text == chr(step.token_id)
        assert len(step.logprobs) == 3
        assert step.logprobs[0][0] == step.token_id  # greedy
        values = [lp for _, lp in step.logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0


def test_generate_stream_can_stop_early(toy: Any) -> None:
    stream = generate_stream(toy, "hello", max_tokens=50)
    first = next(stream)
    stream.close()  # must not hang or leak an error
    assert first.token_id == sync_model(toy).generate(ids("hello"), max_tokens=1).token_ids[0]


def test_bad_input_raises_typed_errors_through_the_facade_and_the_model_survives(toy: Any) -> None:
    bad: list[tuple[type[Exception], Any]] = [
        (InvalidTokens, lambda: run_with_cache(toy, [[1, 500]], ["resid_post.0"])),
        (InvalidTokens, lambda: run_with_cache(toy, [[]], ["resid_post.0"])),
        (ContextTooLong, lambda: run_with_cache(toy, "x" * 65, ["resid_post.0"])),
        (LayerOutOfRange, lambda: run_with_cache(toy, "ab", ["resid_post.3"])),
        (UnsupportedAddress, lambda: run_with_cache(toy, "ab", ["mlp_out.0"])),
        (UnsupportedAddress, lambda: capture_attention(toy, "ab", [0])),
        (InvalidSteering, lambda: run_with_cache(toy, "ab", ["resid_post.0"], steering_spec=WRONG_WIDTH)),
        (ContextTooLong, lambda: capture_generation(toy, "x" * 60, ["resid_post.0"], max_tokens=5)),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
    assert run_with_cache(toy, "ab", ["resid_post.0"])["resid_post.0"].shape == (1, 2, 16)


WRONG_WIDTH = SteeringSpec([Write("resid_post.0", torch.ones(15))])


async def test_sync_calls_refuse_inside_a_running_loop(toy: Any) -> None:
    with pytest.raises(RunningLoopError):
        run_with_cache(toy, "ab", ["resid_post.0"])
    acts = await toy.capture(ids("ab"), ["resid_post.0"])  # the async way works here
    assert acts[Address("resid_post", 0)].shape == (2, 16)


async def test_async_stream_and_shutdown() -> None:
    model = load_model("toy-model", backend="toy")
    steps = [step async for step in model.stream(ids("ab"), max_tokens=2, n_logprobs=1)]
    assert len(steps) == 2
    await model.shutdown()
    await model.shutdown()  # idempotent
    with pytest.raises(ModelClosed):
        await model.capture(ids("ab"), ["resid_post.0"])


def test_sync_shutdown_is_idempotent() -> None:
    facade = sync_model(load_model("toy-model", backend="toy"))
    facade.shutdown()
    facade.shutdown()
    with pytest.raises(ModelClosed):
        facade.capture(ids("ab"), ["resid_post.0"])


# -- the public surface ------------------------------------------------------------------


def test_import_is_light() -> None:
    # `import interp_engine` loads no backend and no heavy framework; listing backends loads the
    # plugins' registration modules, which must not pull in transformers or vLLM either
    code = (
        "import json, sys, interp_engine\n"
        "heavy = ('transformers', 'vllm', 'interp_eager', 'interp_vllm', 'interp_toy')\n"
        "after_import = [m for m in heavy if m in sys.modules]\n"
        "names = interp_engine.installed_backends()\n"
        "after_listing = [m for m in ('transformers', 'vllm') if m in sys.modules]\n"
        "print(json.dumps([after_import, names, after_listing]))"
    )
    after_import, names, after_listing = run_fresh(code)
    assert after_import == []
    assert "eager" in names and "toy" in names
    assert after_listing == []


def _isort_key(name: str) -> tuple[int, str]:
    # the order ruff's RUF022 enforces: CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_all_is_sorted_and_complete() -> None:
    names = interp_engine.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(interp_engine, name), name
    assert names == sorted(names, key=_isort_key)


def test_every_error_is_exported() -> None:
    defined = {
        name
        for name, value in vars(errors_module).items()
        if isinstance(value, type) and issubclass(value, InterpError) and not name.startswith("_")
    }
    assert defined <= set(interp_engine.__all__)
    assert defined <= set(ERRORS) | {"InterpError"}


ERRORS: dict[str, type[BaseException]] = {
    "InvalidAddress": ValueError,
    "UnknownKind": ValueError,
    "LayerOutOfRange": ValueError,
    "UnsupportedAddress": ValueError,
    "UndeclaredAddress": ValueError,
    "KindNotInFamily": ValueError,
    "LayerTypeError": TypeError,
    "InvalidTokens": ValueError,
    "ContextTooLong": ValueError,
    "InvalidSteering": ValueError,
    "InvalidActivations": ValueError,
    "InvalidChat": ValueError,
    "NoChatTemplate": ValueError,
    "InvalidOption": TypeError,
    "UnsupportedArchitecture": ValueError,
    "ModelLoadError": OSError,
    "BackendNotFound": LookupError,
    "ModelClosed": RuntimeError,
    "ForeignEventLoop": RuntimeError,
    "RunningLoopError": RuntimeError,
    "StaticConfigError": RuntimeError,
    "BackendError": RuntimeError,
    "IncompatibleDependency": RuntimeError,
    "UnguardedScript": RuntimeError,
    "UnsupportedSae": ValueError,
    "UnknownSae": KeyError,
    "UnknownWeight": KeyError,
    "UnknownAdapter": KeyError,
    "InvalidAdapter": ValueError,
    "UnsupportedOperation": NotImplementedError,
    "InvalidFeatures": ValueError,
    "CaptureMemoryExceeded": MemoryError,
    "InvalidCorpus": ValueError,
    "HarvestMismatch": ValueError,
    "InsufficientDiskSpace": OSError,
    "NotInThisEngine": ImportError,
}


@pytest.mark.parametrize(("name", "builtin"), ERRORS.items(), ids=ERRORS.keys())
def test_errors_are_interp_errors_and_builtins(name: str, builtin: type[BaseException]) -> None:
    cls = getattr(interp_engine, name)
    assert issubclass(cls, InterpError)
    assert issubclass(cls, builtin)
    error = cls("message")
    with pytest.raises(builtin):
        raise error


def test_address_errors_carry_context() -> None:
    for name in ("InvalidAddress", "UnknownKind", "LayerOutOfRange", "UnsupportedAddress", "LayerTypeError"):
        error = getattr(interp_engine, name)("bad", address="resid_post.9", valid=("resid_post.0",))
        assert error.address == "resid_post.9" and tuple(error.valid) == ("resid_post.0",)
        assert issubclass(getattr(interp_engine, name), interp_engine.InvalidAddress)
