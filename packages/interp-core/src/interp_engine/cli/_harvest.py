"""``interp harvest``: a model's activations and SAE readouts over a corpus, to a folder
(:func:`interp_engine.harvest.harvest`); rerunning the same command resumes it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..harvest._corpus import FORMATS as CORPUS_FORMATS
from ..harvest._pack import PACKINGS
from ..harvest._run import FORMATS, harvest
from ._common import UserError, add_model_options, add_sae_option, opened


def cmd_harvest(args: argparse.Namespace) -> int:
    addresses = [a.strip() for text in args.points for a in text.split(",") if a.strip()]
    saes = [name for name, _ in args.saes]
    if not addresses and not saes:
        raise UserError("name --points (addresses) or --sae NAME=PATH (readouts), or both")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    with opened(args) as sync:
        summary = harvest(
            sync,
            args.corpus,
            args.out,
            addresses=addresses,
            saes=saes,
            top_k=args.top_k,
            top_contexts=args.top_contexts,
            context_size=args.context_size,
            packing=args.packing,
            prepend_bos=not args.no_bos,
            formats=formats,
            dtype=args.value_dtype,
            corpus_format=args.corpus_format,
            text_field=args.text_field,
            batch_rows=args.batch_rows,
            shard_bytes=int(args.shard_mb * 2**20),
            max_rows=args.max_rows,
            max_tokens=args.max_tokens,
            progress=not args.quiet,
        )
    report: dict[str, Any] = {
        "folder": str(summary.folder),
        "rows": summary.rows,
        "tokens": summary.tokens,
        "shards": summary.shards,
        "new_tokens": summary.new_tokens,
        "seconds": round(summary.seconds, 3),
    }
    print(json.dumps(report))
    return 0


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
    parser.set_defaults(func=cmd_harvest)
