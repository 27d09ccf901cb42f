"""Per-request taps on compiled engines (``enforce_eager=False``) of the families the vLLM suite
holds out (those of test_vllm_families: vLLM's own classes and its Transformers modeling backend,
deferred residuals, sandwich norms, sliding windows, fused projections, a mixture of experts),
against the eager backend on the same checkpoint (itself checked against HF ``transformers``).

One compiled engine per family, shut down when its tests finish. The residual stream's taps, SAE
readouts and clamps at ``resid_post`` and the lens run inside the compiled graph (its islands);
every other site runs in an uncompiled forward of its step. The worker's ``uncompiled_steps``
counter says which, and its ``islands_fired`` that the compiled graph ran the islands.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write
from interp_testkit.suite import PROMPT, VLLM_ENGINE_ARGS, rel_diff, vllm_model_path

from ..support.compiled import check_generation_rows, check_saes_clamp_and_lens, counters
from ..support.engines import assert_no_leaks, started_engine
from ..support.points import every_point, writes_at_every_kind
from ..support.readouts import TOL, attach_all, eager_twin, saes_for

FAMILIES = ("gpt_neox", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral")
"""test_vllm_families' families."""


@pytest.fixture(scope="module", params=FAMILIES)
def compiled(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    """The family's compiled engine and its eager twin, the readout SAEs attached to both."""
    family = request.param
    saes = saes_for(family)
    eager = eager_twin(family)
    attach_all(eager, saes)
    model = started_engine(vllm_model_path(family), enforce_eager=False, **VLLM_ENGINE_ARGS.get(family, {}))
    try:
        attach_all(model, saes)
        yield family, model, eager
    finally:
        model.shutdown()


def _ids(model: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = model.to_tokens(text)[0].tolist()
    return ids


def _residual_stream(n: int) -> list[Address]:
    return [Address("embed"), *(Address(kind, layer) for layer in range(n) for kind in ("resid_pre", "resid_post"))]


def test_plain_generation_stays_compiled_and_equals_eager(compiled: tuple[str, Any, Any]) -> None:
    _, model, eager = compiled
    ids = _ids(model, "Once upon a time")
    before = counters(model)
    completion = model.generate(ids, max_tokens=8, ignore_eos=True)
    uncompiled, fired = counters(model)
    assert uncompiled == before[0], "a plain step ran uncompiled"
    assert fired - before[1] >= 8 * 2 * model.info.n_layers, "the compiled graph did not run its islands"
    assert completion.token_ids == eager.generate(ids, max_tokens=8, ignore_eos=True).token_ids


def test_every_kind_equals_eager(compiled: tuple[str, Any, Any]) -> None:
    _, model, eager = compiled
    ids = _ids(model)
    resid = _residual_stream(model.info.n_layers)
    before = counters(model)[0]
    stream = model.capture(ids, resid)
    assert counters(model)[0] == before, "the residual stream's taps left the compiled graph"
    points = every_point(model)
    assert set(model.points()) == set(eager.points())
    acts = model.capture(ids, points)
    assert counters(model)[0] > before  # sites inside the layers: an uncompiled forward
    expected = eager.capture(ids, points)
    for point in resid:
        assert rel_diff(stream[point], expected[point]) <= TOL, point
    for point in points:
        assert rel_diff(acts[point], expected[point]) <= TOL, point
    check_generation_rows(model, eager, ids, 4)
    assert_no_leaks(model)


def test_steering_at_every_kind_equals_eager(compiled: tuple[str, Any, Any]) -> None:
    _, model, eager = compiled
    ids = _ids(model)
    n, d = model.info.n_layers, model.info.d_model
    gen = torch.Generator().manual_seed(3)
    residual = [  # inside the compiled graph
        Write("resid_post.0", torch.randn(d, generator=gen), op="add", scale=3.0),
        Write("resid_pre.0", torch.randn(d, generator=gen), op="set", positions=[1, -1]),
    ]
    points = [Address("resid_post", n - 1), Address("logits")]
    plain = model.capture(ids, points)
    for write in residual + writes_at_every_kind(model):
        spec = SteeringSpec([write])
        before = counters(model)[0]
        got = model.capture(ids, points, steering_spec=spec)
        if write.address is not None and write.address.kind in ("resid_pre", "resid_post"):
            assert counters(model)[0] == before, write.address
        expected = eager.capture(ids, points, steering_spec=spec)
        for point in points:
            assert rel_diff(got[point], expected[point]) <= TOL, (write.address, point)
        assert not torch.allclose(got[Address("logits")], plain[Address("logits")]), write.address
    steered = SteeringSpec([residual[0]])
    completion = model.generate(ids, max_tokens=6, steering_spec=steered, ignore_eos=True)
    assert completion.token_ids == eager.generate(ids, max_tokens=6, steering_spec=steered, ignore_eos=True).token_ids


def test_sae_readouts_clamps_and_the_lens_equal_eager(compiled: tuple[str, Any, Any]) -> None:
    family, model, eager = compiled
    check_saes_clamp_and_lens(model, eager, family)
