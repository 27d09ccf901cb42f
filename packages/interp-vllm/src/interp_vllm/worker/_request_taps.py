"""A request's state in a worker: its taps over its whole life, and its rows in one step.

:class:`RequestTaps` is built once per request from its :class:`~.._wire.RequestPayload` (writes
resolved over the whole sequence, SAEs by the names the request uses); each step it is cut to a
:class:`Slice` (its rows of the flattened batch), and each hook gathers the slices that read or
write its addresses in a :class:`Hook`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from interp_engine import Address, BackendError, FeatureReadout, Features, FeatureWrite, Sae, UnknownSae, Write
from interp_engine.backend import write_positions

from .._transport import Region
from .._wire import LensChunk, RequestPayload
from ..model._sites import SITES, VllmSite

LocalWrite = tuple[Write, torch.Tensor, torch.Tensor | None]
"""This rank's part of a write, with its vector and target on the value's device and dtype."""


@dataclass
class WriteTable:
    """One write, resolved over the request's whole sequence."""

    write: Write | FeatureWrite
    mask: torch.Tensor  # [n_total] bool: positions the write touches
    row: torch.Tensor  # [n_total] long: the (per-position) vector and target row for each touched position
    every: bool = False  # the write touches every position of the sequence
    local: dict[tuple[int, torch.device, torch.dtype], LocalWrite | None] = field(default_factory=dict)


class RequestTaps:
    """One request's points, writes, readouts and captured values, for its whole life in the worker."""

    def __init__(
        self, payload: RequestPayload, saes: dict[str, Sae] | None = None, n_layers: int | None = None
    ) -> None:
        self.payload = payload
        self.rid = payload.rid
        self.points = dict.fromkeys(payload.points)  # in the payload's order; a dict to look up
        self.n_prompt = payload.n_prompt
        self.n_total = payload.n_total
        # the SAEs by the names the request uses, each the one it was checked with (held by
        # reference: a detach or re-attach in the worker does not reach an admitted request)
        self.saes: dict[str, Sae] = {}
        self.readouts_at: dict[Address, list[Features]] = defaultdict(list)
        for spec in payload.readouts:
            self.saes[spec.sae] = held_sae(saes, spec.sae, payload.sae_keys)
            self.readouts_at[self.saes[spec.sae].address].append(spec)
        # the input addresses of the transcoders whose features the request clamps: their rows are
        # kept each step for the clamps at the output addresses (read at the input, written at the output)
        self.sources: dict[str, Address] = {}
        for write in payload.writes:
            if isinstance(write, FeatureWrite):
                sae = self.saes[write.sae] = held_sae(saes, write.sae, payload.sae_keys)
                if sae.is_transcoder and write.op != "add":
                    self.sources[write.sae] = source_address(sae, n_layers)
        # the logit lens: per lens layer's resid_post, the rows of the positions it reads (every
        # position from the prompt's last on, and the prompt positions asked) are decoded after
        # the forward; only their top-k ids and probabilities are kept
        self.lens_at = {Address("resid_post", layer): i for i, layer in enumerate(payload.lens_layers)}
        self.lens_k = payload.lens_top_k
        self.lens_prompt = torch.tensor(sorted(payload.lens_positions), dtype=torch.long)
        self.lens_values: list[LensChunk] = []
        # the front end fetches (or releases) what a request captured or read; the others are
        # forgotten when vLLM finishes them
        self.awaits_fetch = bool(payload.points or payload.readouts or payload.lens_layers)
        self.readout_values: dict[Features, list[tuple[torch.Tensor, FeatureReadout]]] = defaultdict(list)
        self.first_readout = payload.n_prompt - 1 if payload.stream else 0
        self.writes: dict[Address, list[WriteTable]] = defaultdict(list)
        for write in payload.writes:
            positions = write_positions(write, self.n_prompt, self.n_total)
            mask = torch.zeros(self.n_total, dtype=torch.bool)
            row = torch.zeros(self.n_total, dtype=torch.long)
            index = torch.tensor([p for p in positions if p < self.n_total], dtype=torch.long)
            mask[index] = True
            row[index] = torch.arange(len(index))
            if write.address is None:  # the front end binds feature writes
                raise BackendError(f"an unbound feature write reached the worker: {write!r}")
            self.writes[write.address].append(WriteTable(write, mask, row, every=bool(mask.all())))
        # captured values: written into the request's regions of the front end's slab as the
        # steps run (spans: the positions written, per address), or kept here as chunks (no
        # region: the RPC transport, attention patterns, routing)
        self.regions: dict[Address, Region] = dict(payload.buffers)
        self.spans: dict[Address, list[tuple[int, int]]] = defaultdict(list)
        self.values: dict[Address, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.first_rows = {address: region.first_row for address, region in self.regions.items()}
        self.keys: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> (positions, keys, step)
        self.steps = 0
        # what the request does at each of its addresses, looked up once per hook and step
        kept = set(self.sources.values())
        self.roles = {
            address: Role(
                tuple(self.writes.get(address, ())),
                address in self.points,
                address in self.readouts_at,
                self.lens_at.get(address),
                address in kept,
            )
            for address in dict.fromkeys([*self.points, *self.writes, *self.readouts_at, *self.lens_at, *kept])
        }

    def addresses(self) -> Iterable[Address]:
        """Every address the request reads or writes (its lens layers included)."""
        return self.roles.keys()

    def lens_keep(self, positions: torch.Tensor) -> torch.Tensor:
        """Which of ``positions`` the lens reads."""
        keep = positions >= self.n_prompt - 1
        if len(self.lens_prompt):
            keep |= torch.isin(positions, self.lens_prompt)
        return keep


@dataclass(frozen=True, slots=True)
class Role:
    """What one request does at one address: its writes there (in order), whether it captures the
    value, reads SAE features from it, which lens layer it is (``None``: none), and whether its
    rows are kept for the step (a clamped transcoder's input)."""

    writes: tuple[WriteTable, ...]
    captures: bool
    reads: bool
    lens: int | None
    keeps: bool = False


def source_address(sae: Sae, n_layers: int | None) -> Address:
    """Where transcoder ``sae`` reads its features (its input address, a negative layer counted
    from the end of a model of ``n_layers``)."""
    address = sae.address
    if address.layer is not None and address.layer < 0:
        if n_layers is None:
            raise BackendError(f"{sae!r} reads {address}: the worker needs the model's layer count to place it")
        address = address.resolve(n_layers)
    return address


def held_sae(saes: dict[str, Sae] | None, name: str, keys: Mapping[str, str] | None = None) -> Sae:
    """The SAE this worker holds for ``name``: under the request's key for it, or under the name
    (the front end sends it before any request names it)."""
    key = (keys or {}).get(name, name)
    if saes is None or key not in saes:
        raise UnknownSae(
            f"this vLLM worker holds no SAE named {name!r} (key {key!r})", name=name, valid=list(saes or ())
        )
    return saes[key]


@dataclass(eq=False)  # compared by identity
class Slice:
    """A request's rows in this step's flattened batch."""

    taps: RequestTaps
    start: int
    end: int
    positions: torch.Tensor  # [end - start] absolute positions, on the CPU
    span: tuple[int, int] | None = None  # the positions as one run [first, last + 1), when they are one
    stash: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: dict[Address, torch.Tensor] = field(default_factory=dict)  # kept rows (transcoder inputs), this step
    lens_keep: torch.Tensor | None = None  # [end - start] bool: rows the lens reads this step
    lens_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # lens layer index -> its kept rows


@dataclass
class Hook:
    """Everything one hook does this step: per address, the requests that read or write it."""

    members: dict[Address, list[Slice]] = field(default_factory=lambda: defaultdict(list))
    stash_for: list[Slice] = field(default_factory=list)  # resid_mid needs this layer's resid_pre
    _seen: set[tuple[Address, int]] = field(default_factory=set)

    def writes(self) -> bool:
        """Whether any member writes at any of the hook's addresses."""
        return any(address in sl.taps.writes for address, members in self.members.items() for sl in members)

    def add(self, address: Address, sl: Slice) -> None:
        key = (address, id(sl))
        if key not in self._seen:
            self._seen.add(key)
            self.members[address].append(sl)

    def ordered(self) -> list[tuple[Address, VllmSite, list[Slice]]]:
        """The hook's addresses in the order their values are computed (the site table's)."""
        return [
            (address, SITES[address.kind], members)
            for address, members in sorted(self.members.items(), key=lambda kv: _ORDER[kv[0].kind])
        ]


_ORDER = {kind: i for i, kind in enumerate(SITES)}


def merged_readouts(taps: RequestTaps) -> dict[Features, tuple[torch.Tensor, FeatureReadout]]:
    """Each readout's chunks in position order (a recomputed position keeps its last value)."""
    out = {}
    for spec, chunks in taps.readout_values.items():
        positions = torch.cat([p for p, _ in chunks])
        parts = [r for _, r in chunks]
        values = torch.cat([r.values for r in parts])
        ids = None if parts[0].ids is None else torch.cat([r.ids for r in parts if r.ids is not None])
        errors = [r.error_norm for r in parts if r.error_norm is not None]
        error = torch.cat(errors) if len(errors) == len(parts) else None
        order = torch.argsort(positions, stable=True)
        positions = positions[order]
        last = torch.ones_like(positions, dtype=torch.bool)
        last[:-1] = positions[1:] != positions[:-1]
        keep = order[last]
        out[spec] = (
            positions[last],
            FeatureReadout(values[keep], None if ids is None else ids[keep], None if error is None else error[keep]),
        )
    return out


def touches_run(sl: Slice, table: WriteTable) -> bool:
    """Whether ``table``'s write touches every row of ``sl``, whose positions are one run inside
    the request's sequence (its rows are then a slice of the batch, no index needed)."""
    return table.every and sl.span is not None and sl.span[1] <= sl.taps.n_total


def touched_rows(sl: Slice, table: WriteTable) -> torch.Tensor | None:
    """The rows of ``sl`` (within the step's batch) that ``table``'s write touches, or ``None``."""
    positions = sl.positions
    inside = positions < sl.taps.n_total
    picked = inside.clone()
    picked[inside] = table.mask[positions[inside]]
    if not bool(picked.any()):
        return None
    return torch.nonzero(picked).flatten()
