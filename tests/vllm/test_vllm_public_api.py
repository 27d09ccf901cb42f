"""Code written for the public ``interp-engine`` package (1.14, its README and docs/USAGE.md) runs
here unchanged on the vllm backend: its documents' examples on the session's shared gpt2 engine,
each compared with the same call on the eager twin of the same checkpoint, or with our own
documented calls on the same engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    AddSpec,
    InvalidTokens,
    LayerSteeringSpec,
    NoChatTemplateError,
    OrthogonalDecompSpec,
    ProjectionCapSpec,
    SteeringSpec,
    SteerMask,
    SteerSpec,
    Write,
    capture,
    capture_attention,
    capture_generation,
    decode_residuals,
    generate_stream,
    position_ids_from_mask,
    run_with_cache,
    steer,
    to_address,
)
from interp_testkit.suite import rel_diff, vllm_model_path

from ..support.readouts import eager_twin

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(vllm_engines: Any) -> Any:
    return vllm_engines("gpt2")


@pytest.fixture(scope="module")
def twin() -> Any:
    """The eager backend on the engine's checkpoint, behind its sync facade."""
    return eager_twin("gpt2")


def _unit(d_model: int, seed: int) -> torch.Tensor:
    vector = torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
    return vector / vector.norm()


def test_capture_and_points(engine: Any, twin: Any) -> None:
    model = engine.model
    point = Address("resid_post", 1)
    cache = capture(engine, model.to_tokens("Hello, world"), [point])
    expected = capture(twin, twin.model.to_tokens("Hello, world"), [point])
    assert rel_diff(cache[point], expected[point]) <= 1e-4
    assert (model.n_layers, model.d_model, model.n_heads) == (
        twin.model.n_layers,
        twin.model.d_model,
        twin.model.n_heads,
    )
    assert model.hf_model_id == str(vllm_model_path("gpt2"))
    token_ids = model.to_tokens(PROMPT)[0].tolist()
    acts = engine.run(lambda: model.capture(token_ids, [("mlp_out", 2), "resid_post.1"]))
    assert list(acts) == [Address("mlp_out", 2), Address("resid_post", 1)]
    assert tuple(acts[to_address("resid_post.1")].shape) == (len(token_ids), model.d_model)


def test_generate_text_and_its_stream(engine: Any, twin: Any) -> None:
    model = engine.model
    token_ids = model.to_tokens(PROMPT)[0].tolist()

    async def generate() -> tuple[str, list[str]]:
        text = await model.generate_text(token_ids, max_tokens=8, temperature=0.0, ignore_eos=True)
        deltas = [d async for d in model.generate_stream(token_ids, max_tokens=8, temperature=0.0, ignore_eos=True)]
        return text, deltas

    text, deltas = engine.run(generate)
    assert "".join(deltas) == text
    assert text == engine.generate(token_ids, max_tokens=8, ignore_eos=True).text
    # the recommendation comes from the same file on both backends
    assert model.recommended_sampling == twin.model.recommended_sampling
    assert model.sampling_settings(temperature=0.3) == twin.model.sampling_settings(temperature=0.3)
    penalised = engine.generate_text(token_ids, max_tokens=8, temperature=0.0, presence_penalty=2.0, ignore_eos=True)
    assert penalised == twin_text(twin, token_ids, presence_penalty=2.0)


def twin_text(twin: Any, token_ids: list[int], **sampling: Any) -> str:
    text: str = twin.generate_text(token_ids, max_tokens=8, temperature=0.0, ignore_eos=True, **sampling)
    return text


def test_capture_generation_rows_are_the_same_rule_as_eager(engine: Any, twin: Any) -> None:
    model = engine.model
    token_ids = model.to_tokens(PROMPT)[0].tolist()
    completion, acts = engine.capture_generation(token_ids, ["resid_post.1"], max_tokens=4, ignore_eos=True)
    rows = acts[Address("resid_post", 1)]
    assert rows.shape[0] == len(token_ids) + len(completion.token_ids)
    twin_completion, twin_acts = twin_generation(twin, token_ids)
    assert twin_completion.token_ids == completion.token_ids
    assert rel_diff(rows, twin_acts[Address("resid_post", 1)]) <= 1e-4
    chunks = list(engine.capture_generation_stream(token_ids, ["resid_post.1"], max_tokens=4, ignore_eos=True))
    assert torch.equal(torch.cat([new[Address("resid_post", 1)] for new, _ in chunks]), rows)
    assert chunks[-1][1] == completion.token_ids


def twin_generation(twin: Any, token_ids: list[int]) -> Any:
    return twin.capture_generation(token_ids, ["resid_post.1"], max_tokens=4, ignore_eos=True)


def test_public_steering_specs(engine: Any, twin: Any) -> None:
    model = engine.model
    d = model.d_model
    vector, other = _unit(d, 1), _unit(d, 2)
    spec = SteeringSpec(layers={1: LayerSteeringSpec(operations=[AddSpec(vector=vector, scale=4.0)])})
    specs = [
        SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0)),
        SteeringSpec.at(
            "mlp_out.2", ProjectionCapSpec(vector=other, max=0.5), OrthogonalDecompSpec(vector=other, coeff=0.5)
        ),
    ]
    token_ids = model.to_tokens(PROMPT)[0].tolist()
    for steering in (spec, specs):
        completion, acts = engine.capture_generation(
            token_ids, ["resid_post.2"], max_tokens=4, steering_spec=steering, ignore_eos=True
        )
        expected_completion, expected = twin.capture_generation(
            token_ids, ["resid_post.2"], max_tokens=4, steering_spec=steering, ignore_eos=True
        )
        assert completion.token_ids == expected_completion.token_ids
        assert rel_diff(acts[Address("resid_post", 2)], expected[Address("resid_post", 2)]) <= 1e-4


def test_steer_block_on_vllm(engine: Any) -> None:
    model = engine.model
    vector = _unit(model.d_model, 3)
    spec = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0))
    tokens = model.to_tokens(PROMPT)
    with steer(engine, spec):
        completion, acts = capture_generation(engine, tokens, ["resid_post.1"], max_tokens=6, ignore_eos=True)
        steps = list(generate_stream(engine, tokens, max_tokens=6, ignore_eos=True))
    explicit_completion, explicit = capture_generation(
        engine, tokens, ["resid_post.1"], max_tokens=6, steering_spec=spec, ignore_eos=True
    )
    assert completion.token_ids == explicit_completion.token_ids
    assert rel_diff(acts["resid_post.1"], explicit["resid_post.1"]) <= 1e-5
    assert "".join(step.token_str for step in steps) == explicit_completion.text
    n = tokens.shape[1]
    ids = tokens[0].tolist()
    with steer(engine, spec, prompt_token_ids=ids, position_mask=[0], generated=False):
        masked_completion, masked = engine.capture_generation(ids, ["resid_post.2"], max_tokens=6, ignore_eos=True)
    by_position = SteeringSpec([Write("resid_post.1", vector, scale=4.0, positions=list(range(1, n)))])
    reference_completion, reference = engine.capture_generation(
        ids, ["resid_post.2"], max_tokens=6, steering_spec=by_position, ignore_eos=True
    )
    assert masked_completion.token_ids == reference_completion.token_ids
    assert rel_diff(masked[Address("resid_post", 2)], reference[Address("resid_post", 2)]) <= 1e-5


def test_steer_leaves_special_tokens_alone_on_vllm(engine: Any) -> None:
    model = engine.model
    vector = _unit(model.d_model, 4)
    spec = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0))
    special = sorted(model.tokenizer.all_special_ids)
    ids = [special[0], *model.to_tokens(PROMPT)[0].tolist()]  # a special token at position 0
    with steer(engine, spec, position_mask=SteerMask.SPECIAL_TOKENS):
        completion, acts = engine.capture_generation(ids, ["resid_post.2"], max_tokens=4, ignore_eos=True)
    reference_spec = SteeringSpec(
        [
            Write("resid_post.1", vector, scale=4.0, positions=list(range(1, len(ids)))),
            Write("resid_post.1", vector, scale=4.0, positions="generated"),
        ]
    )
    reference_completion, reference = engine.capture_generation(
        ids, ["resid_post.2"], max_tokens=4, steering_spec=reference_spec, ignore_eos=True
    )
    assert completion.token_ids == reference_completion.token_ids
    assert rel_diff(acts[Address("resid_post", 2)], reference[Address("resid_post", 2)]) <= 1e-5


def test_capture_attention_by_layer(engine: Any, twin: Any) -> None:
    tokens = engine.model.to_tokens(PROMPT)
    attn = capture_attention(engine, tokens, [1])
    expected = capture_attention(twin, tokens, [1])
    for part in ("scores", "probs", "value"):
        assert rel_diff(attn[1][part], expected[1][part]) <= 1e-4, part
    assert list(attn) == [Address("attn_pattern", 1)]
    method = engine.capture_attention(tokens[0].tolist(), [1])
    assert set(method[1]) == {"scores", "probs", "value"}


def test_a_padded_batch_on_vllm(engine: Any, twin: Any) -> None:
    model = engine.model
    short, long = model.to_tokens("The capital")[0].tolist(), model.to_tokens(PROMPT)[0].tolist()
    pad = len(long) - len(short)
    tokens = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    cache = capture(engine, tokens, ["resid_post.2"], attention_mask=mask)
    alone = run_with_cache(twin, short, ["resid_post.2"])
    assert rel_diff(cache["resid_post.2"][0, pad:], alone["resid_post.2"][0]) <= 1e-4
    assert not cache["resid_post.2"][0, :pad].any()
    with pytest.raises(InvalidTokens, match="position_ids"):
        capture(engine, tokens, ["resid_post.2"], attention_mask=mask, position_ids=position_ids_from_mask(mask) + 1)


def test_the_lower_level_steerspec_list_on_vllm(engine: Any, twin: Any) -> None:
    # the public package's eager-only SteerSpec list, applied by the vllm backend as by eager
    d = engine.model.d_model
    vector, other = _unit(d, 5), _unit(d, 6)
    lowers = [
        SteerSpec(vector=vector, layer=1, coeff=4.0),
        SteerSpec(vector=other, layer=1, method="ablate", point="mlp_out"),
    ]
    tokens = engine.model.to_tokens(PROMPT)
    with steer(engine, lowers):
        got = capture(engine, tokens, ["resid_post.2"])
    with steer(twin, lowers):
        expected = capture(twin, tokens, ["resid_post.2"])
    plain = capture(engine, tokens, ["resid_post.2"])
    assert rel_diff(got["resid_post.2"], expected["resid_post.2"]) <= 1e-4
    assert not torch.allclose(got["resid_post.2"], plain["resid_post.2"])


def test_chat_sampling_and_the_unembed_on_vllm(engine: Any, twin: Any) -> None:
    model = engine.model
    messages = [{"role": "user", "content": "Hi"}]
    # the tokenizer's own chat helpers answer as on eager (a checkpoint without a template refuses)
    assert model.tok.has_chat_template() == twin.model.tok.has_chat_template()
    if model.tok.has_chat_template():
        assert model.tok.apply_chat_template(messages, tokenize=True) == twin.model.tok.apply_chat_template(
            messages, tokenize=True
        )
        assert model.tok.message_partition(messages) == twin.model.tok.message_partition(messages)
    else:
        with pytest.raises(NoChatTemplateError):
            model.tok.apply_chat_template(messages)
    # the sampling defaults are the checkpoint's generation_config.json, read the same way
    recommended, twins = model.recommended_sampling, twin.model.recommended_sampling
    assert dataclasses.replace(recommended, source=None) == dataclasses.replace(twins, source=None)
    assert model.sampling_settings(temperature=0.3) == twin.model.sampling_settings(temperature=0.3)
    # decode_residuals: the method, and the free function with the public package's softcap=
    token_ids = model.to_tokens(PROMPT)[0].tolist()
    acts = engine.capture(token_ids, ["resid_post.2"])
    residuals = next(iter(acts.values()))
    logits = engine.run(lambda: model.decode_residuals(residuals))
    assert rel_diff(logits, twin.decode_residuals(residuals)) <= 1e-4
    capped = decode_residuals(engine, residuals, softcap=2.0)
    assert rel_diff(capped, 2.0 * torch.tanh(logits / 2.0)) <= 1e-5
    assert float(capped.abs().max()) <= 2.0
    # the public package's vLLM-only global hook is refused, naming the per-request steer
    with pytest.raises(AttributeError, match=r"with steer\(model, spec\)"):
        model.set_steering  # noqa: B018
