"""Tensors on the wire: base64 float32 in JSON, or the core's Cache file format (safetensors).

No format that can run code is read: base64 bytes are read as float32 values and nothing else.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from fastapi.responses import Response

from ..results._cache import _FEATURES_KEY, _LENGTHS_KEY, _N_LAYERS_KEY
from ..sae._readouts import FeatureReadout
from ._errors import ApiError, limit_exceeded
from ._schemas import EncodedTensor

SAFETENSORS = "application/octet-stream"


def encode(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype": "float32", "shape": [...], "data": base64}`` of a tensor."""
    value = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    raw = value.numpy().astype("<f4", copy=False).tobytes()
    return {"dtype": "float32", "shape": list(value.shape), "data": base64.b64encode(raw).decode("ascii")}


def decode(value: EncodedTensor | list[Any], field: str, max_values: int) -> torch.Tensor:
    """A float32 tensor from an encoded tensor or nested lists of numbers."""
    if not isinstance(value, EncodedTensor):
        try:
            tensor = torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            message = f"{field}: not a rectangular array of numbers ({exc})"
            raise ApiError(422, "ValidationError", message, field=field) from None
        if tensor.numel() > max_values:
            raise limit_exceeded(field, f"{field} holds {tensor.numel()} values", max_values)
        return tensor
    if any(d < 0 for d in value.shape):
        raise ApiError(422, "ValidationError", f"{field}.shape: dimensions must be >= 0", field=f"{field}.shape")
    n = math.prod(value.shape)
    if n > max_values:
        raise limit_exceeded(field, f"{field} holds {n} values", max_values)
    try:
        raw = base64.b64decode(value.data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(422, "ValidationError", f"{field}.data: not valid base64", field=f"{field}.data") from None
    if len(raw) != 4 * n:
        raise ApiError(
            422,
            "ValidationError",
            f"{field}.data: {len(raw)} bytes, but float32 of shape {value.shape} takes {4 * n}",
            field=f"{field}.data",
        )
    array = np.frombuffer(raw, dtype="<f4").astype(np.float32)  # a native, writable copy
    return torch.from_numpy(array).reshape(value.shape)


def readout_out(readout: FeatureReadout) -> dict[str, Any]:
    """``{"values", "ids", "error_norm"}`` of a readout as nested lists (``null`` where absent)."""
    return readout.to(torch.device("cpu")).to_dict()


def safetensors_response(
    tensors: Mapping[str, torch.Tensor],
    n_tokens: int,
    extra: Mapping[str, Any],
    readouts: Mapping[str, FeatureReadout] | None = None,
    n_layers: int | None = None,
) -> Response:
    """The tensors (and feature readouts) as a Cache file of the core (batch axis of 1, readable
    by ``Cache.load``: a readout is stored as ``KEY/values``, ``KEY/ids`` (int64) and
    ``KEY/error_norm``; keys as requested, a negative layer read back through the model's
    ``n_layers``, kept in the metadata); ``extra`` goes into the metadata as JSON strings."""
    from safetensors.torch import save

    batched: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        value = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if value.numel() and value.data_ptr() in seen:  # one address asked twice (layer -1 and n-1): a copy each
            value = value.clone()
        seen.add(value.data_ptr())
        batched[key] = value[None]
    metadata = {"format": "interp-engine-cache", _LENGTHS_KEY: json.dumps([n_tokens])}
    if n_layers is not None:
        metadata[_N_LAYERS_KEY] = str(n_layers)
    for key, readout in (readouts or {}).items():
        batched.update({name: t.detach().cpu().contiguous()[None] for name, t in readout.tensors(key).items()})
    if readouts:
        metadata[_FEATURES_KEY] = json.dumps(list(readouts))
    metadata.update({key: json.dumps(value) for key, value in extra.items()})
    return Response(save(batched, metadata=metadata), media_type=SAFETENSORS)
