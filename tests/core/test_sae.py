"""SAEs in SAELens's format, with SAELens itself as the oracle.

Each architecture is built with SAELens's own classes and random weights, saved by SAELens, read by
``load_sae`` (which never imports SAELens), and must encode, decode and reconstruct as SAELens's
``SAE.load_from_disk`` of the same folder does. What ``Sae.save`` writes must read back in SAELens
with the same numbers. ``sae-lens`` is a dev dependency: these tests fail, not skip, without it.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import sae_lens
import torch
from sae_lens import SAE
from sae_lens.saes.sae import SAEMetadata

from interp_engine._errors import InvalidFeatures, UnsupportedSae
from interp_engine.addresses._address import Address
from interp_engine.sae._sae import ARCHITECTURES, Probe, Sae, load_sae

D_IN, D_SAE, D_OUT = 32, 128, 24
TOL = {"atol": 1e-5, "rtol": 1e-5}
HOOK, HOOK_OUT = "blocks.2.ln2.hook_normalized", "blocks.2.hook_mlp_out"


def _randomise(sae: Any, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            if name == "threshold":  # positive thresholds a good share of features clear
                param.copy_(torch.rand(param.shape, generator=gen) * 0.8)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return sae.eval()


def _meta(transcoder: bool = False, hook: str = "blocks.2.hook_resid_post") -> SAEMetadata:
    if transcoder:
        return SAEMetadata(hook_name=HOOK, hook_name_out=HOOK_OUT)
    return SAEMetadata(hook_name=hook)


def _build(arch: str, *, apply_b_dec: bool = True, seed: int = 0, **extra: Any) -> Any:
    """A SAELens inference SAE of ``arch`` with random weights."""
    common: dict[str, Any] = {"d_in": D_IN, "d_sae": D_SAE, **extra}
    if arch == "standard":
        sae = sae_lens.StandardSAE(
            sae_lens.StandardSAEConfig(apply_b_dec_to_input=apply_b_dec, metadata=_meta(), **common)
        )
    elif arch == "jumprelu":
        sae = sae_lens.JumpReLUSAE(
            sae_lens.JumpReLUSAEConfig(apply_b_dec_to_input=apply_b_dec, metadata=_meta(), **common)
        )
    elif arch == "topk":
        common.setdefault("k", 8)
        sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(apply_b_dec_to_input=apply_b_dec, metadata=_meta(), **common))
    else:
        classes = {
            "transcoder": (sae_lens.Transcoder, sae_lens.TranscoderConfig),
            "jumprelu_transcoder": (sae_lens.JumpReLUTranscoder, sae_lens.JumpReLUTranscoderConfig),
            "skip_transcoder": (sae_lens.SkipTranscoder, sae_lens.SkipTranscoderConfig),
            "jumprelu_skip_transcoder": (sae_lens.JumpReLUSkipTranscoder, sae_lens.JumpReLUSkipTranscoderConfig),
        }
        cls, cfg_cls = classes[arch]
        sae = cls(cfg_cls(d_out=D_OUT, apply_b_dec_to_input=False, metadata=_meta(transcoder=True), **common))
    return _randomise(sae, seed)


def _inputs(seed: int = 1, d_in: int = D_IN) -> torch.Tensor:
    """Rows at several scales, batched ``[2, 6, d_in]``: small ones where few features fire, large
    ones where many do."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.1, 0.5, 1.0, 2.0, 4.0, 8.0]).view(1, 6, 1)
    return torch.randn(2, 6, d_in, generator=gen) * scales


def _saved(sae: Any, tmp_path: pathlib.Path, name: str = "sae") -> pathlib.Path:
    folder = tmp_path / name
    sae.save_model(folder)
    return folder


def _assert_agrees(ours: Sae, oracle: Any, x: torch.Tensor) -> None:
    """encode, decode and reconstruct as SAELens's encode, decode and forward."""
    with torch.no_grad():
        expected_f = oracle.encode(x)
        torch.testing.assert_close(ours.encode(x), expected_f, **TOL)
        torch.testing.assert_close(ours.reconstruct(x), oracle(x), **TOL)
        if ours.normalize_activations in ("constant_norm_rescale", "layer_norm") and not ours.is_transcoder:
            expected_out = oracle.decode(oracle.encode(x))  # SAELens keeps the input's norm from encode
            torch.testing.assert_close(ours.decode(expected_f, x=x), expected_out, **TOL)
        else:
            torch.testing.assert_close(ours.decode(expected_f), oracle.decode(expected_f), **TOL)
            dense = torch.rand(5, ours.d_sae, generator=torch.Generator().manual_seed(3))
            torch.testing.assert_close(ours.decode(dense), oracle.decode(dense), **TOL)


SAE_ARCHS = [a for a in ARCHITECTURES if a != "probe"]
WITH_B_DEC_CHOICE = ("standard", "jumprelu", "topk")  # transcoders have no apply_b_dec_to_input


@pytest.mark.parametrize(
    ("arch", "apply_b_dec"), [(a, True) for a in WITH_B_DEC_CHOICE] + [(a, False) for a in SAE_ARCHS]
)
def test_matches_saelens(arch: str, apply_b_dec: bool, tmp_path: pathlib.Path) -> None:
    folder = _saved(_build(arch, apply_b_dec=apply_b_dec), tmp_path)
    ours, oracle = load_sae(folder), SAE.load_from_disk(folder)
    assert ours.architecture == arch and ours.apply_b_dec_to_input == apply_b_dec
    x = _inputs()
    _assert_agrees(ours, oracle, x)
    fired = (ours.encode(x[:, -1]) > 0).float().mean()
    assert fired > (0.05 if arch == "topk" else 0.3), "the large inputs should fire many features"
    if arch == "topk":
        assert bool(((ours.encode(x) > 0).sum(-1) <= 8).all())


def test_topk_rescaled_by_decoder_norm(tmp_path: pathlib.Path) -> None:
    folder = _saved(_build("topk", rescale_acts_by_decoder_norm=True, k=16), tmp_path)
    ours = load_sae(folder)
    assert ours.rescale_acts_by_decoder_norm
    _assert_agrees(ours, SAE.load_from_disk(folder), _inputs())


def test_topk_training_checkpoint(tmp_path: pathlib.Path) -> None:
    """A TopK training SAE's save_model: unfolded, rescale_acts_by_decoder_norm on, extra training fields."""
    cfg = sae_lens.TopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=6, metadata=_meta())
    folder = _saved(_randomise(sae_lens.TopKTrainingSAE(cfg), 4), tmp_path)
    ours = load_sae(folder)
    assert ours.k == 6 and ours.rescale_acts_by_decoder_norm
    _assert_agrees(ours, SAE.load_from_disk(folder), _inputs())


def test_batchtopk_inference_save_reads_as_jumprelu(tmp_path: pathlib.Path) -> None:
    cfg = sae_lens.BatchTopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=6, metadata=_meta())
    trained = _randomise(sae_lens.BatchTopKTrainingSAE(cfg), 5)
    trained.topk_threshold = torch.tensor(0.4, dtype=torch.double)
    trained.save_inference_model(tmp_path / "inference")
    ours = load_sae(tmp_path / "inference")
    assert ours.architecture == "jumprelu"
    _assert_agrees(ours, SAE.load_from_disk(tmp_path / "inference"), _inputs())
    trained.save_model(tmp_path / "training")  # the training layout: architecture "batchtopk"
    with pytest.raises(UnsupportedSae, match="save_inference_model"):
        load_sae(tmp_path / "training")


@pytest.mark.parametrize("mode", ["constant_norm_rescale", "layer_norm"])
@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu_transcoder"])
def test_per_input_normalisation(arch: str, mode: str, tmp_path: pathlib.Path) -> None:
    folder = _saved(_build(arch, normalize_activations=mode), tmp_path)
    ours = load_sae(folder)
    assert ours.normalize_activations == mode
    _assert_agrees(ours, SAE.load_from_disk(folder), _inputs())
    if not ours.is_transcoder:
        with pytest.raises(InvalidFeatures, match="x="):
            ours.decode(ours.encode(_inputs()))
        with pytest.raises(InvalidFeatures, match="x="):
            ours.feature_direction(0)


@pytest.mark.parametrize("source", ["cfg", "activation_scaler"])
def test_expected_average_only_in(source: str, tmp_path: pathlib.Path) -> None:
    """SAELens applies the factor by folding it (``fold_activation_norm_scaling_factor``); ours
    applies it at run time and must agree with the folded SAE."""
    factor = 0.37
    folder = _saved(_build("jumprelu", normalize_activations="expected_average_only_in"), tmp_path)
    with pytest.raises(UnsupportedSae, match="norm_scaling_factor"):
        load_sae(folder)
    if source == "cfg":
        cfg = json.loads((folder / "cfg.json").read_text())
        (folder / "cfg.json").write_text(json.dumps({**cfg, "norm_scaling_factor": factor}))
    else:
        (folder / "activation_scaler.json").write_text(json.dumps({"scaling_factor": factor, "has_whitening": False}))
    ours = load_sae(folder)
    oracle = SAE.load_from_disk(folder)
    oracle.fold_activation_norm_scaling_factor(factor)
    _assert_agrees(ours, oracle, _inputs())
    torch.testing.assert_close(ours.feature_direction(7), oracle.W_dec[7].detach(), **TOL)
    ours.save(tmp_path / "again")  # the factor travels in cfg.json
    assert load_sae(tmp_path / "again").norm_scaling_factor == pytest.approx(factor)


def test_covariance_whitening_is_refused(tmp_path: pathlib.Path) -> None:
    folder = _saved(_build("standard", normalize_activations="covariance_whitening"), tmp_path)
    with pytest.raises(UnsupportedSae, match="fold_activation_whitening"):
        load_sae(folder)


def test_hook_z_sae_takes_heads(tmp_path: pathlib.Path) -> None:
    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(
            d_in=D_IN, d_sae=D_SAE, reshape_activations="hook_z", metadata=_meta(hook="blocks.1.attn.hook_z")
        )
    )
    folder = _saved(_randomise(sae, 6), tmp_path)
    ours, oracle = load_sae(folder), SAE.load_from_disk(folder)
    assert ours.address == Address("attn_z", 1)
    heads = _inputs().view(2, 6, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(heads), oracle.encode(heads), **TOL)
        torch.testing.assert_close(ours.reconstruct(heads), oracle(heads), **TOL)
    torch.testing.assert_close(ours.encode(heads.flatten(-2)), ours.encode(heads))


@pytest.mark.parametrize("arch", SAE_ARCHS)
def test_our_save_reads_back_in_saelens_and_ours(arch: str, tmp_path: pathlib.Path) -> None:
    ours = load_sae(_saved(_build(arch, apply_b_dec=False, seed=7), tmp_path))
    ours.save(tmp_path / "ours")
    again, oracle = load_sae(tmp_path / "ours"), SAE.load_from_disk(tmp_path / "ours")
    assert again.cfg == ours.cfg
    assert again.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert (again.architecture, again.hook_name, again.hook_name_out) == (arch, ours.hook_name, ours.hook_name_out)
    _assert_agrees(again, oracle, _inputs(seed=8))


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


@pytest.mark.parametrize("arch", SAE_ARCHS)
def test_built_from_tensors_saves_for_saelens(arch: str, tmp_path: pathlib.Path) -> None:
    transcoder = "transcoder" in arch
    d_out = D_OUT if transcoder else D_IN
    sae = Sae(
        arch,
        _random(D_IN, D_SAE, seed=1),
        _random(D_SAE, seed=2),
        _random(D_SAE, d_out, seed=3),
        _random(d_out, seed=4),
        HOOK if transcoder else "blocks.0.hook_resid_pre",
        threshold=_random(D_SAE, seed=5).abs() if "jumprelu" in arch else None,
        k=10 if arch == "topk" else None,
        W_skip=_random(d_out, D_IN, seed=6) if "skip" in arch else None,
        hook_name_out=HOOK_OUT if transcoder else None,
        apply_b_dec_to_input=not transcoder,
        rescale_acts_by_decoder_norm=arch == "topk",
    )
    sae.save(tmp_path / "built")
    oracle = SAE.load_from_disk(tmp_path / "built")
    assert oracle.cfg.metadata.hook_name == sae.hook_name
    if transcoder:
        assert oracle.cfg.metadata.hook_name_out == HOOK_OUT
        assert sae.address_out == Address("mlp_out", 2) and sae.address == Address("mlp_in", 2)
    else:
        assert sae.address_out == sae.address == Address("resid_pre", 0)
    _assert_agrees(sae, oracle, _inputs())


def test_partial_cfg_given_to_the_constructor(tmp_path: pathlib.Path) -> None:
    """Extra cfg fields travel to cfg.json; the SAELens 6 layout is kept so SAELens keeps the hook."""
    sae = Sae(
        "standard",
        _random(D_IN, D_SAE, seed=1),
        _random(D_SAE, seed=2),
        _random(D_SAE, D_IN, seed=3),
        _random(D_IN, seed=4),
        "blocks.3.hook_mlp_out",
        cfg={"model_name": "tiny", "context_size": 64, "dtype": "float64"},
    )
    assert sae.cfg["model_name"] == "tiny" and sae.cfg["dtype"] == "float32"  # the tensors' dtype wins
    sae.save(tmp_path / "partial")
    oracle = SAE.load_from_disk(tmp_path / "partial")
    assert oracle.cfg.metadata.hook_name == "blocks.3.hook_mlp_out"
    assert load_sae(tmp_path / "partial").cfg == sae.cfg
    _assert_agrees(sae, oracle, _inputs())


def test_legacy_cfg_and_log_threshold(tmp_path: pathlib.Path) -> None:
    """A pre-6 cfg (hook_point, activation_fn topk with activation_fn_kwargs.k, no version) and a
    JumpReLU checkpoint storing log_threshold."""
    folder = _saved(_build("topk", k=5), tmp_path)
    cfg = json.loads((folder / "cfg.json").read_text())
    old = {
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "hook_point": "blocks.2.hook_resid_post",
        "hook_point_layer": 2,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 5},
        "apply_b_dec_to_input": cfg["apply_b_dec_to_input"],
        "normalize_activations": False,
    }
    (folder / "cfg.json").write_text(json.dumps(old))
    ours = load_sae(folder)
    assert (ours.architecture, ours.k, ours.address) == ("topk", 5, Address("resid_post", 2))
    _assert_agrees(ours, SAE.load_from_disk(folder), _inputs())
    ours.save(tmp_path / "resaved")
    assert load_sae(tmp_path / "resaved").cfg["hook_point"] == "blocks.2.hook_resid_post"

    jump = _build("jumprelu", seed=9)
    folder = _saved(jump, tmp_path, "jump")
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "sae_weights.safetensors")
    weights["log_threshold"] = torch.log(weights.pop("threshold"))
    save_file(weights, folder / "sae_weights.safetensors")
    _assert_agrees(load_sae(folder), jump, _inputs())


def test_bytes_round_trip(tmp_path: pathlib.Path) -> None:
    for arch, extra in (("jumprelu_skip_transcoder", {}), ("topk", {"rescale_acts_by_decoder_norm": True})):
        ours = load_sae(_saved(_build(arch, apply_b_dec=False, **extra), tmp_path, arch))
        again = Sae.from_bytes(ours.to_bytes())
        assert again.cfg == ours.cfg and repr(again) == repr(ours)
        x = _inputs()
        torch.testing.assert_close(again.reconstruct(x), ours.reconstruct(x), atol=0, rtol=0)
    probe = Probe(_random(3, D_IN, seed=1), _random(3, seed=2), activation="tanh", address="mlp_out.1")
    back = Sae.from_bytes(probe.to_bytes())
    assert isinstance(back, Probe) and back.cfg == probe.cfg
    torch.testing.assert_close(back.encode(_inputs()), probe.encode(_inputs()), atol=0, rtol=0)
    with pytest.raises(UnsupportedSae):
        Sae.from_bytes(b"not safetensors")


ACTS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda t: t,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


@pytest.mark.parametrize("activation", list(ACTS))
def test_probe(activation: str | None, tmp_path: pathlib.Path) -> None:
    W, b = _random(3, D_IN, seed=1), _random(3, seed=2)
    probe = Probe(W, b, activation=activation, address="blocks.4.hook_resid_post")
    x = _inputs()
    torch.testing.assert_close(probe.encode(x), ACTS[activation](x @ W.T + b))
    assert (probe.d_in, probe.d_sae, probe.address, probe.hook_name) == (
        D_IN,
        3,
        Address("resid_post", 4),
        "resid_post.4",
    )
    assert not probe.has_decoder and probe.address_out == probe.address
    probe.save(tmp_path / "probe")
    cfg = json.loads((tmp_path / "probe" / "cfg.json").read_text())
    assert cfg == {
        "architecture": "probe",
        "hook_name": "resid_post.4",
        "d_in": D_IN,
        "d_sae": 3,
        "activation": activation,
    }
    back = load_sae(tmp_path / "probe")
    assert isinstance(back, Probe) and back.activation == activation
    torch.testing.assert_close(back.encode(x), probe.encode(x), atol=0, rtol=0)
    for call in (
        lambda: probe.decode(torch.zeros(3)),
        lambda: probe.feature_direction(0),
        lambda: probe.reconstruct(x),
    ):
        with pytest.raises(InvalidFeatures, match="probe"):
            call()


def test_probe_defaults() -> None:
    probe = Probe(torch.ones(2, 4))
    assert probe.address == Address("resid_post", 0) and torch.equal(probe.b_enc, torch.zeros(2))
    torch.testing.assert_close(probe.encode(torch.ones(4)), torch.full((2,), 4.0))
    assert repr(probe) == "Probe(resid_post.0, d_in=4, d_sae=2, activation=None)"
    with pytest.raises(UnsupportedSae, match="activation"):
        Probe(torch.ones(2, 4), activation="gelu")


def test_hook_names(tmp_path: pathlib.Path) -> None:
    folder = _saved(_build("standard"), tmp_path)
    assert load_sae(folder).address == Address("resid_post", 2)
    cfg = json.loads((folder / "cfg.json").read_text())
    for hook, names in (("blocks.2.hook_mlp_in", "hook_mlp_in"), ("model.layers.2.mlp", "model.layers.2.mlp")):
        cfg["metadata"]["hook_name"] = hook
        (folder / "cfg.json").write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedSae) as info:
            load_sae(folder)
        assert names in str(info.value) and "hook_resid_post" in str(info.value)  # names the served ones
    del cfg["metadata"]["hook_name"]
    (folder / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedSae, match="names no hook"):
        load_sae(folder)


def test_unknown_architecture_names_supported(tmp_path: pathlib.Path) -> None:
    gated = sae_lens.GatedSAE(sae_lens.GatedSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=_meta()))
    with pytest.raises(UnsupportedSae) as info:
        load_sae(_saved(gated, tmp_path))
    assert "'gated'" in str(info.value) and all(arch in str(info.value) for arch in ARCHITECTURES)
    with pytest.raises(UnsupportedSae, match="supported architectures"):
        Sae("mystery", torch.zeros(2, 3), torch.zeros(3), torch.zeros(3, 2), torch.zeros(2), "resid_post.0")


def test_missing_or_broken_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UnsupportedSae, match="no SAE folder"):
        load_sae(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedSae, match=r"cfg\.json or sae_weights\.safetensors"):
        load_sae(tmp_path / "empty")
    folder = _saved(_build("standard"), tmp_path)
    assert load_sae(folder / "cfg.json").d_sae == D_SAE  # a file inside the folder names the folder
    (folder / "sae_weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(UnsupportedSae, match="cannot read"):
        load_sae(folder)
    (folder / "cfg.json").write_text("{not json")
    with pytest.raises(UnsupportedSae, match="cannot read"):
        load_sae(folder)
    (tmp_path / "sparsify").mkdir()
    (tmp_path / "sparsify" / "sae.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedSae, match="sparsify"):
        load_sae(tmp_path / "sparsify")


def test_wrong_tensors_in_file(tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _saved(_build("jumprelu"), tmp_path)
    weights = load_file(folder / "sae_weights.safetensors")
    save_file({k: v for k, v in weights.items() if k != "threshold"}, folder / "sae_weights.safetensors")
    with pytest.raises(UnsupportedSae, match="missing"):
        load_sae(folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    save_file(weights, folder / "sae_weights.safetensors")
    (folder / "cfg.json").write_text(json.dumps({**cfg, "d_sae": D_SAE + 1}))
    with pytest.raises(UnsupportedSae, match="d_sae"):
        load_sae(folder)


def test_feature_direction(tmp_path: pathlib.Path) -> None:
    for arch, extra in (("standard", {}), ("topk", {"rescale_acts_by_decoder_norm": True}), ("transcoder", {})):
        sae = load_sae(_saved(_build(arch, apply_b_dec=False, **extra), tmp_path, arch))
        f = torch.zeros(2, D_SAE)
        f[1, 5] = 2.5
        moved = sae.decode(f)
        torch.testing.assert_close(moved[1] - moved[0], 2.5 * sae.feature_direction(5), **TOL)
        assert sae.feature_direction(5).shape == (sae.d_out,)
        for bad in (-1, D_SAE):
            with pytest.raises(InvalidFeatures, match="out of range"):
                sae.feature_direction(bad)
        for wrong in (True, 1.0, "3"):
            with pytest.raises(InvalidFeatures, match="feature id is an int"):
                sae.feature_direction(wrong)  # type: ignore[arg-type]
        torch.testing.assert_close(sae.feature_direction(torch.tensor(5)), sae.feature_direction(5))  # type: ignore[arg-type]
    ln = load_sae(_saved(_build("standard", normalize_activations="layer_norm"), tmp_path, "ln"))
    x = _inputs()[0]
    f = ln.encode(x)
    bumped = f.clone()
    bumped[:, 9] += 1.0
    delta = ln.decode(bumped, x=x) - ln.decode(f, x=x)
    torch.testing.assert_close(delta, ln.feature_direction(9, x=x), **TOL)


def test_constructor_checks() -> None:
    W_enc, b_enc = torch.zeros(D_IN, D_SAE), torch.zeros(D_SAE)
    W_dec, b_dec = torch.zeros(D_SAE, D_IN), torch.zeros(D_IN)
    hook = "blocks.0.hook_resid_post"
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: Sae("standard", W_enc, b_enc, torch.zeros(D_SAE + 1, D_IN), b_dec, hook), "W_dec"),
        (lambda: Sae("standard", W_enc, b_enc, torch.zeros(D_SAE, D_OUT), torch.zeros(D_OUT), hook), "d_in"),
        (lambda: Sae("standard", W_enc, torch.zeros(3), W_dec, b_dec, hook), "b_enc"),
        (lambda: Sae("jumprelu", W_enc, b_enc, W_dec, b_dec, hook), "threshold"),
        (lambda: Sae("topk", W_enc, b_enc, W_dec, b_dec, hook), "k"),
        (lambda: Sae("topk", W_enc, b_enc, W_dec, b_dec, hook, k=D_SAE + 1), "k"),
        (lambda: Sae("standard", W_enc, b_enc, W_dec, b_dec, hook, k=4), "k is only"),
        (lambda: Sae("skip_transcoder", W_enc, b_enc, W_dec, b_dec, hook), "W_skip"),
        (lambda: Sae("transcoder", W_enc, b_enc, W_dec, b_dec, hook, apply_b_dec_to_input=True), "apply_b_dec"),
        (lambda: Sae("standard", W_enc, b_enc, None, None, hook), "W_dec"),
        (
            lambda: Sae("standard", W_enc, b_enc, W_dec, b_dec, hook, normalize_activations="covariance_whitening"),
            "fold",
        ),
        (lambda: Sae("standard", W_enc.long(), b_enc, W_dec, b_dec, hook), "floating-point"),
        (lambda: Sae("standard", W_enc, b_enc, W_dec, b_dec, "blocks.0.hook_attn_in"), "hook_attn_in"),
    ]
    for build, message in cases:
        with pytest.raises(UnsupportedSae, match=message):
            build()


def test_inputs_of_the_wrong_width() -> None:
    sae = Sae(
        "standard",
        torch.zeros(D_IN, D_SAE),
        torch.zeros(D_SAE),
        torch.zeros(D_SAE, D_IN),
        torch.zeros(D_IN),
        "resid_post.1",
    )
    with pytest.raises(InvalidFeatures, match=f"width {D_IN}"):
        sae.encode(torch.zeros(3, D_IN + 1))
    with pytest.raises(InvalidFeatures, match=f"{D_SAE}"):
        sae.decode(torch.zeros(3, D_IN))
    assert repr(sae) == f"Sae(standard, resid_post.1, d_in={D_IN}, d_sae={D_SAE})"


def test_to_and_load_sae_passthrough(tmp_path: pathlib.Path) -> None:
    sae = load_sae(_saved(_build("topk", apply_b_dec=False), tmp_path))
    assert load_sae(sae) is sae and sae.to("cpu") is sae and sae.to(dtype=torch.float32) is sae
    half = sae.to(dtype=torch.bfloat16)
    assert half is sae.to(dtype=torch.bfloat16)  # cached
    assert half.W_enc.dtype == torch.bfloat16 and half.cfg["dtype"] == "bfloat16" and sae.cfg["dtype"] == "float32"
    assert half.encode(_inputs()).dtype == torch.float32
    half.save(tmp_path / "half")
    oracle = SAE.load_from_disk(tmp_path / "half")
    assert oracle.W_enc.dtype == torch.bfloat16
    assert torch.equal(oracle.W_enc.detach(), half.W_enc)
    assert repr(sae) == f"Sae(topk, resid_post.2, d_in={D_IN}, d_sae={D_SAE}, k=8)"
