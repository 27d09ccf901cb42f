"""SAE readouts and feature steering on the dynamic vllm backend.

Readouts are computed in vLLM's worker (rank 0) from the rows each step produces and only the
readout leaves it; the oracle is :func:`~interp_engine.sae._readouts.read_features` on the host,
applied to the activations the very same request captured, and the eager backend on the same
checkpoint. Feature writes are checked against the same edit written by hand as a plain
:class:`Write`. The SAEs are random (standard, JumpReLU, TopK, a hook_z one at ``attn_z``),
scaled to the model's activations so that about half the features fire; they are attached under
names unique to them (``support.readouts``; the engines are the session's shared ones).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    BackendError,
    FeatureReadout,
    Features,
    FeatureWrite,
    InvalidFeatures,
    Probe,
    SamplingOptions,
    SteeringSpec,
    UnknownSae,
    Write,
    run_with_cache,
)
from interp_engine.addresses._address import as_address
from interp_engine.sae._readouts import read_features
from interp_testkit.suite import LONG, PROMPT, rel_diff

from ..support.engines import assert_no_leaks
from ..support.readouts import (
    ATTN,
    D_SAE,
    HOOK_Z,
    MLP,
    PREFIX,
    RES,
    SAME,
    TOL,
    assert_close_readout,
    assert_same_readout,
    busiest_feature,
    eager_twin,
    make_sae,
    readouts_for,
    saes_for,
)

F16 = 2e-3  # float16 values on the wire (relative)


# -- SAEs ------------------------------------------------------------------------------------


# -- comparisons -------------------------------------------------------------------------------


def fired(readout: FeatureReadout) -> int:
    assert readout.ids is not None
    return int((readout.ids >= 0).sum())


# -- 1. readouts equal the host's read of the captured activations, and eager ---------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_readouts_equal_host_reads_and_eager(family: str, attached: Any) -> None:
    facade = attached(family)
    eager = eager_twin(family)
    saes = saes_for(family)
    prompts = [facade.to_tokens(PROMPT)[0].tolist()] + ([LONG] if family == "llama" else [])
    specs = [spec for name in saes for spec in readouts_for(name)]
    addresses = [sae.address for sae in saes.values()]
    for ids in prompts:
        acts = facade.capture(ids, [*addresses, *specs])
        theirs = eager.capture(ids, specs)
        for spec in specs:
            sae = saes[spec.sae]
            x = acts[sae.address]
            assert x.shape[0] == len(ids)
            host = read_features(sae, x.reshape(len(ids), -1), spec)
            got = acts[spec]
            assert isinstance(got, FeatureReadout) and got.values.shape[0] == len(ids), spec
            if spec.dtype == "float16":  # values rounded to float16 in the worker; ids and norms exact
                assert torch.equal(got.values, got.values.half().float()), f"{spec}: not sent as float16"
                assert rel_diff(got.values, host.values) <= F16, spec
                assert_same_readout(got, FeatureReadout(got.values, host.ids, host.error_norm), what=str(spec))
            else:
                assert_same_readout(got, host, what=str(spec))
            assert_close_readout(got, theirs[spec], tol=TOL if spec.dtype == "float32" else F16, what=f"eager {spec}")
            if spec.top_k is not None:
                assert fired(got) > len(ids), f"{spec}: too few features fire to test anything"
    # asked for by its string form, and through a Cache (batched, right-padded)
    text = f"features:{RES}:top8"
    cache = run_with_cache(facade, [PROMPT, "Hello"], ["resid_post.1", text])
    first = facade.capture(prompts[0], [text])[Features(RES, 8)]
    assert_same_readout(cache[text][0][: len(prompts[0])], first)
    short = len(facade.to_tokens("Hello")[0])
    assert (cache[text].ids[1, short:] == -1).all() and not cache[text].values[1, short:].any()


SITE_HOOKS = {
    "resid_pre": "blocks.0.hook_resid_pre",
    "resid_mid": "blocks.1.hook_resid_mid",
    "attn_in": "blocks.1.ln1.hook_normalized",
    "attn_v": "blocks.2.attn.hook_v",
    "mlp_in": "blocks.2.ln2.hook_normalized",
    "mlp_post": "blocks.1.mlp.hook_post",
    "final_norm": "ln_final.hook_normalized",
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_readouts_and_clamps_at_other_sites(family: str, attached: Any) -> None:
    """An SAE at each other kind of site (a head site with hook_z, the final norm's output):
    its readouts equal the host's read of the captured activations, and a clamp equals the same
    edit written by hand and the eager backend's."""
    facade = attached(family)
    eager = eager_twin(family)
    ids = facade.to_tokens(PROMPT)[0].tolist()
    n = len(ids)
    logits = Address("logits")
    plain = facade.capture(ids, [logits])[logits]
    names = []
    try:
        for seed, (kind, hook) in enumerate(SITE_HOOKS.items()):
            address = as_address(hook)
            sample = facade.capture(ids, [address])[address]
            extra = {"reshape_activations": "hook_z"} if address.info.per_head else {}
            sae = make_sae("standard", hook, sample, seed=40 + seed, **extra)
            name = f"{PREFIX}-site-{kind}"
            for model in (facade, eager):
                model.attach_sae(name, sae)
            names.append(name)
            specs = [Features(name, 8), Features(name, dense=True)]
            acts = facade.capture(ids, [address, *specs])
            for spec in specs:
                assert_same_readout(acts[spec], read_features(sae, acts[address].reshape(n, -1), spec), what=kind)
            feature = int((acts[specs[1]].values > 0).sum(0).argmax())
            f = sae.encode(acts[address].reshape(n, -1))[:, feature]
            vector = (4.0 - f)[:, None] * sae.feature_direction(feature)
            if address.info.per_head:
                vector = vector.reshape(n, sample.shape[1], -1)
            clamp = SteeringSpec([FeatureWrite(name, feature, "clamp", 4.0)])
            by_feature = facade.capture(ids, [logits, address, specs[1]], steering_spec=clamp)
            by_hand = facade.capture(ids, [logits], steering_spec=SteeringSpec([Write(address, vector)]))[logits]
            on_eager = eager.capture(ids, [logits, address, specs[1]], steering_spec=clamp)
            assert rel_diff(by_feature[logits], by_hand) <= TOL, kind
            assert rel_diff(by_feature[logits], on_eager[logits]) <= TOL, kind
            assert rel_diff(by_feature[address], on_eager[address]) <= TOL, kind
            assert_close_readout(by_feature[specs[1]], on_eager[specs[1]], what=f"clamped {kind}")
            assert rel_diff(by_feature[logits], plain) > 1e-3, f"the clamp at {kind} changed nothing"
    finally:
        for name in names:
            for model in (facade, eager):
                if name in model.saes:
                    model.detach_sae(name)


def test_plain_writes_at_the_final_norm_steer_generation(attached: Any) -> None:
    facade = attached("gpt2")
    eager = eager_twin("gpt2")
    ids = facade.to_tokens(PROMPT)[0].tolist()
    vector = torch.randn(facade.info.d_model, generator=torch.Generator().manual_seed(5)) * 3
    spec = SteeringSpec([Write("final_norm", vector, positions="generated")])
    points = ["final_norm", "resid_post.2"]
    completion, acts = facade.capture_generation(ids, points, max_tokens=5, steering_spec=spec, ignore_eos=True)
    eager_completion, eager_acts = eager.capture_generation(
        ids, points, max_tokens=5, steering_spec=spec, ignore_eos=True
    )
    assert completion.token_ids == eager_completion.token_ids
    plain = facade.generate(ids, max_tokens=5, ignore_eos=True)
    assert completion.token_ids != plain.token_ids, "the write did not steer"
    for point in (Address("final_norm"), Address("resid_post", 2)):
        assert rel_diff(acts[point], eager_acts[point]) <= TOL, point
    streamed = [s.token_id for s in facade.stream(ids, max_tokens=5, steering_spec=spec, ignore_eos=True)]
    assert streamed == completion.token_ids


def test_probes_and_transcoders(attached: Any) -> None:
    """A probe reads projections (no error norm, no writes); a transcoder reads one address and
    its ``add`` writes at its output address; its clamp reads the feature at the input address and
    writes the change at the output address."""
    facade = attached("gpt2")
    eager = eager_twin("gpt2")
    ids = facade.to_tokens(PROMPT)[0].tolist()
    d_model = facade.info.d_model
    gen = torch.Generator().manual_seed(50)
    probe = Probe(
        torch.randn(3, d_model, generator=gen) / 8,
        torch.randn(3, generator=gen),
        activation="sigmoid",
        address="resid_post.1",
    )
    mlp_in = as_address("blocks.0.ln2.hook_normalized")
    sample = facade.capture(ids, [mlp_in])[mlp_in]
    transcoder = make_sae(
        "transcoder", "blocks.0.ln2.hook_normalized", sample, seed=51, hook_name_out="blocks.0.hook_mlp_out"
    )
    names = {f"{PREFIX}-probe": probe, f"{PREFIX}-tc": transcoder}
    try:
        for name, sae in names.items():
            for model in (facade, eager):
                model.attach_sae(name, sae)
        specs = [Features(f"{PREFIX}-probe", dense=True), Features(f"{PREFIX}-tc", 8)]
        acts = facade.capture(ids, [Address("resid_post", 1), mlp_in, *specs])
        theirs = eager.capture(ids, specs)
        for spec, address in zip(specs, [Address("resid_post", 1), mlp_in], strict=True):
            got = acts[spec]
            assert got.error_norm is None, spec
            assert_same_readout(got, read_features(names[spec.sae], acts[address], spec), what=str(spec))
            assert_close_readout(got, theirs[spec], what=f"eager {spec}")
        add = SteeringSpec([FeatureWrite(f"{PREFIX}-tc", 3, "add", 2.0)])
        by_hand = SteeringSpec([Write("mlp_out.0", 2.0 * transcoder.feature_direction(3))])
        got = facade.capture(ids, ["logits"], steering_spec=add)[Address("logits")]
        assert rel_diff(got, facade.capture(ids, ["logits"], steering_spec=by_hand)[Address("logits")]) <= TOL
        assert rel_diff(got, eager.capture(ids, ["logits"], steering_spec=add)[Address("logits")]) <= TOL
        clamp = SteeringSpec([FeatureWrite(f"{PREFIX}-tc", 3, "clamp", 1.0)])
        change = (1.0 - transcoder.encode(sample)[:, 3:4]) * transcoder.feature_direction(3)
        by_hand = SteeringSpec([Write("mlp_out.0", change, positions=list(range(len(ids))))])
        got = facade.capture(ids, ["logits"], steering_spec=clamp)[Address("logits")]
        assert rel_diff(got, facade.capture(ids, ["logits"], steering_spec=by_hand)[Address("logits")]) <= TOL
        assert rel_diff(got, eager.capture(ids, ["logits"], steering_spec=clamp)[Address("logits")]) <= TOL
        with pytest.raises(InvalidFeatures, match="probe"):
            facade.capture(
                ids, ["logits"], steering_spec=SteeringSpec([FeatureWrite(f"{PREFIX}-probe", 0, "add", 1.0)])
            )
        steps = list(facade.stream(ids, max_tokens=3, features=specs, ignore_eos=True))
        completion, gen_acts = facade.capture_generation(ids, specs, max_tokens=3, ignore_eos=True)
        assert [s.token_id for s in steps] == completion.token_ids
        for step in steps:
            for spec in specs:
                assert_same_readout(step.features[spec], gen_acts[spec][step.position], what=str(spec))
    finally:
        for name in names:
            for model in (facade, eager):
                if name in model.saes:
                    model.detach_sae(name)


# -- 2. tensor parallelism: tests/vllm/test_vllm_tp_sae.py (on the TP=1/TP=2 llama pair)


# -- 3. streaming readouts ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stream_readouts_equal_capture_generation(family: str, attached: Any) -> None:
    facade = attached(family)
    ids = facade.to_tokens(PROMPT)[0].tolist() if family == "gpt2" else LONG
    n = len(ids)
    specs = [Features(RES, 8), Features(MLP, dense=True), Features(ATTN, ids=[1, 2, 3], dtype="float16")]
    steps = list(facade.stream(ids, max_tokens=6, features=specs, n_logprobs=2, ignore_eos=True))
    completion, acts = facade.capture_generation(ids, specs, max_tokens=6, ignore_eos=True)
    assert [s.token_id for s in steps] == completion.token_ids and len(steps) == 6
    assert [s.position for s in steps] == list(range(n - 1, n + 5))
    for step in steps:
        assert set(step.features) == set(specs)
        for spec in specs:
            expected = acts[spec][step.position]
            assert_same_readout(step.features[spec], expected, tol=SAME, what=f"{spec} at {step.position}")
    # and the same stream with a steering spec next to its readouts
    spec = SteeringSpec([FeatureWrite(RES, 2, "clamp", 4.0, positions="generated")])
    steered = list(facade.stream(ids, max_tokens=4, features=specs[:1], steering_spec=spec, ignore_eos=True))
    completion, acts = facade.capture_generation(ids, specs[:1], max_tokens=4, steering_spec=spec, ignore_eos=True)
    assert [s.token_id for s in steered] == completion.token_ids
    for step in steered:
        assert_same_readout(step.features[specs[0]], acts[specs[0]][step.position], tol=SAME)


# -- 4. feature steering equals the same edit written by hand ---------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_feature_writes_equal_hand_written_writes(family: str, attached: Any) -> None:
    facade = attached(family)
    eager = eager_twin(family)
    saes = saes_for(family)
    ids = facade.to_tokens(PROMPT)[0].tolist()
    n = len(ids)
    points = [Address("resid_post", 2), Address("logits")]
    for name in (RES, MLP, HOOK_Z):
        sae = saes[name]
        address = sae.address
        clean = facade.capture(ids, [address])[address].reshape(n, -1)
        f = sae.encode(clean)
        feature = busiest_feature(facade, ids, name)
        direction = sae.feature_direction(feature)
        positions = [1, 3, n - 2]
        cases = [
            (
                FeatureWrite(name, feature, "clamp", 5.0, positions=positions),
                (5.0 - f[positions, feature])[:, None] * direction,
                positions,
            ),
            (FeatureWrite(name, feature, "ablate"), -f[:, feature][:, None] * direction, "all"),
            (FeatureWrite(name, feature, "add", 3.0, positions="prompt"), 3.0 * direction, "prompt"),
        ]
        for write, vector, where in cases:
            by_feature = facade.capture(ids, points, steering_spec=SteeringSpec([write]))
            if address.info.per_head:  # a hook_z SAE: the vector is the heads concatenated
                vector = vector.reshape(*vector.shape[:-1], facade.info.n_heads, -1)
            by_hand = facade.capture(
                ids, points, steering_spec=SteeringSpec([Write(address, vector, "add", positions=where)])
            )
            on_eager = eager.capture(ids, points, steering_spec=SteeringSpec([write]))
            for point in points:
                assert rel_diff(by_feature[point], by_hand[point]) <= TOL, (name, write, point)
                assert rel_diff(by_feature[point], on_eager[point]) <= TOL, (name, write, point, "eager")
            plain = facade.capture(ids, [Address("logits")])[Address("logits")]
            assert rel_diff(by_feature[Address("logits")], plain) > 1e-3, f"{write} changed nothing"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_feature_clamp_under_generation_equals_eager(family: str, attached: Any) -> None:
    facade = attached(family)
    eager = eager_twin(family)
    ids = facade.to_tokens(PROMPT)[0].tolist()
    feature = busiest_feature(facade, ids, RES)
    spec = SteeringSpec(
        [FeatureWrite(RES, feature, "clamp", 8.0, positions="generated"), FeatureWrite(ATTN, 5, "add", 2.0)]
    )
    points = [Address("resid_post", 2), Features(RES, 8), Features(ATTN, dense=True)]
    completion, acts = facade.capture_generation(ids, points, max_tokens=6, steering_spec=spec, ignore_eos=True)
    eager_completion, eager_acts = eager.capture_generation(
        ids, points, max_tokens=6, steering_spec=spec, ignore_eos=True
    )
    plain = facade.generate(ids, max_tokens=6, ignore_eos=True)
    assert completion.token_ids == eager_completion.token_ids
    assert completion.token_ids != plain.token_ids or family == "llama", "the clamp did not steer"
    assert rel_diff(acts[points[0]], eager_acts[points[0]]) <= TOL
    for readout in points[1:]:
        assert acts[readout].values.shape[0] == eager_acts[readout].values.shape[0] == len(ids) + 6
        assert_close_readout(acts[readout], eager_acts[readout], what=f"{readout} under generation")


# -- 5. isolation under batching ------------------------------------------------------------------
def test_concurrent_readouts_and_clamps_equal_their_solo_runs(attached: Any) -> None:
    facade = attached("gpt2")
    model = facade.model
    prompts = [facade.to_tokens(p)[0].tolist() for p in (PROMPT, "Hello there", "A cat sat on the mat")]
    clamp = SteeringSpec([FeatureWrite(RES, 7, "clamp", 5.0)])
    ablate = SteeringSpec([FeatureWrite(MLP, 2, "ablate", positions=[0, 1, 2]), FeatureWrite(ATTN, 1, "add", 3.0)])
    z_clamp = SteeringSpec([FeatureWrite(HOOK_Z, 4, "clamp", 2.0, positions="generated")])
    read = [Features(RES, 8), Features(MLP, dense=True), Features(HOOK_Z, ids=[1, 9])]
    kinds: list[tuple[str, list[Any], SteeringSpec | None]] = [
        ("capture", [*read, Address("logits")], None),
        ("capture", [Address("logits"), Features(RES, 4)], clamp),
        ("capture", [Address("resid_post", 2)], None),
        ("capture", [Address("logits"), *read[1:]], ablate),
        ("generation", [Features(ATTN, 8), Address("resid_post", 1)], z_clamp),
        ("generation", [Features(RES, 8, dtype="float16")], clamp),
    ]
    jobs = [(kind, ids, points, spec) for ids in prompts for kind, points, spec in kinds][:16]
    assert len(jobs) == 16

    def call(kind: str, ids: list[int], points: list[Any], spec: SteeringSpec | None) -> Any:
        if kind == "capture":
            return model.capture(ids, points, steering_spec=spec)
        return model.capture_generation(ids, points, max_tokens=4, steering_spec=spec, ignore_eos=True)

    async def together() -> list[Any]:
        return await asyncio.gather(*(call(*job) for job in jobs))

    batched = facade.run(together)
    for (kind, ids, points, spec), result in zip(jobs, batched, strict=True):
        alone = facade.run(lambda kind=kind, ids=ids, points=points, spec=spec: call(kind, ids, points, spec))
        if kind == "generation":
            assert result[0].token_ids == alone[0].token_ids
            result, alone = result[1], alone[1]
        for point in points:
            if isinstance(point, Features):
                assert_close_readout(result[point], alone[point], what=f"batched {point} {spec}")
            else:
                assert rel_diff(result[point], alone[point]) <= TOL, (point, spec)
    logits = Address("logits")
    assert rel_diff(batched[1][logits], batched[0][logits]) > 1e-3, "the clamp did nothing in the batch"
    assert_no_leaks(facade)


# -- 6. bad input, and no leaked state ------------------------------------------------------
def test_bad_requests_are_refused_and_the_engine_serves_on(attached: Any) -> None:
    facade = attached("gpt2")
    ids = facade.to_tokens(PROMPT)[0].tolist()
    with pytest.raises(UnknownSae):
        facade.capture(ids, [Features(f"{PREFIX}-missing", 4)])
    with pytest.raises(UnknownSae):
        facade.capture(ids, ["resid_post.0"], steering_spec=SteeringSpec([FeatureWrite(f"{PREFIX}-missing", 0)]))
    with pytest.raises(UnknownSae):
        list(facade.stream(ids, max_tokens=2, features=[f"features:{PREFIX}-missing"]))
    with pytest.raises(InvalidFeatures, match="out of range"):
        facade.capture(ids, [Features(RES, ids=[3, D_SAE])])
    with pytest.raises(InvalidFeatures, match="out of range"):
        facade.capture(ids, ["logits"], steering_spec=SteeringSpec([FeatureWrite(RES, D_SAE, "clamp", 1.0)]))
    with pytest.raises(InvalidFeatures, match="out of range"):
        list(facade.stream(ids, max_tokens=2, features=[Features(MLP, ids=[D_SAE + 5])]))
    wrong = make_sae("standard", "blocks.0.hook_mlp_out", torch.randn(4, facade.info.d_model + 1), seed=3)
    with pytest.raises(InvalidFeatures, match="width"):
        facade.attach_sae(f"{PREFIX}-wrong", wrong)
    assert f"{PREFIX}-wrong" not in facade.saes
    wrong_z = make_sae("standard", "blocks.0.attn.hook_z", torch.randn(4, facade.info.d_model // 2), seed=3)
    with pytest.raises(InvalidFeatures):
        facade.attach_sae(f"{PREFIX}-wrong", wrong_z)
    # the engine serves on, with readouts
    acts = facade.capture(ids, [Address("resid_post", 1), Features(RES, 8)])
    sae = saes_for("gpt2")[RES]
    assert_same_readout(acts[Features(RES, 8)], read_features(sae, acts[Address("resid_post", 1)], Features(RES, 8)))
    assert_no_leaks(facade)


def test_streams_with_readouts_leave_nothing_behind(attached: Any) -> None:
    facade = attached("gpt2")
    ids = facade.to_tokens(PROMPT)[0].tolist()
    specs = [Features(RES, 8), Features(MLP, dense=True)]
    spec = SteeringSpec([FeatureWrite(RES, 1, "clamp", 3.0)])
    full = list(facade.stream(ids, max_tokens=20, features=specs, steering_spec=spec, ignore_eos=True))
    assert len(full) == 20 and all(set(s.features) == set(specs) for s in full)
    taken = []
    for step in facade.stream(ids, max_tokens=50, features=specs, steering_spec=spec, ignore_eos=True):
        taken.append(step)
        if len(taken) == 3:
            break  # the caller stops early: the request is aborted and its readouts dropped
    assert [s.token_id for s in taken] == [s.token_id for s in full[:3]]
    for a, b in zip(taken, full, strict=False):
        for s in specs:
            assert_same_readout(a.features[s], b.features[s], tol=TOL)
    facade.capture_generation(ids, specs, max_tokens=3, ignore_eos=True)
    facade.capture(ids, specs)
    assert_no_leaks(facade)
    # a cancelled stream in flight, from the async side
    model = facade.model

    async def cancel_midway() -> None:
        async def consume() -> None:
            async for _ in model.stream(ids, max_tokens=200, features=specs, ignore_eos=True):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    facade.run(cancel_midway)
    assert_no_leaks(facade)
    assert facade.generate(ids, max_tokens=2).token_ids


# -- 7. detach and re-attach -----------------------------------------------------------------------
def test_reattaching_a_name_serves_the_new_sae(attached: Any) -> None:
    facade = attached("gpt2")
    ids = facade.to_tokens(PROMPT)[0].tolist()
    name = f"{PREFIX}-swap"
    sample = facade.capture(ids, ["resid_post.0"])[Address("resid_post", 0)]
    first = make_sae("standard", "blocks.0.hook_resid_post", sample, seed=21)
    second = make_sae("jumprelu", "blocks.0.hook_resid_post", sample, seed=22)
    third = make_sae(
        "topk", "blocks.1.hook_resid_post", facade.capture(ids, ["resid_post.1"])[Address("resid_post", 1)], seed=23
    )
    spec = Features(name, dense=True)
    points = [Address("resid_post", 0), Address("resid_post", 1), spec]
    held = [s["saes"] for s in facade.worker_stats()]
    try:
        for sae in (first, second, third, first, third.to(dtype=torch.bfloat16)):
            if name in facade.saes:
                facade.detach_sae(name)
            facade.attach_sae(name, sae)
            acts = facade.capture(ids, points)
            assert_same_readout(acts[spec], read_features(sae, acts[sae.address], spec), what=repr(sae))
            write = SteeringSpec([FeatureWrite(name, 0, "add", 2.0)])
            steered = facade.capture(ids, [sae.address], steering_spec=write)[sae.address]
            by_hand = facade.capture(
                ids, [sae.address], steering_spec=SteeringSpec([Write(sae.address, 2.0 * sae.feature_direction(0))])
            )[sae.address]
            assert rel_diff(steered, by_hand) <= TOL
            clamp = SteeringSpec([FeatureWrite(name, 0, "clamp", 3.0)])
            got = facade.capture(ids, [Address("logits")], steering_spec=clamp)[Address("logits")]
            clean = facade.capture(ids, [sae.address])[sae.address]
            hand = Write(sae.address, (3.0 - sae.encode(clean)[:, 0])[:, None] * sae.feature_direction(0))
            want = facade.capture(ids, [Address("logits")], steering_spec=SteeringSpec([hand]))[Address("logits")]
            assert rel_diff(got, want) <= TOL, repr(sae)
        # a detached name is unknown again, and the workers let go of every copy sent
        facade.detach_sae(name)
        with pytest.raises(UnknownSae):
            facade.capture(ids, [spec])
        facade.capture(ids, [Features(RES, 4)])
        assert [s["saes"] for s in facade.worker_stats()] == held
    finally:
        if name in facade.saes:
            facade.detach_sae(name)


def test_requests_queued_across_a_reattach_keep_the_sae_they_were_checked_with(attached: Any) -> None:
    """Requests waiting in vLLM's queue when their SAE's name is re-attached are still served
    with the SAE they were checked against (the llama engine prefills 64 tokens a step, so most
    of these long prompts wait for many steps)."""
    facade = attached("llama")
    model = facade.model
    engine = model._engine
    name = f"{PREFIX}-race"
    sample = facade.capture(LONG, ["resid_post.0"])[Address("resid_post", 0)]
    old = make_sae("standard", "blocks.0.hook_resid_post", sample, seed=31)
    new = make_sae("standard", "blocks.0.hook_resid_post", sample, seed=32)
    spec = Features(name, dense=True)
    prompts = [[(t + i) % 512 for t in LONG] for i in range(24)]

    async def race() -> tuple[list[Any], Any]:
        model.attach_sae(name, old)
        before = engine.get_num_unfinished_requests()
        tasks = [asyncio.ensure_future(model.capture(ids, ["resid_post.0", spec])) for ids in prompts]
        while engine.get_num_unfinished_requests() < before + len(prompts):
            await asyncio.sleep(0.005)
        model.detach_sae(name)
        model.attach_sae(name, new)
        swapped = await model.capture(LONG, ["resid_post.0", spec])
        return list(await asyncio.gather(*tasks)), swapped

    try:
        queued, swapped = facade.run(race)
    finally:
        if name in facade.saes:
            facade.detach_sae(name)
    address = Address("resid_post", 0)
    for acts in queued:
        assert_same_readout(acts[spec], read_features(old, acts[address], spec), tol=SAME)
    assert_same_readout(swapped[spec], read_features(new, swapped[address], spec), tol=SAME)


def test_a_payload_naming_an_sae_the_workers_do_not_hold_fails_alone(attached: Any) -> None:
    """A request whose taps cannot be set up in the worker (here: an SAE it never received) fails
    at its fetch; the engine and the requests next to it go on."""
    from interp_vllm._wire import RequestPayload

    facade = attached("gpt2")
    model = facade.model
    engine = model._engine
    ids = facade.to_tokens(PROMPT)[0].tolist()
    rid = f"interp-{PREFIX}-ghost"
    ghost = Features(f"{PREFIX}-ghost", 4)
    payload = RequestPayload(
        rid, (Address("resid_post", 0),), (), len(ids), len(ids), readouts=(ghost,), issuer=model._issuer
    )

    async def send() -> Any:
        params = model._sampling(1, SamplingOptions(), extra_args=payload.extra_args())
        async for _ in model._outputs(engine, ids, params, rid, rid):
            pass
        return await model._fetch(engine, rid, [Address("resid_post", 0)], len(ids), [ghost])

    neighbour = asyncio.run_coroutine_threadsafe(model.capture(ids, [Features(RES, 8)]), facade._loop)
    with pytest.raises(BackendError, match="ghost"):
        facade.run(send)
    assert neighbour.result(timeout=60)[Features(RES, 8)].values.shape == (len(ids), 8)
    assert facade.capture(ids, [Features(RES, 8)])[Features(RES, 8)].values.shape == (len(ids), 8)
    assert_no_leaks(facade)
