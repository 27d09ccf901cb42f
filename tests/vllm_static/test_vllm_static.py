"""The vllm-static backend on vLLM's compiled path (``enforce_eager=False``): taps and writes
declared before the engine exists and traced into the compiled graph.

Three compiled engines (the folder's, from its conftest), one per way of declaring: llama with
``static_points=[...]`` at load (and only 4 steering slots, with chunked prefill over 64-token
steps), qwen2 with ``"auto"`` bound by ``configure_static`` before warm-up, gpt2 with ``"auto"``
never bound (the default set). Results are checked against HF and the dynamic ``vllm`` backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidOption,
    InvalidSteering,
    LayerOutOfRange,
    LensRequest,
    StaticConfigError,
    SteeringSpec,
    UndeclaredAddress,
    UnknownKind,
    UnsupportedAddress,
    Write,
    load_model,
    logit_attribution,
    run_with_cache,
    weights,
)
from interp_testkit.suite import LONG as LONG_IDS
from interp_testkit.suite import PROMPT, hf_for, rel_diff, vllm_model_path

from ..support.lens import assert_same_lens, check_against, decoded_lens
from ..support.static import POINTS, WRITES
from ..support.weights import hf_parameters

TOL = 1e-4
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)  # > 64 tokens: chunked prefill


def _ids(facade: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = facade.to_tokens(text)[0].tolist()
    return ids


def _specs(info: Any) -> list[SteeringSpec]:
    gen = torch.Generator().manual_seed(11)

    def vec(width: int = info.d_model, rows: int = 0) -> torch.Tensor:
        return torch.randn(*((rows,) if rows else ()), width, generator=gen)

    v = vec()
    return [
        SteeringSpec([Write("resid_post.1", vec(), op="add", scale=4.0)]),
        SteeringSpec([Write("resid_post.1", v, op="ablate"), Write("resid_post.1", vec(), op="add", positions=[2, 3])]),
        SteeringSpec([Write("resid_post.1", vec(), op="add"), Write("resid_post.1", v, op="ablate", scale=0.5)]),
        SteeringSpec([Write("resid_mid.1", vec(rows=3), op="set", positions=[0, 4, -1])]),
        SteeringSpec([Write("mlp_post.0", vec(info.d_mlp), op="set", positions="prompt")]),
        SteeringSpec([Write("embed", vec(), op="add", scale=2.0), Write("attn_out.1", vec(), op="ablate")]),
        SteeringSpec([Write("resid_pre.1", vec(), op="add", positions="generated", scale=8.0)]),
        SteeringSpec([Write("mlp_out.2", vec(), op="add", scale=3.0, positions=[-1])]),
        # heads: zero-ablation, per-head rows with an ablation on another head, a per-position
        # patch of one head, and a value head (a key/value head under GQA)
        SteeringSpec([Write("attn_z.1", torch.zeros(info.d_head), op="set", heads=[0])]),
        SteeringSpec(
            [
                Write("attn_z.1", vec(info.d_head, rows=2), op="add", scale=2.0, heads=[1, 3]),
                Write("attn_z.1", vec(info.d_head), op="ablate", heads=[0]),
            ]
        ),
        SteeringSpec(
            [Write("attn_z.1", vec(info.d_head, rows=3).unsqueeze(1), op="set", heads=[2], positions=[0, 1, 2])]
        ),
        SteeringSpec([Write("attn_v.0", vec(info.d_head), op="add", scale=3.0, heads=[info.n_kv_heads - 1])]),
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_captures_equal_hf_and_the_vllm_backend(static_engines: Any, vllm_engines: Any, family: str) -> None:
    static, dynamic = static_engines[family], vllm_engines(family)
    for text in (PROMPT, LONG):
        ids = _ids(static, text)
        got = static.capture(ids, POINTS)
        with torch.no_grad():
            hf = hf_for(vllm_model_path(family))(torch.tensor([ids]), output_hidden_states=True)
        hidden = hf.hidden_states
        assert rel_diff(got[Address("embed")], hidden[0][0]) <= TOL
        assert rel_diff(got[Address("resid_pre", 1)], hidden[1][0]) <= TOL
        for layer in range(2):  # HF's last hidden state is after the final norm
            assert rel_diff(got[Address("resid_post", layer)], hidden[layer + 1][0]) <= TOL
        assert rel_diff(got[Address("final_norm")], hidden[3][0]) <= TOL
        assert rel_diff(got[Address("logits")], hf.logits[0]) <= TOL
        reference = dynamic.capture(ids, POINTS)
        for point in POINTS:
            address = Address.parse(point)
            assert rel_diff(got[address], reference[address]) <= TOL, point


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_steering_equals_the_vllm_backend(static_engines: Any, vllm_engines: Any, family: str) -> None:
    static, dynamic = static_engines[family], vllm_engines(family)
    ids = _ids(static)
    points = ["resid_post.2", "logits"]
    plain = static.capture(ids, points)
    for spec in _specs(static.info):
        got = static.capture(ids, points, steering_spec=spec)
        reference = dynamic.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(got[Address.parse(point)], reference[Address.parse(point)]) <= TOL, spec
        if all(w.positions != "generated" for w in spec.writes):
            assert not torch.allclose(got[Address("logits")], plain[Address("logits")])
        completion, acts = static.capture_generation(ids, points, max_tokens=4, steering_spec=spec, ignore_eos=True)
        ref_completion, ref_acts = dynamic.capture_generation(
            ids, points, max_tokens=4, steering_spec=spec, ignore_eos=True
        )
        assert completion.token_ids == ref_completion.token_ids
        assert rel_diff(acts[Address("logits")], ref_acts[Address("logits")]) <= TOL
        streamed = [step.token_id for step in static.stream(ids, max_tokens=4, steering_spec=spec, ignore_eos=True)]
        assert streamed == completion.token_ids


def test_static_steering_over_chunked_prefill_equals_the_vllm_backend(static_engines: Any, vllm_engines: Any) -> None:
    static, dynamic = static_engines["llama"], vllm_engines("llama")
    ids = _ids(static, LONG)
    assert len(ids) > 64  # several 64-token steps
    gen = torch.Generator().manual_seed(5)
    spec = SteeringSpec(
        [
            Write("resid_post.1", torch.randn(len(ids), 128, generator=gen), op="set", positions="prompt"),
            Write("mlp_post.0", torch.randn(static.info.d_mlp, generator=gen), op="add", positions=[3, 70, -2]),
        ]
    )
    with pytest.raises(InvalidSteering, match="static_write_slots"):  # one slot per row, 4 slots
        static.capture(ids, ["logits"], steering_spec=spec)
    spec = SteeringSpec(spec.writes[1:])
    got = static.capture(ids, ["resid_post.2", "logits"], steering_spec=spec)
    reference = dynamic.capture(ids, ["resid_post.2", "logits"], steering_spec=spec)
    for point in got:
        assert rel_diff(got[point], reference[point]) <= TOL


def test_concurrent_steered_and_unsteered_requests_equal_their_solo_runs(static_engines: Any) -> None:
    facade = static_engines["llama"]  # 4 slots per site: 13 steered requests wait for each other
    model = facade.model
    points = [Address("resid_post", 2), Address("logits")]
    prompts = ["Hello there, how are you", PROMPT, "A cat sat on the mat", "Once upon a time there was"]
    specs: list[SteeringSpec | None] = [None, *_specs(model.info)[:4]]
    jobs = [(_ids(facade, p), s) for p in prompts for s in specs]

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))

    batched = facade.run(together)
    for (ids, spec), result in zip(jobs, batched, strict=True):
        alone = facade.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(result[point], alone[point]) <= TOL
    stats = facade.run(model.worker_stats)
    assert [s["held_slots"] for s in stats] == [0]
    assert [s["live_requests"] for s in stats] == [0]


def test_cancelled_and_finished_steered_requests_free_their_slots(static_engines: Any) -> None:
    facade = static_engines["llama"]
    model = facade.model
    ids = _ids(facade)
    spec = _specs(model.info)[3]  # three slots of the four

    async def stop_early() -> list[int]:
        seen = []
        async with contextlib.aclosing(model.stream(ids, max_tokens=100, steering_spec=spec, ignore_eos=True)) as steps:
            async for step in steps:
                seen.append(step.token_id)
                if len(seen) == 2:
                    break
        # a second request needing three slots gets them: the first one's were given back
        return (await model.generate(ids, max_tokens=3, steering_spec=spec, ignore_eos=True)).token_ids

    assert len(facade.run(stop_early)) == 3
    # the worker forgets a steering-only request when vLLM tells it the request is done (the
    # engine's next step, which vLLM runs at once to pass finished ids on)
    deadline = time.monotonic() + 10
    while True:
        (stats,) = facade.run(model.worker_stats)
        if (stats["held_slots"] == 0 and stats["live_requests"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["held_slots"] == 0 and stats["live_requests"] == 0
    assert all(used == 0 for used in model._slots_used.values())


def test_unsteered_rows_of_a_steered_request_are_bit_identical(static_engines: Any) -> None:
    facade = static_engines["qwen2"]
    ids = _ids(facade)
    plain = facade.capture(ids, ["resid_post.1", "resid_post.2"])
    spec = SteeringSpec([Write("resid_post.1", torch.ones(128), op="add", positions=[-1])])
    steered = facade.capture(ids, ["resid_post.1", "resid_post.2"], steering_spec=spec)
    for point in plain:
        assert torch.equal(steered[point][:-1], plain[point][:-1])
        assert not torch.equal(steered[point][-1], plain[point][-1])


def test_requests_never_recompile(static_engines: Any) -> None:
    facade = static_engines["qwen2"]
    model = facade.model
    (before,) = facade.run(model.worker_stats)
    # the compiled path ran: vLLM compiled the model with the taps in it
    assert before["dynamo_compiled_graphs"] >= 1 and before["dynamo_unique_graphs"] >= 1
    assert before["static_tables"] == len(WRITES)
    specs = _specs(model.info)
    texts = ["Hello there my good friend", PROMPT, "A cat sat on the mat and looked at the dog", LONG]
    for i in range(20):
        ids = _ids(facade, texts[i % len(texts)])
        facade.capture(ids, [POINTS[i % len(POINTS)]], steering_spec=specs[i % len(specs)])
    (after,) = facade.run(model.worker_stats)
    counters = [k for k in before if k.startswith(("vllm_", "dynamo_unique", "dynamo_compiled"))]
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}


def test_the_default_tap_set_is_every_resid_post(static_engines: Any) -> None:
    facade = static_engines["gpt2"]
    assert facade.model.static_points == [Address("resid_post", layer) for layer in range(3)]
    assert facade.model.static_writes == []
    ids = _ids(facade)
    got = run_with_cache(facade, facade.to_tokens(PROMPT), ["resid_post.0", "resid_post.-1"])
    assert got["resid_post.0"].shape == (1, len(ids), 128)
    with torch.no_grad():
        hidden = hf_for(vllm_model_path("gpt2"))(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert rel_diff(got["resid_post.0"][0], hidden[1][0]) <= TOL
    # HF applies the final norm to its last hidden state; the residual is what the lens decodes
    logits = facade.decode_residuals(got["resid_post.-1"])
    with torch.no_grad():
        reference = hf_for(vllm_model_path("gpt2"))(torch.tensor([ids])).logits
    assert rel_diff(logits, reference) <= TOL
    with pytest.raises(UndeclaredAddress, match=r"declared: \[resid_post.0, resid_post.1, resid_post.2\]"):
        facade.capture(ids, ["mlp_out.1"])
    with pytest.raises(UndeclaredAddress, match="not a write point"):
        facade.generate(ids, max_tokens=2, steering_spec=SteeringSpec([Write("resid_post.1", torch.ones(128))]))
    assert facade.generate(ids, max_tokens=3).token_ids  # still serving


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_static_weights_equal_hf(static_engines: Any, family: str) -> None:
    """The compiled engine serves the same weights (read from its workers, whatever taps it
    declared); direct logit attribution needs captures the declaration lacks: a clear error."""
    w = weights(static_engines[family])
    for layer in range(w.info.n_layers):
        expected = hf_parameters(family, layer)
        for name in ("W_O", "b_O"):
            if name in expected:
                assert torch.equal(w.get(name, layer), expected[name]), (name, layer)
    for name in ("W_E", "W_U", "ln_final.w", "ln_final.b"):
        if name in expected:
            assert torch.equal(w.get(name), expected[name]), name
    assert w.layout.tied == (family == "gpt2")
    with pytest.raises(UndeclaredAddress):
        logit_attribution(static_engines[family], PROMPT, 5, 7)


def test_configure_static_after_the_engine_is_built_raises(static_engines: Any) -> None:
    for facade in static_engines.values():
        with pytest.raises(StaticConfigError, match="before the engine is built"):
            facade.configure_static(["resid_post.0"])
    assert isinstance(StaticConfigError("x"), RuntimeError)


def test_configure_static_before_build_binds_the_set() -> None:
    model = load_model(vllm_model_path("llama"), backend="vllm-static", static_points="auto")
    assert model.static_points == [Address("resid_post", layer) for layer in range(3)]  # the default
    model.configure_static(["resid_post.-1", "logits"], static_writes=["resid_pre.-1"])
    assert model.static_points == [Address("resid_post", 2), Address("logits")]
    assert model.static_writes == [Address("resid_pre", 2)]
    model.configure_static(["mlp_post.1"])  # again, before build: replaces the points, keeps the writes
    assert model.static_points == [Address("mlp_post", 1)]
    assert model.static_writes == [Address("resid_pre", 2)]
    with pytest.raises(InvalidOption, match="not 'auto'"):
        model.configure_static("auto")
    model.configure_static([], static_writes=["resid_post.1"])  # a steering-only engine
    assert model.static_points == [] and model.static_writes == [Address("resid_post", 1)]
    with pytest.raises(UndeclaredAddress, match=r"declared: \[\] \(none\)"):
        asyncio.run(model.capture([1, 2, 3], ["resid_post.1"]))  # checked before any engine exists


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"static_writes": ["logits"]}, UnsupportedAddress, "writable kinds"),
        ({"static_writes": ["attn_pattern.0"]}, UnsupportedAddress, "writable kinds"),
        ({"static_points": ["resid_post.9"]}, LayerOutOfRange, r"resid_post\.9"),
        ({"static_points": ["nonsense.1"]}, UnknownKind, "nonsense"),
        ({"static_write_slots": 0}, InvalidOption, "static_write_slots"),
        ({"static_widgets": 1}, InvalidOption, "static_widgets"),
    ],
)
def test_bad_declarations_are_clear_errors(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_model(vllm_model_path("llama"), backend="vllm-static", **options)


def test_undeclared_and_uncombinable_requests_are_clear_errors(static_engines: Any) -> None:
    facade = static_engines["llama"]
    ids = _ids(facade)
    with pytest.raises(UndeclaredAddress, match=r"mlp_out\.0 is not a capture point") as caught:
        facade.capture(ids, ["mlp_out.0"])
    assert "resid_post.0" in caught.value.valid
    with pytest.raises(UndeclaredAddress, match="declared: \\[embed"):
        facade.capture(ids, ["logits"], steering_spec=SteeringSpec([Write("resid_post.2", torch.ones(128))]))
    a, b = torch.zeros(128), torch.zeros(128)
    a[0], b[1] = 1.0, 1.0
    two_ablations = SteeringSpec([Write("resid_post.1", a, op="ablate"), Write("resid_post.1", b, op="ablate")])
    with pytest.raises(InvalidSteering, match="different directions"):
        facade.capture(ids, ["logits"], steering_spec=two_ablations)
    # ablating along one line twice (either sign) is ablating once: one slot, composed
    same_line = SteeringSpec([Write("resid_post.1", a, op="ablate"), Write("resid_post.1", -a, op="ablate")])
    once = SteeringSpec([Write("resid_post.1", a, op="ablate")])
    twice = facade.capture(ids, ["logits"], steering_spec=same_line)[Address("logits")]
    assert rel_diff(twice, facade.capture(ids, ["logits"], steering_spec=once)[Address("logits")]) <= TOL
    assert facade.capture(ids, ["resid_post.0"])[Address("resid_post", 0)].shape[0] == len(ids)  # still serving


def test_the_tap_set_is_part_of_the_compile_cache_key() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    def config_hash(points: list[str], writes: list[str]) -> str:
        model = load_model(vllm_model_path("llama"), backend="vllm-static", static_points=points, static_writes=writes)
        args = model._engine_args()
        config = AsyncEngineArgs(model=str(model.path), **args).create_engine_config()
        return str(config.compute_hash())

    first = config_hash(["resid_post.1"], [])
    assert config_hash(["resid_post.1"], []) == first
    assert config_hash(["resid_post.2"], []) != first
    assert config_hash(["resid_post.1"], ["resid_post.1"]) != first


# the seed's "Declaring taps after load" example, as written but for the local model path
SEED_MODEL = str(vllm_model_path("qwen3"))


async def serve(points, writes):
    model = load_model(SEED_MODEL, backend="vllm-static", static_points="auto")
    model.configure_static(points, static_writes=writes)
    await model.warmup()
    return model


async def test_the_seed_configure_static_example_runs_as_written() -> None:
    vector = torch.randn(128, generator=torch.Generator().manual_seed(2))
    model = await serve([Address("resid_post", 1), "logits"], [Address("resid_post", 1)])
    try:
        with pytest.raises(StaticConfigError):
            model.configure_static([Address("resid_post", 0)])
        ids = model.to_tokens(PROMPT)[0].tolist()
        acts = await model.capture(ids, [Address("resid_post", 1), "logits"])
        with torch.no_grad():
            hf = hf_for(vllm_model_path("qwen3"))(torch.tensor([ids]), output_hidden_states=True)
        assert rel_diff(acts[Address("resid_post", 1)], hf.hidden_states[2][0]) <= TOL
        assert rel_diff(acts[Address("logits")], hf.logits[0]) <= TOL
        spec = SteeringSpec([Write(Address("resid_post", 1), vector, op="add", scale=4.0)])
        steered = await model.capture(ids, ["logits"], steering_spec=spec)
        assert not torch.allclose(steered[Address("logits")], acts[Address("logits")])
    finally:
        await model.shutdown()


# -- the logit lens during generation (issue 16), on the llama engine above ---------------------
def test_static_lens_equals_decoded_resid_post_and_the_vllm_backend(
    static_engines: dict[str, Any], vllm_engines: Any
) -> None:
    """The logit lens during generation on vllm-static, at declared resid_post layers (the compiled
    graph's taps): equal to the decoded resid_post of the same request and to the vllm backend's
    lens, steered or not, over a chunked prefill, without recompiling."""
    static, llama = static_engines["llama"], vllm_engines("llama")
    model = static.model
    (before,) = static.run(model.worker_stats)
    spec = SteeringSpec([Write("resid_post.1", torch.ones(128), op="add", positions=[-1])])
    for ids in (static.to_tokens(PROMPT)[0].tolist(), LONG_IDS):
        n = len(ids)
        lens = LensRequest([2, 0], top_k=5, positions=[0, -2])
        for steering in (None, spec):
            steps = list(static.stream(ids, max_tokens=5, lens=lens, steering_spec=steering, ignore_eos=True))
            completion, acts = static.capture_generation(
                ids, ["resid_post.0", "resid_post.2"], max_tokens=5, lens=lens, steering_spec=steering, ignore_eos=True
            )
            assert [s.token_id for s in steps] == completion.token_ids
            ref = decoded_lens(static, acts, (2, 0), 5)
            for step in steps:
                assert step.lens is not None
                assert_same_lens(step.lens.ids, step.lens.probs, ref[0][:, step.position], ref[1][:, step.position])
            assert steps[0].prompt_lens is not None and steps[0].prompt_lens.positions == (0, n - 2)
            check_against(steps[0].prompt_lens, ref, "static prompt lens")
            check_against(acts[lens], ref, "static capture_generation lens")
            # the dynamic backend's lens of the same request
            dynamic = list(llama.stream(ids, max_tokens=5, lens=lens, steering_spec=steering, ignore_eos=True))
            assert [s.token_id for s in dynamic] == completion.token_ids
            for step, twin in zip(steps, dynamic, strict=True):
                assert step.lens is not None and twin.lens is not None
                assert_same_lens(step.lens.ids, step.lens.probs, twin.lens.ids, twin.lens.probs)
    (after,) = static.run(model.worker_stats)
    counters = [k for k in before if k.startswith(("vllm_", "dynamo_unique", "dynamo_compiled"))]
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}, "a lens request recompiled"
    assert after["live_requests"] == 0
