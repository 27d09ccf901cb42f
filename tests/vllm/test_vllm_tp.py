"""Tensor parallelism on the vllm backend: ``tensor_parallel_size=2`` equals TP=1 and HF.

Under TP each worker holds a shard: ``mlp_post`` (the MLP's neurons) and ``attn_pattern`` (the
heads) are split across ranks and gathered by the front end; a write at ``mlp_post`` is sliced
per rank in the worker. Residual-type points are whole on every rank. The other kinds run on
Qwen3 (q/k norms, a fused ``gate_up_proj``, one key/value head per rank) at TP=2 against TP=1.
The tiny llama (4 heads of
32, 2 KV heads, d_mlp 384) runs with ``max_num_batched_tokens=64``, so the long prompt below is
prefilled in chunks, under TP too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from interp_engine import Address, InvalidSteering, SteeringSpec, Write
from interp_testkit.suite import LONG, PROMPT, hf_for, rel_diff, vllm_model_path

FAMILY = "llama"
TOL = 1e-4
N_LAYERS, D_MODEL, D_MLP, N_HEADS, VOCAB = 3, 128, 384, 4, 512

RESIDUAL_POINTS = [
    Address("embed"),
    *(Address(kind, layer) for layer in range(N_LAYERS) for kind in ("resid_pre", "resid_mid", "resid_post")),
    *(Address(kind, layer) for layer in range(N_LAYERS) for kind in ("attn_out", "mlp_out")),
    Address("final_norm"),
    Address("logits"),
]
SHARDED_POINTS = [
    *(Address("mlp_post", layer) for layer in range(N_LAYERS)),
    *(Address("attn_pattern", layer) for layer in range(N_LAYERS)),
]


def width(address: Address) -> int:
    return {"mlp_post": D_MLP, "logits": VOCAB}.get(address.kind, D_MODEL)


def hf_reference(ids: list[int]) -> dict[Address, torch.Tensor]:
    """HF's values at the points HF exposes directly (hidden states, attentions, logits, MLP
    neurons through a pre-hook on ``down_proj``)."""
    oracle = hf_for(vllm_model_path(FAMILY))
    neurons: dict[int, torch.Tensor] = {}
    handles = [
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda module, args, i=i: neurons.__setitem__(i, args[0][0].detach().clone())
        )
        for i, layer in enumerate(oracle.model.layers)
    ]
    try:
        with torch.no_grad():
            out = oracle(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    ref: dict[Address, torch.Tensor] = {Address("embed"): out.hidden_states[0][0], Address("logits"): out.logits[0]}
    for layer in range(N_LAYERS):
        ref[Address("resid_pre", layer)] = out.hidden_states[layer][0]
        ref[Address("attn_pattern", layer)] = out.attentions[layer][0]
        ref[Address("mlp_post", layer)] = neurons[layer]
        if layer < N_LAYERS - 1:
            ref[Address("resid_post", layer)] = out.hidden_states[layer + 1][0]
    ref[Address("final_norm")] = out.hidden_states[N_LAYERS][0]  # HF's last hidden state is normed
    return ref


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_tp2_captures_equal_tp1_and_hf(tp: tuple[Any, Any], prompt: str) -> None:
    one, two = tp
    ids = one.to_tokens(PROMPT)[0].tolist() if prompt == "short" else LONG
    n = len(ids)
    points = RESIDUAL_POINTS + SHARDED_POINTS
    got1 = one.capture(ids, points)
    got2 = two.capture(ids, points)
    assert list(got2) == points
    for address in points:
        value = got2[address]
        # one whole value per request, not one per rank: full d_mlp and all heads
        if address.kind == "attn_pattern":
            assert value.shape == (N_HEADS, n, n), f"{address}: {list(value.shape)}"
            torch.testing.assert_close(value.sum(-1), torch.ones(N_HEADS, n), rtol=0, atol=1e-5)
        else:
            assert value.shape == (n, width(address)), f"{address}: {list(value.shape)}"
        assert rel_diff(value, got1[address]) <= TOL, address
    for address, expected in hf_reference(ids).items():
        assert rel_diff(got2[address], expected) <= TOL, address
    # the residual stream is one stream: resid_post.L == resid_pre.L+1, resid_mid = pre + attn_out
    for layer in range(N_LAYERS - 1):
        assert torch.equal(got2[Address("resid_post", layer)], got2[Address("resid_pre", layer + 1)])
    for layer in range(N_LAYERS):
        mid = got2[Address("resid_pre", layer)] + got2[Address("attn_out", layer)]
        assert rel_diff(got2[Address("resid_mid", layer)], mid) <= TOL


def test_tp2_steering_equals_tp1(tp: tuple[Any, Any]) -> None:
    """Writes at resid_post, mlp_post (the vector is sliced per rank) and resid_mid."""
    one, two = tp
    gen = torch.Generator().manual_seed(5)
    ids = one.to_tokens(PROMPT)[0].tolist()
    n = len(ids)
    spec = SteeringSpec(
        [
            Write(Address("resid_post", 0), torch.randn(D_MODEL, generator=gen), op="add", scale=3.0),
            Write(Address("mlp_post", 1), torch.randn(D_MLP, generator=gen), op="add", scale=2.0),
            Write(Address("resid_mid", 2), torch.randn(D_MODEL, generator=gen), op="ablate"),
            Write(Address("mlp_post", 0), torch.randn(2, D_MLP, generator=gen), op="set", positions=[1, n - 1]),
        ]
    )
    points = [
        Address("resid_post", 0),
        Address("mlp_post", 0),
        Address("mlp_post", 1),
        Address("resid_mid", 2),
        Address("resid_post", 2),
        Address("logits"),
    ]
    plain = one.capture(ids, points)
    steered1 = one.capture(ids, points, steering_spec=spec)
    steered2 = two.capture(ids, points, steering_spec=spec)
    for address in points:
        assert steered2[address].shape == steered1[address].shape
        assert rel_diff(steered2[address], steered1[address]) <= TOL, address
        assert not torch.allclose(steered2[address], plain[address], atol=1e-3), f"{address} was not steered"
    # the set rows are exactly the patch (every rank wrote its slice), other rows untouched by it
    patch = spec.writes[3].vector
    torch.testing.assert_close(steered2[Address("mlp_post", 0)][[1, n - 1]], patch, rtol=0, atol=1e-6)
    # the ablated direction is gone from resid_mid.2
    direction = spec.writes[2].vector / spec.writes[2].vector.norm()
    assert float((steered2[Address("resid_mid", 2)] @ direction).abs().max()) <= 1e-4

    # steered and unsteered requests batched together under TP each equal their solo runs
    async def together() -> list[Any]:
        model = two.model
        return list(
            await asyncio.gather(
                model.capture(ids, points, steering_spec=spec),
                model.capture(ids, points),
                model.capture(LONG, points, steering_spec=SteeringSpec([spec.writes[1]])),
            )
        )

    both_steered, both_plain, long_steered = two.run(together)
    long_alone = one.capture(LONG, points, steering_spec=SteeringSpec([spec.writes[1]]))
    for address in points:
        assert rel_diff(both_steered[address], steered1[address]) <= TOL, address
        assert rel_diff(both_plain[address], plain[address]) <= TOL, address
        assert rel_diff(long_steered[address], long_alone[address]) <= TOL, address


def test_tp2_refuses_ablation_across_split_neurons(tp: tuple[Any, Any]) -> None:
    """A direction's projection needs every neuron, and each rank holds half: refused under TP
    (TP=1 serves it), rather than ablating per shard."""
    one, two = tp
    ids = one.to_tokens(PROMPT)[0].tolist()
    spec = SteeringSpec([Write(Address("mlp_post", 1), torch.ones(D_MLP), op="ablate")])
    one.capture(ids, ["logits"], steering_spec=spec)
    with pytest.raises(InvalidSteering, match="tensor parallelism"):
        two.capture(ids, ["logits"], steering_spec=spec)
    assert two.capture(ids, ["logits"])  # and the engine keeps serving


def test_tp2_decode_residuals(tp: tuple[Any, Any]) -> None:
    one, two = tp
    residuals = torch.randn(2, 5, D_MODEL, generator=torch.Generator().manual_seed(6)) * 3
    logits2 = two.decode_residuals(residuals)
    assert logits2.shape == (2, 5, VOCAB)  # gathered over the vocab shards, not one shard per rank
    assert rel_diff(logits2, one.decode_residuals(residuals)) <= TOL
    oracle = hf_for(vllm_model_path(FAMILY))
    with torch.no_grad():
        expected = oracle.lm_head(oracle.model.norm(residuals))
    assert rel_diff(logits2, expected) <= TOL
    # the last layer's resid_post decodes to the model's own logits
    ids = one.to_tokens(PROMPT)[0].tolist()
    acts = two.capture(ids, ["resid_post.-1", "logits"])
    decoded = two.decode_residuals({Address("resid_post", -1): acts[Address("resid_post", -1)]})
    assert rel_diff(decoded[Address("resid_post", -1)], acts[Address("logits")]) <= TOL


def test_tp2_greedy_generation_equals_tp1(tp: tuple[Any, Any]) -> None:
    one, two = tp
    for ids in (one.to_tokens(PROMPT)[0].tolist(), LONG[:70]):
        c1 = one.generate(ids, max_tokens=12, ignore_eos=True)
        c2 = two.generate(ids, max_tokens=12, ignore_eos=True)
        assert len(c2.token_ids) == 12
        assert c2.token_ids == c1.token_ids and c2.text == c1.text
        # and with activations over prompt + generated tokens
        points = [Address("resid_post", 1), Address("mlp_post", 2), Address("attn_pattern", 0)]
        g1, a1 = one.capture_generation(ids, points, max_tokens=6, ignore_eos=True)
        g2, a2 = two.capture_generation(ids, points, max_tokens=6, ignore_eos=True)
        assert g2.token_ids == g1.token_ids == c1.token_ids[:6]
        total = len(ids) + 6
        assert a2[Address("mlp_post", 2)].shape == (total, D_MLP)
        assert a2[Address("attn_pattern", 0)].shape == (N_HEADS, total, total)
        for address in points:
            assert rel_diff(a2[address], a1[address]) <= TOL, address
        full = ids + g2.token_ids
        hf = hf_reference(full)
        for address in points:
            assert rel_diff(a2[address], hf[address]) <= TOL, address
    # greedy under TP is HF's argmax continuation
    ids = one.to_tokens(PROMPT)[0].tolist()
    c2 = two.generate(ids, max_tokens=8, ignore_eos=True)
    logits = hf_reference(ids + c2.token_ids)[Address("logits")]
    assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == c2.token_ids


def test_tp2_stream_logprobs_equal_tp1(tp: tuple[Any, Any]) -> None:
    one, two = tp
    ids = one.to_tokens(PROMPT)[0].tolist()
    s1 = list(one.stream(ids, max_tokens=5, n_logprobs=3, ignore_eos=True))
    s2 = list(two.stream(ids, max_tokens=5, n_logprobs=3, ignore_eos=True))
    assert [s.token_id for s in s2] == [s.token_id for s in s1]
    for a, b in zip(s1, s2, strict=True):
        assert [t for t, _ in b.logprobs] == [t for t, _ in a.logprobs]
        for (_, x), (_, y) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x - y) <= 1e-4


def test_tp2_heads_equal_tp1(tp: tuple[Any, Any]) -> None:
    """Head reads are gathered over the ranks that hold them; head writes go to the rank that
    holds each head (2 query heads and 1 key/value head per rank here)."""
    one, two = tp
    ids = one.to_tokens(PROMPT)[0].tolist()
    d_head = one.info.d_head
    points = [Address(kind, layer) for layer in range(N_LAYERS) for kind in ("attn_q", "attn_k", "attn_v", "attn_z")]
    ref, got = one.capture(ids, points), two.capture(ids, points)
    for point in points:
        assert got[point].shape == ref[point].shape, point
        assert rel_diff(got[point], ref[point]) <= TOL, point
    gen = torch.Generator().manual_seed(2)
    donor = one.capture(LONG[:8], ["attn_z.1"])[Address("attn_z", 1)][:3, [3]]
    specs = [
        # heads on both ranks, one row per head, and an ablation on a third head
        SteeringSpec(
            [
                Write("attn_z.1", torch.randn(2, d_head, generator=gen), op="add", scale=2.0, heads=[1, 2]),
                Write("attn_z.1", torch.randn(d_head, generator=gen), op="ablate", heads=[3]),
            ]
        ),
        SteeringSpec([Write("attn_z.2", torch.zeros(d_head), op="set", heads=[0])]),  # rank 0 only
        SteeringSpec([Write("attn_z.1", donor, op="set", heads=[3], positions=[0, 1, 2])]),  # rank 1 only
        SteeringSpec([Write("attn_v.0", torch.randn(d_head, generator=gen), op="add", scale=3.0, heads=[1])]),
    ]
    for spec in specs:
        a = one.capture(ids, ["attn_z.2", "logits"], steering_spec=spec)
        b = two.capture(ids, ["attn_z.2", "logits"], steering_spec=spec)
        for point in a:
            assert rel_diff(b[point], a[point]) <= TOL, (spec, point)


NEW_KINDS = ("attn_in", "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "attn_scores", "mlp_in", "mlp_pre")


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_tp2_new_points_equal_tp1(vllm_engines: Any, prompt: str) -> None:
    """Qwen3 (q/k norms, a gated MLP, 2 key/value heads: one per rank): the sublayer inputs are
    whole on every rank; the q/k norms and the scores are split by heads, the gate and up halves
    of the fused ``gate_up_proj`` by columns, each rank holding a slice of each; all gathered."""
    one, two = vllm_engines("qwen3"), vllm_engines("qwen3", tensor_parallel_size=2)
    assert two.model.tp_size == 2
    info = one.info
    ids = one.to_tokens(PROMPT)[0].tolist() if prompt == "short" else LONG[:120]
    points = [Address(k, layer) for layer in range(N_LAYERS) for k in (*NEW_KINDS, "mlp_pre_linear", "mlp_gate_act")]
    points.append(Address("logits_raw"))
    ref, got = one.capture(ids, points), two.capture(ids, points)
    for point in points:
        assert got[point].shape == ref[point].shape, point
        assert rel_diff(got[point], ref[point]) <= TOL, point
    assert got[Address("mlp_pre", 0)].shape == (len(ids), info.d_mlp)
    gen = torch.Generator().manual_seed(8)
    d_head, d_mlp, n = info.d_head, info.d_mlp, len(ids)
    specs = [
        SteeringSpec([Write("attn_in.1", torch.randn(D_MODEL, generator=gen), op="add", scale=2.0)]),
        SteeringSpec([Write("mlp_in.0", torch.randn(2, D_MODEL, generator=gen), op="set", positions=[1, n - 1])]),
        # the gate and up halves: each rank writes its slice of each
        SteeringSpec(
            [
                Write("mlp_pre.1", torch.randn(d_mlp, generator=gen), op="add", scale=3.0),
                Write("mlp_pre_linear.1", torch.randn(2, d_mlp, generator=gen), op="set", positions=[0, 2]),
            ]
        ),
        # heads on both ranks, and a key/value head on rank 1 only
        SteeringSpec(
            [
                Write("q_norm_out.1", torch.randn(2, d_head, generator=gen), op="add", scale=2.0, heads=[0, 3]),
                Write("k_norm_in.2", torch.randn(d_head, generator=gen), op="ablate", heads=[1]),
            ]
        ),
    ]
    for spec in specs:
        a = one.capture(ids, ["mlp_pre.2", "logits"], steering_spec=spec)
        b = two.capture(ids, ["mlp_pre.2", "logits"], steering_spec=spec)
        plain = one.capture(ids, ["logits"])[Address("logits")]
        assert not torch.allclose(a[Address("logits")], plain, atol=1e-3), spec
        for point in a:
            assert rel_diff(b[point], a[point]) <= TOL, (spec, point)
    # a direction over the split neurons needs all of them: refused at mlp_pre too
    with pytest.raises(InvalidSteering, match="tensor parallelism"):
        two.capture(ids, ["logits"], steering_spec=SteeringSpec([Write("mlp_pre.0", torch.ones(d_mlp), op="ablate")]))


# A compiled TP=2 engine (two workers, each compiling the model with Dynamo and Inductor) beside
# the session's TP engines needs the machine's memory and both cores to itself: it runs apart
# (pytest -m apart tests/vllm/test_vllm_tp.py), started and shut down here.
@pytest.mark.apart
def test_compiled_tp2_equals_the_eager_engines(tp: tuple[Any, Any], engine_pool: Any) -> None:
    """``tensor_parallel_size=2`` with ``enforce_eager=False``: the residual stream's taps in
    each rank's compiled islands (no step of theirs runs uncompiled), the sharded sites in an
    uncompiled step, and steering at both, equal the eager TP=1 and TP=2 engines."""
    one, two = tp
    compiled = engine_pool.get(FAMILY, tensor_parallel_size=2, enforce_eager=False)
    try:
        assert compiled.model.tp_size == 2
        ids = one.to_tokens(PROMPT)[0].tolist()

        def uncompiled() -> list[int]:
            return [int(s["uncompiled_steps"]) for s in compiled.worker_stats()]

        # the residual stream at the layers' inputs and outputs: the compiled islands
        stream_points = [Address("embed")]
        stream_points += [Address(kind, layer) for layer in range(N_LAYERS) for kind in ("resid_pre", "resid_post")]
        before = uncompiled()
        stream = compiled.capture(ids, stream_points)
        assert uncompiled() == before, "a capture of the residual stream ran uncompiled"
        assert all(int(s.get("islands_fired", 0)) > 0 for s in compiled.worker_stats())  # on both ranks
        inside = RESIDUAL_POINTS + SHARDED_POINTS  # sites inside the layers too: an uncompiled step
        want = one.capture(ids, inside)
        for address in stream_points:
            assert rel_diff(stream[address], want[address]) <= TOL, address
        got = compiled.capture(ids, inside)
        assert all(after > was for after, was in zip(uncompiled(), before, strict=True))
        for address in inside:
            assert rel_diff(got[address], want[address]) <= TOL, address
        gen = torch.Generator().manual_seed(8)
        at_stream = SteeringSpec([Write(Address("resid_post", 0), torch.randn(D_MODEL, generator=gen), scale=3.0)])
        inside = SteeringSpec([Write(Address("mlp_post", 1), torch.randn(D_MLP, generator=gen), scale=2.0)])
        points = [Address("resid_post", 1), Address("mlp_post", 2), Address("logits")]
        for spec in (at_stream, inside):
            got = compiled.capture(ids, points, steering_spec=spec)
            for address in points:
                assert rel_diff(got[address], one.capture(ids, points, steering_spec=spec)[address]) <= TOL, address
                assert rel_diff(got[address], two.capture(ids, points, steering_spec=spec)[address]) <= TOL, address
        steered = compiled.generate(ids, max_tokens=10, ignore_eos=True, steering_spec=at_stream)
        assert steered.token_ids == one.generate(ids, max_tokens=10, ignore_eos=True, steering_spec=at_stream).token_ids
        assert compiled.generate(ids, max_tokens=10, ignore_eos=True) == two.generate(
            ids, max_tokens=10, ignore_eos=True
        )
    finally:
        engine_pool.release(keep=lambda runner, args: args.get("enforce_eager", True))
