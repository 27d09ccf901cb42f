"""The vllm backend while vLLM batches: per-request isolation, chunked prefill, prefix caching,
cancellation, and the free functions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch

from interp_engine import (
    Address,
    Cache,
    SteeringSpec,
    Write,
    capture_attention,
    capture_generation,
    generate_stream,
    run_with_cache,
)
from interp_testkit.suite import PROMPT, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
PROMPTS = [
    "Hello there",
    PROMPT,
    "A cat sat on the mat and looked at the dog",
    "Once upon a time",
]


def _specs(info: Any) -> list[SteeringSpec | None]:
    gen = torch.Generator().manual_seed(3)
    return [
        None,
        SteeringSpec([Write("resid_post.0", torch.randn(info.d_model, generator=gen), op="add", scale=4.0)]),
        SteeringSpec([Write("mlp_post.1", torch.randn(info.d_mlp, generator=gen), op="add", scale=2.0)]),
        SteeringSpec([Write("resid_mid.1", torch.randn(info.d_model, generator=gen), op="ablate")]),
        SteeringSpec([Write("resid_pre.2", torch.randn(info.d_model, generator=gen), op="add", positions="generated")]),
    ]


def test_concurrent_requests_with_different_specs_equal_their_solo_runs(vllm_engines: Any) -> None:
    facade = vllm_engines("qwen2")
    model = facade.model
    points = [Address("resid_post", -1), Address("logits")]
    jobs = [(facade.to_tokens(p)[0].tolist(), s) for p in PROMPTS for s in _specs(model.info)]
    assert len(jobs) >= 16

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))

    batched = facade.run(together)
    for (ids, spec), result in zip(jobs, batched, strict=True):
        alone = facade.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(result[point], alone[point]) <= TOL
    # the specs did act: each steered result differs from the unsteered one of its prompt
    for i in range(1, 4):
        assert not torch.allclose(batched[i][points[1]], batched[0][points[1]])


def test_concurrent_generations_with_specs_equal_their_solo_runs(vllm_engines: Any) -> None:
    facade = vllm_engines("qwen2")
    model = facade.model
    points = [Address("resid_post", 2)]
    jobs = [(facade.to_tokens(p)[0].tolist(), s) for p in PROMPTS[:2] for s in _specs(model.info)]

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(model.capture_generation(ids, points, max_tokens=5, steering_spec=s, ignore_eos=True) for ids, s in jobs)
        )

    batched = facade.run(together)
    for (ids, spec), (completion, acts) in zip(jobs, batched, strict=True):
        alone_completion, alone = facade.capture_generation(
            ids, points, max_tokens=5, steering_spec=spec, ignore_eos=True
        )
        assert completion.token_ids == alone_completion.token_ids
        assert rel_diff(acts[points[0]], alone[points[0]]) <= TOL


def test_a_long_prompt_through_chunked_prefill_next_to_short_ones(vllm_engines: Any) -> None:
    facade = vllm_engines("llama")  # max_num_batched_tokens=64: long prompts are split over steps
    model = facade.model
    long_text = " ".join([PROMPT] * 9)
    long_ids = facade.to_tokens(long_text)[0].tolist()[:200]
    assert len(long_ids) > 3 * 64
    short = [facade.to_tokens(p)[0].tolist() for p in PROMPTS]
    points = [Address("resid_post", 1), Address("attn_pattern", 2), Address("logits")]

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(ids, points) for ids in [long_ids, *short]))

    results = facade.run(together)
    hf = hf_for(vllm_model_path("llama"))
    for ids, acts in zip([long_ids, *short], results, strict=True):
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        assert rel_diff(acts[points[0]], out.hidden_states[2][0]) <= TOL
        assert rel_diff(acts[points[1]], out.attentions[2][0]) <= TOL
        assert rel_diff(acts[points[2]], out.logits[0]) <= TOL


def test_prefix_cache_hits_still_return_every_prompt_token(vllm_engines: Any) -> None:
    """Capturing requests carry a unique cache salt, so vLLM computes every prompt token for them
    even when the same prefix is cached; other requests keep using the cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    facade = vllm_engines("qwen2")
    model = facade.model
    ids = facade.to_tokens(" ".join([PROMPT] * 9))[0].tolist()[:200]  # > one KV block (128 on CPU)
    engine = model._engine

    async def plain(rid: str) -> Any:
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1), rid):
            final = out
        return final

    facade.run(lambda: plain("warm-prefix-1"))
    second = facade.run(lambda: plain("warm-prefix-2"))
    assert second.num_cached_tokens > 0  # this prefix really is in vLLM's cache
    point = Address("resid_post", 1)
    acts = facade.capture(ids, [point])
    with torch.no_grad():
        out = hf_for(vllm_model_path("qwen2"))(torch.tensor([ids]), output_hidden_states=True)
    assert acts[point].shape[0] == len(ids)
    assert rel_diff(acts[point], out.hidden_states[2][0]) <= TOL


def test_steered_requests_neither_reuse_nor_leave_cached_kv(vllm_engines: Any) -> None:
    """A steered generation on a prompt whose prefix is cached still steers every prompt token,
    and its steered KV is never served to a later unsteered request (prefix caching on)."""
    facade = vllm_engines("qwen2")
    info = facade.info
    long_text = " ".join([PROMPT] * 9)
    spec = SteeringSpec(
        [Write("resid_post.0", torch.randn(info.d_model, generator=torch.Generator().manual_seed(5)), scale=6.0)]
    )
    hf = hf_for(vllm_model_path("qwen2"))

    def first_step(ids: list[int], steering: SteeringSpec | None) -> list[tuple[int, float]]:
        steps = list(facade.stream(ids, max_tokens=1, n_logprobs=3, steering_spec=steering))
        return steps[0].logprobs

    def expected(ids: list[int], steering: SteeringSpec | None) -> torch.Tensor:
        logits = facade.capture(ids, ["logits"], steering_spec=steering)[Address("logits")]
        return logits[-1].log_softmax(-1)

    # a cached unsteered prefix, then a steered request on it
    ids = facade.to_tokens(long_text)[0].tolist()[:200]  # > one KV block (128 on CPU)
    first_step(ids, None)
    first_step(ids, None)
    steered = first_step(ids, spec)
    want = expected(ids, spec)
    assert [t for t, _ in steered] == want.topk(3).indices.tolist()
    assert max(abs(lp - float(want[t])) for t, lp in steered) <= 1e-3
    # a steered request first, then an unsteered one on the same prompt: HF's numbers
    ids = facade.to_tokens(long_text)[0].tolist()[3:203]
    first_step(ids, spec)
    plain = first_step(ids, None)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    assert [t for t, _ in plain] == want.topk(3).indices.tolist()
    assert max(abs(lp - float(want[t])) for t, lp in plain) <= 1e-3


def test_cancelling_a_call_aborts_its_request_and_frees_its_state(vllm_engines: Any) -> None:
    facade = vllm_engines("gpt2")
    model = facade.model
    ids = facade.to_tokens(PROMPT)[0].tolist()

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(
            model.capture_generation(ids, [Address("resid_post", 0)], max_tokens=150, ignore_eos=True)
        )
        await asyncio.sleep(0.5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    facade.run(cancel_midway)
    engine = model._engine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = facade.run(lambda: engine.collective_rpc("interp_stats"))
        if engine.get_num_unfinished_requests() == 0 and all(s["live_requests"] == 0 for s in stats):
            break
        time.sleep(0.2)
    assert engine.get_num_unfinished_requests() == 0
    assert all(s["live_requests"] == 0 for s in stats), stats
    # and the engine still serves
    assert facade.generate(ids, max_tokens=3).token_ids


def test_free_functions_and_cache_on_vllm(vllm_engines: Any) -> None:
    facade = vllm_engines("gpt2")
    tokens = facade.to_tokens(PROMPT)
    cache = run_with_cache(facade, [PROMPT, "Hello"], ["resid_post.1", "attn_pattern.0"])
    assert isinstance(cache, Cache) and cache["resid_post.1"].shape[0] == 2
    assert cache.lengths is not None and cache.lengths.tolist() == [tokens.shape[1], len(facade.to_tokens("Hello")[0])]
    n = int(cache.lengths[1])
    assert not cache["resid_post.1"][1, n:].any()
    completion, gen_cache = capture_generation(facade, tokens, ["resid_post.1"], max_tokens=4, ignore_eos=True)
    assert gen_cache["resid_post.1"].shape == (1, tokens.shape[1] + 4, facade.info.d_model)
    attn = capture_attention(facade, tokens, [0, -1])
    assert attn[Address("attn_pattern", -1)].shape == (1, facade.info.n_heads, tokens.shape[1], tokens.shape[1])
    steps = list(generate_stream(facade, tokens, max_tokens=4, n_logprobs=3))
    assert [s.token_id for s in steps] == completion.token_ids[: len(steps)]
    with torch.no_grad():
        out = hf_for(vllm_model_path("gpt2"))(tokens, output_hidden_states=True)
    assert rel_diff(cache["resid_post.1"][0], out.hidden_states[2][0]) <= TOL
