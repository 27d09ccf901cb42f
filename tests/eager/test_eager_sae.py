"""SAEs on the eager backend: readouts next to points in every capture path, feature steering,
transcoders and probes, and the typed errors (the model keeps serving after each)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    FeatureWrite,
    InvalidFeatures,
    KindNotInFamily,
    Probe,
    Sae,
    SteeringSpec,
    UnknownSae,
    UnsupportedSae,
    Write,
    capture_generation,
    generate_stream,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_engine.sae._readouts import read_features

PROMPT = "The capital of France is"


def random_sae(
    architecture: str, d_in: int, d_sae: int, hook: str, *, seed: int = 0, d_out: int | None = None, **extra: Any
) -> Sae:
    g = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    kwargs: dict[str, Any] = dict(extra)
    if "jumprelu" in architecture:
        kwargs["threshold"] = torch.rand(d_sae, generator=g) * 0.5
    if architecture == "topk":
        kwargs.setdefault("k", 12)
    return Sae(
        architecture,
        torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        torch.randn(d_sae, generator=g) * 0.1,
        torch.randn(d_sae, d_out, generator=g) / d_sae**0.5,
        torch.randn(d_out, generator=g) * 0.1,
        hook,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tiny() -> Any:
    model = load_model("interp:tiny", backend="eager")
    d = model.info.d_model
    model.attach_sae("std", random_sae("standard", d, 256, "blocks.1.hook_resid_post", seed=1))
    model.attach_sae("jump", random_sae("jumprelu", d, 256, "blocks.2.hook_mlp_out", seed=2))
    model.attach_sae("topk", random_sae("topk", d, 512, "blocks.2.hook_resid_post", seed=3))
    model.attach_sae("post", random_sae("standard", model.info.d_mlp, 256, "blocks.0.mlp.hook_post", seed=4))
    facade = sync_model(model)
    yield facade
    facade.shutdown()


def ids_of(facade: Any, text: str = PROMPT) -> list[int]:
    return list(facade.to_tokens(text)[0].tolist())


@pytest.mark.parametrize("name", ["std", "jump", "topk", "post"])
@pytest.mark.parametrize("spec", ["top8", "ids=0,5,77", "dense"])
def test_readouts_equal_encoding_the_captured_activations(tiny: Any, name: str, spec: str) -> None:
    sae = tiny.model.saes[name]
    readout = Features.parse(f"features:{name}:{spec}")
    acts = tiny.capture(ids_of(tiny), [sae.address, readout])
    host = read_features(sae, acts[sae.address], readout)
    got = acts[readout]
    assert got.values.shape == (len(ids_of(tiny)), readout.width(sae.d_sae))
    torch.testing.assert_close(got.to_dense(sae.d_sae), host.to_dense(sae.d_sae), atol=1e-5, rtol=1e-5)
    recon = sae.reconstruct(acts[sae.address])
    torch.testing.assert_close(got.error_norm, (acts[sae.address] - recon).norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_topk_readout_reports_features_that_fire(tiny: Any) -> None:
    sae = tiny.model.saes["topk"]
    acts = tiny.capture(ids_of(tiny), [Features("topk", 16)])
    readout = acts[Features("topk", 16)]
    fired = (readout.ids >= 0).sum(-1)
    assert bool((fired <= sae.k).all()) and bool((fired > 0).all())  # TopK: at most k features fire
    assert bool((readout.values[readout.ids < 0] == 0).all())


def test_batched_readouts_equal_solo_runs_and_pad(tiny: Any) -> None:
    texts = [PROMPT, "Hi", "One two three four five six seven"]
    cache = run_with_cache(tiny, texts, ["features:std:top5", "resid_post.1"])
    readout = cache["features:std:top5"]
    assert readout.values.shape[:2] == (3, int(cache.lengths.max()))
    for row, text in enumerate(texts):
        solo = tiny.capture(ids_of(tiny, text), [Features("std", 5)])[Features("std", 5)]
        n = int(cache.lengths[row])
        torch.testing.assert_close(readout.to_dense(256)[row, :n], solo.to_dense(256), atol=1e-5, rtol=1e-5)
        assert bool((readout.ids[row, n:] == -1).all()) and bool((readout.error_norm[row, n:] == 0).all())


def test_generation_and_stream_readouts(tiny: Any) -> None:
    ids = ids_of(tiny)
    completion, cache = capture_generation(tiny, ids, ["features:topk:top6"], max_tokens=5)
    readout = cache["features:topk:top6"]
    full = ids + completion.token_ids
    assert readout.values.shape == (1, len(full), 6)
    forced = tiny.capture(full, [Features("topk", 6)])[Features("topk", 6)]
    torch.testing.assert_close(readout.to_dense(512)[0], forced.to_dense(512), atol=1e-5, rtol=1e-5)
    steps = list(generate_stream(tiny, ids, max_tokens=5, features=[Features("topk", 6)]))
    assert [s.token_id for s in steps] == completion.token_ids
    assert [s.position for s in steps] == list(range(len(ids) - 1, len(ids) + 4))
    for step in steps:
        torch.testing.assert_close(
            step.features[Features("topk", 6)].to_dense(512), forced.to_dense(512)[step.position], atol=1e-5, rtol=1e-5
        )


def test_clamp_equals_the_same_write_done_by_hand(tiny: Any) -> None:
    sae = tiny.model.saes["std"]
    ids = ids_of(tiny)
    plain = tiny.capture(ids, [sae.address])[sae.address]
    feature = int(sae.encode(plain[-1]).argmax())
    later = Address("resid_post", 3)
    for op, value in (("clamp", 4.0), ("ablate", 0.0)):
        positions = [1, len(ids) - 1]
        by_feature = SteeringSpec([FeatureWrite("std", feature, op, value, positions=positions)])
        current = sae.encode(plain[positions])[:, feature : feature + 1]
        delta = (value - current) * sae.feature_direction(feature)
        by_hand = SteeringSpec([Write(sae.address, delta, "add", positions=positions)])
        a = tiny.capture(ids, [later], steering_spec=by_feature)[later]
        b = tiny.capture(ids, [later], steering_spec=by_hand)[later]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a, tiny.capture(ids, [later])[later])
    added = tiny.capture(ids, [later], steering_spec=SteeringSpec([FeatureWrite("std", feature, "add", 3.0)]))[later]
    direction = SteeringSpec([Write(sae.address, 3.0 * sae.feature_direction(feature), "add")])
    torch.testing.assert_close(added, tiny.capture(ids, [later], steering_spec=direction)[later])


def test_a_clamp_applies_to_generated_tokens(tiny: Any) -> None:
    # a tied SAE with unit decoder rows: encoding x + (v - f_i) d_i gives feature i v where it
    # fired, and v + its (negative) pre-activation where it did not
    d = tiny.info.d_model
    g = torch.Generator().manual_seed(11)
    decoder = torch.nn.functional.normalize(torch.randn(64, d, generator=g), dim=-1)
    tied = Sae("standard", decoder.T.clone(), torch.zeros(64), decoder, torch.zeros(d), "blocks.2.hook_resid_post")
    tiny.model.attach_sae("tied", tied)
    try:
        ids = ids_of(tiny)
        plain, _ = capture_generation(tiny, ids, [], max_tokens=6)
        spec = SteeringSpec([FeatureWrite("tied", 5, "clamp", 40.0, positions="generated")])
        readout = Features("tied", ids=[5])
        steered, cache = capture_generation(tiny, ids, [readout], max_tokens=6, steering_spec=spec)
        assert steered.token_ids[0] == plain.token_ids[0]  # the first token comes from the prompt's forward
        assert steered.token_ids != plain.token_ids
        values = cache[readout].values[0, :, 0]
        assert bool((values[len(ids) :] > 30.0).all()) and bool((values[len(ids) :] < 40.0 + 1e-4).all())
        assert bool((values[: len(ids)] < 10.0).all())  # the prompt is untouched
    finally:
        tiny.model.detach_sae("tied")


def test_transcoder_reads_one_address_and_writes_another(tiny: Any) -> None:
    d = tiny.info.d_model
    tc = random_sae("transcoder", d, 192, "blocks.1.ln2.hook_normalized", seed=5, hook_name_out="blocks.1.hook_mlp_out")
    tiny.model.attach_sae("tc", tc)
    try:
        assert tc.address == Address("mlp_in", 1) and tc.address_out == Address("mlp_out", 1)
        acts = tiny.capture(ids_of(tiny), [tc.address, Features("tc", 4)])
        readout = acts[Features("tc", 4)]
        assert readout.error_norm is None
        torch.testing.assert_close(
            readout.to_dense(192), read_features(tc, acts[tc.address], Features("tc", 4)).to_dense(192)
        )
        out = Address("mlp_out", 1)
        added = tiny.capture(ids_of(tiny), [out], steering_spec=SteeringSpec([FeatureWrite("tc", 2, "add", 1.5)]))[out]
        torch.testing.assert_close(
            added - tiny.capture(ids_of(tiny), [out])[out], (1.5 * tc.feature_direction(2)).expand_as(added)
        )
        # a clamp reads the feature at mlp_in.1 and writes (1 - f) d at mlp_out.1 (tests/circuits has more)
        clamped = tiny.capture(ids_of(tiny), [out], steering_spec=SteeringSpec([FeatureWrite("tc", 2, "clamp", 1.0)]))
        f = tc.encode(acts[tc.address])[:, 2:3]
        torch.testing.assert_close(
            clamped[out] - tiny.capture(ids_of(tiny), [out])[out], (1.0 - f) * tc.feature_direction(2)
        )
    finally:
        tiny.model.detach_sae("tc")


def test_probe_readouts_are_its_projections(tiny: Any) -> None:
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(5, tiny.info.d_model, generator=g), torch.randn(5, generator=g)
    tiny.model.attach_sae("probe", Probe(weight, bias, activation="sigmoid", address="resid_post.2"))
    try:
        acts = tiny.capture(ids_of(tiny), ["resid_post.2", "features:probe:dense"])
        readout = acts[Features("probe", dense=True)]
        assert readout.ids is None and readout.error_norm is None
        expected = torch.sigmoid(acts[Address("resid_post", 2)] @ weight.T + bias)
        torch.testing.assert_close(readout.values, expected, atol=1e-5, rtol=1e-5)
        with pytest.raises(InvalidFeatures, match="probe"):
            tiny.capture(
                ids_of(tiny), ["resid_post.2"], steering_spec=SteeringSpec([FeatureWrite("probe", 0, "add", 1.0)])
            )
    finally:
        tiny.model.detach_sae("probe")


def test_hook_z_sae_reads_the_concatenated_heads(tiny: Any) -> None:
    info = tiny.info
    width = info.n_heads * info.d_head
    tiny.model.attach_sae("z", random_sae("standard", width, 64, "blocks.1.attn.hook_z", seed=6))
    try:
        acts = tiny.capture(ids_of(tiny), ["attn_z.1", Features("z", dense=True)])
        flat = acts[Address("attn_z", 1)].flatten(-2)
        torch.testing.assert_close(
            acts[Features("z", dense=True)].values, tiny.model.saes["z"].encode(flat), atol=1e-5, rtol=1e-5
        )
    finally:
        tiny.model.detach_sae("z")


def test_bad_input_is_a_typed_error_and_the_model_keeps_serving(tiny: Any) -> None:
    ids = ids_of(tiny)
    with pytest.raises(UnknownSae, match="attached: "):
        tiny.capture(ids, ["features:nope:top3"])
    with pytest.raises(InvalidFeatures, match="out of range"):
        tiny.capture(ids, [Features("std", ids=[256])])
    with pytest.raises(InvalidFeatures, match="out of range"):
        tiny.capture(ids, ["resid_post.0"], steering_spec=SteeringSpec([FeatureWrite("std", 10_000, "clamp", 1.0)]))
    with pytest.raises(UnknownSae):
        tiny.capture(ids, ["resid_post.0"], steering_spec=SteeringSpec([FeatureWrite("missing", 1)]))
    with pytest.raises(InvalidFeatures, match="wide"):
        tiny.model.attach_sae("wrong", random_sae("standard", 64, 32, "blocks.0.hook_resid_post"))
    with pytest.raises(InvalidFeatures, match="already attached"):
        tiny.model.attach_sae("std", tiny.model.saes["std"])
    with pytest.raises(KindNotInFamily):
        tiny.model.attach_sae("post_norm", random_sae("standard", tiny.info.d_model, 32, "attn_out_post.0"))
    with pytest.raises(UnsupportedSae):
        tiny.model.attach_sae("missing_folder", "/nonexistent/sae")
    assert "wrong" not in tiny.model.saes
    acts = tiny.capture(ids, [Features("std", 3)])
    assert acts[Features("std", 3)].values.shape == (len(ids), 3)


def test_load_model_attaches_saes_from_folders(tmp_path: pathlib.Path) -> None:
    sae = random_sae("topk", 128, 256, "blocks.0.hook_resid_pre", seed=7)
    sae.save(tmp_path / "sae")
    model = sync_model(load_model("interp:tiny", backend="eager", saes={"pre0": tmp_path / "sae"}))
    try:
        assert list(model.model.saes) == ["pre0"]
        ids = ids_of(model)
        acts = model.capture(ids, ["resid_pre.0", "features:pre0:top4"])
        expected = read_features(sae, acts[Address("resid_pre", 0)], Features("pre0", 4))
        torch.testing.assert_close(
            acts[Features("pre0", 4)].to_dense(256), expected.to_dense(256), atol=1e-5, rtol=1e-5
        )
        model.model.detach_sae("pre0")
        with pytest.raises(UnknownSae):
            model.capture(ids, ["features:pre0:top4"])
    finally:
        model.shutdown()
