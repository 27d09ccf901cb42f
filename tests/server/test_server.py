"""The HTTP server (``interp_engine.server``), started for real with uvicorn on a loopback port and
driven with ``httpx``, on the eager backend and a tiny local GPT-2.

The numbers each endpoint returns are checked against the same checkpoint's eager model called
directly and against HF ``transformers`` (the oracle).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import torch

from interp_engine import Address, Cache, InvalidOption, SteeringSpec, Write, load_model, sync_model
from interp_engine.server import ServerLimits, create_app
from interp_testkit.suite import PROMPT, hf_for, rel_diff, tiny_model_path

from ..support.engines import eager_model
from ..support.servers import LiveServer, sse, tensor

TOL = 1e-4
FAMILY = "gpt2"
LIMITS = ServerLimits(max_body_bytes=256 * 1024, max_activation_values=50_000, max_new_tokens=64)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """The server as ``interp serve`` runs it: the app's lifespan loads the model from its path."""
    app = create_app(tiny_model_path(FAMILY), backend="eager", limits=LIMITS)
    with LiveServer(app, run_config=False) as running:
        model = app.state.served.model
        assert model is not None and model.backend == "eager"
        yield running
    # the lifespan shut down the model it loaded
    assert app.state.served.model is None
    with pytest.raises(Exception, match="shut down"):
        sync_model(model).capture([1, 2], ["resid_post.0"])


@pytest.fixture(scope="module")
def direct() -> Any:
    """The same checkpoint's eager model, called directly (sync facade)."""
    return sync_model(eager_model(FAMILY))


def oracle() -> Any:
    return hf_for(tiny_model_path(FAMILY))


def hf_run(ids: list[int]) -> Any:
    with torch.no_grad():
        return oracle()(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)


def encoded(value: torch.Tensor) -> dict[str, Any]:
    raw = value.detach().float().contiguous().numpy().astype("<f4").tobytes()
    return {"dtype": "float32", "shape": list(value.shape), "data": base64.b64encode(raw).decode()}


def steering(seed: int, layer: int = 0, scale: float = 4.0) -> SteeringSpec:
    vector = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    return SteeringSpec([Write(Address("resid_post", layer), vector, op="add", scale=scale)])


def steer_hf(ids: list[int], spec: SteeringSpec) -> Any:
    """HF's forward with ``spec``'s single add at ``resid_post.L`` as a forward hook."""
    (write,) = spec.writes
    assert write.address.kind == "resid_post" and write.op == "add"

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + write.scale * write.vector
        return (output[0] + write.scale * write.vector, *output[1:])

    handle = oracle().transformer.h[write.address.layer].register_forward_hook(hook)
    try:
        return hf_run(ids)
    finally:
        handle.remove()


# -- the model and the schema ----------------------------------------------------------------


def test_health_model_info_and_openapi(client: httpx.Client, direct: Any) -> None:
    assert client.get("/v1/health").json() == {"status": "ok", "backend": "eager", "in_flight": 0}
    info = client.get("/v1/model").json()
    model = direct.model
    assert info["backend"] == "eager"
    assert info["info"]["n_layers"] == model.info.n_layers == 3
    assert info["info"]["d_model"] == model.info.d_model
    assert info["layers"] == [0, 1, 2]
    assert {"resid_post.2", "mlp_post.0", "attn_pattern.1", "embed", "logits"} <= set(info["addresses"])
    assert "resid_post.3" not in info["addresses"]
    kinds = {k["kind"]: k for k in info["kinds"]}
    assert kinds["mlp_post"]["size"] == model.info.d_mlp and kinds["logits"]["size"] == model.info.vocab_size
    assert kinds["logits"]["writable"] is False and kinds["resid_post"]["writable"] is True
    # the kinds this family has (model.points()): GPT-2 has no gate branch and no q-norm
    assert list(kinds) == list(model.points()) and {"attn_in", "mlp_pre", "attn_scores", "logits_raw"} <= set(kinds)
    assert "mlp_pre_linear" not in kinds and "q_norm_out" not in kinds and "mlp_pre_linear.0" not in info["addresses"]
    assert kinds["attn_scores"]["writable"] is False and kinds["mlp_pre"]["size"] == model.info.d_mlp
    assert info["limits"]["max_body_bytes"] == LIMITS.max_body_bytes

    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/health",
        "/v1/model",
        "/v1/tokenize",
        "/v1/capture",
        "/v1/generate",
        "/v1/capture_generation",
        "/v1/decode_residuals",
        "/v1/attention",
    ):
        assert path in paths, path
    assert client.get("/docs").status_code == 200

    tokens = client.post("/v1/tokenize", json={"text": PROMPT}).json()
    assert tokens["token_ids"] == model.to_tokens(PROMPT)[0].tolist()
    assert tokens["str_tokens"] == model.to_str_tokens(tokens["token_ids"])


# -- each endpoint against the model and HF ----------------------------------------------------


def test_capture_equals_model_and_hf(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    points = ["embed", "resid_post.0", "resid_post.-2", "mlp_post.1", "final_norm", "logits"]
    by_text = client.post("/v1/capture", json={"text": PROMPT, "points": points})
    assert by_text.status_code == 200, by_text.text
    body = by_text.json()
    assert body["token_ids"] == ids
    by_ids = client.post("/v1/capture", json={"token_ids": ids, "points": points}).json()
    assert by_ids == body

    acts = {key: tensor(value) for key, value in body["activations"].items()}
    assert list(acts) == points
    alone = direct.capture(ids, points)
    for name in points:
        assert rel_diff(acts[name], alone[Address.parse(name)]) <= 1e-6, name
    reference = hf_run(ids)
    assert rel_diff(acts["embed"], reference.hidden_states[0][0]) <= TOL
    assert rel_diff(acts["resid_post.0"], reference.hidden_states[1][0]) <= TOL
    assert rel_diff(acts["resid_post.-2"], reference.hidden_states[2][0]) <= TOL
    assert rel_diff(acts["final_norm"], reference.hidden_states[3][0]) <= TOL
    assert rel_diff(acts["logits"], reference.logits[0]) <= TOL


@pytest.mark.parametrize("ask", ["format", "accept"])
def test_capture_as_safetensors_is_a_cache_file(client: httpx.Client, direct: Any, ask: str, tmp_path: Any) -> None:
    from safetensors import safe_open

    ids = direct.to_tokens(PROMPT)[0].tolist()
    request: dict[str, Any] = {"token_ids": ids, "points": ["resid_post.1", "mlp_post.0"]}
    headers = {}
    if ask == "format":
        request["format"] = "safetensors"
    else:
        headers["Accept"] = "application/octet-stream"
    response = client.post("/v1/capture", json=request, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    path = tmp_path / "acts.safetensors"
    path.write_bytes(response.content)
    cache = Cache.load(path)  # the core's Cache format: batch axis of 1
    alone = direct.capture(ids, ["resid_post.1", "mlp_post.0"])
    assert rel_diff(cache["resid_post.1"][0], alone[Address("resid_post", 1)]) <= 1e-6
    assert rel_diff(cache["mlp_post.0"][0], alone[Address("mlp_post", 0)]) <= 1e-6
    assert cache.lengths is not None and cache.lengths.tolist() == [len(ids)]
    with safe_open(path, framework="pt") as f:
        assert json.loads(f.metadata()["token_ids"]) == ids


def test_steered_capture_equals_model_and_hf(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    spec = steering(1)
    body = {"token_ids": ids, "points": ["resid_post.2"], "steering": spec.to_dict()}
    steered = tensor(client.post("/v1/capture", json=body).json()["activations"]["resid_post.2"])
    plain = tensor(client.post("/v1/capture", json={**body, "steering": None}).json()["activations"]["resid_post.2"])
    alone = direct.capture(ids, ["resid_post.2"], steering_spec=spec)[Address("resid_post", 2)]
    assert rel_diff(steered, alone) <= 1e-6
    assert not torch.allclose(steered, plain)
    mid_body = client.post("/v1/capture", json={**body, "points": ["resid_post.1"]}).json()
    mid = tensor(mid_body["activations"]["resid_post.1"])
    assert rel_diff(mid, steer_hf(ids, spec).hidden_states[2][0]) <= TOL

    # activation patching: a `set` with another run's activations, sent back as an encoded tensor
    clean_ids = direct.to_tokens("The capital of France is")[0].tolist()[: len(ids)]
    clean = client.post("/v1/capture", json={"token_ids": clean_ids, "points": ["resid_post.0"]}).json()
    patch = {"writes": [{"address": "resid_post.0", "vector": clean["activations"]["resid_post.0"], "op": "set",
                         "positions": list(range(len(clean_ids)))}]}  # fmt: skip
    patched = client.post("/v1/capture", json={"token_ids": ids, "points": ["logits"], "steering": patch})
    assert patched.status_code == 200, patched.text
    clean_row = tensor(clean["activations"]["resid_post.0"])
    spec_patch = SteeringSpec([Write("resid_post.0", clean_row, op="set", positions=list(range(len(clean_ids))))])
    expected = direct.capture(ids, ["logits"], steering_spec=spec_patch)[Address("logits")]
    assert rel_diff(tensor(patched.json()["activations"]["logits"]), expected) <= 1e-6


def test_generate_and_stream_equal_model_and_hf(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    request = {"token_ids": ids, "max_tokens": 6, "ignore_eos": True}
    completion = direct.generate(ids, max_tokens=6, ignore_eos=True)
    plain = client.post("/v1/generate", json=request).json()
    assert plain == {"token_ids": completion.token_ids, "text": completion.text, "finish_reason": "length"}

    # greedy: each token is HF's argmax after the ones before it
    teacher = hf_run(ids + completion.token_ids)
    n = len(ids)
    assert teacher.logits[0, n - 1 : n + 5].argmax(-1).tolist() == completion.token_ids

    with_logprobs = client.post("/v1/generate", json={**request, "n_logprobs": 3}).json()
    assert with_logprobs["token_ids"] == completion.token_ids
    with client.stream("POST", "/v1/generate", json={**request, "n_logprobs": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse(response))
    assert [e for e, _ in events] == ["token"] * 6 + ["done"]
    steps = [data for _, data in events[:-1]]
    assert steps == with_logprobs["steps"]
    assert events[-1][1] == plain
    assert "".join(s["text"] for s in steps) == completion.text
    for i, step in enumerate(steps):
        expected = torch.log_softmax(teacher.logits[0, n - 1 + i], dim=-1)
        assert step["logprobs"][0][0] == step["token_id"] == completion.token_ids[i]
        for token_id, logprob in step["logprobs"]:
            assert abs(logprob - float(expected[token_id])) <= TOL

    # steered generation equals the steered model
    spec = steering(2, layer=1, scale=8.0)
    steered = client.post("/v1/generate", json={**request, "steering": spec.to_dict()}).json()
    assert steered["token_ids"] == direct.generate(ids, max_tokens=6, ignore_eos=True, steering_spec=spec).token_ids


def test_capture_generation_equals_model_and_hf(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens("Hello world")[0].tolist()
    request = {"token_ids": ids, "points": ["resid_post.0", "mlp_post.2"], "max_tokens": 5, "ignore_eos": True}
    body = client.post("/v1/capture_generation", json=request).json()
    completion, alone = direct.capture_generation(ids, ["resid_post.0", "mlp_post.2"], max_tokens=5, ignore_eos=True)
    assert body["token_ids"] == ids
    assert body["completion"] == {"token_ids": completion.token_ids, "text": completion.text, "finish_reason": "length"}
    full = ids + completion.token_ids
    got = tensor(body["activations"]["resid_post.0"])
    assert got.shape == (len(full), 64)
    assert rel_diff(got, alone[Address("resid_post", 0)]) <= 1e-6
    assert rel_diff(tensor(body["activations"]["mlp_post.2"]), alone[Address("mlp_post", 2)]) <= 1e-6
    assert rel_diff(got, hf_run(full).hidden_states[1][0]) <= TOL

    as_file = client.post("/v1/capture_generation", json={**request, "format": "safetensors"})
    from safetensors.torch import load

    loaded = load(as_file.content)
    assert rel_diff(loaded["resid_post.0"][0], got) == 0


def test_attention_equals_hf(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    body = client.post("/v1/attention", json={"token_ids": ids, "layers": [0, -1]}).json()
    assert set(body["patterns"]) == {"attn_pattern.0", "attn_pattern.-1"}
    reference = hf_run(ids)
    assert rel_diff(tensor(body["patterns"]["attn_pattern.0"]), reference.attentions[0][0]) <= TOL
    assert rel_diff(tensor(body["patterns"]["attn_pattern.-1"]), reference.attentions[2][0]) <= TOL


def test_heads_over_http_capture_write_and_steered_attention(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    d_head = direct.info.d_head
    body = client.post("/v1/capture", json={"token_ids": ids, "points": ["attn_z.1", "attn_k.0"]}).json()
    expected = direct.capture(ids, ["attn_z.1", "attn_k.0"])
    assert torch.equal(tensor(body["activations"]["attn_z.1"]), expected[Address("attn_z", 1)])
    assert list(tensor(body["activations"]["attn_k.0"]).shape) == [len(ids), direct.info.n_kv_heads, d_head]
    # zero-ablate head 0 of layer 0, then read layer 1's pattern: one call, the same as the model's
    spec = SteeringSpec([Write("attn_z.0", torch.zeros(d_head), op="set", heads=[0])])
    request = {"token_ids": ids, "layers": [1], "steering": spec.to_dict()}
    body = client.post("/v1/attention", json=request).json()
    steered = direct.capture_attention(ids, [1], steering_spec=spec)[Address("attn_pattern", 1)]
    assert rel_diff(tensor(body["patterns"]["attn_pattern.1"]), steered) <= TOL
    plain = direct.capture_attention(ids, [1])[Address("attn_pattern", 1)]
    assert not torch.allclose(steered, plain)
    # a per-position, per-head patch arrives as an encoded [positions, heads, d_head] tensor
    rows = expected[Address("attn_z", 1)][:2, [1]]
    write = {"address": "attn_z.1", "vector": encoded(rows), "op": "set", "positions": [0, 1], "heads": [1]}
    body = client.post(
        "/v1/capture", json={"token_ids": ids, "points": ["logits"], "steering": {"writes": [write]}}
    ).json()
    spec = SteeringSpec([Write("attn_z.1", rows, op="set", positions=[0, 1], heads=[1])])
    assert (
        rel_diff(
            tensor(body["activations"]["logits"]),
            direct.capture(ids, ["logits"], steering_spec=spec)[Address("logits")],
        )
        <= TOL
    )
    bad = {"address": "attn_z.1", "vector": [0.0] * d_head, "op": "set", "heads": [99]}
    response = client.post("/v1/capture", json={"token_ids": ids, "points": ["logits"], "steering": {"writes": [bad]}})
    assert response.status_code == 400
    assert "head 99" in response.text


def test_decode_residuals_is_the_logit_lens(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    last = client.post("/v1/capture", json={"token_ids": ids, "points": ["resid_post.-1"]}).json()
    request = {"activations": last["activations"]["resid_post.-1"], "top_k": 5, "return_logits": True}
    body = client.post("/v1/decode_residuals", json=request).json()
    expected = hf_run(ids).logits[0]  # on the last layer's resid_post: the model's own logits
    assert body["shape"] == list(expected.shape)
    logits = tensor(body["logits"])
    assert rel_diff(logits, expected) <= TOL
    assert body["top"]["token_ids"] == torch.topk(logits, 5, dim=-1).indices.tolist()
    assert torch.allclose(torch.tensor(body["top"]["logits"]), torch.topk(expected, 5, dim=-1).values, atol=1e-4)
    lp = torch.log_softmax(expected, -1).gather(-1, torch.tensor(body["top"]["token_ids"]))
    assert torch.allclose(torch.tensor(body["top"]["logprobs"]), lp, atol=1e-4)
    assert body["top"]["tokens"][0] == direct.model.to_str_tokens(body["top"]["token_ids"][0])

    # plain nested lists work too, and a middle layer decodes like the model's decode_residuals
    mid = direct.capture(ids, ["resid_post.0"])[Address("resid_post", 0)]
    lens = client.post("/v1/decode_residuals", json={"activations": mid[:2].tolist(), "top_k": 3}).json()
    assert lens["logits"] is None
    assert lens["top"]["token_ids"] == torch.topk(direct.decode_residuals(mid[:2]), 3, dim=-1).indices.tolist()


# -- concurrency ----------------------------------------------------------------------------------


async def test_32_concurrent_requests_equal_their_solo_runs(server: LiveServer) -> None:
    model = eager_model(FAMILY)
    prompts = [PROMPT, "The capital of France is", "Hello world", "one two three four five six seven"]
    specs = [None, steering(3), steering(4, layer=2, scale=-2.0), steering(5, layer=1)]
    requests: list[tuple[str, dict[str, Any]]] = []
    for i in range(32):
        prompt, spec = prompts[i % 4], specs[(i // 4) % 4]
        body: dict[str, Any] = {"text": prompt}
        if spec is not None:
            body["steering"] = spec.to_dict()
        if i % 2:
            requests.append(("/v1/capture", {**body, "points": ["resid_post.2", "mlp_out.1"]}))
        else:
            requests.append(("/v1/generate", {**body, "max_tokens": 4, "ignore_eos": True, "n_logprobs": 2}))

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post(path, json=body) for path, body in requests))

    for (path, body), response in zip(requests, responses, strict=True):
        assert response.status_code == 200, response.text
        ids = model.to_tokens(body["text"])[0].tolist()
        spec = SteeringSpec.from_dict(body["steering"]) if "steering" in body else None
        got = response.json()
        if path == "/v1/capture":
            alone = await model.capture(ids, ["resid_post.2", "mlp_out.1"], steering_spec=spec)
            for name in ("resid_post.2", "mlp_out.1"):
                assert rel_diff(tensor(got["activations"][name]), alone[Address.parse(name)]) <= 1e-6
        else:
            stream = model.stream(ids, max_tokens=4, ignore_eos=True, n_logprobs=2, steering_spec=spec)
            steps = [s async for s in stream]
            assert got["token_ids"] == [s.token_id for s in steps]
            for step, served in zip(steps, got["steps"], strict=True):
                assert [p[0] for p in served["logprobs"]] == [p[0] for p in step.logprobs]
                assert np.allclose([p[1] for p in served["logprobs"]], [p[1] for p in step.logprobs], atol=1e-6)
    # steering changed what it steers
    assert responses[1].json() != responses[5].json()


# -- bad input ------------------------------------------------------------------------------------

_WRONG_WIDTH = {"writes": [{"address": "resid_post.0", "vector": [1.0] * 7}]}
BAD = [
    ("/v1/capture", {"text": PROMPT, "points": ["resid_post.9"]}, 400, "LayerOutOfRange", "points[0]"),
    ("/v1/capture", {"text": PROMPT, "points": ["resid_post.0", "nope.1"]}, 400, "UnknownKind", "points[1]"),
    ("/v1/capture", {"text": PROMPT, "points": ["mlp_pre_linear.0"]}, 400, "KindNotInFamily", "points[0]"),
    ("/v1/capture", {"token_ids": [1, 99999], "points": ["embed"]}, 400, "InvalidTokens", "token_ids"),
    ("/v1/capture", {"token_ids": [], "points": ["embed"]}, 400, "InvalidTokens", "token_ids"),
    ("/v1/capture", {"text": "", "points": ["embed"]}, 400, "InvalidTokens", "text"),
    ("/v1/capture", {"text": PROMPT, "token_ids": [1], "points": ["embed"]}, 422, "ValidationError", "token_ids"),
    ("/v1/capture", {"text": PROMPT}, 422, "ValidationError", "points"),
    ("/v1/capture", {"text": PROMPT, "points": ["embed"], "point": "x"}, 422, "ValidationError", "point"),
    ("/v1/capture", {"token_ids": ["a"], "points": ["embed"]}, 422, "ValidationError", "token_ids[0]"),
    (
        "/v1/capture",
        {"text": PROMPT, "points": ["embed"], "steering": _WRONG_WIDTH},
        400,
        "InvalidSteering",
        "steering.writes[0].vector",
    ),
    (
        "/v1/capture",
        {"text": PROMPT, "points": ["embed"], "steering": {"writes": [{"address": "logits", "vector": [1.0]}]}},
        400,
        "InvalidSteering",
        "steering.writes[0].address",
    ),
    (
        "/v1/generate",
        {"text": PROMPT, "steering": {"writes": [{"address": "resid_post.0", "vector": [1.0], "op": "mul"}]}},
        422,
        "ValidationError",
        "steering.writes[0].op",
    ),
    ("/v1/generate", {"text": PROMPT, "max_tokens": 0}, 422, "ValidationError", "max_tokens"),
    ("/v1/generate", {"text": PROMPT, "temperature": -1}, 422, "ValidationError", "temperature"),
    ("/v1/generate", {"token_ids": [1] * 100, "max_tokens": 60}, 400, "ContextTooLong", "token_ids"),
    ("/v1/generate", {"token_ids": [1, -5], "stream": True}, 400, "InvalidTokens", "token_ids"),
    (
        "/v1/capture_generation",
        {"text": PROMPT, "points": ["logits"], "max_tokens": 2},
        400,
        "UnsupportedAddress",
        "points",
    ),
    ("/v1/attention", {"text": PROMPT, "layers": [7]}, 400, "LayerOutOfRange", "layers[0]"),
    ("/v1/decode_residuals", {"activations": [[1.0] * 7]}, 400, "InvalidActivations", "activations"),
    (
        "/v1/decode_residuals",
        {"activations": {"dtype": "float32", "shape": [2], "data": "!!"}},
        422,
        "ValidationError",
        "activations.data",
    ),
    (
        "/v1/decode_residuals",
        {"activations": {"dtype": "float32", "shape": [64], "data": "AAAA"}},
        422,
        "ValidationError",
        "activations.data",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "error", "field"), BAD, ids=[f"{b[3]}-{b[4]}" for b in BAD])
def test_bad_requests_are_4xx_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, error: str, field: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    got = response.json()
    assert got["error"] == error
    assert got["field"] == field
    assert got["message"]
    # and the server keeps serving
    assert client.post("/v1/capture", json={"token_ids": [1, 2, 3], "points": ["embed"]}).status_code == 200


def test_errors_carry_what_is_valid_and_bad_json_is_422(client: httpx.Client) -> None:
    got = client.post("/v1/capture", json={"text": PROMPT, "points": ["resid_post.3"]}).json()
    assert got["valid"] == "-3..2"
    got = client.post("/v1/capture", json={"text": PROMPT, "points": ["resdi_post.1"]}).json()
    assert "resid_post" in got["valid"]
    bad = client.post("/v1/capture", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and bad.json()["error"] == "ValidationError"


# -- limits -----------------------------------------------------------------------------------------


def test_limits_are_413_naming_the_field(client: httpx.Client) -> None:
    big = {"text": "x " * 200_000, "points": ["embed"]}  # ~400 KB > 256 KiB
    response = client.post("/v1/capture", json=big)
    assert response.status_code == 413
    assert response.json()["error"] == "LimitExceeded" and response.json()["field"] == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds on the bytes received
        yield b'{"text": "'
        for _ in range(40):
            yield b"x " * 5000
        yield b'", "points": ["embed"]}'

    response = client.post("/v1/capture", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["field"] == "body"

    cases = [
        ("/v1/generate", {"token_ids": [1, 2], "max_tokens": 65}, "max_tokens"),
        ("/v1/generate", {"token_ids": [1, 2], "n_logprobs": 21}, "n_logprobs"),
        ("/v1/capture", {"token_ids": list(range(100)), "points": ["logits"]}, "points"),  # 51,200 values
        ("/v1/attention", {"token_ids": list(range(100)), "layers": [0, 1, 2]}, "layers"),
        ("/v1/decode_residuals", {"activations": [[0.0] * 64] * 100, "top_k": 5, "return_logits": True}, "activations"),
        ("/v1/capture", {"token_ids": [1], "points": ["embed"] * 65}, "points"),
    ]
    for path, body, field in cases:
        response = client.post(path, json=body)
        assert response.status_code == 413, (path, response.text)
        assert response.json()["field"] == field
    assert client.get("/v1/health").status_code == 200
    ok = client.post("/v1/capture", json={"token_ids": list(range(90)), "points": ["logits"]})
    assert ok.status_code == 200


# -- a client that goes away mid-stream -----------------------------------------------------------


class TrackedModel:
    """An eager model whose streams record how many steps they produced and when they closed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.produced = 0
        self.closed = threading.Event()
        self.generating = threading.Event()
        self.cancelled = threading.Event()
        self.shutdowns = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        steps = self.inner.stream(*args, **kwargs)
        try:
            async for step in steps:
                self.produced += 1
                yield step
        finally:
            await steps.aclose()
            self.closed.set()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.generating.set()
        try:
            return await self.inner.generate(*args, **kwargs)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def shutdown(self) -> None:
        self.shutdowns += 1
        await self.inner.shutdown()


def test_client_disconnect_mid_stream_closes_the_model_stream() -> None:
    tracked = TrackedModel(eager_model(FAMILY))
    app = create_app(tracked)  # a model object: served, not shut down by the server
    with LiveServer(app, run_config=False) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        request = {"text": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True, "n_logprobs": 2}
        with client.stream("POST", "/v1/generate", json=request) as response:
            events = sse(response)
            for _ in range(3):
                assert next(events)[0] == "token"
        # the response is closed (and with it the connection) after 3 of 100 tokens
        assert tracked.closed.wait(10), "the model's stream was not closed after the client left"
        assert tracked.produced < 100
        produced = tracked.produced
        time.sleep(0.3)
        assert tracked.produced == produced  # generation stopped

        # the server stays healthy (the stream's request slot is free) and serves the next stream
        assert client.get("/v1/health").json()["in_flight"] == 0
        tracked.closed.clear()
        with client.stream("POST", "/v1/generate", json={**request, "max_tokens": 3}) as response:
            assert [e for e, _ in sse(response)] == ["token"] * 3 + ["done"]
        assert tracked.closed.wait(5)

        # a client that leaves before a plain (non-streamed) generation ends cancels it too
        body = json.dumps({"text": "Hi", "max_tokens": 120, "ignore_eos": True}).encode()
        head = (
            "POST /v1/generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        host, port = running.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            assert tracked.generating.wait(10)
        assert tracked.cancelled.wait(10), "the generation went on after its client left"
        time.sleep(0.2)
        assert client.get("/v1/health").json()["in_flight"] == 0
    assert tracked.shutdowns == 0  # the caller's model outlives the server
    assert sync_model(eager_model(FAMILY)).capture([1, 2], ["embed"])


def test_a_closed_model_is_503_and_misuse_is_refused() -> None:
    model = load_model(tiny_model_path(FAMILY), backend="eager")
    with pytest.raises(InvalidOption, match="backend"):
        create_app(model, backend="eager")
    with pytest.raises(ValueError, match="max_points"):
        ServerLimits(max_points=0)
    with (
        LiveServer(create_app(model), run_config=False) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        assert client.post("/v1/capture", json={"token_ids": [1, 2], "points": ["embed"]}).status_code == 200
        sync_model(model).shutdown()  # its owner shuts it down under the server
        response = client.post("/v1/capture", json={"token_ids": [1, 2], "points": ["embed"]})
        assert response.status_code == 503 and response.json()["error"] == "ModelClosed"


# -- run(): a process that stops cleanly -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_stops_cleanly_on_a_signal(sig: signal.Signals) -> None:
    port = _free_port()
    code = (
        f"from interp_engine.server import run\nrun({str(tiny_model_path(FAMILY))!r}, backend='eager', port={port})\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/capture", json={"text": "Hi", "points": ["embed"]})
        assert response.status_code == 200
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read() if proc.stderr else ""
        assert "Uvicorn running on http://127.0.0.1:" in log  # loopback by default
        assert "Application shutdown complete" in log  # the lifespan (and the model's shutdown) ran
        assert "Traceback" not in log
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_import_interp_engine_does_not_import_the_server_stack() -> None:
    code = (
        "import json, sys, interp_engine\n"
        "print(json.dumps([m for m in ('fastapi', 'starlette', 'pydantic', 'uvicorn') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_a_capture_larger_than_the_capture_memory_cap_is_413() -> None:
    from interp_engine import CaptureMemoryExceeded
    from interp_engine.server._errors import from_interp

    error = from_interp(CaptureMemoryExceeded("too big", needed=10, limit=4, option="capture_memory_bytes"))
    assert error.status_code == 413
    assert error.body() == {"error": "CaptureMemoryExceeded", "message": "too big", "valid": "4"}
