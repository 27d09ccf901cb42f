"""OpenAI-compatible ``POST /v1/completions``, driven by the ``openai`` Python client itself over a
loopback socket (eager backend, ``interp:tiny``): plain and streamed completions, logprobs, stop
strings, seeds, and steering and captures passed with ``extra_body``, each equal to the model called
directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from interp_engine import Address, SteeringSpec, Write
from interp_engine.server import create_app

from ..support.servers import LiveServer, tensor

KEY = "openai-test-key-42"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with LiveServer(create_app("interp:tiny", backend="eager", api_key=KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def ids_of(direct: Any) -> list[int]:
    ids: list[int] = direct.to_tokens(PROMPT)[0].tolist()
    return ids


def test_a_greedy_completion_equals_the_model(client: openai.OpenAI, direct: Any) -> None:
    out = client.completions.create(model="interp:tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    expected = direct.generate(ids_of(direct), max_tokens=8)
    assert out.object == "text_completion" and out.model == "interp:tiny" and len(out.choices) == 1
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids_of(direct)), 8)
    assert out.model_extra is not None and out.model_extra["interp"]["token_ids"] == expected.token_ids
    # the prompt as token ids answers the same
    again = client.completions.create(model="m", prompt=ids_of(direct), max_tokens=8, temperature=0)
    assert again.choices[0].text == expected.text


def test_logprobs_are_the_models_top_n(client: openai.OpenAI, direct: Any) -> None:
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    steps = list(direct.stream(ids_of(direct), max_tokens=4, n_logprobs=3))
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [s.text for s in steps]
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    for step, chosen, top in zip(steps, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen == pytest.approx(step.logprobs[0][1], abs=1e-5)  # greedy: the best one
        assert sorted(top.values(), reverse=True) == pytest.approx([lp for _, lp in step.logprobs], abs=1e-5)
    assert logprobs.text_offset == [sum(len(s.text) for s in steps[:i]) for i in range(len(steps))]


def test_a_stream_is_openais_chunks_and_equals_the_plain_answer(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model="m", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert "".join(texts) == plain.choices[0].text and len(texts) == 6
    assert reasons == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_cut_the_text_plain_and_streamed(client: openai.OpenAI) -> None:
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert stop and stop in full
    cut = full[: full.index(stop)]
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == cut and chunks[-1].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_completion(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, top_p=0.95)
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_steering_and_captures_ride_in_extra_body(client: openai.OpenAI, direct: Any) -> None:
    vector = torch.randn(128, generator=torch.Generator().manual_seed(0))
    spec = SteeringSpec([Write(Address("resid_post", 0), vector, scale=6.0)])
    steered = direct.generate(ids_of(direct), max_tokens=8, steering_spec=spec)
    plain = direct.generate(ids_of(direct), max_tokens=8)
    assert steered.text != plain.text
    out = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"interp": {"steering": spec.to_dict()}}
    )
    assert out.choices[0].text == steered.text
    captured = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"interp": {"steering": spec.to_dict(), "points": ["resid_post.1"]}},
    )
    completion, acts = direct.capture_generation(ids_of(direct), ["resid_post.1"], max_tokens=4, steering_spec=spec)
    extra = captured.model_extra or {}
    assert captured.choices[0].text == completion.text
    got = tensor(extra["interp"]["activations"]["resid_post.1"])
    expected = acts[Address("resid_post", 1)]
    assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_points_at_a_few_positions_ride_in_extra_body(client: openai.OpenAI, direct: Any) -> None:
    """``interp.positions`` keeps those positions of ``interp.points`` (the fields interp-vllm's
    plugin answers in ``vllm serve``), as ``capture_generation(..., positions=...)`` does."""
    from interp_engine import capture_generation

    n = len(ids_of(direct))
    points = ["resid_post.1", "attn_pattern.0"]
    for positions in ([0, n - 1, n + 2], [-1, 1], "prompt"):
        asked = {"points": points, "positions": positions}
        out = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"interp": asked}
        )
        answer = (out.model_extra or {})["interp"]
        _, cache = capture_generation(direct, ids_of(direct), points, max_tokens=4, positions=positions)
        assert cache.positions is not None and answer["positions"] == cache.positions[0].tolist()
        for point in points:
            got, want = tensor(answer["activations"][point]), cache[point][0]
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5), point
    bad_ones = [
        {"points": ["resid_post.1"], "positions": [99]},
        {"positions": [0]},
        {"points": ["embed"], "positions": "x"},
    ]
    for bad in bad_ones:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="m", prompt=PROMPT, max_tokens=4, extra_body={"interp": bad})
        assert refused.value.response.json()["field"] == "interp.positions", refused.value.response.text


def test_errors_reach_the_openai_client_as_its_errors(server: LiveServer, client: openai.OpenAI) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="m", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=PROMPT, extra_body={"interp": {"points": ["resid_post.99"]}})
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="m", prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=PROMPT, stream=True, extra_body={"interp": {"points": ["embed"]}})
    # the server keeps serving
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def test_the_model_list_names_the_served_model(server: LiveServer, client: openai.OpenAI, direct: Any) -> None:
    """``client.models.list()``, what OpenAI clients call first: the one served model under the
    name completions report, retrievable by that id; an id not served is a 404 in the server's
    error shape."""
    before = int(time.time())
    listed = list(client.models.list())
    assert [m.id for m in listed] == ["interp:tiny"]
    card = listed[0]
    assert card.object == "model" and card.owned_by == "interp-engine" and 0 < card.created <= before
    assert card.model_extra is not None
    assert card.model_extra["max_model_len"] == direct.info.n_ctx and card.model_extra["backend"] == "eager"
    # the id is the name a completion answers under when its request names none
    raw = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert raw.json()["model"] == card.id
    assert client.models.retrieve(card.id) == card
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.status_code == 404
    assert missing.value.response.json() == {
        "error": "UnknownModel",
        "message": "no model 'gpt-4o' is served here; this server serves 'interp:tiny'",
        "field": "model",
        "valid": ["interp:tiny"],
    }
    with pytest.raises(openai.NotFoundError):  # an id with a slash, as hub ids and paths have
        client.models.retrieve("org/interp:tiny")
    # the list needs the API key like every route but health
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # both routes count under their templates in the metrics
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'interp_requests_total{endpoint="/v1/models",status="200"}' in metrics
    assert 'interp_requests_total{endpoint="/v1/models/{model:path}",status="404"}' in metrics
