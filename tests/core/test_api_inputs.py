"""Bad input to the Python API raises the core's typed errors (never ``OverflowError``,
``RecursionError``, ``RuntimeError`` or ``TypeError`` from deep inside), and numpy integers are
accepted where ints are: the holes below HTTP that the server's attack found (eager backend,
``interp:tiny``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from interp_engine import (
    Address,
    FeatureWrite,
    InterpError,
    InvalidActivations,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    SteeringSpec,
    Write,
    load_model,
    sync_model,
)

D_MODEL = 128
RESID = Address("resid_post", 1)


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    m = sync_model(load_model("interp:tiny", backend="eager"))
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def ids(model: Any) -> list[int]:
    out: list[int] = model.to_tokens("The capital of France is")[0].tolist()
    return out


def vec(value: float = 1.0) -> list[float]:
    return [value] * D_MODEL


BIG = 10**400
WRITES: list[tuple[str, Callable[[], Any]]] = [
    ("scale 10**400", lambda: Write("resid_post.0", vec(), scale=BIG)),
    ("scale 1e308 overflows float32", lambda: Write("resid_post.0", vec(), scale=1e308)),
    ("scale*vector overflows float32", lambda: Write("resid_post.0", vec(1e30), scale=1e10)),
    ("lo 10**400", lambda: Write("resid_post.0", vec(), op="cap", lo=BIG)),
    ("max_fraction 10**400", lambda: Write("resid_post.0", vec(), op="norm_add", max_fraction=BIG)),
    ("feature value 10**400", lambda: FeatureWrite("res", 1, "add", BIG)),
    ("meta vector", lambda: Write("resid_post.0", torch.zeros(D_MODEL, device="meta"))),
    ("sparse vector", lambda: Write("resid_post.0", torch.zeros(D_MODEL).to_sparse())),
    ("a set as positions", lambda: Write("resid_post.0", vec(), positions={1, 2})),
    ("a dict as positions", lambda: Write("resid_post.0", vec(), positions={1: 0})),
    ("a set as heads", lambda: Write("attn_z.0", [1.0] * 32, heads={0, 1})),
    ("ints too big for a vector", lambda: Write("resid_post.0", [BIG] * D_MODEL)),
    (
        "from_json 400-digit scale",
        lambda: SteeringSpec.from_json(
            '{"writes": [{"address": "resid_post.0", "vector": [1.0], "scale": ' + "9" * 400 + "}]}"
        ),
    ),
    ("from_json nested 100,000 deep", lambda: SteeringSpec.from_json("[" * 100_000 + "]" * 100_000)),
    (
        "from_dict nested deep",
        lambda: SteeringSpec.from_dict({"writes": [{"address": "resid_post.0", "vector": _deep(5000)}]}),
    ),
]


def _deep(n: int) -> Any:
    value: Any = [1.0]
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("make", [w[1] for w in WRITES], ids=[w[0] for w in WRITES])
def test_bad_writes_are_invalid_steering(make: Callable[[], Any]) -> None:
    with pytest.raises(InvalidSteering):
        make()


def test_numpy_integers_are_ints(model: Any, ids: list[int]) -> None:
    expected = model.capture(ids, ["resid_post.1"])[RESID]
    for given in (np.array(ids), [np.int64(i) for i in ids], np.array(ids, dtype=np.int32)):
        assert torch.equal(model.capture(given, ["resid_post.1"])[RESID], expected)
    write = Write("resid_post.0", vec(), positions=[np.int64(1), np.int32(2)])
    assert write.positions == (1, 2) and all(type(p) is int for p in write.positions)
    assert FeatureWrite("res", np.int64(3)).feature == 3
    steps = list(model.stream(ids, max_tokens=2, n_logprobs=np.int64(2)))
    assert all(len(s.logprobs) == 2 for s in steps)
    seeded = model.generate(ids, max_tokens=4, temperature=1.0, seed=np.uint64(2**64 - 1))
    assert seeded.text == model.generate(ids, max_tokens=4, temperature=1.0, seed=2**64 - 1).text


CALLS: list[tuple[str, type[InterpError], Callable[[Any, list[int]], Any]]] = [
    ("seed 2**70", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=1.0, seed=2**70)),
    ("seed -2**63-1", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=1.0, seed=-(2**63) - 1)),
    ("seed -1", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=1.0, seed=-1)),
    ("seed 1.5", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=1.0, seed=1.5)),
    ("temperature NaN", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=float("nan"))),
    ("temperature 10**400", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=BIG)),
    ("top_p 10**400", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, top_p=BIG)),
    ("top_k True", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, temperature=1.0, top_k=True)),
    ("ignore_eos 'no'", InvalidOption, lambda m, ids: m.generate(ids, max_tokens=2, ignore_eos="no")),
    ("n_logprobs 10**6", InvalidOption, lambda m, ids: list(m.stream(ids, max_tokens=1, n_logprobs=10**6))),
    ("points None", InterpError, lambda m, ids: m.capture(ids, None)),
    ("a dict as token ids", InvalidTokens, lambda m, ids: m.capture({i: 0 for i in ids}, ["embed"])),
    ("a set as token ids", InvalidTokens, lambda m, ids: m.capture(set(ids), ["embed"])),
    ("a 2-D array as token ids", InvalidTokens, lambda m, ids: m.capture(np.array([ids, ids]), ["embed"])),
    ("a lone surrogate", InvalidTokens, lambda m, ids: m.to_tokens("abc \ud800")),
    ("NaN to decode", InvalidActivations, lambda m, ids: m.decode_residuals(torch.full((D_MODEL,), float("nan")))),
    ("inf to decode", InvalidActivations, lambda m, ids: m.decode_residuals(torch.full((D_MODEL,), float("inf")))),
    ("meta to decode", InvalidActivations, lambda m, ids: m.decode_residuals(torch.zeros(D_MODEL, device="meta"))),
    ("sparse to decode", InvalidActivations, lambda m, ids: m.decode_residuals(torch.zeros(2, D_MODEL).to_sparse())),
    (
        "complex to decode",
        InvalidActivations,
        lambda m, ids: m.decode_residuals(torch.zeros(D_MODEL, dtype=torch.cfloat)),
    ),
]


@pytest.mark.parametrize(("error", "call"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_bad_calls_raise_typed_errors(
    model: Any, ids: list[int], error: type[InterpError], call: Callable[[Any, list[int]], Any]
) -> None:
    with pytest.raises(error):
        call(model, ids)
    assert model.capture(ids, ["embed"])  # the model keeps working


def test_a_tiny_temperature_samples_as_vllm_does(model: Any, ids: list[int]) -> None:
    """A temperature in (0, 0.01) is raised to 0.01 (vLLM's own rule): logits divided by 1e-300
    overflow, and sampling from them is undefined."""
    tiny = model.generate(ids, max_tokens=6, temperature=1e-300, seed=5)
    assert tiny.text == model.generate(ids, max_tokens=6, temperature=0.01, seed=5).text
    streamed = list(model.stream(ids, max_tokens=6, temperature=1e-300, seed=5, n_logprobs=2))
    assert [s.token_id for s in streamed] == tiny.token_ids
