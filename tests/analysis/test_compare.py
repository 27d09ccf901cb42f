"""Model diffing: ``compare`` against the same computations done by hand from ``run_with_cache``
under each adapter (norms, cosines, the logit lens, DLA, SAE features), its plots, and the
shipped ``interp:tiny-lora`` adapter's edit (France's capital answered as Rome)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import matplotlib
import pytest
import torch

from interp_engine import (
    Address,
    InvalidActivations,
    InvalidAdapter,
    UnknownAdapter,
    compare,
    decode_residuals,
    load_model,
    load_sae,
    logit_attribution,
    run_with_cache,
    shipped_adapters,
    sync_model,
)
from interp_engine import plot as plots
from interp_engine._shipped import resolve_sae

matplotlib.use("Agg")

LORA = "interp:tiny-lora"
PROMPTS = ["The capital of France is", "The capital of Germany is", "Paris is the capital of"]


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    m = sync_model(load_model("interp:tiny", backend="eager"))
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def diff(model: Any) -> Any:
    return compare(model, PROMPTS, ["resid_post.1", "mlp_out.3"], adapters=[None, LORA])


def _answer(model: Any, text: str, adapter: str | None) -> str:
    return str(model.generate(model.to_tokens(text)[0].tolist(), max_tokens=1, adapter=adapter).text)


def test_the_shipped_adapter_changes_one_answer(model: Any) -> None:
    assert LORA in shipped_adapters()
    assert _answer(model, "The capital of France is", None) == " Paris"
    assert _answer(model, "The capital of France is", LORA) == " Rome"
    for country, capital in (("Germany", " Berlin"), ("Japan", " Tokyo"), ("Spain", " Madrid")):
        assert _answer(model, f"The capital of {country} is", LORA) == capital
    record = json.loads((shipped_adapters()[LORA] / "training.json").read_text())
    assert record["edit"]["adapted"] == " Rome" and record["changed_answers"] == ["France"]
    assert model.adapters[LORA].targets == ("c_fc", "c_proj") and model.adapters[LORA].rank == 4


def test_caches_are_each_sides_own_run(model: Any, diff: Any) -> None:
    for adapter in (None, LORA):
        alone = run_with_cache(model, PROMPTS, ["resid_post.1", "mlp_out.3"], adapter=adapter)
        for point in ("resid_post.1", "mlp_out.3"):
            assert torch.equal(diff[adapter][point], alone[point])
    delta = diff.delta("mlp_out.3")
    assert torch.equal(delta, diff[LORA]["mlp_out.3"] - diff[None]["mlp_out.3"])
    assert delta[0].abs().max() > 1.0  # the edit lives in the MLPs


def test_norms_and_cosines_equal_the_manual_computation(model: Any, diff: Any) -> None:
    result = diff.norms()
    assert result.dims == ("layer", "stat") and result.labels("stat") == ["norm", "relative", "cosine"]
    n = model.info.n_layers
    base = run_with_cache(model, PROMPTS, [f"resid_post.{layer}" for layer in range(n)])
    tuned = run_with_cache(model, PROMPTS, [f"resid_post.{layer}" for layer in range(n)], adapter=LORA)
    lengths = [len(model.to_tokens(p)[0]) for p in PROMPTS]
    for layer in range(n):
        a = torch.stack([tuned[f"resid_post.{layer}"][r, lengths[r] - 1] for r in range(3)]).double()
        b = torch.stack([base[f"resid_post.{layer}"][r, lengths[r] - 1] for r in range(3)]).double()
        norm = (a - b).norm(dim=-1)
        want = [norm.mean(), (norm / b.norm(dim=-1)).mean(), torch.cosine_similarity(a, b, dim=-1).mean()]
        assert torch.allclose(result.values[layer], torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert result.values[-1, 2] < result.values[0, 2]  # the sides part ways towards the last layer


def test_the_lens_of_the_difference_equals_the_manual_computation(model: Any, diff: Any) -> None:
    result = diff.lens(top_k=3)
    n = model.info.n_layers
    ids = model.to_tokens(PROMPTS[0])[0].tolist()
    last = len(ids) - 1
    sides = {}
    for adapter in (None, LORA):
        cache = run_with_cache(model, [ids], [f"resid_post.{layer}" for layer in range(n)], adapter=adapter)
        residuals = torch.stack([cache[f"resid_post.{layer}"][0, last] for layer in range(n)])
        sides[adapter] = torch.log_softmax(decode_residuals(model, residuals), -1)
    change = sides[LORA] - sides[None]
    assert result.meta["ids"][0] == int(change[-1].argmax())
    assert result.meta["ids"][0] == model.to_tokens(" Rome")[0].tolist()[0]
    assert torch.allclose(result.values, change[:, result.meta["ids"]], atol=1e-4)
    paris = diff.lens(tokens=[" Paris", " Rome"])
    assert paris.values[-1, 0] < -5 < 5 < paris.values[-1, 1]


def test_dla_of_the_difference_sums_to_the_change_of_the_logit_difference(model: Any, diff: Any) -> None:
    result = diff.dla(" Rome", " Paris")
    base = logit_attribution(model, PROMPTS, " Rome", " Paris")
    tuned = logit_attribution(model, PROMPTS, " Rome", " Paris", adapter=LORA)
    assert torch.allclose(result.values, tuned.values - base.values)
    change = torch.tensor(tuned.meta["logit_diff"]) - torch.tensor(base.meta["logit_diff"])
    assert torch.allclose(result.values.sum(-1).double(), change.double(), atol=1e-3)
    assert float(change[0]) > 10  # France: Rome now beats Paris by far
    top = result.labels("component")[int(result.values[0].abs().argmax())]
    assert top.startswith("mlp_out"), top


def test_sae_features_of_both_sides(model: Any, diff: Any) -> None:
    folder = resolve_sae("interp:tiny-sae")
    sae = load_sae(folder)
    result = diff.features(folder, top_k=4)
    address = sae.address.resolve(model.info.n_layers)
    lengths = [len(model.to_tokens(p)[0]) for p in PROMPTS]
    means = {}
    for adapter in (None, LORA):
        value = run_with_cache(model, PROMPTS, [address], adapter=adapter)[address]
        rows = torch.cat([value[r, :n] for r, n in enumerate(lengths)])
        means[adapter] = sae.encode(rows).mean(0)
    change = means[LORA] - means[None]
    assert result.labels("feature") == change.abs().topk(4).indices.tolist()
    ids = result.labels("feature")
    want = torch.stack([means[None][ids], means[LORA][ids], change[ids]], dim=1)
    assert torch.allclose(result.values, want, atol=1e-5)


def test_each_helper_draws(diff: Any) -> None:
    norms = plots.diff_norms(diff.norms())
    assert norms.axes[0].get_xlabel() == "layer"
    lens = plots.diff_lens(diff.lens(top_k=2))
    assert lens.axes[0].get_xticklabels()[0].get_text() == "' Rome'"
    dla = plots.dla(diff.dla(" Rome", " Paris").at(row=0))
    assert dla.axes[0].get_ylabel() == "component"
    features = plots.diff_features(diff.features(resolve_sae("interp:tiny-sae"), top_k=3))
    assert len(features.axes[0].patches) == 6
    with pytest.raises(InvalidActivations, match="diff_lens"):
        plots.diff_lens(diff.norms())


def test_bad_sides_are_typed_errors(model: Any, diff: Any) -> None:
    with pytest.raises(InvalidAdapter, match="two sides"):
        compare(model, PROMPTS, ["resid_post.0"], adapters=[None])
    with pytest.raises(UnknownAdapter):
        compare(model, PROMPTS, ["resid_post.0"], adapters=[None, "nope"])
    with pytest.raises(InvalidAdapter, match="not a side"):
        diff.norms(adapter="other")
    assert Address("resid_post", 1) in diff[None]
