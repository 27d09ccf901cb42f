"""A vLLM engine core that dies under a served model: the call that finds out raises the core's
typed ``ModelClosed`` (503 over HTTP) at once, not vLLM's own ``EngineDeadError``; every later
call does too, without waiting on the dead engine; ``/v1/health`` says ``EngineDead`` (503), after
a failed request (``vllm``) or by itself (``vllm-static``); and the server still shuts down cleanly.

Starts a vLLM engine: run under the machine's engine lock (``flock /tmp/interp-engine.lock``).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from interp_engine import ModelBase
from interp_engine.server import ServerLimits, create_app
from interp_testkit.suite import PROMPT, vllm_model_path

from ..support.servers import LiveServer

FAMILY = "qwen2"


def _engine_processes(model: Any) -> list[Any]:
    from interp_vllm._compat import engine_processes

    return engine_processes(model._engine)


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_a_dead_engine_is_a_typed_error_and_health_says_so(backend: str) -> None:
    options: dict[str, Any] = {}
    if backend == "vllm-static":
        options = {"static_points": ["resid_post.1"], "static_writes": ["resid_post.1"]}
    app = create_app(vllm_model_path(FAMILY), backend=backend, limits=ServerLimits(max_new_tokens=64), **options)
    capture = {"text": PROMPT, "points": ["resid_post.1"]}
    with LiveServer(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        assert client.post("/v1/capture", json=capture).status_code == 200
        model = app.state.served.model
        assert isinstance(model, ModelBase) and model.dead is None
        processes = _engine_processes(model)
        assert processes, "no engine core process found"
        for process in processes:
            process.kill()
        for process in processes:
            process.join(timeout=10)
        if backend == "vllm-static":  # health finds out by itself, before any request fails
            deadline = time.monotonic() + 15
            while (health := client.get("/v1/health")).status_code == 200:
                assert time.monotonic() < deadline, "health did not notice the dead engine"
                time.sleep(0.1)
            assert health.status_code == 503 and health.json()["error"] == "EngineDead"
        start = time.monotonic()
        response = client.post("/v1/generate", json={"text": PROMPT, "max_tokens": 8})
        took = time.monotonic() - start
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "ModelClosed" and "died" in response.json()["message"]
        assert took < 10
        assert model.dead is not None and "EngineDead" in model.dead
        health = client.get("/v1/health")
        assert health.status_code == 503 and health.json()["error"] == "EngineDead"
        for body in (capture, {**capture, "points": ["embed"]}):
            start = time.monotonic()
            again = client.post("/v1/capture", json=body)
            assert again.status_code == 503 and again.json()["error"] == "ModelClosed"
            assert time.monotonic() - start < 2
    assert app.state.served.model is None  # the lifespan shut the dead model down
