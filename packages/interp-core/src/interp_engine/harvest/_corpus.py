"""Corpus readers: the documents a harvest runs over, one at a time, in a fixed order.

A corpus is what a researcher already has on disk, or a Python list:

========================  ==================================================================
``format``                what it reads
========================  ==================================================================
``"text"``                a ``.txt`` file, or a folder of them (sorted by name): one document
                          per line, as Hugging Face ``datasets``' ``text`` loader reads it
``"jsonl"``               a ``.jsonl`` / ``.json`` file of one JSON object per line
``"parquet"``             a ``.parquet`` file (read a batch of rows at a time)
``"hf"``                  a folder ``datasets.Dataset.save_to_disk`` wrote (a ``DatasetDict``'s
                          ``train`` split)
``"list"``                a Python list of texts, or of token-id lists
========================  ==================================================================

A record's document is its ``text_field`` (default ``"text"``): a string is tokenized; a list
of ints is taken as token ids as they are (pre-tokenized; SAELens's ``tokens`` and
``input_ids`` columns are found when ``text_field`` is absent). Reading is streaming: memory
does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InvalidCorpus

FORMATS = ("text", "jsonl", "parquet", "hf", "list")
"""The corpus formats :func:`open_corpus` reads."""

_SUFFIXES = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
TOKEN_FIELDS = ("tokens", "input_ids")
"""The columns of pre-tokenized ids SAELens reads, tried when ``text_field`` is absent."""

Document = str | list[int]


@dataclass(frozen=True)
class Corpus:
    """Documents to harvest: ``source`` (a path, or the list itself), its ``format`` (one of
    :data:`FORMATS`) and the record field that holds each document."""

    source: Any
    format: str
    text_field: str = "text"

    def documents(self) -> Iterator[Document]:
        """Each document in order: a text, or a list of token ids."""
        if self.format == "list":
            for index, item in enumerate(self.source):
                yield _document(item, f"item {index} of the list", self.source)
        elif self.format == "text":
            for file in _text_files(Path(self.source)):
                with open(file, encoding="utf-8", errors="strict") as handle:
                    try:
                        for line in handle:
                            yield line.rstrip("\n").rstrip("\r")
                    except UnicodeDecodeError as exc:
                        raise InvalidCorpus(
                            f"{file} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                            path=file,
                            valid="UTF-8 text",
                        ) from None
        elif self.format == "jsonl":
            yield from self._jsonl()
        elif self.format == "parquet":
            yield from self._parquet()
        else:
            yield from self._hf()

    def _jsonl(self) -> Iterator[Document]:
        path = Path(self.source)
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidCorpus(
                        f"{path} line {number} is not JSON ({exc.msg}): a JSONL corpus has one JSON object per line",
                        path=path,
                        valid="one JSON object per line",
                    ) from None
                if not isinstance(record, dict):
                    raise InvalidCorpus(f"{path} line {number} is not a JSON object", path=path, valid="JSON objects")
                yield _document(self._field(record, f"{path} line {number}"), f"{path} line {number}", path)

    def _field(self, record: dict[str, Any], where: str) -> Any:
        if self.text_field in record:
            return record[self.text_field]
        for name in TOKEN_FIELDS:
            if name in record:
                return record[name]
        raise InvalidCorpus(
            f"{where} has no field {self.text_field!r} (it has {', '.join(sorted(record)) or 'none'}); "
            f"name the field with text_field= (or give token ids under {' or '.join(TOKEN_FIELDS)})",
            path=self.source,
            valid=sorted(record),
        )

    def _column(self, names: Sequence[str]) -> str:
        if self.text_field in names:
            return self.text_field
        for name in TOKEN_FIELDS:
            if name in names:
                return name
        raise InvalidCorpus(
            f"{self.source} has no column {self.text_field!r} (it has {', '.join(names) or 'none'}); "
            f"name the column with text_field= (or give token ids under {' or '.join(TOKEN_FIELDS)})",
            path=self.source,
            valid=list(names),
        )

    def _parquet(self) -> Iterator[Document]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(self.source)
        except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
            raise InvalidCorpus(
                f"{self.source} is not a Parquet file: {exc}", path=self.source, valid="Parquet"
            ) from None
        column = self._column(parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
            for item in batch.column(0).to_pylist():
                yield _document(item, f"a row of {self.source}", self.source)

    def _hf(self) -> Iterator[Document]:
        import datasets

        try:
            loaded = datasets.load_from_disk(str(self.source))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise InvalidCorpus(
                f"{self.source} is not a folder datasets.save_to_disk wrote: {exc}",
                path=self.source,
                valid="a datasets.save_to_disk folder",
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise InvalidCorpus(
                    f"{self.source} is a DatasetDict without a 'train' split (it has {', '.join(loaded)})",
                    path=self.source,
                    valid=list(loaded),
                )
            loaded = loaded["train"]
        column = self._column(loaded.column_names)
        for start in range(0, len(loaded), 1024):
            for item in loaded[start : start + 1024][column]:
                yield _document(item, f"a row of {self.source}", self.source)

    def identity(self) -> dict[str, Any]:
        """What tells this corpus from another in a harvest's manifest: its format, field, and
        each file's name, size and a hash of its first MiB (a list: a hash of its items)."""
        if self.format == "list":
            digest = hashlib.sha256()
            for item in self.source:  # one document at a time: no copy of the whole list
                digest.update(json.dumps(item).encode() + b"\n")
            return {"format": "list", "items": len(self.source), "sha256": digest.hexdigest()}
        path = Path(self.source)
        files = _text_files(path) if self.format == "text" else _hf_files(path) if self.format == "hf" else [path]
        return {
            "format": self.format,
            "text_field": self.text_field,
            "path": str(path.resolve()),
            "files": [{"name": f.name, "bytes": f.stat().st_size, "head_sha256": _head_hash(f)} for f in files],
        }

    def n_bytes(self) -> int:
        """The corpus's size on disk (a list: its texts' UTF-8 bytes), for the run's estimates."""
        if self.format == "list":
            return sum(len(item.encode()) if isinstance(item, str) else 4 * len(item) for item in self.source)
        path = Path(self.source)
        files = _text_files(path) if self.format == "text" else _hf_files(path) if self.format == "hf" else [path]
        return sum(f.stat().st_size for f in files)


def open_corpus(source: Any, *, format: str | None = None, text_field: str = "text") -> Corpus:
    """The :class:`Corpus` of ``source`` (a path, a :class:`Corpus`, or a list of texts or of
    token-id lists), its format named or read from the path (extension; a folder with
    ``state.json`` is a ``datasets`` folder, else a folder of ``.txt`` files). Raises
    ``InvalidCorpus`` for a path that is missing or of no known format."""
    if isinstance(source, Corpus):
        return source
    if format is not None and format not in FORMATS:
        raise InvalidCorpus(f"unknown corpus format {format!r}", path=source, valid=FORMATS)
    if isinstance(source, (list, tuple)):
        if not source:
            raise InvalidCorpus("the corpus list is empty: give at least one document", path=None, valid="documents")
        return Corpus(list(source), "list", text_field)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidCorpus(
            f"a corpus is a path or a list of documents, got {type(source).__name__}", path=source, valid=FORMATS
        )
    path = Path(source)
    if not path.exists():
        raise InvalidCorpus(f"the corpus {path} does not exist", path=path, valid="an existing file or folder")
    guessed = _guess(path)
    chosen = format or guessed
    if chosen is None:
        raise InvalidCorpus(
            f"cannot tell the format of {path} from its name: pass format= one of {', '.join(FORMATS[:4])} "
            f"(known extensions: {', '.join(sorted(_SUFFIXES))})",
            path=path,
            valid=FORMATS,
        )
    if path.is_dir() and chosen not in ("text", "hf"):
        raise InvalidCorpus(f"{path} is a folder, not a {chosen} file", path=path, valid=("text", "hf"))
    if chosen == "hf" and not (path / "state.json").exists() and not (path / "dataset_dict.json").exists():
        raise InvalidCorpus(
            f"{path} is not a folder datasets.save_to_disk wrote (no state.json or dataset_dict.json)",
            path=path,
            valid="a datasets.save_to_disk folder",
        )
    if chosen == "text":
        _text_files(path)  # raises for a folder without .txt files
    return Corpus(path, chosen, text_field)


def _guess(path: Path) -> str | None:
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return "hf"
        return "text"
    return _SUFFIXES.get(path.suffix.lower())


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".txt" and p.is_file())
    if not files:
        raise InvalidCorpus(f"the folder {path} holds no .txt file", path=path, valid=".txt files")
    return files


def _hf_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def _head_hash(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(1 << 20)).hexdigest()


def _document(item: Any, where: str, path: Any) -> Document:
    if isinstance(item, str):
        return item
    if isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return [int(t) for t in item]
    try:  # a tensor or array of ids
        ids = item.tolist()
    except AttributeError:
        ids = None
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return ids
    raise InvalidCorpus(
        f"{where} is {type(item).__name__}, not a document: a text (str) or a list of token ids (ints)",
        path=path,
        valid="a text or a list of token ids",
    )
