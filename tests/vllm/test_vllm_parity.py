"""The vllm backend against HF ``transformers`` and against the eager backend, on GPT-2, Llama,
Qwen2 and Qwen3: every address, attention patterns, the logit lens, generation and steering."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write, load_model, sync_model
from interp_testkit.suite import PROMPT, VLLM_FAMILIES, hf_for, rel_diff, vllm_model_path

TOL = 1e-4
FAMILIES = VLLM_FAMILIES

pytestmark = pytest.mark.parametrize("family", FAMILIES)


@functools.cache
def eager_twin(family: str) -> Any:
    """The eager backend on the very same checkpoint."""
    return sync_model(load_model(vllm_model_path(family), backend="eager"))


def _every_point(n_layers: int) -> list[Address]:
    kinds = ("resid_pre", "resid_mid", "attn_out", "mlp_post", "mlp_out", "resid_post", "attn_pattern")
    points = [Address("embed")]
    points += [Address(kind, layer) for layer in range(n_layers) for kind in kinds]
    return [*points, Address("final_norm"), Address("logits")]


def _ids(facade: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = facade.to_tokens(text)[0].tolist()
    return ids


def test_every_address_matches_hf_and_eager(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    n = model.info.n_layers
    points = _every_point(n)
    acts = model.capture(ids, points)
    assert list(acts) == points
    with torch.no_grad():
        out = hf_for(vllm_model_path(family))(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    assert rel_diff(acts[Address("embed")], out.hidden_states[0][0]) <= TOL
    for layer in range(n):
        assert rel_diff(acts[Address("resid_pre", layer)], out.hidden_states[layer][0]) <= TOL
        if layer < n - 1:
            assert rel_diff(acts[Address("resid_post", layer)], out.hidden_states[layer + 1][0]) <= TOL
        assert rel_diff(acts[Address("attn_pattern", layer)], out.attentions[layer][0]) <= TOL
        parts = acts[Address("resid_pre", layer)] + acts[Address("attn_out", layer)] + acts[Address("mlp_out", layer)]
        assert rel_diff(parts, acts[Address("resid_post", layer)]) <= TOL
    assert rel_diff(acts[Address("final_norm")], out.hidden_states[n][0]) <= TOL
    assert rel_diff(acts[Address("logits")], out.logits[0]) <= TOL
    eager = eager_twin(family).capture(ids, points)
    for point in points:
        assert rel_diff(acts[point], eager[point]) <= TOL, point


def test_decode_residuals_reproduces_the_logits(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    last = Address("resid_post", -1)
    acts = model.capture(ids, [last, Address("resid_post", 0)])
    logits = model.decode_residuals(acts[last])
    with torch.no_grad():
        expected = hf_for(vllm_model_path(family))(torch.tensor([ids])).logits[0]
    assert rel_diff(logits, expected) <= TOL
    lens = model.decode_residuals(acts)
    eager_lens = eager_twin(family).decode_residuals(acts)
    for point in acts:
        assert rel_diff(lens[point], eager_lens[point]) <= TOL


def test_greedy_generation_equals_hf_and_eager(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model, "Once upon a time")
    completion = model.generate(ids, max_tokens=10)
    with torch.no_grad():
        hf = hf_for(vllm_model_path(family)).generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert completion.token_ids == hf[0, len(ids) :].tolist()
    assert completion == eager_twin(family).generate(ids, max_tokens=10)


def test_capture_generation_covers_every_generated_token(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model, "Once upon a time")
    points = [Address("resid_post", 1), Address("mlp_post", 0), Address("attn_pattern", -1)]
    completion, acts = model.capture_generation(ids, points, max_tokens=7, ignore_eos=True)
    eager_completion, eager_acts = eager_twin(family).capture_generation(ids, points, max_tokens=7, ignore_eos=True)
    assert completion.token_ids == eager_completion.token_ids and len(completion.token_ids) == 7
    for point in points:
        assert acts[point].shape[-2 if point.kind != "attn_pattern" else -1] == len(ids) + 7
        assert rel_diff(acts[point], eager_acts[point]) <= TOL, point


def test_stream_logprobs_come_from_the_sampler(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model, "Once upon a time")
    steps = list(model.stream(ids, max_tokens=4, n_logprobs=5, ignore_eos=True))
    eager_steps = list(eager_twin(family).stream(ids, max_tokens=4, n_logprobs=5, ignore_eos=True))
    assert [s.token_id for s in steps] == [s.token_id for s in eager_steps]
    for step, twin in zip(steps, eager_steps, strict=True):
        assert [t for t, _ in step.logprobs] == [t for t, _ in twin.logprobs]
        assert max(abs(a - b) for (_, a), (_, b) in zip(step.logprobs, twin.logprobs, strict=True)) <= 1e-4
        assert step.logprobs[0][0] == step.token_id
    assert "".join(s.text for s in steps) == "".join(s.text for s in eager_steps)


def test_steering_equals_the_eager_backend(family: str, vllm_engines: Any) -> None:
    model = vllm_engines(family)
    ids = _ids(model)
    gen = torch.Generator().manual_seed(7)
    d_model, d_mlp = model.info.d_model, model.info.d_mlp
    other = model.capture(_ids(model, "A completely different sentence about cats"), [Address("resid_post", 0)])
    n_other = other[Address("resid_post", 0)].shape[0]
    specs = [
        SteeringSpec([Write("resid_post.0", torch.randn(d_model, generator=gen), op="add", scale=3.0)]),
        SteeringSpec([Write("resid_pre.1", torch.randn(d_model, generator=gen), op="ablate")]),
        SteeringSpec([Write("mlp_post.1", torch.randn(d_mlp, generator=gen), op="add", positions=[1, -1])]),
        SteeringSpec([Write("resid_mid.2", torch.randn(d_model, generator=gen), op="add", positions="prompt")]),
        SteeringSpec([Write("attn_out.0", torch.randn(d_model, generator=gen), op="add", scale=2.0)]),
        # activation patching: another run's residual at the first positions
        SteeringSpec(
            [
                Write(
                    "resid_post.0",
                    other[Address("resid_post", 0)][: min(n_other, 4)],
                    op="set",
                    positions=list(range(min(n_other, 4))),
                )
            ]
        ),
    ]
    points = [Address("resid_post", 0), Address("resid_mid", 2), Address("logits")]
    for spec in specs:
        steered = model.capture(ids, points, steering_spec=spec)
        expected = eager_twin(family).capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(steered[point], expected[point]) <= TOL, (spec, point)
    plain = model.capture(ids, points)
    assert not torch.allclose(plain[Address("logits")], steered[Address("logits")])
    # steered generation, too
    spec = specs[0]
    assert model.generate(ids, max_tokens=6, steering_spec=spec) == eager_twin(family).generate(
        ids, max_tokens=6, steering_spec=spec
    )


def test_per_row_steering_in_one_call_equals_each_row_alone(family: str, vllm_engines: Any) -> None:
    """``steering_spec=[spec, None, other]``: the rows go as concurrent requests that vLLM batches;
    each equals its solo run and the eager backend's one-forward batch."""
    from interp_engine import run_with_cache

    model = vllm_engines(family)
    gen = torch.Generator().manual_seed(11)
    d_model = model.info.d_model
    rows = [_ids(model), _ids(model, "A completely different sentence about cats"), _ids(model, "Short one")]
    specs = [
        SteeringSpec([Write("resid_post.0", torch.randn(d_model, generator=gen), scale=3.0)]),
        None,
        SteeringSpec([Write("resid_pre.1", torch.randn(d_model, generator=gen), positions=[-1], op="set")]),
    ]
    points = ["resid_post.1", "logits"]
    batch = run_with_cache(model, rows, points, steering_spec=specs)
    twin = run_with_cache(eager_twin(family), rows, points, steering_spec=specs)
    for i, (row, spec) in enumerate(zip(rows, specs, strict=True)):
        solo = model.capture(row, points, steering_spec=spec)
        for point in points:
            got = batch[point][i, : len(row)]
            assert rel_diff(got, solo[Address.parse(point)]) <= TOL, (i, point)
            assert rel_diff(got, twin[point][i, : len(row)]) <= TOL, (i, point)
    unsteered = model.capture(rows[1], points)
    assert rel_diff(batch["logits"][1, : len(rows[1])], unsteered[Address("logits")]) <= TOL
