"""``interp demo``: capture, logit lens, attention and steering on one model, as tables and PNGs."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .._address import Address
from .._errors import UnsupportedAddress
from .._steering import SteeringSpec, Write
from .._sync import SyncModel
from ._common import (
    DEFAULT_MODEL,
    UserError,
    add_model_options,
    add_plot_options,
    bar,
    figure_class,
    opened,
    prompt_ids,
    show_token,
    table,
)
from ._views import lens_top_k, logit_lens, plot_heads, plot_lens

PROMPT = "The capital of France is"
CONTRAST = "The capital of Germany is"


def repeated_random(sync: SyncModel, length: int, seed: int) -> tuple[list[int], int]:
    """A random block of ``length`` tokens shown twice (after any BOS), and where it starts."""
    info = sync.model.info
    prefix: list[int] = sync.to_tokens("")[0].tolist()  # the tokenizer's BOS, if it adds one
    generator = torch.Generator().manual_seed(seed)
    low = min(100, info.vocab_size // 2)
    block = torch.randint(low, info.vocab_size, (length,), generator=generator).tolist()
    return prefix + block + block, len(prefix)


def head_scores(
    sync: SyncModel, ids: list[int], start: int, layers: list[int], spec: SteeringSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of ``layers``, ``[len(layers), heads]`` each: the induction score (mean attention
    from each token of the second copy to the token after its earlier copy) and the
    previous-token score (mean attention to the previous token), under an optional steering spec."""
    length = (len(ids) - start) // 2
    acts = sync.capture_attention(ids, layers, steering_spec=spec)
    queries = torch.arange(start + length, start + 2 * length)
    everyone = torch.arange(start + 1, start + 2 * length)
    induction = torch.stack(
        [acts[Address("attn_pattern", layer)][:, queries, queries - length + 1].mean(-1) for layer in layers]
    )
    previous = torch.stack(
        [acts[Address("attn_pattern", layer)][:, everyone, everyone - 1].mean(-1) for layer in layers]
    )
    return induction, previous


def induction_scores(sync: SyncModel, length: int, seed: int) -> tuple[torch.Tensor, list[int], int]:
    """Every head's induction score on a repeated random sequence (an induction head's
    signature): ``[layers, heads]``, the ids, the offset."""
    ids, start = repeated_random(sync, length, seed)
    scores, _ = head_scores(sync, ids, start, list(range(sync.model.info.n_layers)))
    return scores, ids, start


def top_next(sync: SyncModel, logits: torch.Tensor, k: int) -> str:
    probs = logits.float().softmax(-1).topk(k)
    return ", ".join(
        f"{show_token(sync.to_str_tokens([int(i)])[0])} {float(p):.2f}"
        for p, i in zip(probs.values, probs.indices, strict=True)
    )


def section_capture(sync: SyncModel, ids: list[int]) -> list[Address]:
    info = sync.model.info
    points = [Address("embed")] + [Address("resid_post", layer) for layer in range(info.n_layers)]
    acts = sync.capture(ids, points)
    norms = [float(acts[p][-1].norm()) for p in points]
    print("1. capture: the residual stream's norm at the last token, layer by layer\n")
    rows = [[p, f"{n:.2f}", bar(n, max(norms))] for p, n in zip(points, norms, strict=True)]
    print(table(["address", "norm", ""], rows))
    return points


def section_attention(sync: SyncModel, length: int, seed: int) -> tuple[list[int], int, tuple[int, int], float] | None:
    print(
        f"\n3. attention: induction score of each head on {length} random tokens repeated "
        "(mean attention from a token to the one after its earlier copy; 1.0 is a perfect induction head)\n"
    )
    try:
        scores, rand_ids, start = induction_scores(sync, length, seed)
    except UnsupportedAddress as exc:
        print(f"   skipped: {exc}")
        return None
    best = divmod(int(scores.argmax()), scores.shape[1])
    rows = [[f"layer {i}", *[f"{float(s):.2f}" for s in scores[i]]] for i in range(scores.shape[0])]
    print(table(["", *[f"head {h}" for h in range(scores.shape[1])]], rows))
    print(f"\n   strongest: layer {best[0]} head {best[1]} ({float(scores[best]):.2f})")
    return rand_ids, start, best, float(scores[best])


def section_heads(
    sync: SyncModel, rand_ids: list[int], start: int, best: tuple[int, int], score: float, n_ablate: int
) -> None:
    """Zero-ablate the strongest previous-token heads below the induction head, one at a time,
    and show what is left of its induction score (the circuit: a previous-token head feeds it)."""
    layer, head = best
    print(
        f"\n4. heads: zero-ablate one earlier head at a time (attn_z set to 0 for that head) and measure "
        f"layer {layer} head {head}'s induction score again ({score:.2f} unablated)\n"
    )
    if layer == 0:
        print("   skipped: the strongest induction head is in layer 0; no earlier head can feed it")
        return
    info = sync.model.info
    _, previous = head_scores(sync, rand_ids, start, list(range(layer)))
    order = previous.flatten().argsort(descending=True)[:n_ablate].tolist()
    rows = []
    for index in order:
        src_layer, src_head = divmod(index, info.n_heads)
        off = SteeringSpec([Write(Address("attn_z", src_layer), torch.zeros(info.d_head), op="set", heads=[src_head])])
        after, _ = head_scores(sync, rand_ids, start, [layer], off)
        rows.append(
            [
                f"layer {src_layer} head {src_head}",
                f"{float(previous[src_layer, src_head]):.2f}",
                f"{float(after[0, head]):.2f}",
            ]
        )
    print(table(["ablated head", "previous-token score", f"induction score of {layer}.{head}"], rows))


def section_steering(sync: SyncModel, ids: list[int], contrast: str, layer: int, scale: float, max_tokens: int) -> None:
    point = Address("resid_post", layer)
    other = prompt_ids(sync, contrast)
    here = sync.capture(ids, [point])[point][-1]
    there = sync.capture(other, [point])[point][-1]
    spec = SteeringSpec([Write(point, there - here, op="add", scale=scale, positions=[-1])])
    logits = Address("logits")
    plain = sync.capture(ids, [logits])[logits][-1]
    steered = sync.capture(ids, [logits], steering_spec=spec)[logits][-1]
    print(
        f"\n5. steering: add {scale:g} x (resid_post.{layer} of {contrast!r} - resid_post.{layer} of the prompt), "
        "at the prompt's last token\n"
    )
    target = sync.capture(other, [logits])[logits][-1]
    rows = [
        ["prompt", top_next(sync, plain, 5)],
        ["steered prompt", top_next(sync, steered, 5)],
        ["contrast prompt", top_next(sync, target, 5)],
    ]
    print(table(["", "next token (top 5)"], rows))
    if max_tokens > 0:
        text_plain = "".join(step.text for step in sync.stream(ids, max_tokens=max_tokens))
        text_steered = "".join(step.text for step in sync.stream(ids, max_tokens=max_tokens, steering_spec=spec))
        print(f"\n   plain:   {text_plain!r}\n   steered: {text_steered!r}")


def cmd_demo(args: argparse.Namespace) -> int:
    figure = figure_class(args)
    with opened(args) as sync:
        info = sync.model.info
        layer = info.n_layers // 2 if args.layer is None else args.layer
        if not -info.n_layers <= layer < info.n_layers:
            raise UserError(f"--layer {layer} is out of range for a model with {info.n_layers} layers")
        layer %= info.n_layers
        ids = prompt_ids(sync, args.prompt)
        print(
            f"model {args.model} on {sync.model.backend}: {info.architecture}, {info.n_layers} layers, "
            f"d_model {info.d_model}, {info.n_heads} heads, vocab {info.vocab_size}"
        )
        print(f"prompt {args.prompt!r}: {len(ids)} tokens\n")

        section_capture(sync, ids)

        lens = logit_lens(sync, ids)
        print("\n2. logit lens: the next token decoded from each layer's residual stream (last token)\n")
        print(lens_top_k(sync, lens, len(ids) - 1, 3))

        induction = section_attention(sync, args.induction_length, args.seed)
        if induction is not None:
            section_heads(sync, *induction, args.ablate_heads)

        section_steering(sync, ids, args.contrast, layer, args.scale, args.max_tokens)

        if figure is not None:
            print()
            plot_lens(figure, sync, lens, list(range(len(ids))), args.out, "lens.png")
            if induction is not None:
                rand_ids, _, (layer_, head), score = induction
                pattern = sync.capture_attention(rand_ids, [layer_])[Address("attn_pattern", layer_)]
                title = f"layer {layer_} on repeated random tokens (head {head}: induction {score:.2f})"
                plot_heads(figure, pattern, sync.to_str_tokens(rand_ids), title, args.out, "induction.png")
    return 0


def add_demo(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="a tour: capture, logit lens, attention and steering, as tables and PNGs",
        description="A tour of one model: the residual stream's norm through the layers, the logit "
        "lens at the prompt's last token, each head's induction score on repeated random tokens, "
        "what zero-ablating the earlier previous-token heads leaves of the strongest one, and "
        "steering with the difference of two prompts' residuals. Writes lens.png and induction.png to --out.",
        epilog="example: interp demo --out demo-plots   (or: interp demo path/to/model --prompt '...')",
    )
    parser.add_argument(
        "model", metavar="MODEL", nargs="?", default=DEFAULT_MODEL, help=f"the model (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--prompt", default=PROMPT, help=f"the prompt (default: {PROMPT!r})")
    parser.add_argument(
        "--contrast", default=CONTRAST, help=f"the prompt whose residual the steering moves toward ({CONTRAST!r})"
    )
    parser.add_argument("--layer", type=int, help="the steering layer (default: the middle one)")
    parser.add_argument("--scale", type=float, default=1.0, help="the steering vector's scale (1.0)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated with and without steering (8)")
    parser.add_argument(
        "--induction-length", type=int, default=16, help="random tokens repeated for the induction test"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")
    parser.add_argument(
        "--ablate-heads", type=int, default=3, help="earlier heads ablated one at a time against the induction head (3)"
    )
    add_plot_options(parser, "interp-demo")
    add_model_options(parser)
    parser.set_defaults(func=cmd_demo)
