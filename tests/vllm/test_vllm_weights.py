"""Weights and direct logit attribution on the vllm backend, from the served weights.

The session's engines (``vllm_engines``: GPT-2 and Llama at TP=1, Llama at TP=2 as in
test_vllm_tp.py) are reused, none is started for this module alone. Each weight equals the HF
parameter (named by hand, as in test_weights.py) on the same checkpoint: at TP=2 the workers'
vocabulary-parallel shards of ``W_E``/``W_U`` and row-parallel shards of ``W_O`` are joined in the
front end. The vllm-static, pipeline-parallel and other families' weights are checked beside their
engines (test_vllm_static.py, test_vllm_pp.py, test_vllm_families.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import Address, LayerOutOfRange, UnknownWeight, load_model, logit_attribution, sync_model, weights
from interp_testkit.suite import PROMPT, vllm_model_path

from ..support.weights import hf_parameters

ANSWER, WRONG = 5, 7
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    "llama-tp2": ("llama", {"tensor_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def eager_twins() -> dict[str, Any]:
    return {family: sync_model(load_model(vllm_model_path(family), backend="eager")) for family in ("gpt2", "llama")}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_served_weights_equal_hf(vllm_engines: Any, eager_twins: dict[str, Any], engine: str) -> None:
    family, args = ENGINES[engine]
    model = vllm_engines(family, **args)
    assert model.model.tp_size == args.get("tensor_parallel_size", 1)
    w = weights(model)
    n = model.info.n_layers
    for layer in range(n):
        expected = hf_parameters(family, layer)
        assert torch.equal(w.W_O(layer), expected["W_O"]), layer
        if "b_O" in expected:
            assert torch.equal(w.b_O(layer), expected["b_O"])  # type: ignore[arg-type]
    expected = hf_parameters(family, 0)
    assert torch.equal(w.W_E, expected["W_E"])
    assert torch.equal(w.W_U, expected["W_U"])
    for name in ("ln_final.w", "ln_final.b", "b_O"):
        assert (name in w.names) == (name in expected), name
    assert torch.equal(w.get("ln_final.w"), expected["ln_final.w"])
    twin = weights(eager_twins[family])
    assert w.layout == twin.layout  # kind, eps, offset, tied, scale, soft-cap, names: as eager resolves them
    ids = [3, 300, 511, 3]  # across both vocabulary shards at TP=2, one twice
    assert torch.equal(w.get("W_U", vocab=ids), expected["W_U"][:, ids])
    assert torch.equal(w.get("W_E", vocab=ids), expected["W_E"][ids])
    with pytest.raises(UnknownWeight, match="unknown weight"):
        w.get("W_K")
    with pytest.raises(LayerOutOfRange):
        w.W_O(n)


def test_vllm_dla_equals_eager(vllm_engines: Any, eager_twins: dict[str, Any]) -> None:
    model = vllm_engines("gpt2")
    eager = eager_twins["gpt2"]
    prompts = [PROMPT, "A shorter prompt"]
    for heads in (False, True):
        got = logit_attribution(model, prompts, ANSWER, WRONG, heads=heads)
        expected = logit_attribution(eager, prompts, ANSWER, WRONG, heads=heads)
        assert got.labels("component") == expected.labels("component")
        assert torch.allclose(got.values, expected.values, atol=1e-4)
        ids = model.to_tokens(PROMPT)[0].tolist()
        real = model.capture(ids, [Address("logits")])[Address("logits")][-1]
        assert abs(float(got.values[0].sum()) - float(real[ANSWER] - real[WRONG])) <= 1e-4


def test_tp2_dla_equals_tp1(vllm_engines: Any) -> None:
    one = logit_attribution(vllm_engines("llama"), PROMPT, ANSWER, WRONG, heads=True)
    two = logit_attribution(vllm_engines("llama", tensor_parallel_size=2), PROMPT, ANSWER, WRONG, heads=True)
    assert torch.allclose(one.values, two.values, atol=1e-4)
    assert abs(float(two.values.sum()) - two.meta["logit_diff"]) <= 1e-4
