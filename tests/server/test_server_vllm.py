"""The HTTP server in front of a compiled vllm-static engine: concurrent HTTP requests batched by
vLLM each equal their solo runs, steering specs in JSON, and a client that disconnects
mid-stream aborts its engine request while the server keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from interp_engine.server import ServerLimits, create_app
from interp_testkit.suite import PROMPT, hf_for, rel_diff, vllm_model_path

from ..support.servers import LiveServer, tensor

TOL = 1e-4
FAMILY = "qwen2"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LiveServer, Any]]:
    app = create_app(
        vllm_model_path(FAMILY),
        backend="vllm-static",
        limits=ServerLimits(max_new_tokens=200),
        static_points=["resid_post.1", "logits"],
        static_writes=["resid_post.1"],
    )
    with LiveServer(app, run_config=False) as running:
        yield running, app


def test_concurrent_steered_and_unsteered_http_requests_equal_their_solo_runs(served: tuple[LiveServer, Any]) -> None:
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=120) as client:
        info = client.get("/v1/model").json()
        assert info["static_points"] == ["resid_post.1", "logits"]
        gen = torch.Generator().manual_seed(4)
        specs: list[dict[str, Any] | None] = [None]
        specs += [
            {"writes": [{"address": "resid_post.1", "vector": torch.randn(128, generator=gen).tolist(), "scale": s}]}
            for s in (2.0, 4.0, 8.0)
        ]
        texts = [PROMPT, "Hello there, how are you today", "A cat sat on the mat", "Once upon a time in a land"]
        bodies = [
            {"text": texts[i % 4], "points": ["resid_post.1", "logits"], "steering": specs[(i // 4) % 4]}
            for i in range(32)
        ]

        def post(body: dict[str, Any]) -> dict[str, Any]:
            response = client.post("/v1/capture", json=body)
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()
            return result

        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(post, bodies))
        for body, result in zip(bodies, together, strict=True):
            alone = post(body)
            for point in ("resid_post.1", "logits"):
                assert rel_diff(tensor(result["activations"][point]), tensor(alone["activations"][point])) <= TOL
        plain = together[0]
        ids = plain["token_ids"]
        with torch.no_grad():
            hf = hf_for(vllm_model_path(FAMILY))(torch.tensor([ids]), output_hidden_states=True)
        assert rel_diff(tensor(plain["activations"]["resid_post.1"]), hf.hidden_states[2][0]) <= TOL
        steered = together[4]  # the same prompt with a spec
        assert not torch.allclose(tensor(steered["activations"]["logits"]), tensor(plain["activations"]["logits"]))
        undeclared = client.post("/v1/capture", json={"text": PROMPT, "points": ["mlp_out.0"]})
        assert undeclared.status_code == 400 and undeclared.json()["error"] == "UndeclaredAddress"


def test_a_disconnect_mid_stream_aborts_the_engine_request(served: tuple[LiveServer, Any]) -> None:
    server, app = served
    engine = app.state.served.model._engine
    aborted: list[Any] = []
    original = engine.abort

    async def abort(request_id: Any, *args: Any, **kwargs: Any) -> Any:
        aborted.append(request_id)
        return await original(request_id, *args, **kwargs)

    engine.abort = abort  # record what the backend aborts
    spec = {"writes": [{"address": "resid_post.1", "vector": [0.5] * 128}]}
    body = {"text": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "steering": spec}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/generate", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while "event: token" not in next(lines):
                pass
        # the connection is closed after one token of 200: the engine request goes away
        deadline = time.monotonic() + 30
        while engine.output_processor.get_num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.output_processor.get_num_unfinished_requests() == 0
        assert aborted  # stopped by the disconnect, not run to its 200 tokens
        del engine.abort
        assert client.get("/v1/health").json()["status"] == "ok"
        done = client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 3, "steering": spec})
        assert done.status_code == 200 and len(done.json()["token_ids"]) == 3
