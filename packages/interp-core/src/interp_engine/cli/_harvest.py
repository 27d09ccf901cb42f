"""``interp harvest``: a model's activations and SAE readouts over a corpus, to a folder
(:func:`interp_engine.harvest.harvest`), on this machine or on Ray replicas (``--replicas N``);
rerunning the same command resumes it. ``interp harvest show OUT``: the top contexts a harvest
kept, of each SAE and feature, as text, JSON or an HTML page."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .._errors import InvalidFeatures
from ..harvest._corpus import FORMATS as CORPUS_FORMATS
from ..harvest._html import feature_html, top_contexts
from ..harvest._pack import PACKINGS
from ..harvest._run import FORMATS, harvest
from ._common import UserError, add_model_options, add_sae_option, load_options, opened, read_saes


def cmd_harvest(args: argparse.Namespace) -> int:
    addresses = [a.strip() for text in args.points for a in text.split(",") if a.strip()]
    saes = [name for name, _ in args.saes]
    if not addresses and not saes:
        raise UserError("name --points (addresses) or --sae NAME=PATH (readouts), or both")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    settings: dict[str, Any] = {
        "addresses": addresses,
        "top_k": args.top_k,
        "top_contexts": args.top_contexts,
        "context_size": args.context_size,
        "packing": args.packing,
        "prepend_bos": not args.no_bos,
        "formats": formats,
        "dtype": args.value_dtype,
        "corpus_format": args.corpus_format,
        "text_field": args.text_field,
        "batch_rows": args.batch_rows,
        "shard_bytes": int(args.shard_mb * 2**20),
        "max_rows": args.max_rows,
        "max_tokens": args.max_tokens,
        "progress": not args.quiet,
    }
    if args.replicas is not None:
        read_saes(args.saes)  # a bad name or folder: one line, before any replica starts
        options = {key: value for key, value in load_options(args).items() if key != "saes"}
        resources: dict[str, Any] = {"num_cpus": args.replica_cpus}
        if args.replica_gpus:
            resources["num_gpus"] = args.replica_gpus
        summary = harvest(
            args.model,
            args.corpus,
            args.out,
            saes=dict(args.saes),
            replicas=args.replicas,
            backend=args.backend,
            model_options=options,
            ray_address=args.ray_address,
            replica_resources=resources,
            **settings,
        )
    else:
        if args.ray_address is not None:
            raise UserError("--ray-address goes with --replicas N (a harvest on Ray replicas)")
        with opened(args) as sync:
            summary = harvest(sync, args.corpus, args.out, saes=saes, **settings)
    report: dict[str, Any] = {
        "folder": str(summary.folder),
        "rows": summary.rows,
        "tokens": summary.tokens,
        "shards": summary.shards,
        "new_tokens": summary.new_tokens,
        "seconds": round(summary.seconds, 3),
    }
    if args.replicas is not None:
        report["replica_tokens"] = list(summary.replica_tokens)
    print(json.dumps(report))
    return 0


def cmd_harvest_show(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    kept = sorted(p.stem for p in (folder / "top").glob("*.json"))
    if not kept:
        raise UserError(f"{folder} holds no top contexts: harvest with --sae NAME=PATH --top-contexts N")
    sae = args.sae
    if sae is None:
        if len(kept) > 1:
            raise UserError(f"{folder} holds the top contexts of several SAEs ({', '.join(kept)}): name one with --sae")
        sae = kept[0]
    elif sae not in kept:
        raise UserError(f"{folder} holds no top contexts of {sae!r}; it holds those of {', '.join(kept)}")
    data = top_contexts(folder, sae)
    features: dict[str, list[dict[str, Any]]] = data["features"]
    if args.feature is None:
        best = sorted(features.items(), key=lambda item: -item[1][0]["value"])[: args.limit]
        if args.json:
            print(json.dumps({"sae": sae, "features": {f: entries[0] for f, entries in best}}))
            return 0
        print(f"{sae}: {len(features)} features kept; the strongest (value, feature, its best context):")
        for feature, entries in best:
            print(f"{entries[0]['value']:10.3f}  {feature:>6}  {_context(entries[0], int(data['window']))}")
        return 0
    if str(args.feature) not in features:
        raise InvalidFeatures(
            f"feature {args.feature} of {sae!r} never reached a token's top-k in this harvest "
            f"({len(features)} features did; 'interp harvest show {folder} --sae {sae}' lists the strongest)"
        )
    entries = features[str(args.feature)]
    if args.html:
        Path(args.html).write_text(feature_html(folder, sae, args.feature))
    if args.json:
        print(json.dumps({"sae": sae, "feature": args.feature, "contexts": entries}))
        return 0
    print(f"{sae} feature {args.feature}: top {len(entries)} contexts (value, row:position, [[token]])")
    for entry in entries:
        where = f"{entry['row']}:{entry['position']}"
        print(f"{entry['value']:10.3f}  {where:>9}  {_context(entry, int(data['window']))}")
    if args.html:
        print(f"wrote {args.html}")
    return 0


def _context(entry: dict[str, Any], window: int) -> str:
    pieces = []
    for i, (token, text) in enumerate(zip(entry["tokens"], entry["text"], strict=True)):
        if token < 0:
            continue
        shown = json.dumps(text)[1:-1]  # newlines and quotes escaped: one line per context
        pieces.append(f"[[{shown}]]" if i == window else shown)
    return "".join(pieces)


def add_harvest(sub: Any) -> None:
    parser = sub.add_parser(
        "harvest",
        help="activations and SAE readouts over a corpus, to SAELens's cache and safetensors shards",
        description="Run MODEL over CORPUS (a .txt file of one document per line or a folder of them, .jsonl, "
        ".parquet, or a datasets.save_to_disk folder) packed as SAELens packs it, and write OUT/saelens (SAELens's "
        "cached-activations folder: train with use_cached_activations=True) and OUT/shards with OUT/harvest.json "
        "(read back with interp_engine.harvest.open_harvest). Rerunning the same command resumes after the last "
        "whole shard; a folder holding another harvest is refused.",
        epilog="example: interp harvest interp:tiny corpus.jsonl out/ --points resid_post.2 --context-size 128",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    parser.add_argument("corpus", metavar="CORPUS", help="the corpus file or folder")
    parser.add_argument("out", metavar="OUT", help="the output folder (new, empty, or this harvest's own)")
    parser.add_argument("--points", action="append", default=[], help="addresses to write, e.g. resid_post.2,mlp_out.1")
    parser.add_argument("--top-k", type=int, default=16, help="features per token of each --sae readout (default 16)")
    parser.add_argument(
        "--top-contexts", type=int, default=0, help="keep each feature's N highest activations with their contexts"
    )
    parser.add_argument("--context-size", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument(
        "--packing", choices=PACKINGS, default="concat", help="how documents fill rows (SAELens: concat)"
    )
    parser.add_argument("--no-bos", action="store_true", help="do not begin each row with BOS (SAELens's prepend_bos)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"some of {','.join(FORMATS)} (default: both)")
    parser.add_argument("--value-dtype", default="float32", help="float32, float16 (bfloat16: safetensors only)")
    parser.add_argument(
        "--corpus-format", choices=CORPUS_FORMATS[:4], help="the corpus format (default: from its name)"
    )
    parser.add_argument("--text-field", default="text", help="the JSONL / Parquet / datasets field of each document")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per batch through the model (default 16)")
    parser.add_argument("--shard-mb", type=float, default=256, help="about how many MiB per shard (default 256)")
    parser.add_argument("--max-rows", type=int, help="stop after this many rows")
    parser.add_argument("--max-tokens", type=int, help="stop before this many tokens")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sae_option(parser)
    add_model_options(parser)
    ray = parser.add_argument_group("Ray replicas")
    ray.add_argument(
        "--replicas",
        type=int,
        help="harvest on N replicas of MODEL on a Ray cluster, shard k on replica k mod N, into OUT (a folder "
        "every node sees)",
    )
    ray.add_argument("--ray-address", help="the cluster (default: $RAY_ADDRESS, else a local one)")
    ray.add_argument("--replica-cpus", type=float, default=1, help="CPUs each replica holds (default 1)")
    ray.add_argument("--replica-gpus", type=float, default=0, help="GPUs each replica holds (tp x pp on vllm)")
    parser.set_defaults(func=cmd_harvest)


def add_harvest_show(sub: Any) -> None:
    parser = sub.add_parser(
        "harvest-show",
        prog="interp harvest show",
        help="a harvest's top contexts of a feature (interp harvest show OUT --feature N)",
        description="Print the top-activating contexts a harvest kept (interp harvest ... --sae NAME=PATH "
        "--top-contexts N): without --feature, the SAE's strongest features with their best context; with "
        "--feature N, its contexts, highest first, the activating token in [[ ]]. --html writes the page "
        "interp_engine.harvest.feature_html renders.",
        epilog="example: interp harvest show out/ --sae res --feature 12 --html feature.html",
    )
    parser.add_argument("folder", metavar="OUT", help="the harvest's output folder")
    parser.add_argument("--sae", help="the SAE's name in the harvest (needed where it kept several)")
    parser.add_argument("--feature", type=int, help="the feature whose contexts to show")
    parser.add_argument("--limit", type=int, default=20, help="features listed without --feature (20)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--html", metavar="FILE", help="with --feature: write its HTML page to FILE")
    parser.set_defaults(func=cmd_harvest_show)
