"""``interp capture``: batch capture (activations and feature readouts) into one Cache file, resumable.

Each prompt's activations are written as soon as they exist to ``OUT.parts/NNNNNN.safetensors``
(one Cache of batch 1, written atomically), next to a ``manifest.json`` naming the model, the
points and a hash of the prompts. Re-running the same command skips the prompts already there;
when all are done they are joined into ``OUT`` (right-padded with zeros, ``Cache.lengths`` holding
each prompt's real token count) and the parts directory is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from .._sync import SyncModel
from ..addresses._address import Address
from ..protocol._protocol import Results
from ..results._cache import Cache
from ..sae._readouts import Features
from ._common import (
    CHAT_HELP,
    Progress,
    UserError,
    add_model_options,
    add_sae_option,
    check_readouts,
    opened,
    parse_points,
    read_chat,
)

MANIFEST = "manifest.json"


def read_prompts(args: argparse.Namespace) -> list[str]:
    given = [args.text is not None, args.input is not None, args.chat is not None]
    if sum(given) != 1:
        hint = "; TEXT goes before --points, which takes several values" if not any(given) else ""
        raise UserError(
            f"give either TEXT or --input FILE (one prompt per line) or --chat FILE.json, one of them{hint}"
        )
    if args.chat is not None:
        return []  # the chat's rendered text, once the model has formatted it
    if args.text is not None:
        prompts = [args.text]
    else:
        path = pathlib.Path(args.input)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise UserError(f"--input file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --input {path}: {exc}") from None
        prompts = [line for line in lines if line.strip()]
    if not prompts or not all(p.strip() for p in prompts):
        raise UserError("no prompts to capture (the text or every line of --input is empty)")
    return prompts


def parts_dir(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(out.name + ".parts")


def shard_path(parts: pathlib.Path, index: int) -> pathlib.Path:
    return parts / f"{index:06d}.safetensors"


def _manifest(args: argparse.Namespace, prompts: Sequence[str], points: Sequence[Address | Features]) -> dict[str, Any]:
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    manifest = {
        "model": str(args.model),
        "backend": args.backend,
        "points": [str(p) for p in points],
        "n_prompts": len(prompts),
        "prompts_sha256": digest,
    }
    if args.saes:  # readouts resume only with the same SAEs
        manifest["saes"] = {name: os.path.abspath(p) if os.path.exists(p) else p for name, p in args.saes}
    if args.adapter is not None:  # and only under the same adapter
        manifest["adapter"] = os.path.abspath(args.adapter) if os.path.exists(args.adapter) else args.adapter
    return manifest


def prepare_parts(parts: pathlib.Path, manifest: dict[str, Any], overwrite: bool) -> set[int]:
    """The indices already captured by an interrupted run of the same command (a fresh parts
    directory when there is none, or when ``overwrite``)."""
    if overwrite and parts.exists():
        shutil.rmtree(parts)
    if parts.exists():
        try:
            previous = json.loads((parts / MANIFEST).read_text())
        except (OSError, ValueError):
            previous = None
        if previous != manifest:
            raise UserError(
                f"{parts} holds a capture of other prompts, points or model; "
                "re-run the same command to resume it, or pass --overwrite to start again"
            )
        return {i for i in range(manifest["n_prompts"]) if shard_path(parts, i).exists()}
    parts.mkdir(parents=True)
    (parts / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return set()


def write_shard(parts: pathlib.Path, index: int, acts: Results, n_tokens: int, n_layers: int | None = None) -> None:
    """One prompt's activations (and readouts) as a batch-1 Cache, written atomically."""
    final = shard_path(parts, index)
    tmp = final.with_suffix(".tmp")
    batched = {a: v[None] for a, v in acts.items()}
    Cache(batched, lengths=torch.tensor([n_tokens]), n_layers=n_layers).save(tmp)
    os.replace(tmp, final)


def join_parts(parts: pathlib.Path, n: int, out: pathlib.Path, metadata: dict[str, str]) -> Cache:
    """The ``n`` shards joined along the batch axis (:meth:`Cache.concat`: right-padded to the
    longest prompt, lengths kept) into ``out``, written atomically; the parts are removed."""
    cache = Cache.concat(Cache.load(shard_path(parts, index)) for index in range(n))
    tmp = out.with_name(out.name + ".tmp")
    cache.save(tmp, metadata=metadata)
    os.replace(tmp, out)
    shutil.rmtree(parts)
    return cache


def capture_chunk(
    sync: SyncModel, rows: list[list[int]], points: list[Address | Features], adapter: str | None = None
) -> list[Results]:
    """Several prompts at once: concurrent requests, which a serving backend batches (under
    ``adapter``, a LoRA adapter's folder or shipped name, if given)."""
    extra: dict[str, Any] = {} if adapter is None else {"adapter": adapter}

    async def gather() -> list[Results]:
        return list(await asyncio.gather(*(sync.model.capture(r, points, **extra) for r in rows)))

    return sync.run(gather)


def cmd_capture(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    chat_file = read_chat(args.chat) if args.chat is not None else None
    points = parse_points(args.points)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    out = pathlib.Path(args.out)
    parts = parts_dir(out)
    if out.exists() and not parts.exists() and not args.overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it")
    with opened(args) as sync:
        check_readouts(sync.model, points)
        n_layers = sync.model.info.n_layers
        resolved = list(dict.fromkeys(p.resolve(n_layers) if isinstance(p, Address) else p for p in points))
        chats: list[Any] = []
        if chat_file is not None:  # one prompt: the messages as the chat template formats them
            chats = [chat_file.tokens(sync)]
            prompts = [chats[0].text]
        ids = [list(chat) for chat in chats] or [sync.to_tokens(p)[0].tolist() for p in prompts]
        done = prepare_parts(parts, _manifest(args, prompts, resolved), args.overwrite)
        todo = [i for i in range(len(prompts)) if i not in done]
        progress = Progress(len(prompts), len(done), "capture", quiet=args.quiet)
        try:
            for start in range(0, len(todo), args.batch_size):
                chunk = todo[start : start + args.batch_size]
                captured = capture_chunk(sync, [ids[i] for i in chunk], resolved, args.adapter)
                for index, acts in zip(chunk, captured, strict=True):
                    write_shard(parts, index, acts, len(ids[index]), n_layers)
                    progress.update()
        finally:
            progress.close()
    metadata = {
        "interp.prompts": json.dumps(prompts),
        "interp.token_ids": json.dumps(ids),
        "interp.model": str(args.model),
    }
    if args.adapter is not None:
        metadata["interp.adapter"] = str(args.adapter)
    if chats:
        metadata["interp.chat"] = json.dumps([chat.to_json() for chat in chats])
    cache = join_parts(parts, len(prompts), out, metadata)
    shapes = ", ".join(f"{a} {list(t.shape)}" for a, t in cache.items())
    print(f"wrote {out}: {len(prompts)} prompts, {shapes}")
    for spec, readout in cache.features().items():
        if readout.ids is not None:
            print(f"{spec}: {_most_read(readout.ids)}")
    return 0


def _most_read(ids: torch.Tensor, n: int = 8) -> str:
    """The features read on the most tokens (ids ``-1``, nothing fired or padding, left out)."""
    fired = ids[ids >= 0]
    if fired.numel() == 0:
        return "no feature fired"
    counts = torch.bincount(fired)
    top = counts.topk(min(n, int((counts > 0).sum())))
    listed = ", ".join(f"{int(i)} ({int(c)} tokens)" for c, i in zip(top.values, top.indices, strict=True))
    return f"features read on the most tokens: {listed}"


def add_capture(sub: Any) -> None:
    parser = sub.add_parser(
        "capture",
        help="capture activations of one text or a file of prompts into a Cache file",
        description="Capture activations at --points for TEXT, every non-empty line of --input, or the chat "
        "messages of --chat (formatted by the model's chat template; its spans kept in the metadata, interp.chat), "
        "into one safetensors file in the Cache format (Cache.load reads it): values "
        "[batch, pos, width] (attention [batch, heads, q, k]) right-padded with zeros, and "
        "cache.lengths holding each prompt's real token count. Feature readouts of SAEs attached "
        "with --sae (features:NAME:top8) are stored beside them: cache['features:NAME:top8'] has "
        "ids and values [batch, pos, k] and the error norm [batch, pos]. The prompts and their token ids "
        "are kept in the file's metadata (interp.prompts, interp.token_ids). Progress is kept in "
        "OUT.parts/ as each prompt finishes: re-run the same command after an interruption to "
        "continue where it stopped.",
        epilog="example: interp capture path/to/model --input prompts.txt "
        "--points resid_post.5,blocks.3.hook_mlp_out --out acts.safetensors; with an SAE: "
        "interp capture path/to/model TEXT --points resid_post.2 features:res:top8 --sae res=path/to/sae",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    parser.add_argument("text", metavar="TEXT", nargs="?", help="one prompt (or use --input)")
    parser.add_argument("--input", metavar="FILE", help="a text file with one prompt per line (blank lines skipped)")
    parser.add_argument("--chat", metavar="FILE.json", help=CHAT_HELP)
    parser.add_argument(
        "--points",
        required=True,
        nargs="+",
        help="addresses, comma-separated or as several arguments: resid_post.5,mlp_post.-1,... (TransformerLens "
        "names too), and feature readouts of an SAE given with --sae: features:NAME:top8, features:NAME:ids=3,17, "
        "features:NAME:dense",
    )
    parser.add_argument("--out", default="acts.safetensors", help="output file (default: acts.safetensors)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts sent to the model at once (8)")
    parser.add_argument(
        "--adapter",
        metavar="PATH",
        help="capture under a LoRA adapter: a PEFT adapter folder or a shipped one (interp:tiny-lora); on vllm, "
        "load with -o enable_lora=true",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT and discard unfinished progress")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sae_option(parser)
    add_model_options(parser)
    parser.set_defaults(func=cmd_capture)
