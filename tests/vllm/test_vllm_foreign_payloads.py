"""Payloads the workers did not get from a front end of theirs.

A request reaches vLLM's workers with whatever a client put in its ``SamplingParams.extra_args``:
``vllm_xargs`` on vLLM's OpenAI routes (strings, numbers, lists) or a whole ``SamplingParams`` on
its token-in routes (any JSON). Under the payload's key, that must never stop the engine, and a
payload the client wrote itself must never steer, capture or write into a file: the workers serve
only payloads carrying the secret of a front end that pinged them (``RequestPayload.issuer``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from interp_engine import Address, SamplingOptions, SteeringSpec, Write, run_with_cache
from interp_testkit.suite import PROMPT

FAMILY = "gpt2"


@pytest.fixture(scope="module")
def engine(vllm_engines: Any) -> Any:
    return vllm_engines(FAMILY)


def _tokens(facade: Any, extra: dict[str, Any] | None, max_tokens: int = 6) -> list[int]:
    """Greedy tokens of ``PROMPT`` sent straight to the engine with ``extra`` as ``extra_args``."""
    model = facade.model
    ids = facade.to_tokens(PROMPT)[0].tolist()

    async def send() -> list[int]:
        engine = model._engine
        params = model._sampling(max_tokens, SamplingOptions(), extra_args=extra)
        rid = f"foreign-{os.urandom(6).hex()}"
        out: list[int] = []
        async for output in model._outputs(engine, ids, params, rid, rid):
            out = list(output.outputs[0].token_ids)
        return out

    return list(facade.run(send))


def _forged(facade: Any, tmp_path: Any, issuer: Any) -> dict[str, Any]:
    """A payload as the front end writes it (a steering write that changes every token, a capture
    into a slab region naming a file of the client's choosing), with ``issuer`` as given."""
    model = facade.model
    ids = facade.to_tokens(PROMPT)[0].tolist()
    width = model.info.d_model
    target = tmp_path / "target.bin"
    target.write_bytes(b"\0" * (4 * width * 64))
    vector = torch.randn(width, generator=torch.Generator().manual_seed(0))  # not constant: a norm would remove it
    spec = SteeringSpec([Write(Address("resid_post", 0), vector, op="add", scale=20.0)])
    payload = model._payload("forged", [Address("resid_post", 0)], list(spec.writes), len(ids), len(ids) + 6)
    data = payload.encode()
    data["buffers"] = {"resid_post.0": [str(target), 0, 64, [width]]}
    if issuer is None:
        del data["issuer"]
    else:
        data["issuer"] = issuer
    return data


@pytest.mark.parametrize(
    "entry",
    ["a string", 7, 1.5, ["a", 1], {}, {"id": 3}, {"id": "x", "issuer": ["not", "a", "string"]}],
    ids=["string", "int", "float", "list", "empty", "numeric-id", "list-issuer"],
)
def test_anything_a_client_puts_under_the_key_is_served_as_a_plain_request(engine: Any, entry: Any) -> None:
    plain = _tokens(engine, None)
    assert _tokens(engine, {"interp_engine": entry}) == plain
    cache = run_with_cache(engine, PROMPT, ["resid_post.1"])  # the engine goes on serving taps
    assert cache["resid_post.1"].shape[-1] == engine.model.info.d_model


@pytest.mark.parametrize("issuer", [None, "", "0" * 32], ids=["none", "empty", "unknown"])
def test_a_forged_payload_neither_steers_nor_writes(engine: Any, tmp_path: Any, issuer: Any) -> None:
    plain = _tokens(engine, None)
    forged = _forged(engine, tmp_path, issuer)
    assert _tokens(engine, {"interp_engine": forged}) == plain
    assert (tmp_path / "target.bin").read_bytes() == b"\0" * (4 * engine.model.info.d_model * 64)


def test_the_same_payload_with_the_front_ends_secret_is_served(engine: Any, tmp_path: Any) -> None:
    """The control: the forged payload, given the issuer the front end pinged the workers with,
    steers (so the refusals above are the issuer check, not a payload that could not work)."""
    plain = _tokens(engine, None)
    data = _forged(engine, tmp_path, engine.model._issuer)
    del data["buffers"]  # values of a request with no region stay in the worker: release them
    data["points"] = []
    assert _tokens(engine, {"interp_engine": data}) != plain


def test_the_workers_decide_trust_without_decoding() -> None:
    """``rid_of`` reads only the id and the issuer, and answers ``None`` for anything else."""
    from interp_vllm._wire import RequestPayload

    class Params:
        def __init__(self, extra: Any) -> None:
            self.extra_args = extra

    trusted = {"secret"}
    assert RequestPayload.rid_of(Params({"interp_engine": {"id": "r", "issuer": "secret"}}), trusted) == "r"
    for extra in (None, "x", [1], {"interp_engine": None}, {"interp_engine": {"id": "r", "issuer": "other"}}):
        assert RequestPayload.rid_of(Params(extra), trusted) is None
    assert not RequestPayload.awaits_fetch_of(Params({"interp_engine": "x"}))
