"""SAEs on the ``interp`` command line: ``interp serve --sae NAME=PATH`` attaches them before the
engine is built, ``interp capture`` saves feature readouts in its Cache file."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import pytest
import torch

from interp_engine import Features, Sae, load_model, load_sae, run_with_cache, sync_model
from interp_engine.cli import _common

from ..support.cli import interp, our_lines
from ..support.saes import tiny_sae
from ..support.servers import LiveServer

MODEL = "interp:tiny"
PROMPTS = ["The capital of France is", "Paris", "The capital of Germany is Berlin"]  # 5, 1 and 6 tokens


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("sae") / "res"
    tiny_sae().save(folder)
    return folder


def same_sae(a: Sae, b: Sae) -> bool:
    return a.architecture == b.architecture and a.address == b.address and torch.equal(a.W_enc, b.W_enc)


# -- interp serve --sae -----------------------------------------------------------------------------


def test_serve_attaches_its_saes_before_the_engine_is_built(
    capsys: pytest.CaptureFixture[str], sae_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import interp_engine.server

    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(interp_engine.server, "run", lambda model, **kwargs: calls.append((model, kwargs)))
    argv = ["serve", MODEL, "--backend", "eager", "--sae", f"res={sae_dir}", "--sae", f"other={sae_dir}"]
    status, _, err = interp(capsys, *argv)
    assert status == 0, err
    ((model, kwargs),) = calls
    assert model == MODEL
    saes = kwargs.pop("saes")
    assert list(saes) == ["res", "other"]
    assert all(isinstance(s, Sae) and same_sae(s, load_sae(sae_dir)) for s in saes.values())

    # what run() does with them: the app's lifespan loads the model with the SAEs attached
    options = {k: v for k, v in kwargs.items() if k not in ("host", "port")}
    app = interp_engine.server.create_app(model, saes=saes, **options)
    with LiveServer(app, run_config=False) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        listed = client.get("/v1/model").json()["saes"]
        assert [(s["name"], s["address"], s["d_sae"]) for s in listed] == [
            ("res", "resid_post.1", 512),
            ("other", "resid_post.1", 512),
        ]
        body = client.post("/v1/capture", json={"text": PROMPTS[0], "points": ["features:other:top4"]})
        assert body.status_code == 200 and len(body.json()["features"]["features:other:top4"]["ids"][0]) == 4


@pytest.mark.parametrize(
    ("option", "status", "expected"),
    [
        ("res", 2, "expected NAME=PATH"),
        ("=folder", 2, "expected NAME=PATH"),
        ("res={tmp}/missing", 1, "no SAE folder"),
        ("bad name={sae}", 1, "an SAE name is"),
    ],
)
def test_bad_sae_options_are_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    sae_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    option: str,
    status: int,
    expected: str,
) -> None:
    import interp_engine.server

    calls: list[Any] = []
    monkeypatch.setattr(interp_engine.server, "run", lambda *args, **kwargs: calls.append(args))
    got, _, err = interp(capsys, "serve", MODEL, "--sae", option.format(tmp=tmp_path, sae=sae_dir))
    assert got == status
    lines = our_lines(err)
    assert len(lines) == 1 and expected in lines[0], err
    assert not calls  # refused before any model is loaded
    twice = ["--sae", f"res={sae_dir}", "--sae", f"res={sae_dir}"]
    got, _, err = interp(capsys, "serve", MODEL, *twice)
    assert got == 1 and "given twice" in our_lines(err)[0]


# -- interp capture with readouts ---------------------------------------------------------------------


def test_capture_writes_readouts_into_the_cache_file(
    capsys: pytest.CaptureFixture[str], sae_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "acts.safetensors"
    argv = ["capture", MODEL, "--input", str(prompts), "--out", str(out), "--sae", f"res={sae_dir}", "--quiet"]
    points = ["resid_post.1,features:res:ids=3,17", "features:res:top8"]
    status, stdout, err = interp(capsys, *argv, "--points", *points, "--batch-size", "2")
    assert status == 0, err
    assert f"wrote {out}: 3 prompts, resid_post.1 [3, 6, 128], features:res:ids=3,17 [3, 6, 2]" in stdout
    assert "features:res:top8: features read on the most tokens: " in stdout

    from interp_engine import Cache

    cache = Cache.load(out)
    assert [str(k) for k in cache] == ["resid_post.1", "features:res:ids=3,17", "features:res:top8"]
    model = sync_model(load_model(MODEL, backend="eager", saes={"res": sae_dir}))
    expected = run_with_cache(model, PROMPTS, ["resid_post.1", "features:res:ids=3,17", "features:res:top8"])
    assert cache.lengths is not None and expected.lengths is not None
    assert cache.lengths.tolist() == expected.lengths.tolist()
    for key in ("features:res:top8", "features:res:ids=3,17"):
        got, want = cache[key], expected[key]
        assert got.ids is not None and want.ids is not None and torch.equal(got.ids, want.ids), key
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.error_norm, want.error_norm, rtol=0, atol=1e-4)
    top = cache[Features("res", 8)]
    assert top.values.shape == (3, 6, 8) and (top.ids[1, 1:] == -1).all()  # "Paris" is one token: padding
    # the readouts are the SAE's encoding of the stored activations
    sae = load_sae(sae_dir)
    x = cache["resid_post.1"][0, :5]  # the first prompt's 5 tokens
    chosen = top.ids[0, :5]
    torch.testing.assert_close(top.values[0, :5], sae.encode(x).gather(-1, chosen), rtol=1e-5, atol=1e-5)
    model.shutdown()

    # the manifest of an interrupted run names the SAEs: another SAE folder does not resume it
    from interp_engine.cli._capture import _manifest, parts_dir

    parsed = _common.parse_points(points)
    assert [str(p) for p in parsed] == ["resid_post.1", "features:res:ids=3,17", "features:res:top8"]
    args = type("Args", (), {"model": MODEL, "backend": None, "saes": [("res", str(sae_dir))], "adapter": None})()
    assert json.loads(json.dumps(_manifest(args, PROMPTS, parsed)))["saes"] == {"res": str(sae_dir)}
    assert not parts_dir(out).exists()


def test_capture_refuses_an_unknown_sae_before_capturing(
    capsys: pytest.CaptureFixture[str], sae_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "acts.safetensors"
    base = ["capture", MODEL, "hi", "--out", str(out), "--sae", f"res={sae_dir}"]
    for points, expected in (
        (["features:nope:top8"], "no SAE is attached as 'nope'; attached: res"),
        (["embed", "features:res:ids=600"], "feature 600 is out of range"),
        (["features:res:top"], "not a feature readout"),
    ):
        status, _, err = interp(capsys, *base, "--points", *points)
        lines = our_lines(err)
        assert status == 1 and len(lines) == 1 and expected in lines[0], err
        assert not out.exists() and not (tmp_path / "acts.safetensors.parts").exists()
