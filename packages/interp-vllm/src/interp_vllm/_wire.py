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
LensChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""The logit lens at some positions: ``(positions [n], ids [n, n_layers, k], probs [n, n_layers, k])``."""
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
    lens_layers: tuple[int, ...] = ()
    """The logit lens: ``resid_post`` layers (absolute, in the order asked; empty: no lens)."""
    lens_top_k: int = 0
    lens_positions: tuple[int, ...] = ()
    """Prompt positions (absolute) the lens reads besides every position from ``n_prompt - 1`` on."""

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
        if self.lens_layers:
            data["lens"] = {
                "layers": list(self.lens_layers),
                "top_k": self.lens_top_k,
                "positions": list(self.lens_positions),
            }
        return data

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> RequestPayload:
        lens = data.get("lens") or {}
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
            lens_layers=tuple(int(layer) for layer in lens.get("layers", ())),
            lens_top_k=int(lens.get("top_k", 0)),
            lens_positions=tuple(int(p) for p in lens.get("positions", ())),
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
    def awaits_fetch_of(cls, params: Any) -> bool:
        """Whether the payload a request's ``SamplingParams`` carry asks for values back (points,
        readouts or a lens), read without decoding the rest: it answers for a payload that
        :meth:`decode` refused too (that request's error waits for its fetch)."""
        data = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY) or {}
        return bool(data.get("points") or data.get("readouts") or data.get("lens"))

    @classmethod
    def rid_of(cls, params: Any) -> str | None:
        """Only the id (cheap: the workers ask this of every request in every step)."""
        data = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY)
        return None if data is None else str(data["id"])


def compact_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token ids as they cross the process boundary: int16 for a vocabulary up to 32767 tokens,
    else int32 (the front end widens them to int64)."""
    return ids.to(torch.int16 if vocab <= torch.iinfo(torch.int16).max else torch.int32)


def merge_lens(chunks: list[LensChunk]) -> LensChunk | None:
    """Lens chunks in position order (a recomputed position keeps its last value)."""
    if not chunks:
        return None
    positions = torch.cat([p for p, _, _ in chunks])
    ids = torch.cat([i for _, i, _ in chunks])
    probs = torch.cat([p for _, _, p in chunks])
    order = torch.argsort(positions, stable=True)
    positions = positions[order]
    last = torch.ones_like(positions, dtype=torch.bool)
    last[:-1] = positions[1:] != positions[:-1]
    keep = order[last]
    return positions[last], ids[keep], probs[keep]


def _lens_bytes(lens: LensChunk) -> dict[str, Any]:
    """A lens chunk as plain data: positions as ints, ids (int16 or int32) and float32
    probabilities as little-endian bytes."""
    positions, ids, probs = lens
    return {
        "positions": positions.tolist(),
        "shape": list(ids.shape[1:]),
        "wide": ids.dtype != torch.int16,
        "ids": ids.contiguous().numpy().astype("<i4" if ids.dtype != torch.int16 else "<i2").tobytes(),
        "probs": probs.contiguous().numpy().astype("<f4").tobytes(),
    }


def _lens_tensors(data: Mapping[str, Any]) -> LensChunk:
    """What :func:`_lens_bytes` wrote (ids widened to int64)."""
    import numpy as np

    positions = torch.tensor(data["positions"], dtype=torch.long)
    shape = (len(positions), *(int(n) for n in data["shape"]))
    ids = np.frombuffer(data["ids"], dtype="<i4" if data["wide"] else "<i2").reshape(shape)
    probs = np.frombuffer(data["probs"], dtype="<f4").reshape(shape)
    return positions, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(probs.astype(np.float32))


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
    or why it could not serve it. ``lens``: the logit lens's positions ``[n]``, top-k ids
    ``[n, n_layers, k]`` (the narrowest integer type holding the vocabulary) and probabilities
    ``[n, n_layers, k]`` (float32), by position (computed by tensor-parallel rank 0 of the last
    pipeline stage)."""

    values: Mapping[Address, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None
    readouts: Mapping[Features, tuple[torch.Tensor, FeatureReadout]] = field(default_factory=dict)
    lens: LensChunk | None = None

    def encode(self) -> dict[str, Any]:
        tensors: dict[str, torch.Tensor] = {}
        for address, (positions, values) in self.values.items():
            tensors[f"positions/{address}"] = positions.contiguous()
            tensors[f"values/{address}"] = values.contiguous()
        for spec, (positions, readout) in self.readouts.items():
            tensors[f"rpositions/{spec}"] = positions.to(torch.int32).contiguous()
            tensors.update(readout.tensors(f"readout/{spec}"))
        data: dict[str, Any] = {"error": self.error, "values": pack(tensors)}
        if self.lens is not None:  # sent every step of a stream: raw bytes, no per-tensor header
            data["lens"] = _lens_bytes(self.lens)
        return data

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
        lens = _lens_tensors(data["lens"]) if data.get("lens") is not None else None
        return cls(values, data.get("error"), readouts, lens)

    def raise_error(self) -> None:
        if self.error is not None:
            raise BackendError(self.error)
