"""Read-only weight access on the eager backend: ``weights(model)`` equals the HF model's own
parameters, named here per family by hand (not through the backend's resolution): GPT-2's
``Conv1D`` (tied, LayerNorm with bias, ``b_O``), Llama (grouped-query attention, untied, RMSNorm),
GPT-NeoX and Phi-3 (fused q/k/v), Falcon (multi-query, tied), Gemma 2 (a ``1 + w`` norm, a logit
soft-cap), Phi (an unembedding bias) and Cohere (a logit scale). The vLLM backends' weights are
checked in test_vllm_weights.py and beside the engines of test_vllm_families/static/pp."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (
    WEIGHT_NAMES,
    InterpError,
    InvalidOption,
    InvalidTokens,
    LayerOutOfRange,
    UnknownWeight,
    UnsupportedOperation,
    Weights,
    load_model,
    sync_model,
    tiny_model_path,
    weights,
)
from interp_testkit.suite import hf_oracle

from ..support.engines import eager_model
from ..support.weights import HF_NAMES, _module


def hf_weights(family: str, layer: int) -> dict[str, torch.Tensor]:
    """The HF parameters behind each weight name, read by hand."""
    hf = hf_oracle(family)
    names = HF_NAMES[family]
    config = hf.config
    n_heads = int(config.num_attention_heads)
    d_model = int(config.hidden_size)
    d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
    o = _module(hf, names["o"].format(layer))
    matrix = o.weight if names.get("conv1d") else o.weight.T  # [n_heads * d_head, d_model]
    unembed = _module(hf, names["unembed"])
    norm = _module(hf, names["norm"])
    out = {
        "W_E": _module(hf, names["embed"]).weight,
        "W_U": unembed.weight.T,
        "W_O": matrix.reshape(n_heads, d_head, d_model),
        "ln_final.w": norm.weight,
    }
    for name, value in (("b_U", unembed.bias), ("b_O", o.bias), ("ln_final.b", getattr(norm, "bias", None))):
        if value is not None:
            out[name] = value
    return {name: value.detach() for name, value in out.items()}


@pytest.mark.parametrize("family", list(HF_NAMES))
def test_weights_equal_the_hf_parameters(family: str) -> None:
    model = eager_model(family)
    w = weights(model)
    names = HF_NAMES[family]
    n = model.info.n_layers
    for layer in range(n):
        expected = hf_weights(family, layer)
        assert torch.equal(w.W_O(layer), expected["W_O"]), layer
        assert w.W_O(layer - n) is w.W_O(layer)  # a negative layer counts from the end, kept once
        if "b_O" in expected:
            assert torch.equal(w.b_O(layer), expected["b_O"])  # type: ignore[arg-type]
        else:
            assert w.b_O(layer) is None and "b_O" not in w.names
    expected = hf_weights(family, 0)
    assert torch.equal(w.W_E, expected["W_E"])
    assert torch.equal(w.W_U, expected["W_U"])
    assert w.W_E.shape == (model.info.vocab_size, model.info.d_model)
    assert w.W_U.shape == (model.info.d_model, model.info.vocab_size)
    assert w.W_O().shape == (n, model.info.n_heads, model.info.d_head, model.info.d_model)
    for name in ("b_U", "ln_final.w", "ln_final.b"):
        if name in expected:
            assert torch.equal(w.get(name), expected[name]), name
        else:
            assert name not in w.names
    assert (w.b_U is None) == ("b_U" not in expected)
    layout = w.layout
    assert layout.norm == names["kind"]
    assert layout.norm_weight_offset == names.get("offset", 0.0)
    hf_norm = _module(hf_oracle(family), names["norm"])
    assert layout.norm_eps == (getattr(hf_norm, "eps", None) or getattr(hf_norm, "variance_epsilon", None))
    assert layout.tied == names.get("tied", False)
    assert layout.tied == torch.equal(w.W_U, w.W_E.T)
    assert layout.logit_scale == names.get("scale", 1.0)
    assert layout.logit_softcap == names.get("softcap")
    assert layout.dtype == "float32"
    for value in (w.W_E, w.W_U, w.W_O(0)):
        assert value.dtype == torch.float32 and value.device.type == "cpu"


@pytest.mark.parametrize("family", list(HF_NAMES))
def test_the_final_norm_is_described_so_that_applying_it_equals_hf(family: str) -> None:
    """``w.final_norm(x)`` (kind, eps, weight, bias, Gemma's offset) is what HF's norm computes."""
    norm = weights(eager_model(family)).final_norm
    hf_norm = _module(hf_oracle(family), HF_NAMES[family]["norm"])
    x = torch.randn(5, eager_model(family).info.d_model, generator=torch.Generator().manual_seed(1)) * 2 + 0.3
    with torch.no_grad():
        expected = hf_norm(x)
    assert torch.allclose(norm(x), expected, atol=1e-5, rtol=1e-5)
    if HF_NAMES[family].get("offset"):  # the stored weight is the difference from 1
        assert norm.scale is not None and norm.weight is not None
        assert torch.equal(norm.scale, norm.weight + 1.0)


def test_vocab_entries_are_fetched_alone() -> None:
    w = weights(eager_model("phi"))
    ids = [7, 3, 7, 400]
    assert torch.equal(w.get("W_U", vocab=ids), w.W_U[:, ids])
    assert torch.equal(w.get("W_E", vocab=ids), w.W_E[ids])
    assert torch.equal(w.get("b_U", vocab=ids), w.b_U[ids])  # type: ignore[index]
    assert torch.equal(w.logit_direction(7, 3), w.W_U[:, 7] - w.W_U[:, 3])
    assert torch.equal(w.logit_direction(7), w.W_U[:, 7])


def test_weights_are_copies_the_model_never_sees_changed() -> None:
    model = eager_model("llama")
    w = Weights(model)
    before = hf_weights("llama", 1)["W_O"].clone()
    w.W_O(1).zero_()
    w.W_U.zero_()
    assert torch.equal(hf_weights("llama", 1)["W_O"], before)
    assert torch.equal(Weights(model).W_O(1), before)


def test_unknown_names_and_bad_layers_are_typed_errors() -> None:
    model = eager_model("llama")
    w = weights(model)
    with pytest.raises(UnknownWeight, match="unknown weight 'W_Q'") as unknown:
        w.get("W_Q")
    assert unknown.value.valid == w.names and isinstance(unknown.value, KeyError)
    assert str(unknown.value).startswith("unknown weight")  # not quoted as a KeyError would be
    with pytest.raises(UnknownWeight, match=r"no b_U .*bias"):
        w.get("b_U")
    w.W_O(0)  # kept: a layer out of range must not find it
    with pytest.raises(LayerOutOfRange, match=r"valid layers are -3\.\.2"):
        w.W_O(3)
    with pytest.raises(LayerOutOfRange):
        w.W_O(-4)
    with pytest.raises(InvalidOption, match="per layer"):
        w.get("W_O")
    with pytest.raises(InvalidOption, match="takes no layer"):
        w.get("W_E", 0)
    with pytest.raises(InvalidOption, match="no vocabulary axis"):
        w.get("W_O", 0, vocab=[1])
    with pytest.raises(InvalidTokens, match="outside the vocabulary"):
        w.get("W_U", vocab=[512])
    with pytest.raises(InvalidTokens, match=r"is \d+ tokens; give one token"):
        w.logit_direction(" quick brown")
    assert set(w.names) <= set(WEIGHT_NAMES)


def test_the_shipped_model_through_the_sync_facade() -> None:
    model = load_model("interp:tiny", backend="eager")
    facade = sync_model(model)
    w = weights(facade)
    assert w.W_O(1).shape == (4, 32, 128) and w.W_U.shape == (128, model.info.vocab_size)
    assert torch.equal(facade.weight("W_O", 1), w.W_O(1))  # the async method through the facade
    assert w.layout.tied and torch.equal(w.W_U, w.W_E.T)
    assert "ln_final.b" in w.names and w.final_norm.kind == "layernorm"
    assert "W_U" in repr(w)
    assert tiny_model_path().is_dir()
    facade.shutdown()


def test_a_backend_without_weight_access_says_so() -> None:
    toy = load_model("toy-model", backend="toy")
    try:
        with pytest.raises(UnsupportedOperation, match="toy backend does not expose its weights") as refused:
            weights(toy)
        assert isinstance(refused.value, InterpError)
    finally:
        sync_model(toy).shutdown()
