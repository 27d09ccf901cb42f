"""Code written for the public ``interp-engine`` package (1.14, its README and docs/USAGE.md) runs
here unchanged on the eager backend: each test is one of its documents' examples, with
``interp:tiny`` in place of the hub model it loads, checked against what the same call means in
our own API (the numbers come from our documented calls, or from Hugging Face through them)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from interp_engine import (
    AblateSpec,
    Address,
    AddSpec,
    AttentionCache,
    BackendNotFound,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    KindNotInFamily,
    LayerSteeringSpec,
    LensRequest,
    NoChatTemplate,
    NoChatTemplateError,
    NormScaledAddSpec,
    NotInThisEngine,
    OrthogonalDecompSpec,
    ProjectionCapSpec,
    SamplingSettings,
    SteeringSpec,
    SteerMask,
    SteerSpec,
    SwapSpec,
    Tokenize,
    UnsupportedOperation,
    Write,
    capture,
    capture_attention,
    capture_generation,
    decode_residuals,
    format_address,
    generate_stream,
    installed_backends,
    load_model,
    parse_address,
    position_ids_from_mask,
    run_with_cache,
    steer,
    sync_model,
    tiny_model_path,
    to_address,
    vllm_installed,
)
from interp_testkit.suite import rel_diff

from ..support.engines import eager_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("interp:tiny", backend="eager")


def _ids(model: Any) -> list[int]:
    ids: list[int] = model.to_tokens(PROMPT)[0].tolist()
    return ids


def _unit(model: Any, seed: int = 0) -> torch.Tensor:
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(seed))
    return vector / vector.norm()


# -- the README's first example and "Your first capture" ----------------------------------------


def test_the_readme_capture_is_run_with_cache(model: Any) -> None:
    point = Address("resid_post", 1)  # or string: "resid_post.1"
    cache = capture(model, model.to_tokens("Hello, world"), [point])
    assert list(cache[point].shape) == [1, len(model.to_tokens("Hello, world")[0]), model.d_model]
    assert torch.equal(cache["resid_post.1"], cache[point])
    assert torch.equal(cache[point], run_with_cache(model, "Hello, world", [point])[point])


def test_model_attributes_and_the_first_capture(model: Any) -> None:
    assert (model.n_layers, model.d_model, model.n_heads) == (
        model.info.n_layers,
        model.info.d_model,
        model.info.n_heads,
    )
    assert model.hf_model_id == "interp:tiny"

    async def first_capture() -> dict[Address, torch.Tensor]:
        await model.warmup()
        token_ids = model.to_tokens(PROMPT)[0].tolist()
        acts: dict[Address, torch.Tensor] = await model.capture(token_ids, ["resid_post.1"])
        return acts

    acts = asyncio.run(first_capture())
    ((address, tensor),) = acts.items()
    assert isinstance(address, Address) and format_address(address) == "resid_post.1"
    assert tuple(tensor.shape) == (len(_ids(model)), model.d_model)
    with pytest.raises(KeyError, match="keyed by Address"):
        acts["resid_post.1"]  # type: ignore[index]
    assert torch.equal(acts[to_address("resid_post.1")], tensor)


def test_naming_a_point(model: Any) -> None:
    assert parse_address("resid_post.10") == Address("resid_post", 10)
    assert parse_address("resid_post.10").name == "resid_post"
    assert to_address(("mlp_out", 3)) == Address("mlp_out", 3)
    assert format_address(("mlp_out", 3)) == "mlp_out.3"
    ids = _ids(model)
    by_tuple = asyncio.run(model.capture(ids, [("mlp_out", 2), ("resid_post", -1)]))
    assert list(by_tuple) == [Address("mlp_out", 2), Address("resid_post", -1)]
    by_string = asyncio.run(model.capture(ids, ["mlp_out.2"]))
    assert torch.equal(by_tuple[Address("mlp_out", 2)], by_string[Address("mlp_out", 2)])
    # one tuple as the points of a free function is one point, not two
    assert list(run_with_cache(model, ids, ("resid_post", 0))) == [Address("resid_post", 0)]


def test_the_z_point_keeps_the_head_axis_here(model: Any) -> None:
    acts = asyncio.run(model.capture(_ids(model), ["z.1"]))
    z = acts[Address("z", 1)]
    assert tuple(z.shape) == (len(_ids(model)), model.n_heads, model.info.d_head)
    # the public package's [seq, n_heads * head_dim] is the same values, flattened
    assert tuple(z.flatten(-2).shape) == (len(_ids(model)), model.n_heads * model.info.d_head)


# -- Generate -------------------------------------------------------------------------------------


def test_generate_text_is_the_concatenated_stream(model: Any) -> None:
    token_ids = _ids(model)

    async def generate() -> tuple[str, list[str]]:
        text = await model.generate_text(token_ids, max_tokens=12, temperature=0.0)
        deltas = [delta async for delta in model.generate_stream(token_ids, max_tokens=12, temperature=0.0)]
        return text, deltas

    text, deltas = asyncio.run(generate())
    assert "".join(deltas) == text
    assert text == asyncio.run(model.generate(token_ids, max_tokens=12)).text  # greedy, as temperature=0.0 asks


def test_collected_steps_are_the_streams(model: Any) -> None:
    token_ids = _ids(model)
    lens = LensRequest([0, -1], top_k=3, positions=[0])

    async def both() -> tuple[list[Any], list[Any]]:
        collected = await model.collect_steps(token_ids, max_tokens=6, n_logprobs=2, lens=lens)
        streamed = [step async for step in model.stream(token_ids, max_tokens=6, n_logprobs=2, lens=lens)]
        return collected, streamed

    collected, streamed = asyncio.run(both())
    assert len(collected) == 6 and collected[0].prompt_lens is not None
    assert [(s.token_id, s.text, s.position, s.logprobs) for s in collected] == [
        (s.token_id, s.text, s.position, s.logprobs) for s in streamed
    ]
    for got, want in zip(collected, streamed, strict=True):
        assert got.lens is not None and want.lens is not None
        assert torch.equal(got.lens.ids, want.lens.ids) and torch.equal(got.lens.probs, want.lens.probs)
    with pytest.raises(InvalidTokens, match="max_tokens"):  # checked as stream checks it
        asyncio.run(model.collect_steps(token_ids, max_tokens=0))


def test_sampling_defaults_come_from_generation_config(model: Any, tmp_path: Path) -> None:
    # interp:tiny states do_sample false: unset knobs decode greedily
    assert model.recommended_sampling.do_sample is False
    assert model.sampling_settings() == SamplingSettings(0.0, None, None, 0.0)
    assert model.sampling_settings(temperature=0.3).temperature == 0.3
    # a checkpoint that recommends sampling (gemma-3-270m-it's file), copied beside the tiny weights
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_path(), folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "eos_token_id": 0})
    )
    sampled = load_model(folder, backend="eager")
    recommended = sampled.recommended_sampling
    assert (recommended.temperature, recommended.top_k, recommended.top_p) == (1.0, 64, 0.95)
    assert sampled.sampling_settings(temperature=0.3) == SamplingSettings(
        temperature=0.3, top_k=64, top_p=0.95, presence_penalty=0.0
    )
    assert sampled.sampling_settings(top_k=0, top_p=1.0).top_k is None  # a recommended filter turned off
    token_ids = _ids(sampled)
    text = asyncio.run(sampled.generate_text(token_ids, max_tokens=8, temperature=0.3, presence_penalty=1.5, seed=1))
    again = asyncio.run(sampled.generate_text(token_ids, max_tokens=8, temperature=0.3, presence_penalty=1.5, seed=1))
    assert text == again
    # the recommended filters are what generate_text ran with: the same seed through generate's own knobs
    explicit = asyncio.run(
        sampled.generate(token_ids, max_tokens=8, temperature=0.3, top_k=64, top_p=0.95, presence_penalty=1.5, seed=1)
    )
    assert text == explicit.text
    # generate itself stays greedy unless told (our documented rule)
    assert asyncio.run(sampled.generate(token_ids, max_tokens=8)).text == asyncio.run(
        sampled.generate_text(token_ids, max_tokens=8, temperature=0.0)
    )
    asyncio.run(sampled.shutdown())


def test_the_presence_penalty_is_subtracted_from_the_generated_tokens() -> None:
    from interp_eager._generate import choose
    from interp_engine import SamplingOptions

    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    options = SamplingOptions.from_kwargs({"presence_penalty": 0.5})
    assert choose(options, logits, None, generated=[]) == 0
    assert choose(options, logits, None, generated=[0, 0]) == 1  # 3.0 - 0.5 < 2.9, once however often seen
    assert choose(SamplingOptions(), logits, None, generated=[0]) == 0
    with pytest.raises(InvalidOption, match="presence_penalty"):
        SamplingOptions.from_kwargs({"presence_penalty": 3.0})


# -- chat on model.tok ------------------------------------------------------------------------------


def test_chat_helpers_on_tok(model: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert isinstance(model.tok, Tokenize)
    prompt = model.tok.apply_chat_template(messages)
    token_ids = model.tok.apply_chat_template(messages, tokenize=True)
    chat = model.chat_tokens(messages)
    assert prompt == chat.text and token_ids == list(chat.ids)
    assert model.tok.has_chat_template()
    assert model.tok.accepted_template_kwargs(["enable_thinking", "add_generation_prompt"]) == {"add_generation_prompt"}
    spans = model.tok.message_spans(messages)
    assert [s.position for s in spans] == list(range(len(token_ids)))
    content = [s.token_id for s in spans if s.section == "content"]
    assert model.to_string(content).strip() == "Hi"
    assert {s.role for s in spans if s.message_index == 0} == {"user"}
    assert spans[-1].role == "assistant" and spans[-1].message_index is None  # the generation prompt


def test_message_partition_covers_every_token(model: Any) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "The capital of France is"},
        {"role": "assistant", "content": "Paris."},
    ]
    token_ids, spans = model.tok.message_partition(messages)
    assert len(spans) == len(messages)
    assert spans[0][0] == 0 and spans[-1][1] == len(token_ids)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    acts = asyncio.run(model.capture(token_ids, ["resid_post.1"]))[Address("resid_post", 1)]
    per_turn = [acts[start:end].mean(0) for start, end in spans]
    assert len(per_turn) == 3 and all(t.shape == (model.d_model,) for t in per_turn)
    assert model.to_string(token_ids[spans[2][0] : spans[2][1]]).startswith("Assistant: Paris.")


def test_no_chat_template_is_refused_not_invented() -> None:
    plain = eager_model("gpt2")  # the testkit's tokenizer has no template
    assert not plain.tok.has_chat_template()
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        plain.tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert NoChatTemplateError is NoChatTemplate


# -- capture while generating ---------------------------------------------------------------------


def test_capture_generation_rows_and_its_stream(model: Any) -> None:
    token_ids = _ids(model)

    async def run() -> tuple[Any, Any, list[Any]]:
        completion, acts = await model.capture_generation(token_ids, ["resid_post.1"], max_tokens=4)
        chunks = [chunk async for chunk in model.capture_generation_stream(token_ids, ["resid_post.1"], max_tokens=4)]
        return completion, acts, chunks

    completion, acts, chunks = asyncio.run(run())
    rows = acts[Address("resid_post", 1)]
    # our rule: one row per prompt token and per generated token (the last token is fed back)
    assert rows.shape[0] == len(token_ids) + len(completion.token_ids)
    streamed = torch.cat([new_rows[Address("resid_post", 1)] for new_rows, _ in chunks])
    assert torch.equal(streamed, rows)
    assert chunks[-1][1] == completion.token_ids


# -- steering -------------------------------------------------------------------------------------


def test_the_public_spec_is_our_spec(model: Any) -> None:
    vector = torch.randn(model.d_model)
    vector /= vector.norm()
    spec = SteeringSpec(layers={1: LayerSteeringSpec(operations=[AddSpec(vector=vector, scale=4.0)])})
    assert spec == SteeringSpec([Write("resid_post.1", vector, op="add", scale=4.0)])
    assert SteeringSpec.from_json(spec.to_json()) == spec
    assert SteeringSpec(layers=spec.layers, point=spec.point) == spec
    assert spec.layers == {1: LayerSteeringSpec([AddSpec(vector=vector, scale=4.0)])}

    token_ids = _ids(model)
    _, acts = asyncio.run(model.capture_generation(token_ids, ["resid_post.1"], steering_spec=spec))
    assert acts[Address("resid_post", 1)].shape[0] == len(token_ids) + 8  # max_tokens defaults to 8
    ours = asyncio.run(model.capture(token_ids, ["resid_post.1"], steering_spec=spec))
    plain = asyncio.run(model.capture(token_ids, ["resid_post.1"]))
    moved = ours[Address("resid_post", 1)] - plain[Address("resid_post", 1)]
    assert torch.allclose(moved, (4.0 * vector).expand_as(moved), atol=1e-5)


def test_each_op_object_is_a_row_of_our_registry(model: Any) -> None:
    v, t = _unit(model, 1), _unit(model, 2)
    pairs = [
        (AddSpec(vector=3 * v, scale=2.0, normalize=True), Write("mlp_out.2", 3 * v / (3 * v).norm(), scale=2.0)),
        (ProjectionCapSpec(vector=v, min=-1.0, max=2.0), Write("mlp_out.2", v, op="cap", lo=-1.0, hi=2.0)),
        (OrthogonalDecompSpec(vector=v, coeff=0.5), Write("mlp_out.2", v, op="rescale", scale=0.5)),
        (
            NormScaledAddSpec(vector=v, strength=0.3, max_fraction=0.2),
            Write("mlp_out.2", v, op="norm_add", scale=0.3, max_fraction=0.2),
        ),
        (AblateSpec(vector=v), Write("mlp_out.2", v, op="ablate")),
        (SwapSpec(vector=v, target=t), Write("mlp_out.2", v, op="swap", target=t)),
    ]
    for op, write in pairs:
        spec = SteeringSpec.at("mlp_out.2", op)
        assert spec == SteeringSpec([write]), op
        assert spec.layers[2].operations == (op,) or isinstance(op, AddSpec)
        assert SteeringSpec(layers=spec.layers, point="mlp_out") == spec
        assert SteeringSpec.from_json(spec.to_json()) == spec


def test_the_registry_names_each_op_object() -> None:
    from interp_engine.steering._ops import OP_SPECS
    from interp_engine.steering._writes import OP_ROWS, op_row

    assert {op_row(cls.op).op_object for cls in OP_SPECS} == {cls.__name__ for cls in OP_SPECS}
    assert {row.name for row in OP_ROWS if row.op_object is None} == {"set"}


def test_a_list_of_specs_composes_in_order(model: Any) -> None:
    vector, other = _unit(model, 3), _unit(model, 4)
    specs = [
        SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0)),
        SteeringSpec.at("mlp_out.2", ProjectionCapSpec(vector=other, max=2.0)),
    ]
    token_ids = _ids(model)
    _, listed = asyncio.run(model.capture_generation(token_ids, ["resid_post.3"], steering_spec=specs))
    _, combined = asyncio.run(
        model.capture_generation(token_ids, ["resid_post.3"], steering_spec=SteeringSpec.combine(specs))
    )
    assert torch.equal(listed[Address("resid_post", 3)], combined[Address("resid_post", 3)])
    one_row = run_with_cache(model, token_ids, ["resid_post.3"], steering_spec=specs)
    assert torch.equal(one_row["resid_post.3"][0], combined[Address("resid_post", 3)][: len(token_ids)])


def test_op_objects_refuse_what_no_backend_can_steer_with(model: Any) -> None:
    with pytest.raises(InvalidSteering, match="zero vector"):
        AblateSpec(vector=torch.zeros(model.d_model))
    with pytest.raises(InvalidSteering, match=r"finite|inf|nan|NaN"):
        AddSpec(vector=torch.full((model.d_model,), float("nan")), scale=1.0)
    with pytest.raises(InvalidSteering, match="min=, max= or both"):
        ProjectionCapSpec(vector=_unit(model))
    patched = SteeringSpec([Write("resid_post.1", torch.zeros(model.d_model), op="set")])
    with pytest.raises(InvalidSteering, match="op='set'"):
        patched.layers  # noqa: B018
    two_points = (
        SteeringSpec.at("resid_post.1", AblateSpec(vector=_unit(model))).writes
        + SteeringSpec.at("mlp_out.1", AblateSpec(vector=_unit(model))).writes
    )
    with pytest.raises(InvalidSteering, match="not at one point"):
        SteeringSpec(two_points).point  # noqa: B018
    with pytest.raises(InvalidSteering, match="stream"):
        SteeringSpec(layers={1: [AddSpec(vector=_unit(model), scale=1.0)]}, stream=0)


def test_steer_as_a_block(model: Any) -> None:
    vector = _unit(model, 5)
    spec = SteeringSpec(layers={1: LayerSteeringSpec(operations=[AddSpec(vector=vector, scale=4.0)])})
    tokens = model.to_tokens(PROMPT)
    with steer(model, spec):
        completion, acts = capture_generation(model, tokens, ["resid_post.1"], max_tokens=8)
        steps = list(generate_stream(model, tokens, max_tokens=8))
    explicit_completion, explicit = capture_generation(
        model, tokens, ["resid_post.1"], max_tokens=8, steering_spec=spec
    )
    assert completion.token_ids == explicit_completion.token_ids
    assert torch.equal(acts["resid_post.1"], explicit["resid_post.1"])
    assert "".join(step.token_str for step in steps) == explicit_completion.text
    # outside the block nothing is steered
    _, after = capture_generation(model, tokens, ["resid_post.1"], max_tokens=8)
    _, plain = capture_generation(model, tokens, ["resid_post.1"], max_tokens=8)
    assert torch.equal(after["resid_post.1"], plain["resid_post.1"])


def test_steer_leaves_masked_and_generated_positions_alone(model: Any) -> None:
    vector = _unit(model, 6)
    spec = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0))
    ids = _ids(model)
    n = len(ids)

    async def run() -> tuple[Any, Any]:
        with steer(model, spec, prompt_token_ids=ids, position_mask=[0], generated=False):
            return await model.capture_generation(ids, ["resid_post.3"], max_tokens=8)

    completion, acts = asyncio.run(run())
    positions = SteeringSpec([Write("resid_post.1", vector, scale=4.0, positions=list(range(1, n)))])
    reference_completion, reference = asyncio.run(
        model.capture_generation(ids, ["resid_post.3"], max_tokens=8, steering_spec=positions)
    )
    assert completion.token_ids == reference_completion.token_ids
    assert torch.equal(acts[Address("resid_post", 3)], reference[Address("resid_post", 3)])


def test_steer_can_leave_the_special_tokens_alone(model: Any) -> None:
    vector = _unit(model, 7)
    spec = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=4.0))
    chat = model.chat_tokens([{"role": "user", "content": "The capital of France is"}])
    special = {p for p, token in enumerate(chat) if token in model.tokenizer.all_special_ids}
    assert special == {0}  # interp:tiny's template opens with <|endoftext|>
    with steer(model, spec, position_mask=SteerMask.SPECIAL_TOKENS):
        completion, acts = capture_generation(model, chat, ["resid_post.3"], max_tokens=4)
    kept = [p for p in range(len(chat)) if p not in special]
    reference_spec = SteeringSpec(
        [
            Write("resid_post.1", vector, scale=4.0, positions=kept),
            Write("resid_post.1", vector, scale=4.0, positions="generated"),
        ]
    )
    reference_completion, reference = capture_generation(
        model, chat, ["resid_post.3"], max_tokens=4, steering_spec=reference_spec
    )
    assert completion.token_ids == reference_completion.token_ids
    assert torch.equal(acts["resid_post.3"], reference["resid_post.3"])


def test_the_lower_level_steerspec_list(model: Any) -> None:
    from interp_engine.steering._writes import op_row

    # USAGE's example (layer 2 of the tiny model's 4 in place of layer 10): a no-op steer
    with steer(model, [SteerSpec(vector=torch.zeros(model.d_model), layer=2, coeff=1.0)]):
        pass  # any forward inside here is steered
    vector, other = _unit(model, 8), _unit(model, 9)
    tokens = model.to_tokens(PROMPT)
    with steer(model, [SteerSpec(vector=vector, layer=2, coeff=4.0)]):
        steered = capture(model, tokens, ["resid_post.3"])
    at_two = SteeringSpec.at("resid_post.2", AddSpec(vector=vector, scale=4.0))
    reference = capture(model, tokens, ["resid_post.3"], steering_spec=at_two)
    plain = capture(model, tokens, ["resid_post.3"])
    assert torch.equal(steered["resid_post.3"], reference["resid_post.3"])
    assert not torch.equal(steered["resid_post.3"], plain["resid_post.3"])
    # every method is the op object of the same row of our registry, the same value as SteeringSpec.at
    by_method = {
        "additive": AddSpec(vector=vector, scale=0.5, normalize=True),
        "orthogonal": OrthogonalDecompSpec(vector=vector, coeff=0.5),
        "projection_cap": ProjectionCapSpec(vector=vector, min=-1.0, max=2.0),
        "norm_scaled_add": NormScaledAddSpec(vector=vector, strength=0.5, max_fraction=0.25, normalize=True),
        "ablate": AblateSpec(vector=vector),
        "swap": SwapSpec(vector=vector, target=other),
    }
    fields = {"coeff": 0.5, "normalize": True, "min": -1.0, "max": 2.0, "max_fraction": 0.25, "target": other}
    for method, op in by_method.items():
        lower = SteerSpec(vector=vector, layer=1, method=method, point="mlp_out", **fields)
        assert op_row(op.op).steer_method == method  # the registry's own column
        assert lower.op_spec() == op and lower.address == Address("mlp_out", 1)
        assert SteeringSpec.combine([lower]) == SteeringSpec.at("mlp_out.1", op)
    # a list of them is one steer, applied in order, wherever a spec is taken
    lowers = [SteerSpec(vector=vector, layer=1, coeff=2.0), SteerSpec(vector=other, layer=1, method="ablate")]
    combined = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=2.0), AblateSpec(vector=other))
    rows = torch.cat([tokens, tokens])  # on a batch, a list of SteerSpec is every row's
    got = capture(model, rows, ["resid_post.2"], steering_spec=lowers)
    expected = capture(model, rows, ["resid_post.2"], steering_spec=combined)
    assert torch.equal(got["resid_post.2"], expected["resid_post.2"])
    assert SteeringSpec.from_json(SteeringSpec.combine(lowers).to_json()) == combined


def test_steerspec_refusals_name_what_to_write(model: Any) -> None:
    vector = _unit(model)
    with pytest.raises(InvalidSteering, match="expected one of additive"):
        SteerSpec(vector=vector, layer=1, method="add")
    with pytest.raises(InvalidSteering, match="stream=None"):
        SteerSpec(vector=vector, layer=1, stream=0)
    with pytest.raises(InvalidSteering, match="needs target="):
        SteerSpec(vector=vector, layer=1, method="swap")
    with pytest.raises(InvalidSteering, match="kind without a layer"):
        SteerSpec(vector=vector, layer=1, point="resid_post.1")
    with pytest.raises(InvalidSteering, match="zero vector"):
        SteerSpec(vector=torch.zeros(model.d_model), layer=1, method="ablate")
    with pytest.raises(InvalidSteering, match=r"item 0 is a object"), steer(model, [object()]):  # type: ignore[list-item]
        pass
    spec = SteeringSpec.at("resid_post.1", AddSpec(vector=vector, scale=1.0))
    with (
        pytest.raises(InvalidSteering, match="prompt_token_ids are token ids"),
        steer(model, spec, prompt_token_ids=[1.5]),
    ):
        pass
    with pytest.raises(InvalidSteering, match="position_mask"), steer(model, spec, position_mask="special"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("SteerMethod", "'additive', 'orthogonal'"),
        ("hf_generate_kwargs", "sampling_settings"),
        ("GenStep", "StreamStep"),
        ("CAPABILITIES", "UnsupportedOperation"),
        ("CapabilityUnsupported", "UnsupportedOperation"),
        ("check_flashinfer", "warmup"),
        ("check_cuda_driver", "warmup"),
        ("VLLMModel", "backend='vllm'"),
        ("EagerModel", "backend='eager'"),
    ],
)
def test_names_not_here_say_what_to_use(name: str, says: str) -> None:
    with pytest.raises(NotInThisEngine, match=says) as raised:
        exec(f"from interp_engine import {name}", {})
    assert isinstance(raised.value, ImportError) and raised.value.name == name
    import interp_engine

    assert not hasattr(interp_engine, "no_such_name")  # other names are plain AttributeErrors


# -- the unembed, without an event loop, padded batches -------------------------------------------


def test_decode_residuals_method_and_free_function(model: Any) -> None:
    token_ids = _ids(model)

    async def logit_lens() -> tuple[torch.Tensor, torch.Tensor]:
        acts = await model.capture(token_ids, ["resid_post.3", "logits"])
        logits = await model.decode_residuals(acts[Address("resid_post", 3)])
        return logits, acts[Address("logits")]

    logits, reference = asyncio.run(logit_lens())
    assert rel_diff(logits, reference) <= 1e-4
    assert model.to_string(logits[-1].argmax().item()) == " Paris"
    residuals = run_with_cache(model, token_ids, ["resid_post.3"])["resid_post.3"]
    raw = decode_residuals(model, residuals, softcap=None)
    assert torch.equal(raw, decode_residuals(model, residuals))
    capped = decode_residuals(model, residuals, softcap=5.0)
    assert torch.allclose(capped, 5.0 * torch.tanh(raw / 5.0))


def test_without_an_event_loop(model: Any) -> None:
    tokens = model.to_tokens(PROMPT)
    cache = capture(model, tokens, ["resid_post.3"])
    completion, gen_cache = capture_generation(model, tokens, ["resid_post.3"], max_tokens=8)
    attn = capture_attention(model, tokens, [1])  # {1: {"scores", "probs", "value"}}
    steps = list(generate_stream(model, tokens, max_tokens=8, n_logprobs=5))
    assert cache["resid_post.3"].shape[:2] == (1, tokens.shape[1])
    assert gen_cache["resid_post.3"].shape[1] == tokens.shape[1] + len(completion.token_ids)
    assert "".join(step.token_str for step in steps) == completion.text
    assert all(len(step.logprobs) == 5 for step in steps)
    assert isinstance(attn, AttentionCache)
    layer = attn[1]
    assert set(layer) == {"scores", "probs", "value"}
    n = tokens.shape[1]
    assert layer["probs"].shape == (model.n_heads, n, n)
    assert torch.equal(layer["probs"], attn["attn_pattern.1"][0])
    assert torch.allclose(layer["scores"].softmax(-1), layer["probs"], atol=1e-5)
    z = run_with_cache(model, tokens, ["attn_z.1"])["attn_z.1"][0]  # probs @ value is each head's output
    heads = torch.einsum("hqk,khd->qhd", layer["probs"], layer["value"])
    assert rel_diff(heads, z) <= 1e-4
    assert list(attn) == [Address("attn_pattern", 1)]  # our form, unchanged
    method = asyncio.run(model.capture_attention(tokens[0].tolist(), [1]))
    assert torch.equal(method[1]["scores"], layer["scores"])
    assert list(method) == [Address("attn_pattern", 1)]


def test_a_padded_batch_with_its_attention_mask(model: Any) -> None:
    short, long = model.to_tokens("The capital")[0].tolist(), _ids(model)
    pad = len(long) - len(short)
    tokens = torch.tensor([[1] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    assert position_ids_from_mask(mask)[0].tolist() == [0] * pad + list(range(len(short)))
    cache = capture(model, tokens, ["resid_post.2", "attn_pattern.1"], attention_mask=mask)
    alone = run_with_cache(model, short, ["resid_post.2", "attn_pattern.1"])
    assert rel_diff(cache["resid_post.2"][0, pad:], alone["resid_post.2"][0]) <= 1e-4
    assert rel_diff(cache["attn_pattern.1"][0, :, pad:, pad:], alone["attn_pattern.1"][0]) <= 1e-4
    assert not cache["resid_post.2"][0, :pad].any()
    again = run_with_cache(
        model,
        tokens,
        ["resid_post.2", "attn_pattern.1"],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
    )
    assert torch.equal(again["resid_post.2"], cache["resid_post.2"])
    with pytest.raises(InvalidTokens, match="position_ids"):
        capture(model, tokens, ["resid_post.2"], attention_mask=mask, position_ids=torch.arange(len(long)).repeat(2, 1))
    with pytest.raises(InvalidTokens, match="between real tokens"):
        capture(model, tokens[1:], ["resid_post.2"], attention_mask=torch.tensor([[1, 0] + [1] * (len(long) - 2)]))


def test_sync_model_mirrors_the_new_methods(model: Any) -> None:
    sync = sync_model(model)
    token_ids = _ids(model)
    text = sync.generate_text(token_ids, max_tokens=6, temperature=0.0)
    assert "".join(sync.generate_stream(token_ids, max_tokens=6, temperature=0.0)) == text
    ((rows, ids),) = list(sync.capture_generation_stream(token_ids, ["resid_post.1"], max_tokens=3))
    assert rows[Address("resid_post", 1)].shape[0] == len(token_ids) + len(ids)
    logits = sync.decode_residuals(sync.capture(token_ids, ["resid_post.3"])[to_address("resid_post.3")])
    assert logits.shape == (len(token_ids), model.info.vocab_size)


def test_capabilities_that_differ_say_what_to_call(model: Any) -> None:
    with pytest.raises(UnsupportedOperation, match="run_with_gradients"):
        capture(model, model.to_tokens(PROMPT), ["resid_post.1"], detach=False)
    # this environment installs vLLM exactly where it installs interp-vllm's backends
    assert vllm_installed() == ("vllm" in installed_backends())


def test_backend_names_not_here_say_what_to_name() -> None:
    with pytest.raises(BackendNotFound, match="backend='eager' or backend='vllm'"):
        load_model("interp:tiny", backend="auto")
    with pytest.raises(BackendNotFound, match="backend='vllm' generates"):
        load_model("interp:tiny", backend="vllm-generate")


def test_points_the_public_package_aliases_on_every_family(model: Any) -> None:
    # mlp_out_post / attn_out_post are theirs on every family; here only where a sandwich norm makes
    # them differ from mlp_out / attn_out, and the refusal names the point to capture instead
    token_ids = _ids(model)
    for point, instead in (("mlp_out_post.1", "mlp_out is what is added"), ("attn_out_post.1", "attn_out is what")):
        with pytest.raises(KindNotInFamily, match=instead):
            asyncio.run(model.capture(token_ids, [point]))


PUBLIC_NAMES = (
    "capture",
    "steer",
    "SteerMask",
    "position_ids_from_mask",
    "parse_address",
    "to_address",
    "format_address",
    "vllm_installed",
    "AddSpec",
    "ProjectionCapSpec",
    "OrthogonalDecompSpec",
    "NormScaledAddSpec",
    "AblateSpec",
    "SwapSpec",
    "LayerSteeringSpec",
    "SteerSpec",
    "Tokenize",
    "TokenSpan",
    "RecommendedSampling",
    "SamplingSettings",
)


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_the_public_packages_names_are_documented(name: str) -> None:
    import interp_engine

    api = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md").read_text()
    value = getattr(interp_engine, name)
    assert name in interp_engine.__all__
    assert (value.__doc__ or "").strip(), name
    assert f"::: interp_engine.{name}\n" in api, name


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("set_steering", "with steer"),
        ("generate_steps", "model.stream"),
        ("project", "acts\\[address\\] @ directions.T"),
        ("grad_support", "run_with_gradients"),
        ("residual_basis", "one residual stream"),
    ],
)
def test_model_attributes_not_here_say_what_to_use(model: Any, name: str, says: str) -> None:
    with pytest.raises(AttributeError, match=says):
        getattr(model, name)
    with pytest.raises(AttributeError, match=says):  # the sync facade passes the lookup through
        getattr(sync_model(model), name)
    assert not hasattr(model, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        model.no_such_name  # noqa: B018
