"""The logit lens under tensor parallelism (``tensor_parallel_size=2``) on the vllm backend.

Every rank keeps the lens layers' rows (the residual stream is whole on each) and joins one
batched final norm + served unembedding per step (a collective: the vocabulary is sharded and
gathered); rank 0 keeps the top-k. Runs on the session's TP=1 and TP=2 llama engines (the ``tp``
fixture of ``tests/vllm/conftest.py``), as tests/vllm/test_vllm_tp.py does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from interp_engine import Address, LensRequest, LensResult, SteeringSpec, Write
from interp_testkit.suite import LONG, PROMPT

from ..support.engines import assert_no_leaks
from ..support.lens import assert_same_lens, check_against, decoded_lens


def test_tp2_lens_equals_tp1_and_the_decoded_resid_post(tp: tuple[Any, Any]) -> None:
    one, two = tp
    layers = (0, 2, 1)
    for ids in (one.to_tokens(PROMPT)[0].tolist()[:12], LONG):
        asked = [0, 3, 70, -1] if len(ids) > 70 else [0, 3, -1]  # the long prompt's span three prefill chunks
        request = LensRequest(list(layers), top_k=10, positions=asked)
        steps2 = list(two.stream(ids, max_tokens=5, lens=request, ignore_eos=True))
        steps1 = list(one.stream(ids, max_tokens=5, lens=request, ignore_eos=True))
        assert [s.token_id for s in steps2] == [s.token_id for s in steps1]
        points = [Address("resid_post", layer) for layer in layers]
        completion, acts = two.capture_generation(ids, points, max_tokens=5, lens=request, ignore_eos=True)
        assert completion.token_ids == [s.token_id for s in steps2]
        ref = decoded_lens(two, acts, layers, 10)
        for step, twin in zip(steps2, steps1, strict=True):
            assert step.lens is not None and twin.lens is not None
            assert step.lens.ids.shape == (3, 10)  # the whole vocabulary's top-k, not one shard's
            assert_same_lens(step.lens.ids, step.lens.probs, ref[0][:, step.position], ref[1][:, step.position])
            assert_same_lens(step.lens.ids, step.lens.probs, twin.lens.ids, twin.lens.probs, "TP=2 vs TP=1")
        first = steps2[0].prompt_lens
        assert first is not None and steps1[0].prompt_lens is not None
        assert first.positions == steps1[0].prompt_lens.positions
        check_against(first, ref, "TP=2 prompt lens")
        result = acts[request]
        assert isinstance(result, LensResult)
        check_against(result, ref, "TP=2 capture_generation lens")


def test_tp2_concurrent_lens_and_steered_requests_equal_their_solo_runs(tp: tuple[Any, Any]) -> None:
    _, two = tp
    model = two.model
    ids = two.to_tokens(PROMPT)[0].tolist()
    steer = SteeringSpec([Write("resid_post.1", torch.ones(128) * 2.0, op="add")])
    kinds: list[dict[str, Any]] = [
        {"lens": LensRequest([0, 1, 2], top_k=10)},
        {"n_logprobs": 2},
        {"lens": LensRequest([1], top_k=3, positions=[2]), "steering_spec": steer},
        {"steering_spec": steer},
    ]
    jobs = [(ids[: 6 + i], kind) for i, kind in enumerate(kinds * 2)]

    async def one(prompt: list[int], kind: dict[str, Any]) -> list[Any]:
        return [s async for s in model.stream(prompt, max_tokens=4, ignore_eos=True, **kind)]

    async def together() -> list[list[Any]]:
        return await asyncio.gather(*(one(prompt, kind) for prompt, kind in jobs))

    batched = two.run(together)
    for (prompt, kind), steps in zip(jobs, batched, strict=True):
        alone = two.run(lambda prompt=prompt, kind=kind: one(prompt, kind))
        assert [s.token_id for s in steps] == [s.token_id for s in alone]
        for step, solo in zip(steps, alone, strict=True):
            assert (step.lens is None) == ("lens" not in kind)
            if step.lens is not None and solo.lens is not None:
                assert_same_lens(step.lens.ids, step.lens.probs, solo.lens.ids, solo.lens.probs)
    assert_no_leaks(two)
