"""What crosses the process boundary between the front end and vLLM's workers.

The front end and the workers import only these types; nothing else knows a key or a layout:

- :class:`RequestPayload` travels in ``SamplingParams.extra_args[PAYLOAD_KEY]`` with each request
  (plain data: vLLM serialises it with the request);
- :class:`Fetched` is one rank's captured values for one request, returned by the
  ``interp_fetch_many`` RPC as plain data (``{"error": str | None, "values": safetensors bytes}``);
- :func:`pack` / :func:`unpack` carry tensors through ``collective_rpc`` (which does not return
  tensors as tensors, but does return bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from interp_engine import Address, BackendError, FeatureReadout, Features, FeatureWrite, SteeringSpec, Write

PAYLOAD_KEY = "interp_engine"
"""The ``SamplingParams.extra_args`` entry that carries a request's payload."""


def pack(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Tensors as safetensors bytes (empty bytes for none); views (e.g. logits sliced from
    vLLM's padded vocabulary) are packed as contiguous copies."""
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in tensors.items()}) if tensors else b""


def unpack(data: bytes) -> dict[str, torch.Tensor]:
    """What :func:`pack` wrote."""
    from safetensors.torch import load

    return load(data) if data else {}


@dataclass(frozen=True)
class RequestPayload:
    """One request's taps: what the workers read and write for it, over its whole life.

    ``rid`` is the front end's id (vLLM adds a suffix to its own ids inside the workers);
    ``n_prompt``/``n_total`` bound the positions writes resolve against; ``slots`` is what a
    vllm-static request holds in each write address's slot table.
    """

    rid: str
    points: tuple[Address, ...] = ()
    writes: tuple[Write | FeatureWrite, ...] = ()
    n_prompt: int = 0
    n_total: int = 0
    slots: Mapping[Address, int] = field(default_factory=dict)
    readouts: tuple[Features, ...] = ()
    """Feature readouts, each naming an SAE the workers hold (``interp_attach``)."""
    stream: bool = False
    """Readouts are drained step by step (``interp_drain_many``); positions before the prompt's
    last token are not kept."""
    sae_keys: Mapping[str, str] = field(default_factory=dict)
    """Per SAE name the readouts and feature writes use, the key the workers hold it under (one
    key per attachment: a request queued while its name is re-attached keeps the SAE it was
    checked with). A name without a key is held under the name itself."""

    def encode(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.rid,
            "points": [str(p) for p in self.points],
            "writes": [w.to_dict() for w in self.writes],
            "n_prompt": self.n_prompt,
            "n_total": self.n_total,
            "slots": {str(a): n for a, n in self.slots.items()},
        }
        if self.readouts:
            data["readouts"] = [str(r) for r in self.readouts]
        if self.stream:
            data["stream"] = True
        if self.sae_keys:
            data["sae_keys"] = dict(self.sae_keys)
        return data

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> RequestPayload:
        return cls(
            rid=str(data["id"]),
            points=tuple(Address.parse(p) for p in data.get("points", ())),
            writes=SteeringSpec.from_dict(list(data.get("writes") or [])).writes,
            n_prompt=int(data["n_prompt"]),
            n_total=int(data["n_total"]),
            slots={Address.parse(a): int(n) for a, n in (data.get("slots") or {}).items()},
            readouts=tuple(Features.parse(r) for r in data.get("readouts", ())),
            stream=bool(data.get("stream", False)),
            sae_keys={str(n): str(k) for n, k in (data.get("sae_keys") or {}).items()},
        )

    def extra_args(self) -> dict[str, Any]:
        """The ``SamplingParams.extra_args`` that carry this payload."""
        return {PAYLOAD_KEY: self.encode()}

    @classmethod
    def of(cls, params: Any) -> RequestPayload | None:
        """The payload a request's ``SamplingParams`` carry, or ``None``."""
        data = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY)
        return None if data is None else cls.decode(data)

    @classmethod
    def rid_of(cls, params: Any) -> str | None:
        """Only the id (cheap: the workers ask this of every request in every step)."""
        data = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY)
        return None if data is None else str(data["id"])


def compact(readout: FeatureReadout, dtype: str, d_sae: int) -> FeatureReadout:
    """A readout as it crosses the process boundary: ids in the narrowest integer type that
    holds ``d_sae`` (int16 up to 32767 features), values in ``dtype`` (``Features.dtype``)."""
    ids = readout.ids
    if ids is not None:
        ids = ids.to(torch.int16 if d_sae <= torch.iinfo(torch.int16).max else torch.int32)
    values = readout.values.to(torch.float16 if dtype == "float16" else torch.float32)
    return FeatureReadout(values, ids, readout.error_norm)


@dataclass(frozen=True)
class Fetched:
    """One rank's values for one request: per address, the absolute positions it saw and the
    values there (sorted by position, one value per position), per feature readout the same
    (tensor-parallel rank 0 of the pipeline stage holding the SAE's address computes readouts),
    or why it could not serve it."""

    values: Mapping[Address, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None
    readouts: Mapping[Features, tuple[torch.Tensor, FeatureReadout]] = field(default_factory=dict)

    def encode(self) -> dict[str, Any]:
        tensors: dict[str, torch.Tensor] = {}
        for address, (positions, values) in self.values.items():
            tensors[f"positions/{address}"] = positions.contiguous()
            tensors[f"values/{address}"] = values.contiguous()
        for spec, (positions, readout) in self.readouts.items():
            tensors[f"rpositions/{spec}"] = positions.to(torch.int32).contiguous()
            tensors.update(readout.tensors(f"readout/{spec}"))
        return {"error": self.error, "values": pack(tensors)}

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> Fetched:
        tensors = unpack(data.get("values") or b"")
        values = {
            Address.parse(key.partition("/")[2]): (tensors[key], tensors[f"values/{key.partition('/')[2]}"])
            for key in tensors
            if key.startswith("positions/")
        }
        readouts = {}
        for key in tensors:
            if key.startswith("rpositions/"):
                name = key.partition("/")[2]
                readout = FeatureReadout.from_tensors(tensors, f"readout/{name}")
                readouts[Features.parse(name)] = (tensors[key].long(), readout)
        return cls(values, data.get("error"), readouts)

    def raise_error(self) -> None:
        if self.error is not None:
            raise BackendError(self.error)
