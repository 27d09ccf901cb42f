"""interp-vllm inside ``vllm serve``: a real ``vllm serve`` process (the CPU build, the shipped
``interp:tiny`` model, its own loopback port, started once for this module with
``VLLM_PLUGINS=interp_vllm`` and compiling the model as vLLM does by default: no
``--enforce-eager``), driven by the ``openai`` client.

Steering sent per request on vLLM's own ``/v1/completions`` and ``/v1/chat/completions``
(streamed or not) equals the same spec through the Python API on the same engine (the ``/interp``
routes, which serve ``load_model(..., backend="vllm")``'s model) and on the eager backend; span
names equal explicit positions; a preset's model name equals its spec sent per request;
readouts, the lens and points at a few positions in the answer (and per stream chunk) equal the
Python API's; the ``/interp`` capture routes equal the eager backend; 16 concurrent mixed requests
equal their solo runs; bad specs and points are ``400`` with the typed error, the API key guards
the new routes, and the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from interp_engine import Address, FeatureWrite, SteeringSpec, Write, load_sae, shipped_saes, tiny_model_path
from interp_testkit.vllm_serve import VllmServe

KEY = "serve-test-key-7"
SERVED = "tiny"
PRESET = "tiny-calm"
PROMPT = "The capital of France is"
D_MODEL = 128


def _spec(scale: float = 4.0, positions: Any = "all", layer: int = 1) -> SteeringSpec:
    vector = torch.randn(D_MODEL, generator=torch.Generator().manual_seed(layer))
    return SteeringSpec([Write(Address("resid_post", layer), vector, op="add", scale=scale, positions=positions)])


PRESET_SPEC = _spec(6.0, layer=2)


def _config() -> str:
    sae = str(shipped_saes()["interp:tiny-sae"])
    return json.dumps({"interp": {"saes": {"res": sae}, "presets": {PRESET: PRESET_SPEC.to_dict()}}})


ARGS = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    args = [*ARGS, "--api-key", KEY, "--additional-config", _config()]
    with VllmServe(tiny_model_path(), args, log, env={"VLLM_PLUGINS": "interp_vllm"}) as running:
        yield running.wait()


@pytest.fixture(scope="module")
def client(server: VllmServe) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _post(server: VllmServe, path: str, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def _steered(
    client: openai.OpenAI, spec: SteeringSpec | None, *, model: str = SERVED, max_tokens: int = 8, **extra: Any
) -> Any:
    """A greedy completion of ``PROMPT`` with ``spec`` sent per request (``extra``: more body fields),
    its tokens as ids in ``logprobs.tokens``."""
    body = {"return_tokens_as_token_ids": True, **extra}
    if spec is not None:
        body["interp"] = {"steering": spec.to_dict()}
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, extra_body=body
    )


def _chat(
    client: openai.OpenAI, messages: list[dict[str, str]], spec: SteeringSpec | None = None, **options: Any
) -> Any:
    """A greedy chat completion of 8 tokens, with ``spec`` sent per request."""
    extra = {"interp": {"steering": spec.to_dict()}} if spec is not None else None
    return client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=8, temperature=0, extra_body=extra, **options
    )


def _python_api(server: VllmServe, spec: SteeringSpec | None, max_tokens: int = 8) -> list[int]:
    """The same completion through the Python API's model on the same engine (``/interp``)."""
    body: dict[str, Any] = {"text": PROMPT, "max_tokens": max_tokens}
    if spec is not None:
        body["steering"] = spec.to_dict()
    answer = _post(server, "/interp/v1/generate", body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["token_ids"])


def _ids(out: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_steering_on_vllms_completions_equals_the_python_api(
    server: VllmServe, client: openai.OpenAI, direct: Any
) -> None:
    plain = _steered(client, None)
    spec = _spec()
    steered = _steered(client, spec)
    ids = _ids(steered)
    assert ids == _python_api(server, spec)
    eager = direct.generate(direct.to_tokens(PROMPT)[0].tolist(), max_tokens=8, steering_spec=spec)
    assert ids == eager.token_ids
    assert steered.choices[0].text != plain.choices[0].text
    # the spec as a JSON string in vllm_xargs, as a client that only knows vLLM sends it
    again = _steered(client, None, vllm_xargs={"interp": json.dumps({"steering": spec.to_dict()})})
    assert _ids(again) == ids


def test_steered_logprobs_equal_the_python_apis(server: VllmServe, client: openai.OpenAI) -> None:
    spec = _spec(2.0)
    out = _steered(client, spec, max_tokens=6)
    answer = _post(
        server,
        "/interp/v1/generate",
        {"text": PROMPT, "max_tokens": 6, "n_logprobs": 1, "steering": spec.to_dict()},
    )
    assert answer.status_code == 200, answer.text
    ours = [step["logprobs"][0][1] for step in answer.json()["steps"]]
    theirs = out.choices[0].logprobs.token_logprobs
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-4


def test_a_streamed_chat_equals_the_whole_one_and_span_names_equal_positions(
    server: VllmServe, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    named = _spec(3.0, positions="user[-1]")
    whole = _chat(client, messages, named)
    chunks = _chat(client, messages, named, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    # the same write at the positions the span selects, found through the Python API's chat tokens
    tokens = _post(server, "/interp/v1/tokenize", {"messages": messages})
    assert tokens.status_code == 200, tokens.text
    span = next(s for s in tokens.json()["chat"]["messages"] if s["role"] == "user")
    explicit = _spec(3.0, positions=list(range(span["start"], span["end"])))
    by_hand = _chat(client, messages, explicit)
    plain = _chat(client, messages)
    assert by_hand.choices[0].message.content == whole.choices[0].message.content
    assert plain.choices[0].message.content != whole.choices[0].message.content


def test_a_preset_is_its_spec_sent_per_request(client: openai.OpenAI) -> None:
    listed = [m.id for m in client.models.list().data]
    assert SERVED in listed and PRESET in listed
    by_name = client.completions.create(model=PRESET, prompt=PROMPT, max_tokens=8, temperature=0)
    per_request = _steered(client, PRESET_SPEC)
    assert by_name.choices[0].text == per_request.choices[0].text
    assert by_name.choices[0].text != _steered(client, None).choices[0].text


def test_presets_change_at_run_time_for_the_next_request(server: VllmServe, client: openai.OpenAI) -> None:
    spec = _spec(5.0, layer=3)
    answer = httpx.put(
        f"{server.url}/interp/v1/presets/tiny-late",
        content=json.dumps(spec.to_dict()),
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert "tiny-late" in [m.id for m in client.models.list().data]
    by_name = client.completions.create(model="tiny-late", prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_name.choices[0].text == _steered(client, spec).choices[0].text
    gone = httpx.delete(f"{server.url}/interp/v1/presets/tiny-late", headers={"Authorization": f"Bearer {KEY}"})
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-late", prompt=PROMPT, max_tokens=2)
    unauthorized = httpx.put(
        f"{server.url}/interp/v1/presets/x", content=json.dumps(spec.to_dict()), headers={"Authorization": "Bearer no"}
    )
    assert unauthorized.status_code == 401


def test_a_feature_write_names_the_attached_sae(client: openai.OpenAI, direct: Any) -> None:
    spec = SteeringSpec([FeatureWrite("res", 3, op="clamp", value=50.0)])
    out = _steered(client, spec)
    assert out.choices[0].text != _steered(client, None).choices[0].text


@pytest.mark.parametrize(
    ("steering", "kind"),
    [
        ({"writes": [{"address": "resid_post.9", "vector": [0.0] * D_MODEL}]}, "LayerOutOfRange"),
        ({"writes": [{"address": "resid_post.1", "vector": [0.0] * 3}]}, "InvalidSteering"),
        ({"writes": [{"address": "resid_post.1", "vector": [float("nan")] + [0.0] * (D_MODEL - 1)}]}, None),
        ({"writes": [{"sae": "missing", "feature": 1}]}, None),
        ({"writes": [{"adress": "resid_post.1"}]}, "InvalidSteering"),
        ("not a spec", "InvalidOption"),
    ],
    ids=["layer", "width", "nan", "unknown-sae", "misspelt", "string"],
)
def test_a_bad_spec_is_a_400_naming_the_error_and_the_server_serves_on(
    server: VllmServe, client: openai.OpenAI, steering: Any, kind: str | None
) -> None:
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 4, "interp": {"steering": steering}}
    if steering == "not a spec":
        body["interp"] = steering
    text = json.dumps(body)  # NaN as JSON's NaN literal, which vLLM's parser reads
    answer = httpx.post(
        f"{server.url}/v1/completions",
        content=text,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert error["message"]
    if kind is not None:
        assert error["type"] == kind
    assert _steered(client, None).choices[0].text  # still serving


def test_the_interp_routes_need_the_api_key(server: VllmServe) -> None:
    assert _post(server, "/interp/v1/generate", {"text": PROMPT, "max_tokens": 2}, key=None).status_code == 401
    assert _post(server, "/interp/v1/generate", {"text": PROMPT, "max_tokens": 2}, key="wrong").status_code == 401
    assert _post(server, "/v1/completions", {"model": SERVED, "prompt": PROMPT}, key="wrong").status_code == 401
    assert _post(server, "/interp/v1/generate", {"text": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_client_cannot_send_the_workers_payload_itself(client: openai.OpenAI) -> None:
    """``vllm_xargs`` reaches ``SamplingParams.extra_args``; whatever a client puts under the
    workers' key is served as a plain request."""
    plain = _steered(client, None)
    forged = client.completions.create(
        model=SERVED,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"vllm_xargs": {"interp_engine": json.dumps({"id": "x", "writes": []})}},
    )
    assert forged.choices[0].text == plain.choices[0].text


def _mixed(client: openai.OpenAI, i: int) -> tuple[str, Any]:
    """The ``i``-th of 8 kinds of request: plain, steered, a preset, steered at two positions,
    with readouts and the lens, streamed and steered, streamed with readouts, with points; its
    text and its ``interp`` answer (streamed: the steps of every chunk, in order)."""
    kind = i % 8
    spec = [None, _spec(), None, _spec(3.0, positions=[0, 1], layer=3), _spec(2.0, layer=0), _spec(), None, _spec()]
    interp: dict[str, Any] = {"steering": spec[kind].to_dict()} if spec[kind] is not None else {}
    if kind in (4, 6):
        interp.update({"features": [READOUT], "lens": LENS})
    if kind == 7:
        interp.update({"points": ["resid_post.2"], "positions": [1, 6, 8]})
    body = {"interp": interp} if interp else None
    model = PRESET if kind == 2 else SERVED
    if kind in (5, 6):
        chunks = list(
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body=body
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        extras = [c.model_extra["interp"] for c in chunks if c.model_extra and "interp" in c.model_extra]
        return text, [step for extra in extras for step in extra.get("steps", [])]  # chunks vary with timing
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=body)
    return out.choices[0].text, (out.model_extra or {}).get("interp")


def _close(got: Any, want: Any) -> None:
    """JSON answers equal: every string and int exactly, floats to 1e-4."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want)
        for key in want:
            _close(got[key], want[key])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _close(a, b)
    elif isinstance(want, float):
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
    else:
        assert got == want


def test_sixteen_concurrent_mixed_requests_each_equal_their_solo_runs(client: openai.OpenAI) -> None:
    solo = [_mixed(client, i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: _mixed(client, i), range(16)))
    assert [text for text, _ in together] == [text for text, _ in solo]
    for (_, got), (_, want) in zip(together, solo, strict=True):
        _close(got, want)
    assert solo[4][1]["steps"] and solo[6][1] and solo[7][1]["activations"]["resid_post.2"]  # readouts, points


def test_steering_on_the_responses_api_equals_the_same_chat(client: openai.OpenAI) -> None:
    spec = _spec(3.0)
    asked = {"interp": {"steering": spec.to_dict()}}
    text = "Tell me about Paris."
    steered = client.responses.create(model=SERVED, input=text, max_output_tokens=8, temperature=0, extra_body=asked)
    plain = client.responses.create(model=SERVED, input=text, max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0, extra_body=asked
    )
    assert steered.output_text == chat.choices[0].message.content
    assert steered.output_text != plain.output_text
    # points at the prompt's positions come with a response too, as with the same chat
    points = {"interp": {**asked["interp"], "points": ["resid_post.2"], "positions": "prompt"}}
    read = client.responses.create(model=SERVED, input=text, max_output_tokens=4, temperature=0, extra_body=points)
    same = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, extra_body=points
    )
    assert read.model_extra is not None and same.model_extra is not None
    _close(read.model_extra["interp"], same.model_extra["interp"])
    assert len(read.model_extra["interp"]["positions"]) > 5


def test_vllms_metrics_count_steered_requests(server: VllmServe, client: openai.OpenAI) -> None:
    def finished() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    before = finished()
    _steered(client, _spec())
    assert finished() == before + 1


READOUT = "features:res:top4"
LENS = {"layers": [1, 3], "top_k": 3}


def _reference_steps(server: VllmServe, spec: SteeringSpec | None) -> list[dict[str, Any]]:
    """Each generated token's readouts and lens through the Python API on the same engine."""
    body: dict[str, Any] = {"text": PROMPT, "max_tokens": 6, "features": [READOUT], "lens": LENS}
    if spec is not None:
        body["steering"] = spec.to_dict()
    answer = _post(server, "/interp/v1/generate", body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["steps"])


def _same_steps(ours: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert [s["position"] for s in ours] == [s["position"] for s in reference]
    for got, want in zip(ours, reference, strict=True):
        assert got["lens"]["ids"] == want["lens"]["ids"] and got["lens"]["tokens"] == want["lens"]["tokens"]
        assert torch.allclose(torch.tensor(got["lens"]["probs"]), torch.tensor(want["lens"]["probs"]), atol=1e-5)
        readout, expected = got["features"][READOUT], want["features"][READOUT]
        assert readout["ids"] == expected["ids"]
        assert torch.allclose(torch.tensor(readout["values"]), torch.tensor(expected["values"]), atol=1e-4)


def test_readouts_and_the_lens_come_with_the_completion(server: VllmServe, client: openai.OpenAI) -> None:
    spec = _spec(2.0)
    out = client.completions.create(
        model=SERVED,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"interp": {"steering": spec.to_dict(), "features": [READOUT], "lens": LENS}},
    )
    assert out.model_extra is not None
    steps = out.model_extra["interp"]["steps"]
    assert len(steps) == 6
    _same_steps(steps, _reference_steps(server, spec))


def test_a_stream_carries_each_tokens_readouts_in_its_chunk(server: VllmServe, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=SERVED,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"interp": {"features": [READOUT], "lens": LENS}},
        )
    )
    steps = [
        step for c in chunks if c.model_extra and "interp" in c.model_extra for step in c.model_extra["interp"]["steps"]
    ]
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert all(c.model_extra and c.model_extra.get("interp") for c in with_text)  # each token's chunk has its step
    _same_steps(steps, _reference_steps(server, None))


def test_bad_readouts_are_a_400(client: openai.OpenAI) -> None:
    for interp in ({"features": ["features:nope:top4"]}, {"lens": {"layers": [9]}}, {"lens": [1]}, {"captures": 1}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, extra_body={"interp": interp})
    assert _steered(client, None).choices[0].text


def _fuzzed(seed: int) -> Any:
    """A request body whose ``interp`` field is random JSON of the shapes a client might send."""
    import random

    rng = random.Random(seed)
    atoms: list[Any] = [None, True, 0, -1, 2**40, 1.5, float("inf"), "", "resid_post.1", "user[-1]", "all", [], {}]

    def value(depth: int) -> Any:
        kind = rng.random()
        if depth > 2 or kind < 0.4:
            return rng.choice(atoms)
        if kind < 0.7:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        keys = ["steering", "features", "lens", "points", "writes", "address", "vector", "op", "positions"]
        keys += ["layers", "top_k"]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 3))}

    write = {"address": rng.choice(["resid_post.1", "attn_z.0", "mlp_post.9", "x"]), "vector": value(1)}
    points = {"points": rng.choice([value(1), ["resid_post.1", "attn_pattern.0", "x.1"]]), "positions": value(1)}
    interp = rng.choice(
        [value(0), {"steering": {"writes": [write]}}, {"lens": value(1)}, {"features": value(1)}, points]
    )
    return {"model": SERVED, "prompt": PROMPT, "max_tokens": 2, "interp": interp}


def test_no_request_body_gets_a_5xx(server: VllmServe, client: openai.OpenAI) -> None:
    for seed in range(60):
        body = _fuzzed(seed)
        answer = httpx.post(
            f"{server.url}/v1/completions",
            content=json.dumps(body),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=60,
        )
        assert answer.status_code < 500, (body, answer.text)
    huge = {"writes": [{"address": "resid_post.1", "vector": [0.5] * 2_000_000}]}
    answer = _post(
        server, "/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 2, "interp": {"steering": huge}}
    )
    assert 400 <= answer.status_code < 500
    assert _steered(client, None).choices[0].text  # still serving


def test_a_stream_closed_early_leaves_nothing_in_the_workers(server: VllmServe) -> None:
    body = {
        "model": SERVED,
        "prompt": PROMPT,
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "interp": {"steering": _spec().to_dict(), "features": [READOUT], "lens": LENS},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as answer:
        lines = answer.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
    deadline = time.monotonic() + 15
    while True:
        stats = httpx.get(f"{server.url}/interp/v1/workers", headers=headers, timeout=30).json()["workers"]
        if all(worker["live_requests"] == 0 for worker in stats) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(worker["live_requests"] == 0 for worker in stats), stats


def test_saes_are_attached_and_detached_at_run_time(server: VllmServe, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    path = str(shipped_saes()["interp:tiny-sae"])
    answer = httpx.put(f"{server.url}/interp/v1/saes/late", json={"path": path}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    clamp = SteeringSpec([FeatureWrite("late", 3, op="clamp", value=50.0)])
    same = SteeringSpec([FeatureWrite("res", 3, op="clamp", value=50.0)])
    assert _steered(client, clamp).choices[0].text == _steered(client, same).choices[0].text
    readout = client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=2, extra_body={"interp": {"features": ["features:late:top4"]}}
    )
    assert readout.model_extra is not None and len(readout.model_extra["interp"]["steps"]) == 2
    for bad in ({"path": "/nonexistent"}, {"folder": path}, ["x"]):
        refused = httpx.put(f"{server.url}/interp/v1/saes/other", json=bad, headers=headers, timeout=60)
        assert 400 <= refused.status_code < 500, refused.text
    assert httpx.delete(f"{server.url}/interp/v1/saes/late", headers=headers, timeout=60).status_code == 200
    with pytest.raises(openai.BadRequestError):
        _steered(client, clamp)
    assert httpx.delete(f"{server.url}/interp/v1/saes/late", headers=headers, timeout=60).status_code == 400


POINTS = ["resid_post.1", "mlp_out.3"]


def _decoded(encoded: dict[str, Any]) -> torch.Tensor:
    """A tensor of interp serve's JSON form (base64 float32)."""
    import base64

    raw = base64.b64decode(encoded["data"])
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(encoded["shape"])


def _n_prompt(server: VllmServe) -> int:
    answer = _post(server, "/interp/v1/tokenize", {"text": PROMPT})
    assert answer.status_code == 200, answer.text
    return len(answer.json()["token_ids"])


def test_points_at_a_few_positions_come_with_the_completion(
    server: VllmServe, client: openai.OpenAI, direct: Any
) -> None:
    from interp_engine import capture_generation

    spec = _spec(2.0)
    n = _n_prompt(server)
    positions = [0, 2, n - 1, n + 2]
    interp = {"steering": spec.to_dict(), "points": POINTS, "positions": positions}
    out = client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"interp": interp}
    )
    assert out.model_extra is not None
    answer = out.model_extra["interp"]
    assert answer["positions"] == positions and sorted(answer["activations"]) == sorted(POINTS)
    # the Python API's model on the same engine (/interp), and the eager backend
    whole = _post(
        server,
        "/interp/v1/capture_generation",
        {"text": PROMPT, "points": POINTS, "max_tokens": 6, "steering": spec.to_dict()},
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["completion"]["text"] == out.choices[0].text
    tokens = direct.to_tokens(PROMPT)[0].tolist()
    completion, cache = capture_generation(
        direct, tokens, POINTS, max_tokens=6, steering_spec=spec, positions=positions
    )
    assert completion.text == out.choices[0].text
    for point in POINTS:
        got = torch.tensor(answer["activations"][point])
        assert got.shape == (len(positions), D_MODEL)
        same_engine = _decoded(whole.json()["activations"][point])[positions]
        assert torch.allclose(got, same_engine, atol=1e-5), point
        assert torch.allclose(got, cache[point][0], atol=1e-4, rtol=1e-4), (point, (got - cache[point][0]).abs().max())
    # streamed: the points come in the chunk before [DONE]
    chunks = list(
        client.completions.create(
            model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, extra_body={"interp": interp}
        )
    )
    extras = [c.model_extra["interp"] for c in chunks if c.model_extra and "interp" in c.model_extra]
    assert len(extras) == 1 and extras[0]["positions"] == positions
    _close(extras[0]["activations"], answer["activations"])


def test_points_at_chat_spans_equal_explicit_positions(server: VllmServe, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    tokens = _post(server, "/interp/v1/tokenize", {"messages": messages})
    assert tokens.status_code == 200, tokens.text
    span = next(s for s in tokens.json()["chat"]["messages"] if s["role"] == "user")

    def read(positions: Any) -> dict[str, Any]:
        out = client.chat.completions.create(
            model=SERVED,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=3,
            temperature=0,
            extra_body={"interp": {"points": ["resid_post.0"], "positions": positions}},
        )
        assert out.model_extra is not None
        return dict(out.model_extra["interp"])

    named, explicit = read("user[-1]"), read(list(range(span["start"], span["end"])))
    assert named["positions"] == explicit["positions"] == list(range(span["start"], span["end"]))
    assert named["activations"] == explicit["activations"]


def test_points_past_the_generation_are_left_out(server: VllmServe, client: openai.OpenAI) -> None:
    n = _n_prompt(server)
    ids = _ids(_steered(client, None, max_tokens=4))
    positions = [0, n, n + 2]
    out = client.completions.create(
        model=SERVED,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={
            "stop_token_ids": [ids[1]],  # the generation ends at its second token
            "interp": {"points": ["resid_post.1"], "positions": positions},
        },
    )
    assert out.model_extra is not None and out.usage is not None
    generated = out.usage.completion_tokens
    assert generated < 4
    kept = [p for p in positions if p < n + generated - 1]  # vLLM never runs the last token it samples
    assert out.model_extra["interp"]["positions"] == kept
    assert len(out.model_extra["interp"]["activations"]["resid_post.1"]) == len(kept)


@pytest.mark.parametrize(
    ("interp", "kind", "param", "max_tokens"),
    [
        ({"points": ["resid_post.1"]}, "InvalidOption", "interp.positions", 2),
        ({"points": ["resid_post.1"], "positions": [0, 200]}, "InvalidOption", "interp.positions", 2),
        ({"points": ["resid_post.1"], "positions": [-1]}, "InvalidOption", "interp.positions", 2),
        ({"points": ["resid_post.1"], "positions": [0, 0]}, "InvalidOption", "interp.positions", 2),
        ({"points": ["resid_post.9"], "positions": [0]}, "LayerOutOfRange", "interp.points[0]", 2),
        ({"points": ["resid_post.1", "nope.1"], "positions": [0]}, "UnknownKind", "interp.points[1]", 2),
        ({"points": "resid_post.1", "positions": [0]}, "InvalidOption", "interp.points", 2),
        (
            {"points": ["mlp_post.0", "mlp_post.1", "mlp_post.2"], "positions": list(range(60))},
            "LimitExceeded",
            None,
            64,
        ),
        ({"points": ["resid_post.1"], "positions": "assistant"}, "InvalidOption", "interp.positions", 2),
    ],
    ids=["no-positions", "past", "negative", "twice", "layer", "kind", "not-a-list", "cap", "span-on-text"],
)
def test_bad_points_are_a_400_naming_the_field(
    server: VllmServe, client: openai.OpenAI, interp: dict[str, Any], kind: str, param: str | None, max_tokens: int
) -> None:
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": max_tokens, "interp": interp}
    answer = _post(server, "/v1/completions", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == kind, error
    if param is not None:
        assert error["param"] == param, error
    if kind == "LimitExceeded":
        assert error["valid"] == 65536 and "points_max_values" in error["message"]
    assert _steered(client, None).choices[0].text  # still serving


def test_the_capture_routes_equal_the_python_api(server: VllmServe, direct: Any) -> None:
    """``/interp/v1/capture`` and ``/interp/v1/capture_generation`` of the mounted app serve the
    same engine as vLLM's routes and equal the Python API (eager backend, same spec)."""
    from interp_engine import Cache, run_with_cache

    spec = _spec(2.0, layer=2)
    tokens = direct.to_tokens(PROMPT)[0].tolist()
    body = {"token_ids": tokens, "points": ["resid_post.2", READOUT], "steering": spec.to_dict()}
    captured = _post(server, "/interp/v1/capture", body)
    assert captured.status_code == 200, captured.text
    direct.attach_sae("res", load_sae(shipped_saes()["interp:tiny-sae"]))
    try:
        reference = run_with_cache(direct, tokens, ["resid_post.2", READOUT], steering_spec=spec)
    finally:
        direct.detach_sae("res")
    got = _decoded(captured.json()["activations"]["resid_post.2"])
    assert torch.allclose(got, reference["resid_post.2"][0], atol=1e-4, rtol=1e-4)
    readout = captured.json()["features"][READOUT]
    assert torch.tensor(readout["ids"]).tolist() == reference[READOUT].ids[0].tolist()
    # the whole generation's capture as a safetensors Cache file
    answer = httpx.post(
        f"{server.url}/interp/v1/capture_generation",
        json={"token_ids": tokens, "points": ["resid_post.3"], "max_tokens": 5, "format": "safetensors"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(answer.content)
        f.flush()
        cache = Cache.load(f.name)
    from interp_engine import capture_generation

    _, eager = capture_generation(direct, tokens, ["resid_post.3"], max_tokens=5)
    assert cache["resid_post.3"].shape == eager["resid_post.3"].shape
    assert torch.allclose(cache["resid_post.3"], eager["resid_post.3"], atol=1e-4, rtol=1e-4)
