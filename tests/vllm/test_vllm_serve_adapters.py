"""interp-vllm inside a ``vllm serve`` that serves LoRA adapters and parses tool calls and
reasoning: a second real server (the CPU build, its own loopback port, started once for this
module) on the testkit's tiny Llama with a Qwen 3 chat tokenizer (``<think>``, ``<tool_call>``;
a short ChatML template),
``--enable-lora`` with an adapter made here with ``peft``, ``--tool-call-parser hermes`` and
``--reasoning-parser deepseek_r1``, driven by the ``openai`` client.

- A request naming the adapter carries a steering spec: its tokens and logprobs equal the eager
  backend's on the adapter merged into the weights (``peft``'s ``merge_and_unload``) with the same
  spec, so the plugin keeps vLLM's ``lora_request``.
- The ``/interp`` routes serve the server's ``--lora-modules`` LoRA: their ``adapter`` field names
  it as ``model=`` does on vLLM's routes, and captures, generations and captured generations under
  it equal the eager backend's with the same adapter (PEFT); any other name is ``400
  UnknownAdapter`` listing it. A LoRA vLLM loads at run time (``/v1/load_lora_adapter``, allowed
  here by ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is served there too, until vLLM unloads it.
- vLLM's parsers run on steered chats: a steering spec that writes each token of a reasoning
  section and a tool call (the unembedding direction of each, at the last layer) gives a message
  that vLLM's parsers split into ``reasoning`` and ``tool_calls``, whole and streamed; a spec of
  scale 0 answers exactly what no spec answers.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from interp_engine import Address, SteeringSpec, Write, generate_stream, load_model, sync_model
from interp_testkit.chat_templates import chat_tokenizer
from interp_testkit.suite import rel_diff, vllm_model_path
from interp_testkit.vllm_serve import VllmServe

from ..support.servers import tensor

SERVED = "tinychat"
ADAPTER = "tinylora"
PROMPT = "The capital of France is"
LAST = 2  # the tiny Llama's last layer
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "a tool",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template that names the tools in one line: Qwen 3's own lists each tool's JSON schema,
longer than the tiny model's 256 positions in its 512-token vocabulary."""
FORCED = '<think>ok</think><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
"""What the forcing spec makes the model write: a reasoning section, then a call of the tool."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """``base``: the tiny Llama with the chat tokenizer; ``adapter``: a rank-8 LoRA of it with
    random weights (``peft``); ``merged``: the base with that LoRA merged into its weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    base = root / "base"
    base.mkdir()
    source = vllm_model_path("llama")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(source / name, base / name)
    tokenizer = chat_tokenizer("qwen3")  # <|im_start|>, <think>, <tool_call> ... as special tokens
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(base)
    torch.manual_seed(0)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,  # random A and B: the adapter changes the model
    )
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    tuned.save_pretrained(root / "adapter")
    merged = tuned.merge_and_unload()
    merged.save_pretrained(root / "merged")
    tokenizer.save_pretrained(root / "merged")
    return {"base": base, "adapter": root / "adapter", "merged": root / "merged"}


@pytest.fixture(scope="module")
def server(models: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    log = tmp_path_factory.mktemp("serve-adapters") / "vllm-serve.log"
    args = [
        *("--served-model-name", SERVED, "--enforce-eager", "--dtype", "float32", "--max-model-len", "256"),
        *("--enable-lora", "--lora-modules", f"{ADAPTER}={models['adapter']}", "--max-lora-rank", "8"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"),
    ]
    env = {"VLLM_PLUGINS": "interp_vllm", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter
    with VllmServe(models["base"], args, log, env=env) as running:
        yield running.wait()


@pytest.fixture(scope="module")
def client(server: VllmServe) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _spec(scale: float = 4.0) -> SteeringSpec:
    vector = torch.randn(128, generator=torch.Generator().manual_seed(1))
    return SteeringSpec([Write("resid_post.1", vector, scale=scale)])


def _completion(client: openai.OpenAI, model: str, spec: SteeringSpec | None) -> Any:
    extra: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if spec is not None:
        extra["interp"] = {"steering": spec.to_dict()}
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, extra_body=extra
    )


def _ids(out: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_a_lora_request_carries_a_steering_spec(
    client: openai.OpenAI, server: VllmServe, models: dict[str, pathlib.Path]
) -> None:
    assert ADAPTER in [m.id for m in client.models.list().data]
    spec = _spec()
    base, tuned = _completion(client, SERVED, None), _completion(client, ADAPTER, None)
    steered = _completion(client, ADAPTER, spec)
    assert _ids(tuned) != _ids(base)  # the adapter changes the model
    assert _ids(steered) != _ids(tuned)  # and the spec changes the adapter's answer
    merged = sync_model(load_model(str(models["merged"]), backend="eager"))
    try:
        prompt = merged.to_tokens(PROMPT)[0].tolist()
        reference = list(generate_stream(merged, prompt, max_tokens=8, n_logprobs=1, steering_spec=spec))
        plain = merged.generate(prompt, max_tokens=8)
    finally:
        merged.shutdown()
    assert _ids(steered) == [step.token_id for step in reference]
    assert _ids(tuned) == plain.token_ids
    ours = steered.choices[0].logprobs.token_logprobs
    theirs = [dict(step.logprobs)[step.token_id] for step in reference]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-4
    # the base model's steering is still the Python API's on the same engine (/interp, no adapter)
    answer = httpx.post(
        f"{server.url}/interp/v1/generate",
        json={"text": PROMPT, "max_tokens": 8, "steering": spec.to_dict()},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["token_ids"] == _ids(_completion(client, SERVED, spec))


def test_the_interp_routes_serve_the_servers_lora(
    client: openai.OpenAI, server: VllmServe, models: dict[str, pathlib.Path]
) -> None:
    interp = f"{server.url}/interp/v1"
    listed = httpx.get(f"{interp}/model", timeout=60).json()["adapters"]
    assert [(a["name"], a["rank"]) for a in listed] == [(ADAPTER, 8)]
    spec = _spec()
    eager = sync_model(load_model(str(models["base"]), backend="eager", adapters={ADAPTER: str(models["adapter"])}))
    try:
        ids = eager.to_tokens(PROMPT)[0].tolist()
        points = ["resid_post.0", "attn_z.1", "attn_out.1", "mlp_post.2", "mlp_out.2", "logits"]
        want = eager.capture(ids, points, adapter=ADAPTER)
        plain = eager.capture(ids, points)
        tokens = eager.generate(ids, max_tokens=8, adapter=ADAPTER).token_ids
        completion, acts = eager.capture_generation(
            ids, ["resid_post.1"], max_tokens=4, steering_spec=spec, adapter=ADAPTER
        )
    finally:
        eager.shutdown()
    answer = httpx.post(f"{interp}/capture", json={"token_ids": ids, "points": points, "adapter": ADAPTER}, timeout=120)
    assert answer.status_code == 200, answer.text
    for point in points:
        got = tensor(answer.json()["activations"][point])
        assert rel_diff(got, want[Address.parse(point)]) <= 1e-4, point
    assert not torch.allclose(want[Address("attn_out", 1)], plain[Address("attn_out", 1)], atol=1e-3)
    generated = httpx.post(
        f"{interp}/generate", json={"text": PROMPT, "max_tokens": 8, "adapter": ADAPTER}, timeout=120
    ).json()
    assert generated["token_ids"] == tokens == _ids(_completion(client, ADAPTER, None))
    both = httpx.post(
        f"{interp}/capture_generation",
        json={
            "token_ids": ids,
            "points": ["resid_post.1"],
            "max_tokens": 4,
            "steering": spec.to_dict(),
            "adapter": ADAPTER,
        },
        timeout=120,
    ).json()
    assert both["completion"]["token_ids"] == completion.token_ids
    assert rel_diff(tensor(both["activations"]["resid_post.1"]), acts[Address("resid_post", 1)]) <= 1e-4
    refused = httpx.post(
        f"{interp}/capture", json={"token_ids": ids, "points": ["resid_post.0"], "adapter": "nope"}, timeout=60
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert (error["error"], error["field"], error["valid"]) == ("UnknownAdapter", "adapter", [ADAPTER])
    # a LoRA vLLM loads at run time (the same folder under another name and id) is served on
    # /interp under its name, and refused again once vLLM unloads it
    again = {"lora_name": "again", "lora_path": str(models["adapter"])}
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=again, timeout=120)
    assert loaded.status_code == 200, loaded.text
    try:
        listed = httpx.get(f"{interp}/model", timeout=60).json()["adapters"]
        assert sorted(a["name"] for a in listed) == ["again", ADAPTER]
        body = {"token_ids": ids, "points": points, "adapter": "again"}
        answer = httpx.post(f"{interp}/capture", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        for point in points:
            assert rel_diff(tensor(answer.json()["activations"][point]), want[Address.parse(point)]) <= 1e-4, point
    finally:
        unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "again"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    gone = httpx.post(f"{interp}/capture", json=body, timeout=60)
    assert gone.status_code == 400 and gone.json()["valid"] == [ADAPTER], gone.text


def _forcing(server: VllmServe, messages: list[dict[str, str]]) -> tuple[SteeringSpec, int]:
    """A spec that makes the model write :data:`FORCED` after the chat prompt (with the tools), a
    token at each generated position, and the number of tokens it writes."""
    from safetensors.torch import load_file

    rendered = httpx.post(
        f"{server.url}/tokenize",
        json={"model": SERVED, "messages": messages, "tools": TOOLS, "add_generation_prompt": True},
        timeout=60,
    )
    assert rendered.status_code == 200, rendered.text
    n = int(rendered.json()["count"])
    tokenizer = chat_tokenizer("qwen3")
    targets = tokenizer(FORCED, add_special_tokens=False)["input_ids"]
    unembed = load_file(str(vllm_model_path("llama") / "model.safetensors"))["lm_head.weight"]
    writes = [
        Write(f"resid_post.{LAST}", unembed[t] / unembed[t].norm(), scale=50.0, positions=[n - 1 + i])
        for i, t in enumerate(targets)
    ]
    return SteeringSpec(writes), len(targets)


def test_vllms_parsers_read_a_steered_chat(client: openai.OpenAI, server: VllmServe) -> None:
    messages = [{"role": "user", "content": "What is x?"}]
    spec, n_tokens = _forcing(server, messages)
    asked = {"interp": {"steering": spec.to_dict()}, "skip_special_tokens": False}
    whole = client.chat.completions.create(
        model=SERVED,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=n_tokens,
        temperature=0,
        extra_body=asked,
    )
    message = whole.choices[0].message
    assert message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"x": 1}  # type: ignore[union-attr]
    assert (message.model_extra or {}).get("reasoning") == "ok"
    assert whole.choices[0].finish_reason == "tool_calls"
    # streamed: the parsers' deltas add up to the same call and reasoning
    chunks = list(
        client.chat.completions.create(
            model=SERVED,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=n_tokens,
            temperature=0,
            stream=True,
            extra_body=asked,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert reasoning == "ok"
    assert [t.function.name for t in calls if t.function and t.function.name] == ["f"]
    arguments = "".join(t.function.arguments or "" for t in calls if t.function)
    assert json.loads(arguments) == {"x": 1}
    # unforced, the tiny model calls no tool; a spec of scale 0 answers what no spec answers
    plain = client.chat.completions.create(
        model=SERVED,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=n_tokens,
        temperature=0,
        extra_body={"skip_special_tokens": False},
    )
    zero = client.chat.completions.create(
        model=SERVED,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=n_tokens,
        temperature=0,
        extra_body={"interp": {"steering": _spec(0.0).to_dict()}, "skip_special_tokens": False},
    )
    assert not plain.choices[0].message.tool_calls
    assert zero.choices[0].message.model_dump() == plain.choices[0].message.model_dump()
