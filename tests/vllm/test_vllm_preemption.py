"""Preemption: vLLM frees a running request's KV cache when a step needs blocks it has not got, and
runs the request again later from what its prefix cache still holds (each runner in its own way:
V1 resumes it among its cached requests, V2 drops its state and adds it again as a new request).
The positions it computes again are read and written again: every request's captures over its
prompt and its generated tokens still equal HF's, and its steering still acts on every step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write
from interp_testkit.suite import hf_for, rel_diff, vllm_model_path

from ..support.engines import assert_no_leaks, started_engine

TOL = 1e-4
POINTS = [Address("resid_post", 1), Address("logits")]
REQUESTS = 6
PROMPT_TOKENS = 40
NEW_TOKENS = 150


@pytest.fixture(scope="module")
def crowded(vllm_runner: str) -> Any:
    """The llama engine with six KV cache blocks of 128 tokens (vLLM's CPU block): the six
    requests need a block each for their prompts and two at full length, so requests are
    preempted as they grow."""
    facade = started_engine(
        vllm_model_path("llama"), num_gpu_blocks_override=6, max_num_batched_tokens=64, max_num_seqs=8
    )
    yield facade
    facade.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(REQUESTS)]


def test_preempted_requests_captures_and_steering_stay_exact(crowded: Any) -> None:
    model = crowded.model
    prompts = _prompts(model.info.vocab_size)
    vector = torch.randn(model.info.d_model, generator=torch.Generator().manual_seed(5))
    specs = [
        None if i % 2 else SteeringSpec([Write("resid_post.0", vector, op="add", scale=3.0)]) for i in range(REQUESTS)
    ]
    before = sum(s["preempted"] for s in crowded.worker_stats())

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(
                model.capture_generation(ids, POINTS, max_tokens=NEW_TOKENS, steering_spec=spec, ignore_eos=True)
                for ids, spec in zip(prompts, specs, strict=True)
            )
        )

    results = crowded.run(together)
    preempted = sum(s["preempted"] for s in crowded.worker_stats()) - before
    assert preempted > 0, "no request was preempted: the test did not exercise recompute"

    hf = hf_for(vllm_model_path("llama"))
    for ids, spec, (completion, acts) in zip(prompts, specs, results, strict=True):
        assert len(completion.token_ids) == NEW_TOKENS
        rows = acts[POINTS[0]].shape[0]  # the prompt and the generated tokens the model read
        assert rows >= len(ids) + NEW_TOKENS - 1
        tokens = torch.tensor([(ids + completion.token_ids)[:rows]])
        handle = None
        if spec is not None:  # the same write by hand: after layer 0, every position
            layer = hf.model.layers[0]
            handle = layer.register_forward_hook(lambda module, args, output: _add(output, 3.0 * vector))
        try:
            with torch.no_grad():
                out = hf(tokens, output_hidden_states=True)
        finally:
            if handle is not None:
                handle.remove()
        assert rel_diff(acts[POINTS[0]], out.hidden_states[2][0]) <= TOL
        assert rel_diff(acts[POINTS[1]], out.logits[0]) <= TOL
        # greedy: each generated token is the argmax of the logits captured before it
        greedy = out.logits[0, len(ids) - 1 : len(ids) - 1 + NEW_TOKENS].argmax(-1).tolist()
        assert completion.token_ids[: len(greedy)] == greedy
    assert_no_leaks(crowded)


def _add(output: Any, delta: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (output[0] + delta, *output[1:])
    return output + delta
