"""Chat prompts: ``chat_tokens`` against each family's real template (the ids of
``apply_chat_template``, every span checked by decoding it), positions named by span (grammar, JSON,
resolution per row), steering by span equal to the same explicit positions on eager, capture
selections and ``Cache.select``."""

from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import Any

import pytest
import torch

import interp_engine
from interp_engine import (
    ChatTokens,
    FeatureWrite,
    InvalidChat,
    InvalidOption,
    InvalidSteering,
    NoChatTemplate,
    Span,
    SteeringSpec,
    Write,
    capture_generation,
    chat_tokens,
    generate_stream,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_engine.chat import build_chat_tokens, span_positions
from interp_testkit.chat_templates import CHAT_TEMPLATES, LLAMA3, chat_tokenizer
from interp_testkit.suite import tiny_model_path

from ..support.engines import eager_model

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": " What is the capital of France? "}
ANSWER = {"role": "assistant", "content": "The capital of France is Paris."}
THOUGHT = {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."}
FOLLOW = {"role": "user", "content": "And of Spain?"}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "llama3": [SYSTEM, USER, ANSWER, FOLLOW],
    "gemma2": [USER, ANSWER, FOLLOW],
    "gemma3": [SYSTEM, USER, ANSWER, FOLLOW],  # the system prompt folded into the first user turn
    "qwen3": [SYSTEM, USER, ANSWER, FOLLOW],
}
HEADER = {"llama3": "<|start_header_id|>{}<|end_header_id|>", "gemma2": "<start_of_turn>{}", "qwen3": "<|im_start|>{}"}
HEADER["gemma3"] = HEADER["gemma2"]


@functools.cache
def tokenizer(name: str) -> Any:
    return chat_tokenizer(name)


@functools.cache
def chat_model(name: str) -> Any:
    """The family's tiny eager model with the chat tokenizer (its ids fit the model's vocabulary)."""
    family = CHAT_TEMPLATES[name].family
    return sync_model(load_model(tiny_model_path(family), backend="eager", tokenizer=tokenizer(name)))


def _reference(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    ids = tokenizer(name).apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(ids)


def _decode(name: str, ids: list[int], lo: int, hi: int) -> str:
    return str(tokenizer(name).decode(ids[lo:hi]))


def _expected(message: dict[str, Any]) -> str:
    content = str(message["content"])
    return content.split("</think>")[-1].strip() if message["role"] == "assistant" else content.strip()


def _role_shown(name: str, role: str) -> str:
    return "model" if name.startswith("gemma") and role == "assistant" else role


# -- the families' own templates ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_and_every_span_match_the_template(name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    chat = build_chat_tokens(tokenizer(name), messages, add_generation_prompt=add_generation_prompt)
    assert chat.ids == _reference(name, messages, add_generation_prompt=add_generation_prompt)
    assert chat == _reference(name, messages, add_generation_prompt=add_generation_prompt)  # a list compares by ids
    assert chat.token_ids is chat.ids and chat != [*chat.ids, 0]
    assert chat.generation_start == (len(chat.ids) if add_generation_prompt else None)
    assert [s.role for s in chat.messages] == [m["role"] for m in messages]
    assert [s.index for s in chat.messages] == list(range(len(messages)))
    previous_end = 0
    for span, message in zip(chat.messages, messages, strict=True):
        assert span.kind == "message"
        content = _decode(name, chat.ids, span.start, span.end)
        assert content.strip() == _expected(message), (span, content)
        turn = _decode(name, chat.ids, span.turn_start, span.turn_end)
        assert span.turn_start <= span.start <= span.end <= span.turn_end
        if name == "gemma3" and message["role"] == "system":  # folded in: no template tokens of its own
            assert (span.turn_start, span.turn_end) == (span.start, span.end)
            continue
        assert turn.startswith(HEADER[name].format(_role_shown(name, message["role"]))), turn
        assert span.turn_start >= previous_end  # turns in order, never overlapping
        previous_end = span.turn_end
    assert chat.text == tokenizer(name).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_the_template_tokens_are_outside_the_content(name: str) -> None:
    chat = build_chat_tokens(tokenizer(name), CONVERSATIONS[name])
    specials = set(tokenizer(name).convert_tokens_to_ids(list(CHAT_TEMPLATES[name].special_tokens)))
    for span in chat.messages:
        assert not specials & set(chat.ids[span.start : span.end])
        if span.turn_end > span.end:
            assert specials & set(chat.ids[span.turn_start : span.turn_end])


def test_gemma3_merges_the_system_prompt_into_the_first_user_turn() -> None:
    chat = build_chat_tokens(tokenizer("gemma3"), CONVERSATIONS["gemma3"])
    system, user = chat.messages[0], chat.messages[1]
    assert user.turn_start < system.start < system.end <= user.start < user.turn_end
    assert chat.positions("system") == list(range(system.start, system.end))


def test_qwen3_reasoning_spans() -> None:
    name = "qwen3"
    messages = [SYSTEM, USER, THOUGHT]
    chat = build_chat_tokens(tokenizer(name), messages, add_generation_prompt=False)
    assert chat.ids == _reference(name, messages)
    (section,) = chat.reasoning
    assert (section.kind, section.role, section.index) == ("reasoning", "assistant", 2)
    assert _decode(name, chat.ids, section.start, section.end).strip() == "The user asks about France."
    assert _decode(name, chat.ids, section.turn_start, section.turn_end).startswith("<think>")
    assert _decode(name, chat.ids, section.turn_start, section.turn_end).endswith("</think>")
    answer = chat.messages[2]
    assert answer.turn_start < section.turn_start and section.turn_end <= answer.start
    assert _decode(name, chat.ids, answer.start, answer.end) == "Paris."
    assert chat.positions("reasoning[0]") == list(range(section.start, section.end))
    assert chat.positions("reasoning.turn") == list(range(section.turn_start, section.turn_end))


def test_qwen3_reasoning_content_field_and_dropped_history() -> None:
    name = "qwen3"
    answer = {"role": "assistant", "content": "Paris.", "reasoning_content": "France: Paris."}
    later = [USER, answer, FOLLOW]  # a past turn: the template drops its reasoning
    chat = build_chat_tokens(tokenizer(name), later)
    assert chat.ids == _reference(name, later, add_generation_prompt=True)
    assert chat.reasoning == ()
    assert [_decode(name, chat.ids, s.start, s.end).strip() for s in chat.messages] == [
        USER["content"].strip(),
        "Paris.",
        "And of Spain?",
    ]
    last = build_chat_tokens(tokenizer(name), [USER, answer], add_generation_prompt=False)
    (section,) = last.reasoning
    assert _decode(name, last.ids, section.start, section.end) == "France: Paris."


def test_qwen3_enable_thinking_false_opens_an_empty_section_in_the_generation_prompt() -> None:
    name = "qwen3"
    chat = build_chat_tokens(tokenizer(name), [USER], enable_thinking=False)
    assert chat.ids == _reference(name, [USER], add_generation_prompt=True, enable_thinking=False)
    (section,) = chat.reasoning
    assert (section.role, section.index, section.start, section.end) == ("assistant", 1, section.start, section.start)
    assert section.turn_start >= chat.messages[0].turn_end
    assert section.turn_end <= chat.generation_start  # type: ignore[operator]
    with pytest.raises(InvalidSteering, match="select no token"):
        chat.positions("reasoning")
    assert chat.positions("reasoning.turn") == list(range(section.turn_start, section.turn_end))
    thinking = build_chat_tokens(tokenizer(name), [USER], enable_thinking=True)
    assert thinking.reasoning == () and len(thinking) < len(chat)


def test_qwen3_tools_tool_calls_and_tool_responses() -> None:
    name = "qwen3"
    tools = [{"type": "function", "function": {"name": "capital_of", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "capital_of", "arguments": {"country": "France"}}}
    messages = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Paris"},
        {"role": "tool", "content": "population 2.1M"},
        ANSWER,
    ]
    chat = build_chat_tokens(tokenizer(name), messages, tools=tools)
    assert chat.ids == _reference(name, messages, tools=tools, add_generation_prompt=True)
    assert "# Tools" in chat.text  # the tools reached the template
    calling = chat.messages[1]
    assert calling.start == calling.end  # no content of its own
    turn = _decode(name, chat.ids, calling.turn_start, calling.turn_end)
    assert turn.startswith("<|im_start|>assistant") and '"name": "capital_of"' in turn
    first, second = chat.messages[2], chat.messages[3]
    assert _decode(name, chat.ids, first.start, first.end) == "Paris"
    assert _decode(name, chat.ids, second.start, second.end) == "population 2.1M"
    assert calling.turn_end <= first.turn_start < first.turn_end <= second.turn_start
    assert chat.positions("tool") == [*range(first.start, first.end), *range(second.start, second.end)]
    assert chat.positions("tool[-1].last") == [second.end - 1]


def test_llama3_tool_role_and_content_parts() -> None:
    name = "llama3"
    messages = [USER, {"role": "tool", "content": '{"capital": "Paris"}'}]
    chat = build_chat_tokens(tokenizer(name), messages)
    assert chat.ids == _reference(name, messages, add_generation_prompt=True)
    tool = chat.messages[1]
    assert _decode(name, chat.ids, tool.start, tool.end) == '{"capital": "Paris"}'
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    gemma = build_chat_tokens(tokenizer("gemma3"), parts)
    assert gemma.ids == _reference("gemma3", parts, add_generation_prompt=True)
    (span,) = gemma.messages
    assert _decode("gemma3", gemma.ids, span.start, span.end) == "Hellothere"


def test_custom_reasoning_markers() -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [USER, {"role": "assistant", "content": "[[plan: answer]] Paris."}]
    chat = build_chat_tokens(
        tokenizer("qwen3"), messages, template=template, reasoning_markers=[("[[", "]]")], add_generation_prompt=False
    )
    (section,) = chat.reasoning
    assert _decode("qwen3", chat.ids, section.start, section.end) == "plan: answer"
    assert _decode("qwen3", chat.ids, chat.messages[1].start, chat.messages[1].end) == "Paris."
    with pytest.raises(InvalidChat, match="reasoning"):
        build_chat_tokens(tokenizer("qwen3"), messages, reasoning_markers=[("", "]]")])


class _SlowTokenizer:
    """A tokenizer without offsets (``is_fast`` False): spans come from decoding prefixes."""

    is_fast = False

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_a_slow_tokenizer_gives_the_same_spans(name: str) -> None:
    fast = build_chat_tokens(tokenizer(name), CONVERSATIONS[name])
    slow = build_chat_tokens(_SlowTokenizer(tokenizer(name)), CONVERSATIONS[name])
    assert slow == fast


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3"])
@pytest.mark.parametrize("slow", [False, True])
def test_spans_of_awkward_contents(name: str, slow: bool) -> None:
    """Multi-byte characters split across byte tokens, a content equal to its role's name, one
    letter that also occurs in the template's own text."""
    messages = [
        {"role": "user", "content": "Café 😀 東京は?"},
        {"role": "assistant", "content": "ça va 🎉"},
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "a"},
    ]
    chat = build_chat_tokens(_SlowTokenizer(tokenizer(name)) if slow else tokenizer(name), messages)
    assert chat.ids == _reference(name, messages, add_generation_prompt=True)
    for span, message in zip(chat.messages, messages, strict=True):
        assert _decode(name, chat.ids, span.start, span.end) == message["content"]
        turn = _decode(name, chat.ids, span.turn_start, span.turn_end)
        assert turn.startswith(HEADER[name].format(_role_shown(name, message["role"])))


# -- errors ------------------------------------------------------------------------------------------
def test_a_model_without_a_template_names_the_fix() -> None:
    model = sync_model(eager_model("llama"))  # the testkit tokenizer has no chat template
    with pytest.raises(NoChatTemplate, match="template=") as info:
        model.chat_tokens([USER])
    assert isinstance(info.value, InvalidChat) and isinstance(info.value, ValueError)
    chat = model.chat_tokens([USER], template=LLAMA3)  # the override renders it
    reference = model.model.tokenizer.apply_chat_template(
        [USER], chat_template=LLAMA3, add_generation_prompt=True, return_dict=False
    )
    assert chat.ids == list(reference)


def test_the_templates_own_errors_and_bad_messages() -> None:
    gemma = tokenizer("gemma2")
    with pytest.raises(InvalidChat, match="System role not supported"):
        build_chat_tokens(gemma, [SYSTEM, USER])
    with pytest.raises(InvalidChat, match="roles must alternate"):
        build_chat_tokens(gemma, [USER, USER])
    llama = tokenizer("llama3")
    bad: list[Any] = [
        "hello",
        [],
        {"role": "user", "content": "hi"},
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        ["not a dict"],
    ]
    for messages in bad:
        with pytest.raises(InvalidChat):
            build_chat_tokens(llama, messages)
    with pytest.raises(InvalidChat, match="template="):
        build_chat_tokens(llama, [USER], template=42)  # type: ignore[arg-type]
    with pytest.raises(InvalidChat, match="tokenize"):
        build_chat_tokens(llama, [USER], tokenize=False)
    with pytest.raises(InvalidChat, match="refused"):
        build_chat_tokens(llama, [USER], template="{{ raise_exception('no chats today') }}")


def test_a_backend_without_a_tokenizer_says_so() -> None:
    toy = load_model("toy", backend="toy")  # tests/toy_backend: ModelBase without a Hugging Face tokenizer
    with pytest.raises(interp_engine.UnsupportedOperation, match="eager and vllm"):
        chat_tokens(toy, [USER])
    named = _spec("user", toy.info.d_model)
    with pytest.raises(InvalidSteering, match="chat_tokens"):  # the front end's check, on every backend
        sync_model(toy).capture([1, 2, 3], ["resid_post.0"], steering_spec=named)


def test_errors_are_exported() -> None:
    for name in ("ChatTokens", "Span", "InvalidChat", "NoChatTemplate", "chat_tokens"):
        assert name in interp_engine.__all__
    assert issubclass(NoChatTemplate, InvalidChat) and issubclass(InvalidChat, interp_engine.InterpError)


# -- ChatTokens as ids ------------------------------------------------------------------------------
def test_chat_tokens_are_ids_and_round_trip_through_json() -> None:
    chat = chat_model("qwen3").chat_tokens([SYSTEM, USER, THOUGHT], add_generation_prompt=False)
    assert list(chat) == chat.ids and len(chat) == len(chat.ids) and chat[0] == chat.ids[0]
    assert chat[1:3] == chat.ids[1:3]
    assert torch.equal(chat.tensor(), torch.tensor([chat.ids]))
    assert ChatTokens.from_json(chat.to_json()) == chat
    assert ChatTokens.from_json(json.dumps(chat.to_json())) == chat
    assert chat.spans == chat.messages + chat.reasoning
    assert "system" in repr(chat)
    with pytest.raises(InvalidChat):
        ChatTokens.from_json({"ids": [1, 2], "messages": [{"kind": "message", "role": "user", "index": 0}]})
    with pytest.raises(InvalidChat, match="past"):
        ChatTokens.from_json({"ids": [1], "messages": [Span("message", "user", 0, 0, 3, 0, 3).to_json()]})


def test_the_sync_facade_the_free_function_and_the_async_model_agree() -> None:
    facade = chat_model("llama3")
    assert chat_tokens(facade, [USER]) == facade.chat_tokens([USER]) == facade.model.chat_tokens([USER])
    assert chat_tokens(facade.model, [USER], add_generation_prompt=False).generation_start is None


def test_the_shipped_tiny_model_has_a_chat_template() -> None:
    model = sync_model(load_model("interp:tiny", backend="eager"))
    chat = model.chat_tokens([{"role": "system", "content": "Answer briefly."}, USER])
    assert chat.text == "<|endoftext|>System: Answer briefly.\nUser: What is the capital of France?\nAssistant:"
    user = chat.messages[1]  # GPT-2's BPE puts the space after "User:" in the content's first token
    assert model.to_string(chat.ids[user.start : user.end]) == " " + USER["content"].strip()
    assert model.to_string(chat.ids[chat.messages[0].turn_start : chat.messages[0].turn_end]) == (
        "System: Answer briefly.\n"
    )


# -- named positions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["user", "user[-1].last", "assistant", "reasoning[0]", "system.turn", "message[2]"])
def test_span_names_are_positions(name: str) -> None:
    write = Write("resid_post.0", torch.ones(4), positions=name)
    assert write.positions == name
    assert Write.from_dict(json.loads(json.dumps(write.to_dict()))) == write
    feature = FeatureWrite("sae", 3, "clamp", 2.0, positions=name)
    assert FeatureWrite.from_dict(json.loads(json.dumps(feature.to_dict()))) == feature
    spec = SteeringSpec([write, feature])
    again = SteeringSpec.from_json(spec.to_json())
    assert [w.positions for w in again] == [name, name]


@pytest.mark.parametrize(
    "bad", ["user[-1]last", "user.lst", "[0]", "user[x]", "user[0].first.last", "", "user[]", "last", "turn[0]"]
)
def test_a_malformed_span_name_names_the_grammar(bad: str) -> None:
    with pytest.raises(InvalidSteering, match=re.escape("'<name>[<i>][.<part>]'")):
        Write("resid_post.0", torch.ones(4), positions=bad)


def test_span_positions_resolve_and_explain() -> None:
    chat = build_chat_tokens(tokenizer("llama3"), CONVERSATIONS["llama3"])
    system, user, answer, follow = chat.messages
    assert span_positions("user", chat, len(chat)) == [*range(user.start, user.end), *range(follow.start, follow.end)]
    assert chat.positions("user[0]") == list(range(user.start, user.end))
    assert chat.positions("user[-1].last") == [follow.end - 1]
    assert chat.positions("user[-1].first") == [follow.start]
    assert chat.positions("assistant.turn") == list(range(answer.turn_start, answer.turn_end))
    assert chat.positions("message[0]") == list(range(system.start, system.end))
    assert chat.positions("message[-1]") == chat.positions("user[1]")
    with pytest.raises(InvalidSteering, match=r"user\[0\].*assistant\[0\]"):
        chat.positions("user[2]")
    with pytest.raises(InvalidSteering, match="0 'tool' span"):
        chat.positions("tool[0]")
    with pytest.raises(InvalidSteering, match="select no token"):
        chat.positions("tool")
    with pytest.raises(InvalidSteering, match="chat_tokens"):
        span_positions("user", list(chat), len(chat))


# -- steering by span equals the same explicit positions (eager) ----------------------------------
def _spec(positions: Any, d_model: int, seed: int = 0) -> SteeringSpec:
    vector = torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
    return SteeringSpec([Write("resid_post.0", vector, scale=4.0, positions=positions)])


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3"])
@pytest.mark.parametrize("positions", ["user[-1]", "user[0].last", "assistant.turn", "message"])
def test_steering_by_span_equals_explicit_positions(name: str, positions: str) -> None:
    model = chat_model(name)
    chat = model.chat_tokens(CONVERSATIONS[name])
    d_model = model.model.info.d_model
    explicit = chat.positions(positions)
    named = run_with_cache(model, chat, ["resid_post.1"], steering_spec=_spec(positions, d_model))
    by_hand = run_with_cache(model, list(chat), ["resid_post.1"], steering_spec=_spec(explicit, d_model))
    plain = run_with_cache(model, list(chat), ["resid_post.1"])
    assert torch.equal(named["resid_post.1"], by_hand["resid_post.1"])
    assert not torch.equal(named["resid_post.1"], plain["resid_post.1"])
    assert named.chat == (chat,) and by_hand.chat is None


def test_span_names_resolve_per_row_of_a_batch() -> None:
    model = chat_model("qwen3")
    short = model.chat_tokens([USER])
    long = model.chat_tokens([SYSTEM, USER, ANSWER, FOLLOW])
    d_model = model.model.info.d_model
    named = run_with_cache(model, [long, short], ["resid_post.1"], steering_spec=_spec("user[-1].last", d_model))
    rows = [
        run_with_cache(
            model, list(chat), ["resid_post.1"], steering_spec=_spec(chat.positions("user[-1].last"), d_model)
        )
        for chat in (long, short)
    ]
    assert long.positions("user[-1].last") != short.positions("user[-1].last")
    for i, row in enumerate(rows):
        n = len((long, short)[i])
        assert torch.allclose(named["resid_post.1"][i, :n], row["resid_post.1"][0], atol=1e-5)
    # per-row specs, one naming a span and one not
    per_row = run_with_cache(model, [long, list(short)], ["resid_post.1"], steering_spec=[_spec("user", d_model), None])
    assert torch.allclose(
        per_row["resid_post.1"][1, : len(short)],
        run_with_cache(model, list(short), ["resid_post.1"])["resid_post.1"][0],
        atol=1e-5,
    )
    with pytest.raises(InvalidSteering, match="chat_tokens"):
        run_with_cache(model, [long, list(short)], ["resid_post.1"], steering_spec=_spec("user", d_model))


def test_generation_steered_by_span_equals_explicit_positions() -> None:
    model = chat_model("llama3")
    chat = model.chat_tokens([SYSTEM, USER])
    d_model = model.model.info.d_model
    named = capture_generation(model, chat, ["resid_post.1"], max_tokens=4, steering_spec=_spec("user", d_model))
    explicit = _spec(chat.positions("user"), d_model)
    by_hand = capture_generation(model, list(chat), ["resid_post.1"], max_tokens=4, steering_spec=explicit)
    assert named[0].token_ids == by_hand[0].token_ids
    assert torch.equal(named[1]["resid_post.1"], by_hand[1]["resid_post.1"])
    streamed = [s.token_id for s in generate_stream(model, chat, max_tokens=4, steering_spec=_spec("user", d_model))]
    assert streamed == named[0].token_ids
    # "generated" keeps its meaning beside span names
    both = SteeringSpec([*_spec("user", d_model), *_spec("generated", d_model, seed=1)])
    steered = capture_generation(model, chat, ["resid_post.1"], max_tokens=3, steering_spec=both)
    explicit_both = SteeringSpec([*explicit, *_spec("generated", d_model, seed=1)])
    hand = capture_generation(model, list(chat), ["resid_post.1"], max_tokens=3, steering_spec=explicit_both)
    assert torch.equal(steered[1]["resid_post.1"], hand[1]["resid_post.1"])


def test_a_span_name_with_plain_ids_is_refused_before_compute() -> None:
    model = chat_model("llama3")
    ids = list(model.chat_tokens([USER]))
    with pytest.raises(InvalidSteering, match=r"'user\[-1\]' name a chat span"):
        run_with_cache(model, ids, ["resid_post.1"], steering_spec=_spec("user[-1]", model.model.info.d_model))
    with pytest.raises(InvalidSteering, match="chat_tokens"):
        model.generate(ids, max_tokens=2, steering_spec=_spec("assistant", model.model.info.d_model))


# -- capture selections and Cache.select ------------------------------------------------------------
def test_capture_keeps_only_the_positions_asked() -> None:
    model = chat_model("gemma2")
    chats = [model.chat_tokens([USER]), model.chat_tokens([USER, ANSWER, FOLLOW])]
    full = run_with_cache(model, chats, ["resid_post.1", "attn_pattern.0"])
    kept = run_with_cache(model, chats, ["resid_post.1", "attn_pattern.0"], positions="user[-1]")
    assert kept.positions is not None and kept.lengths is not None and kept.chat == tuple(chats)
    for row, chat in enumerate(chats):
        positions = chat.positions("user[-1]")
        n = len(positions)
        assert kept.positions[row, :n].tolist() == positions and bool((kept.positions[row, n:] == -1).all())
        assert int(kept.lengths[row]) == n
        assert torch.equal(kept["resid_post.1"][row, :n], full["resid_post.1"][row, positions])
        assert torch.equal(kept["attn_pattern.0"][row, :, :n], full["attn_pattern.0"][row][:, positions])
        assert torch.equal(
            kept.select("resid_post.1", "user[-1].last", row=row), full["resid_post.1"][row, [positions[-1]]]
        )
    last = run_with_cache(model, chats, ["resid_post.1"], positions=[-1, 0])
    assert last.positions.tolist() == [[len(chats[0]) - 1, 0], [len(chats[1]) - 1, 0]]  # type: ignore[union-attr]
    with pytest.raises(InvalidOption, match="outside"):
        run_with_cache(model, chats, ["resid_post.1"], positions=[len(chats[0])])
    with pytest.raises(InvalidOption, match="chat_tokens"):
        run_with_cache(model, list(chats[0]), ["resid_post.1"], positions="user")
    with pytest.raises(InvalidOption, match="no generated"):
        run_with_cache(model, chats, ["resid_post.1"], positions="generated")


def test_cache_select() -> None:
    model = chat_model("qwen3")
    chat = model.chat_tokens([SYSTEM, USER, THOUGHT], add_generation_prompt=False)
    cache = run_with_cache(model, chat, ["resid_post.0", "attn_pattern.1"])
    values = cache["resid_post.0"][0]
    assert torch.equal(cache.select("resid_post.0", "reasoning"), values[chat.positions("reasoning")])
    assert torch.equal(cache.select("resid_post.0", [-1, 2]), values[[len(chat) - 1, 2]])
    assert torch.equal(cache.select("resid_post.0", "all"), values)
    assert torch.equal(
        cache.select("attn_pattern.1", "user.last"), cache["attn_pattern.1"][0][:, chat.positions("user.last")]
    )
    kept = run_with_cache(model, chat, ["resid_post.0"], positions="message")
    values = run_with_cache(model, chat, ["resid_post.0"])["resid_post.0"][0]  # the same points: the same kernels
    assert torch.equal(kept.select("resid_post.0", "user"), values[chat.positions("user")])
    assert torch.equal(kept.select("resid_post.0", "all"), values[chat.positions("message")])
    with pytest.raises(InvalidOption, match="not kept"):
        kept.select("resid_post.0", "reasoning")
    with pytest.raises(InvalidOption, match="row"):
        cache.select("resid_post.0", "user", row=3)
    completion, generated = capture_generation(model, chat, ["resid_post.0"], max_tokens=3, ignore_eos=True)
    assert generated.chat == (chat,)
    new = generated.select("resid_post.0", "generated")
    assert new.shape[0] == len(completion.token_ids)
    assert torch.equal(generated.select("resid_post.0", "user"), generated["resid_post.0"][0, chat.positions("user")])
    only_new = capture_generation(model, chat, ["resid_post.0"], max_tokens=3, ignore_eos=True, positions="generated")[
        1
    ]
    assert torch.equal(only_new["resid_post.0"][0], new)


def test_chats_and_kept_positions_survive_concat_and_save(tmp_path: pathlib.Path) -> None:
    model = chat_model("llama3")
    one, two = model.chat_tokens([USER]), model.chat_tokens([SYSTEM, USER, ANSWER, FOLLOW])
    a = run_with_cache(model, one, ["resid_post.1"], positions="user")
    b = run_with_cache(model, [two, list(one)], ["resid_post.1"], positions=[0, -1])
    joined = interp_engine.Cache.concat([a, b])
    assert joined.chat == (one, two, None)
    assert joined.positions is not None and joined.positions.shape == (3, max(len(one.positions("user")), 2))
    assert joined.positions[1, :2].tolist() == [0, len(two) - 1] and joined.positions[2, :2].tolist() == [
        0,
        len(one) - 1,
    ]
    assert torch.equal(joined.select("resid_post.1", "user[-1].last", row=0), a.select("resid_post.1", "user.last"))
    path = tmp_path / "chat.safetensors"
    joined.save(path)
    loaded = interp_engine.Cache.load(path)
    assert loaded.chat == joined.chat and torch.equal(loaded.positions, joined.positions)  # type: ignore[arg-type]
    assert torch.equal(loaded["resid_post.1"], joined["resid_post.1"])
    full = run_with_cache(model, one, ["resid_post.1"])
    with pytest.raises(interp_engine.InvalidActivations, match="selection"):
        interp_engine.Cache.concat([a, full])
