"""vllm-static inside ``vllm serve``: taps and write points declared in ``--additional-config``
(``{"interp": {"static": ...}}``), compiled into vLLM's graph by the workers before vLLM
compiles it, served on vLLM's own routes.

One compiled ``vllm serve`` of ``interp:tiny`` (its own loopback port, started once for this
module) declares capture points at the residual stream and inside layers, write points at both,
and compiles the tiny SAE in. Steering, points, readouts and the lens on ``/v1/completions``
equal the eager backend's; the workers hold the compiled taps (no request recompiles); a request
naming an undeclared point, write or lens layer is ``400 UndeclaredAddress`` naming the
declaration and how to declare it, and the server serves on; the compiled SAEs cannot change at
run time (``409``); no request body gets a ``5xx``. The declaration itself
(:func:`interp_vllm._wire.serve_declaration`: ``"auto"``, defaults, bad forms) is checked
without a server. The subject is the plugin, not the model runner: V1 only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from interp_engine import (
    Address,
    FeatureWrite,
    InterpError,
    InvalidOption,
    LensRequest,
    SteeringSpec,
    Write,
    capture_generation,
    load_sae,
    shipped_saes,
    tiny_model_path,
)
from interp_testkit.vllm_serve import VllmServe
from interp_vllm._wire import SERVE_STATIC_HOW, serve_declaration

pytestmark = pytest.mark.runners("v1")

KEY = "serve-static-key-3"
SERVED = "tiny"
PRESET = "tiny-calm"
PROMPT = "The capital of France is"
D_MODEL = 128
D_MLP = 512
POINTS = ["resid_post.1", "resid_post.3", "mlp_post.2", "attn_z.1"]
WRITES = ["resid_post.1", "mlp_post.2"]
READOUT = "features:res:top4"
LENS = {"layers": [1, 3], "top_k": 3}


def _vector(width: int, seed: int) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def _spec(scale: float = 4.0) -> SteeringSpec:
    """Writes at both declared write points: the residual stream and an MLP's neurons."""
    return SteeringSpec(
        [
            Write(Address("resid_post", 1), _vector(D_MODEL, 1), op="add", scale=scale),
            Write(Address("mlp_post", 2), _vector(D_MLP, 2), op="add", scale=scale / 2, positions=[1, 3]),
        ]
    )


PRESET_SPEC = SteeringSpec([Write(Address("resid_post", 1), _vector(D_MODEL, 5), op="add", scale=6.0)])


def _config() -> str:
    sae = str(shipped_saes()["interp:tiny-sae"])
    static = {"points": POINTS, "writes": WRITES, "write_slots": 8}
    return json.dumps({"interp": {"saes": {"res": sae}, "presets": {PRESET: PRESET_SPEC.to_dict()}, "static": static}})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    log = tmp_path_factory.mktemp("serve-static") / "vllm-serve.log"
    args = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "256"]
    args += ["--api-key", KEY, "--additional-config", _config()]
    with VllmServe(tiny_model_path(), args, log, env={"VLLM_PLUGINS": "interp_vllm"}) as running:
        yield running.wait()


@pytest.fixture(scope="module")
def client(server: VllmServe) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def eager(direct: Any) -> Iterator[Any]:
    """The eager backend with the same SAE attached as ``res``."""
    direct.attach_sae("res", load_sae(shipped_saes()["interp:tiny-sae"]))
    yield direct
    direct.detach_sae("res")


def _post(server: VllmServe, path: str, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def _completion(client: openai.OpenAI, interp: dict[str, Any] | None, max_tokens: int = 6, **extra: Any) -> Any:
    body = {"return_tokens_as_token_ids": True, **extra}
    if interp is not None:
        body["interp"] = interp
    return client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, extra_body=body
    )


def _ids(out: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_the_workers_serve_the_declared_taps_compiled_in(server: VllmServe) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    stats = httpx.get(f"{server.url}/interp/v1/workers", headers=headers, timeout=30).json()["workers"]
    assert len(stats) == 1
    # a tap per declared point, a write table per declared write, the SAE compiled in
    assert stats[0]["static_taps"] >= len(POINTS) and stats[0]["static_tables"] == len(WRITES)
    assert stats[0]["static_saes"] == 1


def test_steering_at_declared_points_equals_the_eager_backend(client: openai.OpenAI, eager: Any) -> None:
    spec = _spec()
    steered = _completion(client, {"steering": spec.to_dict()}, max_tokens=8)
    ids = eager.to_tokens(PROMPT)[0].tolist()
    assert _ids(steered) == eager.generate(ids, max_tokens=8, steering_spec=spec).token_ids
    assert _ids(steered) != _ids(_completion(client, None, max_tokens=8))
    by_name = client.completions.create(model=PRESET, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_name.choices[0].text == eager.generate(ids, max_tokens=8, steering_spec=PRESET_SPEC).text


def test_points_inside_layers_and_on_the_stream_equal_the_eager_backend(client: openai.OpenAI, eager: Any) -> None:
    spec = _spec(2.0)
    ids = eager.to_tokens(PROMPT)[0].tolist()
    positions = [0, 2, len(ids) - 1, len(ids) + 2]
    interp = {"steering": spec.to_dict(), "points": POINTS, "positions": positions}
    out = _completion(client, interp)
    answer = out.model_extra["interp"]
    assert answer["positions"] == positions
    completion, cache = capture_generation(eager, ids, POINTS, max_tokens=6, steering_spec=spec, positions=positions)
    assert completion.text == out.choices[0].text
    for point in POINTS:
        got = torch.tensor(answer["activations"][point])
        want = cache[point][0]
        assert got.shape == want.shape, point
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (point, (got - want).abs().max())


def test_readouts_and_the_lens_from_the_compiled_graph_equal_the_eager_backend(
    client: openai.OpenAI, eager: Any
) -> None:
    spec = _spec(2.0)
    out = _completion(client, {"steering": spec.to_dict(), "features": [READOUT], "lens": LENS})
    steps = out.model_extra["interp"]["steps"]
    ids = eager.to_tokens(PROMPT)[0].tolist()
    want = list(eager.stream(ids, max_tokens=6, steering_spec=spec, features=[READOUT], lens=LensRequest(**LENS)))
    assert [s["position"] for s in steps] == [s.position for s in want]
    for got, ref in zip(steps, want, strict=True):
        assert got["lens"]["ids"] == ref.lens.ids.tolist()
        assert torch.allclose(torch.tensor(got["lens"]["probs"]), ref.lens.probs, atol=1e-5)
        readout, expected = got["features"][READOUT], next(iter(ref.features.values()))
        assert readout["ids"] == expected.ids.reshape(-1).tolist()
        assert torch.allclose(torch.tensor(readout["values"]), expected.values.reshape(-1), atol=1e-4)
    clamp = SteeringSpec([FeatureWrite("res", 3, op="clamp", value=50.0)])
    clamped = _completion(client, {"steering": clamp.to_dict()}, max_tokens=8)
    assert _ids(clamped) == eager.generate(ids, max_tokens=8, steering_spec=clamp).token_ids


@pytest.mark.parametrize(
    ("interp", "param"),
    [
        ({"points": ["mlp_out.3"], "positions": [0]}, "interp.points[0]"),
        ({"steering": {"writes": [{"address": "resid_post.2", "vector": [0.0] * D_MODEL}]}}, "interp.steering"),
        ({"lens": {"layers": [2], "top_k": 3}}, "interp"),
    ],
    ids=["point", "write", "lens"],
)
def test_an_undeclared_point_is_a_400_naming_the_declaration(
    server: VllmServe, client: openai.OpenAI, interp: dict[str, Any], param: str
) -> None:
    answer = _post(server, "/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 2, "interp": interp})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "UndeclaredAddress" and error["param"] == param
    assert "declared:" in error["message"] and SERVE_STATIC_HOW in error["message"], error["message"]
    assert _completion(client, None).choices[0].text  # still serving


def test_the_interp_routes_refuse_undeclared_points_and_keep_the_compiled_saes(server: VllmServe) -> None:
    refused = _post(server, "/interp/v1/capture", {"text": PROMPT, "points": ["mlp_out.1"]})
    assert refused.status_code == 400 and refused.json()["error"] == "UndeclaredAddress", refused.text
    taken = _post(server, "/interp/v1/capture", {"text": PROMPT, "points": ["mlp_post.2"]})
    assert taken.status_code == 200, taken.text
    headers = {"Authorization": f"Bearer {KEY}"}
    path = str(shipped_saes()["interp:tiny-sae"])
    put = httpx.put(f"{server.url}/interp/v1/saes/late", json={"path": path}, headers=headers, timeout=60)
    assert put.status_code == 409 and "compiled" in put.text, put.text
    assert httpx.delete(f"{server.url}/interp/v1/saes/res", headers=headers, timeout=60).status_code == 409
    # a preset set at run time writes at declared write points only
    undeclared = SteeringSpec([Write(Address("resid_post", 2), _vector(D_MODEL, 3))])
    put = httpx.put(
        f"{server.url}/interp/v1/presets/tiny-late", content=json.dumps(undeclared.to_dict()), headers=headers
    )
    assert put.status_code == 400 and "UndeclaredAddress" in put.text, put.text
    put = httpx.put(f"{server.url}/interp/v1/presets/tiny-late", content=json.dumps(_spec().to_dict()), headers=headers)
    assert put.status_code == 200, put.text
    assert httpx.delete(f"{server.url}/interp/v1/presets/tiny-late", headers=headers).status_code == 200


def _counters(server: VllmServe) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    stats = httpx.get(f"{server.url}/interp/v1/workers", headers=headers, timeout=30).json()["workers"][0]
    return {k: v for k, v in stats.items() if k.startswith(("vllm_", "dynamo_")) or k == "live_requests"}


def test_no_request_body_gets_a_5xx_nor_a_recompile(server: VllmServe, client: openai.OpenAI) -> None:
    import random

    before = _counters(server)
    assert before["live_requests"] == 0 and any(v > 0 for k, v in before.items() if k.startswith("vllm_"))

    rng = random.Random(7)
    addresses = ["resid_post.1", "resid_post.2", "mlp_post.2", "attn_z.1", "attn_z.0", "mlp_post.9", "x", 3]
    for _ in range(30):
        address = rng.choice(addresses)
        width = rng.choice([D_MODEL, D_MLP, 16, 0])
        interp = rng.choice(
            [
                {"points": [address], "positions": rng.choice([[0], "prompt", [99], "x"])},
                {"steering": {"writes": [{"address": address, "vector": [0.5] * width, "op": "add"}]}},
                {"lens": {"layers": [rng.choice([0, 1, 3, -1, 9])], "top_k": rng.choice([1, 0, 10**9])}},
                {"features": [rng.choice([READOUT, "features:res:dense", "features:res:top100", "x"])]},
            ]
        )
        body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 2, "interp": interp}
        answer = _post(server, "/v1/completions", body)
        assert answer.status_code < 500, (body, answer.text)
    assert _completion(client, None).choices[0].text
    assert _counters(server) == before  # vLLM compiled once, before any request; nothing is left held


# -- the declaration, without a server ----------------------------------------------------------------


def test_auto_declares_every_resid_post_and_the_presets_writes(tmp_path: Any) -> None:
    preset = SteeringSpec([Write(Address("mlp_out", -1), torch.zeros(D_MODEL))]).to_dict()
    feature = SteeringSpec([FeatureWrite("res", 3, op="add", value=2.0)]).to_dict()  # the SAE reads resid_post.2
    clamp = SteeringSpec([FeatureWrite("res", 3, op="clamp", value=2.0)]).to_dict()  # no write point
    presets = {"p": preset, "f": feature, "c": clamp}
    extra = {"interp": {"static": "auto", "presets": presets, "saes": {"res": "interp:tiny-sae"}}}
    declared = serve_declaration(extra, 4)
    assert declared is not None
    every = tuple(f"resid_post.{layer}" for layer in range(4))
    assert declared.points == every and declared.writes == (*every, "mlp_out.3")
    # a feature add writes at its SAE's address: one of an SAE at mlp_out.1
    from interp_engine import Sae

    w_enc, w_dec = torch.randn(D_MODEL, 8), torch.randn(8, D_MODEL)
    Sae("standard", w_enc, torch.zeros(8), w_dec, torch.zeros(D_MODEL), "blocks.1.hook_mlp_out").save(tmp_path / "s")
    mlp = SteeringSpec([FeatureWrite("mlp", 3, op="add", value=2.0)]).to_dict()
    config = {"static": {"writes": "auto"}, "presets": {"m": mlp}, "saes": {"mlp": str(tmp_path / "s")}}
    only = serve_declaration({"interp": config}, 4)
    assert only is not None and only.writes == (*every, "mlp_out.1")
    assert list(declared.saes) == ["res"] and declared.saes["res"].path == "interp:tiny-sae"
    explicit = serve_declaration({"interp": {"static": {"points": ["mlp_post.-1", "mlp_post.3"]}}}, 4)
    assert explicit is not None and explicit.points == ("mlp_post.3",) and explicit.writes == ()
    assert explicit.slots == 257  # the backend's default slots, and row 0
    assert serve_declaration({"interp": {"saes": {}}}, 4) is None and serve_declaration({}, 4) is None


@pytest.mark.parametrize(
    "static",
    [
        "all",
        {"point": ["resid_post.1"]},
        {"points": "resid_post.1"},
        {"points": ["resid_post.9"]},
        {"points": ["nope.1"]},
        {"writes": [1]},
        {"write_slots": 0},
        {"sae_top_k": True},
    ],
)
def test_a_bad_declaration_names_what_is_wrong(static: Any) -> None:
    with pytest.raises(InterpError) as raised:
        serve_declaration({"interp": {"static": static}}, 4)
    assert str(raised.value)
    if isinstance(static, str) or "point" in static or "write_slots" in static:
        assert isinstance(raised.value, InvalidOption)


def test_the_workers_read_the_served_declaration_with_the_saes_digests(caplog: Any) -> None:
    """Before vLLM compiles, a worker reads ``interp.static`` as the plugin does, and writes it
    back under the backend's key with each SAE's digest (so the compile-cache key covers the SAE);
    one it cannot read is logged and leaves the engine to the dynamic taps."""
    from types import SimpleNamespace

    from interp_vllm._wire import CONFIG_KEY
    from interp_vllm.static._worker import served_declaration, static_config

    def runner(extra: dict[str, Any]) -> Any:
        model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=4))
        return SimpleNamespace(vllm_config=SimpleNamespace(additional_config=extra), model_config=model_config)

    extra: dict[str, Any] = {"interp": {"saes": {"res": "interp:tiny-sae"}, "static": {"points": ["mlp_post.-1"]}}}
    declared = static_config(runner(extra))
    assert declared is not None and declared.points == ("mlp_post.3",) and served_declaration(runner(extra))
    assert len(declared.saes["res"].digest) == 32
    assert extra[CONFIG_KEY]["saes"]["res"]["digest"] == declared.saes["res"].digest
    assert static_config(runner(extra)) == declared  # read back as written
    bad: dict[str, Any] = {"interp": {"static": {"points": ["resid_post.7"]}}}
    assert static_config(runner(bad)) is None and CONFIG_KEY not in bad
    assert "not served" in caplog.text and "resid_post.7" in caplog.text
    assert static_config(runner({})) is None and not served_declaration(runner({}))
