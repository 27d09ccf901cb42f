"""The logit lens during generation on the vllm and vllm-static backends.

The lens is computed in vLLM's worker: each lens layer's ``resid_post`` rows of the positions it
reads are kept by the layer's hook, decoded after the forward in one batch through the served
final norm and unembedding, and only the top-k ids and probabilities leave the worker. The
oracle is :func:`~interp_engine.results._lens.lens_top_k` of ``decode_residuals`` on the ``resid_post``
the very same request captured (``capture_generation``), and the eager backend's lens on the
same checkpoint. TP=2: tests/vllm/test_vllm_tp_lens.py (it reuses test_vllm_tp's engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    BackendError,
    Features,
    InvalidOption,
    LensRequest,
    LensResult,
    LensTopK,
    Sae,
    SteeringSpec,
    UndeclaredAddress,
    UnsupportedOperation,
    Write,
    capture_generation,
    load_model,
    sync_model,
)
from interp_engine.backend import CheckedLens
from interp_testkit.suite import LONG, PROMPT, rel_diff, vllm_model_path

from ..support.engines import assert_no_leaks
from ..support.lens import assert_same_lens, check_against, decoded_lens

FAMILY = "llama"  # 3 layers, a 512-token vocabulary; its shared engine prefills in chunks of 64 tokens
N_LAYERS = 3
SAE_NAME = "tvlens-res"


@functools.cache
def eager_twin() -> Any:
    """The eager backend on the vLLM engine's checkpoint."""
    return sync_model(load_model(vllm_model_path(FAMILY), backend="eager"))


@pytest.fixture(scope="module")
def llama(vllm_engines: Any) -> Any:
    return vllm_engines(FAMILY)


# -- 1. the stream's lens equals the decoded resid_post of the same tokens, and eager ----------
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_stream_lens_equals_decoded_resid_post_and_eager(llama: Any, prompt: str) -> None:
    ids = llama.to_tokens(PROMPT)[0].tolist() if prompt == "short" else LONG
    n = len(ids)
    # the long prompt's asked positions lie in three prefill chunks
    lens = LensRequest([2, 0, -2], top_k=5, positions=[0, 5, 70, -1] if prompt == "long" else [0, 5, -1])
    layers = (2, 0, 1)
    steps = list(llama.stream(ids, max_tokens=6, lens=lens, n_logprobs=2, ignore_eos=True))
    points = [Address("resid_post", layer) for layer in layers]
    completion, acts = llama.capture_generation(ids, points, max_tokens=6, lens=lens, ignore_eos=True)
    assert [s.token_id for s in steps] == completion.token_ids and len(steps) == 6
    ref = decoded_lens(llama, acts, layers, 5)
    asked = tuple(sorted({p % n for p in lens.positions}))  # type: ignore[union-attr]
    for i, step in enumerate(steps):
        assert step.position == n - 1 + i
        assert isinstance(step.lens, LensTopK) and step.lens.position == step.position
        assert step.lens.layers == layers and step.lens.ids.shape == (3, 5)
        assert_same_lens(
            step.lens.ids, step.lens.probs, ref[0][:, step.position], ref[1][:, step.position], f"step {i}"
        )
        assert (step.prompt_lens is None) == (i > 0)
    first = steps[0].prompt_lens
    assert isinstance(first, LensResult) and first.positions == asked and first.layers == layers
    check_against(first, ref, "prompt lens")
    # capture_generation's LensResult: the prompt positions asked, then every token-producing one
    result = acts[lens]
    assert isinstance(result, LensResult)
    assert result.positions == tuple(sorted({*asked, *range(n - 1, n + 5)}))
    assert result.ids.shape == (3, len(result.positions), 5)
    check_against(result, ref, "capture_generation lens")
    for step in steps:
        assert torch.equal(result.at(step.position).ids, step.lens.ids)  # type: ignore[union-attr]
    # the probabilities are the whole vocabulary's: the top-1 of the last layer is the greedy token
    last = layers.index(N_LAYERS - 1)
    assert [int(s.lens.ids[last, 0]) for s in steps] == completion.token_ids  # type: ignore[union-attr]
    # the eager backend's lens of the same request
    eager = eager_twin()
    eager_steps = list(eager.stream(ids, max_tokens=6, lens=lens, ignore_eos=True))
    assert [s.token_id for s in eager_steps] == completion.token_ids
    for step, twin in zip(steps, eager_steps, strict=True):
        assert twin.lens is not None and step.lens is not None
        assert_same_lens(step.lens.ids, step.lens.probs, twin.lens.ids, twin.lens.probs, f"eager at {step.position}")
    assert eager_steps[0].prompt_lens is not None and first.positions == eager_steps[0].prompt_lens.positions
    assert_same_lens(first.ids, first.probs, eager_steps[0].prompt_lens.ids, eager_steps[0].prompt_lens.probs)


def test_lens_alone_and_under_steering(llama: Any) -> None:
    ids = llama.to_tokens(PROMPT)[0].tolist()
    n = len(ids)
    lens = LensRequest([1], top_k=3)
    # no points: the lens alone; the result covers the token-producing positions only
    completion, acts = llama.capture_generation(ids, [], max_tokens=4, lens=lens, ignore_eos=True)
    assert list(acts) == [lens] and acts[lens].positions == tuple(range(n - 1, n + 3))
    # the free function's Cache holds it as cache.lens
    again, cache = capture_generation(llama, ids, [], max_tokens=4, lens=lens, ignore_eos=True)
    assert again.token_ids == completion.token_ids and cache.lens is not None
    assert torch.equal(cache.lens.ids, acts[lens].ids) and torch.equal(cache.lens.probs, acts[lens].probs)
    # under a steering spec the lens reads the steered stream (what capture reads)
    spec = SteeringSpec([Write("resid_post.1", torch.ones(128) * 3.0, op="add", positions="generated")])
    steered = list(llama.stream(ids, max_tokens=4, lens=lens, steering_spec=spec, ignore_eos=True))
    completion, acts = llama.capture_generation(
        ids, ["resid_post.1"], max_tokens=4, lens=lens, steering_spec=spec, ignore_eos=True
    )
    assert [s.token_id for s in steered] == completion.token_ids
    ref = decoded_lens(llama, {Address("resid_post", 1): acts[Address("resid_post", 1)]}, (1,), 3)
    for step in steered:
        assert step.lens is not None
        assert_same_lens(step.lens.ids, step.lens.probs, ref[0][:, step.position], ref[1][:, step.position])
    plain = list(llama.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
    assert plain[-1].lens is not None and steered[-1].lens is not None
    assert not torch.equal(plain[-1].lens.probs, steered[-1].lens.probs), "the steering did not reach the lens"
    assert_no_leaks(llama)


# -- 2. isolation: 16 concurrent mixed requests ------------------------------------------------
@pytest.fixture(scope="module")
def with_sae(llama: Any) -> Iterator[Any]:
    """The shared engine with a random SAE at ``resid_post.1`` attached (detached afterwards)."""
    ids = llama.to_tokens(PROMPT)[0].tolist()
    sample = llama.capture(ids, ["resid_post.1"])[Address("resid_post", 1)]
    gen = torch.Generator().manual_seed(5)
    norm = float(sample.norm(dim=-1).mean())
    sae = Sae(
        "standard",
        torch.randn(128, 64, generator=gen) / norm,
        torch.randn(64, generator=gen) * 0.1,
        torch.randn(64, 128, generator=gen) * norm / 45,
        torch.zeros(128),
        "blocks.1.hook_resid_post",
    )
    llama.attach_sae(SAE_NAME, sae)
    try:
        yield llama
    finally:
        llama.detach_sae(SAE_NAME)


def test_16_concurrent_mixed_requests_equal_their_solo_runs(with_sae: Any) -> None:
    facade = with_sae
    model = facade.model
    prompts = [facade.to_tokens(p)[0].tolist() for p in (PROMPT, "Hello there", "A cat sat on the mat")] + [LONG]
    steer = SteeringSpec([Write("resid_post.0", torch.ones(128) * 2.0, op="add")])
    kinds: list[dict[str, Any]] = [
        {"lens": LensRequest([0, 1, 2], top_k=10)},
        {"n_logprobs": 3},  # plain
        {"steering_spec": steer, "n_logprobs": 3},
        {"features": [Features(SAE_NAME, 8)]},
        {"lens": LensRequest([-1], top_k=4, positions=[1, -1]), "steering_spec": steer},
        {"lens": LensRequest([1, 0], top_k=10), "features": [Features(SAE_NAME, 4)], "n_logprobs": 2},
    ]
    jobs = [(ids, kind) for kind in kinds for ids in prompts][:16]
    assert len(jobs) == 16

    async def one(ids: list[int], kind: dict[str, Any]) -> list[Any]:
        return [s async for s in model.stream(ids, max_tokens=5, ignore_eos=True, **kind)]

    async def together(jobs: list[tuple[list[int], dict[str, Any]]]) -> list[list[Any]]:
        return await asyncio.gather(*(one(ids, kind) for ids, kind in jobs))

    batched = facade.run(lambda: together(jobs))
    # the same batch with no lens anywhere: the plain requests do not notice the lens traffic
    unlensed = [(ids, {k: v for k, v in kind.items() if k != "lens"}) for ids, kind in jobs]
    without = facade.run(lambda: together(unlensed))
    for (ids, kind), steps, other in zip(jobs, batched, without, strict=True):
        alone = facade.run(lambda ids=ids, kind=kind: one(ids, kind))
        what = f"{sorted(kind)} on {len(ids)} tokens"
        assert [s.token_id for s in steps] == [s.token_id for s in alone] == [s.token_id for s in other], what
        for step, solo, unlit in zip(steps, alone, other, strict=True):
            if "lens" in kind:
                assert step.lens is not None and solo.lens is not None, what
                assert_same_lens(step.lens.ids, step.lens.probs, solo.lens.ids, solo.lens.probs, what)
                assert (step.prompt_lens is None) == (solo.prompt_lens is None), what
                if step.prompt_lens is not None:
                    sp = solo.prompt_lens
                    assert step.prompt_lens.positions == sp.positions, what
                    assert_same_lens(step.prompt_lens.ids, step.prompt_lens.probs, sp.ids, sp.probs, what)
            else:
                assert step.lens is None and step.prompt_lens is None, what
            assert set(step.features) == set(solo.features), what
            for spec, readout in step.features.items():
                assert rel_diff(readout.values, solo.features[spec].values) <= 1e-4, what
            for (t1, lp1), (t2, lp2), (t3, lp3) in zip(step.logprobs, solo.logprobs, unlit.logprobs, strict=True):
                # float rounding follows the batch's composition (the scheduler's, not the lens's):
                # exactness next to a lens request is test_plain_requests_are_bit_identical_...
                assert t1 == t2 == t3 and abs(lp1 - lp2) <= 1e-4 and abs(lp1 - lp3) <= 1e-4, what
    assert_no_leaks(facade)


def test_collected_steps_equal_the_streams(with_sae: Any) -> None:
    """``collect_steps`` (vLLM's one answer at the end, one drain) gives the steps ``stream``
    gives (one answer and one drain per step), for requests collected at the same time too."""
    facade = with_sae
    model = facade.model
    ids = facade.to_tokens(PROMPT)[0].tolist()
    kinds: list[dict[str, Any]] = [
        {"lens": LensRequest([1, 0], top_k=5, positions=[1, -1]), "features": [Features(SAE_NAME, 4)], "n_logprobs": 2},
        {"n_logprobs": 3},
        {"features": [Features(SAE_NAME, 8)]},
    ]

    async def streamed(kind: dict[str, Any]) -> list[Any]:
        return [s async for s in model.stream(ids, max_tokens=5, ignore_eos=True, **kind)]

    async def collected() -> list[list[Any]]:
        return await asyncio.gather(*(model.collect_steps(ids, max_tokens=5, ignore_eos=True, **k) for k in kinds))

    for kind, got in zip(kinds, facade.run(collected), strict=True):
        want = facade.run(lambda kind=kind: streamed(kind))
        what = sorted(kind)
        assert [(s.token_id, s.text, s.position) for s in got] == [(s.token_id, s.text, s.position) for s in want]
        for step, other in zip(got, want, strict=True):
            assert [t for t, _ in step.logprobs] == [t for t, _ in other.logprobs], what
            assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(step.logprobs, other.logprobs, strict=True))
            assert (step.lens is None) == (other.lens is None) and (step.prompt_lens is None) == (
                other.prompt_lens is None
            ), what
            if step.lens is not None:
                assert_same_lens(step.lens.ids, step.lens.probs, other.lens.ids, other.lens.probs, what)
            if step.prompt_lens is not None:
                assert step.prompt_lens.positions == other.prompt_lens.positions, what
            assert set(step.features) == set(other.features), what
            for spec, readout in step.features.items():
                assert rel_diff(readout.values, other.features[spec].values) <= 1e-4, what
    lensed = facade.run(collected)[0]
    assert lensed[0].prompt_lens is not None and all(s.lens is not None and s.features for s in lensed)
    assert_no_leaks(facade)


def test_plain_requests_are_bit_identical_next_to_lens_requests(llama: Any) -> None:
    """A lens only reads: the requests next to it compute exactly what they compute alone."""
    model = llama.model
    ids = llama.to_tokens(PROMPT)[0].tolist()
    other = llama.to_tokens("A cat sat on the mat")[0].tolist()
    points = [Address("resid_post", 1), Address("logits")]

    async def pair(lens: LensRequest | None) -> Any:
        extra = {} if lens is None else {"lens": lens}
        plain = model.capture_generation(ids, points, max_tokens=4, ignore_eos=True)
        lensed = model.capture_generation(other, [], max_tokens=4, ignore_eos=True, **extra)
        return await asyncio.gather(plain, lensed)

    (completion, alone), _ = llama.run(lambda: pair(None))
    for _ in range(2):
        (next_to, got), (_, lensed) = llama.run(lambda: pair(LensRequest([0, 1, 2], top_k=10, positions="prompt")))
        assert next_to.token_ids == completion.token_ids
        for point in points:
            assert torch.equal(got[point], alone[point]), point
        assert isinstance(next(iter(lensed.values())), LensResult)


# -- 3. errors ------------------------------------------------------------------------------------
def test_bad_lens_requests_are_typed_errors(llama: Any) -> None:
    ids = llama.to_tokens(PROMPT)[0].tolist()
    for lens, match in (
        (LensRequest([3]), "outside this 3-layer model"),
        (LensRequest([0, -3]), "name one layer twice"),
        (LensRequest([0], top_k=100, positions=[40]), "outside the"),
        ({"layers": [0], "top_k": 2, "bogus": 1}, "unknown lens field"),
        ("resid_post.1", "must be a LensRequest"),
    ):
        with pytest.raises(InvalidOption, match=match):
            list(llama.stream(ids, max_tokens=2, lens=lens))
        with pytest.raises(InvalidOption, match=match):
            llama.capture_generation(ids, [], max_tokens=2, lens=lens)
    with pytest.raises(InvalidOption, match="top_k"):
        LensRequest([0], top_k=0)
    # a lens that fails in the worker fails alone: the engine and the requests next to it go on
    model = llama.model
    request = model._check_generation(ids, [], max_tokens=3, steering_spec=None, sampling={}, lens=LensRequest([0]))
    assert request.lens is not None
    broken = dataclasses.replace(request, lens=CheckedLens(request.lens.request, (0,), 10**6))  # k > vocabulary

    async def broken_and_fine() -> list[Any]:
        async def bad() -> Any:
            return [s async for s in model._stream(broken)]

        fine = model.capture_generation(ids, [], max_tokens=3, lens=LensRequest([0, 2], top_k=2))
        return await asyncio.gather(bad(), fine, return_exceptions=True)

    bad, fine = llama.run(broken_and_fine)
    assert isinstance(bad, BackendError) and "failed in vLLM's worker" in str(bad), bad
    assert not isinstance(fine, BaseException), fine
    assert llama.generate(ids, max_tokens=2).token_ids  # the engine serves on
    assert_no_leaks(llama)


def test_a_stream_stopped_early_leaves_nothing_behind(llama: Any) -> None:
    model = llama.model
    ids = llama.to_tokens(PROMPT)[0].tolist()

    async def stop_early() -> int:
        seen = 0
        steps = model.stream(ids, max_tokens=50, lens=LensRequest([0, 1], top_k=3, positions="prompt"), ignore_eos=True)
        async with contextlib.aclosing(steps):
            async for _ in steps:
                seen += 1
                if seen == 2:
                    break
        return seen

    assert llama.run(stop_early) == 2
    assert_no_leaks(llama)


def test_pipeline_parallelism_serves_the_lens_on_the_last_stage_only() -> None:
    """Checked in the front end against the stages the workers reported (faked here: no engine
    is started); the worker side under PP is the same code as under PP=1 on the last stage."""
    model = load_model(vllm_model_path(FAMILY), backend="vllm")
    try:
        model._stages = [(frozenset({0, 1}), [0]), (frozenset({2}), [1])]
        model.pp_size = 2
        ids = list(range(5))
        with pytest.raises(UnsupportedOperation, match="tensor_parallel_size"):
            model._check_generation(ids, [], max_tokens=2, steering_spec=None, sampling={}, lens=LensRequest([0, 2]))
        checked = model._check_generation(
            ids, [], max_tokens=2, steering_spec=None, sampling={}, lens=LensRequest([-1])
        )
        assert checked.lens is not None and checked.lens.layers == (2,)
    finally:
        model.close()


# -- 4. vllm-static: the lens at declared resid_post layers ------------------------------------
# (its equality with the decoded resid_post and the vllm backend runs on test_vllm_static's
# engine: tests/vllm_static/test_vllm_static.py::test_static_lens_equals_decoded_resid_post_and_the_vllm_backend)
def test_static_lens_at_an_undeclared_layer_is_refused_before_any_engine() -> None:
    model = load_model(
        vllm_model_path(FAMILY), backend="vllm-static", static_points=["resid_post.0", "resid_post.2", "logits"]
    )
    try:
        facade = sync_model(model)
        ids = facade.to_tokens(PROMPT)[0].tolist()
        with pytest.raises(UndeclaredAddress, match=r"resid_post\.1"):
            list(facade.stream(ids, max_tokens=2, lens=LensRequest([0, 1])))
        with pytest.raises(UndeclaredAddress, match="declare the lens layers"):
            facade.capture_generation(ids, [], max_tokens=2, lens=LensRequest([-2]))
        assert model._engine is None  # refused in the front end: nothing was built
    finally:
        model.close()
