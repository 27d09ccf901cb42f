"""What a harvest runs on a model: the plan (the addresses and readouts, their widths and hook
names), and one shard's work (its rows run through the model, written in every format, its own
top contexts). The driver (:mod:`._run`) calls it in its own process, or Ray replicas
(:mod:`._replicas`) call it in theirs, each with a model of its own.
"""

from __future__ import annotations

import errno
import math
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._api import model_points
from .._errors import InsufficientDiskSpace, InvalidAddress, InvalidFeatures, InvalidOption
from .._sync import SyncModel
from ..addresses._address import Address
from ..protocol._base import ModelBase
from ..sae._readouts import Features, stack_readouts
from ._pack import Row
from ._saelens import write_saelens_shard
from ._shards import DTYPES, shard_name, write_shard
from ._top import TopContexts


@dataclass
class Plan:
    """What each token of a harvest gets: the ``addresses`` (their flattened ``widths`` and
    TransformerLens ``hooks``), the SAE ``readouts`` (their SAEs' ``sae_widths``), the dtype."""

    addresses: list[Address]
    readouts: list[Features]
    widths: dict[Address, int]
    sae_widths: dict[str, int]
    hooks: dict[Address, str]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ShardJob:
    """One shard to harvest: its ``index``, its ``rows`` (the ``first_row``-th row of the
    harvest onwards), how to write it, and the top contexts to keep (``top_n`` per feature,
    ``window`` tokens either side; 0: none)."""

    folder: Path
    index: int
    rows: list[Row]
    first_row: int
    plan: Plan
    formats: tuple[str, ...]
    context_size: int
    batch_rows: int
    top_n: int
    window: int


def make_plan(facade: SyncModel, addresses: Iterable[Any], saes: Any, top_k: int, dtype: str) -> Plan:
    """The plan of a harvest on ``facade``'s model: addresses resolved and probed for their
    widths, SAEs attached (``{name: Sae or folder}``) or found attached (names)."""
    model = facade.model
    listed = [addresses] if isinstance(addresses, (str, Address)) else list(addresses)
    points = [p for p in model_points(model, listed) if isinstance(p, Address)] if listed else []
    for address in points:
        if address.info.width == "heads x keys":
            raise InvalidAddress(
                f"{address} is [heads, q, k] per prompt, not a value per token; a harvest writes per-token values "
                "(residual, MLP, attention outputs, heads)",
                address=address,
                valid="per-token kinds",
            )
    widths: dict[Address, int] = {}
    hooks: dict[Address, str] = {}
    if points:
        probe = facade.capture([0, 0], points)
        for address in points:
            value = probe[address]
            widths[address] = int(math.prod(value.shape[1:]))
            hooks[address] = address.tl_name or str(address)
    readouts: list[Features] = []
    sae_widths: dict[str, int] = {}
    named = saes.items() if isinstance(saes, Mapping) else [(name, None) for name in saes]
    for name, sae in named:
        if not isinstance(model, ModelBase):
            raise InvalidFeatures(f"the {model.backend} backend attaches no SAE, so it has no readouts to harvest")
        attached = model.saes
        if sae is not None and name not in attached:
            loaded = model.attach_sae(name, sae)
        elif name in attached:
            loaded = attached[name]
        else:
            raise InvalidFeatures(
                f"no SAE is attached as {name!r}: pass saes={{{name!r}: folder_or_Sae}} to attach one",
            )
        readouts.append(Features(name, top_k=min(top_k, loaded.d_sae)))
        sae_widths[name] = loaded.d_sae
    if not points and not readouts:
        raise InvalidOption("a harvest writes addresses= or saes= (readouts): name at least one")
    return Plan(points, readouts, widths, sae_widths, hooks, dtype)


def readout_key(readout: Features) -> str:
    return f"features:{readout.sae}:top{readout.top_k}"


def run_job(facade: SyncModel, job: ShardJob, *, replica: int = 0) -> dict[str, Any]:
    """Harvest one shard: run its rows, write it in every format (atomically), and return its
    manifest entry (``replica`` and ``node`` name who wrote it) with ``"top"``, its own top
    contexts' state by SAE (merged by the driver in shard order)."""
    tops = {r.sae: TopContexts(job.plan.sae_widths[r.sae], job.top_n, job.window) for r in job.plan.readouts}
    if not job.top_n:
        tops = {}
    parts = _run_rows(facade, job, tops)
    _write(job, parts)
    rows = job.rows
    return {
        "index": job.index,
        "file": shard_name(job.index) if "safetensors" in job.formats else None,
        "first_row": job.first_row,
        "rows": len(rows),
        "tokens": sum(len(r.tokens) for r in rows),
        "first_doc": min(min(r.doc) for r in rows),
        "last_doc": max(max(r.doc) for r in rows),
        "replica": replica,
        "node": socket.gethostname(),
        "top": {sae: top.state() for sae, top in tops.items()},
    }


def _run_rows(facade: SyncModel, job: ShardJob, tops: Mapping[str, TopContexts]) -> dict[str, list[torch.Tensor]]:
    """The shard's values, as the pieces that make each tensor of the shard, in row order: each
    address ``[n, width]`` per row in the harvest's dtype, each readout's ``ids`` and ``values``
    ``[n, k]`` per row. The pieces are the rows the model handed back (:func:`rows_with_cache`:
    on the vllm backends, the shared memory the workers wrote), converted only where the
    harvest's dtype differs: the safetensors shard is written from them, and SAELens's Arrow
    shard from their concatenation."""
    from .._api import rows_with_cache

    plan, rows = job.plan, job.rows
    parts: dict[str, list[torch.Tensor]] = {}
    points: list[Any] = [*plan.addresses, *plan.readouts]
    torch_dtype = plan.torch_dtype
    for start in range(0, len(rows), job.batch_rows):
        batch = rows[start : start + job.batch_rows]
        captured = rows_with_cache(facade, [r.tokens for r in batch], points)
        for address in plan.addresses:
            parts.setdefault(str(address), []).extend(
                row[address].reshape(row[address].shape[0], -1).to(torch_dtype) for row in captured
            )
        for readout in plan.readouts:
            key = readout_key(readout)
            read = [row[readout] for row in captured]
            parts.setdefault(f"{key}/ids", []).extend(
                (r.ids if r.ids is not None else torch.empty(0)).to(torch.int32) for r in read
            )
            parts.setdefault(f"{key}/values", []).extend(r.values.to(torch_dtype) for r in read)
            if readout.sae in tops:
                lengths = [len(r.tokens) for r in batch]
                stacked = stack_readouts(read, lengths)
                tokens = torch.full((len(batch), max(lengths)), -1, dtype=torch.int64)
                for i, r in enumerate(batch):
                    tokens[i, : len(r.tokens)] = torch.tensor(r.tokens)
                ids = stacked.ids if stacked.ids is not None else torch.empty(0)
                tops[readout.sae].update(ids, stacked.values, tokens, job.first_row + start)
    return parts


def _joined(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))


def _write(job: ShardJob, parts: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """Write one shard in every format; a full disk raises ``InsufficientDiskSpace`` with the
    partial file removed (the shards before it, and the manifest, are untouched)."""
    folder, rows, plan = job.folder, job.rows, job.plan
    try:
        if "safetensors" in job.formats:
            lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            layout = {
                "tokens": torch.tensor([t for r in rows for t in r.tokens], dtype=torch.int32),
                "doc": torch.tensor([d for r in rows for d in r.doc], dtype=torch.int64),
                "pos": torch.tensor([p for r in rows for p in r.pos], dtype=torch.int32),
                "row_offsets": offsets,
            }
            write_shard(folder, job.index, {**layout, **parts})
        if "saelens" in job.formats:
            columns = {
                plan.hooks[a]: _joined(parts[str(a)]).reshape(len(rows), job.context_size, -1).numpy()
                for a in plan.addresses
            }
            token_ids = torch.tensor([r.tokens for r in rows], dtype=torch.int32).numpy()
            write_saelens_shard(folder, job.index, columns, token_ids, plan.dtype)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(folder).free
        raise InsufficientDiskSpace(
            f"the disk under {folder} filled while writing shard {job.index} ({exc.strerror}); the shards before it "
            "are whole and listed in harvest.json: free space and rerun the same harvest to resume",
            needed=sum(p.numel() * p.element_size() for pieces in parts.values() for p in pieces),
            free=free,
        ) from exc


def token_bytes(plan: Plan, formats: Sequence[str]) -> int:
    """Bytes written per token in ``formats``."""
    size = torch.empty((), dtype=plan.torch_dtype).element_size()
    values = sum(plan.widths.values()) * size
    readouts = sum(8 * (r.top_k or 0) for r in plan.readouts)
    out = 0
    if "safetensors" in formats:
        out += values + readouts + 16
    if "saelens" in formats:
        out += values + 4
    return max(out, 1)
