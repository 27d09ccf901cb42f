"""Granite with ``residual_multiplier != 1``: each sublayer's output is scaled before the residual
add, and ``attn_out``/``mlp_out`` are what is added (after the multiplier) on every backend, so the
documented ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out`` hold, the
decomposition and the per-head split are exact (the split folds the multiplier, from
``WeightInfo.residual_multiplier``), and a write at ``attn_out`` sets what the residual receives.
The vllm backend equals eager on the same weights."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    SteeringSpec,
    Write,
    decompose_resid,
    load_model,
    logit_attribution,
    run_with_cache,
    sync_model,
    weights,
)
from interp_testkit.suite import MODELS, rel_diff, tiny_model_path, vllm_model_path

from ..support.engines import started_engine

MULTIPLIER = 0.5
TOL = 1e-5
IDS = [5, 9, 17, 33, 8, 70, 12]
ANSWER, WRONG = 11, 23


def _build(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """``source``'s Granite (config, weights, tokenizer) with the residual multiplier set."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    config = AutoConfig.from_pretrained(source)
    config.residual_multiplier = MULTIPLIER
    hf = AutoModelForCausalLM.from_pretrained(source, config=config)
    tmp = out.with_name(out.name + ".tmp")
    hf.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(out)
    return out


@functools.cache
def granite_path() -> pathlib.Path:
    return _build(tiny_model_path("granite"), MODELS / "granite-residual-multiplier")


@functools.cache
def eager() -> Any:
    return sync_model(load_model(granite_path(), backend="eager"))


def _hf_sublayers(path: pathlib.Path, ids: list[int]) -> dict[str, torch.Tensor]:
    """HF's own attention and MLP outputs per layer (before the multiplier) and hidden states."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"attn{i}", o[0])))
        handles.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"mlp{i}", o)))
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    for handle in handles:
        handle.remove()
    seen.update({f"hidden{i}": h[0] for i, h in enumerate(out.hidden_states)})
    seen["logits"] = out.logits[0]
    return {k: v[0] if v.dim() == 3 else v for k, v in seen.items()}


def test_the_multiplier_is_resolved_and_served() -> None:
    model = eager()
    assert model.model.family.residual_multiplier == MULTIPLIER
    assert model.model.family.logit_multiplier != 0
    assert {"resid_mid", "attn_out", "mlp_out"} <= set(model.points())
    assert weights(model).layout.residual_multiplier == MULTIPLIER


def test_attn_out_and_mlp_out_are_what_the_residual_receives() -> None:
    model = eager()
    n = model.info.n_layers
    points = ["logits"] + [f"{k}.{i}" for i in range(n) for k in ("resid_pre", "resid_mid", "resid_post")]
    points += [f"{k}.{i}" for i in range(n) for k in ("attn_out", "mlp_out")]
    got = run_with_cache(model, [IDS], points)
    hf = _hf_sublayers(granite_path(), IDS)
    for i in range(n):
        assert rel_diff(got[f"attn_out.{i}"][0], MULTIPLIER * hf[f"attn{i}"]) <= TOL
        assert rel_diff(got[f"mlp_out.{i}"][0], MULTIPLIER * hf[f"mlp{i}"]) <= TOL
        resid_pre, resid_mid = got[f"resid_pre.{i}"][0], got[f"resid_mid.{i}"][0]
        assert rel_diff(resid_mid, resid_pre + got[f"attn_out.{i}"][0]) <= TOL
        assert rel_diff(got[f"resid_post.{i}"][0], resid_mid + got[f"mlp_out.{i}"][0]) <= TOL
        assert rel_diff(got[f"resid_post.{i}"][0], hf[f"hidden{i + 1}"]) <= TOL or i == n - 1
    assert rel_diff(got["logits"][0], hf["logits"]) <= TOL


def test_a_write_at_attn_out_sets_what_the_residual_receives() -> None:
    model = eager()
    vector = torch.randn(model.info.d_model, generator=torch.Generator().manual_seed(0))
    spec = SteeringSpec([Write("attn_out.1", vector, op="set")])
    got = run_with_cache(model, [IDS], ["attn_out.1", "resid_pre.1", "resid_mid.1"], steering_spec=spec)
    assert rel_diff(got["attn_out.1"][0], vector.expand(len(IDS), -1)) <= TOL
    assert rel_diff(got["resid_mid.1"][0], got["resid_pre.1"][0] + vector) <= TOL


@pytest.mark.parametrize("heads", [False, True])
def test_the_decomposition_and_attribution_are_exact(heads: bool) -> None:
    model = eager()
    split = decompose_resid(model, [IDS], heads=heads)
    assert split.meta["residual_error"] <= 1e-5
    result = logit_attribution(model, [IDS], ANSWER, WRONG, heads=heads)
    logits = run_with_cache(model, [IDS], ["logits"])["logits"][0, -1]
    expected = float(logits[ANSWER] - logits[WRONG])
    assert abs(float(result.values.sum()) - expected) <= 1e-4
    assert abs(result.meta["logit_diff"] - expected) <= 1e-5


@functools.cache
def granite_vllm_path() -> pathlib.Path:
    return _build(vllm_model_path("granite"), MODELS / "granite-residual-multiplier-vllm")


def test_the_vllm_resolver_reads_the_multiplier_of_each_sublayer() -> None:
    """vLLM's module tree (no engine): both contributions' multiplier, applied where each is added."""
    from interp_vllm.model._resolve import resolve_without_weights
    from interp_vllm.model._sites import SITES, added_scale

    family = resolve_without_weights(str(granite_vllm_path()), {"dtype": "float32"})
    assert (family.attn_scale, family.mlp_scale) == (MULTIPLIER, MULTIPLIER)
    scales = {kind: added_scale(SITES[kind], family) for kind in ("attn_out", "mlp_out", "attn_out_post", "attn_z")}
    assert scales == {"attn_out": MULTIPLIER, "mlp_out": MULTIPLIER, "attn_out_post": 1.0, "attn_z": 1.0}


def test_the_vllm_backend_equals_eager() -> None:
    path = granite_vllm_path()
    twin = sync_model(load_model(path, backend="eager"))
    model = started_engine(path)
    try:
        n = model.info.n_layers
        points = [f"{k}.{i}" for i in range(n) for k in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")]
        ids = IDS
        got, want = run_with_cache(model, [ids], points), run_with_cache(twin, [ids], points)
        for point in points:
            assert rel_diff(got[point][0], want[point][0]) <= 1e-4, point
        for i in range(n):
            assert rel_diff(got[f"resid_mid.{i}"][0], got[f"resid_pre.{i}"][0] + got[f"attn_out.{i}"][0]) <= 1e-4
        vector = torch.randn(model.info.d_model, generator=torch.Generator().manual_seed(0))
        spec = SteeringSpec([Write(Address("attn_out", 1), vector, op="set")])
        steered = run_with_cache(model, [ids], ["resid_mid.1", "resid_post.2"], steering_spec=spec)
        twin_steered = run_with_cache(twin, [ids], ["resid_mid.1", "resid_post.2"], steering_spec=spec)
        for point in ("resid_mid.1", "resid_post.2"):
            assert rel_diff(steered[point][0], twin_steered[point][0]) <= 1e-4, point
        for heads in (False, True):
            a = logit_attribution(model, [ids], ANSWER, WRONG, heads=heads)
            b = logit_attribution(twin, [ids], ANSWER, WRONG, heads=heads)
            assert a.labels("component") == b.labels("component")
            assert torch.allclose(a.values, b.values, atol=1e-3, rtol=0)
    finally:
        model.shutdown()
