"""SAE readouts, feature clamps and transcoder clamps under tensor parallelism (TP=2 equals TP=1),
and SAEs at addresses tensor parallelism splits refused. The helpers and SAEs are test_vllm_sae's
(``support.readouts``); the engines are the session's llama TP=1/TP=2 pair, as in test_vllm_tp."""

from __future__ import annotations

from typing import Any

import pytest

from interp_engine import Address, Features, FeatureWrite, InvalidFeatures, SteeringSpec
from interp_engine.sae._readouts import read_features
from interp_testkit.suite import LONG, PROMPT, rel_diff

from ..support.circuits import scaled_plt
from ..support.readouts import (
    ATTN,
    HOOK_Z,
    MLP,
    PREFIX,
    RES,
    TOL,
    assert_close_readout,
    assert_same_readout,
    busiest_feature,
    eager_twin,
    make_sae,
    readouts_for,
)


@pytest.fixture(scope="module")
def tp(attached: Any) -> tuple[Any, Any]:
    """The session's TP=1 and TP=2 llama engines (the same ones test_vllm_tp uses)."""
    one = attached("llama")
    two = attached("llama", tensor_parallel_size=2)
    assert one.model.tp_size == 1 and two.model.tp_size == 2
    return one, two


def test_tp2_readouts_and_clamps_equal_tp1(tp: tuple[Any, Any]) -> None:
    one, two = tp
    whole = [RES, MLP, ATTN]  # the hook_z SAE's attn_z is split over ranks
    specs = [spec for name in whole for spec in readouts_for(name)[:3]]
    for ids in (one.to_tokens(PROMPT)[0].tolist(), LONG):
        a, b = one.capture(ids, specs), two.capture(ids, specs)
        for spec in specs:
            assert_close_readout(b[spec], a[spec], what=f"TP=2 {spec}")
    ids = one.to_tokens(PROMPT)[0].tolist()
    feature = busiest_feature(one, ids, RES)
    spec = SteeringSpec([FeatureWrite(RES, feature, "clamp", 6.0, positions=[1, 3, 4]), FeatureWrite(MLP, 3, "ablate")])
    points = [Address("resid_post", 2), Address("logits"), Features(RES, dense=True)]
    a = one.capture(ids, points, steering_spec=spec)
    b = two.capture(ids, points, steering_spec=spec)
    plain = one.capture(ids, points)
    assert rel_diff(b[Address("logits")], a[Address("logits")]) <= TOL
    assert rel_diff(b[Address("resid_post", 2)], a[Address("resid_post", 2)]) <= TOL
    assert_close_readout(b[points[2]], a[points[2]], what="clamped readout")
    assert rel_diff(a[Address("logits")], plain[Address("logits")]) > 1e-3, "the clamp did nothing"
    completion_a = one.generate(ids, max_tokens=5, steering_spec=spec, ignore_eos=True)
    completion_b = two.generate(ids, max_tokens=5, steering_spec=spec, ignore_eos=True)
    assert completion_a.token_ids == completion_b.token_ids
    # streamed readouts (drained from rank 0 step by step), steered
    read = [Features(RES, 8), Features(MLP, dense=True)]
    steps_a = list(one.stream(ids, max_tokens=4, features=read, steering_spec=spec, ignore_eos=True))
    steps_b = list(two.stream(ids, max_tokens=4, features=read, steering_spec=spec, ignore_eos=True))
    assert [s.token_id for s in steps_b] == [s.token_id for s in steps_a] == completion_a.token_ids[:4]
    for a, b in zip(steps_a, steps_b, strict=True):
        assert a.position == b.position
        for r in read:
            assert_close_readout(b.features[r][None], a.features[r][None], what=f"streamed {r}")


def test_tp2_refuses_an_sae_at_a_split_address(tp: tuple[Any, Any]) -> None:
    one, two = tp
    ids = one.to_tokens(PROMPT)[0].tolist()
    sample = one.capture(ids, ["mlp_post.1"])[Address("mlp_post", 1)]
    name = f"{PREFIX}-neurons"
    sae = make_sae("standard", "blocks.1.mlp.hook_post", sample, seed=11)
    try:
        two.attach_sae(name, sae)
        with pytest.raises(InvalidFeatures, match="tensor parallelism"):
            two.capture(ids, [Features(name, 4)])
        with pytest.raises(InvalidFeatures, match="tensor parallelism"):
            two.generate(ids, max_tokens=2, steering_spec=SteeringSpec([FeatureWrite(name, 0, "ablate")]))
        with pytest.raises(InvalidFeatures, match="tensor parallelism"):
            list(two.stream(ids, max_tokens=2, features=[Features(name, 4)]))
        with pytest.raises(InvalidFeatures):  # so is the hook_z SAE (attn_z: heads split over ranks)
            two.capture(ids, [Features(HOOK_Z, 4)])
        # TP=1 serves it; TP=2 goes on serving everything else
        one.attach_sae(name, sae)
        got = one.capture(ids, ["mlp_post.1", Features(name, 4)])
        assert_same_readout(got[Features(name, 4)], read_features(sae, got[Address("mlp_post", 1)], Features(name, 4)))
        assert two.capture(ids, [Features(RES, 4)])[Features(RES, 4)].values.shape == (len(ids), 4)
    finally:
        for facade in (one, two):
            if name in facade.saes:
                facade.detach_sae(name)


def test_tp2_transcoder_clamps_equal_tp1(tp: tuple[Any, Any]) -> None:
    """Transcoder clamps (read at ``mlp_in``, written at ``mlp_out``: both whole rows on every
    rank, each rank applying the same change) under TP=2 equal TP=1 and the eager backend, over
    one prefill step and over several (chunked prefill)."""
    one, two = tp
    eager = eager_twin("llama")
    plt = scaled_plt(eager, prefix="tvtp-tc", seed=41)
    models = (one, two, eager)
    for model in models:
        plt.attach(model)
    try:
        points = [Address("mlp_out", 2), Address("resid_post", 2), Address("logits")]
        spec = SteeringSpec(
            [
                FeatureWrite(plt.names[0], 4, "ablate"),
                FeatureWrite(plt.names[1], 9, "clamp", 5.0, positions=[1, 3, -1]),
                FeatureWrite(plt.names[2], 2, "clamp", 3.0),
            ]
        )
        for ids in (one.to_tokens(PROMPT)[0].tolist(), LONG):
            a = one.capture(ids, points, steering_spec=spec)
            b = two.capture(ids, points, steering_spec=spec)
            want = eager.capture(ids, points, steering_spec=spec)
            plain = one.capture(ids, points)
            for point in points:
                assert rel_diff(b[point], a[point]) <= TOL, point
                assert rel_diff(a[point], want[point]) <= TOL, point
            assert rel_diff(a[Address("logits")], plain[Address("logits")]) > 1e-3, "the clamps did nothing"
        ids = one.to_tokens(PROMPT)[0].tolist()
        completion_a = one.generate(ids, max_tokens=5, steering_spec=spec, ignore_eos=True)
        completion_b = two.generate(ids, max_tokens=5, steering_spec=spec, ignore_eos=True)
        assert completion_a.token_ids == completion_b.token_ids
    finally:
        for model in models:
            for name in plt.names.values():
                if name in model.saes:
                    model.detach_sae(name)
