"""Packing documents' token ids into the rows a harvest runs, the way SAELens does.

Three packings (``packing=``):

``"concat"``
    SAELens's default (``ActivationsStore`` with ``disable_concat_sequences=False``, what
    ``CacheActivationsRunner`` caches): each document tokenized without special tokens; the
    documents joined into rows of exactly ``context_size`` tokens; every row begins with BOS
    (``prepend_bos``; not added again where the row's first token is BOS already); a
    document that starts inside a row is preceded by the separator (SAELens's default
    ``sequence_separator_token="bos"``: BOS again), unless it begins with it; a document longer
    than the rest of its row continues in the next row (after that row's BOS); empty documents
    are skipped and the last, partial row is dropped.
``"truncate"``
    SAELens's ``disable_concat_sequences=True``: one document per row, BOS first (unless the
    document begins with it), cut at ``context_size``; documents shorter than that are skipped.
``"document"``
    One document per row, whatever its length (BOS first as above, cut at ``context_size``):
    rows of different lengths, for the safetensors output (SAELens's cache needs full rows).

Each row keeps, per token, the index of its document in the corpus and its position among that
document's tokens (``-1`` for a BOS or separator the packing inserted).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._errors import InvalidOption

PACKINGS = ("concat", "truncate", "document")


@dataclass(frozen=True)
class Row:
    """One packed row: its token ids, and per token the document it came from and its position
    in that document's token ids (``-1``: a token the packing inserted)."""

    tokens: list[int]
    doc: list[int]
    pos: list[int]


def pack(
    documents: Iterable[tuple[int, list[int]]],
    *,
    context_size: int,
    packing: str,
    bos_id: int | None,
    separator_id: int | None,
) -> Iterator[Row]:
    """Rows of ``documents`` (``(index, ids)`` pairs, in corpus order) under ``packing``;
    ``context_size`` is at least 2 (a row of one token would hold its BOS alone, forever)."""
    if context_size < 2:
        raise InvalidOption(f"context_size is at least 2 (a row holds its BOS and a token), got {context_size}")
    if packing == "concat":
        yield from _concat(documents, context_size, bos_id, separator_id)
        return
    for index, ids in documents:
        if not ids:
            continue
        tokens, pos = list(ids), list(range(len(ids)))
        if bos_id is not None and tokens[0] != bos_id and (packing == "document" or len(tokens) >= context_size - 1):
            tokens, pos = [bos_id, *tokens], [-1, *pos]
        tokens, pos = tokens[:context_size], pos[:context_size]
        if packing == "truncate" and len(tokens) < context_size:
            continue
        yield Row(tokens, [index] * len(tokens), pos)


def _concat(
    documents: Iterable[tuple[int, list[int]]], context_size: int, bos_id: int | None, separator_id: int | None
) -> Iterator[Row]:
    tokens: list[int] = []
    doc: list[int] = []
    pos: list[int] = []
    for index, ids in documents:
        offset = 0
        while offset < len(ids):
            if not tokens:  # a new row: BOS first unless the row starts with it
                if bos_id is not None and ids[offset] != bos_id:
                    tokens, doc, pos = [bos_id], [index], [-1]
            elif offset == 0 and separator_id is not None and ids[0] != separator_id:
                tokens.append(separator_id)
                doc.append(index)
                pos.append(-1)
            take = max(context_size - len(tokens), 0)
            tokens.extend(ids[offset : offset + take])
            doc.extend([index] * len(ids[offset : offset + take]))
            pos.extend(range(offset, offset + len(ids[offset : offset + take])))
            offset += take
            if len(tokens) == context_size:
                yield Row(tokens, doc, pos)
                tokens, doc, pos = [], [], []
