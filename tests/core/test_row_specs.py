"""One steering spec per row of a batched call, on eager: each row equals the HF model run alone
with the same edit made by hand (a forward hook on HF's own module, that row only), in one
batched forward; and the errors of a malformed list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from interp_engine import InvalidSteering, SteeringSpec, Write, run_with_cache
from interp_testkit.suite import hf_oracle, rel_diff

from ..support.engines import eager_model

ROWS = [[5, 17, 42, 9, 33, 61, 8, 12], [7, 3, 99, 12], [5, 17, 42, 9, 33, 61]]


def _blocks(hf: Any) -> Any:
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _hf_logits(
    hf: Any, ids: list[int], module: Any | None, edit: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    def hook(mod: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = edit(hidden.clone())
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = module.register_forward_hook(hook) if module is not None else None
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_row_equals_its_own_edit_made_by_hand_on_hf(family: str) -> None:
    model = eager_model(family)
    hf = hf_oracle(family)
    gen = torch.Generator().manual_seed(3)
    d = model.info.d_model
    add = torch.randn(d, generator=gen)
    rows_set = torch.randn(2, d, generator=gen)
    specs = [
        SteeringSpec([Write("resid_post.0", add, scale=2.0)]),
        None,
        SteeringSpec([Write("resid_post.1", rows_set, op="set", positions=[1, -1])]),
    ]
    got = run_with_cache(model, ROWS, ["logits"], steering_spec=specs)["logits"]
    blocks = _blocks(hf)

    def added(h: torch.Tensor) -> torch.Tensor:
        return h + 2.0 * add

    def put(h: torch.Tensor) -> torch.Tensor:
        h[0, 1], h[0, -1] = rows_set[0], rows_set[1]
        return h

    expected = [
        _hf_logits(hf, ROWS[0], blocks[0], added),
        _hf_logits(hf, ROWS[1], None, lambda h: h),
        _hf_logits(hf, ROWS[2], blocks[1], put),
    ]
    for i, want in enumerate(expected):
        assert rel_diff(got[i, : len(ROWS[i])], want) <= 1e-4, i
    # the same spec object on two rows, and one spec for every row, agree with the list form
    shared = run_with_cache(model, ROWS, ["logits"], steering_spec=[specs[0], specs[0], specs[0]])["logits"]
    single = run_with_cache(model, ROWS, ["logits"], steering_spec=specs[0])["logits"]
    assert torch.equal(shared, single)


def test_a_malformed_list_of_specs_is_refused_before_any_compute() -> None:
    model = eager_model("gpt2")
    spec = SteeringSpec([Write("resid_post.0", torch.zeros(model.info.d_model))])
    with pytest.raises(InvalidSteering, match="3 rows"):
        run_with_cache(model, ROWS, ["logits"], steering_spec=[spec, None])
    with pytest.raises(InvalidSteering, match="not writes"):
        run_with_cache(model, ROWS, ["logits"], steering_spec=[Write("resid_post.0", torch.zeros(model.info.d_model))])
    with pytest.raises(InvalidSteering, match=r"steering_spec\[1\]"):
        run_with_cache(model, ROWS, ["logits"], steering_spec=[spec, "add", None])
    with pytest.raises(InvalidSteering, match="SteeringSpec, None, or a list"):
        run_with_cache(model, ROWS, ["logits"], steering_spec="resid_post.0")  # type: ignore[arg-type]
    # a bad write in one row's spec is refused for the whole call
    with pytest.raises(InvalidSteering, match="width"):
        run_with_cache(
            model, ROWS, ["logits"], steering_spec=[None, SteeringSpec([Write("resid_post.0", torch.zeros(3))]), None]
        )
