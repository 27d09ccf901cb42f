"""Chat prompts and the logit lens over HTTP (eager backend, ``interp:tiny``, a real uvicorn server
on a loopback port): ``messages`` on every prompt endpoint, the spans in the answers, steering
positions named by span resolved against the request's own chat, the lens in stream events and in
``steps``, the OpenAI-compatible chat completions — each equal to the model called directly — and
bad chats, templates, span names and lens requests answered 4xx in the server's one error shape
while the server keeps serving."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from interp_engine import (
    Address,
    LensRequest,
    NoChatTemplate,
    SteeringSpec,
    Write,
    lens_top_k,
    sync_model,
)
from interp_engine.server import ServerLimits, create_app
from interp_testkit.chat_templates import ROLE_TAG_TEMPLATE, SAMPLE_CONVERSATION

from ..support.engines import eager_model
from ..support.servers import LiveServer, is_error_body, sse, tensor

TEMPLATE = ROLE_TAG_TEMPLATE  # given as the template override
MESSAGES = SAMPLE_CONVERSATION
LIMITS = ServerLimits(max_new_tokens=32, max_messages=8, max_text_chars=4096, max_lens_layers=3, max_lens_top_k=5)
D_MODEL = 128


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    app = create_app("interp:tiny", backend="eager", limits=LIMITS, trust_request_chat_template=True)
    with LiveServer(app) as running:
        yield running


def chat_of(direct: Any, messages: list[dict[str, Any]] = MESSAGES, **options: Any) -> Any:
    options.setdefault("template", TEMPLATE)
    return direct.chat_tokens(messages, **options)


def body(**fields: Any) -> dict[str, Any]:
    """A request with the test chat (and its template) as the prompt."""
    return {"messages": MESSAGES, "chat_template": TEMPLATE, **fields}


def spans_json(chat: Any) -> dict[str, Any]:
    def span(s: Any) -> dict[str, Any]:
        return {
            "kind": s.kind,
            "role": s.role,
            "index": s.index,
            "start": s.start,
            "end": s.end,
            "turn_start": s.turn_start,
            "turn_end": s.turn_end,
        }

    return {
        "messages": [span(s) for s in chat.messages],
        "reasoning": [span(s) for s in chat.reasoning],
        "generation_start": chat.generation_start,
        "text": chat.text,
    }


def vector(seed: int, scale: float = 1.0) -> list[float]:
    return (torch.randn(D_MODEL, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def assert_ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


# -- messages as the prompt ---------------------------------------------------------------------


def test_the_model_info_says_what_chats_it_takes(client: httpx.Client) -> None:
    assert client.get("/v1/model").json()["chat"] == {"template": True, "request_templates": True}


def test_tokenize_gives_the_chat_ids_and_spans(client: httpx.Client, direct: Any) -> None:
    chat = chat_of(direct)
    out = assert_ok(client.post("/v1/tokenize", json=body()))
    assert out["token_ids"] == chat.ids
    assert out["chat"] == spans_json(chat)
    assert out["str_tokens"] == direct.to_str_tokens(chat.ids)
    # what the spans say: the last user message's content tokens decode to its text
    last_user = out["chat"]["messages"][3]
    assert last_user["role"] == "user" and last_user["index"] == 3
    assert "".join(out["str_tokens"][last_user["start"] : last_user["end"]]) == MESSAGES[3]["content"]
    assert out["chat"]["generation_start"] == len(chat.ids)
    # without a generation prompt: no generation start, fewer tokens
    plain = assert_ok(client.post("/v1/tokenize", json=body(add_generation_prompt=False)))
    assert plain["chat"]["generation_start"] is None
    assert plain["token_ids"] == chat_of(direct, add_generation_prompt=False).ids
    assert len(plain["token_ids"]) < len(chat.ids)


def test_the_models_own_template(client: httpx.Client, direct: Any) -> None:
    """interp:tiny ships a minimal chat template: messages need no chat_template."""
    chat = direct.chat_tokens(MESSAGES)
    out = assert_ok(client.post("/v1/tokenize", json={"messages": MESSAGES}))
    assert out["token_ids"] == chat.ids and out["chat"] == spans_json(chat)
    generated = assert_ok(client.post("/v1/generate", json={"messages": MESSAGES, "max_tokens": 4}))
    assert generated["token_ids"] == direct.generate(chat, max_tokens=4).token_ids


def test_capture_with_messages_equals_the_model(client: httpx.Client, direct: Any) -> None:
    chat = chat_of(direct)
    out = assert_ok(client.post("/v1/capture", json=body(points=["resid_post.1", "logits"])))
    assert out["token_ids"] == chat.ids and out["chat"] == spans_json(chat)
    acts = direct.capture(chat, ["resid_post.1", "logits"])
    for name in ("resid_post.1", "logits"):
        assert torch.equal(tensor(out["activations"][name]), acts[Address.parse(name)].float())
    # as a safetensors Cache file: the spans in its metadata
    raw = client.post("/v1/capture", json=body(points=["resid_post.1"], format="safetensors"))
    assert raw.status_code == 200
    from safetensors.torch import load

    header_len = int.from_bytes(raw.content[:8], "little")
    metadata = json.loads(raw.content[8 : 8 + header_len])["__metadata__"]
    assert json.loads(metadata["chat"]) == spans_json(chat)
    assert torch.equal(load(raw.content)["resid_post.1"][0], acts[Address("resid_post", 1)].float())


def test_generate_and_capture_generation_with_messages(client: httpx.Client, direct: Any) -> None:
    chat = chat_of(direct)
    expected = direct.generate(chat, max_tokens=5)
    out = assert_ok(client.post("/v1/generate", json=body(max_tokens=5)))
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert out["chat"] == spans_json(chat)
    both = assert_ok(client.post("/v1/capture_generation", json=body(max_tokens=5, points=["resid_post.0"])))
    assert both["completion"]["token_ids"] == expected.token_ids and both["chat"] == spans_json(chat)
    assert tensor(both["activations"]["resid_post.0"]).shape[0] == len(chat) + 5
    attention = assert_ok(client.post("/v1/attention", json=body(layers=[0])))
    assert attention["chat"] == spans_json(chat) and tensor(attention["patterns"]["attn_pattern.0"]).shape[-1] == len(
        chat
    )
    # streamed: the spans ride on the first token event
    with client.stream("POST", "/v1/generate", json=body(max_tokens=5, stream=True)) as response:
        events = list(sse(response))
    tokens = [data for name, data in events if name == "token"]
    assert [t["token_id"] for t in tokens] == expected.token_ids
    assert tokens[0]["chat"] == spans_json(chat) and all("chat" not in t for t in tokens[1:])
    assert events[-1][0] == "done"


# -- steering positions named by span ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["user[-1].last", "assistant", "system.turn", "message[1]", "user"])
def test_span_named_positions_equal_the_explicit_ones(client: httpx.Client, direct: Any, name: str) -> None:
    chat = chat_of(direct)
    explicit = chat.positions(name)
    assert explicit  # the name selects something in this chat

    def capture(positions: Any) -> torch.Tensor:
        write = {"address": "resid_post.0", "vector": vector(1), "scale": 8.0, "positions": positions}
        out = assert_ok(client.post("/v1/capture", json=body(points=["logits"], steering={"writes": [write]})))
        return tensor(out["activations"]["logits"])

    named, by_hand = capture(name), capture(explicit)
    assert torch.equal(named, by_hand)
    plain = tensor(assert_ok(client.post("/v1/capture", json=body(points=["logits"])))["activations"]["logits"])
    assert not torch.equal(named, plain)  # the write did something
    # and the model itself, called directly with the same spec
    spec = SteeringSpec([Write("resid_post.0", torch.tensor(vector(1)), scale=8.0, positions=name)])
    assert torch.equal(direct.capture(chat, ["logits"], steering_spec=spec)[Address("logits")].float(), named)


def test_span_named_steering_in_a_generation(client: httpx.Client, direct: Any) -> None:
    chat = chat_of(direct)
    write = {"address": "resid_post.1", "vector": vector(2), "scale": 12.0, "positions": "user[-1].last"}
    out = assert_ok(client.post("/v1/generate", json=body(max_tokens=6, steering={"writes": [write]})))
    spec = SteeringSpec(
        [Write("resid_post.1", torch.tensor(vector(2)), scale=12.0, positions=chat.positions("user[-1].last"))]
    )
    assert out["token_ids"] == direct.generate(chat, max_tokens=6, steering_spec=spec).token_ids
    # chat completions take span names too
    completion = assert_ok(
        client.post(
            "/v1/chat/completions",
            json=body(max_tokens=6, temperature=0, interp={"steering": {"writes": [write]}}),
        )
    )
    assert completion["interp"]["token_ids"] == out["token_ids"]


def test_a_span_name_needs_messages(client: httpx.Client) -> None:
    write = {"address": "resid_post.0", "vector": vector(1), "positions": "assistant"}
    response = client.post("/v1/capture", json={"text": "Hello", "points": ["logits"], "steering": {"writes": [write]}})
    assert response.status_code == 400 and response.json()["error"] == "InvalidSteering"
    assert response.json()["field"] == "steering" and "chat_tokens" in response.json()["message"]


# -- the lens --------------------------------------------------------------------------------------


def reference_lens(direct: Any, ids: list[int], layers: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lens_top_k(decode_residuals(resid_post))`` over prompt + generated ids, at ``layers``."""
    acts = direct.capture(ids, [Address("resid_post", layer) for layer in layers])
    stacked = torch.stack([acts[Address("resid_post", layer)] for layer in layers])  # [L, n, d]
    top_ids, top_probs = lens_top_k(direct.decode_residuals(stacked), k)
    return top_ids, top_probs  # [L, n, k]


def check_step_lens(step: dict[str, Any], direct: Any, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    lens, position = step["lens"], step["position"]
    ids, probs = ref
    assert lens["ids"] == ids[:, position].tolist()
    assert torch.allclose(torch.tensor(lens["probs"]), probs[:, position], atol=1e-5)
    assert lens["tokens"] == [direct.to_str_tokens(row) for row in lens["ids"]]


def test_the_lens_streams_with_each_token(client: httpx.Client, direct: Any) -> None:
    lens = {"layers": [0, -1], "top_k": 3, "positions": "prompt"}
    request = {"text": "The capital of France is", "max_tokens": 6, "stream": True, "lens": lens}
    with client.stream("POST", "/v1/generate", json=request) as response:
        assert response.status_code == 200
        events = list(sse(response))
    tokens = [data for name, data in events if name == "token"]
    prompt = direct.to_tokens("The capital of France is")[0].tolist()
    generated = [t["token_id"] for t in tokens]
    assert len(tokens) == 6 and generated == direct.generate(prompt, max_tokens=6).token_ids
    ref = reference_lens(direct, prompt + generated, [0, 3], 3)
    for i, step in enumerate(tokens):
        assert step["position"] == len(prompt) - 1 + i and step["lens"]["layers"] == [0, 3]
        check_step_lens(step, direct, ref)
    # greedy: the last layer's top-1 is the token generated
    assert [t["lens"]["ids"][-1][0] for t in tokens] == generated
    first = tokens[0]["prompt_lens"]
    assert first["positions"] == list(range(len(prompt))) and first["layers"] == [0, 3]
    assert first["ids"] == ref[0][:, : len(prompt)].tolist()
    assert torch.allclose(torch.tensor(first["probs"]), ref[1][:, : len(prompt)], atol=1e-5)
    assert all("prompt_lens" not in t for t in tokens[1:])
    # the same request unstreamed: the lens in steps, the prompt's under prompt_lens
    unstreamed = assert_ok(client.post("/v1/generate", json={**request, "stream": False}))
    assert [s["token_id"] for s in unstreamed["steps"]] == generated
    for ours, theirs in zip(unstreamed["steps"], tokens, strict=True):
        assert ours["lens"]["ids"] == theirs["lens"]["ids"] and ours["lens"]["tokens"] == theirs["lens"]["tokens"]
    assert unstreamed["prompt_lens"]["ids"] == first["ids"]


def test_the_lens_at_a_chat_span(client: httpx.Client, direct: Any) -> None:
    chat = chat_of(direct)
    lens = {"layers": [1], "top_k": 2, "positions": "user[-1]"}
    out = assert_ok(client.post("/v1/generate", json=body(max_tokens=3, lens=lens)))
    assert out["prompt_lens"]["positions"] == chat.positions("user[-1]")
    ref = reference_lens(direct, chat.ids + out["token_ids"], [1], 2)
    assert out["prompt_lens"]["ids"] == ref[0][:, chat.positions("user[-1]")].tolist()
    for step in out["steps"]:
        check_step_lens(step, direct, ref)
    # direct.stream with the same LensRequest agrees
    steps = list(direct.stream(chat, max_tokens=3, lens=LensRequest([1], top_k=2, positions="user[-1]")))
    assert [s.lens.ids.tolist() for s in steps] == [s["lens"]["ids"] for s in out["steps"]]


def test_the_lens_in_capture_generation_and_completions(client: httpx.Client, direct: Any) -> None:
    lens = {"layers": [-1], "top_k": 2}
    out = assert_ok(
        client.post(
            "/v1/capture_generation",
            json={"text": "The capital of France is", "max_tokens": 3, "points": ["embed"], "lens": lens},
        )
    )
    n = len(out["token_ids"])
    assert out["lens"]["positions"] == [n - 1, n, n + 1] and out["lens"]["layers"] == [3]
    assert [row[0] for row in out["lens"]["ids"][0]] == out["completion"]["token_ids"]  # greedy
    # OpenAI completions: each chunk's interp.lens
    request = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json={**request, "interp": {"lens": lens}}) as response:
        chunks = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:") and "{" in line]
    lensed = [c["interp"]["lens"] for c in chunks if "interp" in c]
    assert [entry["ids"][0][0] for entry in lensed] == out["completion"]["token_ids"]


# -- OpenAI chat completions -----------------------------------------------------------------------


def test_chat_completions_through_the_openai_client(server: LiveServer, direct: Any) -> None:
    chat = chat_of(direct)
    expected = direct.generate(chat, max_tokens=5)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as oa:
        extra = {"chat_template": TEMPLATE, "interp": {"lens": {"layers": [0], "top_k": 1}}}
        out = oa.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body=extra,
        )
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == expected.text
        assert out.choices[0].logprobs is not None and len(out.choices[0].logprobs.content or []) == 5
        assert out.usage is not None and out.usage.prompt_tokens == len(chat)
        assert out.model_extra is not None
        assert out.model_extra["interp"]["chat"] == spans_json(chat)
        assert len(out.model_extra["interp"]["steps"]) == 5
        stream = oa.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, stream=True, extra_body=extra
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert "".join(pieces) == expected.text
        with pytest.raises(openai.BadRequestError):  # the model has no such span
            oa.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                extra_body={"chat_template": TEMPLATE, "interp": {"lens": {"layers": [0], "positions": "tool"}}},
            )


# -- bad input: 4xx, never 5xx -------------------------------------------------------------------


BAD: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("empty messages", {"messages": [], "chat_template": TEMPLATE}, 400, "InvalidChat", "messages"),
    ("no role", {"messages": [{"content": "x"}]}, 422, "ValidationError", "messages[0].role"),
    ("empty role", {"messages": [{"role": "", "content": "x"}]}, 422, "ValidationError", "messages[0].role"),
    ("content not text", {"messages": [{"role": "user", "content": 3}]}, 422, "ValidationError", None),
    ("unknown message field", {"messages": [{"role": "user", "content": "x", "x": 1}]}, 422, "ValidationError", None),
    ("text and messages", {"text": "x", "messages": MESSAGES}, 422, "ValidationError", "token_ids"),
    ("template without messages", {"text": "x", "chat_template": TEMPLATE}, 422, "ValidationError", "chat_template"),
    ("generation prompt without messages", {"text": "x", "add_generation_prompt": False}, 422, "ValidationError", None),
    (
        "template raises",
        body(chat_template="{{ raise_exception('roles must alternate') }}"),
        400,
        "InvalidChat",
        "chat_template",
    ),
    ("template syntax", body(chat_template="{% for %}"), 400, "InvalidChat", "chat_template"),
    ("template type error", body(chat_template="{{ messages[0]['content'] + 3 }}"), 400, "InvalidChat", None),
    ("template kwargs reserved", body(chat_template_kwargs={"tokenize": True}), 400, "InvalidOption", None),
    ("template kwargs odd name", body(chat_template_kwargs={"a b": 1}), 400, "InvalidOption", None),
    ("too many messages", body(messages=[{"role": "user", "content": "x"}] * 9), 413, "LimitExceeded", "messages"),
    ("too many characters", body(messages=[{"role": "user", "content": "x" * 5000}]), 413, "LimitExceeded", "messages"),
    (
        "unknown span",
        body(steering={"writes": [{"address": "resid_post.0", "vector": [0.0] * D_MODEL, "positions": "tool[0]"}]}),
        400,
        "InvalidSteering",
        "steering",
    ),
    (
        "span out of range",
        body(
            steering={"writes": [{"address": "resid_post.0", "vector": [0.0] * D_MODEL, "positions": "user[7].last"}]}
        ),
        400,
        "InvalidSteering",
        "steering",
    ),
    (
        "bad span grammar",
        body(steering={"writes": [{"address": "resid_post.0", "vector": [0.0] * D_MODEL, "positions": "user[x"}]}),
        400,
        "InvalidSteering",
        "steering.writes[0]",
    ),
    (
        "bad part",
        body(steering={"writes": [{"address": "resid_post.0", "vector": [0.0] * D_MODEL, "positions": "user.middle"}]}),
        400,
        "InvalidSteering",
        "steering.writes[0]",
    ),
    ("lens top_k over the limit", body(lens={"layers": [0], "top_k": 6}), 413, "LimitExceeded", "lens.top_k"),
    ("lens layers over the limit", body(lens={"layers": [0, 1, 2, 3]}), 413, "LimitExceeded", "lens.layers"),
    ("lens layer outside", body(lens={"layers": [4]}), 400, "LayerOutOfRange", "lens.layers"),
    ("lens layer twice", body(lens={"layers": [3, -1]}), 400, "InvalidOption", None),
    ("lens top_k zero", body(lens={"layers": [0], "top_k": 0}), 422, "ValidationError", "lens.top_k"),
    ("lens no layers", body(lens={"layers": []}), 422, "ValidationError", "lens.layers"),
    ("lens unknown field", body(lens={"layers": [0], "k": 2}), 422, "ValidationError", None),
    ("lens positions all", body(lens={"layers": [0], "positions": "all"}), 400, "InvalidOption", "lens"),
    ("lens unknown span", body(lens={"layers": [0], "positions": "tool"}), 400, "InvalidSteering", "lens.positions"),
    (
        "lens span on text",
        {"text": "x", "lens": {"layers": [0], "positions": "user"}},
        400,
        "InvalidSteering",
        "lens.positions",
    ),
    ("lens position outside", {"text": "x y", "lens": {"layers": [0], "positions": [40]}}, 400, None, None),
]


@pytest.mark.parametrize(("case", "request_body", "status", "error", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_chats_and_lenses_are_4xx(
    client: httpx.Client, case: str, request_body: dict[str, Any], status: int, error: str | None, field: str | None
) -> None:
    for stream in (False, True):
        response = client.post("/v1/generate", json={"max_tokens": 2, "stream": stream, **request_body})
        assert response.status_code == status, (case, response.text)
        out = response.json()
        assert is_error_body(out), out
        if error is not None:
            assert out["error"] == error, out
        if field is not None:
            assert out["field"] == field, out
    assert client.get("/v1/health").json()["status"] == "ok"


def test_a_model_without_a_chat_template_and_a_server_that_runs_none_sent(direct: Any) -> None:
    """The testkit's GPT-2 has no chat template: NoChatTemplate naming the fix. A server not told
    to trust request templates (the default) refuses one sent, before rendering anything."""
    model = eager_model("gpt2")
    with pytest.raises(NoChatTemplate):
        sync_model(model).chat_tokens(MESSAGES)
    with LiveServer(create_app(model)) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        response = c.post("/v1/generate", json={"messages": MESSAGES, "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"] == "NoChatTemplate" and response.json()["field"] == "chat_template"
        assert "template" in response.json()["message"]
        assert c.get("/v1/model").json()["chat"] == {"template": False, "request_templates": False}
        for path in ("/v1/generate", "/v1/tokenize", "/v1/chat/completions"):
            sent = c.post(path, json={"messages": MESSAGES, "chat_template": "{{ 'x' * 10**10 }}"})
            assert sent.status_code == 400, sent.text
            assert sent.json()["error"] == "InvalidOption" and sent.json()["field"] == "chat_template"
            assert "--trust-request-chat-template" in sent.json()["message"]
        assert c.post("/v1/generate", json={"text": "Hello", "max_tokens": 2}).status_code == 200


def _pick(rng: random.Random, good: list[Any], bad: list[Any], p_bad: float = 0.12) -> Any:
    """A valid value mostly, a bad one with probability ``p_bad``."""
    return rng.choice(bad) if rng.random() < p_bad else rng.choice(good)


def _mutated_chat_body(rng: random.Random) -> dict[str, Any]:
    """A chat request, each part valid most of the time and broken now and then."""
    messages: Any = []
    for _ in range(_pick(rng, [1, 2, 3, 4], [0, 9])):
        message: dict[str, Any] = {
            "role": _pick(rng, ["user", "assistant", "system", "tool"], ["", "x" * 70, None, 3, "ünï"]),
            "content": _pick(rng, ["hi", "The capital of France is", "\u4e2d\u6587", ""], [None, 3, ["a"], {"t": 1}]),
        }
        if rng.random() < 0.05:
            message["reasoning_content"] = rng.choice(["thought", 5])
        if rng.random() < 0.03:
            del message["content"]
        messages.append(message)
    if rng.random() < 0.03:
        messages = rng.choice(["hi", {"role": "user"}, 3, None])
    out: dict[str, Any] = {"messages": messages, "max_tokens": rng.randint(1, 3)}
    out["chat_template"] = _pick(
        rng, [TEMPLATE], ["{{ raise_exception('no') }}", "{% if %}", "{{ messages | length }}", "", "{{ 1/0 }}", 3]
    )
    if rng.random() < 0.2:
        out["add_generation_prompt"] = _pick(rng, [False, True], ["yes"])
    if rng.random() < 0.4:
        positions = _pick(
            rng,
            ["user", "assistant[-1].last", "message[0]", "system.turn", "user[-1].first", [0, 1], [-1], "prompt"],
            ["reasoning", "message[99]", "user[", ".last", "x" * 300, "tool", 3],
        )
        out["steering"] = {"writes": [{"address": "resid_post.0", "vector": [0.01] * D_MODEL, "positions": positions}]}
    if rng.random() < 0.4:
        out["lens"] = {
            "layers": _pick(rng, [[0], [-1, 1], [2]], [[], [9], [0, 0], ["0"]]),
            "top_k": _pick(rng, [1, 3, 5], [0, 99, -1]),
            "positions": _pick(rng, [None, "prompt", "user[-1]", [0], "message.last"], ["generated", [99], "tool"]),
        }
    if rng.random() < 0.1:
        out["chat_template_kwargs"] = _pick(rng, [{"enable_thinking": False}], [{"tokenize": True}, {"": 1}, []])
    if rng.random() < 0.2:
        out["stream"] = True
    return out


def test_fuzzed_chat_bodies_never_give_a_5xx(client: httpx.Client) -> None:
    rng = random.Random(16)
    statuses: dict[int, int] = {}
    for _ in range(200):
        request = _mutated_chat_body(rng)
        path = rng.choice(["/v1/generate", "/v1/capture", "/v1/tokenize", "/v1/chat/completions"])
        if path == "/v1/capture":
            request = {k: v for k, v in request.items() if k not in ("max_tokens", "lens", "stream")}
            request["points"] = ["resid_post.0"]
        elif path == "/v1/tokenize":
            request = {k: v for k, v in request.items() if k in ("messages", "chat_template", "add_generation_prompt")}
        response = client.post(path, json=request)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (request, response.text)
        if response.status_code >= 400:
            assert is_error_body(response.json()), response.text
    assert statuses.get(200, 0) > 30 and sum(n for s, n in statuses.items() if s >= 400) > 30, statuses
    assert client.get("/v1/health").json()["status"] == "ok"
    assert client.post("/v1/generate", json=body(max_tokens=2)).status_code == 200


def test_tokenize_a_text_still_works(client: httpx.Client, direct: Any) -> None:
    out = assert_ok(client.post("/v1/tokenize", json={"text": "Hello there"}))
    assert out["token_ids"] == direct.to_tokens("Hello there")[0].tolist() and "chat" not in out
    missing = client.post("/v1/tokenize", json={})
    assert missing.status_code == 422 and missing.json()["field"] == "text"


def test_a_backend_without_a_tokenizer_or_the_lens_answers_4xx() -> None:
    """The third-party toy backend (tests/toy_backend) has no Hugging Face tokenizer to render
    chats and reads no lens: both are 4xx, and it keeps serving."""
    app = create_app("toy-model", backend="toy")
    with LiveServer(app) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        assert c.get("/v1/model").json()["chat"]["template"] is False
        chat = c.post("/v1/generate", json={"messages": MESSAGES, "max_tokens": 2})
        assert chat.status_code == 400 and chat.json()["error"] == "UnsupportedOperation", chat.text
        lensed = c.post("/v1/generate", json={"token_ids": [1, 2, 3], "max_tokens": 2, "lens": {"layers": [0]}})
        assert 400 <= lensed.status_code < 500 and is_error_body(lensed.json()), lensed.text
        assert c.post("/v1/generate", json={"token_ids": [1, 2, 3], "max_tokens": 2}).status_code == 200
