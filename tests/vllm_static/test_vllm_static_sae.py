"""SAE readouts and feature clamps compiled into vllm-static's graph.

The folder's compiled llama engine (its conftest; chunked prefill over 64-token steps, the taps
test_vllm_static uses too) built with four SAEs attached before the build (three through
``load_model(..., saes=...)``, one with ``attach_sae`` before ``warmup()``): a TopK SAE at
``resid_post.1`` (its top-k kept whole), a ReLU SAE at
``mlp_out.1`` (small enough to keep every feature: ``ids=`` and dense readouts), a JumpReLU SAE
with layer-norm input normalisation at ``resid_pre.2`` (only its top 16 kept) and a sigmoid
probe on ``attn_z.0`` (hook_z). The oracle for readouts is
:func:`~interp_engine.sae._readouts.read_features` on the activations the same request captured;
clamps are checked against the dynamic ``vllm`` backend (the session's shared llama engine, with
the same SAEs attached under their names) and against the same edit written by hand.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    FeatureWrite,
    InvalidFeatures,
    InvalidSteering,
    Sae,
    StaticConfigError,
    SteeringSpec,
    UndeclaredAddress,
    UnknownSae,
    Write,
    load_model,
)
from interp_engine.sae._readouts import read_features
from interp_testkit.suite import LONG, PROMPT, rel_diff, vllm_model_path

from ..support.static import JUMP, PREFIX, PROBE, RELU, SAE_POINTS, TOPK, saes

TOL = 1e-4  # across backends and batching (float32 summation order)
SAME = 1e-5  # a readout against the host's read of the very activations the request captured
F16 = 2e-3  # float16 values on the wire (relative)
READOUTS = [
    Features(TOPK, 16),
    Features(TOPK, 4, dtype="float16"),
    Features(TOPK, 40),  # more than the SAE's k: every firing feature, then -1
    Features(RELU, ids=[3, 17, 150]),
    Features(RELU, dense=True),
    Features(RELU, 32),  # more than the kept top 16: served from the dense features
    Features(JUMP, 8),
    Features(PROBE, dense=True),
    Features(PROBE, 3),
]


@pytest.fixture(scope="module")
def engines(static_engines: Any, vllm_engines: Any) -> Iterator[tuple[Any, Any]]:
    """(the folder's static llama engine, the shared dynamic llama engine), both with the SAEs."""
    attached = saes()
    static = static_engines["llama"]
    dynamic = vllm_engines("llama")
    try:
        for name, sae in attached.items():
            if name in dynamic.saes:
                dynamic.detach_sae(name)
            dynamic.attach_sae(name, sae)
        yield static, dynamic
    finally:
        for name in attached:
            if name in dynamic.saes:
                dynamic.detach_sae(name)


def _ids(facade: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = facade.to_tokens(text)[0].tolist()
    return ids


def _assert_readout(got: Any, spec: Features, activations: torch.Tensor) -> None:
    """``got`` equals ``read_features`` of ``activations`` (``[n, d_in]``) on the host."""
    sae = saes()[spec.sae]
    expected = read_features(sae, activations, spec)
    assert got.values.shape == expected.values.shape, spec
    tol = F16 if spec.dtype == "float16" else SAME
    assert rel_diff(got.to_dense(sae.d_sae), expected.to_dense(sae.d_sae)) <= tol, spec
    if expected.ids is not None:
        assert got.ids is not None
        fired = expected.values.abs() > 1e-3  # ids may differ only at exact ties of zeros
        assert torch.equal(got.ids[fired], expected.ids[fired]), spec
        if spec.top_k is not None and sae.architecture != "probe":
            assert bool((got.ids[~fired] == -1).all()), spec
    if expected.error_norm is None:
        assert got.error_norm is None, spec
    else:
        assert rel_diff(got.error_norm, expected.error_norm) <= SAME, spec


def _activations(values: dict[Any, Any], spec: Features) -> torch.Tensor:
    address = saes()[spec.sae].address
    return torch.as_tensor(values[address]).flatten(1)


def test_readouts_equal_the_host_encoding_of_the_captured_activations(engines: Any) -> None:
    static, _ = engines
    points = [*SAE_POINTS[:4], *READOUTS]
    for ids in (_ids(static), LONG):
        got = static.capture(ids, points)
        for spec in READOUTS:
            _assert_readout(got[spec], spec, _activations(got, spec))
    # prompt and generated tokens, and the same readouts streamed step by step
    ids = _ids(static)
    completion, acts = static.capture_generation(ids, points, max_tokens=5, ignore_eos=True)
    assert acts[READOUTS[0]].values.shape[0] == len(ids) + 5
    for spec in READOUTS:
        _assert_readout(acts[spec], spec, _activations(acts, spec))
    steps = list(static.stream(ids, max_tokens=5, features=READOUTS, ignore_eos=True))
    assert [s.token_id for s in steps] == completion.token_ids
    for step in steps:
        for spec in READOUTS:
            sae = saes()[spec.sae]
            row = acts[spec][step.position]
            assert rel_diff(step.features[spec].to_dense(sae.d_sae), row.to_dense(sae.d_sae)) <= SAME, spec


def test_readouts_equal_the_vllm_backend(engines: Any) -> None:
    static, dynamic = engines
    ids = _ids(static)
    got = static.capture_generation(ids, READOUTS, max_tokens=4, ignore_eos=True)[1]
    reference = dynamic.capture_generation(ids, READOUTS, max_tokens=4, ignore_eos=True)[1]
    for spec in READOUTS:
        d_sae = saes()[spec.sae].d_sae
        assert rel_diff(got[spec].to_dense(d_sae), reference[spec].to_dense(d_sae)) <= TOL, spec


def _strongest(readout: Any) -> int:
    """The feature with the largest value anywhere in a top-1 readout."""
    return int(readout.ids.flatten()[readout.values.flatten().argmax()])


def _unclamped(spec: SteeringSpec | None, readouts: list[Features]) -> list[Features]:
    """The readouts at addresses ``spec`` clamps nothing at (vllm-static refuses the others)."""
    clamped = {saes()[w.sae].address for w in (spec.writes if spec else []) if isinstance(w, FeatureWrite)}
    return [r for r in readouts if saes()[r.sae].address not in clamped]


def _clamp_specs(static: Any) -> list[SteeringSpec]:
    ids = _ids(static)
    fired = static.capture(ids, [Features(TOPK, 1), Features(JUMP, 1)])
    hot, warm = _strongest(fired[Features(TOPK, 1)]), _strongest(fired[Features(JUMP, 1)])
    return [
        SteeringSpec([FeatureWrite(TOPK, hot, "clamp", 6.0)]),
        SteeringSpec([FeatureWrite(TOPK, 3, "clamp", 4.0, positions=[1, 3, -1])]),
        SteeringSpec([FeatureWrite(JUMP, warm, "ablate"), FeatureWrite(RELU, 5, "clamp", 3.0, positions="generated")]),
        SteeringSpec([Write("resid_post.1", torch.ones(128), op="add"), FeatureWrite(TOPK, hot, "ablate")]),
        SteeringSpec(
            [FeatureWrite(TOPK, 7, "clamp", 2.0, positions=[0, 1]), FeatureWrite(TOPK, 9, "clamp", 1.0, positions=[2])]
        ),
    ]


def test_clamps_equal_the_vllm_backend(engines: Any) -> None:
    static, dynamic = engines
    ids = _ids(static)
    points = [Address("resid_post", 2), Address("logits")]
    plain = static.capture(ids, points)
    for spec in _clamp_specs(static):
        got = static.capture(ids, points, steering_spec=spec)
        reference = dynamic.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(got[point], reference[point]) <= TOL, spec
        if all(getattr(w, "positions", None) != "generated" for w in spec.writes):
            assert not torch.allclose(got[Address("logits")], plain[Address("logits")])
        readout = _unclamped(spec, [Features(JUMP, 8), Features(TOPK, 16)])[:1]  # downstream of the clamps
        completion, acts = static.capture_generation(
            ids, [*points, *readout], max_tokens=4, steering_spec=spec, ignore_eos=True
        )
        ref_completion, ref_acts = dynamic.capture_generation(
            ids, [*points, *readout], max_tokens=4, steering_spec=spec, ignore_eos=True
        )
        assert completion.token_ids == ref_completion.token_ids
        assert rel_diff(acts[Address("logits")], ref_acts[Address("logits")]) <= TOL
        d_sae = saes()[readout[0].sae].d_sae
        dense = [a[readout[0]].to_dense(d_sae) for a in (acts, ref_acts)]
        assert rel_diff(dense[0], dense[1]) <= TOL


def test_a_clamp_equals_the_same_edit_written_by_hand(engines: Any) -> None:
    static, _ = engines
    ids = _ids(static)
    sae = saes()[TOPK]
    x = static.capture(ids, ["resid_post.1"])[Address("resid_post", 1)]
    feature = int(read_features(sae, x, Features(TOPK, 1)).ids[-1, 0])
    positions = [0, 2, len(ids) - 1]
    current = sae.encode(x)[positions, feature]
    delta = (5.0 - current)[:, None] * sae.feature_direction(feature)[None, :]
    clamp = SteeringSpec([FeatureWrite(TOPK, feature, "clamp", 5.0, positions=positions)])
    by_hand = SteeringSpec([Write("resid_post.1", delta, op="add", positions=positions)])
    got = static.capture(ids, ["resid_post.1", "resid_post.2", "logits"], steering_spec=clamp)
    expected = static.capture(ids, ["resid_post.1", "resid_post.2", "logits"], steering_spec=by_hand)
    for point in got:
        assert rel_diff(got[point], expected[point]) <= TOL, point


def test_unclamped_tokens_and_requests_are_untouched(engines: Any) -> None:
    static, _ = engines
    model = static.model
    ids = _ids(static)
    points = ["resid_post.1", "resid_post.2"]
    plain = static.capture(ids, points)
    last = SteeringSpec([FeatureWrite(TOPK, 3, "clamp", 4.0, positions=[-1])])
    steered = static.capture(ids, points, steering_spec=last)
    for point in plain:  # rows before the clamped one: bit for bit
        assert torch.equal(steered[point][:-1], plain[point][:-1])
        assert not torch.equal(steered[point][-1], plain[point][-1])
    # concurrent requests mixing clamps, readouts and neither each equal their solo run
    prompts = [ids, _ids(static, "A cat sat on the mat"), LONG[:40], _ids(static, "Once upon a time there was")]
    specs = [None, *_clamp_specs(static)[:3]]
    readable = [Features(TOPK, 16), Features(RELU, ids=[3, 17, 150]), Features(PROBE, 3)]
    jobs = [(p, s, r) for p in prompts for s in specs for r in ([], _unclamped(s, readable))]

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(p, ["resid_post.2", *r], steering_spec=s) for p, s, r in jobs))

    batched = static.run(together)
    for (p, s, r), result in zip(jobs, batched, strict=True):
        alone = static.capture(p, ["resid_post.2", *r], steering_spec=s)
        assert rel_diff(result[Address("resid_post", 2)], alone[Address("resid_post", 2)]) <= TOL
        for spec in r:
            d_sae = saes()[spec.sae].d_sae
            assert rel_diff(result[spec].to_dense(d_sae), alone[spec].to_dense(d_sae)) <= TOL
    (stats,) = static.run(model.worker_stats)
    assert stats["live_requests"] == 0 and stats["held_slots"] == 0
    assert stats["static_saes"] == 4 + 4  # and the transcoders test_vllm_static_circuits clamps


def test_requests_never_recompile(engines: Any) -> None:
    static, _ = engines
    model = static.model
    (before,) = static.run(model.worker_stats)
    specs = _clamp_specs(static)
    for i in range(8):
        ids = _ids(static) if i % 2 else LONG[: 20 + 10 * i]
        spec = specs[i % 3]
        static.capture(ids, ["resid_post.2", *_unclamped(spec, [READOUTS[i % len(READOUTS)]])], steering_spec=spec)
    (after,) = static.run(model.worker_stats)
    counters = [k for k in before if k.startswith(("vllm_", "dynamo_unique", "dynamo_compiled"))]
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}


def test_what_the_compiled_graph_cannot_serve_is_a_clear_error(engines: Any) -> None:
    static, _ = engines
    ids = _ids(static)
    with pytest.raises(StaticConfigError, match="already built"):
        static.attach_sae(f"{PREFIX}-late", saes()[TOPK])
    with pytest.raises(StaticConfigError, match="compiled into"):
        static.detach_sae(TOPK)
    with pytest.raises(UnknownSae):
        static.capture(ids, [Features(f"{PREFIX}-late", 4)])
    with pytest.raises(InvalidFeatures, match="static_sae_dense_max"):
        static.capture(ids, [Features(TOPK, ids=[1, 2])])  # 512 features: only its top k are kept
    with pytest.raises(InvalidFeatures, match="static_sae_top_k"):
        static.capture(ids, [Features(JUMP, 32)])  # neither complete nor dense
    with pytest.raises(InvalidSteering, match="reads"):
        static.capture(ids, [Features(TOPK, 4)], steering_spec=SteeringSpec([FeatureWrite(TOPK, 1, "ablate")]))
    overlapping = SteeringSpec([FeatureWrite(TOPK, 1, "ablate"), FeatureWrite(TOPK, 2, "clamp", 1.0, positions=[0])])
    with pytest.raises(InvalidSteering, match="same position"):
        static.capture(ids, ["logits"], steering_spec=overlapping)
    clamp_first = SteeringSpec([FeatureWrite(TOPK, 1, "ablate"), Write("resid_post.1", torch.ones(128))])
    with pytest.raises(InvalidSteering, match="comes after"):
        static.capture(ids, ["logits"], steering_spec=clamp_first)
    with pytest.raises(UndeclaredAddress, match="not a write point"):  # an "add" is a plain write
        static.capture(ids, ["logits"], steering_spec=SteeringSpec([FeatureWrite(RELU, 1, "add", 2.0)]))
    assert static.capture(ids, [Features(TOPK, 4)])[Features(TOPK, 4)].values.shape == (len(ids), 4)


def test_attach_checks_before_the_build() -> None:
    model = load_model(vllm_model_path("llama"), backend="vllm-static", static_points=["resid_post.1"])
    d = model.info.d_model
    final = Sae(
        "standard", torch.randn(d, 8), torch.zeros(8), torch.randn(8, d), torch.zeros(d), "ln_final.hook_normalized"
    )
    with pytest.raises(InvalidFeatures, match="after the compiled graph"):
        model.attach_sae("final", final)
    model.attach_sae("res", saes()[TOPK])
    args = model._engine_args()["additional_config"]
    config = next(iter(args.values()))
    assert list(config["saes"]) == ["res"] and config["sae_top_k"] == 64
    folder = model._sae_folder
    assert folder is not None
    model.close()
    assert not pathlib.Path(folder).exists()  # the saved SAEs go with the model
