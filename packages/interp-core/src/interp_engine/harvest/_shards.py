"""The safetensors output of a harvest, and :class:`HarvestDataset`, which reads it back lazily.

Each shard ``shards/shard_NNNNN.safetensors`` holds a run of whole rows, flat over their tokens:

- ``tokens`` ``[n_tokens]`` int32, the token ids;
- ``doc`` ``[n_tokens]`` int64, each token's document (its index in the corpus);
- ``pos`` ``[n_tokens]`` int32, its position among that document's ids (``-1``: a BOS or
  separator the packing inserted);
- ``row_offsets`` ``[n_rows + 1]`` int64, where each row starts among the shard's tokens;
- one tensor per address (its string form, ``"resid_post.3"``), ``[n_tokens, width]`` in the
  harvest's dtype;
- under each readout (``"features:NAME:topK"``), ``.../ids`` int32 and ``.../values``
  ``[n_tokens, k]``.

The manifest (``harvest.json``) lists the shards with their first row, rows, tokens and the
range of documents they hold, so a row or a document is found without opening other shards.
"""

from __future__ import annotations

import bisect
import json
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import InvalidAddress, InvalidCorpus
from ._manifest import MANIFEST, atomic_write, read_manifest

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHARD_FOLDER = "shards"


def shard_name(index: int) -> str:
    return f"{SHARD_FOLDER}/shard_{index:05d}.safetensors"


SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""The dtypes a shard may hold, by their name in a safetensors header, in the order
``safetensors`` lays tensors out in a file (then by name)."""

Pieces = torch.Tensor | Sequence[torch.Tensor]
"""A tensor, or the pieces that make it, joined along their first axis."""


def safetensors_chunks(tensors: Mapping[str, Pieces]) -> list[bytes | memoryview]:
    """The file ``safetensors.torch.save(tensors)`` gives, byte for byte, as its header and then
    views of the tensors' own memory (each piece of a tensor in turn), so the file is written
    with no copy of the values: the layout, the header's JSON and its padding are the library's
    (``tests/core/test_harvest.py`` compares the two)."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian values
        from safetensors.torch import save

        return [save({key: _one(value) for key, value in tensors.items()})]
    order = list(SAFETENSORS_DTYPES)
    entries = []
    for name, value in tensors.items():
        pieces = [value] if isinstance(value, torch.Tensor) else list(value)
        dtype, rest = pieces[0].dtype, pieces[0].shape[1:]
        if dtype not in SAFETENSORS_DTYPES or any(p.dtype != dtype or p.shape[1:] != rest for p in pieces):
            raise ValueError(f"{name}: its pieces differ in dtype or trailing shape, or a shard holds no {dtype}")
        shape = list(value.shape) if isinstance(value, torch.Tensor) else [sum(p.shape[0] for p in pieces), *rest]
        entries.append((order.index(dtype), name, dtype, shape, [p.contiguous() for p in pieces]))
    entries.sort(key=lambda entry: entry[:2])
    header: dict[str, Any] = {}
    data: list[bytes | memoryview] = []
    offset = 0
    for _, name, dtype, shape, pieces in entries:
        size = sum(p.numel() * p.element_size() for p in pieces)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        data.extend(p.reshape(-1).view(torch.uint8).numpy().data for p in pieces if p.numel())
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *data]


def _one(value: Pieces) -> torch.Tensor:
    return value.contiguous() if isinstance(value, torch.Tensor) else torch.cat(list(value))


def write_shard(folder: Path, index: int, tensors: Mapping[str, Pieces]) -> str:
    """Write one shard atomically (each tensor given whole or as its pieces); returns its path
    relative to ``folder``."""
    name = shard_name(index)
    (folder / SHARD_FOLDER).mkdir(parents=True, exist_ok=True)
    atomic_write(folder / name, safetensors_chunks(tensors))
    return name


@dataclass(frozen=True)
class HarvestRow:
    """One row of a harvest: its ``tokens`` ``[n]``, each token's ``doc`` and ``pos`` in it, and
    ``values`` by address (``[n, width]``) and readout (``(ids, values)`` ``[n, k]``)."""

    tokens: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    values: dict[str, Any]


class HarvestDataset:
    """A harvest's safetensors output, read lazily: ``len(ds)`` rows; ``ds[i]`` one row (a
    :class:`HarvestRow`; only its slice of one shard is read); ``ds.document(d)`` the tokens
    and values of document ``d`` in order (the packing's inserted tokens left out);
    ``ds.address("resid_post.2")`` one address's values, indexable by row, and its shards one
    tensor at a time (``.shards()``); ``ds.manifest`` the manifest (model, addresses, dtype,
    settings, versions)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise InvalidCorpus(f"{self.folder} holds no harvest (no {MANIFEST})", path=self.folder, valid=MANIFEST)
        if "safetensors" not in manifest["settings"]["formats"]:
            raise InvalidCorpus(
                f"the harvest in {self.folder} wrote no safetensors shards "
                f"(formats: {manifest['settings']['formats']})",
                path=self.folder,
                valid="a harvest with formats including 'safetensors'",
            )
        indices = [s["index"] for s in manifest["shards"]]
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            raise InvalidCorpus(
                f"the harvest in {self.folder} stopped with shards missing before its last one (shards "
                f"{', '.join(map(str, missing[:8]))}{', ...' if len(missing) > 8 else ''} of {max(indices) + 1}: "
                "replicas finish shards out of order); rerun the same harvest to finish it",
                path=self.folder,
                valid="a harvest whose shards run from 0 without a gap",
            )
        self.manifest = manifest
        self._shards: list[dict[str, Any]] = manifest["shards"]
        self._starts = [s["first_row"] for s in self._shards]

    @property
    def addresses(self) -> list[str]:
        return list(self.manifest["settings"]["addresses"])

    @property
    def readouts(self) -> list[str]:
        return [r["key"] for r in self.manifest["settings"]["readouts"]]

    @property
    def n_tokens(self) -> int:
        return int(sum(s["tokens"] for s in self._shards))

    def __len__(self) -> int:
        return int(sum(s["rows"] for s in self._shards))

    def __repr__(self) -> str:
        folder = str(self.folder)
        return f"HarvestDataset({folder!r}, rows={len(self)}, tokens={self.n_tokens}, addresses={self.addresses})"

    def _locate(self, row: int) -> tuple[int, int]:
        n = len(self)
        if not isinstance(row, int) or not -n <= row < n:
            raise IndexError(f"row {row!r} is outside this harvest's {n} rows")
        row %= n
        shard = bisect.bisect_right(self._starts, row) - 1
        return shard, row - self._starts[shard]

    def _open(self, shard: int) -> Any:
        from safetensors import safe_open

        return safe_open(str(self.folder / self._shards[shard]["file"]), framework="pt")

    def __getitem__(self, row: int) -> HarvestRow:
        shard, local = self._locate(row)
        with self._open(shard) as handle:
            offsets = handle.get_slice("row_offsets")[local : local + 2].tolist()
            lo, hi = int(offsets[0]), int(offsets[1])
            values: dict[str, Any] = {a: handle.get_slice(a)[lo:hi] for a in self.addresses}
            for key in self.readouts:
                values[key] = (handle.get_slice(f"{key}/ids")[lo:hi], handle.get_slice(f"{key}/values")[lo:hi])
            return HarvestRow(
                handle.get_slice("tokens")[lo:hi],
                handle.get_slice("doc")[lo:hi],
                handle.get_slice("pos")[lo:hi],
                values,
            )

    def __iter__(self) -> Iterator[HarvestRow]:
        for row in range(len(self)):
            yield self[row]

    def document(self, doc: int) -> HarvestRow:
        """Document ``doc``'s tokens and values in its own order, gathered from every row that
        holds a part of it (``IndexError`` where no row does: a document the packing skipped or
        dropped)."""
        parts: list[tuple[torch.Tensor, HarvestRow]] = []
        for index, shard in enumerate(self._shards):
            if not shard["first_doc"] <= doc <= shard["last_doc"]:
                continue
            with self._open(index) as handle:
                docs = handle.get_tensor("doc")
                where = ((docs == doc) & (handle.get_tensor("pos") >= 0)).nonzero().reshape(-1)
                if where.numel() == 0:
                    continue
                values: dict[str, Any] = {a: handle.get_tensor(a)[where] for a in self.addresses}
                for key in self.readouts:
                    values[key] = (handle.get_tensor(f"{key}/ids")[where], handle.get_tensor(f"{key}/values")[where])
                pos = handle.get_tensor("pos")[where]
                parts.append((pos, HarvestRow(handle.get_tensor("tokens")[where], docs[where], pos, values)))
        if not parts:
            raise IndexError(f"no row of this harvest holds document {doc}")
        pos = torch.cat([p for p, _ in parts])
        order = torch.argsort(pos)

        def joined(items: list[Any]) -> Any:
            if isinstance(items[0], tuple):
                return tuple(torch.cat([i[k] for i in items])[order] for k in range(len(items[0])))
            return torch.cat(items)[order]

        rows = [r for _, r in parts]
        return HarvestRow(
            joined([r.tokens for r in rows]),
            joined([r.doc for r in rows]),
            pos[order],
            {key: joined([r.values[key] for r in rows]) for key in rows[0].values},
        )

    def address(self, address: Any) -> AddressView:
        """One address's values (its string form or an :class:`Address`)."""
        key = str(address)
        if key not in self.addresses:
            raise InvalidAddress(
                f"this harvest holds no {key}; it holds {', '.join(self.addresses)}", address=key, valid=self.addresses
            )
        return AddressView(self, key)


class AddressView:
    """One address of a :class:`HarvestDataset`: ``view[i]`` row ``i``'s values ``[n, width]``;
    ``view.shards()`` each shard's values ``[n_tokens, width]`` in row order (one in memory at a time)."""

    def __init__(self, dataset: HarvestDataset, key: str) -> None:
        self.dataset = dataset
        self.key = key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, row: int) -> torch.Tensor:
        shard, local = self.dataset._locate(row)
        with self.dataset._open(shard) as handle:
            lo, hi = (int(x) for x in handle.get_slice("row_offsets")[local : local + 2].tolist())
            value: torch.Tensor = handle.get_slice(self.key)[lo:hi]
            return value

    def shards(self) -> Iterator[torch.Tensor]:
        for index in range(len(self.dataset._shards)):
            with self.dataset._open(index) as handle:
                yield handle.get_tensor(self.key)


def open_harvest(folder: str | Path) -> HarvestDataset:
    """The safetensors output of the harvest in ``folder`` as a lazy :class:`HarvestDataset`."""
    return HarvestDataset(folder)
