"""Residual decomposition and direct logit attribution on the eager backend, against HF.

The oracle is written here by hand on the HF model: forward pre-hooks on each layer's output
projection (its input, split by head, is every head's output) and on the final norm (its input is
the residual leaving the last layer), ``W_O``/``W_U`` read from the HF parameters, and the final
norm applied as TransformerLens does (the whole residual's scale on every component). The vLLM
backends' DLA is checked against eager's in test_vllm_weights.py and test_vllm_families.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    InvalidOption,
    InvalidTokens,
    Labelled,
    UnsupportedArchitecture,
    UnsupportedOperation,
    accumulated_resid,
    decode_residuals,
    decompose_resid,
    load_model,
    logit_attribution,
    run_with_cache,
    weights,
)
from interp_testkit.suite import PROMPT, hf_oracle, rel_diff, tiny_model_path

from ..support.engines import eager_model

ANSWER, WRONG = 5, 7
HF_PARTS: dict[str, tuple[str, str, str, bool]] = {
    # output projection per layer, final norm, unembedding, whether the projection is a Conv1D
    "gpt2": ("transformer.h.{}.attn.c_proj", "transformer.ln_f", "lm_head", True),
    "llama": ("model.layers.{}.self_attn.o_proj", "model.norm", "lm_head", False),
    "phi": ("model.layers.{}.self_attn.dense", "model.final_layernorm", "lm_head", False),
    "cohere": ("model.layers.{}.self_attn.o_proj", "model.norm", "lm_head", False),
    "gemma2": ("model.layers.{}.self_attn.o_proj", "model.norm", "lm_head", False),
    "olmo2": ("model.layers.{}.self_attn.o_proj", "model.norm", "lm_head", False),
}


def _module(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _ids(family: str, text: str = PROMPT) -> list[int]:
    ids: list[int] = eager_model(family).to_tokens(text)[0].tolist()
    return ids


def hf_run(family: str, ids: list[int]) -> dict[str, Any]:
    """HF's forward with the heads' outputs, the last residual and the unembedding's input hooked."""
    hf = hf_oracle(family)
    o_path, norm_path, unembed_path, _ = HF_PARTS[family]
    seen: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            seen[name] = args[0].detach()[0]

        return hook

    n = int(hf.config.num_hidden_layers)
    for layer in range(n):
        handles.append(_module(hf, o_path.format(layer)).register_forward_pre_hook(keep(f"z{layer}")))
    handles.append(_module(hf, norm_path).register_forward_pre_hook(keep("resid")))
    handles.append(_module(hf, unembed_path).register_forward_pre_hook(keep("normed")))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return {**seen, "logits": out.logits[0], "embed": out.hidden_states[0][0]}


def hf_w_o(family: str, layer: int) -> torch.Tensor:
    hf = hf_oracle(family)
    o_path, _, _, conv1d = HF_PARTS[family]
    o = _module(hf, o_path.format(layer))
    config = hf.config
    heads = int(config.num_attention_heads)
    d_model = int(config.hidden_size)
    matrix = o.weight if conv1d else o.weight.T
    return matrix.detach().reshape(heads, -1, d_model)


def hf_direction(family: str) -> torch.Tensor:
    w_u = _module(hf_oracle(family), HF_PARTS[family][2]).weight.detach().T
    return w_u[:, ANSWER] - w_u[:, WRONG]


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi", "cohere"])
@pytest.mark.parametrize("heads", [False, True])
def test_contributions_sum_to_the_models_logit_difference(family: str, heads: bool) -> None:
    """LayerNorm with biases (GPT-2; Phi also with an unembedding bias), RMSNorm (Llama), a logit
    scale (Cohere): the parts add up to HF's own logit difference."""
    ids = _ids(family)
    result = logit_attribution(eager_model(family), ids, ANSWER, WRONG, heads=heads)
    logits = hf_run(family, ids)["logits"][-1]
    expected = float(logits[ANSWER] - logits[WRONG])
    assert result.dims == ("component",)
    assert abs(float(result.values.sum()) - expected) <= 1e-4
    assert abs(result.meta["logit_diff"] - expected) <= 1e-5
    names = result.labels("component")
    assert names[0] == "embed" and names.count("embed") == 1
    assert ("b_U" in names) == (family == "phi")
    assert ("final_norm.bias" in names) == (family in ("gpt2", "phi"))
    n = eager_model(family).info.n_layers
    if heads:
        assert f"L{n - 1}H0" in names and f"attn_out.{n - 1}" not in names
    else:
        assert names[1:3] == ["attn_out.0", "mlp_out.0"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_per_head_split_equals_a_hand_written_decomposition(family: str) -> None:
    """Each head's component is its slice of the output projection's input times its rows of
    ``W_O``; its contribution goes through the final norm with the whole residual's scale."""
    model = eager_model(family)
    ids = _ids(family)
    hf = hf_run(family, ids)
    split = decompose_resid(model, ids, heads=True)
    attribution = logit_attribution(model, ids, ANSWER, WRONG, heads=True)
    norm_module = _module(hf_oracle(family), HF_PARTS[family][1])
    x = hf["resid"][-1]
    eps = getattr(norm_module, "eps", None) or norm_module.variance_epsilon
    direction = hf_direction(family)
    for layer in range(model.info.n_layers):
        w_o = hf_w_o(family, layer)
        z = hf["z" + str(layer)][-1].reshape(w_o.shape[0], w_o.shape[1])
        for head in range(w_o.shape[0]):
            part = z[head] @ w_o[head]
            name = f"L{layer}H{head}"
            got = split.at(component=name)
            assert isinstance(got, Labelled)
            assert rel_diff(got.values, part) <= 1e-5, name
            if family == "gpt2":  # LayerNorm: centre the component, divide by the whole residual's std
                normed = (part - part.mean()) / (x.var(unbiased=False) + eps).sqrt()
            else:  # RMSNorm: divide by the whole residual's root mean square
                normed = part / (x.pow(2).mean() + eps).sqrt()
            expected = float((normed * norm_module.weight.detach()) @ direction)
            assert abs(attribution.at(component=name) - expected) <= 1e-4, name  # type: ignore[operator]
    assert rel_diff(split.values.sum(0), x) <= 1e-5  # the components add up to HF's residual
    assert rel_diff(split.at(component="embed").values, hf["embed"][-1]) <= 1e-6  # type: ignore[union-attr]


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_sandwich_norm_families_decompose_without_heads(family: str) -> None:
    """Gemma 2 and OLMo 2 add ``attn_out_post``/``mlp_out_post`` (their sandwich norms' outputs):
    those are the components. Gemma 2 soft-caps its logits: the attribution is of the logit
    difference before the cap, which HF's unembedding of the final norm's output gives."""
    model = eager_model(family)
    ids = _ids(family)
    result = logit_attribution(model, ids, ANSWER, WRONG)
    assert result.labels("component")[1:3] == ["attn_out_post.0", "mlp_out_post.0"]
    hf = hf_run(family, ids)
    with torch.no_grad():
        uncapped = _module(hf_oracle(family), "lm_head")(hf["normed"][-1])
    expected = float(uncapped[ANSWER] - uncapped[WRONG])
    assert abs(float(result.values.sum()) - expected) <= 1e-4
    cap = result.meta["softcap"]
    assert cap == (30.0 if family == "gemma2" else None)
    if cap:  # the model's own logits are the capped ones
        capped = hf["logits"][-1]
        real = cap * torch.tanh(uncapped / cap)
        assert torch.allclose(real, capped, atol=1e-5)
    split = decompose_resid(model, ids)
    assert rel_diff(split.values.sum(0), hf["resid"][-1]) <= 1e-5
    with pytest.raises(UnsupportedOperation, match="sandwich norm"):
        logit_attribution(model, ids, ANSWER, WRONG, heads=True)


def test_a_batch_gives_one_row_per_prompt_each_equal_to_its_solo_run() -> None:
    model = eager_model("gpt2")
    prompts = [PROMPT, "A short one"]
    batch = logit_attribution(model, prompts, [ANSWER, 9], WRONG, heads=True)
    assert batch.dims == ("row", "component") and batch.shape[0] == 2
    for row, (prompt, answer) in enumerate(zip(prompts, [ANSWER, 9], strict=True)):
        solo = logit_attribution(model, prompt, answer, WRONG, heads=True)
        assert torch.allclose(batch.values[row], solo.values, atol=1e-5)
        assert abs(batch.meta["logit_diff"][row] - solo.meta["logit_diff"]) <= 1e-5
    assert batch.meta["position"] == [len(model.to_tokens(p)[0]) - 1 for p in prompts]
    earlier = logit_attribution(model, PROMPT, ANSWER, WRONG, position=3)
    logits = hf_run("gpt2", _ids("gpt2"))["logits"][3]
    assert abs(float(earlier.values.sum()) - float(logits[ANSWER] - logits[WRONG])) <= 1e-4
    one = logit_attribution(model, PROMPT, ANSWER)  # no wrong token: the answer's logit itself
    assert abs(float(one.values.sum()) - float(hf_run("gpt2", _ids("gpt2"))["logits"][-1, ANSWER])) <= 1e-4


def test_the_shipped_model_prefers_paris_over_berlin_and_says_why() -> None:
    model = load_model("interp:tiny", backend="eager")
    prompt = "The capital of France is"
    dla = logit_attribution(model, prompt, " Paris", " Berlin", heads=True)
    cache = run_with_cache(model, prompt, ["logits"])
    paris, berlin = (model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Berlin"))
    expected = float(cache["logits"][0, -1, paris] - cache["logits"][0, -1, berlin])
    assert expected > 0 and abs(float(dla.values.sum()) - expected) <= 1e-4
    assert dla.meta["answer"] == paris and dla.meta["wrong"] == berlin
    assert len(dla.labels("component")) == 1 + 4 * (4 + 1 + 1) + 1  # embed; heads, b_O, mlp per layer; ln bias
    assert dla.top(1)[0][0] == ("mlp_out.3",)  # the last MLP picks Paris (the lens shows it late, too)
    whole = logit_attribution(model, prompt, " Paris", " Berlin")
    for layer in range(4):  # the heads and the bias add up to the layer's attention output
        parts = [f"L{layer}H{h}" for h in range(4)] + [f"b_O.{layer}"]
        total = sum(dla.at(component=name) for name in parts)  # type: ignore[misc]
        assert abs(total - whole.at(component=f"attn_out.{layer}")) <= 1e-4  # type: ignore[operator]


def test_accumulated_resid_applies_the_final_norm_as_asked() -> None:
    model = eager_model("gpt2")
    ids = _ids("gpt2")
    n = model.info.n_layers
    cache = run_with_cache(model, [ids], ["resid_pre.0", *(f"resid_post.{i}" for i in range(n)), "final_norm"])
    raw = accumulated_resid(model, ids, norm="none")
    assert raw.dims == ("layer", "d_model")
    assert raw.labels("layer") == ["embed", *(f"resid_post.{i}" for i in range(n))]
    assert torch.equal(raw.values[0], cache["resid_pre.0"][0, -1])
    assert torch.equal(raw.values[-1], cache[f"resid_post.{n - 1}"][0, -1])
    own = accumulated_resid(model, ids)  # each normalised by its own scale: the logit lens
    assert rel_diff(own.values[-1], cache["final_norm"][0, -1]) <= 1e-5
    w = weights(model)
    lens = decode_residuals(model, cache["resid_post.1"][0, -1])
    assert rel_diff(own.values[2] @ w.W_U, lens) <= 1e-5
    final = accumulated_resid(model, ids, norm="final")  # the last layer's scale, no bias
    norm = w.final_norm
    assert norm.bias is not None
    assert rel_diff(final.values[-1], cache["final_norm"][0, -1] - norm.bias) <= 1e-5
    x = cache[f"resid_post.{n - 1}"][0, -1]
    expected = (raw.values[1] - raw.values[1].mean()) / (x.var(unbiased=False) + norm.eps).sqrt() * norm.weight
    assert rel_diff(final.values[1], expected) <= 1e-5
    with pytest.raises(InvalidOption, match="'own', 'final' or 'none'"):
        accumulated_resid(model, ids, norm="lens")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def post_norm_opt() -> Iterator[Any]:
    """OPT-350m's layout: the residual is normalised after each block, and ``project_out`` maps
    the last layer's output to a narrower unembedding."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from interp_eager import EagerModel
    from interp_testkit import randomize_weights

    path = tiny_model_path("opt")
    config = AutoConfig.from_pretrained(path)
    config.do_layer_norm_before = False
    config.word_embed_proj_dim = 32
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_weights(hf, seed=1)
    yield EagerModel.from_hf(hf, AutoTokenizer.from_pretrained(path))


def test_what_has_no_additive_decomposition_is_refused_and_says_why(post_norm_opt: Any) -> None:
    ids = [5, 9, 17, 33, 8]
    with pytest.raises(UnsupportedArchitecture, match="post-norm block"):
        decompose_resid(post_norm_opt, ids)
    with pytest.raises(UnsupportedArchitecture, match="project_out"):
        logit_attribution(post_norm_opt, ids, ANSWER, WRONG)
    bitnet = eager_model("bitnet")  # a norm between the heads' outputs and the output projection
    with pytest.raises(UnsupportedOperation, match="sub-norm"):
        decompose_resid(bitnet, _ids("bitnet"), heads=True)
    assert decompose_resid(bitnet, _ids("bitnet")).meta["residual_error"] <= 1e-5  # without heads it is fine


def test_bad_arguments_are_typed_errors() -> None:
    model = eager_model("gpt2")
    with pytest.raises(InvalidOption, match="position 99 is outside row 0"):
        logit_attribution(model, PROMPT, ANSWER, WRONG, position=99)
    with pytest.raises(InvalidTokens, match=r"is \d+ tokens; give one token"):
        logit_attribution(model, PROMPT, " quick brown", WRONG)
    with pytest.raises(InvalidTokens, match="3 tokens for 2 rows"):
        logit_attribution(model, [PROMPT, "hello"], [1, 2, 3], WRONG)
    with pytest.raises(InvalidTokens, match="outside the vocabulary"):
        logit_attribution(model, PROMPT, 10**6, WRONG)
