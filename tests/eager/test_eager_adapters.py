"""LoRA adapters per request on the eager backend (PEFT), against two oracles: HF ``transformers``
with the adapter applied by ``peft`` itself, and the base model with the adapter merged into its
weights, for GPT-2, Llama and Qwen 2 with random adapters on the attention and MLP projections."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidAdapter,
    LensRequest,
    SteeringSpec,
    UnknownAdapter,
    UnsupportedOperation,
    Write,
    capture_attention,
    capture_generation,
    compare,
    generate_stream,
    load_model,
    logit_attribution,
    run_with_cache,
    sync_model,
    weights,
)
from interp_testkit.suite import PROMPT, rel_diff, tiny_model_path

from ..support.adapters import Lora, make_lora

TOL = 1e-4
FAMILIES = ("gpt2", "llama", "qwen2")


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Lora, Lora]]:
    """Two random adapters per family (``ft``, and ``other`` with another seed and rank)."""
    root = tmp_path_factory.mktemp("loras")
    return {
        family: (
            make_lora(tiny_model_path(family), root / family / "ft", family, seed=1),
            make_lora(tiny_model_path(family), root / family / "other", family, seed=2, rank=2),
        )
        for family in FAMILIES
    }


@pytest.fixture(scope="module")
def models(loras: dict[str, tuple[Lora, Lora]]) -> Iterator[dict[str, Any]]:
    """Per family, a model of its own (not the session's: adapters load into its modules) with
    both adapters registered at load."""
    out = {}
    for family, (ft, other) in loras.items():
        out[family] = sync_model(
            load_model(
                tiny_model_path(family), backend="eager", adapters={"ft": str(ft.adapter), "other": str(other.adapter)}
            )
        )
    yield out
    for model in out.values():
        model.shutdown()


def _merged(lora: Lora, family: str) -> Any:
    return sync_model(load_model(lora.merged, backend="eager", tokenizer=str(tiny_model_path(family))))


def _hf_peft(family: str, adapter: pathlib.Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(family), attn_implementation="eager")
    return PeftModel.from_pretrained(base, adapter).eval()


def _every_point(model: Any) -> list[str]:
    points = []
    for kind, info in model.model.points().items():
        if kind in ("expert_indices", "expert_weights", "router_logits"):
            continue
        layers = range(model.info.n_layers) if info.per_layer else [None]
        points += [kind if layer is None else f"{kind}.{layer}" for layer in layers]
    return points


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_under_an_adapter_equals_peft_and_the_merged_model(
    family: str, models: dict[str, Any], loras: dict[str, tuple[Lora, Lora]]
) -> None:
    model = models[family]
    ft = loras[family][0]
    tokens = model.to_tokens(PROMPT)
    points = _every_point(model)
    adapted = run_with_cache(model, tokens, points, adapter="ft")
    merged = _merged(ft, family)
    try:
        expected = run_with_cache(merged, tokens, points)
    finally:
        merged.shutdown()
    base = run_with_cache(model, tokens, points)
    moved = 0
    for point in points:
        assert rel_diff(adapted[point], expected[point]) <= TOL, point
        moved += not torch.allclose(adapted[point], base[point], atol=1e-5)
    assert moved > len(points) // 2, "the adapter changed too few points to tell"
    with torch.no_grad():  # HF + PEFT itself: the hidden states and the logits
        out = _hf_peft(family, ft.adapter)(tokens, output_hidden_states=True)
    n = model.info.n_layers
    for layer in range(n - 1):
        assert rel_diff(adapted[f"resid_post.{layer}"], out.hidden_states[layer + 1]) <= TOL, layer
    assert rel_diff(adapted["logits"], out.logits) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stream_and_attention_under_an_adapter(
    family: str, models: dict[str, Any], loras: dict[str, tuple[Lora, Lora]]
) -> None:
    model = models[family]
    tokens = model.to_tokens(PROMPT)
    merged = _merged(loras[family][0], family)
    try:
        completion, cache = capture_generation(model, tokens, ["resid_post.1"], max_tokens=6, adapter="ft")
        want, want_cache = capture_generation(merged, tokens, ["resid_post.1"], max_tokens=6)
        assert completion.token_ids == want.token_ids
        assert rel_diff(cache["resid_post.1"], want_cache["resid_post.1"]) <= TOL
        steps = list(generate_stream(model, tokens, max_tokens=6, n_logprobs=3, adapter="ft"))
        assert [s.token_id for s in steps] == want.token_ids
        plain = merged.generate(tokens[0].tolist(), max_tokens=6)
        assert model.generate(tokens[0].tolist(), max_tokens=6, adapter="ft").token_ids == plain.token_ids
        lens = LensRequest(layers=[0, 1], top_k=3)
        _, with_lens = capture_generation(model, tokens, [], max_tokens=3, lens=lens, adapter="ft")
        _, lens_want = capture_generation(merged, tokens, [], max_tokens=3, lens=lens)
        assert torch.equal(with_lens.lens.ids, lens_want.lens.ids)
        patterns = capture_attention(model, tokens, [0, 1], adapter="ft")
        patterns_want = capture_attention(merged, tokens, [0, 1])
        for layer in (0, 1):
            assert rel_diff(patterns[f"attn_pattern.{layer}"], patterns_want[f"attn_pattern.{layer}"]) <= TOL
    finally:
        merged.shutdown()


@pytest.mark.parametrize("family", ["llama"])
def test_steering_and_an_adapter_together(
    family: str, models: dict[str, Any], loras: dict[str, tuple[Lora, Lora]]
) -> None:
    model = models[family]
    tokens = model.to_tokens(PROMPT)
    spec = SteeringSpec([Write(Address("resid_post", 0), torch.ones(model.info.d_model), op="add", scale=2.0)])
    merged = _merged(loras[family][0], family)
    try:
        got = run_with_cache(model, tokens, ["resid_post.2", "logits"], steering_spec=spec, adapter="ft")
        want = run_with_cache(merged, tokens, ["resid_post.2", "logits"], steering_spec=spec)
    finally:
        merged.shutdown()
    assert rel_diff(got["resid_post.2"], want["resid_post.2"]) <= TOL
    assert rel_diff(got["logits"], want["logits"]) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_mixed_adapters_equals_each_row_alone(family: str, models: dict[str, Any]) -> None:
    model = models[family]
    texts = [PROMPT, "Hello there", "The cat sat on the mat and", "One two"]
    adapters = ["ft", None, "other", "ft"]
    rows = [model.to_tokens(t)[0].tolist() for t in texts]
    batch = run_with_cache(model, rows, ["resid_post.1", "logits"], adapter=adapters)
    for i, (row, adapter) in enumerate(zip(rows, adapters, strict=True)):
        solo = run_with_cache(model, [row], ["resid_post.1", "logits"], adapter=adapter)
        for point in ("resid_post.1", "logits"):
            assert rel_diff(batch[point][i, : len(row)], solo[point][0]) <= TOL, (i, point)


def test_concurrent_requests_never_see_each_others_adapter(models: dict[str, Any]) -> None:
    """16 requests at once (captures, generations and streams, under ``ft``, ``other`` or none),
    each equal to the same request alone."""
    facade = models["llama"]
    model = facade.model
    ids = facade.to_tokens(PROMPT)[0].tolist()
    choices = ["ft", None, "other", "ft"] * 4

    async def one(i: int, adapter: str | None) -> Any:
        prompt = ids[: 6 + i % 5]
        if i % 3 == 0:
            return (await model.generate(prompt, max_tokens=4, adapter=adapter)).token_ids
        if i % 3 == 1:
            return [s.token_id async for s in model.stream(prompt, max_tokens=4, adapter=adapter)]
        return (await model.capture(prompt, ["resid_post.2"], adapter=adapter))[Address("resid_post", 2)]

    async def together() -> list[Any]:
        return await asyncio.gather(*(one(i, a) for i, a in enumerate(choices)))

    results = facade.run(together)
    for i, adapter in enumerate(choices):
        alone = facade.run(lambda i=i, adapter=adapter: one(i, adapter))  # type: ignore[misc]
        if isinstance(alone, torch.Tensor):
            assert torch.equal(results[i], alone), i
        else:
            assert results[i] == alone, i


def test_base_values_are_unchanged_by_loading_adapters(loras: dict[str, tuple[Lora, Lora]]) -> None:
    model = sync_model(load_model(tiny_model_path("gpt2"), backend="eager"))
    try:
        tokens = model.to_tokens(PROMPT)
        points = ["resid_post.0", "attn_v.1", "mlp_out.1", "logits"]
        before = run_with_cache(model, tokens, points)
        w_o, w_u = weights(model).get("W_O", 1).clone(), weights(model).get("W_U").clone()
        model.load_adapter("ft", str(loras["gpt2"][0].adapter))
        assert torch.equal(weights(model).get("W_O", 1), w_o)  # the base model's, read through the LoRA layers
        assert torch.equal(weights(model).get("W_U"), w_u)
        after = run_with_cache(model, tokens, points)
        adapted = run_with_cache(model, tokens, points, adapter="ft")
        for point in points:
            assert torch.equal(before[point], after[point]), point
            assert not torch.allclose(before[point], adapted[point], atol=1e-5), point
        assert model.adapters["ft"].targets == ("c_attn", "c_proj", "c_fc")
    finally:
        model.shutdown()


def test_an_adapter_by_its_folder(models: dict[str, Any], loras: dict[str, tuple[Lora, Lora]]) -> None:
    model = models["qwen2"]
    folder = str(loras["qwen2"][1].adapter)
    tokens = model.to_tokens(PROMPT)
    by_path = run_with_cache(model, tokens, ["resid_post.1"], adapter=folder)
    by_name = run_with_cache(model, tokens, ["resid_post.1"], adapter="other")
    assert torch.equal(by_path["resid_post.1"], by_name["resid_post.1"])
    assert folder in model.adapters


def test_bad_adapters_are_typed_errors_and_the_model_keeps_serving(
    models: dict[str, Any], loras: dict[str, tuple[Lora, Lora]], tmp_path: pathlib.Path
) -> None:
    model = models["gpt2"]
    ids = model.to_tokens(PROMPT)[0].tolist()
    with pytest.raises(UnknownAdapter, match="registered: ft, other") as unknown:
        model.capture(ids, ["resid_post.0"], adapter="nope")
    assert set(unknown.value.valid) >= {"ft", "other"}
    with pytest.raises(InvalidAdapter, match="another model"):  # a Llama's adapter on GPT-2
        model.capture(ids, ["resid_post.0"], adapter=str(loras["llama"][0].adapter))
    with pytest.raises(InvalidAdapter, match="already registered"):
        model.load_adapter("ft", str(loras["gpt2"][0].adapter))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(InvalidAdapter, match="only LoRA"):
        model.load_adapter("prefix", tmp_path)
    with pytest.raises(InvalidAdapter, match=r"per row|rows"):
        run_with_cache(model, [ids, ids], ["resid_post.0"], adapter=["ft"])
    with pytest.raises(InvalidAdapter):
        model.capture(ids, ["resid_post.0"], adapter=3)  # type: ignore[arg-type]
    assert "prefix" not in model.adapters
    assert model.capture(ids, ["resid_post.0"], adapter="ft")[Address("resid_post", 0)].shape[0] == len(ids)


def test_views_of_the_base_weights_refuse_the_lora_they_would_leave_out(
    models: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    """Per-head DLA reads the base model's W_O, the logit lens and DLA its W_U: under a LoRA on
    ``o_proj`` per-head DLA names the LoRA, and under a LoRA on ``lm_head`` the lens, DLA and
    compare's lens refuse naming the adapter."""
    model = models["llama"]  # "ft" adapts every projection, o_proj included, and not lm_head
    prompt = model.to_tokens(PROMPT)[0].tolist()
    with pytest.raises(UnsupportedOperation, match=r"under adapter 'ft' \(a LoRA on .*o_proj.*\)"):
        logit_attribution(model, [prompt], 5, 7, heads=True, adapter="ft")
    whole = logit_attribution(model, [prompt], 5, 7, adapter="ft")  # one component per layer: exact
    assert abs(float(whole.values.sum()) - whole.meta["logit_diff"]) <= 1e-3 * max(1.0, abs(whole.meta["logit_diff"]))
    head = make_lora(tiny_model_path("llama"), tmp_path / "head", "llama", seed=7, targets=("lm_head", "v_proj"))
    tuned = sync_model(load_model(tiny_model_path("llama"), backend="eager", adapters={"head": str(head.adapter)}))
    try:
        ids = tuned.to_tokens(PROMPT)[0].tolist()
        lens = LensRequest(layers=[0, 1], top_k=2)
        with pytest.raises(UnsupportedOperation, match=r"'head' adapts the unembedding \(lm_head\).*logit lens"):
            capture_generation(tuned, ids, ["resid_post.0"], max_tokens=2, lens=lens, adapter="head")
        with pytest.raises(UnsupportedOperation, match=r"adapter 'head' adapts the unembedding.*logit lens"):
            list(generate_stream(tuned, ids, max_tokens=2, lens=lens, adapter="head"))
        with pytest.raises(UnsupportedOperation, match=r"adapter 'head' adapts the unembedding.*direct logit"):
            logit_attribution(tuned, [ids], 5, 7, adapter="head")
        diff = compare(tuned, PROMPT, ["resid_post.0"], adapters=[None, "head"])
        with pytest.raises(UnsupportedOperation, match=r"adapter 'head' adapts the unembedding.*logit lens"):
            diff.lens()
        # what reads no W_U runs under it, and the LoRA on lm_head moves the logits as HF + PEFT's
        plain = capture_generation(tuned, ids, ["resid_post.0"], max_tokens=2, lens=lens)[1]
        assert plain.lens.ids.shape[0] == 2
        got = run_with_cache(tuned, [ids], ["logits"], adapter="head")["logits"]
        with torch.no_grad():
            want = _hf_peft("llama", head.adapter)(torch.tensor([ids])).logits
        assert rel_diff(got, want) <= TOL
        assert diff.norms().values.shape[-1] == 3
    finally:
        tuned.shutdown()
