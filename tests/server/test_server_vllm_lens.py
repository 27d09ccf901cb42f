"""The HTTP server over a vLLM engine: a streamed chat generation steered at a span-named position
with the logit lens in every event, equal to the eager backend on the same checkpoint called
directly (the lens within 1e-5, as tests/vllm/test_vllm_lens.py checks the engine's own)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from interp_engine import LensRequest, SteeringSpec, Write, load_model, sync_model
from interp_engine.server import create_app
from interp_testkit.chat_templates import ROLE_TAG_TEMPLATE as TEMPLATE
from interp_testkit.chat_templates import SAMPLE_CONVERSATION as MESSAGES
from interp_testkit.suite import VLLM_ENGINE_ARGS, vllm_model_path

from ..support.servers import LiveServer, sse

FAMILY = "llama"  # 3 layers
PROB_TOL = 1e-5


@pytest.fixture(scope="module")
def served() -> Iterator[LiveServer]:
    app = create_app(
        vllm_model_path(FAMILY), backend="vllm", trust_request_chat_template=True, **VLLM_ENGINE_ARGS[FAMILY]
    )
    with LiveServer(app) as running:
        yield running


def test_a_steered_chat_stream_carries_the_lens_equal_to_eager(served: LiveServer) -> None:
    d_model = 128
    vector = (torch.randn(d_model, generator=torch.Generator().manual_seed(3)) * 0.5).tolist()
    write = {"address": "resid_post.1", "vector": vector, "scale": 2.0, "positions": "user[-1].last"}
    lens = {"layers": [0, -1], "top_k": 3, "positions": "user[-1]"}
    body = {
        "messages": MESSAGES,
        "chat_template": TEMPLATE,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "steering": {"writes": [write]},
        "lens": lens,
    }
    with httpx.Client(base_url=served.url, timeout=300) as client:
        assert client.get("/v1/model").json()["info"]["d_model"] == d_model
        with client.stream("POST", "/v1/generate", json=body) as response:
            assert response.status_code == 200, response.read()
            events = list(sse(response))
        bad = client.post("/v1/generate", json={**body, "lens": {"layers": [0], "positions": "tool"}})
        assert bad.status_code == 400 and bad.json()["field"] == "lens.positions"
    tokens = [data for name, data in events if name == "token"]
    assert len(tokens) == 5 and events[-1][0] == "done"

    eager = sync_model(load_model(vllm_model_path(FAMILY), backend="eager"))
    try:
        chat = eager.chat_tokens(MESSAGES, template=TEMPLATE)
        assert tokens[0]["chat"]["messages"][3]["end"] == chat.messages[3].end
        spec = SteeringSpec([Write("resid_post.1", torch.tensor(vector), scale=2.0, positions="user[-1].last")])
        request = LensRequest([0, -1], top_k=3, positions="user[-1]")
        steps = list(eager.stream(chat, max_tokens=5, steering_spec=spec, lens=request, ignore_eos=True))
    finally:
        eager.shutdown()
    assert [t["token_id"] for t in tokens] == [s.token_id for s in steps]
    for ours, theirs in zip(tokens, steps, strict=True):
        assert theirs.lens is not None and ours["position"] == theirs.position
        assert ours["lens"]["layers"] == [0, 2]
        assert float((torch.tensor(ours["lens"]["probs"]) - theirs.lens.probs).abs().max()) <= PROB_TOL
        assert ours["lens"]["ids"][-1][0] == ours["token_id"]  # greedy: the last layer's top-1
    prompt_lens = tokens[0]["prompt_lens"]
    assert steps[0].prompt_lens is not None
    assert prompt_lens["positions"] == chat.positions("user[-1]") == list(steps[0].prompt_lens.positions)
    assert float((torch.tensor(prompt_lens["probs"]) - steps[0].prompt_lens.probs).abs().max()) <= PROB_TOL
    json.dumps(events)  # plain JSON all through
