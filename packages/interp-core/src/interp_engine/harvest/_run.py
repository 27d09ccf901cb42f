"""``harvest``: run a model over a corpus and write its activations and SAE readouts to disk.

The driver: documents are read and tokenized in order, packed into rows (:mod:`._pack`) and cut
into shards of ``rows_per_shard`` rows; shard ``k`` is rows ``k * rows_per_shard`` onwards
whoever runs it. Each shard runs a batch of rows at a time through the model's batched capture
(one batched forward on eager; concurrent requests, which vLLM batches, on the vllm backends)
and is written whole in every format asked for (:mod:`._work`), in this process or on a Ray
replica (:mod:`._replicas`); then the manifest names it. Memory holds one shard's values per
model, and a rerun after a kill skips the shards the manifest lists (re-reading the corpus up to
the last, without running the model), whichever replica wrote them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InvalidCorpus, InvalidOption
from .._sync import SyncModel, sync_model
from ..addresses._address import Address
from ..protocol._protocol import InterpModel
from ._corpus import Corpus, Document, open_corpus
from ._manifest import FORMAT_VERSION, check_disk, check_folder, model_identity, versions, write_manifest
from ._pack import PACKINGS, Row, pack
from ._saelens import SAELENS_DTYPES, finish_saelens
from ._shards import DTYPES
from ._top import TopContexts, TopStore
from ._work import Plan, ShardJob, make_plan, readout_key, run_job, token_bytes

FORMATS = ("saelens", "safetensors")
"""The outputs a harvest writes (``formats=``)."""

SEPARATORS = ("bos", "eos", "sep")


@dataclass(frozen=True)
class HarvestSummary:
    """What a :func:`harvest` call did: the ``folder``, the rows and tokens now in it, how many of
    them this call harvested (the rest were there: a resumed run), its shards and seconds, and
    the tokens each replica harvested in this call (``replica_tokens``: one number without
    replicas)."""

    folder: Path
    rows: int
    tokens: int
    shards: int
    new_rows: int
    new_tokens: int
    seconds: float
    replica_tokens: tuple[int, ...] = ()


class _Local:
    """The shards run in this process, on ``facade``'s model, one after the other."""

    def __init__(self, facade: SyncModel) -> None:
        self.facade = facade
        self.tokens = [0]

    def submit(self, job: ShardJob) -> list[dict[str, Any]]:
        entry = run_job(self.facade, job)
        self.tokens[0] += entry["tokens"]
        return [entry]

    def finish(self) -> list[dict[str, Any]]:
        return []

    def str_tokens(self, ids: list[int]) -> list[str]:
        return [self.facade.model.to_str_tokens([t])[0] for t in ids]


def harvest(
    model: InterpModel | SyncModel | str,
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
    replicas: int | None = None,
    backend: str | None = None,
    model_options: Mapping[str, Any] | None = None,
    ray_address: str | None = None,
    replica_resources: Mapping[str, Any] | None = None,
) -> HarvestSummary:
    """Run ``model`` over ``corpus`` and write what it computes to the folder ``out``.

    ``model``: a loaded model, or its name or folder, loaded here on ``backend`` with
    ``model_options`` (``load_model``'s keyword arguments) and shut down at the end.

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

    ``replicas=N``: ``N`` replicas of the model (``model`` named, not loaded) on a Ray cluster
    (``ray_address``; ``None``: ``RAY_ADDRESS``, else a local cluster), each with
    ``replica_resources`` (Ray actor options; default ``{"num_cpus": 1}``), harvest shard ``k``
    on replica ``k mod N`` into the same folder (shared by every node). The rows, shards and
    manifest are those of a one-process run, which resumes the folder as well (and the other
    way round).
    """
    folder = Path(out)
    chosen = _check_options(formats, dtype, packing, context_size, batch_rows, top_k, top_contexts)
    the_corpus = open_corpus(corpus, format=corpus_format, text_field=text_field)
    listed = [addresses] if isinstance(addresses, (str, Address)) else list(addresses)
    if replicas is not None:
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise InvalidOption(f"replicas is an int >= 1 (Ray replicas of the model), got {replicas!r}")
        if not isinstance(model, (str, Path)):
            raise InvalidOption(
                "replicas= loads the model in each replica: pass its name or folder (with backend= and "
                f"model_options=), not a loaded model ({type(model).__name__})"
            )
        from ._replicas import RayReplicas

        ray_replicas = RayReplicas(
            replicas,
            str(model),
            backend,
            model_options or {},
            address=ray_address,
            resources=replica_resources or {},
        )
        try:
            prepared = ray_replicas.prepare(listed, saes, top_k, dtype)
            _check_context(context_size, prepared["n_ctx"])
            return _harvest(
                ray_replicas, prepared, the_corpus, folder, chosen, **_settings(locals()), progress=progress
            )
        finally:
            ray_replicas.close()
    if replica_resources is not None or ray_address is not None:
        raise InvalidOption("ray_address= and replica_resources= go with replicas=N (a harvest on Ray replicas)")
    loaded = isinstance(model, (str, Path))
    if isinstance(model, (str, Path)):
        from .._plugins import load_model

        facade = sync_model(load_model(str(model), backend=backend, **(model_options or {})))
    elif backend is not None or model_options:
        raise InvalidOption("backend= and model_options= load a model named by its name or folder, not a loaded one")
    else:
        facade = sync_model(model)
    try:
        inner = facade.model
        _check_context(context_size, inner.info.n_ctx)
        tok = getattr(inner, "tok", None)
        prepared = {
            "plan": make_plan(facade, listed, saes, top_k, dtype),
            "tokenizer": getattr(tok, "tokenizer", None) if tok is not None else None,
            "identity": model_identity(inner),
            "backend": inner.backend,
        }
        return _harvest(_Local(facade), prepared, the_corpus, folder, chosen, **_settings(locals()), progress=progress)
    finally:
        if loaded:
            facade.shutdown()


def _settings(names: Mapping[str, Any]) -> dict[str, Any]:
    keys = ["top_contexts", "context_window", "context_size", "packing", "prepend_bos", "separator", "dtype"]
    keys += ["batch_rows", "shard_bytes", "max_rows", "max_tokens"]
    return {key: names[key] for key in keys}


def _harvest(
    executor: Any,
    prepared: Mapping[str, Any],
    the_corpus: Corpus,
    folder: Path,
    chosen: tuple[str, ...],
    *,
    top_contexts: int,
    context_window: int,
    context_size: int,
    packing: str,
    prepend_bos: bool,
    separator: str | int | None,
    dtype: str,
    batch_rows: int,
    shard_bytes: int,
    max_rows: int | None,
    max_tokens: int | None,
    progress: bool,
) -> HarvestSummary:
    """The driver: read and pack the corpus, send each shard not done yet to ``executor``
    (:class:`_Local`, or :class:`._replicas.RayReplicas`), and list each shard it finishes in the
    manifest, the top contexts merged in shard order."""
    plan: Plan = prepared["plan"]
    if plan.readouts and "saelens" in chosen and not plan.addresses:
        raise InvalidOption("the saelens format holds activations: name addresses=, or use formats=['safetensors']")
    tokenizer = prepared["tokenizer"]
    bos_id = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    separator_id = _separator(separator, tokenizer)
    row_bytes = context_size * token_bytes(plan, chosen)
    rows_per_shard = max(1, shard_bytes // row_bytes)
    settings: dict[str, Any] = {
        "model": prepared["identity"],
        "corpus": the_corpus.identity(),
        "addresses": [str(a) for a in plan.addresses],
        "readouts": [
            {"key": readout_key(r), "sae": r.sae, "top_k": r.top_k, "d_sae": plan.sae_widths[r.sae]}
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
        return _summary(folder, manifest, 0, 0, 0.0, executor.tokens)
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
            "backend": prepared["backend"],
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
    done = {s["index"] for s in manifest["shards"]}
    widths = {r.sae: plan.sae_widths[r.sae] for r in plan.readouts} if top_contexts else {}
    tops = TopStore(folder, widths, top_contexts, context_window, done)
    rows = pack(documents, context_size=context_size, packing=packing, bos_id=bos_id, separator_id=separator_id)
    rows = _limited(rows, max_rows, max_tokens)
    bar = _progress(progress, estimate, manifest)
    start = time.perf_counter()
    new = [0, 0]

    def record(entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            tops.add(entry["index"], entry.pop("top"))
            manifest["shards"].append(entry)
            manifest["shards"].sort(key=lambda s: s["index"])
            write_manifest(folder, manifest)
            tops.prune()
            new[0] += entry["rows"]
            new[1] += entry["tokens"]
            if bar is not None:
                bar.update(entry["tokens"])

    try:
        for index in itertools.count():
            shard_rows = _take(rows, rows_per_shard)
            if not shard_rows:
                break
            if index in done:  # listed: its rows were read again, not run
                continue
            job = ShardJob(
                folder,
                index,
                shard_rows,
                index * rows_per_shard,  # every shard before the last holds rows_per_shard rows
                plan,
                chosen,
                context_size,
                batch_rows,
                top_contexts if plan.readouts else 0,
                context_window,
            )
            record(executor.submit(job))
        record(executor.finish())
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
    for sae, top in tops.merged.items():
        _write_top_json(folder, sae, top, executor.str_tokens)
    manifest["complete"] = True
    write_manifest(folder, manifest)
    return _summary(folder, manifest, new[0], new[1], time.perf_counter() - start, executor.tokens)


def _summary(
    folder: Path,
    manifest: Mapping[str, Any],
    new_rows: int,
    new_tokens: int,
    seconds: float,
    replica_tokens: Sequence[int],
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
        tuple(replica_tokens),
    )


def _check_options(
    formats: Sequence[str],
    dtype: str,
    packing: str,
    context_size: int,
    batch_rows: int,
    top_k: int,
    top_contexts: int,
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
    return chosen


def _check_context(context_size: int, n_ctx: int) -> None:
    if context_size > n_ctx:
        raise InvalidOption(f"context_size {context_size} is longer than the model's context window ({n_ctx})")


def _separator(separator: str | int | None, tokenizer: Any) -> int | None:
    if separator is None:
        return None
    if isinstance(separator, int) and not isinstance(separator, bool):
        return separator
    if separator not in SEPARATORS:
        raise InvalidOption(f"separator is one of {', '.join(SEPARATORS)}, a token id, or None; got {separator!r}")
    found = getattr(tokenizer, f"{separator}_token_id", None)
    return None if found is None else int(found)


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


def _write_top_json(folder: Path, sae: str, top: TopContexts, str_tokens: Any) -> None:
    import json

    from ._manifest import atomic_write_bytes

    features = {}
    for feature in range(top.n_features):
        entries = top.feature(feature)
        if not entries:
            continue
        features[str(feature)] = entries
    ids = sorted({int(t) for entries in features.values() for e in entries for t in e["tokens"] if int(t) >= 0})  # type: ignore[attr-defined]
    texts = dict(zip(ids, str_tokens(ids) if ids else [], strict=True))
    for entries in features.values():
        for entry in entries:
            entry["text"] = [texts[int(t)] if int(t) >= 0 else "" for t in entry["tokens"]]  # type: ignore[attr-defined]
    data = {"sae": sae, "n": top.n, "window": top.window, "features": features}
    atomic_write_bytes(folder / "top" / f"{sae}.json", json.dumps(data).encode())
