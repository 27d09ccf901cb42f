"""``interp lens`` and ``interp attention``: the logit lens and attention patterns of one text."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import plot
from .._address import Address
from .._sync import SyncModel
from ._common import (
    UserError,
    add_model_options,
    add_plot_options,
    opened,
    plots_wanted,
    prompt_ids,
    save_figure,
    show_token,
    table,
)

# -- the logit lens -----------------------------------------------------------------------------


@dataclass
class Lens:
    """Each layer's residual stream decoded through the final norm and unembedding."""

    points: list[Address]  # embed, resid_post.0 .. resid_post.N-1
    tokens: list[str]  # the input tokens
    logits: torch.Tensor  # [len(points), n_tokens, vocab]
    probs: torch.Tensor  # their softmax


def logit_lens(sync: SyncModel, ids: list[int]) -> Lens:
    n_layers = sync.model.info.n_layers
    points = [Address("embed")] + [Address("resid_post", layer) for layer in range(n_layers)]
    acts = sync.capture(ids, points)
    stacked = torch.stack([acts[p] for p in points])  # [points, n, d_model]
    logits = cast(torch.Tensor, sync.decode_residuals(stacked))
    return Lens(points, sync.to_str_tokens(ids), logits.float(), logits.float().softmax(-1))


def lens_grid(sync: SyncModel, lens: Lens, positions: list[int]) -> str:
    """Top-1 prediction (and its probability) per layer (rows) and position (columns)."""
    top = lens.probs.max(-1)
    headers = ["layer"] + [f"{i}:{show_token(lens.tokens[i], 12)}" for i in positions]
    rows = []
    for row, point in enumerate(lens.points):
        cells = [
            f"{show_token(sync.to_str_tokens([int(top.indices[row, i])])[0], 12)} {float(top.values[row, i]):.2f}"
            for i in positions
        ]
        rows.append([str(point), *cells])
    return table(headers, rows)


def lens_top_k(sync: SyncModel, lens: Lens, position: int, k: int) -> str:
    """The top-``k`` predictions at one position, layer by layer."""
    top = lens.probs[:, position].topk(k, dim=-1)
    rows = []
    for row, point in enumerate(lens.points):
        guesses = [
            f"{show_token(sync.to_str_tokens([int(i)])[0])} {float(p):.2f}"
            for p, i in zip(top.values[row], top.indices[row], strict=True)
        ]
        rows.append([str(point), *guesses])
    return table(["layer", *[f"top {j + 1}" for j in range(k)]], rows)


def plot_lens(sync: SyncModel, lens: Lens, positions: list[int], out_dir: str, name: str) -> None:
    fig = plot.logit_lens(
        lens.logits[:, positions],
        tokens=[lens.tokens[i] for i in positions],
        layers=[str(p) for p in lens.points],
        decode=sync.to_str_tokens,
        title="logit lens: the top-1 next token and its probability",
    )
    save_figure(fig, out_dir, name)


def select_positions(text: str | None, n: int) -> list[int]:
    if not text:
        return list(range(n))
    out = []
    for part in text.split(","):
        try:
            index = int(part)
        except ValueError:
            raise UserError(f"--positions takes comma-separated integers, got {part!r}") from None
        if not -n <= index < n:
            raise UserError(f"--positions: {index} is outside the {n}-token text (valid: {-n}..{n - 1})")
        out.append(index % n)
    return out


def cmd_lens(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {args.top_k}")
    with opened(args) as sync:
        ids = prompt_ids(sync, args.text)
        positions = select_positions(args.positions, len(ids))
        lens = logit_lens(sync, ids)
        print(f"logit lens of {len(ids)} tokens: top-1 next token (probability) decoded from each layer\n")
        print(lens_grid(sync, lens, positions))
        last = positions[-1]
        print(f"\ntop {args.top_k} at position {last} ({show_token(lens.tokens[last])}):\n")
        print(lens_top_k(sync, lens, last, min(args.top_k, lens.probs.shape[-1])))
        if plots_wanted(args):
            plot_lens(sync, lens, positions, args.out, "lens.png")
    return 0


def add_lens(sub: Any) -> None:
    parser = sub.add_parser(
        "lens",
        help="the logit-lens table (top tokens per layer and position) and a heatmap PNG",
        description="Decode every layer's residual stream through the final norm and unembedding "
        "(the logit lens): a table of the top-1 next token per layer and position, the top-k at "
        "the last position, and lens.png.",
        epilog="example: interp lens path/to/model 'The capital of France is' --top-k 3",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    parser.add_argument("text", metavar="TEXT", help="the text to read")
    parser.add_argument("--top-k", type=int, default=5, help="tokens shown per layer at the last position (5)")
    parser.add_argument("--positions", metavar="I,J,..", help="only these token positions (negative: from the end)")
    add_plot_options(parser, "interp-out")
    add_model_options(parser)
    parser.set_defaults(func=cmd_lens)


# -- attention -------------------------------------------------------------------------------------


def head_summary(pattern: torch.Tensor, tokens: list[str]) -> list[list[object]]:
    """Per head: mean attention to the previous token, to itself and to the first token, the mean
    entropy of its rows, and where the last token looks most."""
    heads, n, _ = pattern.shape
    rows: list[list[object]] = []
    idx = torch.arange(n)
    for head in range(heads):
        p = pattern[head]
        prev = float(p[idx[1:], idx[:-1]].mean()) if n > 1 else 0.0
        entropy = float(-(p.clamp_min(1e-12).log() * p).sum(-1).mean())
        target = int(p[-1].argmax())
        rows.append(
            [
                head,
                f"{prev:.2f}",
                f"{float(p.diagonal().mean()):.2f}",
                f"{float(p[:, 0].mean()):.2f}",
                f"{entropy:.2f}",
                f"{target}:{show_token(tokens[target])} {float(p[-1, target]):.2f}",
            ]
        )
    return rows


SUMMARY_HEADERS = ["head", "prev-token", "self", "first-token", "entropy", "last token looks at"]


def cmd_attention(args: argparse.Namespace) -> int:
    with opened(args) as sync:
        info = sync.model.info
        if not -info.n_layers <= args.layer < info.n_layers:
            raise UserError(
                f"--layer {args.layer} is out of range for a model with {info.n_layers} layers "
                f"(valid: {-info.n_layers}..{info.n_layers - 1})"
            )
        layer = args.layer % info.n_layers
        ids = prompt_ids(sync, args.text)
        tokens = sync.to_str_tokens(ids)
        pattern = sync.capture_attention(ids, [layer])[Address("attn_pattern", layer)]
        print(f"attention of layer {layer}: {pattern.shape[0]} heads over {len(ids)} tokens (rows: queries)\n")
        print(table(SUMMARY_HEADERS, head_summary(pattern, tokens)))
        if plots_wanted(args):
            title = f"attention patterns, layer {layer} (query rows, key columns)"
            save_figure(plot.attention(pattern, tokens=tokens, title=title), args.out, f"attention_L{layer}.png")
    return 0


def add_attention(sub: Any) -> None:
    parser = sub.add_parser(
        "attention",
        help="attention pattern heatmaps per head (PNG) and a short summary",
        description="Capture one layer's attention probabilities: a table per head (attention to "
        "the previous token, to itself and to the first token, mean entropy, where the last token "
        "looks) and attention_L<layer>.png with one heatmap per head.",
        epilog="example: interp attention path/to/model 'a b c d a b c d' --layer 1",
    )
    parser.add_argument("model", metavar="MODEL", help="a local model directory, hub id or interp:tiny")
    parser.add_argument("text", metavar="TEXT", help="the text to read")
    parser.add_argument("--layer", type=int, required=True, help="the layer (negative: from the end)")
    add_plot_options(parser, "interp-out")
    add_model_options(parser)
    parser.set_defaults(func=cmd_attention)
