"""``harvest``: run a model over a corpus and write its activations and SAE readouts to disk.

The loop: documents are read and tokenized in order, packed into rows (:mod:`._pack`), run a
batch of rows at a time through the model's batched capture (one batched forward on eager;
concurrent requests, which vLLM batches, on the vllm backends), and gathered into shards of
``rows_per_shard`` rows. Each shard is written whole in every format asked for, then the
manifest names it: memory holds one shard's values, and a rerun after a kill resumes after the
last shard the manifest lists (re-reading the corpus up to there, without running the model).
"""

from __future__ import annotations

import errno
import itertools
import math
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._api import model_points
from .._errors import InsufficientDiskSpace, InvalidAddress, InvalidCorpus, InvalidFeatures, InvalidOption
from .._sync import SyncModel, sync_model
from ..addresses._address import Address
from ..protocol._base import ModelBase
from ..protocol._protocol import InterpModel
from ..sae._readouts import Features
from ._corpus import Corpus, Document, open_corpus
from ._manifest import FORMAT_VERSION, check_disk, check_folder, model_identity, versions, write_manifest
from ._pack import PACKINGS, Row, pack
from ._saelens import SAELENS_DTYPES, finish_saelens, write_saelens_shard
from ._shards import DTYPES, write_shard
from ._top import TopContexts, load_top, prune_top, save_top

FORMATS = ("saelens", "safetensors")
"""The outputs a harvest writes (``formats=``)."""

SEPARATORS = ("bos", "eos", "sep")


@dataclass(frozen=True)
class HarvestSummary:
    """What a :func:`harvest` call did: the ``folder``, the rows and tokens now in it, how many of
    them this call harvested (the rest were there: a resumed run), its shards and seconds."""

    folder: Path
    rows: int
    tokens: int
    shards: int
    new_rows: int
    new_tokens: int
    seconds: float


@dataclass
class _Plan:
    addresses: list[Address]
    readouts: list[Features]
    widths: dict[Address, int]
    sae_widths: dict[str, int]
    hooks: dict[Address, str]
    torch_dtype: torch.dtype


def harvest(
    model: InterpModel | SyncModel,
    corpus: Any,
    out: str | Path,
    *,
    addresses: Iterable[Any] = (),
    saes: Mapping[str, Any] | Iterable[str] = (),
    top_k: int = 16,
    top_contexts: int = 0,
    context_window: int = 8,
    context_size: int = 128,
    packing: str = "concat",
    prepend_bos: bool = True,
    separator: str | int | None = "bos",
    formats: Sequence[str] = FORMATS,
    dtype: str = "float32",
    corpus_format: str | None = None,
    text_field: str = "text",
    batch_rows: int = 16,
    shard_bytes: int = 256 * 2**20,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
) -> HarvestSummary:
    """Run ``model`` over ``corpus`` and write what it computes to the folder ``out``.

    ``corpus``: a path (``.txt`` one document per line, or a folder of them; ``.jsonl`` with a
    ``text_field``; ``.parquet``; a ``datasets.save_to_disk`` folder) or a list of texts or of
    token-id lists (pre-tokenized; also a ``tokens`` / ``input_ids`` field): :mod:`._corpus`.

    ``addresses``: the activations to write (``"resid_post.3"``, an :class:`Address`, ...).
    ``saes``: SAEs whose top-``top_k`` feature readouts to write per token: names of SAEs
    attached to the model, or ``{name: Sae or folder}`` to attach; with ``top_contexts=N``,
    each feature's ``N`` highest activations with ``context_window`` tokens either side are
    kept as well (``top/<name>.json``, :func:`interp_engine.harvest.feature_html`).

    Rows: ``context_size`` tokens, packed as SAELens packs them (``packing="concat"``; also
    ``"truncate"`` and ``"document"``, one document per row; :mod:`._pack`), with BOS first
    (``prepend_bos``) and ``separator`` (``"bos"``, ``"eos"``, ``"sep"``, a token id, or
    ``None``) between documents joined in a row.

    ``formats``: ``"saelens"`` (``out/saelens``, SAELens's cached-activations folder: train with
    ``use_cached_activations=True, cached_activations_path=out/saelens``) and/or
    ``"safetensors"`` (``out/shards``, read back with :func:`open_harvest`). ``dtype``:
    ``"float32"``, ``"float16"`` (``"bfloat16"``: safetensors only).

    Long runs: ``batch_rows`` rows run per batch; shards of about ``shard_bytes`` (whole rows)
    are written atomically; memory holds one shard. Rerunning the same call on the same folder
    resumes after the last whole shard; a folder that holds another harvest is refused
    (``HarvestMismatch``, naming each difference). ``max_rows`` / ``max_tokens`` stop early.
    The free disk is checked before the run (``InsufficientDiskSpace``).
    """
    facade = sync_model(model)
    inner = facade.model
    folder = Path(out)
    chosen = _check_options(formats, dtype, packing, context_size, batch_rows, top_k, top_contexts, inner)
    the_corpus = open_corpus(corpus, format=corpus_format, text_field=text_field)
    plan = _plan(facade, addresses, saes, top_k, dtype, chosen)
    tokenizer = _tokenizer(inner)
    bos_id = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    separator_id = _separator(separator, tokenizer)
    row_bytes = context_size * _token_bytes(plan, chosen, dtype)
    rows_per_shard = max(1, shard_bytes // row_bytes)
    settings: dict[str, Any] = {
        "model": model_identity(inner),
        "corpus": the_corpus.identity(),
        "addresses": [str(a) for a in plan.addresses],
        "readouts": [
            {"key": _readout_key(r), "sae": r.sae, "top_k": r.top_k, "d_sae": plan.sae_widths[r.sae]}
            for r in plan.readouts
        ],
        "context_size": context_size,
        "packing": packing,
        "prepend_bos": prepend_bos,
        "bos_id": bos_id,
        "separator_id": separator_id,
        "dtype": dtype,
        "formats": list(chosen),
        "rows_per_shard": rows_per_shard,
        "max_rows": max_rows,
        "max_tokens": max_tokens,
        "top_contexts": [top_contexts, context_window],
    }
    manifest = check_folder(folder, settings)
    if manifest is not None and manifest.get("complete"):
        return _summary(folder, manifest, 0, 0, 0.0)
    rows_done = 0 if manifest is None else sum(s["rows"] for s in manifest["shards"])
    documents = _documents(the_corpus, tokenizer)
    first = next(documents, None)
    if first is None:
        raise InvalidCorpus(
            f"the corpus {the_corpus.source} holds no document", path=the_corpus.source, valid="documents"
        )
    documents = _chain(first, documents)
    estimate = _estimate_tokens(the_corpus, tokenizer, context_size, max_rows, max_tokens)
    check_disk(folder, int(1.05 * estimate * row_bytes / context_size), what=f"harvesting about {estimate} tokens")
    folder.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {
            "format_version": FORMAT_VERSION,
            "settings": settings,
            "backend": inner.backend,
            "versions": versions(),
            "shards": [],
            "complete": False,
        }
        if "saelens" in chosen:
            manifest["saelens"] = {
                "path": "saelens",
                "hook_names": {str(a): plan.hooks[a] for a in plan.addresses},
                "d_in": {plan.hooks[a]: plan.widths[a] for a in plan.addresses},
            }
        write_manifest(folder, manifest)
    tops = {
        r.sae: load_top(folder, r.sae, len(manifest["shards"]), plan.sae_widths[r.sae], top_contexts, context_window)
        for r in plan.readouts
        if top_contexts
    }
    rows = pack(documents, context_size=context_size, packing=packing, bos_id=bos_id, separator_id=separator_id)
    rows = _limited(rows, max_rows, max_tokens)
    for _ in range(rows_done):  # the rows the listed shards hold: read again, not run
        if next(rows, None) is None:
            break
    bar = _progress(progress, estimate, manifest)
    start = time.perf_counter()
    new_rows = new_tokens = 0
    try:
        while True:
            shard_rows = _take(rows, rows_per_shard)
            if not shard_rows:
                break
            index = len(manifest["shards"])
            first_row = sum(s["rows"] for s in manifest["shards"])
            tensors = _run_shard(facade, plan, shard_rows, batch_rows, tops, first_row, bar)
            _write(folder, index, plan, chosen, dtype, shard_rows, tensors, context_size)
            for sae, top in tops.items():
                save_top(folder, sae, index + 1, top)
            manifest["shards"].append(
                {
                    "index": index,
                    "file": f"shards/shard_{index:05d}.safetensors" if "safetensors" in chosen else None,
                    "first_row": first_row,
                    "rows": len(shard_rows),
                    "tokens": sum(len(r.tokens) for r in shard_rows),
                    "first_doc": min(min(r.doc) for r in shard_rows),
                    "last_doc": max(max(r.doc) for r in shard_rows),
                }
            )
            write_manifest(folder, manifest)
            for sae in tops:
                prune_top(folder, sae, index + 1)
            new_rows += len(shard_rows)
            new_tokens += manifest["shards"][-1]["tokens"]
    finally:
        if bar is not None:
            bar.close()
    if not manifest["shards"]:
        raise InvalidCorpus(
            f"the corpus {the_corpus.source} gives no row under packing={packing!r} and context_size={context_size} "
            "(every document empty, or shorter than a row where packing='truncate')",
            path=the_corpus.source,
            valid="documents with tokens",
        )
    if "saelens" in chosen:
        finish_saelens(folder, len(manifest["shards"]))
    for sae, top in tops.items():
        _write_top_json(folder, sae, top, inner)
    manifest["complete"] = True
    write_manifest(folder, manifest)
    return _summary(folder, manifest, new_rows, new_tokens, time.perf_counter() - start)


def _summary(
    folder: Path, manifest: Mapping[str, Any], new_rows: int, new_tokens: int, seconds: float
) -> HarvestSummary:
    shards = manifest["shards"]
    return HarvestSummary(
        folder,
        sum(s["rows"] for s in shards),
        sum(s["tokens"] for s in shards),
        len(shards),
        new_rows,
        new_tokens,
        seconds,
    )


def _check_options(
    formats: Sequence[str],
    dtype: str,
    packing: str,
    context_size: int,
    batch_rows: int,
    top_k: int,
    top_contexts: int,
    model: InterpModel,
) -> tuple[str, ...]:
    chosen = (formats,) if isinstance(formats, str) else tuple(formats)
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise InvalidOption(f"formats are some of {', '.join(FORMATS)}; got {list(chosen)}")
    if dtype not in DTYPES:
        raise InvalidOption(f"dtype is one of {', '.join(DTYPES)}; got {dtype!r}")
    if "saelens" in chosen and dtype not in SAELENS_DTYPES:
        raise InvalidOption(
            f"SAELens's cache (Arrow) has no {dtype}: use dtype={' or '.join(map(repr, SAELENS_DTYPES))}, "
            "or formats=['safetensors']"
        )
    if packing not in PACKINGS:
        raise InvalidOption(f"packing is one of {', '.join(PACKINGS)}; got {packing!r}")
    if packing == "document" and "saelens" in chosen:
        raise InvalidOption(
            "packing='document' gives rows of different lengths, and SAELens's cache holds rows of context_size "
            "tokens: use packing='concat' or 'truncate' with the saelens format, or formats=['safetensors']"
        )
    for name, value, low in (("context_size", context_size, 1), ("batch_rows", batch_rows, 1), ("top_k", top_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidOption(f"{name} is an int >= {low}, got {value!r}")
    if not isinstance(top_contexts, int) or top_contexts < 0:
        raise InvalidOption(f"top_contexts is an int >= 0, got {top_contexts!r}")
    if context_size < 2:
        raise InvalidOption(f"context_size is at least 2 (a row holds its BOS and a token), got {context_size}")
    if context_size > model.info.n_ctx:
        raise InvalidOption(
            f"context_size {context_size} is longer than the model's context window ({model.info.n_ctx})"
        )
    return chosen


def _plan(
    facade: SyncModel, addresses: Iterable[Any], saes: Any, top_k: int, dtype: str, formats: Sequence[str]
) -> _Plan:
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
    if readouts and "saelens" in formats and not points:
        raise InvalidOption("the saelens format holds activations: name addresses=, or use formats=['safetensors']")
    return _Plan(points, readouts, widths, sae_widths, hooks, DTYPES[dtype])


def _tokenizer(model: Any) -> Any:
    tok = getattr(model, "tok", None)
    tokenizer = getattr(tok, "tokenizer", None) if tok is not None else None
    return tokenizer


def _separator(separator: str | int | None, tokenizer: Any) -> int | None:
    if separator is None:
        return None
    if isinstance(separator, int) and not isinstance(separator, bool):
        return separator
    if separator not in SEPARATORS:
        raise InvalidOption(f"separator is one of {', '.join(SEPARATORS)}, a token id, or None; got {separator!r}")
    found = getattr(tokenizer, f"{separator}_token_id", None)
    return None if found is None else int(found)


def _token_bytes(plan: _Plan, formats: Sequence[str], dtype: str) -> int:
    size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    values = sum(plan.widths.values()) * size
    readouts = sum(8 * (r.top_k or 0) for r in plan.readouts)
    out = 0
    if "safetensors" in formats:
        out += values + readouts + 16
    if "saelens" in formats:
        out += values + 4
    return max(out, 1)


def _documents(corpus: Corpus, tokenizer: Any) -> Iterator[tuple[int, list[int]]]:
    """``(index, ids)`` of each document, texts tokenized without special tokens (as SAELens
    tokenizes them before packing), a chunk of texts at a time."""
    chunk: list[tuple[int, Document]] = []
    for index, document in enumerate(corpus.documents()):
        chunk.append((index, document))
        if len(chunk) == 256:
            yield from _tokenized(chunk, tokenizer)
            chunk = []
    yield from _tokenized(chunk, tokenizer)


def _tokenized(chunk: list[tuple[int, Document]], tokenizer: Any) -> Iterator[tuple[int, list[int]]]:
    texts = [d for _, d in chunk if isinstance(d, str)]
    if texts and tokenizer is None:
        raise InvalidCorpus("this model has no tokenizer to read texts with: give token ids", valid="token ids")
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    for index, document in chunk:
        yield index, list(next(encoded)) if isinstance(document, str) else document


def _chain(first: tuple[int, list[int]], rest: Iterator[tuple[int, list[int]]]) -> Iterator[tuple[int, list[int]]]:
    yield first
    yield from rest


def _estimate_tokens(
    corpus: Corpus, tokenizer: Any, context_size: int, max_rows: int | None, max_tokens: int | None
) -> int:
    """The tokens the run will harvest, for the disk check and the progress bar: ``max_rows`` /
    ``max_tokens`` where they bound it; else a list's own count, or the corpus's bytes at the
    tokens per byte of its first texts (ids stored as text or Parquet: half a token a byte)."""
    bounds = [b for b in (max_tokens, None if max_rows is None else max_rows * context_size) if b is not None]
    if corpus.format == "list":
        estimate = sum(len(d) if isinstance(d, list) else len(d.encode()) for d in corpus.source)
    else:
        texts = [d for d in itertools.islice(corpus.documents(), 64) if isinstance(d, str) and d]
        per_byte = 0.5
        if texts and tokenizer is not None:
            n_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
            per_byte = n_tokens / max(1, sum(len(t.encode()) for t in texts))
        estimate = int(corpus.n_bytes() * per_byte)
    return max(1, min([estimate + context_size, *bounds]))


def _limited(rows: Iterator[Row], max_rows: int | None, max_tokens: int | None) -> Iterator[Row]:
    tokens = 0
    for count, row in enumerate(rows):
        if max_rows is not None and count >= max_rows:
            return
        if max_tokens is not None and tokens + len(row.tokens) > max_tokens:
            return
        tokens += len(row.tokens)
        yield row


def _take(rows: Iterator[Row], n: int) -> list[Row]:
    out = []
    for row in rows:
        out.append(row)
        if len(out) == n:
            break
    return out


def _progress(enabled: bool, estimate: int, manifest: Mapping[str, Any]) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ModuleNotFoundError:
        return None
    done = sum(s["tokens"] for s in manifest["shards"])
    return tqdm(total=max(estimate, done), initial=done, unit="tok", unit_scale=True, desc="harvest", smoothing=0.1)


def _run_shard(
    facade: SyncModel,
    plan: _Plan,
    rows: list[Row],
    batch_rows: int,
    tops: Mapping[str, TopContexts],
    first_row: int,
    bar: Any,
) -> dict[str, torch.Tensor]:
    """One shard's values, flat over its tokens: each address ``[n_tokens, width]`` in the
    harvest's dtype, each readout's ``ids`` and ``values`` ``[n_tokens, k]``."""
    from .._api import run_with_cache

    parts: dict[str, list[torch.Tensor]] = {}
    points: list[Any] = [*plan.addresses, *plan.readouts]
    for start in range(0, len(rows), batch_rows):
        batch = rows[start : start + batch_rows]
        cache = run_with_cache(facade, [r.tokens for r in batch], points)
        lengths = [len(r.tokens) for r in batch]
        for address in plan.addresses:
            value = cache[address]
            flat = value.reshape(value.shape[0], value.shape[1], -1).to(plan.torch_dtype)
            parts.setdefault(str(address), []).extend(flat[i, :n] for i, n in enumerate(lengths))
        for readout in plan.readouts:
            read = cache[readout]
            key = _readout_key(readout)
            ids = read.ids if read.ids is not None else torch.empty(0)
            parts.setdefault(f"{key}/ids", []).extend(ids[i, :n].to(torch.int32) for i, n in enumerate(lengths))
            parts.setdefault(f"{key}/values", []).extend(
                read.values[i, :n].to(plan.torch_dtype) for i, n in enumerate(lengths)
            )
            if readout.sae in tops:
                tokens = torch.full((len(batch), max(lengths)), -1, dtype=torch.int64)
                for i, r in enumerate(batch):
                    tokens[i, : len(r.tokens)] = torch.tensor(r.tokens)
                tops[readout.sae].update(ids, read.values, tokens, first_row + start)
        if bar is not None:
            bar.update(sum(lengths))
    return {key: torch.cat(values) for key, values in parts.items()}


def _readout_key(readout: Features) -> str:
    return f"features:{readout.sae}:top{readout.top_k}"


def _write(
    folder: Path,
    index: int,
    plan: _Plan,
    formats: Sequence[str],
    dtype: str,
    rows: list[Row],
    tensors: Mapping[str, torch.Tensor],
    context_size: int,
) -> None:
    """Write one shard in every format; a full disk raises ``InsufficientDiskSpace`` with the
    partial file removed (the shards before it, and the manifest, are untouched)."""
    try:
        if "safetensors" in formats:
            lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            layout = {
                "tokens": torch.tensor([t for r in rows for t in r.tokens], dtype=torch.int32),
                "doc": torch.tensor([d for r in rows for d in r.doc], dtype=torch.int64),
                "pos": torch.tensor([p for r in rows for p in r.pos], dtype=torch.int32),
                "row_offsets": offsets,
            }
            write_shard(folder, index, {**layout, **tensors})
        if "saelens" in formats:
            columns = {
                plan.hooks[a]: tensors[str(a)].reshape(len(rows), context_size, -1).numpy() for a in plan.addresses
            }
            token_ids = torch.tensor([r.tokens for r in rows], dtype=torch.int32).numpy()
            write_saelens_shard(folder, index, columns, token_ids, dtype)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(folder).free
        raise InsufficientDiskSpace(
            f"the disk under {folder} filled while writing shard {index} ({exc.strerror}); the shards before it are "
            "whole and listed in harvest.json: free space and rerun the same harvest to resume",
            needed=sum(t.numel() * t.element_size() for t in tensors.values()),
            free=free,
        ) from exc


def _write_top_json(folder: Path, sae: str, top: TopContexts, model: Any) -> None:
    import json

    from ._manifest import atomic_write_bytes

    features = {}
    for feature in range(top.n_features):
        entries = top.feature(feature)
        if not entries:
            continue
        for entry in entries:
            tokens = [int(t) for t in entry["tokens"]]  # type: ignore[attr-defined]
            entry["text"] = [model.to_str_tokens([t])[0] if t >= 0 else "" for t in tokens]
        features[str(feature)] = entries
    data = {"sae": sae, "n": top.n, "window": top.window, "features": features}
    atomic_write_bytes(folder / "top" / f"{sae}.json", json.dumps(data).encode())
