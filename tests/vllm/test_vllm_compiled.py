"""Per-request taps on an engine vLLM compiles (``enforce_eager=False``), against the eager engine.

One compiled Llama engine (deferred residual, fused ``gate_up_proj``, grouped-query attention)
per runner; the reference is the session's eager vLLM engine on the same checkpoint (and HF for
the residual stream). The residual stream's taps run inside the compiled graph (the compiled
islands, ``interp_vllm.worker._compiled``); taps inside a layer run in an uncompiled forward of
their step. The worker's counters say which: ``uncompiled_steps`` and ``islands_fired``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write, run_with_cache
from interp_testkit.suite import PROMPT, hf_for, rel_diff, vllm_model_path

from ..support.compiled import check_generation_rows, check_saes_clamp_and_lens, counters
from ..support.readouts import TOL

FAMILY = "llama"


@pytest.fixture(scope="module")
def engines(attached: Any) -> tuple[Any, Any]:
    """The compiled engine and the eager one, with the readout SAEs attached to both."""
    compiled = attached(FAMILY, enforce_eager=False)
    eager = attached(FAMILY)
    return compiled, eager


def _points(n: int) -> list[Address]:
    kinds = ("resid_pre", "resid_mid", "attn_out", "mlp_pre", "mlp_post", "mlp_out", "resid_post", "attn_z")
    inside = [Address(kind, layer) for layer in range(n) for kind in kinds]
    return [Address("embed"), *inside, Address("attn_pattern", 1), Address("final_norm"), Address("logits")]


def test_the_engine_compiles_and_plain_steps_stay_compiled(engines: Any) -> None:
    compiled, eager = engines
    ids = compiled.to_tokens("Once upon a time")[0].tolist()
    before = counters(compiled)
    completion = compiled.generate(ids, max_tokens=8)
    uncompiled, fired = counters(compiled)
    assert uncompiled == before[0]  # no step ran uncompiled
    n = compiled.info.n_layers
    assert fired - before[1] >= 8 * 2 * n  # every island's op ran in every compiled step: the graph has them
    assert completion == eager.generate(ids, max_tokens=8)


def test_every_kind_equals_the_eager_engine_and_hf(engines: Any) -> None:
    compiled, eager = engines
    ids = compiled.to_tokens(PROMPT)[0].tolist()
    n = compiled.info.n_layers
    points = _points(n)
    resid = [Address("embed"), *(Address(k, layer) for layer in range(n) for k in ("resid_pre", "resid_post"))]
    before = counters(compiled)
    stream = compiled.capture(ids, resid)  # the residual stream alone: inside the compiled graph
    assert counters(compiled)[0] == before[0]
    acts = compiled.capture(ids, points)  # sites inside the layers: this step runs uncompiled
    assert counters(compiled)[0] > before[0]
    theirs = eager.capture(ids, points)
    for point in points:
        assert rel_diff(acts[point], theirs[point]) <= TOL, point
    with torch.no_grad():
        hf = hf_for(vllm_model_path(FAMILY))(torch.tensor([ids]), output_hidden_states=True)
    for layer in range(n):
        assert rel_diff(stream[Address("resid_pre", layer)], hf.hidden_states[layer][0]) <= TOL
        assert rel_diff(stream[Address("resid_pre", layer)], theirs[Address("resid_pre", layer)]) <= TOL
        assert rel_diff(stream[Address("resid_post", layer)], theirs[Address("resid_post", layer)]) <= TOL
    assert rel_diff(stream[Address("embed")], hf.hidden_states[0][0]) <= TOL
    # during generation, every generated token's rows too
    check_generation_rows(compiled, eager, ids, 5)


def test_steering_equals_the_eager_engine(engines: Any) -> None:
    compiled, eager = engines
    ids = compiled.to_tokens(PROMPT)[0].tolist()
    gen = torch.Generator().manual_seed(5)
    d_model, d_mlp, d_head = compiled.info.d_model, compiled.info.d_mlp, compiled.info.d_head
    specs = [  # the residual stream (compiled islands), then sites inside the layers (uncompiled)
        SteeringSpec([Write("resid_post.0", torch.randn(d_model, generator=gen), op="add", scale=3.0)]),
        SteeringSpec([Write("resid_pre.1", torch.randn(d_model, generator=gen), op="ablate")]),
        SteeringSpec([Write("resid_pre.0", torch.randn(d_model, generator=gen), op="set", positions=[1, -1])]),
        SteeringSpec([Write("resid_post.2", torch.randn(d_model, generator=gen), op="add", positions="prompt")]),
        SteeringSpec([Write("mlp_post.1", torch.randn(d_mlp, generator=gen), op="add", positions=[1, -1])]),
        SteeringSpec([Write("resid_mid.2", torch.randn(d_model, generator=gen), op="add")]),
        SteeringSpec([Write("attn_z.1", torch.zeros(d_head), op="set", heads=[0])]),
    ]
    points = [Address("resid_post", 0), Address("resid_mid", 2), Address("logits")]
    plain = compiled.capture(ids, points)
    for spec in specs:
        steered = compiled.capture(ids, points, steering_spec=spec)
        expected = eager.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(steered[point], expected[point]) <= TOL, (spec, point)
        assert not torch.allclose(steered[Address("logits")], plain[Address("logits")]), spec
    for spec in (specs[0], specs[4]):
        assert compiled.generate(ids, max_tokens=6, steering_spec=spec) == eager.generate(
            ids, max_tokens=6, steering_spec=spec
        )


def test_concurrent_tapped_and_untapped_requests_equal_their_solo_runs(engines: Any) -> None:
    compiled, eager = engines
    gen = torch.Generator().manual_seed(9)
    d_model = compiled.info.d_model
    rows = [compiled.to_tokens(text)[0].tolist() for text in (PROMPT, "A different sentence about cats", "Short")]
    specs = [
        SteeringSpec([Write("resid_post.0", torch.randn(d_model, generator=gen), scale=3.0)]),
        None,
        SteeringSpec([Write("resid_pre.1", torch.randn(d_model, generator=gen), positions=[-1], op="set")]),
    ]
    points = ["resid_post.1", "logits"]
    batch = run_with_cache(compiled, rows, points, steering_spec=specs)
    twin = run_with_cache(eager, rows, points, steering_spec=specs)
    for i, (row, spec) in enumerate(zip(rows, specs, strict=True)):
        solo = compiled.capture(row, points, steering_spec=spec)
        for point in points:
            got = batch[point][i, : len(row)]
            assert rel_diff(got, solo[Address.parse(point)]) <= TOL, (i, point)
            assert rel_diff(got, twin[point][i, : len(row)]) <= TOL, (i, point)
    # an untapped generation beside steered ones (each step of the batch runs the islands' plan
    # for the steered rows only): its tokens and log-probabilities are its solo run's
    alone = list(compiled.stream(rows[1], max_tokens=5, n_logprobs=3, ignore_eos=True))
    steered = SteeringSpec([Write("resid_post.1", torch.randn(d_model, generator=gen), scale=4.0)])
    mixed = run_with_cache(compiled, rows, ["resid_post.0"], steering_spec=[steered, None, steered])
    assert mixed["resid_post.0"].shape[0] == 3
    beside = list(compiled.stream(rows[1], max_tokens=5, n_logprobs=3, ignore_eos=True))
    assert [s.token_id for s in beside] == [s.token_id for s in alone]
    for a, b in zip(alone, beside, strict=True):
        assert a.logprobs == b.logprobs
    # a request tapping inside a layer runs its steps uncompiled, its neighbours' too: their
    # values equal their compiled solo runs within float rounding
    model = compiled.model
    solo = compiled.capture(rows[1], ["logits"])[Address("logits")]
    before = counters(compiled)[0]

    async def together() -> list[Any]:
        return list(await asyncio.gather(model.capture(rows[0], ["attn_z.1"]), model.capture(rows[1], ["logits"])))

    _, neighbour = compiled.run(together)
    assert counters(compiled)[0] > before
    assert rel_diff(neighbour[Address("logits")], solo) <= TOL


def test_sae_readouts_clamps_and_the_lens_equal_the_eager_engine(engines: Any) -> None:
    compiled, eager = engines
    check_saes_clamp_and_lens(compiled, eager, FAMILY)
