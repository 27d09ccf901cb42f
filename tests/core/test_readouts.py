"""Feature readout requests, their results, feature writes in steering specs, and the Cache
holding readouts: the core values every backend shares."""

from __future__ import annotations

import pathlib

import pytest
import torch

from interp_engine import (
    Cache,
    FeatureReadout,
    Features,
    FeatureWrite,
    InvalidFeatures,
    InvalidSteering,
    SteeringSpec,
    Write,
)
from interp_engine.sae._readouts import DEFAULT_TOP_K, select_features, stack_readouts


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("features:res", Features("res", DEFAULT_TOP_K)),
        ("features:res:top8", Features("res", 8)),
        ("features:res:ids=3,17", Features("res", ids=[3, 17])),
        ("features:res:dense", Features("res", dense=True)),
        ("features:res.L2-x:top4:float16", Features("res.L2-x", 4, dtype="float16")),
    ],
)
def test_string_forms_round_trip(text: str, expected: Features) -> None:
    parsed = Features.parse(text)
    assert parsed == expected
    assert Features.parse(str(parsed)) == parsed
    assert Features.from_dict(parsed.to_dict()) == parsed
    assert hash(parsed) == hash(expected)


@pytest.mark.parametrize(
    "bad",
    ["features:", "features:res:top", "features:res:top0", "features:res:ids=", "features:res:sparse", "res:top8"],
)
def test_bad_string_forms_are_refused(bad: str) -> None:
    with pytest.raises(InvalidFeatures):
        Features.parse(bad)


def test_bad_requests_are_refused() -> None:
    with pytest.raises(InvalidFeatures, match="one of top_k, ids or dense"):
        Features("res", 8, dense=True)
    with pytest.raises(InvalidFeatures, match="positive"):
        Features("res", 0)
    with pytest.raises(InvalidFeatures, match="repeat"):
        Features("res", ids=[1, 1])
    with pytest.raises(InvalidFeatures, match="name"):
        Features("bad name")
    with pytest.raises(InvalidFeatures, match="dtype"):
        Features("res", dtype="int8")
    with pytest.raises(InvalidFeatures, match="unknown feature readout fields"):
        Features.from_dict({"sae": "res", "k": 3})


def test_select_top_k_marks_features_that_did_not_fire() -> None:
    features = torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    readout = select_features(features, Features("s", 3))
    assert readout.ids.tolist() == [[1, 3, -1], [-1, -1, -1]]
    assert readout.values.tolist() == [[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.equal(readout.to_dense(4), features)
    chosen = select_features(features, Features("s", ids=[3, 0]))
    assert chosen.values.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert chosen.ids.tolist() == [[3, 0], [3, 0]]
    probe = select_features(torch.tensor([[-2.0, -1.0, -3.0]]), Features("p", 2), sparse=False)
    assert probe.ids.tolist() == [[1, 0]]  # a probe's values may be negative: nothing is masked


def test_stack_pads_ids_with_minus_one() -> None:
    a = FeatureReadout(torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long), torch.ones(3))
    b = FeatureReadout(torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), torch.ones(1))
    stacked = stack_readouts([a, b], [3, 1])
    assert stacked.values.shape == (2, 3, 2)
    assert stacked.ids[1, 1:].eq(-1).all() and stacked.values[1, 1:].eq(0).all()
    assert stacked.error_norm[1].tolist() == [1.0, 0.0, 0.0]


def test_cache_holds_readouts_and_saves_them(tmp_path: pathlib.Path) -> None:
    readout = FeatureReadout(torch.rand(1, 4, 2), torch.randint(0, 9, (1, 4, 2)), torch.rand(1, 4))
    cache = Cache({"resid_post.1": torch.rand(1, 4, 8), Features("res", 2): readout}, lengths=torch.tensor([4]))
    assert cache["features:res:top2"] is readout
    assert "features:res:top2" in cache and "features:res:top3" not in cache
    assert list(cache.features()) == [Features("res", 2)]
    path = tmp_path / "c.safetensors"
    cache.save(path)
    back = Cache.load(path)
    again = back[Features("res", 2)]
    assert torch.equal(again.values, readout.values) and torch.equal(again.ids, readout.ids)
    assert torch.equal(again.error_norm, readout.error_norm)
    assert torch.equal(back["resid_post.1"], cache["resid_post.1"])


def test_feature_writes_serialise_in_steering_specs() -> None:
    spec = SteeringSpec(
        [
            Write("resid_post.0", torch.ones(4)),
            FeatureWrite("res", 7, "clamp", 2.5, positions=[-1]),
            FeatureWrite("res", 3, "ablate", positions="generated"),
            FeatureWrite("res", 1, "add", -1.0),
        ]
    )
    back = SteeringSpec.from_json(spec.to_json())
    assert back == spec
    assert isinstance(back.writes[1], FeatureWrite) and back.writes[1].positions == (-1,)


def test_bad_feature_writes_are_refused() -> None:
    with pytest.raises(InvalidSteering, match="feature ops"):
        FeatureWrite("res", 1, "set")
    with pytest.raises(InvalidSteering, match="feature id"):
        FeatureWrite("res", -1)
    with pytest.raises(InvalidSteering, match="no value"):
        FeatureWrite("res", 1, "ablate", 2.0)
    with pytest.raises(InvalidSteering, match="finite"):
        FeatureWrite("res", 1, "clamp", float("nan"))
    with pytest.raises(InvalidSteering, match="unknown feature write fields"):
        SteeringSpec.from_dict({"writes": [{"sae": "res", "feature": 1, "scale": 2}]})


def test_results_are_a_plain_dict_keyed_by_address_and_features() -> None:
    from interp_engine import Address, Results

    readout = FeatureReadout(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    results = Results({Address("resid_post", -1): torch.zeros(2, 4), Features("res", 1): readout})
    assert isinstance(results, dict)
    assert results[Features.parse("features:res:top1")] is readout
    assert "features:res:top1" not in results and "resid_post.-1" not in results  # SPEC §3: not its string
    with pytest.raises(KeyError):
        results["resid_post.-1"]  # type: ignore[call-overload]
