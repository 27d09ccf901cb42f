"""LoRA adapters over HTTP and on the command line: ``interp serve --adapter NAME=PATH`` (here
``create_app(..., adapters=...)``) registers them, every endpoint's ``adapter`` field names one,
and each answer equals the model called directly under that adapter; a name the server did not
register (a folder on its disk included) is a 400 naming the field. ``interp capture --adapter``
writes the adapted activations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from safetensors import safe_open

from interp_engine import Address, Cache, LensRequest, load_model, shipped_adapters, sync_model
from interp_engine.cli import build_parser
from interp_engine.cli._common import load_options
from interp_engine.server import ServerLimits, create_app
from interp_testkit.suite import rel_diff

from ..support.cli import interp
from ..support.servers import LiveServer, sse, tensor

LORA = "interp:tiny-lora"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def direct() -> Iterator[Any]:
    model = sync_model(load_model("interp:tiny", backend="eager", adapters={"edit": LORA}))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    app = create_app("interp:tiny", backend="eager", limits=ServerLimits(max_new_tokens=16), adapters={"edit": LORA})
    with LiveServer(app, run_config=False) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        yield c


def test_the_model_lists_its_adapters(client: httpx.Client) -> None:
    listed = client.get("/v1/model").json()["adapters"]
    assert listed == [{"name": "edit", "rank": 4, "targets": ["c_fc", "c_proj"], "layers": [0, 1, 2, 3]}]
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    for body in ("CaptureRequest", "GenerateRequest", "CaptureGenerationRequest", "AttentionRequest"):
        assert "adapter" in schema[body]["properties"], body


def test_every_endpoint_takes_the_adapter(client: httpx.Client, direct: Any) -> None:
    ids = direct.to_tokens(PROMPT)[0].tolist()
    plain = client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 1}).json()
    edited = client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 1, "adapter": "edit"}).json()
    assert (plain["text"], edited["text"]) == (" Paris", " Rome")
    events = list(
        sse(client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 3, "adapter": "edit", "stream": True}))
    )
    assert [data["token_id"] for kind, data in events if kind == "token"] == direct.generate(
        ids, max_tokens=3, adapter="edit"
    ).token_ids
    body = client.post("/v1/capture", json={"token_ids": ids, "points": ["mlp_out.3"], "adapter": "edit"}).json()
    want = direct.capture(ids, ["mlp_out.3"], adapter="edit")[Address("mlp_out", 3)]
    assert rel_diff(tensor(body["activations"]["mlp_out.3"]), want) <= 1e-6
    base = direct.capture(ids, ["mlp_out.3"])[Address("mlp_out", 3)]
    assert not torch.allclose(want, base, atol=1e-3)
    both = client.post(
        "/v1/capture_generation",
        json={
            "token_ids": ids,
            "points": ["resid_post.3"],
            "max_tokens": 2,
            "adapter": "edit",
            "lens": {"layers": [3]},
        },
    ).json()
    completion, acts = direct.capture_generation(
        ids, ["resid_post.3"], max_tokens=2, adapter="edit", lens=LensRequest(layers=[3])
    )
    assert both["completion"]["token_ids"] == completion.token_ids
    assert rel_diff(tensor(both["activations"]["resid_post.3"]), acts[Address("resid_post", 3)]) <= 1e-6
    patterns = client.post("/v1/attention", json={"token_ids": ids, "layers": [2], "adapter": "edit"}).json()
    want_pattern = direct.capture_attention(ids, [2], adapter="edit")[Address("attn_pattern", 2)]
    assert rel_diff(tensor(patterns["patterns"]["attn_pattern.2"]), want_pattern) <= 1e-6


def test_an_adapter_the_server_did_not_register_is_a_400(client: httpx.Client) -> None:
    for name in ("nope", str(shipped_adapters()[LORA])):  # never a folder on the server's disk
        response = client.post("/v1/capture", json={"text": PROMPT, "points": ["resid_post.0"], "adapter": name})
        assert response.status_code == 400, response.text
        error = response.json()
        assert (error["error"], error["field"], error["valid"]) == ("UnknownAdapter", "adapter", ["edit"])
    assert client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 1, "adapter": "edit"}).status_code == 200


def test_cli_capture_and_serve_take_adapters(capsys: pytest.CaptureFixture[str], tmp_path: Any, direct: Any) -> None:
    out = tmp_path / "acts.safetensors"
    status, _, err = interp(
        capsys, "capture", "interp:tiny", PROMPT, "--points", "mlp_out.3", "--adapter", LORA, "--out", str(out)
    )
    assert status == 0, err
    cache = Cache.load(out)
    ids = direct.to_tokens(PROMPT)[0].tolist()
    assert (
        rel_diff(cache["mlp_out.3"][0], direct.capture(ids, ["mlp_out.3"], adapter="edit")[Address("mlp_out", 3)])
        <= 1e-6
    )
    with safe_open(out, framework="pt") as f:
        assert f.metadata()["interp.adapter"] == LORA
    args = build_parser().parse_args(["serve", "interp:tiny", "--adapter", f"edit={LORA}", "--adapter", "b=/x"])
    assert load_options(args)["adapters"] == {"edit": LORA, "b": "/x"}
    status, _, err = interp(
        capsys,
        "capture",
        "interp:tiny",
        PROMPT,
        "--points",
        "mlp_out.3",
        "--adapter",
        "nope",
        "--out",
        str(tmp_path / "x.safetensors"),
    )
    assert status != 0 and "nope" in err


def test_openai_completions_name_an_adapter_as_their_model(client: httpx.Client) -> None:
    """vLLM's convention: ``model=<adapter name>`` runs the completion under that adapter, and
    ``/v1/models`` lists each adapter with the served model as its parent."""
    import openai

    api = openai.OpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)
    ids = [card.id for card in api.models.list().data]
    assert ids[1:] == ["edit"]
    assert api.models.retrieve("edit").model_dump()["parent"] == ids[0]
    edited = api.completions.create(model="edit", prompt=PROMPT, max_tokens=1, temperature=0)
    plain = api.completions.create(model=ids[0], prompt=PROMPT, max_tokens=1, temperature=0)
    assert (plain.choices[0].text, edited.choices[0].text) == (" Paris", " Rome")
    assert edited.model == "edit"
