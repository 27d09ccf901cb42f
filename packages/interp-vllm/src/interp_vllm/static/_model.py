"""The vllm-static backend's model: a fixed tap set, compiled into vLLM's graphs.

Everything a request can read or write is declared before the engine exists (``static_points``,
``static_writes``, or later ``configure_static``); the declaration travels to the workers in
vLLM's ``additional_config`` (so it is part of vLLM's compile-cache key) and the workers install
tensor-only taps before vLLM compiles the model. Requests then go through the same front end as
the ``vllm`` backend, checked against the declared set.

Steering uses slot tables in the workers; a request holds its slots from submission until its
values are fetched or released, and waits here (not in vLLM) while the tables are full.

SAEs attached before the engine is built are compiled in: each is saved to a folder this model
owns (removed at shutdown) and named in the static config; the workers load them before
compiling and encode every token in-graph (:class:`~._saes.StaticSae`). Readouts are served
from what the graph keeps (the top ``static_sae_top_k`` features per token, every feature of a
dictionary no wider than ``static_sae_dense_max``); feature clamps are per-token tables filled
by the workers (no slots to reserve). Attaching or detaching after the build is a
``StaticConfigError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import pathlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from interp_engine import (
    Address,
    CheckedRequest,
    FeatureReadout,
    Features,
    FeatureWrite,
    InvalidAdapter,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    Sae,
    StaticConfigError,
    UndeclaredAddress,
    UnknownSae,
    UnsupportedAddress,
    Write,
)
from interp_engine.backend import Adapter, heads_of, requested_points, write_positions

from .._transport import Region
from .._wire import (
    CONFIG_KEY,
    DEFAULT_SAE_DENSE_MAX,
    DEFAULT_SAE_TOP_K,
    DEFAULT_SLOTS,
    LensChunk,
    Ping,
    RequestPayload,
    SavedSae,
    StaticDeclaration,
    to_wire,
)
from ..frontend._engine_config import ENGINE_DEFAULTS
from ..frontend._model import VllmModel
from ..model._sites import POINT_KINDS as STATIC_POINT_KINDS
from ..model._sites import SITES, STATIC_WRITE_KINDS
from ..sae._math import SaeLayout
from ._taps import plan_writes


def _count_option(options: dict[str, Any], name: str, default: int, least: int) -> int:
    value = options.pop(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidOption(f"{name} must be an int >= {least}, got {value!r}")
    return value


_NO_ADAPTERS = (
    "the vllm-static backend serves no LoRA adapters: its taps live in vLLM's compiled graph, which "
    "vLLM's CPU build turns off under a LoRA config and which has not been built with vLLM's LoRA "
    "layers inside; serve adapters with backend='vllm' (enable_lora=True), each request under its own"
)


class StaticVllmModel(VllmModel):
    """A vLLM model whose capture and write points are fixed before its engine is built.

    ``static_points="auto"`` (the default) leaves the points to :meth:`configure_static`; an
    engine built without it declares every layer's ``resid_post`` and no writes.
    """

    backend = "vllm-static"
    # the point of this backend: vLLM's compiled path
    engine_defaults: ClassVar[dict[str, Any]] = {**ENGINE_DEFAULTS, "enforce_eager": False}

    def __init__(self, name_or_path: str, options: dict[str, Any]) -> None:
        options = dict(options)
        points = options.pop("static_points", "auto")
        writes = options.pop("static_writes", None)
        slots = _count_option(options, "static_write_slots", DEFAULT_SLOTS, 1)
        sae_top_k = _count_option(options, "static_sae_top_k", DEFAULT_SAE_TOP_K, 1)
        sae_dense_max = _count_option(options, "static_sae_dense_max", DEFAULT_SAE_DENSE_MAX, 0)
        if options.get("enable_lora"):
            raise InvalidOption(_NO_ADAPTERS)
        super().__init__(name_or_path, options)
        self.static_write_slots = slots
        self.static_sae_top_k = sae_top_k
        self.static_sae_dense_max = sae_dense_max
        self._compiled_saes: dict[str, Sae] = {}  # what the engine was built with
        self._sae_folder: str | None = None  # where they were saved for the workers (ours)
        self._points: list[Address] | None = None
        self._writes: list[Address] = []
        self._frozen = False
        self._slots_used: dict[Address, int] = {}  # per write address: slots held by requests in flight
        self._slots_free: asyncio.Condition | None = None
        self._held: dict[str, Mapping[Address, int]] = {}
        self.declare_how = "static_points=/static_writes= or configure_static before the engine is built"
        """How this model's taps are declared, as a refusal of an undeclared one says (a ``vllm
        serve`` names its ``--additional-config``)."""
        if writes is not None:
            self._writes = self._declare_writes(writes)
        if points != "auto":
            self.configure_static(points, static_writes=writes)

    def __repr__(self) -> str:
        return super().__repr__().replace("<VllmModel", "<StaticVllmModel", 1)

    # -- the declaration -----------------------------------------------------------------------
    def configure_static(self, points: Iterable[Any] | str, static_writes: Iterable[Any] | None = None) -> None:
        """Declare the capture points (and, if given, the write points) of the engine to build.

        Call it before ``warmup()`` or the first request; afterwards the compiled graph holds the
        old set and this raises ``StaticConfigError``."""
        if self._frozen or self._building is not None or self._engine is not None:
            raise StaticConfigError(
                "configure_static must run before the engine is built (before warmup() or the first "
                f"request); this engine was compiled with points {self._names(self.static_points)} and "
                f"writes {self._names(self.static_writes)}. Load the model again to change them."
            )
        if isinstance(points, str) and points == "auto":
            raise InvalidOption("configure_static takes the points themselves, not 'auto'")
        if isinstance(points, (list, tuple)) and not points:
            declared: list[Address] = []  # a steering-only engine
        else:
            declared = list(dict.fromkeys(requested_points(points, self.info, STATIC_POINT_KINDS).values()))
            self._check_served(declared)
        writes = self._declare_writes(static_writes) if static_writes is not None else self._writes
        self._points, self._writes = declared, writes

    def _declare_writes(self, writes: Iterable[Any]) -> list[Address]:
        if isinstance(writes, (str, Address)):
            writes = [writes]
        declared = []
        for write in writes:
            address = Address.parse(write) if isinstance(write, str) else write
            if not isinstance(address, Address):
                raise InvalidOption(f"static_writes takes addresses, got {write!r}")
            address = address.resolve(self.info.n_layers)
            self._check_served([address])
            if address.kind not in STATIC_WRITE_KINDS:
                raise UnsupportedAddress(
                    f"vllm-static cannot write at {address}; writable kinds: {', '.join(STATIC_WRITE_KINDS)}",
                    address=address,
                    valid=STATIC_WRITE_KINDS,
                )
            declared.append(address)
        return list(dict.fromkeys(declared))

    @property
    def static_points(self) -> list[Address]:
        """The declared capture points (every ``resid_post`` if none were declared)."""
        if self._points is None:
            return [Address("resid_post", layer) for layer in range(self.info.n_layers)]
        return list(self._points)

    @property
    def static_writes(self) -> list[Address]:
        """The declared write points."""
        return list(self._writes)

    @staticmethod
    def _names(addresses: Sequence[Address]) -> str:
        return "[" + ", ".join(str(a) for a in addresses) + "]" if addresses else "[] (none)"

    def _engine_args(self) -> dict[str, Any]:
        self._frozen = True
        args = super()._engine_args()
        extra = args.get("additional_config") or {}
        if not isinstance(extra, dict):
            raise InvalidOption("vllm-static needs additional_config to be a dict (it adds its tap set there)")
        declared = StaticDeclaration(
            points=tuple(str(a) for a in self.static_points),
            writes=tuple(str(a) for a in self.static_writes),
            slots=self.static_write_slots + 1,  # slot 0 is the identity
            saes=self._save_saes() if self.saes else {},
            sae_top_k=self.static_sae_top_k,
            sae_dense_max=self.static_sae_dense_max,
        )
        return {**args, "additional_config": {**extra, CONFIG_KEY: to_wire(declared)}}

    def _save_saes(self) -> dict[str, SavedSae]:
        """Write each attached SAE into a folder of ours for the workers to load; the config names
        the folder and a digest of the SAE (the compile hash covers what the graph holds)."""
        if self._sae_folder is None:
            self._sae_folder = tempfile.mkdtemp(prefix="interp-engine-static-saes-")
        entries = {}
        for index, (name, sae) in enumerate(self.saes.items()):
            folder = pathlib.Path(self._sae_folder) / str(index)
            if folder.exists():
                shutil.rmtree(folder)
            sae.save(folder)
            digest = hashlib.sha256(sae.to_bytes()).hexdigest()[:32]
            entries[name] = SavedSae(path=str(folder), digest=digest)
        self._compiled_saes = dict(self.saes)
        return entries

    def _close_resources(self) -> None:
        try:
            super()._close_resources()
        finally:
            if self._sae_folder is not None:
                shutil.rmtree(self._sae_folder, ignore_errors=True)
                self._sae_folder = None

    # -- SAEs: compiled in when the engine is built -----------------------------------------------
    def _built(self) -> bool:
        return self._frozen or self._building is not None or self._engine is not None

    def _attach(self, name: str, sae: Sae) -> None:
        if self._built():
            raise StaticConfigError(
                f"cannot attach SAE {name!r}: this vllm-static engine is already built, and its SAEs are "
                f"compiled into its graph ({', '.join(sorted(self._compiled_saes)) or 'none'}). Attach SAEs "
                "before warmup() or the first request (or load_model(..., saes={...})), or use the vllm backend."
            )
        site = SITES.get(sae.address.kind)
        if site is not None and site.where == "model_out":
            raise InvalidFeatures(
                f"SAE {name!r} reads {sae.address}, which vllm-static reads after the compiled graph; it encodes "
                "SAEs inside the graph, at the layers' hooks: use the vllm backend for an SAE there"
            )
        tp = self.engine_kwargs.get("tensor_parallel_size") or 1
        if isinstance(tp, int) and tp > 1 and site is not None and site.shard is not None:
            raise InvalidFeatures(
                f"SAE {name!r} reads {sae.address}, which tensor parallelism splits across ranks "
                f"(tensor_parallel_size={tp}); SAEs are served at whole-row addresses under TP"
            )

    def _detach(self, name: str) -> None:
        if self._built():
            raise StaticConfigError(
                f"cannot detach SAE {name!r}: it is compiled into this vllm-static engine's graph; load the "
                "model again to change its SAEs"
            )

    async def _sync_saes(self, engine: Any, request: CheckedRequest) -> None:
        """The workers loaded the compiled-in SAEs at build: nothing is sent, only checked."""
        for name, sae in request.saes.items():
            if self._compiled_saes.get(name) is not sae:
                raise UnknownSae(
                    f"SAE {name!r} is not compiled into this vllm-static engine; compiled in: "
                    f"{', '.join(sorted(self._compiled_saes)) or 'none'} (attach SAEs before the engine is built)",
                    name=name,
                    valid=sorted(self._compiled_saes),
                )

    def _check_features(self, request: CheckedRequest) -> None:
        """What the compiled graph can serve of the request's readouts and feature clamps."""
        n = self.info.n_layers
        for spec in request.readouts:
            sae = request.saes[spec.sae]
            why = SaeLayout.of(sae, self.static_sae_top_k, self.static_sae_dense_max).refusal(spec, sae.d_sae)
            if why is not None:
                raise InvalidFeatures(why)
        clamps = [w for w in request.writes if isinstance(w, FeatureWrite)]
        if not clamps:
            return
        n_prompt = len(request.token_ids)
        n_total = n_prompt + request.max_tokens + 1
        taken: dict[Address, set[int]] = {}
        for write in clamps:
            if write.address is None:  # bound by the core's checks
                raise InvalidSteering(f"the feature write on {write.sae!r} is not bound to an address")
            site = SITES[write.address.kind]
            if not site.static_write or site.shard is not None:
                raise InvalidSteering(
                    f"vllm-static cannot clamp features at {write.address} in its compiled graph; use the vllm backend"
                )
            positions = set(write_positions(write, n_prompt, n_total))
            seen = taken.setdefault(write.address, set())
            if seen & positions:
                raise InvalidSteering(
                    f"two feature clamps at {write.address} touch the same position; vllm-static applies one "
                    "clamp per token and address in its compiled graph (the vllm and eager backends apply several)"
                )
            seen |= positions
        clamped = set(taken)
        after: set[Address] = set()
        for item in request.writes:
            if isinstance(item, FeatureWrite):
                after.add(item.address)  # type: ignore[arg-type]
            elif item.address in after:
                raise InvalidSteering(
                    f"a plain write at {item.address} comes after a feature clamp there; vllm-static applies "
                    "the plain writes at an address first: put the clamp last, or use the vllm backend"
                )
        for spec in request.readouts:
            address = request.saes[spec.sae].address.resolve(n)
            if address in clamped:
                raise InvalidSteering(
                    f"this request clamps features at {address} and reads {spec} there; vllm-static encodes each "
                    "token once per SAE (before the clamp), so it cannot read the clamped activation's features: "
                    "read them at a later address, or use the vllm backend"
                )

    def _check_workers(self, pings: list[Ping]) -> str | None:
        problem = super()._check_workers(pings)
        if problem is None and not all(p.static for p in pings):
            problem = (
                "the vllm-static taps were not installed before vLLM compiled the model (the "
                "interp-vllm plugin wraps the model runner's load_model; is a different runner in use?)"
            )
        points, writes = [str(a) for a in self.static_points], [str(a) for a in self.static_writes]
        for ping in pings if problem is None else ():
            if list(ping.static_points) != points or list(ping.static_writes) != writes:
                problem = (
                    f"vLLM's workers compiled the taps {list(ping.static_points)} with writes "
                    f"{list(ping.static_writes)}, not this model's {points} with writes {writes}"
                )
        return problem

    async def serve_engine(self, engine: Any) -> None:
        """Serve through a running engine whose workers compiled this model's declaration (a
        ``vllm serve`` that declares its taps in ``--additional-config``; checked against the
        workers' own): the declaration and the SAEs attached now are this model's compiled set,
        fixed from here on."""
        self._frozen = True
        self._compiled_saes = dict(self.saes)
        await super().serve_engine(engine)

    def _load_adapter(self, adapter: Adapter) -> None:
        raise InvalidAdapter(_NO_ADAPTERS, name=adapter.name)

    # -- requests: checked against the declaration ------------------------------------------------
    def _check_request(self, request: CheckedRequest) -> None:
        super()._check_request(request)
        self._check_features(request)
        declared = set(self.static_points)
        for requested, address in request.points.items():
            if address not in declared:
                raise UndeclaredAddress(
                    f"{requested} is not a capture point of this vllm-static engine; declared: "
                    f"{self._names(self.static_points)} (declare points with {self.declare_how})",
                    address=requested,
                    valid=tuple(str(a) for a in self.static_points),
                )
        if request.lens is not None:  # the lens reads the declared resid_post taps
            undeclared = [a for a in request.lens.addresses if a not in declared]
            if undeclared:
                raise UndeclaredAddress(
                    f"the logit lens at layer {undeclared[0].layer} reads {undeclared[0]}, which is not a capture "
                    f"point of this vllm-static engine; declared: {self._names(self.static_points)} (declare the "
                    f"lens layers' resid_post with {self.declare_how})",
                    address=undeclared[0],
                    valid=tuple(str(a) for a in self.static_points),
                )
        self._check_declared_writes(request.writes)

    def _check_writes(self, steering_spec: Any) -> tuple[list[Any], dict[str, Sae]]:
        """The core's checks of a spec, and its plain writes at declared write points (a preset
        of a ``vllm serve`` is checked so when it is set)."""
        writes, used = super()._check_writes(steering_spec)
        self._check_declared_writes(writes)
        return writes, used

    def _check_declared_writes(self, writes: Iterable[Any]) -> None:
        for write in writes:
            if isinstance(write, Write) and write.address not in self._writes:
                raise UndeclaredAddress(
                    f"cannot write at {write.address}: not a write point of this vllm-static engine; "
                    f"declared: {self._names(self.static_writes)} (declare them with {self.declare_how})",
                    address=write.address,
                    valid=tuple(str(a) for a in self.static_writes),
                )

    def _payload(
        self,
        rid: str,
        points: Iterable[Address],
        writes: list[Write | FeatureWrite],
        n_prompt: int,
        n_total: int,
        readouts: Iterable[Features] = (),
        *,
        stream: bool = False,
        regions: Mapping[Address, Region] | None = None,
    ) -> RequestPayload:
        payload = super()._payload(rid, points, writes, n_prompt, n_total, readouts, stream=stream, regions=regions)
        plain = [w for w in writes if isinstance(w, Write)]  # feature clamps need no slots
        if plain:
            plans = plan_writes(plain, n_prompt, n_total, lambda a: heads_of(a, self.info))
            needs = {a: len(plan.ops) for a, plan in plans.items()}
            for address, need in needs.items():
                if need > self.static_write_slots:
                    raise InvalidSteering(
                        f"this spec needs {need} steering slots at {address} (one per distinct "
                        f"vector row), but the engine has {self.static_write_slots}; load it with "
                        "a larger static_write_slots"
                    )
            payload = dataclasses.replace(payload, slots=needs)  # what it holds in the workers' tables
        return payload

    async def _outputs(
        self, engine: Any, ids: list[int], params: Any, rid: str, salt: str | None, adapter: str | None = None
    ) -> AsyncIterator[Any]:
        payload = RequestPayload.of(params)
        if payload is not None and payload.slots:
            await self._reserve(rid, payload.slots)
        async for output in super()._outputs(engine, ids, params, rid, salt, adapter):
            yield output

    async def _reserve(self, rid: str, needs: Mapping[Address, int]) -> None:
        if self._slots_free is None:
            self._slots_free = asyncio.Condition()
        cap = self.static_write_slots

        def fits() -> bool:
            return all(self._slots_used.get(a, 0) + n <= cap for a, n in needs.items())

        async with self._slots_free:
            await self._slots_free.wait_for(fits)
            for address, need in needs.items():
                self._slots_used[address] = self._slots_used.get(address, 0) + need
            self._held[rid] = needs

    async def _unreserve(self, rid: str) -> None:
        needs = self._held.pop(rid, None)
        if not needs or self._slots_free is None:
            return
        async with self._slots_free:
            for address, need in needs.items():
                self._slots_used[address] -= need
            self._slots_free.notify_all()

    async def _fetch(
        self,
        engine: Any,
        rid: str,
        points: Iterable[Address],
        n: int,
        readouts: Iterable[Features] = (),
        regions: Mapping[Address, Region] | None = None,
    ) -> tuple[dict[Address, torch.Tensor], dict[Features, FeatureReadout], LensChunk | None]:
        try:
            return await super()._fetch(engine, rid, points, n, readouts, regions)
        finally:
            await self._unreserve(rid)

    async def _done(self, engine: Any, rid: str) -> None:
        await self._unreserve(rid)  # the workers free its slots before admitting anyone else

    async def _release(self, engine: Any, rid: str) -> None:
        try:
            await super()._release(engine, rid)
        finally:
            await self._unreserve(rid)
