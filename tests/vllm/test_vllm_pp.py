"""Pipeline parallelism on the vllm backends: ``pipeline_parallel_size=2`` equals PP=1.

Under PP each worker holds some of the layers (vLLM puts a ``PPMissingLayer`` in place of the
others) and only the last stage holds the final norm and the unembedding; the hidden states
pass from stage to stage as vLLM's ``IntermediateTensors`` (``hidden_states`` and the deferred
``residual``). Each worker hooks only its own layers: a read comes back from the stage that
holds its layer, a write is applied there (the next stage receives the written stream), and
``final_norm``, ``logits``, ``logits_raw`` and ``decode_residuals`` come from the last stage.
The 4-layer llama puts layers 0-1 on stage 0 and 2-3 on stage 1, so every check below crosses
the boundary; its engines run with ``max_num_batched_tokens=64`` (a long prompt is prefilled in
chunks, each chunk passing through both stages).

The engines are this module's own (shut down when it ends), not the session's shared ones.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    KINDS,
    WEIGHT_NAMES,
    Address,
    Features,
    FeatureWrite,
    InvalidFeatures,
    LensRequest,
    Sae,
    SteeringSpec,
    UnsupportedOperation,
    Write,
    capture_attention,
    logit_attribution,
    weights,
)
from interp_engine.circuits import TranscoderSet
from interp_engine.sae._readouts import read_features
from interp_testkit.suite import LONG, MODELS, PROMPT, VLLM_SHAPE, hf_for, rel_diff

from ..support.circuits import random_plt
from ..support.engines import started_engine
from ..support.readouts import assert_close_readout, assert_same_readout, make_sae

TOL = 1e-4
N_LAYERS = 4
VOCAB = 512
ENGINE = {"max_num_batched_tokens": 64}


@functools.cache
def pp_model_path() -> pathlib.Path:
    from interp_testkit import build_tiny_model

    return build_tiny_model("llama", MODELS / "llama-vllm-pp4", n_layers=N_LAYERS, **VLLM_SHAPE)


def _start(backend: str = "vllm", **engine_args: Any) -> Any:
    return started_engine(pp_model_path(), backend, **ENGINE, **engine_args)


@pytest.fixture(scope="module")
def pp() -> Iterator[tuple[Any, Any]]:
    """PP=1 and PP=2 engines on the 4-layer llama, shut down when the module ends."""
    one = _start()
    try:
        two = _start(pipeline_parallel_size=2)
    except BaseException:
        one.shutdown()
        raise
    try:
        assert one.model.pp_size == 1
        assert two.model.pp_size == 2, "the engine did not start two pipeline stages"
        # the stages hold disjoint halves of the layers, the last one the final norm
        assert [sorted(layers) for layers, _ in two.model._stages] == [[0, 1], [2, 3]]
        yield one, two
    finally:
        two.shutdown()
        one.shutdown()


def _ids(facade: Any) -> list[int]:
    ids: list[int] = facade.to_tokens(PROMPT)[0].tolist()
    return ids


def every_address(facade: Any) -> list[Address]:
    """Every address the model serves (every kind at every layer)."""
    points = []
    for kind in facade.model.points():
        if KINDS[kind].per_layer:
            points += [Address(kind, layer) for layer in range(N_LAYERS)]
        else:
            points.append(Address(kind))
    return points


def test_stages_and_owned_layers_whatever_the_workers_order() -> None:
    """The front end maps workers to stages and TP ranks from what each reports (an executor
    may list them in any order); a worker owns the layers that are not vLLM's placeholders."""
    from torch import nn
    from vllm.model_executor.models.utils import PPMissingLayer

    from interp_vllm._wire import Ping
    from interp_vllm.frontend._engine import _stages
    from interp_vllm.hooks import owned_layers

    pings = [
        Ping("CPUModelRunner", True, rank=1, pp_rank=1, layers=(2, 3)),
        Ping("CPUModelRunner", True, rank=0, pp_rank=1, layers=(2, 3)),
        Ping("CPUModelRunner", True, rank=1, pp_rank=0, layers=(0, 1)),
        Ping("CPUModelRunner", True, rank=0, pp_rank=0, layers=(0, 1)),
    ]
    assert _stages(pings) == [(frozenset({0, 1}), [3, 2]), (frozenset({2, 3}), [1, 0])]
    layers = nn.ModuleList([PPMissingLayer(), PPMissingLayer(), nn.Linear(2, 2), nn.Linear(2, 2)])
    assert owned_layers(layers) == (2, 3)


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_pp2_captures_every_address_equal_pp1(pp: tuple[Any, Any], prompt: str) -> None:
    one, two = pp
    ids = _ids(one) if prompt == "short" else LONG
    points = every_address(one)
    assert set(one.model.points()) == set(two.model.points())
    kinds = {p.kind for p in points}
    assert {"embed", "attn_q", "attn_scores", "attn_pattern", "mlp_post", "final_norm", "logits_raw"} <= kinds
    got1, got2 = one.capture(ids, points), two.capture(ids, points)
    assert list(got2) == points
    for address in points:
        assert got2[address].shape == got1[address].shape, address
        assert rel_diff(got2[address], got1[address]) <= TOL, address
    # against HF too, across the stage boundary (resid_post.1 is what stage 0 hands stage 1)
    with torch.no_grad():
        out = hf_for(pp_model_path())(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    for layer in range(N_LAYERS):
        assert rel_diff(got2[Address("resid_pre", layer)], out.hidden_states[layer][0]) <= TOL
        assert rel_diff(got2[Address("attn_pattern", layer)], out.attentions[layer][0]) <= TOL
    assert rel_diff(got2[Address("final_norm")], out.hidden_states[N_LAYERS][0]) <= TOL
    assert rel_diff(got2[Address("logits")], out.logits[0]) <= TOL
    assert torch.equal(got2[Address("resid_post", 1)], got2[Address("resid_pre", 2)])


def test_pp2_steering_equals_pp1(pp: tuple[Any, Any]) -> None:
    """Writes on both stages (each applied where its layer lives), at the boundary and at the
    final norm, alone and batched with unsteered requests."""
    one, two = pp
    gen = torch.Generator().manual_seed(3)
    d_model, d_mlp, d_head = one.info.d_model, one.info.d_mlp, one.info.d_head
    ids = _ids(one)
    n = len(ids)
    specs = [
        SteeringSpec([Write("resid_post.1", torch.randn(d_model, generator=gen), op="add", scale=3.0)]),  # boundary
        SteeringSpec([Write("resid_pre.2", torch.randn(d_model, generator=gen), op="ablate")]),
        SteeringSpec(
            [
                Write("mlp_post.0", torch.randn(d_mlp, generator=gen), op="add", scale=2.0),
                Write("resid_mid.3", torch.randn(2, d_model, generator=gen), op="set", positions=[1, n - 1]),
                Write("attn_z.2", torch.randn(2, d_head, generator=gen), op="add", scale=2.0, heads=[0, 3]),
                Write("attn_v.1", torch.randn(d_head, generator=gen), op="add", scale=3.0, heads=[1]),
            ]
        ),
        SteeringSpec([Write("final_norm", torch.randn(d_model, generator=gen), op="add", scale=0.5)]),
    ]
    points = ["resid_post.0", "mlp_post.0", "resid_pre.2", "resid_mid.3", "attn_z.2", "final_norm", "logits"]
    plain = one.capture(ids, ["logits"])[Address("logits")]
    for spec in specs:
        a = one.capture(ids, points, steering_spec=spec)
        b = two.capture(ids, points, steering_spec=spec)
        assert not torch.allclose(a[Address("logits")], plain, atol=1e-3), spec
        for point in a:
            assert rel_diff(b[point], a[point]) <= TOL, (spec, point)
    # batched together: each request equals its solo run
    together = two.run(
        lambda: _gather(
            two.model.capture(ids, points, steering_spec=specs[2]),
            two.model.capture(ids, points),
            two.model.capture(LONG, points, steering_spec=specs[0]),
        )
    )
    alone = [
        one.capture(ids, points, steering_spec=specs[2]),
        one.capture(ids, points),
        one.capture(LONG, points, steering_spec=specs[0]),
    ]
    for got, expected in zip(together, alone, strict=True):
        for point in expected:
            assert rel_diff(got[point], expected[point]) <= TOL, point
    # a steered generation: the stages apply their writes at every decode step
    spec = SteeringSpec([Write("resid_post.2", torch.randn(d_model, generator=gen), op="add", scale=4.0)])
    c1 = one.generate(ids, max_tokens=8, steering_spec=spec, ignore_eos=True)
    c2 = two.generate(ids, max_tokens=8, steering_spec=spec, ignore_eos=True)
    assert c2.token_ids == c1.token_ids


async def _gather(*calls: Any) -> list[Any]:
    import asyncio

    return list(await asyncio.gather(*calls))


def test_pp2_attention_and_decode_residuals(pp: tuple[Any, Any]) -> None:
    one, two = pp
    ids = _ids(one)
    spec = SteeringSpec([Write("attn_v.0", torch.ones(one.info.d_head), op="add", scale=2.0, heads=[1])])
    for steering in (None, spec):
        a = capture_attention(one, ids, range(N_LAYERS), steering_spec=steering)
        b = capture_attention(two, ids, range(N_LAYERS), steering_spec=steering)
        assert list(b) == list(a)
        for point in a:
            assert rel_diff(b[point], a[point]) <= TOL, point
    # the logit lens comes from the last stage, which holds the final norm and the unembedding
    residuals = torch.randn(2, 5, one.info.d_model, generator=torch.Generator().manual_seed(6)) * 3
    logits = two.decode_residuals(residuals)
    assert logits.shape == (2, 5, VOCAB)
    assert rel_diff(logits, one.decode_residuals(residuals)) <= TOL
    acts = two.capture(ids, ["resid_post.0", f"resid_post.{N_LAYERS - 1}", "logits"])
    lens = two.decode_residuals({a: v for a, v in acts.items() if a.kind == "resid_post"})
    assert rel_diff(lens[Address("resid_post", N_LAYERS - 1)], acts[Address("logits")]) <= TOL
    assert rel_diff(lens[Address("resid_post", 0)], one.decode_residuals(acts[Address("resid_post", 0)])) <= TOL


def test_pp2_weights_and_logit_attribution_equal_pp1(pp: tuple[Any, Any]) -> None:
    """Each weight comes from the stage that holds it (the embedding from the first, the final norm
    and the unembedding from the last, each layer's output projection from its own) and equals
    PP=1's and HF's; direct logit attribution over both stages equals PP=1's."""
    one, two = pp
    w1, w2 = weights(one), weights(two)
    assert w1.layout == w2.layout
    hf = hf_for(pp_model_path())
    assert torch.equal(w2.W_E, hf.model.embed_tokens.weight.detach())
    assert torch.equal(w2.W_U, hf.lm_head.weight.detach().T)
    for layer in range(N_LAYERS):
        o_proj = hf.model.layers[layer].self_attn.o_proj.weight.detach()
        assert torch.equal(w2.W_O(layer), o_proj.T.reshape(w2.W_O(layer).shape)), layer
    for name in w1.names:
        for layer in range(N_LAYERS) if WEIGHT_NAMES[name].per_layer else [None]:
            assert torch.equal(w1.get(name, layer), w2.get(name, layer)), (name, layer)
    got = logit_attribution(two, PROMPT, 5, 7, heads=True)
    expected = logit_attribution(one, PROMPT, 5, 7, heads=True)
    assert torch.allclose(got.values, expected.values, atol=1e-4)
    assert abs(float(got.values.sum()) - got.meta["logit_diff"]) <= 1e-4


def test_pp2_generation_equals_pp1(pp: tuple[Any, Any]) -> None:
    one, two = pp
    for ids in (_ids(one), LONG[:70]):
        c1 = one.generate(ids, max_tokens=10, ignore_eos=True)
        c2 = two.generate(ids, max_tokens=10, ignore_eos=True)
        assert len(c2.token_ids) == 10 and c2.token_ids == c1.token_ids and c2.text == c1.text
        points = [Address("resid_post", 0), Address("mlp_post", 3), Address("attn_pattern", 2), Address("logits")]
        g1, a1 = one.capture_generation(ids, points, max_tokens=5, ignore_eos=True)
        g2, a2 = two.capture_generation(ids, points, max_tokens=5, ignore_eos=True)
        assert g2.token_ids == g1.token_ids == c1.token_ids[:5]
        for point in points:
            assert a2[point].shape == a1[point].shape, point
            assert rel_diff(a2[point], a1[point]) <= TOL, point
    ids = _ids(one)
    s1 = list(one.stream(ids, max_tokens=5, n_logprobs=3, ignore_eos=True))
    s2 = list(two.stream(ids, max_tokens=5, n_logprobs=3, ignore_eos=True))
    assert [s.token_id for s in s2] == [s.token_id for s in s1]
    for a, b in zip(s1, s2, strict=True):
        assert [t for t, _ in b.logprobs] == [t for t, _ in a.logprobs]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4


def test_pp2_lens_on_the_last_stage_equals_pp1(pp: tuple[Any, Any]) -> None:
    """The logit lens at the last stage's layers is computed there (its final norm and
    unembedding); a lens layer of an earlier stage is refused, naming tensor parallelism."""
    from ..support.lens import assert_same_lens

    one, two = pp
    for ids in (_ids(one), LONG[:70]):
        lens = LensRequest([3, 2], top_k=5, positions=[1, -1])
        s1 = list(one.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
        s2 = list(two.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
        assert [s.token_id for s in s2] == [s.token_id for s in s1]
        for a, b in zip(s1, s2, strict=True):
            assert a.lens is not None and b.lens is not None
            assert_same_lens(b.lens.ids, b.lens.probs, a.lens.ids, a.lens.probs, f"PP=2 at {b.position}")
        assert s2[0].prompt_lens is not None and s1[0].prompt_lens is not None
        assert s2[0].prompt_lens.positions == s1[0].prompt_lens.positions == (1, len(ids) - 1)
        _, acts = two.capture_generation(ids, [], max_tokens=4, lens=lens, ignore_eos=True)
        assert_same_lens(acts[lens].ids, acts[lens].probs, *_lens_of_steps(s1, acts[lens].positions))
    with pytest.raises(UnsupportedOperation, match="tensor_parallel_size"):
        list(two.stream(_ids(one), max_tokens=2, lens=LensRequest([1, 3])))
    assert two.generate(_ids(one), max_tokens=2).token_ids  # and it serves on


def _lens_of_steps(steps: list[Any], positions: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, positions, k]`` ids and probabilities out of a stream's steps (and its prompt lens)."""
    found = {s.position: (s.lens.ids, s.lens.probs) for s in steps}
    first = steps[0].prompt_lens
    for p in first.positions if first is not None else ():
        found.setdefault(p, (first.at(p).ids, first.at(p).probs))
    return (
        torch.stack([found[p][0] for p in positions], dim=1),
        torch.stack([found[p][1] for p in positions], dim=1),
    )


def test_pp2_sae_readouts_and_clamps(pp: tuple[Any, Any]) -> None:
    """SAEs on either stage: readouts encoded by the stage holding the SAE's address, clamps
    applied there; streamed readouts drained from both stages."""
    one, two = pp
    ids = _ids(one)
    sample = one.capture(ids, ["resid_post.0", "mlp_out.3"])
    saes = {
        "tpp-early": make_sae("standard", "blocks.0.hook_resid_post", sample[Address("resid_post", 0)], seed=1),
        "tpp-late": make_sae("jumprelu", "blocks.3.hook_mlp_out", sample[Address("mlp_out", 3)], seed=2),
    }
    for facade in (one, two):
        for name, sae in saes.items():
            facade.attach_sae(name, sae)
    try:
        read = [Features("tpp-early", 8), Features("tpp-late", dense=True)]
        got = two.capture(ids, ["resid_post.0", "mlp_out.3", *read])
        assert_same_readout(
            got[read[0]], read_features(saes["tpp-early"], got[Address("resid_post", 0)], read[0]), what="early"
        )
        assert_same_readout(
            got[read[1]], read_features(saes["tpp-late"], got[Address("mlp_out", 3)], read[1]), what="late"
        )
        expected = one.capture(ids, read)
        for spec in read:
            assert_close_readout(got[spec], expected[spec], what=str(spec))
        spec = SteeringSpec([FeatureWrite("tpp-early", 5, "clamp", 6.0), FeatureWrite("tpp-late", 3, "ablate")])
        a = one.capture(ids, ["logits", read[1]], steering_spec=spec)
        b = two.capture(ids, ["logits", read[1]], steering_spec=spec)
        assert rel_diff(b[Address("logits")], a[Address("logits")]) <= TOL
        assert_close_readout(b[read[1]], a[read[1]], what="clamped")
        steps1 = list(one.stream(ids, max_tokens=4, features=read, steering_spec=spec, ignore_eos=True))
        steps2 = list(two.stream(ids, max_tokens=4, features=read, steering_spec=spec, ignore_eos=True))
        assert [s.token_id for s in steps2] == [s.token_id for s in steps1]
        for s1, s2 in zip(steps1, steps2, strict=True):
            for r in read:
                assert_close_readout(s2.features[r][None], s1.features[r][None], what=f"streamed {r}")
    finally:
        for facade in (one, two):
            for name in saes:
                facade.detach_sae(name)
    # nothing left behind in any worker of either stage
    assert [s["live_requests"] for s in two.worker_stats()] == [0, 0]


def test_pp2_transcoder_clamps_equal_pp1(pp: tuple[Any, Any]) -> None:
    """Transcoder clamps on either stage (each read at ``mlp_in.L`` and written at ``mlp_out.L`` by
    the stage holding layer L) equal PP=1; a transcoder reading on one stage and writing on the
    other is refused under PP=2 (served at PP=1)."""
    one, two = pp
    ids = _ids(one)
    plt = random_plt(seed=5)
    plt = TranscoderSet(list(plt.transcoders.values()), names={layer: f"tpp-tc.{layer}" for layer in plt.layers})
    across = plt[1]
    across = Sae(
        "transcoder", across.W_enc, across.b_enc, across.W_dec, across.b_dec, "mlp_in.1", hook_name_out="mlp_out.2"
    )
    for facade in (one, two):
        plt.attach(facade)
        facade.attach_sae("tpp-across", across)
    try:
        spec = SteeringSpec(
            [
                FeatureWrite("tpp-tc.1", 4, "clamp", 5.0),
                FeatureWrite("tpp-tc.3", 7, "ablate"),
                FeatureWrite("tpp-tc.2", 2, "clamp", 3.0, positions=[-1]),
            ]
        )
        for prompt in (ids, LONG):
            a = one.capture(prompt, ["mlp_out.1", "mlp_out.3", "logits"], steering_spec=spec)
            b = two.capture(prompt, ["mlp_out.1", "mlp_out.3", "logits"], steering_spec=spec)
            for point in a:
                assert rel_diff(b[point], a[point]) <= TOL, point
        plain = one.capture(ids, ["logits"])[Address("logits")]
        assert rel_diff(one.capture(ids, ["logits"], steering_spec=spec)[Address("logits")], plain) > 1e-3
        cross = SteeringSpec([FeatureWrite("tpp-across", 0, "clamp", 4.0)])
        with pytest.raises(InvalidFeatures, match="different pipeline stages"):
            two.capture(ids, ["logits"], steering_spec=cross)
        assert rel_diff(one.capture(ids, ["logits"], steering_spec=cross)[Address("logits")], plain) > 1e-4
    finally:
        for facade in (one, two):
            for name in [*plt.names.values(), "tpp-across"]:
                facade.detach_sae(name)


def test_pp2_static_equals_dynamic_pp1(pp: tuple[Any, Any]) -> None:
    """vllm-static under PP=2: each stage compiles the taps and write tables of its own layers;
    captures (both stages, the final norm and logits) and writes equal the dynamic PP=1 engine."""
    one, _ = pp
    ids = _ids(one)
    points = ["resid_post.0", "attn_z.1", "resid_pre.2", "mlp_post.3", "attn_pattern.3", "final_norm", "logits"]
    writes = ["resid_post.1", "mlp_post.3"]
    static = _start("vllm-static", pipeline_parallel_size=2, static_points=points, static_writes=writes)
    try:
        assert static.model.pp_size == 2
        gen = torch.Generator().manual_seed(9)
        spec = SteeringSpec(
            [
                Write("resid_post.1", torch.randn(one.info.d_model, generator=gen), op="add", scale=3.0),
                Write("mlp_post.3", torch.randn(one.info.d_mlp, generator=gen), op="add", scale=2.0),
            ]
        )
        for ids_ in (ids, LONG):
            for steering in (None, spec):
                a = one.capture(ids_, points, steering_spec=steering)
                b = static.capture(ids_, points, steering_spec=steering)
                for point in a:
                    assert rel_diff(b[point], a[point]) <= TOL, (steering is not None, point)
        c1 = one.generate(ids, max_tokens=8, steering_spec=spec, ignore_eos=True)
        c2 = static.generate(ids, max_tokens=8, steering_spec=spec, ignore_eos=True)
        assert c2.token_ids == c1.token_ids
    finally:
        static.shutdown()


# 4 workers on this 2-core machine (~60 s to start, ~0.5 s per decode step): after the session's
# other engines the machine lacks the memory to start them, so this runs apart (docs/guides/scaling.md)
@pytest.mark.apart
def test_tp2_pp2_equals_pp1(pp: tuple[Any, Any]) -> None:
    """Four ranks: two stages of two tensor-parallel workers each (vLLM's layout: global rank
    ``pp_rank * tp_size + tp_rank``). A value comes from the stage holding its layer, gathered
    over that stage's tensor-parallel ranks; writes go to their stage and are sliced per rank."""
    one, _ = pp
    four = _start(tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert (four.model.tp_size, four.model.pp_size) == (2, 2)
        assert [(sorted(layers), len(workers)) for layers, workers in four.model._stages] == [([0, 1], 2), ([2, 3], 2)]
        points = every_address(one)
        for ids in (_ids(one), LONG):
            a, b = one.capture(ids, points), four.capture(ids, points)
            for point in points:
                assert rel_diff(b[point], a[point]) <= TOL, point
        gen = torch.Generator().manual_seed(11)
        spec = SteeringSpec(
            [
                Write("mlp_post.1", torch.randn(one.info.d_mlp, generator=gen), op="add", scale=2.0),
                Write("attn_z.3", torch.randn(one.info.d_head, generator=gen), op="add", scale=3.0, heads=[1, 2]),
            ]
        )
        ids = _ids(one)
        steered = ["mlp_post.1", "attn_z.3", "logits"]
        a, b = one.capture(ids, steered, steering_spec=spec), four.capture(ids, steered, steering_spec=spec)
        for point in a:
            assert rel_diff(b[point], a[point]) <= TOL, point
        residuals = torch.randn(3, one.info.d_model, generator=gen) * 3
        assert rel_diff(four.decode_residuals(residuals), one.decode_residuals(residuals)) <= TOL
        assert (
            four.generate(ids, max_tokens=6, ignore_eos=True).token_ids
            == one.generate(ids, max_tokens=6, ignore_eos=True).token_ids
        )
    finally:
        four.shutdown()


@pytest.mark.apart
def test_compiled_pp2_equals_pp1(pp: tuple[Any, Any]) -> None:
    """``pipeline_parallel_size=2`` with ``enforce_eager=False``: each stage compiles its layers
    with their islands, so the residual stream's taps on either side of the boundary, steering at
    the stream stage 0 hands to stage 1 and the lens (at the last stage's layers) run in compiled
    steps on both stages; sites inside the layers run in an uncompiled step on both; all equal
    the eager PP=1 engine."""
    one, _ = pp
    compiled = _start(pipeline_parallel_size=2, enforce_eager=False)
    try:
        assert compiled.model.pp_size == 2

        def uncompiled() -> list[int]:
            return [int(s["uncompiled_steps"]) for s in compiled.worker_stats()]

        ids = _ids(one)
        kinds = ("resid_pre", "resid_post")
        stream = [Address("embed"), *(Address(kind, layer) for layer in range(N_LAYERS) for kind in kinds)]
        before = uncompiled()
        got, want = compiled.capture(ids, stream), one.capture(ids, stream)
        assert uncompiled() == before, "a capture of the residual stream ran uncompiled"
        assert all(int(s.get("islands_fired", 0)) > 0 for s in compiled.worker_stats())  # on both stages
        for point in stream:
            assert rel_diff(got[point], want[point]) <= TOL, point
        gen = torch.Generator().manual_seed(12)
        at_boundary = SteeringSpec([Write("resid_post.1", torch.randn(one.info.d_model, generator=gen), scale=3.0)])
        watched = ["resid_pre.2", "resid_post.3", "logits"]
        got = compiled.capture(ids, watched, steering_spec=at_boundary)
        want = one.capture(ids, watched, steering_spec=at_boundary)
        assert uncompiled() == before, "steering the residual stream ran uncompiled"
        for point in want:
            assert rel_diff(got[point], want[point]) <= TOL, point
        lens = LensRequest([2, -1], top_k=5)  # the last stage's layers (where the unembedding is)
        steps = list(compiled.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
        twin = list(one.stream(ids, max_tokens=4, lens=lens, ignore_eos=True))
        assert uncompiled() == before, "the lens ran uncompiled"
        assert [s.token_id for s in steps] == [s.token_id for s in twin]
        for step, other in zip(steps, twin, strict=True):
            assert step.lens is not None and other.lens is not None
            assert torch.equal(step.lens.ids, other.lens.ids)
        inside = ["attn_z.0", "mlp_post.3", "attn_pattern.2", "logits"]
        got, want = compiled.capture(ids, inside), one.capture(ids, inside)
        assert all(after > was for after, was in zip(uncompiled(), before, strict=True))  # both stages
        for point in want:
            assert rel_diff(got[point], want[point]) <= TOL, point
        assert (
            compiled.generate(ids, max_tokens=8, ignore_eos=True, steering_spec=at_boundary).token_ids
            == one.generate(ids, max_tokens=8, ignore_eos=True, steering_spec=at_boundary).token_ids
        )
    finally:
        compiled.shutdown()
