"""The batch side of an eager forward: the writes of rows that carry different specs, the values
recorded chunk by chunk, and the results of right-padded rows (readouts, padding cleared, on the
CPU)."""

from __future__ import annotations

import torch

from interp_engine import Address, CheckedRequest, FeatureReadout, Features, Sae
from interp_engine.backend import AnyWrite, read_features


def batch_writes(
    requests: list[CheckedRequest],
) -> tuple[list[AnyWrite], list[frozenset[int] | None] | None, dict[str, Sae]]:
    """The writes of a batch whose rows may carry different specs, each with the rows it applies
    to (``None`` throughout when every row has the same writes), and the SAEs they use."""
    saes: dict[str, Sae] = {}
    for request in requests:
        saes.update(request.saes)
    first = requests[0].writes
    if all(r.writes is first for r in requests):
        return list(first), None, saes
    writes: list[AnyWrite] = []
    rows: list[frozenset[int] | None] = []
    seen: dict[int, int] = {}  # id of a request's write list -> its first row
    for row, request in enumerate(requests):
        key = id(request.writes)
        if key in seen:
            continue
        seen[key] = row
        sharing = frozenset(i for i, r in enumerate(requests) if r.writes is request.writes)
        writes += request.writes
        rows += [sharing] * len(request.writes)
    return writes, rows, saes


def row_at(chunks: list[torch.Tensor], position: int) -> torch.Tensor:
    """Position ``position``'s row ``[1, width]`` of values recorded chunk by chunk (``[1, length, width]``)."""
    start = 0
    for chunk in chunks:
        if position < start + chunk.shape[1]:
            return chunk[0, position - start : position - start + 1]
        start += chunk.shape[1]
    raise IndexError(f"position {position} was not recorded")  # pragma: no cover - the decode loop records it


def batch_readouts(
    request: CheckedRequest, values: dict[Address, torch.Tensor], lengths: list[int]
) -> dict[Features, FeatureReadout]:
    """Each readout of batched values ``[batch, n_max, width]`` (on the model's device), encoded
    where they are and moved to the CPU; right-padding cleared (ids -1, values 0)."""
    out = {}
    for spec in request.readouts:
        sae = request.saes[spec.sae]
        x = values[sae.address]
        batch, length = x.shape[0], x.shape[1]
        flat = read_features(sae, x.reshape(batch * length, -1), spec).to("cpu")
        values_ = flat.values.reshape(batch, length, -1).clone()
        ids = None if flat.ids is None else flat.ids.reshape(batch, length, -1).clone()
        error = None if flat.error_norm is None else flat.error_norm.reshape(batch, length).clone()
        for row, n in enumerate(lengths):
            values_[row, n:] = 0
            if ids is not None:
                ids[row, n:] = -1
            if error is not None:
                error[row, n:] = 0
        out[spec] = FeatureReadout(values_, ids, error)
    return out


def to_cpu(value: torch.Tensor) -> torch.Tensor:
    """On the CPU, floats as float32 (integer values -- ``expert_indices`` -- keep their dtype)."""
    if not value.is_floating_point():
        return value.detach().to(device="cpu")
    return value.detach().to(device="cpu", dtype=torch.float32)


def zero_padding(address: Address, value: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Clear the right-padding of a batched value (positions past each row's length): zeros, and
    ``-inf`` for attention scores (masked, as ``pad_rows`` pads them)."""
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return value
    value = value.clone()
    fill = float("-inf") if address.kind == "attn_scores" else 0.0
    pad = -1 if address.kind == "expert_indices" else 0
    for row, n in enumerate(lengths):
        if address.info.width == "heads x keys":  # attn_pattern, attn_scores: [heads, q, k]
            value[row, :, n:, :] = fill
            value[row, :, :, n:] = fill
        else:
            value[row, n:] = pad
    return value
