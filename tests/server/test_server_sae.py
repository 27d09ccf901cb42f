"""SAE feature readouts and feature steering over HTTP (``interp_engine.server``).

A uvicorn server on a loopback port serves ``interp:tiny`` on the eager backend with a TopK SAE
attached as ``res``; each answer is checked against the same model called directly, and readouts
against encoding the captured activations on the host (``sae.encode``). One test does the same on
the vllm backend (the session's gpt2 engine), where the encode runs inside the worker.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from interp_engine import (
    Address,
    Cache,
    Features,
    FeatureWrite,
    Sae,
    SteeringSpec,
    Write,
    load_model,
    sync_model,
)
from interp_engine.server import ServerLimits, create_app
from interp_testkit.suite import rel_diff

from ..support.saes import tiny_sae
from ..support.servers import LiveServer, sse, tensor

LIMITS = ServerLimits(max_activation_values=50_000, max_new_tokens=64)
PROMPT = "The capital of France is"
D_MODEL, D_SAE, K = 128, 512, 8


def readout(data: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(values, ids, error_norm)`` of a readout's JSON form."""
    ids = None if data["ids"] is None else torch.tensor(data["ids"])
    norm = None if data["error_norm"] is None else torch.tensor(data["error_norm"])
    return torch.tensor(data["values"]), ids, norm


def assert_readout_equal(data: dict[str, Any], expected: Any, tol: float = 1e-6) -> None:
    values, ids, norm = readout(data)
    assert values.shape == expected.values.shape
    assert rel_diff(values, expected.values) <= tol
    if expected.ids is None:
        assert ids is None
    else:
        assert ids is not None and torch.equal(ids, expected.ids)
    assert norm is not None and expected.error_norm is not None
    assert rel_diff(norm, expected.error_norm) <= tol


@pytest.fixture(scope="module")
def sae() -> Sae:
    return tiny_sae()


@pytest.fixture(scope="module")
def direct(sae: Sae) -> Any:
    """The same model with the same SAE attached, called directly."""
    return sync_model(load_model("interp:tiny", backend="eager", saes={"res": sae}))


@pytest.fixture(scope="module")
def client(sae: Sae) -> Iterator[httpx.Client]:
    app = create_app("interp:tiny", backend="eager", limits=LIMITS, saes={"res": sae})
    with LiveServer(app, run_config=False) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        yield c


def ids_of(direct: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = direct.to_tokens(text)[0].tolist()
    return ids


# -- the model lists its SAEs, the schema documents readouts and feature writes ---------------------


def test_model_lists_the_attached_sae(client: httpx.Client) -> None:
    info = client.get("/v1/model").json()
    assert info["saes"] == [
        {
            "name": "res",
            "architecture": "topk",
            "address": "resid_post.1",
            "address_out": "resid_post.1",
            "d_in": D_MODEL,
            "d_sae": D_SAE,
        }
    ]
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"FeaturesBody", "FeatureWriteBody", "ReadoutOut"} <= set(schemas)
    assert set(schemas["FeatureWriteBody"]["properties"]) == {"sae", "feature", "op", "value", "positions"}
    assert "features" in schemas["CaptureResponse"]["properties"]


# -- readouts ----------------------------------------------------------------------------------------


def test_capture_readouts_equal_model_capture_and_host_encoding(
    client: httpx.Client, direct: Any, sae: Sae, tmp_path: Any
) -> None:
    ids = ids_of(direct)
    points: list[Any] = [
        "resid_post.1",
        "features:res:top8",
        {"sae": "res", "ids": [3, 17, 400]},
        {"sae": "res", "dense": True},
        "features:res",  # the default readout: the top 16
    ]
    response = client.post("/v1/capture", json={"token_ids": ids, "points": points})
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body["activations"]) == ["resid_post.1"]
    keys = ["features:res:top8", "features:res:ids=3,17,400", "features:res:dense", "features:res:top16"]
    assert list(body["features"]) == keys

    alone = direct.capture(ids, ["resid_post.1", *keys])
    for key in keys:
        assert_readout_equal(body["features"][key], alone[Features.parse(key)])

    # the oracle: the SAE's own encoding of the activations the same response carries
    x = tensor(body["activations"]["resid_post.1"])
    encoded = sae.encode(x)
    values, top_ids, norm = readout(body["features"]["features:res:top8"])
    assert top_ids is not None and norm is not None
    assert values.shape == (len(ids), K) and (top_ids >= 0).all()
    assert rel_diff(values, encoded.gather(-1, top_ids)) <= 1e-5
    assert torch.equal(top_ids.sort(-1).values, encoded.topk(K, dim=-1).indices.sort(-1).values)
    assert rel_diff(norm, (x - sae.reconstruct(x)).norm(dim=-1)) <= 1e-5
    dense, dense_ids, _ = readout(body["features"]["features:res:dense"])
    assert dense_ids is None and rel_diff(dense, encoded) <= 1e-5
    chosen, _, _ = readout(body["features"]["features:res:ids=3,17,400"])
    torch.testing.assert_close(chosen, encoded[:, [3, 17, 400]], atol=1e-5, rtol=1e-5)

    # as a safetensors Cache file: the readouts load back with Cache.load
    as_file = client.post("/v1/capture", json={"token_ids": ids, "points": points, "format": "safetensors"})
    assert as_file.status_code == 200
    path = tmp_path / "acts.safetensors"
    path.write_bytes(as_file.content)
    cache = Cache.load(path)
    stored = cache["features:res:top8"]
    assert stored.values.shape == (1, len(ids), K) and stored.ids is not None
    assert torch.equal(stored.ids[0], top_ids) and rel_diff(stored.values[0], values) == 0
    assert cache["features:res:dense"].ids is None
    assert rel_diff(cache["resid_post.1"][0], x) == 0

    # readouts alone, without any address
    only = client.post("/v1/capture", json={"token_ids": ids, "points": ["features:res:top8"]}).json()
    assert only["activations"] == {} and only["features"]["features:res:top8"] == body["features"]["features:res:top8"]
    plain = client.post("/v1/capture", json={"token_ids": ids, "points": ["embed"]}).json()
    assert plain["features"] == {}


def test_capture_generation_readouts_cover_the_generated_tokens(client: httpx.Client, direct: Any) -> None:
    ids = ids_of(direct)
    request = {"token_ids": ids, "points": ["features:res:top4", "resid_post.1"], "max_tokens": 4, "ignore_eos": True}
    body = client.post("/v1/capture_generation", json=request).json()
    completion, alone = direct.capture_generation(
        ids, ["features:res:top4", "resid_post.1"], max_tokens=4, ignore_eos=True
    )
    assert body["completion"]["token_ids"] == completion.token_ids
    expected = alone[Features("res", 4)]
    assert expected.values.shape == (len(ids) + 4, 4)
    assert_readout_equal(body["features"]["features:res:top4"], expected)


def test_stream_events_carry_readouts_at_their_position(client: httpx.Client, direct: Any) -> None:
    ids = ids_of(direct)
    n = 5
    request = {"token_ids": ids, "max_tokens": n, "ignore_eos": True, "features": ["features:res:top4"]}
    with client.stream("POST", "/v1/generate", json={**request, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse(response))
    assert [e for e, _ in events] == ["token"] * n + ["done"]
    steps = [data for _, data in events[:-1]]
    completion, alone = direct.capture_generation(ids, ["features:res:top4"], max_tokens=n, ignore_eos=True)
    assert [s["token_id"] for s in steps] == completion.token_ids
    assert [s["position"] for s in steps] == list(range(len(ids) - 1, len(ids) - 1 + n))
    over_generation = alone[Features("res", 4)]
    for step in steps:
        assert list(step["features"]) == ["features:res:top4"]
        assert_readout_equal(step["features"]["features:res:top4"], over_generation[step["position"]], tol=1e-5)
    # without stream: the same steps
    collected = client.post("/v1/generate", json=request).json()
    assert collected["token_ids"] == completion.token_ids
    assert collected["steps"] == steps
    # and a stream without features carries none
    with client.stream("POST", "/v1/generate", json={"token_ids": ids, "max_tokens": 2, "stream": True}) as response:
        assert all("features" not in data for event, data in sse(response) if event == "token")


# -- feature steering --------------------------------------------------------------------------------


def test_feature_writes_in_json_equal_the_python_spec(client: httpx.Client, direct: Any, sae: Sae) -> None:
    ids = ids_of(direct)
    n = len(ids)
    x = direct.capture(ids, ["resid_post.1"])[Address("resid_post", 1)]
    feature = int(sae.encode(x)[-1].argmax())  # fires at the last token
    writes = [
        {"sae": "res", "feature": feature, "op": "clamp", "value": 40.0, "positions": [n - 1]},
        {"sae": "res", "feature": 7, "op": "add", "value": 3.0},
        {"sae": "res", "feature": feature, "op": "ablate", "positions": [0]},
    ]
    points = ["resid_post.2", "logits"]
    for write in writes:
        body = {"token_ids": ids, "points": points, "steering": {"writes": [write]}}
        response = client.post("/v1/capture", json=body)
        assert response.status_code == 200, response.text
        got = {k: tensor(v) for k, v in response.json()["activations"].items()}
        spec = SteeringSpec.from_dict({"writes": [write]})
        assert isinstance(spec.writes[0], FeatureWrite)
        alone = direct.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(got[point], alone[Address.parse(point)]) <= 1e-6, (write, point)

    # the clamp by hand: add (value - f_i(x)) d_i at the last position, the SAE's error term kept
    delta = (40.0 - sae.encode(x)[-1, feature]) * sae.feature_direction(feature)
    by_hand = SteeringSpec([Write("resid_post.1", delta, op="add", positions=[n - 1])])
    expected = direct.capture(ids, points, steering_spec=by_hand)
    body = {"token_ids": ids, "points": points, "steering": {"writes": [writes[0]]}}
    clamped = {k: tensor(v) for k, v in client.post("/v1/capture", json=body).json()["activations"].items()}
    plain = direct.capture(ids, points)
    assert rel_diff(clamped["resid_post.2"], expected[Address("resid_post", 2)]) <= 1e-5
    assert not torch.allclose(clamped["logits"], plain[Address("logits")])

    # in a generation, mixed with a write at an address
    mixed = {"writes": [writes[0] | {"positions": "all"}, {"address": "resid_post.0", "vector": [0.1] * D_MODEL}]}
    generated = client.post("/v1/generate", json={"token_ids": ids, "max_tokens": 4, "steering": mixed}).json()
    spec = SteeringSpec.from_dict(mixed)
    assert generated["token_ids"] == direct.generate(ids, max_tokens=4, steering_spec=spec).token_ids


# -- bad input ----------------------------------------------------------------------------------------

CAPTURE = {"token_ids": [1, 2, 3]}
BAD = [
    ("/v1/capture", {"points": ["features:nope:top8"]}, 400, "UnknownSae", "points[0]"),
    ("/v1/capture", {"points": ["embed", {"sae": "nope"}]}, 400, "UnknownSae", "points[1]"),
    ("/v1/capture", {"points": [{"sae": "res", "ids": [512]}]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": ["features:res:ids=3,900"]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": ["features:res:top0"]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": ["features:res:bogus"]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": [{"sae": "res", "top_k": 4, "dense": True}]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": [{"sae": "bad name"}]}, 400, "InvalidFeatures", "points[0]"),
    ("/v1/capture", {"points": [{"sae": "res", "top_k": "x"}]}, 422, "ValidationError", "points[0].top_k"),
    ("/v1/capture", {"points": [{"sae": "res", "k": 3}]}, 422, "ValidationError", "points[0].k"),
    ("/v1/capture", {"points": [{"sae": "res", "dtype": "int8"}]}, 422, "ValidationError", "points[0].dtype"),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "nope", "feature": 1}]}},
        400,
        "UnknownSae",
        "steering.writes[0].sae",
    ),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "res", "feature": 512, "value": 2.0}]}},
        400,
        "InvalidFeatures",
        "steering.writes[0]",
    ),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "res", "feature": 1, "op": "ablate", "value": 2.0}]}},
        400,
        "InvalidSteering",
        "steering.writes[0]",
    ),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "res", "feature": 1, "positions": [9]}]}},
        400,
        "InvalidSteering",
        "steering",
    ),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "res", "feature": 1, "op": "boost"}]}},
        422,
        "ValidationError",
        "steering.writes[0].op",
    ),
    (
        "/v1/capture",
        {"points": ["embed"], "steering": {"writes": [{"sae": "res", "feature": -1}]}},
        422,
        "ValidationError",
        "steering.writes[0].feature",
    ),
    ("/v1/generate", {"features": ["resid_post.1"]}, 400, "InvalidFeatures", "features[0]"),
    ("/v1/generate", {"features": ["features:nope"], "stream": True}, 400, "UnknownSae", "features[0]"),
    ("/v1/capture_generation", {"points": ["features:res:ids=999"]}, 400, "InvalidFeatures", "points[0]"),
]


@pytest.mark.parametrize(("path", "body", "status", "error", "field"), BAD, ids=[f"{b[3]}-{b[4]}" for b in BAD])
def test_bad_sae_input_is_4xx_and_the_server_keeps_serving(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, error: str, field: str
) -> None:
    response = client.post(path, json={**CAPTURE, **body})
    assert response.status_code == status, response.text
    got = response.json()
    assert (got["error"], got["field"]) == (error, field), got
    assert got["message"]
    if error == "UnknownSae":
        assert got["valid"] == ["res"]
    ok = client.post("/v1/capture", json={**CAPTURE, "points": ["features:res:top2"]})
    assert ok.status_code == 200 and len(ok.json()["features"]["features:res:top2"]["ids"]) == 3


class Wrapped:
    """A model the server knows only through the protocol (not a ``ModelBase``): the server cannot
    check readouts and feature writes up front, so the model's own errors must still be 4xx."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_models_own_sae_errors_are_4xx_naming_the_field(sae: Sae) -> None:
    model = load_model("interp:tiny", backend="eager", saes={"res": sae})

    def steer(write: dict[str, Any]) -> dict[str, Any]:
        return {"points": ["embed"], "steering": {"writes": [write]}}

    bad = [
        ({"points": ["embed", "features:nope:top8"]}, "UnknownSae", "points"),
        ({"points": ["features:res:ids=700"]}, "InvalidFeatures", "points"),
        (steer({"sae": "nope", "feature": 1}), "UnknownSae", "steering"),
        (steer({"sae": "res", "feature": 700}), "InvalidFeatures", "steering"),
    ]
    with (
        LiveServer(create_app(Wrapped(model)), run_config=False) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        assert client.get("/v1/model").json()["saes"] == []  # it cannot see them
        for body, error, field in bad:
            response = client.post("/v1/capture", json={**CAPTURE, **body})
            assert response.status_code == 400, response.text
            assert (response.json()["error"], response.json()["field"]) == (error, field)
            ok = client.post("/v1/capture", json={**CAPTURE, "points": ["features:res:top2"]})
            assert ok.status_code == 200 and "features:res:top2" in ok.json()["features"]
        stream = {**CAPTURE, "max_tokens": 2, "stream": True, "features": ["features:nope"]}
        response = client.post("/v1/generate", json=stream)
        assert response.status_code == 400 and response.json()["field"] == "features"


def test_readouts_count_toward_the_result_limit(client: httpx.Client) -> None:
    # a dense readout holds 512 values + the error norm per token: 100 tokens > 50,000 values
    big = {"token_ids": list(range(100)), "points": ["features:res:dense"]}
    response = client.post("/v1/capture", json=big)
    assert response.status_code == 413 and response.json()["field"] == "points"
    stream = {"token_ids": [1, 2], "max_tokens": 64, "features": ["features:res:dense"] * 2 + ["features:res:top8"]}
    assert client.post("/v1/generate", json=stream).status_code == 200  # 64 x (513 + 17) values
    many = {"token_ids": [1, 2], "max_tokens": 64, "features": [f"features:res:ids={i}" for i in range(65)]}
    assert client.post("/v1/generate", json=many).json()["field"] == "features"
    ok = client.post("/v1/capture", json={**big, "points": ["features:res:top8"]})
    assert ok.status_code == 200


# -- vLLM: the readouts computed in the worker come through HTTP ---------------------------------------


def test_readouts_over_http_on_vllm(vllm_engines: Any) -> None:
    import uvicorn

    facade = vllm_engines("gpt2")
    model = facade.model
    name = "test_server_sae.res"
    sae = tiny_sae(seed=1)
    model.attach_sae(name, sae)
    key = f"features:{name}:top8"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # the server runs on the loop that owns the engine (the facade's)
    server = uvicorn.Server(uvicorn.Config(create_app(model), log_level="warning"))
    serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), facade._loop)
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert not serving.done(), serving.exception()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=120) as client:
            assert name in [s["name"] for s in client.get("/v1/model").json()["saes"]]
            ids: list[int] = facade.to_tokens(PROMPT)[0].tolist()
            body = client.post("/v1/capture", json={"token_ids": ids, "points": ["resid_post.1", key]}).json()
            values, top_ids, norm = readout(body["features"][key])
            x = tensor(body["activations"]["resid_post.1"])
            assert top_ids is not None and norm is not None and values.shape == (len(ids), K)
            assert rel_diff(values, sae.encode(x).gather(-1, top_ids)) <= 1e-4
            assert rel_diff(norm, (x - sae.reconstruct(x)).norm(dim=-1)) <= 1e-4
            assert_readout_equal(body["features"][key], facade.capture(ids, [key])[Features.parse(key)], tol=1e-5)

            request = {"token_ids": ids, "max_tokens": 4, "ignore_eos": True, "features": [key], "stream": True}
            with client.stream("POST", "/v1/generate", json=request) as response:
                steps = [data for event, data in sse(response) if event == "token"]
            _, over = facade.capture_generation(ids, [key], max_tokens=4, ignore_eos=True)
            assert [s["position"] for s in steps] == list(range(len(ids) - 1, len(ids) + 3))
            for step in steps:
                assert_readout_equal(step["features"][key], over[Features.parse(key)][step["position"]], tol=1e-4)
            bad = client.post("/v1/capture", json={"token_ids": ids, "points": ["features:nope:top8"]})
            assert bad.status_code == 400 and bad.json()["error"] == "UnknownSae"
    finally:
        server.should_exit = True
        serving.result(timeout=30)
        sock.close()
        model.detach_sae(name)
