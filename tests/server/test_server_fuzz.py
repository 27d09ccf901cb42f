"""A seeded fuzz test over every endpoint's body schema and over ``SteeringSpec.from_json``.

Bodies start valid (each endpoint's schema, steering specs, feature readouts of an attached SAE)
and are mutated: values swapped for hostile ones (huge and tiny numbers, wrong types, non-ASCII
digits, lone surrogates, empty and deep containers, encoded tensors of odd shapes), fields
dropped or invented, the raw JSON cut or spliced with non-JSON. Every answer must be a 2xx, or a
4xx in the server's error shape; never a 5xx; answers are JSON proper (no ``NaN``); and after
all of it the server answers a fixed capture exactly as before. The case count is reported
(``INTERP_FUZZ_CASES`` changes it; the seed is fixed, so a failure replays).
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from interp_engine import InterpError, SteeringSpec
from interp_engine.server import ServerLimits, create_app

from ..support.servers import LiveServer, is_error_body

SEED = int(os.environ.get("INTERP_FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("INTERP_FUZZ_CASES", "4000"))
SPEC_CASES = int(os.environ.get("INTERP_FUZZ_SPEC_CASES", "4000"))
LIMITS = ServerLimits(max_new_tokens=12, max_activation_values=100_000, max_body_bytes=512 * 1024, max_text_chars=4000)
D_MODEL = 128
PROMPT = "The capital of France is"
FIXED = {"text": PROMPT, "points": ["resid_post.1", "logits"]}
ADDRESSES = ["embed", "resid_post.1", "resid_mid.0", "attn_out.-1", "mlp_post.2", "attn_z.1", "logits", "final_norm"]


def _encoded(shape: list[int], values: float | None = None, rng: random.Random | None = None) -> dict[str, Any]:
    n = math.prod(shape)
    if values is None and rng is not None:
        data = b"".join(
            rng.choice([b"\x00\x00\x80?", b"\x00\x00\xc0\x7f", b"\xff\xff\x7f\x7f", b"\x00\x00\x00\x00"])
            for _ in range(n)
        )
    else:
        import struct

        data = struct.pack(f"<{n}f", *([values or 0.5] * n))
    return {"dtype": "float32", "shape": shape, "data": base64.b64encode(data).decode()}


def _write(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.2:
        return {
            "sae": rng.choice(["res", "res", "nope"]),
            "feature": rng.choice([0, 3, 1023, 1024]),
            "op": rng.choice(["clamp", "add", "ablate"]),
            "value": rng.choice([0.0, 2.0]),
        }
    op = rng.choice(["add", "set", "ablate", "cap", "rescale", "norm_add", "swap"])
    write: dict[str, Any] = {
        "address": rng.choice(["resid_post.0", "resid_post.1", "attn_out.2", "mlp_out.0"]),
        "op": op,
    }
    write["vector"] = [rng.uniform(-1, 1) for _ in range(D_MODEL)] if rng.random() < 0.7 else _encoded([D_MODEL], 0.25)
    write["scale"] = rng.choice([1.0, 0.5, 4.0])
    if op == "cap":
        write["scale"] = 1.0
        write["lo"], write["hi"] = -1.0, 1.0
    if op == "swap":
        write["target"] = [rng.uniform(-1, 1) for _ in range(D_MODEL)]
    if op == "norm_add":
        write["max_fraction"] = 0.5
    write["positions"] = rng.choice(["all", "prompt", "generated", [0, 1], [-1], "user[-1].last", "user"])
    return write


def _steering(rng: random.Random) -> dict[str, Any]:
    return {"writes": [_write(rng) for _ in range(rng.randint(1, 3))]}


def _messages(rng: random.Random) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": PROMPT}]
    if rng.random() < 0.4:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And Italy?"}]
    return messages


def _prompt(rng: random.Random) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.45:
        return {"text": PROMPT}
    if roll < 0.75:
        return {"token_ids": [rng.randrange(1015) for _ in range(rng.randint(1, 8))]}
    body: dict[str, Any] = {"messages": _messages(rng)}
    if rng.random() < 0.3:
        body["add_generation_prompt"] = False
    return body


def _lens(rng: random.Random) -> dict[str, Any]:
    lens: dict[str, Any] = {"layers": rng.sample([0, 1, 2, 3, -1], rng.randint(1, 2)), "top_k": rng.randint(1, 4)}
    if rng.random() < 0.3:
        lens["positions"] = rng.choice(["prompt", [-1], "user[-1].last"])
    return lens


def _points(rng: random.Random) -> list[Any]:
    points: list[Any] = rng.sample(ADDRESSES, rng.randint(1, 3))
    if rng.random() < 0.3:
        points.append(rng.choice(["features:res:top8", {"sae": "res", "ids": [3, 17]}, {"sae": "res", "top_k": 4}]))
    return points


def _body(path: str, rng: random.Random) -> dict[str, Any]:
    """A valid body of ``path``'s schema (before mutation)."""
    if path == "/v1/tokenize":
        return {"text": rng.choice([PROMPT, "hello", "\u00e9t\u00e9 \u4e2d\u6587"])}
    if path == "/v1/decode_residuals":
        rows = rng.randint(1, 3)
        acts: Any = [[rng.uniform(-2, 2) for _ in range(D_MODEL)] for _ in range(rows)]
        return {
            "activations": acts if rng.random() < 0.5 else _encoded([rows, D_MODEL], 0.1),
            "top_k": rng.randint(0, 5),
        }
    if path == "/v1/completions":
        body: dict[str, Any] = {
            "model": "m",
            "prompt": PROMPT,
            "max_tokens": rng.randint(1, 6),
            "temperature": rng.choice([0, 0.7]),
        }
        if rng.random() < 0.3:
            body["stop"] = rng.choice([".", [" the", "\n"]])
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.4:
            body["interp"] = {"steering": _steering(rng)}
        if rng.random() < 0.2:
            body.setdefault("interp", {})["lens"] = _lens(rng)
        return body
    if path == "/v1/chat/completions":
        body = {"model": "m", "messages": _messages(rng), "max_tokens": rng.randint(1, 6), "temperature": 0}
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        if rng.random() < 0.4:
            body["interp"] = {"steering": _steering(rng)}
        if rng.random() < 0.3:
            body.setdefault("interp", {})["lens"] = _lens(rng)
        return body
    body = _prompt(rng)
    if path in ("/v1/capture", "/v1/capture_generation"):
        body["points"] = _points(rng)
    if path == "/v1/attention":
        body["layers"] = rng.sample([0, 1, 2, 3, -1], rng.randint(1, 2))
    if path in ("/v1/generate", "/v1/capture_generation"):
        body["max_tokens"] = rng.randint(1, 6)
        if rng.random() < 0.4:
            body["temperature"], body["seed"] = rng.choice([0.5, 1.0]), rng.randrange(1000)
    if path in ("/v1/generate", "/v1/capture_generation") and rng.random() < 0.3:
        body["lens"] = _lens(rng)
    if path == "/v1/generate":
        body["n_logprobs"] = rng.randint(0, 3)
        body["stream"] = rng.random() < 0.4
        if rng.random() < 0.2:
            body["features"] = ["features:res:top4"]
    if path in ("/v1/capture", "/v1/capture_generation", "/v1/attention") and rng.random() < 0.15:
        body["format"] = "safetensors"
    if rng.random() < 0.4:
        body["steering"] = _steering(rng)
    return body


def _hostile(rng: random.Random, like: Any = None) -> Any:
    pool: list[Any] = [
        None,
        True,
        False,
        0,
        -1,
        1,
        2**31,
        2**63,
        -(2**63) - 1,
        2**64,
        2**70,
        -(2**70),
        10**30,
        1e308,
        -1e308,
        1e-300,
        5e-324,
        -0.0,
        3.4e38,
        1e37,
        0.5,
        "",
        "x",
        "yes",
        "2",
        "NaN",
        "resid_post.\u0663",
        "resid_post.1_0",
        "resid_post.99",
        "resid_post.-99",
        "features:res:top0",
        "features:nope:top8",
        "features:res:ids=99999",
        "all",
        "prompt",
        "generated",
        "user[-1].last",
        "reasoning[9]",
        "user[x]",
        "last",
        {"layers": [0], "top_k": 10**6},
        {"layers": [], "top_k": 1},
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": 3, "content": "x"}],
        "\ud800",
        "\udfff abc",
        "\u0000",
        "a" * 5000,
        "\u202e\u200b",
        [],
        {},
        [[]],
        [[[[[]]]]],
        [None],
        [1, "a"],
        [0.5] * 7,
        [1e308] * D_MODEL,
        list(range(70)),
        {"shape": [0, 2**31 - 1], "data": ""},
        {"shape": [2**31 - 1], "data": "AAAA"},
        {"shape": [-1], "data": ""},
        {"shape": [D_MODEL], "data": "!!!"},
        {"shape": [D_MODEL], "data": ""},
        {"dtype": "float64", "shape": [1], "data": "AAAAAAAAAAA="},
        {"sae": "res"},
        {"sae": "res", "top_k": 10**6},
        {"sae": "res", "ids": [-1]},
        {"writes": []},
        {"writes": None},
    ]
    if like is not None and rng.random() < 0.6:  # a value of the same JSON type: reaches deeper checks
        same = [
            v for v in pool if type(v) is type(like) or (isinstance(like, (int, float)) and type(v) in (int, float))
        ]
        same = [v for v in same if not isinstance(v, bool) or isinstance(like, bool)]
        if same:
            return rng.choice(same)
    value = rng.choice(pool)
    if rng.random() < 0.1:
        value = _encoded([rng.choice([1, 2, 3]), rng.choice([D_MODEL, 7])], rng=rng)
    return value


def _mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` with one place changed (replaced, dropped, invented, wrapped)."""
    if isinstance(value, dict) and value and rng.random() < 0.75:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.1:
            del out[key]
        elif roll < 0.2:
            out[rng.choice(["extra", "Points", "steering ", "interp", "stream", "format"])] = _hostile(rng)
        else:
            out[key] = _mutate(value[key], rng, depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.6:
        i = rng.randrange(len(value))
        out_list = list(value)
        if rng.random() < 0.15:
            out_list.pop(i)
        else:
            out_list[i] = _mutate(value[i], rng, depth + 1)
        return out_list
    if rng.random() < 0.05:
        return [value]
    return _hostile(rng, value)


def _raw(body: Any, rng: random.Random) -> bytes:
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    roll = rng.random()
    if roll < 0.05:
        cut = rng.randrange(len(text) + 1)
        text = text[:cut]
    elif roll < 0.1:
        at = rng.randrange(len(text) + 1)
        text = (
            text[:at]
            + rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "\\ud800", "\x00", "]]]", "{", ","])
            + text[at:]
        )
    raw = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.03:
        at = rng.randrange(len(raw) + 1)
        raw = raw[:at] + bytes([rng.randrange(128, 256)]) + raw[at:]
    return raw


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} in an answer")


def _check_answer(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        assert len(response.content) < 64 * 1024, what
        assert is_error_body(json.loads(response.text, parse_constant=_no_constant)), f"{what}: {response.text[:300]}"
        return
    kind = response.headers.get("content-type", "")
    if kind.startswith("application/json"):
        json.loads(response.text, parse_constant=_no_constant)
    elif kind.startswith("application/octet-stream"):  # a Cache file: safetensors' own header is JSON
        size = int.from_bytes(response.content[:8], "little")
        json.loads(response.content[8 : 8 + size], parse_constant=_no_constant)
    elif kind.startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:], parse_constant=_no_constant)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    app = create_app("interp:tiny", backend="eager", limits=LIMITS, saes={"res": "interp:tiny-sae"})
    with LiveServer(app) as running:
        yield running


def test_fuzz_every_endpoint_body(server: LiveServer) -> None:
    rng = random.Random(SEED)
    paths = [
        "/v1/capture",
        "/v1/capture_generation",
        "/v1/attention",
        "/v1/generate",
        "/v1/decode_residuals",
        "/v1/tokenize",
        "/v1/completions",
        "/v1/chat/completions",
    ]
    statuses: dict[int, int] = {}
    start = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = client.post("/v1/capture", json=FIXED)
        assert before.status_code == 200
        for case in range(CASES):
            path = paths[case % len(paths)]
            body = _body(path, rng)
            for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3])):
                body = _mutate(body, rng)
            raw = _raw(body, rng)
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            _check_answer(response, f"case {case} {path} {raw[:300]!r}")
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        after = client.post("/v1/capture", json=FIXED)
        assert after.status_code == 200 and after.json() == before.json()
        assert client.get("/v1/health").json()["in_flight"] == 0
    took = time.monotonic() - start
    print(f"fuzz: {CASES} bodies over {len(paths)} endpoints in {took:.1f} s; statuses {sorted(statuses.items())}")
    assert statuses.get(200, 0) > CASES // 10  # the generator reaches the model, not only the validator
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > CASES // 4


def test_fuzz_steering_spec_from_json() -> None:
    rng = random.Random(SEED + 1)
    parsed = refused = 0
    for _ in range(SPEC_CASES):
        body: Any = _steering(rng)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            body = _mutate(body, rng)
        raw = _raw(body, rng)
        text: str | bytes = raw
        if rng.random() < 0.5:
            text = raw.decode("utf-8", "surrogatepass") if _is_utf8(raw) else raw
        try:
            spec = SteeringSpec.from_json(text)
        except InterpError:
            refused += 1
            continue
        parsed += 1
        assert SteeringSpec.from_json(spec.to_json()) == spec
    for deep in (
        "[" * 100_000,
        '{"writes": [' + "[" * 5000 + "]" * 5000 + "]}",
        '{"writes": [{"address": "resid_post.0", "vector": [1], "scale": ' + "9" * 400 + "}]}",
    ):
        with pytest.raises(InterpError):
            SteeringSpec.from_json(deep)
    print(f"fuzz: SteeringSpec.from_json over {SPEC_CASES} texts: {parsed} specs, {refused} typed refusals")
    assert parsed > SPEC_CASES // 10 and refused > SPEC_CASES // 10
