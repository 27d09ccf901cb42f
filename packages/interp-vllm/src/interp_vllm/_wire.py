"""Everything that crosses the process boundary between the front end and vLLM's workers.

The front end and the workers import only these types and names; nothing else knows a key, a
layout or an RPC's name:

- the RPCs themselves (:data:`RPC_NAMES`): the workers register their methods under these
  names (``_vllm_entry``) and the front end calls them through :class:`~.frontend._client.Workers`;
- :class:`RequestPayload` travels in ``SamplingParams.extra_args[PAYLOAD_KEY]`` with each request
  (plain data: vLLM serialises it with the request);
- :class:`StaticDeclaration` is a vllm-static engine's tap set, in vLLM's ``additional_config``
  under :data:`CONFIG_KEY` (part of vLLM's compile-cache key); its defaults are the backend's;
- :class:`Ping` (``interp_ping``), :class:`WeightsHeld` (``interp_weight_info``) and
  :data:`WorkerStats` (``interp_stats``) are what a worker says about itself;
- :class:`Fetched` is one rank's captured values for one request (``interp_fetch_many`` and
  ``interp_drain_many``), carried as :class:`FetchedWire`;
- :func:`pack` / :func:`unpack` carry tensors (``interp_decode``, ``interp_weight``).

The structured answers are msgspec structs (as vLLM's own ``v1/engine`` messages are) that cross
``collective_rpc`` as plain data (:func:`to_wire` / :func:`from_wire`): vLLM's executors
(multiprocessing, Ray) all carry dicts, lists, strings, numbers and bytes, and a test or tool
reading an answer sees plain data.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import torch

from interp_engine import Address, BackendError, FeatureReadout, Features, FeatureWrite, SteeringSpec, Write

from ._transport import Region, Written

logger = logging.getLogger(__name__)

PAYLOAD_KEY = "interp_engine"
"""The ``SamplingParams.extra_args`` entry that carries a request's payload."""
CONFIG_KEY = "interp_engine_static"
"""The ``additional_config`` entry that declares a vllm-static engine's taps."""
LensChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""The logit lens at some positions: ``(positions [n], ids [n, n_layers, k], probs [n, n_layers, k])``."""

# -- the RPCs ------------------------------------------------------------------------------------
PING = "interp_ping"
"""-> :class:`Ping`: which runner serves the worker, and whether it carries the taps."""
FETCH_MANY = "interp_fetch_many"
"""``(rids)`` -> a :class:`FetchedWire` per request: finished requests' values (then forgotten)."""
DRAIN_MANY = "interp_drain_many"
"""``(rids)`` -> a :class:`FetchedWire` per request: streaming requests' readouts and lens so far."""
ATTACH = "interp_attach"
"""``(key, Sae.to_bytes())``: hold an SAE or probe under ``key``."""
DETACH = "interp_detach"
"""``(key)``: drop the SAE held under ``key``."""
RELEASE = "interp_release"
"""``(rid)``: forget a request's values (cancelled or failed requests)."""
DECODE = "interp_decode"
"""``(pack_residuals(...))`` -> :func:`pack`'d logits (empty from a stage before the last)."""
WEIGHT_INFO = "interp_weight_info"
"""-> :class:`WeightsHeld`: what the worker's pipeline stage holds of the weights."""
WEIGHT = "interp_weight"
"""``(name, layer, vocab)`` -> :func:`pack`'d shard of a weight (empty where the stage lacks it)."""
STATS = "interp_stats"
"""-> :data:`WorkerStats`."""
RPC_NAMES = (PING, FETCH_MANY, DRAIN_MANY, ATTACH, DETACH, RELEASE, DECODE, WEIGHT_INFO, WEIGHT, STATS)

_T = TypeVar("_T")


def to_wire(value: msgspec.Struct) -> Any:
    """A struct as the plain data ``collective_rpc`` and ``additional_config`` carry (bytes stay bytes)."""
    return msgspec.to_builtins(value, builtin_types=(bytes,))


def from_wire(kind: type[_T], data: Any) -> _T:
    """What :func:`to_wire` wrote, checked against ``kind`` (a typed error for a malformed answer)."""
    return msgspec.convert(data, kind)


# -- the vllm-static declaration ---------------------------------------------------------------------
DEFAULT_SLOTS = 256
"""Steering slots per write address (``static_write_slots``)."""
DEFAULT_SAE_TOP_K = 64
"""Top features an in-graph SAE keeps per token (``static_sae_top_k``)."""
DEFAULT_SAE_DENSE_MAX = 1024
"""Dictionaries up to this wide keep every feature in-graph (``static_sae_dense_max``)."""


class SavedSae(msgspec.Struct, frozen=True):
    """An SAE a vllm-static engine compiles in, as the front end saved it for the workers: the
    folder it was saved to, and a digest of it (so the compile hash covers what the graph holds).
    The workers load it into a :class:`~interp_vllm.sae._math.StaticSae`."""

    path: str
    digest: str


class StaticDeclaration(msgspec.Struct, frozen=True):
    """A vllm-static engine's taps, fixed before vLLM compiles the model."""

    points: tuple[str, ...] = ()
    """Capture points (addresses, as strings)."""
    writes: tuple[str, ...] = ()
    """Write points."""
    slots: int = DEFAULT_SLOTS + 1
    """Rows of each write table: the steering slots and row 0, the identity."""
    saes: dict[str, SavedSae] = {}
    """SAEs compiled in, by name."""
    sae_top_k: int = DEFAULT_SAE_TOP_K
    sae_dense_max: int = DEFAULT_SAE_DENSE_MAX

    def addresses(self) -> tuple[list[Address], list[Address]]:
        """The capture and write points as addresses."""
        return [Address.parse(p) for p in self.points], [Address.parse(a) for a in self.writes]


SERVE_KEY = "interp"
"""The ``additional_config`` entry that configures the ``vllm serve`` plugin (its ``static``
entry declares a vllm-static tap set: :func:`serve_declaration`)."""
SERVE_STATIC_FIELDS = ("points", "writes", "write_slots", "sae_top_k", "sae_dense_max")
"""What the plugin's ``static`` entry may hold (or it is the string ``"auto"``)."""
SERVE_STATIC_HOW = """--additional-config '{"interp": {"static": {"points": [...], "writes": [...]}}}'"""
"""How a ``vllm serve`` declares its compiled taps (named by the refusal of an undeclared one)."""


def _feature_add_address(path: str) -> Address:
    """Where a feature ``add`` of the SAE saved at ``path`` writes (a transcoder: its output)."""
    from interp_engine import load_sae

    return load_sae(path).address_out


def serve_declaration(extra: Mapping[str, Any], n_layers: int) -> StaticDeclaration | None:
    """The vllm-static tap set a ``vllm serve`` declares in ``--additional-config``
    (``{"interp": {"static": ...}}``; ``None``: it declares none, the dynamic taps serve it).

    The workers (before vLLM compiles) and the plugin's front end (after) both read it here, so
    they agree. ``static`` is an object of :data:`SERVE_STATIC_FIELDS` or ``"auto"``:

    - ``points``: the capture points (every layer's ``resid_post`` where left out or ``"auto"``);
    - ``writes``: the write points (none where left out; ``"auto"``: every layer's
      ``resid_post`` and every address a preset writes at, a feature ``add`` at its SAE's);
    - ``write_slots``, ``sae_top_k``, ``sae_dense_max``: as the backend's ``static_*`` options;
    - ``"auto"``: ``{"points": "auto", "writes": "auto"}``.

    The SAEs of the ``saes`` entry are compiled in. Negative layers count from the end. Raises
    :class:`~interp_engine.InvalidOption` (or an address error) naming what is wrong."""
    from interp_engine import InterpError, InvalidOption

    config = extra.get(SERVE_KEY)
    if not isinstance(config, Mapping) or config.get("static") is None:
        return None
    static: Any = config["static"]
    if static == "auto":
        static = {"points": "auto", "writes": "auto"}
    if not isinstance(static, Mapping):
        raise InvalidOption(f'interp.static is "auto" or an object of {", ".join(SERVE_STATIC_FIELDS)}, got {static!r}')
    unknown = sorted(set(static) - set(SERVE_STATIC_FIELDS))
    if unknown:
        raise InvalidOption(f"unknown interp.static settings {unknown}; valid: {', '.join(SERVE_STATIC_FIELDS)}")
    every = [f"resid_post.{layer}" for layer in range(n_layers)]

    def addresses(name: str, given: Any, auto: list[str]) -> tuple[str, ...]:
        if given == "auto":
            given = auto
        if isinstance(given, str) or not isinstance(given, (list, tuple)):
            raise InvalidOption(f'interp.static.{name} is a list of addresses or "auto", got {given!r}')
        out = []
        for text in given:
            if not isinstance(text, str):
                raise InvalidOption(f"interp.static.{name} holds addresses as strings, got {text!r}")
            out.append(str(Address.parse(text).resolve(n_layers)))
        return tuple(dict.fromkeys(out))

    saes = {str(name): SavedSae(path=str(path), digest="") for name, path in dict(config.get("saes") or {}).items()}
    preset_writes: list[str] = []
    for name, spec in dict(config.get("presets") or {}).items():
        try:
            parsed = SteeringSpec.from_dict(spec)
        except (InterpError, TypeError, ValueError, KeyError) as exc:
            raise InvalidOption(f"preset {name!r} is not a steering spec: {exc}") from None
        for write in parsed.writes:
            if isinstance(write, Write) and write.address is not None:
                preset_writes.append(str(write.address))
            elif isinstance(write, FeatureWrite) and write.op == "add" and write.sae in saes:
                preset_writes.append(str(_feature_add_address(saes[write.sae].path)))
    points = addresses("points", static.get("points", "auto"), every)
    writes = addresses("writes", static.get("writes", []), [*every, *preset_writes])
    counts = {}
    for name, default, least in (
        ("write_slots", DEFAULT_SLOTS, 1),
        ("sae_top_k", DEFAULT_SAE_TOP_K, 1),
        ("sae_dense_max", DEFAULT_SAE_DENSE_MAX, 0),
    ):
        value = static.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidOption(f"interp.static.{name} is an int >= {least}, got {value!r}")
        counts[name] = value
    return StaticDeclaration(
        points=points,
        writes=writes,
        slots=counts["write_slots"] + 1,
        saes=saes,
        sae_top_k=counts["sae_top_k"],
        sae_dense_max=counts["sae_dense_max"],
    )


# -- what a worker says about itself ---------------------------------------------------------------


class Ping(msgspec.Struct, frozen=True):
    """A worker's answer to ``interp_ping``."""

    runner: str
    """The model runner's class."""
    patched: bool
    """Whether the runner's class carries the taps' wrappers."""
    static: bool = False
    """Whether the taps are vllm-static's, installed before compilation."""
    static_points: tuple[str, ...] = ()
    """A vllm-static worker's compiled capture points."""
    static_writes: tuple[str, ...] = ()
    """A vllm-static worker's compiled write points."""
    rank: int = 0
    tp_size: int = 1
    lacks: tuple[str, ...] | None = None
    """The kinds the worker's resolved family lacks (``None``: no family)."""
    unsupported: str | None = None
    """Why the worker has no taps for this model (``None``: it has)."""
    pp_rank: int = 0
    pp_size: int = 1
    layers: tuple[int, ...] = ()
    """The layers this worker's pipeline stage holds."""
    v2_runner_env: str | None = None
    """``VLLM_USE_V2_MODEL_RUNNER`` as this worker saw it (a Ray worker has its own environment)."""
    incompatible: str | None = None
    """Why the runner could not be patched (``interp_engine.IncompatibleDependency``), if it could not."""
    sees_probe: bool = False
    """Whether the worker sees the front end's shared-memory probe file (``interp_ping``'s
    argument): then captured values travel through shared memory (:mod:`._transport`)."""
    seam: str | None = None
    """Which of vLLM's runners it is, as the taps' seam serves it (``"v1"`` or ``"v2"``; ``None``:
    one the taps do not wrap)."""


class FinalNorm(msgspec.Struct, frozen=True):
    """The final norm as probed in the worker."""

    kind: Literal["layernorm", "rmsnorm", "none"]
    eps: float
    offset: float
    weight: bool
    bias: bool


class WeightsHeld(msgspec.Struct, frozen=True):
    """What a worker's pipeline stage holds of the weights (``interp_weight_info``); the
    unembedding's and the final norm's fields are set on the last stage only."""

    pp_rank: int
    rank: int
    dtype: str
    embed: bool
    """The stage holds the input embedding."""
    o_bias: bool
    """Every layer of the stage has an output-projection bias."""
    tied: bool | None = None
    """The unembedding is the input embedding (``None``: the stage cannot tell)."""
    unembed_bias: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    norm: FinalNorm | None = None
    norm_error: str | None = None
    """Why the final norm cannot be described (then ``norm`` is ``None``)."""


WorkerStats = dict[str, int]
"""A worker's counters (``interp_stats``): live requests and SAEs held (leak checks), where its
time goes, and vLLM's and Dynamo's compilation counters (open-ended: a mapping, by name)."""


def pack_residuals(residuals: torch.Tensor) -> bytes:
    """Residuals ``[n, d_model]`` for ``interp_decode``."""
    return pack({"residuals": residuals})


def unpack_residuals(data: bytes) -> torch.Tensor:
    return unpack(data)["residuals"]


def pack_logits(logits: torch.Tensor | None) -> bytes:
    """``interp_decode``'s answer (empty from a stage that holds no unembedding)."""
    return pack({} if logits is None else {"logits": logits})


def unpack_logits(data: bytes) -> torch.Tensor | None:
    return unpack(data).get("logits")


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
    ``issuer`` is the front end's secret, told to the workers at its ping: a worker serves only
    payloads whose issuer it was told (a client that puts an entry under :data:`PAYLOAD_KEY`
    through vLLM's own request fields, ``vllm_xargs`` or a raw ``SamplingParams``, is served as a
    plain request);
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
    buffers: Mapping[Address, Region] = field(default_factory=dict)
    """Per captured address, the slab region the workers write its values into (:mod:`._transport`);
    an address without one is returned through the fetch RPC."""
    issuer: str = ""

    def encode(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.rid,
            "issuer": self.issuer,
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
        if self.buffers:
            data["buffers"] = {str(a): to_wire(r) for a, r in self.buffers.items()}
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
            buffers={Address.parse(a): from_wire(Region, r) for a, r in (data.get("buffers") or {}).items()},
            issuer=str(data.get("issuer", "")),
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
        data = _entry(params)
        return bool(data and (data.get("points") or data.get("readouts") or data.get("lens")))

    @staticmethod
    def rid_of(params: Any, issuers: Container[str]) -> str | None:
        """The id of the payload a request carries if one of ``issuers`` issued it, else ``None``
        (cheap: the workers ask this of every request in every step). Whatever else a client put
        under :data:`PAYLOAD_KEY` is not a payload: the request is served plainly, and the first
        such request is logged."""
        data = _entry(params)
        if data is None:
            return None
        issuer, rid = data.get("issuer"), data.get("id")
        if type(issuer) is str and issuer in issuers and type(rid) is str:
            return rid
        if not _FOREIGN:
            _FOREIGN.append(True)
            logger.warning(
                "interp-engine: a request carried an entry under SamplingParams.extra_args[%r] that no "
                "front end of this engine issued; it is served as a plain request (no taps)",
                PAYLOAD_KEY,
            )
        return None


_FOREIGN: list[bool] = []
"""Whether this process has logged a request carrying a payload it does not trust."""


def _entry(params: Any) -> dict[str, Any] | None:
    """The entry under :data:`PAYLOAD_KEY` in a request's ``extra_args``, if it is a dict."""
    extra = getattr(params, "extra_args", None)
    if type(extra) is not dict:
        return None
    data = extra.get(PAYLOAD_KEY)
    if data is None:
        return None
    return data if type(data) is dict else {}


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


class LensWire(msgspec.Struct, frozen=True):
    """A lens chunk as plain data: positions as ints, ids (int16 or int32) and float32
    probabilities as little-endian bytes (sent every step of a stream: no per-tensor header)."""

    positions: list[int]
    shape: list[int]
    """``[n_layers, k]``."""
    wide: bool
    """The ids are int32 (else int16)."""
    ids: bytes
    probs: bytes

    @classmethod
    def of(cls, lens: LensChunk) -> LensWire:
        positions, ids, probs = lens
        wide = ids.dtype != torch.int16
        return cls(
            positions=positions.tolist(),
            shape=list(ids.shape[1:]),
            wide=wide,
            ids=ids.contiguous().numpy().astype("<i4" if wide else "<i2").tobytes(),
            probs=probs.contiguous().numpy().astype("<f4").tobytes(),
        )

    def tensors(self) -> LensChunk:
        """The chunk (ids widened to int64)."""
        import numpy as np

        positions = torch.tensor(self.positions, dtype=torch.long)
        shape = (len(positions), *(int(n) for n in self.shape))
        ids = np.frombuffer(self.ids, dtype="<i4" if self.wide else "<i2").reshape(shape)
        probs = np.frombuffer(self.probs, dtype="<f4").reshape(shape)
        return positions, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(probs.astype(np.float32))


class FetchedWire(msgspec.Struct, frozen=True):
    """:class:`Fetched` as it crosses ``collective_rpc``: its tensors as safetensors bytes, and
    what was written into the slab as positions covered."""

    error: str | None = None
    values: bytes = b""
    lens: LensWire | None = None
    written: list[Written] = []


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
    written: Mapping[Address, int] = field(default_factory=dict)
    """Per address written into the request's slab region: how many leading positions were
    written (the values are read out of the slab by the front end)."""

    def encode(self) -> FetchedWire:
        """What crosses ``collective_rpc`` (as :func:`to_wire`'s plain data)."""
        tensors: dict[str, torch.Tensor] = {}
        for address, (positions, values) in self.values.items():
            tensors[f"positions/{address}"] = positions.contiguous()
            tensors[f"values/{address}"] = values.contiguous()
        for spec, (positions, readout) in self.readouts.items():
            tensors[f"rpositions/{spec}"] = positions.to(torch.int32).contiguous()
            tensors.update(readout.tensors(f"readout/{spec}"))
        lens = None if self.lens is None else LensWire.of(self.lens)
        written = [Written(str(address), n) for address, n in self.written.items()]
        return FetchedWire(self.error, pack(tensors), lens, written)

    @classmethod
    def decode(cls, wire: FetchedWire) -> Fetched:
        tensors = unpack(wire.values)
        values: dict[Address, tuple[torch.Tensor, torch.Tensor]] = {
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
        lens = None if wire.lens is None else wire.lens.tensors()
        written = {Address.parse(w.address): w.covered for w in wire.written}
        return cls(values, wire.error, readouts, lens, written)

    def raise_error(self) -> None:
        if self.error is not None:
            raise BackendError(self.error)
