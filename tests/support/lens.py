"""The logit lens compared: top-k ids and probabilities against a reference decoded from
captured residuals."""

from __future__ import annotations

from typing import Any

import torch

from interp_engine import Address, LensResult, lens_top_k

PROB_TOL = 1e-5  # the bound on probabilities


def assert_same_lens(
    ids: torch.Tensor, probs: torch.Tensor, ref_ids: torch.Tensor, ref_probs: torch.Tensor, what: str = ""
) -> None:
    """Equal top-k ids (two near-equal probabilities may swap, nothing else) and probabilities
    within :data:`PROB_TOL` slot by slot."""
    assert ids.shape == ref_ids.shape and probs.shape == ref_probs.shape, what
    assert ids.dtype == torch.int64 and probs.dtype == torch.float32, what
    assert float((probs - ref_probs).abs().max()) <= PROB_TOL, f"{what}: probabilities differ"
    for where in (ids != ref_ids).nonzero().tolist():
        # a different id only where its probability ties the expected one (a swap of near-equals)
        got = float(ref_probs[tuple(where)])
        assert abs(float(probs[tuple(where)]) - got) <= PROB_TOL, f"{what}: ids differ at {where} without a tie"
    assert int((ids != ref_ids).sum()) <= 2, f"{what}: ids differ"


def decoded_lens(facade: Any, acts: Any, layers: tuple[int, ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lens_top_k(decode_residuals(resid_post))`` of a capture: ``[n_layers, n_positions, k]``."""
    stacked = torch.stack([acts[Address("resid_post", layer)] for layer in layers])
    logits = facade.decode_residuals(stacked)
    return lens_top_k(logits, k)


def check_against(result: LensResult, ref: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    cols = list(result.positions)
    assert_same_lens(result.ids, result.probs, ref[0][:, cols], ref[1][:, cols], what)
