"""The server attacked as a hostile client would, over a real loopback socket (uvicorn configured as
``run`` configures it), on the eager backend and the shipped ``interp:tiny``: authentication, the
trusted Host check, every input that used to give a 500, bounded error bodies, non-finite results,
bounded work (text before tokenizing, header and body deadlines, the connection cap, the slot
wait), the metrics, and memory over 1,000 mixed requests. Each attack is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from interp_engine import load_model
from interp_engine.cli import main as interp_main
from interp_engine.server import LOOPBACK_HOSTS, ServerLimits, create_app

from ..support.servers import LiveServer, is_error_body, read_all

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(
    max_text_chars=10_000,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    keep_alive_s=2.0,
    max_connections=48,
    max_activation_values=200_000,
    max_new_tokens=64,
    max_buffered_bytes=12_000_000,
)
PROMPT = "The capital of France is"
FIXED = {"text": PROMPT, "points": ["resid_post.1", "logits"]}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # configured as run() configures a loopback bind
    app = create_app("interp:tiny", backend="eager", limits=LIMITS, api_key=KEY, trusted_hosts=LOOPBACK_HOSTS)
    with LiveServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} in an answer: not JSON")


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper (no NaN, Infinity)."""
    return json.loads(text, parse_constant=_no_constant)


def fixed_capture(client: httpx.Client) -> dict[str, Any]:
    response = client.post("/v1/capture", json=FIXED)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


# -- authentication and the Host header --------------------------------------------------------


def test_every_endpoint_but_health_needs_the_key(server: LiveServer, client: httpx.Client) -> None:
    routes = [(m, r.path) for r in server.app.routes for m in sorted(getattr(r, "methods", ()) or ()) if m != "HEAD"]
    assert ("POST", "/v1/completions") in routes and ("GET", "/metrics") in routes
    same_length_wrong = "x" * len(KEY)
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for method, path in routes:
            for headers in ({}, {"Authorization": f"Bearer {same_length_wrong}"}, {"Authorization": KEY}):
                response = anonymous.request(method, path, headers=headers, json={})
                if path == "/v1/health":
                    assert response.status_code == 200
                    continue
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"] == "Unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/model").status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_a_host_header_not_loopback_is_refused(server: LiveServer, client: httpx.Client) -> None:
    for host in ("evil.example", "evil.example:80", f"rebind.attacker.test:{server.port}", ""):
        response = client.get("/v1/model", headers={"Host": host})
        assert response.status_code == 400, host
        assert response.json()["error"] == "UntrustedHost"
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}", "LOCALHOST"):
        assert client.get("/v1/model", headers={"Host": host}).status_code == 200, host


def test_run_checks_the_host_on_a_loopback_bind() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = f"from interp_engine.server import run\nrun('interp:tiny', backend='eager', port={port})\n"
    env = {k: v for k, v in os.environ.items() if k != "INTERP_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/model", headers={"Host": "attacker.example"}).json()["error"] == "UntrustedHost"
        assert httpx.get(f"{url}/v1/model", headers={"Host": f"localhost:{port}"}).status_code == 200
        assert httpx.get(f"{url}/v1/model").status_code == 200  # no key given: none asked
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_a_public_bind_without_a_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INTERP_API_KEY", raising=False)
    start = time.monotonic()
    assert interp_main(["serve", "interp:tiny", "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without an API key" in err and "--insecure-no-auth" in err
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert interp_main(["serve", "interp:tiny", "--api-key-file", str(empty)]) == 1
    assert "is empty" in capsys.readouterr().err
    assert interp_main(["serve", "interp:tiny", "--api-key-file", str(tmp_path / "missing")]) == 1
    assert "cannot read the API key file" in capsys.readouterr().err
    assert time.monotonic() - start < 10  # refused before any model loads


def test_serve_reads_the_key_file_and_the_insecure_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import interp_engine.server

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(interp_engine.server, "run", lambda model, **kwargs: calls.append(kwargs))
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    assert interp_main(["serve", "interp:tiny", "--host", "0.0.0.0", "--api-key-file", str(key_file)]) == 0
    assert calls[-1]["api_key"] == KEY and "insecure_no_auth" not in calls[-1]
    assert interp_main(["serve", "interp:tiny", "--host", "0.0.0.0", "--insecure-no-auth"]) == 0
    assert calls[-1]["api_key"] is None and calls[-1]["insecure_no_auth"] is True
    capsys.readouterr()


# -- no 500 for any client input -------------------------------------------------------------------

_NAN_VECTOR = base64.b64encode(bytes.fromhex("0000c07f") * 128).decode()
_STEER = {"address": "resid_post.0", "vector": [1.0] * 128}
CASES: list[tuple[str, str, bytes | dict[str, Any], int, str]] = [
    ("seed 2**70", "/v1/generate", {"text": PROMPT, "temperature": 1.0, "seed": 2**70}, 400, "InvalidOption"),
    ("seed -2**63-1", "/v1/generate", {"text": PROMPT, "temperature": 1.0, "seed": -(2**63) - 1}, 400, "InvalidOption"),
    ("lone surrogate", "/v1/capture", b'{"text": "abc \\ud800", "points": ["embed"]}', 422, "ValidationError"),
    ("lone surrogate tokenize", "/v1/tokenize", b'{"text": "abc \\udc00"}', 422, "ValidationError"),
    (
        "shape [0, 2**70] decode",
        "/v1/decode_residuals",
        {"activations": {"shape": [0, 2**70], "data": ""}},
        422,
        "ValidationError",
    ),
    (
        "shape [0, 2**70] vector",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "vector": {"shape": [0, 2**70], "data": ""}}]}},
        422,
        "ValidationError",
    ),
    (
        "shape [0, 2**31-1] vector",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "vector": {"shape": [0, 2**31 - 1], "data": ""}}]}},
        400,
        "InvalidSteering",
    ),
    (
        "scale 1e308",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "scale": 1e308}]}},
        400,
        "InvalidSteering",
    ),
    (
        "scale 400 digits",
        "/v1/capture",
        b'{"text": "hi", "points": ["embed"], "steering": {"writes": [{"address": "resid_post.0", '
        + b'"vector": [1], "scale": '
        + b"9" * 400
        + b"}]}}",
        422,
        "ValidationError",
    ),
    (
        "NaN activations",
        "/v1/decode_residuals",
        {"activations": {"shape": [128], "data": _NAN_VECTOR}},
        400,
        "InvalidActivations",
    ),
    ("NaN literal", "/v1/decode_residuals", b'{"activations": [NaN, 1.0]}', 422, "ValidationError"),
    ("1e999", "/v1/generate", b'{"text": "hi", "temperature": 1e999}', 422, "ValidationError"),
    ("invalid UTF-8", "/v1/capture", b'{"text": "\xff\xfe", "points": ["embed"]}', 422, "ValidationError"),
    ("deep JSON", "/v1/capture", b"[" * 50_000 + b"]" * 50_000, 422, "ValidationError"),
    (
        "deep JSON in a vector",
        "/v1/capture",
        b'{"text": "hi", "points": ' + b"[" * 40 + b"]" * 40 + b"}",
        422,
        "ValidationError",
    ),
    ("stream: yes", "/v1/generate", {"text": PROMPT, "stream": "yes"}, 422, "ValidationError"),
    (
        "scale: '2'",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "scale": "2"}]}},
        422,
        "ValidationError",
    ),
    ("arabic-indic layer", "/v1/capture", {"text": PROMPT, "points": ["resid_post.\u0663"]}, 400, "InvalidAddress"),
    ("layer 1_0", "/v1/capture", {"text": PROMPT, "points": ["resid_post.1_0"]}, 400, "InvalidAddress"),
    (
        "layer 5000 digits",
        "/v1/capture",
        {"text": PROMPT, "points": ["resid_post." + "9" * 5000]},
        400,
        "InvalidAddress",
    ),
    (
        "int of 5000 digits",
        "/v1/capture",
        b'{"text": "hi", "points": ["embed"], "x": ' + b"9" * 5000 + b"}",
        422,
        "ValidationError",
    ),
    ("not JSON", "/v1/capture", b"{'text': 'hi'}", 422, "ValidationError"),
    ("empty body", "/v1/capture", b"", 422, "ValidationError"),
    ("a list body", "/v1/capture", b"[1, 2]", 422, "ValidationError"),
    ("dict token ids", "/v1/capture", {"token_ids": {"1": 2}, "points": ["embed"]}, 422, "ValidationError"),
    (
        "set-like positions",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "positions": {"0": 1}}]}},
        422,
        "ValidationError",
    ),
    ("n_logprobs 10**6", "/v1/generate", {"text": PROMPT, "n_logprobs": 10**6}, 413, "LimitExceeded"),
    ("top_k true", "/v1/generate", {"text": PROMPT, "temperature": 1.0, "top_k": True}, 422, "ValidationError"),
    ("ignore_eos 'no'", "/v1/generate", {"text": PROMPT, "ignore_eos": "no"}, 422, "ValidationError"),
    ("points null", "/v1/capture", {"text": PROMPT, "points": None}, 422, "ValidationError"),
    ("max_tokens 2**70", "/v1/generate", {"text": PROMPT, "max_tokens": 2**70}, 413, "LimitExceeded"),
    ("layers 2**70", "/v1/attention", {"text": PROMPT, "layers": [2**70]}, 400, "LayerOutOfRange"),
    (
        "positions 2**70",
        "/v1/capture",
        {**FIXED, "steering": {"writes": [{**_STEER, "positions": [2**70]}]}},
        400,
        "InvalidSteering",
    ),
    ("token id 2**70", "/v1/capture", {"token_ids": [2**70], "points": ["embed"]}, 400, "InvalidTokens"),
    ("temperature -0.0", "/v1/generate", {"text": PROMPT, "temperature": -0.0, "max_tokens": 2}, 200, ""),
    (
        "temperature 1e-300",
        "/v1/generate",
        {"text": PROMPT, "temperature": 1e-300, "max_tokens": 4, "seed": 1},
        200,
        "",
    ),
    ("text plain", "/v1/capture", b"hello", 422, "ValidationError"),
    (
        "one layer twice, safetensors",
        "/v1/attention",
        {"text": PROMPT, "layers": [-1, 3], "format": "safetensors"},
        200,
        "",
    ),
    ("no such path", "/v1/nope", {}, 404, "NotFound"),
    ("completions: n 2", "/v1/completions", {"prompt": PROMPT, "n": 2}, 422, "ValidationError"),
    ("completions: 2 prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "InvalidOption"),
    ("completions: stop x5", "/v1/completions", {"prompt": PROMPT, "stop": ["a"] * 5}, 413, "LimitExceeded"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "error"), CASES, ids=[c[0] for c in CASES])
def test_inputs_that_gave_500s_are_typed_errors(
    client: httpx.Client, name: str, path: str, body: bytes | dict[str, Any], status: int, error: str
) -> None:
    if isinstance(body, dict):
        response = client.post(path, json=body)
    else:
        headers = {"content-type": "text/plain"} if name == "text plain" else JSON
        response = client.post(path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert len(response.content) < 4096
    if status >= 400:
        assert is_error_body(response.json()) and response.json()["error"] == error, response.text
    # the connection was kept: the next request on it is answered
    assert client.get("/v1/health").status_code == 200


def test_a_temperature_too_small_streams_too(client: httpx.Client) -> None:
    body = {"text": PROMPT, "temperature": 1e-300, "max_tokens": 4, "seed": 3, "stream": True, "n_logprobs": 2}
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200
    assert response.text.count("event: token") == 4 and "event: done" in response.text
    for line in response.text.splitlines():
        if line.startswith("data: "):
            strict_json(line[6:])


def test_error_bodies_are_bounded(client: httpx.Client) -> None:
    huge = "resid_post." + "x" * 8_000_000
    response = client.post("/v1/capture", json={"text": PROMPT, "points": [huge]})
    assert response.status_code == 400 and len(response.content) < 2048, len(response.content)
    assert response.json()["error"] == "InvalidAddress" and "characters" in response.json()["message"]
    response = client.post("/v1/capture", json={**FIXED, "x" * 1_000_000: 1})
    assert response.status_code == 422 and len(response.content) < 4096
    bad = {"text": PROMPT, "points": [1] * 100_000}  # 100,000 schema errors
    response = client.post("/v1/capture", json=bad)
    assert response.status_code == 422 and len(response.content) < 16_384
    assert is_error_body(response.json())


def test_non_finite_results_are_errors_naming_the_cause(client: httpx.Client) -> None:
    overflowing = {"writes": [{**_STEER, "scale": 1e37}]}  # finite, but the next norm overflows
    response = client.post("/v1/capture", json={**FIXED, "steering": overflowing})
    assert response.status_code == 400 and response.json()["error"] == "InvalidSteering"
    assert "inf or NaN" in response.json()["message"] and response.json()["field"] == "steering"
    for body in (
        {"text": PROMPT, "steering": overflowing, "n_logprobs": 2},
        {"text": PROMPT, "steering": overflowing, "temperature": 1.0},
        {"text": PROMPT, "steering": overflowing, "temperature": 1e-300, "stream": True},
    ):
        response = client.post("/v1/generate", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == "InvalidSteering"
    huge = base64.b64encode(bytes.fromhex("ffff7f7f") * 128).decode()  # float32 max, every value
    response = client.post("/v1/decode_residuals", json={"activations": {"shape": [128], "data": huge}})
    assert response.status_code in (200, 400)
    strict_json(response.text)


# -- bounded work ---------------------------------------------------------------------------------


def test_a_long_text_is_refused_before_tokenizing(client: httpx.Client) -> None:
    text = "word " * 2_000_000  # 10 MB
    timings = []

    def health() -> None:
        start = time.monotonic()
        client.get("/v1/health")
        timings.append(time.monotonic() - start)

    for path, body in (("/v1/capture", {"text": text, "points": ["embed"]}), ("/v1/tokenize", {"text": text})):
        start = time.monotonic()
        response = client.post(path, json=body)
        assert response.status_code == 413 and response.json()["field"] == "text", response.text
        assert time.monotonic() - start < 5
    # a text within the limit is tokenized off the event loop: the server answers meanwhile
    ok = "a b c " * 1600
    thread = threading.Thread(target=lambda: [client.post("/v1/tokenize", json={"text": ok}) for _ in range(5)])
    thread.start()
    while thread.is_alive():
        health()
    thread.join()
    assert max(timings) < 1.0


def test_slow_headers_are_cut_and_connections_are_capped(server: LiveServer, client: httpx.Client) -> None:
    socks = []
    for _ in range(LIMITS.max_connections + 4):
        sock = server.connect()
        sock.sendall(b"POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")  # and never the rest
        socks.append(sock)
    start = time.monotonic()
    answers = [read_all(sock, timeout=5) for sock in socks]
    elapsed = time.monotonic() - start
    for sock in socks:
        sock.close()
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(refused) >= 4 and len(refused) + len(timed_out) == len(answers), [a[:40] for a in answers]
    assert b"retry-after: 1" in refused[0] and b'"error": "Overloaded"' in refused[0]
    assert b'"error": "RequestTimeout"' in timed_out[0]
    assert elapsed < 4  # cut after header_timeout_s (1 s), not held
    # oversized headers are cut too
    sock = server.connect()
    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (LIMITS.max_header_bytes + 10))
    answer = read_all(sock, timeout=5)
    sock.close()
    assert answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), answer[:80]
    assert fixed_capture(client)["token_ids"]


def test_a_request_http_cannot_parse_is_400_in_the_error_shape(server: LiveServer) -> None:
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ):
        sock = server.connect()
        sock.sendall(raw)
        answer = read_all(sock, timeout=5)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 400"), (raw, answer[:80])
        assert is_error_body(json.loads(answer.split(b"\r\n\r\n", 1)[1])), answer


def test_a_partial_body_times_out(server: LiveServer, client: httpx.Client) -> None:
    socks = []
    for _ in range(10):
        sock = server.connect()
        head = (
            "POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 1000000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"text": "' + b"a" * 1000)
        socks.append(sock)
    start = time.monotonic()
    answers = [read_all(sock, timeout=6) for sock in socks]
    for sock in socks:
        sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), [a[:60] for a in answers]
    assert b'"error":"RequestTimeout"' in answers[0]
    assert time.monotonic() - start < 5
    assert fixed_capture(client)["token_ids"]


def test_partial_bodies_cannot_hold_more_than_the_buffer_budget(server: LiveServer, client: httpx.Client) -> None:
    head = (
        "POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 15000000\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(6):  # 6 x 3 MB arriving, 12 MB allowed
        sock = server.connect()
        sock.sendall(head + b'{"text": "' + b"a" * 3_000_000)
        socks.append(sock)
    answers = [read_all(sock, timeout=6) for sock in socks]
    for sock in socks:
        sock.close()
    overloaded = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert overloaded and b'"error":"Overloaded"' in overloaded[0], [a[:60] for a in answers]
    assert all(a.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) for a in answers)
    # the budget is given back: a 10 MB body is read whole again (and refused for its text's length)
    response = client.post("/v1/tokenize", json={"text": "b" * 10_000_000})
    assert response.status_code == 413 and response.json()["field"] == "text"


class GatedModel:
    """A model whose captures wait until ``gate`` is set (holding their request slots)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    async def capture(self, *args: Any, **kwargs: Any) -> Any:
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return await self._model.capture(*args, **kwargs)


def test_the_wait_for_a_slot_is_bounded_then_503() -> None:
    model = GatedModel(load_model("interp:tiny", backend="eager"))
    limits = ServerLimits(max_concurrent_requests=2, queue_timeout_s=0.5)
    try:
        with LiveServer(create_app(model, limits=limits)) as running, httpx.Client(base_url=running.url) as client:
            model.gate.clear()
            held: list[httpx.Response] = []
            threads = [
                threading.Thread(target=lambda: held.append(client.post("/v1/capture", json=FIXED))) for _ in range(2)
            ]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 10
            while client.get("/v1/health").json()["in_flight"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            start = time.monotonic()
            response = client.post("/v1/capture", json=FIXED)
            waited = time.monotonic() - start
            assert response.status_code == 503 and response.json()["error"] == "Overloaded"
            assert response.headers["retry-after"] == "1" and 0.4 < waited < 3
            metrics = client.get("/metrics").text
            assert "interp_slots_in_use 2" in metrics and "interp_slots_total 2" in metrics
            model.gate.set()
            for thread in threads:
                thread.join(timeout=30)
            assert [r.status_code for r in held] == [200, 200]
            assert client.post("/v1/capture", json=FIXED).status_code == 200
    finally:
        model.close()


# -- metrics and memory -----------------------------------------------------------------------------


def _metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{wanted}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} {labels} not in metrics"
    return float(match.group(1))


def test_metrics_count_requests_errors_latency_and_tokens(client: httpx.Client) -> None:
    before = client.get("/metrics").text
    ok = (
        _metric(before, "interp_requests_total", endpoint="/v1/capture", status="200")
        if '/v1/capture",status="200' in before
        else 0
    )
    tokens = _metric(before, "interp_prompt_tokens_total")
    for _ in range(3):
        fixed_capture(client)
    client.post("/v1/capture", json={"text": PROMPT, "points": ["resid_post.99"]})
    client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 3, "ignore_eos": True})
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert _metric(text, "interp_requests_total", endpoint="/v1/capture", status="200") == ok + 3
    assert _metric(text, "interp_request_errors_total", endpoint="/v1/capture", error="LayerOutOfRange") >= 1
    assert _metric(text, "interp_prompt_tokens_total") >= tokens + 4 * 5
    assert _metric(text, "interp_generation_tokens_total") >= 3
    count = _metric(text, "interp_request_duration_seconds_count", endpoint="/v1/capture")
    assert _metric(text, "interp_request_duration_seconds_bucket", endpoint="/v1/capture", le="+Inf") == count
    for gauge in ("interp_requests_in_flight", "interp_requests_queued", "interp_slots_in_use", "interp_slots_total"):
        assert f"# TYPE {gauge} gauge" in text
    assert _metric(text, "interp_requests_in_flight") == 1  # this very request


def test_memory_is_flat_over_1000_mixed_requests(client: httpx.Client) -> None:
    steer = {"writes": [{**_STEER, "scale": 0.5}]}
    bodies: list[tuple[str, Any]] = [
        ("/v1/capture", FIXED),
        ("/v1/capture", {**FIXED, "steering": steer}),
        ("/v1/generate", {"text": PROMPT, "max_tokens": 4, "n_logprobs": 2}),
        ("/v1/tokenize", {"text": PROMPT}),
        ("/v1/capture", {"text": PROMPT, "points": ["resid_post.99"]}),  # 400
        ("/v1/capture", b'{"text": "\\ud800", "points": ["embed"]}'),  # 422
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}),
        ("/v1/decode_residuals", {"activations": [[0.5] * 128], "top_k": 3}),
    ]
    process = psutil.Process(os.getpid())

    def burst(n: int) -> None:
        for i in range(n):
            path, body = bodies[i % len(bodies)]
            response = (
                client.post(path, json=body)
                if isinstance(body, dict)
                else client.post(path, content=body, headers=JSON)
            )
            assert response.status_code < 500

    burst(200)  # warm up allocator pools and caches
    rss = process.memory_info().rss
    start = time.monotonic()
    burst(1000)
    growth = (process.memory_info().rss - rss) / 2**20
    print(f"RSS growth over 1,000 mixed requests: {growth:.1f} MiB ({time.monotonic() - start:.1f} s)")
    assert growth < 64
    assert fixed_capture(client) == fixed_capture(client)


def test_the_answers_are_unchanged_after_the_attacks(client: httpx.Client) -> None:
    first = fixed_capture(client)
    assert json.dumps(first) == json.dumps(fixed_capture(client))


def test_the_app_works_under_fastapis_test_client() -> None:
    """create_app's defaults (no key, any Host) suit in-process test clients (Host: testserver)."""
    from fastapi.testclient import TestClient

    with TestClient(create_app("interp:tiny", backend="eager")) as test_client:
        assert test_client.post("/v1/capture", json=FIXED).status_code == 200
        response = test_client.post("/v1/capture", json={"text": PROMPT, "points": ["resid_post.99"]})
        assert response.status_code == 400 and response.json()["error"] == "LayerOutOfRange"
        assert test_client.get("/v1/nope").json()["error"] == "NotFound"
