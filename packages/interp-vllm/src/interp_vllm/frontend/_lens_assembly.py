"""The logit lens and readouts as the front end assembles them from the workers' answers, and
the payload fields that ask for them."""

from __future__ import annotations

import dataclasses

import torch

from interp_engine import (
    BackendError,
    FeatureReadout,
    Features,
)
from interp_engine.backend import CheckedLens, LensResult, LensTopK

from .._wire import Fetched, LensChunk, RequestPayload


def readouts_of(ranks: list[Fetched]) -> dict[Features, tuple[torch.Tensor, FeatureReadout]]:
    """Every readout the workers computed (each by tensor-parallel rank 0 of the pipeline stage
    holding its SAE's address)."""
    found: dict[Features, tuple[torch.Tensor, FeatureReadout]] = {}
    for rank in ranks:
        for spec, value in rank.readouts.items():
            found.setdefault(spec, value)
    return found


def lens_of(ranks: list[Fetched]) -> LensChunk | None:
    """The lens the workers computed (tensor-parallel rank 0 of the last pipeline stage)."""
    for rank in ranks:
        if rank.lens is not None:
            return rank.lens
    return None


def with_lens(payload: RequestPayload, lens: CheckedLens | None) -> RequestPayload:
    """``payload`` asking the workers for ``lens``."""
    if lens is None:
        return payload
    return dataclasses.replace(
        payload, lens_layers=lens.layers, lens_top_k=lens.top_k, lens_positions=lens.prompt_positions
    )


def lens_at_prompt(
    lens: CheckedLens, pending: dict[int, tuple[torch.Tensor, torch.Tensor]], n_prompt: int
) -> LensResult:
    """The lens at the prompt positions asked, out of ``pending`` (those before the prompt's last
    are taken out; the last one also produced the first token and stays for its step)."""
    last = n_prompt - 1
    missing = [p for p in lens.prompt_positions if p not in pending]
    if missing:
        raise BackendError(f"the lens of prompt positions {missing[:8]} did not come back from the workers")
    steps = []
    for p in lens.prompt_positions:
        ids, probs = pending[p] if p == last else pending.pop(p)
        steps.append(LensTopK(p, lens.layers, ids, probs))
    return LensResult.stack(steps)


def lens_result(lens: CheckedLens, chunk: LensChunk | None, n_prompt: int, n_generated: int) -> LensResult:
    """The lens of a generation: at the prompt positions asked and at every position that
    produced one of the ``n_generated`` tokens kept."""
    wanted = sorted({*lens.prompt_positions, *range(n_prompt - 1, n_prompt - 1 + n_generated)})
    if not wanted:  # nothing generated and no prompt positions asked
        empty = torch.zeros(len(lens.layers), 0, lens.top_k)
        return LensResult(lens.layers, (), empty.long(), empty)
    if chunk is None:
        raise BackendError("the lens did not come back from the workers")
    positions, ids, probs = chunk
    at = {int(p): row for row, p in enumerate(positions.tolist())}
    missing = [p for p in wanted if p not in at]
    if missing:
        raise BackendError(f"the lens of positions {missing[:8]} did not come back from the workers")
    rows = torch.tensor([at[p] for p in wanted], dtype=torch.long)
    return LensResult(
        lens.layers,
        tuple(wanted),
        ids[rows].transpose(0, 1).contiguous(),
        probs[rows].transpose(0, 1).contiguous(),
    )


def keyed(payload: RequestPayload, keys: dict[str, str]) -> RequestPayload:
    """``payload`` naming the keys its SAEs are held under in the workers."""
    return dataclasses.replace(payload, sae_keys=keys) if keys else payload
