"""Chat prompts on vLLM: ``chat_tokens`` renders through the served tokenizer, and steering by chat
span equals the same explicit positions (capture and generation), resolved in the front end."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import (
    ChatTokens,
    InvalidSteering,
    SteeringSpec,
    Write,
    capture_generation,
    load_model,
    run_with_cache,
)
from interp_testkit.chat_templates import LLAMA3
from interp_testkit.suite import vllm_model_path

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
]


def _spec(positions: Any, d_model: int) -> SteeringSpec:
    vector = torch.randn(d_model, generator=torch.Generator().manual_seed(0))
    return SteeringSpec([Write("resid_post.0", vector, scale=4.0, positions=positions)])


def test_chat_spans_steer_like_explicit_positions(vllm_engines: Any) -> None:
    model = vllm_engines("llama")
    chat = model.chat_tokens(MESSAGES, template=LLAMA3)  # the testkit tokenizer has no template of its own
    assert isinstance(chat, ChatTokens)
    reference = model.model.tokenizer.apply_chat_template(
        MESSAGES, chat_template=LLAMA3, add_generation_prompt=True, return_dict=False
    )
    assert chat.ids == list(reference)
    d_model = model.model.info.d_model
    explicit = chat.positions("user[-1]")
    named = run_with_cache(model, chat, ["resid_post.1"], steering_spec=_spec("user[-1]", d_model))
    by_hand = run_with_cache(model, list(chat), ["resid_post.1"], steering_spec=_spec(explicit, d_model))
    plain = run_with_cache(model, list(chat), ["resid_post.1"])
    assert torch.equal(named["resid_post.1"], by_hand["resid_post.1"])
    assert not torch.equal(named["resid_post.1"], plain["resid_post.1"])
    completion, cache = capture_generation(
        model, chat, ["resid_post.1"], max_tokens=3, steering_spec=_spec("assistant.turn", d_model), positions="user"
    )
    hand = capture_generation(
        model,
        list(chat),
        ["resid_post.1"],
        max_tokens=3,
        steering_spec=_spec(chat.positions("assistant.turn"), d_model),
        positions=chat.positions("user"),
    )
    assert completion.token_ids == hand[0].token_ids
    assert torch.equal(cache["resid_post.1"], hand[1]["resid_post.1"])
    with pytest.raises(InvalidSteering, match="chat_tokens"):
        model.generate(list(chat), max_tokens=2, steering_spec=_spec("user", d_model))


def test_vllm_static_renders_chats_in_its_front_end(vllm_engines: Any) -> None:
    static = load_model(vllm_model_path("llama"), backend="vllm-static")  # no engine is built to render
    try:
        chat = static.chat_tokens(MESSAGES, template=LLAMA3)
        assert chat == vllm_engines("llama").chat_tokens(MESSAGES, template=LLAMA3)
    finally:
        static.close()
