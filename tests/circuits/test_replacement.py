"""Transcoders replacing the MLPs: the replacement plus its error is the model, on every eager
family; transcoder clamps equal the hand-written add of ``(v - f_i) d_i`` at the output address;
the on-disk formats round-trip, and circuit-tracer's layout written by hand reads as the
transcoders it describes."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from interp_engine import Address, FeatureWrite, InvalidFeatures, Sae, SteeringSpec, UnsupportedSae, Write, load_model
from interp_engine.circuits import CrossLayerTranscoder, TranscoderSet, load_transcoders, reconstruct
from interp_testkit.suite import ALL_FAMILIES, PROMPT, tiny_model_path

from ..support.circuits import N_LAYERS, random_clt, random_plt

LOGITS = Address("logits")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_frozen_linear_model_reproduces_the_logits_on_every_family(family: str) -> None:
    """With nothing changed, the frozen-linear forward (patterns and norm scales frozen, each MLP's
    output a constant, at both input kinds) gives the model's own logits."""
    from interp_engine import sync_model

    model = sync_model(load_model(tiny_model_path(family), backend="eager"))
    try:
        tokens = model.to_tokens(PROMPT)[0].tolist()[:10]
        raw = Address("logits_raw")  # before a final soft-cap (Gemma 2): what the frozen model returns
        caps = model.capture(tokens, [LOGITS, raw])
        for kind in ("mlp_in", "resid_mid"):
            frozen = model.model.linearize(tokens, kind)
            assert float((frozen.clean.logits - caps[LOGITS][-1]).abs().max()) <= 1e-5
            assert float((frozen.clean.logits_raw - caps[raw][-1]).abs().max()) <= 1e-5
            run = frozen.run(2, grad=False)
            assert float((run.logits - caps[raw][-1]).abs().max()) <= 1e-5, kind
    finally:
        model.shutdown()


@pytest.mark.parametrize("which", ["plt", "clt"])
def test_replacement_plus_error_is_the_model(tiny: Any, which: str) -> None:
    """Each MLP output replaced by the transcoders' reconstruction plus the error term gives the
    model's logits; the reconstruction alone does not."""
    rep = random_plt() if which == "plt" else random_clt()
    tokens = tiny.to_tokens(PROMPT)[0].tolist()
    frozen = tiny.model.linearize(tokens, rep.input_kind)
    clean = frozen.clean
    recon = reconstruct(rep, clean.inputs)
    error = {layer: clean.mlp_out[layer] - recon[layer] for layer in range(N_LAYERS)}
    replaced = frozen.run(1, mlp_out={layer: recon[layer] + error[layer] for layer in range(N_LAYERS)}, grad=False)
    logits = tiny.capture(tokens, [LOGITS])[LOGITS][-1]  # GPT-2 has no soft-cap: raw logits are the logits
    assert float((replaced.logits[0] - logits).abs().max()) <= 1e-5
    without_error = frozen.run(1, mlp_out=recon, grad=False)
    assert float((without_error.logits[0] - logits).abs().max()) > 1e-2


@pytest.mark.parametrize("kind", ["mlp_in", "resid_mid"])
def test_transcoder_clamp_equals_the_hand_written_add(tiny: Any, kind: str) -> None:
    plt = random_plt(seed=3, kind=kind, jumprelu=True)
    plt.attach(tiny)
    try:
        tokens = tiny.to_tokens(PROMPT)[0].tolist()
        n = len(tokens)
        inputs = tiny.capture(tokens, [Address(kind, 2)])[Address(kind, 2)]
        f = plt[2].encode(inputs)
        i = int(f[-1].argmax())
        assert float(f[-1, i]) > 0
        for op, value in (("clamp", 3.0), ("ablate", 0.0)):
            spec = SteeringSpec([FeatureWrite("tc.2", i, op, value, positions=[n - 1])])
            got = tiny.capture(tokens, [Address("mlp_out", 2), LOGITS], steering_spec=spec)
            delta = (value - float(f[-1, i])) * plt[2].W_dec[i]
            hand = SteeringSpec([Write("mlp_out.2", delta, "add", positions=[n - 1])])
            want = tiny.capture(tokens, [Address("mlp_out", 2), LOGITS], steering_spec=hand)
            for address in (Address("mlp_out", 2), LOGITS):
                assert float((got[address] - want[address]).abs().max()) <= 1e-5
            assert float((got[LOGITS] - tiny.capture(tokens, [LOGITS])[LOGITS]).abs().max()) > 1e-3
    finally:
        for layer in plt.layers:
            tiny.detach_sae(plt.names[layer])


def test_a_clamp_at_an_earlier_layer_moves_later_transcoder_features(tiny: Any) -> None:
    """A feature write re-reads the feature in the steered forward: clamping a layer-0 feature
    changes what a layer-3 clamp of ``f`` to ``v`` adds (``v - f`` with the new ``f``)."""
    plt = random_plt(seed=4)
    plt.attach(tiny)
    try:
        tokens = tiny.to_tokens(PROMPT)[0].tolist()
        x0 = tiny.capture(tokens, [Address("mlp_in", 0)])[Address("mlp_in", 0)]
        first = int(plt[0].encode(x0)[2].argmax())
        spec = SteeringSpec([FeatureWrite("tc.0", first, "clamp", 8.0, positions=[2])])
        steered_in = tiny.capture(tokens, [Address("mlp_in", 3)], steering_spec=spec)[Address("mlp_in", 3)]
        later = int(plt[3].encode(steered_in)[-1].argmax())
        both = SteeringSpec([*spec, FeatureWrite("tc.3", later, "clamp", 2.0, positions=[len(tokens) - 1])])
        out = tiny.capture(tokens, [Address("mlp_out", 3)], steering_spec=both)[Address("mlp_out", 3)]
        alone = tiny.capture(tokens, [Address("mlp_out", 3)], steering_spec=spec)[Address("mlp_out", 3)]
        f = float(plt[3].encode(steered_in)[-1, later])
        want = alone[-1] + (2.0 - f) * plt[3].W_dec[later]
        assert float((out[-1] - want).abs().max()) <= 1e-5
    finally:
        for layer in plt.layers:
            tiny.detach_sae(plt.names[layer])


def test_transcoder_clamps_are_refused_where_not_served(tiny: Any) -> None:
    """The core's check, for a backend that does not serve them (``transcoder_clamps`` false),
    names the backends that do, before any compute."""
    from interp_engine.protocol._features import resolve_feature_writes

    plt = random_plt()
    write = FeatureWrite("tc.1", 0, "clamp", 1.0)
    with pytest.raises(InvalidFeatures, match="the eager, vllm and vllm-static backends serve it"):
        resolve_feature_writes([write], lambda name: plt[1], tiny.info, backend="toy")
    out, used = resolve_feature_writes([write], lambda name: plt[1], tiny.info, transcoder_clamps=True)
    assert out[0].address == Address("mlp_out", 1) and used == {"tc.1": plt[1]}


# -- formats -----------------------------------------------------------------------------------


def _same_plt(a: TranscoderSet, b: TranscoderSet) -> None:
    assert a.layers == b.layers and a.input_kind == b.input_kind
    for layer in a.layers:
        for name, t in a[layer].state_dict().items():
            assert torch.equal(t, b[layer].state_dict()[name]), (layer, name)
        assert a[layer].architecture == b[layer].architecture


def _same_clt(a: CrossLayerTranscoder, b: CrossLayerTranscoder) -> None:
    assert a.input_kind == b.input_kind
    for name in ("W_enc", "b_enc", "b_dec", "threshold"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert all(torch.equal(x, y) for x, y in zip(a.W_dec, b.W_dec, strict=True))


@pytest.mark.parametrize("jumprelu", [False, True])
@pytest.mark.parametrize("fmt", ["circuit-tracer", "saelens"])
def test_plt_save_round_trips(tmp_path: pathlib.Path, fmt: str, jumprelu: bool) -> None:
    plt = random_plt(jumprelu=jumprelu)
    plt.save(str(tmp_path / "tc"), format=fmt)
    _same_plt(plt, load_transcoders(tmp_path / "tc"))  # type: ignore[arg-type]


@pytest.mark.parametrize("jumprelu", [False, True])
def test_clt_save_round_trips(tmp_path: pathlib.Path, jumprelu: bool) -> None:
    clt = random_clt(jumprelu=jumprelu)
    clt.save(str(tmp_path / "clt"))
    _same_clt(clt, load_transcoders(tmp_path / "clt"))  # type: ignore[arg-type]


def test_circuit_tracer_layouts_written_by_hand_read_as_what_they_describe(tmp_path: pathlib.Path) -> None:
    """Files in circuit-tracer's layout (encoders ``[d_sae, d_model]``; a CLT's decoders
    ``[d_sae, n_layers - L, d_model]``), written here with safetensors alone."""
    g = torch.Generator().manual_seed(5)
    d, k = 128, 16
    plt_dir = tmp_path / "plt"
    plt_dir.mkdir()
    enc = [torch.randn(k, d, generator=g) for _ in range(2)]
    for layer in range(2):
        save_file(
            {
                "W_enc": enc[layer],
                "W_dec": torch.randn(k, d, generator=g),
                "b_enc": torch.randn(k, generator=g),
                "b_dec": torch.randn(d, generator=g),
                "activation_function.threshold": torch.rand(k, generator=g),
            },
            str(plt_dir / f"layer_{layer}.safetensors"),
        )
    (plt_dir / "config.yaml").write_text(
        "model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\nfeature_output_hook: hook_mlp_out\n"
    )
    plt = load_transcoders(plt_dir)
    assert isinstance(plt, TranscoderSet) and plt.layers == (0, 1)
    assert plt[1].architecture == "jumprelu_transcoder" and plt[1].address == Address("mlp_in", 1)
    assert plt[1].address_out == Address("mlp_out", 1)
    x = torch.randn(3, d, generator=g)
    assert torch.allclose(plt[1].pre_acts(x), x @ enc[1].T + plt[1].b_enc, atol=1e-5)

    clt_dir = tmp_path / "clt"
    clt_dir.mkdir()
    n = 3
    dec = [torch.randn(k, n - layer, d, generator=g) for layer in range(n)]
    for layer in range(n):
        save_file(
            {
                f"W_enc_{layer}": torch.randn(k, d, generator=g),
                f"b_enc_{layer}": torch.randn(k, generator=g),
                f"b_dec_{layer}": torch.randn(d, generator=g),
            },
            str(clt_dir / f"W_enc_{layer}.safetensors"),
        )
        save_file({f"W_dec_{layer}": dec[layer]}, str(clt_dir / f"W_dec_{layer}.safetensors"))
    clt = load_transcoders(clt_dir)
    assert isinstance(clt, CrossLayerTranscoder) and clt.n_layers == n and clt.threshold is None
    assert clt.input_kind == "resid_mid"  # circuit-tracer's default for CLTs without a config
    assert clt.out_layers(1) == (1, 2)
    assert torch.equal(clt.decoder(1, 2), dec[1][:, 1])
    acts = {layer: torch.relu(torch.randn(2, k, generator=g)) for layer in range(n)}
    from interp_engine.circuits._transcoders import reconstruct_from

    recon = reconstruct_from(clt, acts)
    want = acts[0] @ dec[0][:, 2] + acts[1] @ dec[1][:, 1] + acts[2] @ dec[2][:, 0] + clt.b_dec[2]
    assert torch.allclose(recon[2], want, atol=1e-5)


def test_bad_transcoders_are_typed_errors(tmp_path: pathlib.Path) -> None:
    sae = Sae("standard", torch.randn(128, 8), torch.zeros(8), torch.randn(8, 128), torch.zeros(128), "resid_post.1")
    with pytest.raises(UnsupportedSae, match="not a transcoder"):
        TranscoderSet([sae])
    cross = Sae(
        "transcoder",
        torch.randn(128, 8),
        torch.zeros(8),
        torch.randn(8, 128),
        torch.zeros(128),
        "mlp_in.1",
        hook_name_out="mlp_out.2",
    )
    with pytest.raises(UnsupportedSae, match="same layer"):
        TranscoderSet([cross])
    with pytest.raises(UnsupportedSae, match="two transcoders"):
        TranscoderSet([random_plt()[1], random_plt(seed=2)[1]])
    with pytest.raises(UnsupportedSae, match="W_dec\\[1\\]"):
        CrossLayerTranscoder(
            torch.randn(2, 4, 3), torch.zeros(2, 3), [torch.zeros(3, 2, 4), torch.zeros(3, 2, 4)], torch.zeros(2, 4)
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedSae, match="not a transcoder folder"):
        load_transcoders(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.yaml").write_text("model_kind: transcoder_set\nfeature_input_hook: hook_resid_post\n")
    save_file({"W_enc": torch.zeros(2, 4)}, str(tmp_path / "bad" / "layer_0.safetensors"))
    with pytest.raises(UnsupportedSae, match="resid_post"):
        load_transcoders(tmp_path / "bad")


def test_the_shipped_transcoders_replace_interp_tiny_mlps(tiny: Any) -> None:
    """``interp:tiny-transcoders``: one per layer, explaining most of each MLP output's variance on
    text the tiny model knows (``transcoders.json`` records the held-out figures)."""
    tcs = load_transcoders("interp:tiny-transcoders")
    assert isinstance(tcs, TranscoderSet) and tcs.layers == (0, 1, 2, 3) and tcs.d_sae(0) == 512
    text = "The capital of Spain is Madrid. Paris is the capital of France, and its people speak French."
    tokens = tiny.to_tokens(text)[0].tolist()
    points = [Address(k, layer) for layer in tcs.layers for k in ("mlp_in", "mlp_out")]
    acts = tiny.capture(tokens, points)
    for layer in tcs.layers:
        y = acts[Address("mlp_out", layer)][1:]
        pred = tcs[layer].reconstruct(acts[Address("mlp_in", layer)][1:])
        fve = 1 - float((y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        assert fve > 0.75, (layer, fve)
    with pytest.raises(UnsupportedSae, match="ships"):
        load_transcoders("interp:nope")
