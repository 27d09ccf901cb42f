"""The SAE that ships with interp-core (``interp:tiny-sae``) on the shipped tiny model, on eager.

These tests check behaviours of the shipped files, measured here from the model and the SAE on
fresh text (the corpus generator's documents under a seed neither the training corpus nor the
training script's held-out text used): it reconstructs ``resid_post`` well, few features are
dead, it is as sparse as its ``k``, and the features ``features.json`` names fire on words of
their category far more often than elsewhere. ``features.json`` only says which feature to check
for which category; every figure is recomputed here. The word lists come from the generator's
tables, labelled here independently of the training script.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

import interp_engine
from interp_engine import Sae, UnsupportedSae, load_model, load_sae, run_with_cache
from interp_engine._shipped import resolve_sae, shipped_saes
from interp_testkit.suite import ROOT

SCRIPTS = ROOT / "packages" / "interp-core" / "scripts"
FRESH_SEED = 2024  # the corpus is seed 5, the training script's held-out text seed 1005
FRESH_DOCS = 300


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tiny_corpus", SCRIPTS / "make_tiny_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _categories(gen: ModuleType) -> dict[str, set[str]]:
    """Words of each category the generator fills its templates with, by the names features.json uses."""
    countries = gen.COUNTRIES
    return {
        "country": {c[0] for c in countries},
        "capital city": {c[1] for c in countries},
        "language": {c[2] for c in countries},
        "continent": {word for c in countries for word in c[3].split()},
        "person name": set(gen.NAMES),
        "animal": set(gen.ANIMALS) | {a + "s" for a in gen.ANIMALS},
        "object": set(gen.THINGS) | {t + "s" for t in gen.THINGS},
        "adjective": set(gen.ADJECTIVES),
        "weather": set(gen.WEATHER),
        "number": {str(n) for n in range(100)},
        "place": {p.split()[-1] for p in gen.PLACES},
    }


def _folder() -> pathlib.Path:
    return pathlib.Path(resolve_sae("interp:tiny-sae"))


@functools.cache
def _report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads((_folder() / "features.json").read_text(encoding="utf-8"))
    return report


@functools.cache
def _sae() -> Sae:
    return load_sae(resolve_sae("interp:tiny-sae"))


@functools.cache
def _fresh() -> tuple[torch.Tensor, list[str]]:
    """``resid_post`` at the SAE's layer for every token of fresh generated documents ``[n, d_model]``,
    and each token's text without its leading space."""
    model = load_model("interp:tiny", backend="eager")
    point = str(_sae().address)
    rows = [model.to_tokens(doc)[0].tolist() for doc in _generator().documents(FRESH_DOCS, seed=FRESH_SEED)]
    cache = run_with_cache(model, rows, [point])
    assert cache.lengths is not None
    acts = torch.cat([cache[point][i, :n] for i, n in enumerate(cache.lengths.tolist())])
    words = [model.to_string([t]).strip() for row in rows for t in row]
    assert acts.shape == (len(words), 128)
    return acts, words


@functools.cache
def _codes() -> torch.Tensor:
    return _sae().encode(_fresh()[0])


# -- the name, the files ------------------------------------------------------------------------


def test_the_name_resolves_to_the_shipped_folder() -> None:
    folder = _folder()
    assert folder.is_dir() and folder.parent.name == "models"
    assert folder.parent.parent == pathlib.Path(interp_engine.__file__).resolve().parent
    assert shipped_saes() == {"interp:tiny-sae": folder}
    assert resolve_sae(folder) == str(folder)  # a path passes through
    assert resolve_sae("some/local/sae") == "some/local/sae"
    with pytest.raises(UnsupportedSae, match="interp:tiny-sae") as info:
        resolve_sae("interp:huge-sae")
    assert "interp:huge-sae" in str(info.value)


def test_the_shipped_files_are_a_small_float32_topk_sae_on_a_middle_layer() -> None:
    folder = _folder()
    weights = folder / "sae_weights.safetensors"
    assert weights.stat().st_size < 3_000_000
    with safe_open(weights, framework="pt") as f:
        shapes = {name: tuple(f.get_tensor(name).shape) for name in f.keys()}  # noqa: SIM118 (not a dict)
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    assert dtypes == {torch.float32}
    sae = _sae()
    assert sae.architecture == "topk" and sae.k is not None
    assert sae.d_in == 128 and 256 <= sae.d_sae <= 2048
    assert shapes == {"W_enc": (128, sae.d_sae), "b_enc": (sae.d_sae,), "W_dec": (sae.d_sae, 128), "b_dec": (128,)}
    assert sae.address.kind == "resid_post" and sae.address.layer in (1, 2)
    report = _report()
    assert report["layer"] == sae.address.layer and report["hook_name"] == sae.hook_name
    assert (report["d_sae"], report["k"]) == (sae.d_sae, sae.k)


def test_the_shipped_sae_comes_from_the_scripts_defaults() -> None:
    """``features.json`` records the run; it must be the script's default run (what the docs say to rerun)."""
    spec = importlib.util.spec_from_file_location("train_tiny_sae", SCRIPTS / "train_tiny_sae.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    defaults = {k: v for k, v in vars(script.parse_args([])).items() if k != "out"}
    assert _report()["arguments"] == defaults


def test_sae_lens_reads_the_shipped_folder_and_encodes_the_same() -> None:
    from sae_lens import SAE

    reference = SAE.load_from_disk(str(_folder()), device="cpu")
    x = _fresh()[0][:200]
    with torch.no_grad():
        codes = reference.encode(x)
        assert torch.allclose(codes, _sae().encode(x), atol=1e-5)
        assert torch.allclose(reference.decode(codes), _sae().reconstruct(x), atol=1e-4)


# -- reconstruction and sparsity on fresh text ----------------------------------------------------


def test_it_reconstructs_resid_post_on_fresh_text() -> None:
    """Measured when shipped: FVE 0.991 on this text (0.991 on the script's held-out text)."""
    x = _fresh()[0]
    x_hat = _sae().decode(_codes())
    fve = 1 - float((x - x_hat).pow(2).sum() / (x - x.mean(dim=0)).pow(2).sum())
    assert fve > 0.97, f"fraction of variance explained {fve:.4f}"
    assert torch.allclose(_sae().reconstruct(x), x_hat)


def test_few_features_are_dead_and_codes_are_sparse() -> None:
    """Measured when shipped: 2.4% of the features never fire on these ~16,000 tokens; L0 16 (= k)."""
    fires = _codes() > 0
    dead = float((~fires.any(dim=0)).float().mean())
    assert dead < 0.06, f"dead fraction {dead:.4f}"
    l0 = fires.sum(dim=1).float()
    k = _sae().k
    assert k is not None
    assert float(l0.max()) <= k and 0.75 * k <= float(l0.mean()) <= k, f"mean L0 {float(l0.mean()):.2f}"


# -- the named features ----------------------------------------------------------------------------


def _firing(feature: int, category: str) -> dict[str, float]:
    """Precision and recall of "feature fires" for "the token is a word of category", and the lift:
    how many times more often it fires on the category's tokens than on other tokens."""
    _, words = _fresh()
    vocabulary = _categories(_generator())[category]
    labels = torch.tensor([w in vocabulary for w in words])
    fires = _codes()[:, feature] > 0
    both = float((fires & labels).sum())
    return {
        "precision": both / max(1.0, float(fires.sum())),
        "recall": both / float(labels.sum()),
        "lift": float(fires[labels].float().mean()) / max(1e-9, float(fires[~labels].float().mean())),
    }


def test_features_json_names_features_for_the_generators_categories() -> None:
    report = _report()
    named = report["features"]
    assert len(named) >= 3, named
    assert {n["category"] for n in named} <= set(_categories(_generator()))
    assert all(0 <= n["feature"] < _sae().d_sae and n["top_tokens"] for n in named)
    assert [n["f1"] for n in named] == sorted((n["f1"] for n in named), reverse=True)


def test_the_best_named_feature_fires_on_its_category() -> None:
    """Measured when shipped: 'country', feature 813: precision 0.90, recall 0.86, lift about 150."""
    best = _report()["features"][0]
    got = _firing(best["feature"], best["category"])
    assert got["precision"] > 0.75 and got["recall"] > 0.7, (best["category"], got)
    assert got["lift"] > 50, (best["category"], got)


def test_each_named_feature_fires_on_its_category_far_more_than_elsewhere() -> None:
    """Measured when shipped (precision / recall / lift): country 0.90 / 0.86 / 153, place 0.64 /
    0.82 / 53, person name 0.60 / 0.75 / 28, animal 0.58 / 0.59 / 63, adjective 0.52 / 0.57 / 43,
    object 0.44 / 0.67 / 16. Each is also the best single feature for its category on this text,
    or close to it."""
    fires = _codes() > 0
    _, words = _fresh()
    cats = _categories(_generator())
    failures = []
    for feature in _report()["features"]:
        got = _firing(feature["feature"], feature["category"])
        labels = torch.tensor([w in cats[feature["category"]] for w in words]).float()
        f1 = 2 * (fires.float().T @ labels) / (fires.sum(dim=0) + labels.sum())
        got["f1 / best f1"] = float(f1[feature["feature"]] / f1.max())
        if got["precision"] < 0.3 or got["recall"] < 0.4 or got["lift"] < 8 or got["f1 / best f1"] < 0.8:
            failures.append((feature["category"], feature["feature"], got))
    assert not failures, failures


# -- the training script -------------------------------------------------------------------------


@pytest.mark.slow
def test_the_training_script_runs_end_to_end(tmp_path: pathlib.Path) -> None:
    """A few steps of the real script at one layer (its data, loop, measures, naming and save), then load the result."""
    out = tmp_path / "sae"
    args = ["--out", str(out), "--layer", "2", "--steps", "20", "--d-sae", "256", "--k", "8", "--log-every", "10"]
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "train_tiny_sae.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert results[0].startswith("RESULT layer=2 address=resid_post.2 d_in=128 d_sae=256 k=8"), run.stdout
    assert any(line.startswith("RESULT fve=") for line in results), run.stdout
    assert sum(line.startswith("RESULT feature category=") for line in results) == len(_categories(_generator()))
    sae = load_sae(out)
    assert (sae.architecture, sae.k, sae.d_sae, str(sae.address)) == ("topk", 8, 256, "resid_post.2")
    report = json.loads((out / "features.json").read_text(encoding="utf-8"))
    assert report["layer"] == 2 and report["arguments"]["steps"] == 20
    assert 0 <= report["dead_fraction"] <= 1 and report["mean_l0"] <= 8
