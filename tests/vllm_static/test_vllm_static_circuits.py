"""Transcoder feature clamps compiled into vllm-static's graph.

The folder's compiled llama engine (its conftest; chunked prefill over 64-token steps) is built
with transcoders attached before the build (``support.static.transcoders``: ReLU transcoders
``mlp_in.L -> mlp_out.L`` on every layer, and a JumpReLU one ``resid_mid.1 -> mlp_out.1``). A
clamp reads the feature in the graph at the transcoder's input address and adds ``(v - f_i) d_i``
at its output address. Checked against the dynamic ``vllm`` backend (the session's llama engine)
and the eager backend with the same transcoders attached under the same names, and against the
hand-written add at ``mlp_out.2`` (a declared write point of the engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import Address, Features, FeatureWrite, SteeringSpec, Write
from interp_testkit.suite import LONG, PROMPT, rel_diff

from ..support.readouts import TOL, eager_twin
from ..support.static import MID_TC, transcoders

SAME = 1e-5  # one engine, the same forward (float32 rounding of the add)
POINTS = [Address("mlp_out", 2), Address("resid_post", 2), Address("logits")]


@pytest.fixture(scope="module")
def engines(static_engines: Any, vllm_engines: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(the static llama engine, the shared dynamic llama engine, its eager twin), the last two with
    the transcoders attached under the static engine's names."""
    static = static_engines["llama"]
    others = (vllm_engines("llama"), eager_twin("llama"))
    plt, mid = transcoders()
    names = {**{plt.names[layer]: plt[layer] for layer in plt.layers}, MID_TC: mid}
    try:
        for model in others:
            for name, sae in names.items():
                if name in model.saes:
                    model.detach_sae(name)
                model.attach_sae(name, sae)
        yield static, *others
    finally:
        for model in others:
            for name in names:
                if name in model.saes:
                    model.detach_sae(name)


def _ids(facade: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = facade.to_tokens(text)[0].tolist()
    return ids


def _specs(static: Any) -> list[SteeringSpec]:
    plt, _ = transcoders()
    ids = _ids(static)
    top = static.capture(ids, [Features(plt.names[2], 1), Features(MID_TC, 1)])
    hot = int(top[Features(plt.names[2], 1)].ids[-1, 0])
    warm = int(top[Features(MID_TC, 1)].ids[-1, 0])
    return [
        SteeringSpec([FeatureWrite(plt.names[2], hot, "clamp", 5.0, positions=[-1])]),
        SteeringSpec([FeatureWrite(plt.names[0], 3, "ablate"), FeatureWrite(plt.names[1], 9, "clamp", 4.0)]),
        SteeringSpec(
            [FeatureWrite(MID_TC, warm, "ablate"), FeatureWrite(plt.names[2], 7, "clamp", 3.0, positions=[1, 2])]
        ),
        SteeringSpec([Write("mlp_out.2", torch.ones(128) * 0.1), FeatureWrite(plt.names[2], hot, "clamp", 2.0)]),
        SteeringSpec([FeatureWrite(plt.names[1], 5, "clamp", 3.0, positions="generated")]),
    ]


def test_transcoder_clamps_equal_the_vllm_and_eager_backends(engines: Any) -> None:
    static, dynamic, eager = engines
    ids = _ids(static)
    plain = static.capture(ids, POINTS)
    for spec in _specs(static):
        got = static.capture(ids, POINTS, steering_spec=spec)
        for reference in (dynamic, eager):
            expected = reference.capture(ids, POINTS, steering_spec=spec)
            for point in POINTS:
                assert rel_diff(got[point], expected[point]) <= TOL, (spec, point)
        generated_only = all(getattr(w, "positions", None) == "generated" for w in spec.writes)
        assert generated_only or not torch.allclose(got[Address("logits")], plain[Address("logits")])
        completion, acts = static.capture_generation(ids, POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True)
        ref_completion, ref_acts = dynamic.capture_generation(
            ids, POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True
        )
        assert completion.token_ids == ref_completion.token_ids
        assert rel_diff(acts[Address("logits")], ref_acts[Address("logits")]) <= TOL
    # a prompt over several 64-token prefill steps, every position clamped
    spec = _specs(static)[1]
    got = static.capture(LONG, POINTS, steering_spec=spec)
    expected = dynamic.capture(LONG, POINTS, steering_spec=spec)
    for point in POINTS:
        assert rel_diff(got[point], expected[point]) <= TOL, point


def test_a_transcoder_clamp_equals_the_add_written_by_hand(engines: Any) -> None:
    static, _, _ = engines
    plt, _ = transcoders()
    ids = _ids(static)
    inputs = static.capture(ids, [Features(plt.names[2], dense=True)])[Features(plt.names[2], dense=True)].values
    feature = int(inputs[-1].argmax())
    positions = [0, 2, len(ids) - 1]
    current = inputs[positions, feature]
    delta = (5.0 - current)[:, None] * plt[2].feature_direction(feature)[None, :]
    clamp = SteeringSpec([FeatureWrite(plt.names[2], feature, "clamp", 5.0, positions=positions)])
    by_hand = SteeringSpec([Write("mlp_out.2", delta, op="add", positions=positions)])
    got = static.capture(ids, POINTS, steering_spec=clamp)
    expected = static.capture(ids, POINTS, steering_spec=by_hand)
    for point in POINTS:
        assert rel_diff(got[point], expected[point]) <= SAME, point


def test_unclamped_tokens_and_requests_are_untouched_and_nothing_recompiles(engines: Any) -> None:
    static, _, _ = engines
    model = static.model
    (before,) = static.run(model.worker_stats)
    ids = _ids(static)
    plain = static.capture(ids, POINTS)
    last = _specs(static)[0]
    steered = static.capture(ids, POINTS, steering_spec=last)
    for point in POINTS:  # rows before the clamped one: bit for bit
        assert torch.equal(steered[point][:-1], plain[point][:-1])
        assert not torch.equal(steered[point][-1], plain[point][-1])
    prompts = [ids, _ids(static, "A cat sat on the mat"), LONG[:40]]
    specs = [None, *_specs(static)[:3]]
    jobs = [(p, s) for p in prompts for s in specs]

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(p, POINTS, steering_spec=s) for p, s in jobs))

    batched = static.run(together)
    for (p, s), result in zip(jobs, batched, strict=True):
        alone = static.capture(p, POINTS, steering_spec=s)
        for point in POINTS:
            assert rel_diff(result[point], alone[point]) <= TOL, (s, point)
    (after,) = static.run(model.worker_stats)
    assert after["live_requests"] == 0
    counters = [k for k in before if k.startswith(("vllm_", "dynamo_unique", "dynamo_compiled"))]
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}
