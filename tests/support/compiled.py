"""What the compiled-engine tests share: the worker's counters of uncompiled steps and fired
islands, and the check of SAE readouts, a feature clamp and the lens against another model."""

from __future__ import annotations

from typing import Any

from interp_engine import Address, FeatureWrite, LensRequest, SteeringSpec
from interp_testkit.suite import PROMPT, rel_diff

from .engines import assert_no_leaks
from .lens import assert_same_lens
from .readouts import RES, TOL, assert_close_readout, busiest_feature, readouts_for, saes_for


def counters(model: Any) -> tuple[int, int]:
    """The first worker's steps run uncompiled and islands fired so far."""
    stats = model.worker_stats()[0]
    return stats["uncompiled_steps"], stats.get("islands_fired", 0)


def check_saes_clamp_and_lens(model: Any, oracle: Any, family: str) -> None:
    """On a compiled engine with ``family``'s readout SAEs attached (``support.readouts``): every
    float32 readout equals ``oracle``'s; a clamp at ``resid_post`` and the lens run inside the
    compiled graph (no step uncompiled) and equal ``oracle``'s; nothing is left behind."""
    ids = model.to_tokens(PROMPT)[0].tolist()
    specs = [spec for name in saes_for(family) for spec in readouts_for(name) if spec.dtype == "float32"]
    got = model.capture(ids, specs)
    want = oracle.capture(ids, specs)
    for spec in specs:
        assert_close_readout(got[spec], want[spec], what=str(spec))
    feature = busiest_feature(model, ids, RES)
    clamp = SteeringSpec([FeatureWrite(RES, feature, "clamp", 6.0)])
    before = counters(model)[0]
    clamped = model.capture(ids, ["logits", readouts_for(RES)[0]], steering_spec=clamp)
    assert counters(model)[0] == before, "a clamp at resid_post left the compiled graph"
    expected = oracle.capture(ids, ["logits", readouts_for(RES)[0]], steering_spec=clamp)
    assert rel_diff(clamped[Address("logits")], expected[Address("logits")]) <= TOL
    lens = LensRequest([0, 1, -1], top_k=5, positions=[-1])
    steps = list(model.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
    twin = list(oracle.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
    assert counters(model)[0] == before, "the lens left the compiled graph"
    assert [s.token_id for s in steps] == [s.token_id for s in twin]
    for step, other in zip(steps, twin, strict=True):
        assert step.lens is not None and other.lens is not None
        assert_same_lens(step.lens.ids, step.lens.probs, other.lens.ids, other.lens.probs, f"step {step.position}")
    assert_no_leaks(model)


def check_generation_rows(model: Any, oracle: Any, ids: list[int], max_tokens: int) -> None:
    """``capture_generation`` of the residual stream at two layers (inside the compiled graph):
    the tokens and every prompt and generated token's rows equal ``oracle``'s."""
    points = [Address("resid_post", 1), Address("resid_pre", 0)]
    completion, got = model.capture_generation(ids, points, max_tokens=max_tokens, ignore_eos=True)
    twin_completion, want = oracle.capture_generation(ids, points, max_tokens=max_tokens, ignore_eos=True)
    assert completion.token_ids == twin_completion.token_ids
    for point in points:
        assert got[point].shape[0] == len(ids) + max_tokens
        assert rel_diff(got[point], want[point]) <= TOL, point
