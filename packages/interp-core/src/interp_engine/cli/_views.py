"""``interp lens`` and ``interp attention``: the logit lens and attention patterns of one text."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import plot
from .._sync import SyncModel
from ..addresses._address import Address
from ..results._lens import MAX_LENS_TOP_K, LensRequest, LensResult, LensTopK
from ._common import (
    UserError,
    add_model_options,
    add_plot_options,
    add_prompt_arguments,
    describe_chat,
    opened,
    plots_wanted,
    prompt_tokens,
    read_prompt_source,
    save_figure,
    show_token,
    table,
)
from ._features import plot_class

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


def select_positions(text: str | None, n: int, chat: Any = None) -> list[int]:
    """``--positions``: comma-separated indices (negative from the end), or with ``--chat`` a
    chat span name (``user[-1]``, ``assistant.last``, ``system.turn``)."""
    if not text:
        return list(range(n))
    if chat is not None and not _is_index_list(text):
        named: list[int] = sorted(set(chat.positions(text.strip())))
        if not named:
            raise UserError(f"--positions {text.strip()} selects no token of this chat")
        return named
    out = []
    for part in text.split(","):
        try:
            index = int(part)
        except ValueError:
            hint = " (or, with --chat, a span name such as user[-1])" if chat is None else ""
            raise UserError(f"--positions takes comma-separated integers{hint}, got {part!r}") from None
        if not -n <= index < n:
            raise UserError(f"--positions: {index} is outside the {n}-token text (valid: {-n}..{n - 1})")
        out.append(index % n)
    return out


def _is_index_list(text: str) -> bool:
    return all(part.strip().lstrip("-").isdigit() for part in text.split(","))


def cmd_lens(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {args.top_k}")
    chat_file = read_prompt_source(args)
    if args.generate is not None:
        return lens_generate(args, chat_file)
    if args.layers is not None:
        raise UserError("--layers chooses the layers read with --generate N")
    figure = plot_class(args.plot) if args.plot else None  # a bad suffix: one line, before the model loads
    with opened(args) as sync:
        tokens = prompt_tokens(sync, args, chat_file)
        ids = list(tokens)
        chat = tokens if not isinstance(tokens, list) else None
        positions = select_positions(args.positions, len(ids), chat)
        lens = logit_lens(sync, ids)
        if chat is not None:
            print(
                f"chat of {_count(len(chat.messages), 'message')} ({args.chat}):\n{describe_chat(chat, lens.tokens)}\n"
            )
        print(f"logit lens of {len(ids)} tokens: top-1 next token (probability) decoded from each layer\n")
        print(lens_grid(sync, lens, positions))
        last = positions[-1]
        print(f"\ntop {args.top_k} at position {last} ({show_token(lens.tokens[last])}):\n")
        print(lens_top_k(sync, lens, last, min(args.top_k, lens.probs.shape[-1])))
        if figure is not None:
            plot_lens(sync, lens, positions, str(pathlib.Path(args.plot).parent), pathlib.Path(args.plot).name)
        elif not args.plot and plots_wanted(args):
            plot_lens(sync, lens, positions, args.out, "lens.png")
    return 0


# -- the lens during generation ------------------------------------------------------------------

MAX_DEFAULT_LAYERS = 8
"""``--generate`` without ``--layers`` reads every layer of a model this deep, else this many."""
CELL = 20
"""Width of a layer's cell in the live table: the top-1 token and its probability."""


def parse_layers(text: str | None, n_layers: int) -> list[int]:
    """``--layers 0,2,-1`` (negative from the end); default: every layer, or on a deeper model
    ``MAX_DEFAULT_LAYERS`` spread evenly, the last included."""
    if text is None:
        if n_layers <= MAX_DEFAULT_LAYERS:
            return list(range(n_layers))
        step = (n_layers - 1) / (MAX_DEFAULT_LAYERS - 1)
        return sorted({round(i * step) for i in range(MAX_DEFAULT_LAYERS)})
    layers = []
    for part in text.split(","):
        try:
            layer = int(part)
        except ValueError:
            raise UserError(f"--layers takes comma-separated layer indices, got {part!r}") from None
        if not -n_layers <= layer < n_layers:
            raise UserError(
                f"--layers: {layer} is out of range for a model with {n_layers} layers "
                f"(valid: {-n_layers}..{n_layers - 1})"
            )
        layers.append(layer % n_layers)
    if len(set(layers)) != len(layers):
        raise UserError(f"--layers names a layer twice: {text} (negative layers count from the end)")
    return layers


def lens_prompt_positions(text: str | None, n: int, chat: Any) -> Any:
    """``--positions`` with ``--generate``: the prompt positions whose lens is shown first
    (indices, or with ``--chat`` a span name, passed to the lens as is)."""
    if not text:
        return None
    if chat is not None and not _is_index_list(text):
        return text.strip()
    return select_positions(text, n)


def live_header(sync: SyncModel, layers: Sequence[int]) -> str:
    cells = ["step".ljust(4), "pos".ljust(5), "token".ljust(16)] + [f"L{layer}".ljust(CELL) for layer in layers]
    rule = ["-" * 4, "-" * 5, "-" * 16] + ["-" * CELL for _ in layers]
    return "  ".join(cells).rstrip() + "\n" + "  ".join(rule)


def live_row(sync: SyncModel, index: int, token: str, lens: LensTopK) -> str:
    """One generated token: its step, position and text, then each layer's top-1 and probability."""
    top_ids = [int(lens.ids[row, 0]) for row in range(len(lens.layers))]
    names = sync.to_str_tokens(top_ids)
    cells = [
        f"{show_token(name, CELL - 6)} {float(lens.probs[row, 0]):.2f}".ljust(CELL) for row, name in enumerate(names)
    ]
    return "  ".join(
        [str(index).ljust(4), str(lens.position).ljust(5), show_token(token, 16).ljust(16), *cells]
    ).rstrip()


def lens_generate(args: argparse.Namespace, chat_file: Any) -> int:
    """``interp lens MODEL TEXT --generate N``: generate N tokens reading the lens at each step,
    one table row per token as it arrives, then a plot of the whole generation."""
    if args.generate < 1:
        raise UserError(f"--generate must be at least 1, got {args.generate}")
    if args.top_k > MAX_LENS_TOP_K:
        raise UserError(f"--top-k with --generate is at most {MAX_LENS_TOP_K}, got {args.top_k}")
    figure = plot_class(args.plot) if args.plot else None  # a bad suffix: one line, before the model loads
    plot_path = pathlib.Path(args.plot) if args.plot else pathlib.Path(args.out) / "lens_generate.png"
    with opened(args) as sync:
        info = sync.model.info
        layers = parse_layers(args.layers, info.n_layers)
        tokens = prompt_tokens(sync, args, chat_file)
        ids = list(tokens)
        chat = tokens if not isinstance(tokens, list) else None
        if len(ids) + args.generate > info.n_ctx:
            raise UserError(f"{len(ids)} prompt tokens + --generate {args.generate} exceed the context of {info.n_ctx}")
        request = LensRequest(layers, top_k=args.top_k, positions=lens_prompt_positions(args.positions, len(ids), chat))
        prompt_strs = sync.to_str_tokens(ids)
        if chat is not None:
            print(
                f"chat of {_count(len(chat.messages), 'message')} ({args.chat}):\n{describe_chat(chat, prompt_strs)}\n"
            )
        print(
            f"generating {args.generate} tokens after {len(ids)} prompt tokens; the logit lens at each step: "
            "the top-1 next token (probability) decoded from each layer's resid_post\n"
        )
        steps: list[LensTopK] = []
        generated: list[str] = []
        prompt_lens: LensResult | None = None
        for index, step in enumerate(sync.stream(tokens, max_tokens=args.generate, lens=request)):
            if step.lens is None:
                raise UserError(f"the {sync.model.backend} backend returned no lens for a generated token")
            if index == 0:
                prompt_lens = step.prompt_lens
                if prompt_lens is not None:
                    print(prompt_lens_grid(sync, prompt_lens, prompt_strs) + "\n")
                print(live_header(sync, layers), flush=True)
            print(live_row(sync, index, step.text, step.lens), flush=True)
            steps.append(step.lens)
            generated.append(step.text)
        print(f"\ngenerated: {''.join(generated)!r}")
        if steps and (figure is not None if args.plot else plots_wanted(args)):
            read = {lens.position: lens for lens in steps}
            for position in prompt_lens.positions if prompt_lens is not None else ():
                read.setdefault(position, prompt_lens.at(position))  # type: ignore[union-attr]
            result = LensResult.stack(list(read.values()))
            fig = plot.lens(
                result,
                decode=sync.to_str_tokens,
                tokens=prompt_strs + generated,
                title=f"logit lens during generation ({len(steps)} tokens)",
            )
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(plot_path, dpi=110, bbox_inches="tight")
            print(f"wrote {plot_path}")
    return 0


def prompt_lens_grid(sync: SyncModel, lens: LensResult, tokens: Sequence[str]) -> str:
    """The lens at the prompt positions asked (``--positions``): layers (rows) x positions."""
    headers = ["layer"] + [f"{p}:{show_token(tokens[p], 12)}" for p in lens.positions]
    rows = []
    for row, layer in enumerate(lens.layers):
        names = sync.to_str_tokens([int(i) for i in lens.ids[row, :, 0]])
        cells = [f"{show_token(name, 12)} {float(p):.2f}" for name, p in zip(names, lens.probs[row, :, 0], strict=True)]
        rows.append([f"resid_post.{layer}", *cells])
    return f"the prompt's lens at {_count(len(lens.positions), 'position')}:\n\n" + table(headers, rows)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
    add_prompt_arguments(parser)
    parser.add_argument(
        "--top-k", type=int, default=5, help="tokens shown per layer at the last position; with --generate, kept (5)"
    )
    parser.add_argument(
        "--positions",
        metavar="I,J,..",
        help="only these token positions (negative: from the end; with --chat also a span name such as user[-1]); "
        "with --generate, the prompt positions whose lens is shown first",
    )
    parser.add_argument(
        "--generate",
        type=int,
        metavar="N",
        help="generate N tokens (greedy) and print the lens of each as it is produced: a row per token with each "
        "layer's top-1 next token and probability; then a plot (--plot)",
    )
    parser.add_argument(
        "--layers",
        metavar="L,M,..",
        help=f"with --generate: the layers read (negative from the end; default every layer, or "
        f"{MAX_DEFAULT_LAYERS} spread over a deeper model)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="the plot's file (default: OUT/lens.png, with --generate OUT/lens_generate.png); drawn even with "
        "--no-plots",
    )
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
    chat_file = read_prompt_source(args)
    with opened(args) as sync:
        info = sync.model.info
        if not -info.n_layers <= args.layer < info.n_layers:
            raise UserError(
                f"--layer {args.layer} is out of range for a model with {info.n_layers} layers "
                f"(valid: {-info.n_layers}..{info.n_layers - 1})"
            )
        layer = args.layer % info.n_layers
        ids = list(prompt_tokens(sync, args, chat_file))
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
    add_prompt_arguments(parser)
    parser.add_argument("--layer", type=int, required=True, help="the layer (negative: from the end)")
    add_plot_options(parser, "interp-out")
    add_model_options(parser)
    parser.set_defaults(func=cmd_attention)
