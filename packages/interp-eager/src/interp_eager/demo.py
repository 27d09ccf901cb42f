"""A two-minute tour: capture, logit lens, attention and steering.

    python -m interp_eager.demo [MODEL]

Without an argument it runs on ``interp:tiny``, the small model that ships with interp-core
(4 layers, trained on a corpus of simple facts; nothing is downloaded): the logit lens shows
" Paris" forming in its later layers, one of its heads is an induction head, and adding the
difference between the Germany and France residuals makes it answer " Berlin". ``MODEL`` may be
any local HF model directory or hub id; the same steps run on it.
"""

from __future__ import annotations

import argparse
import sys
from typing import cast

import torch

from interp_engine import (
    Address,
    SteeringSpec,
    Write,
    capture_attention,
    load_model,
    run_with_cache,
    sync_model,
)

PROMPT = "The capital of France is"
CONTRAST = "The capital of Germany is"


def _bar(value: float, top: float, width: int = 24) -> str:
    filled = round(width * value / top) if top > 0 else 0
    return "#" * filled + "." * (width - filled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="interp:tiny", help="default: interp:tiny, the shipped model")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--contrast", default=CONTRAST, help="the prompt whose residual the steering adds")
    args = parser.parse_args(argv)

    model = load_model(args.model, backend="eager")
    info = model.info
    tokens = model.to_tokens(args.prompt)
    words = model.to_str_tokens(tokens)
    print(f"model: {args.model} ({info.architecture}, {info.n_layers} layers, d_model {info.d_model}, ", end="")
    print(f"{info.n_heads} heads)")
    print(f"prompt: {args.prompt!r} -> {len(words)} tokens {words}\n")

    # 1. capture: the residual stream's size through the layers
    points = [Address("embed")] + [Address("resid_post", layer) for layer in range(info.n_layers)]
    cache = run_with_cache(model, tokens, points)
    print("1. capture - residual norm at the last token, layer by layer")
    norms = [float(cache[p][0, -1].norm()) for p in points]
    for point, norm in zip(points, norms, strict=True):
        print(f"   {point!s:>14}  {norm:8.2f}  {_bar(norm, max(norms))}")

    # 2. logit lens: decode every layer's residual at the last position
    sync = sync_model(model)
    print("\n2. logit lens - top next-token guesses decoded from each layer (last position)")
    for point in points:
        logits = cast(torch.Tensor, sync.decode_residuals(cache[point][0, -1]))
        top = logits.softmax(-1).topk(3)
        guesses = ", ".join(
            f"{model.to_string([int(i)])!r} {float(p):.2f}" for p, i in zip(top.values, top.indices, strict=True)
        )
        print(f"   {point!s:>14}  {guesses}")

    # 3. attention: induction heads, on a run of random tokens shown twice
    half = torch.randint(2, info.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    n = half.shape[1]
    attn = capture_attention(model, torch.cat([half, half], dim=1), list(range(info.n_layers)))
    queries = torch.arange(n, 2 * n)
    print("\n3. attention - induction score per head: mean attention from the second copy's token t")
    print(f"   to the first copy's token t+1 (30 random tokens shown twice; chance ~{1 / (1.5 * n):.2f})")
    for layer in range(info.n_layers):
        pattern = attn[Address("attn_pattern", layer)][0]
        scores = pattern[:, queries, queries - n + 1].mean(-1).tolist()
        print(f"   layer {layer}  " + "  ".join(f"head {h} {s:4.2f} {_bar(s, 1.0, 10)}" for h, s in enumerate(scores)))

    # 4. steering: add (contrast - prompt) at a middle layer's last position
    point = Address("resid_post", info.n_layers // 2)
    prompt_ids = tokens[0].tolist()
    contrast = sync.capture(model.to_tokens(args.contrast)[0].tolist(), [point])[point][-1]
    direction = contrast - cache[point][0, -1]
    spec = SteeringSpec([Write(point, direction, op="add", positions=[-1])])
    plain = sync.generate(prompt_ids, max_tokens=6)
    steered = sync.generate(prompt_ids, max_tokens=6, steering_spec=spec)
    print(f"\n4. steering - add {point} of {args.contrast!r} minus that of the prompt, at the last token")
    print(f"   plain:   {args.prompt!r} + {plain.text!r}")
    print(f"   steered: {args.prompt!r} + {steered.text!r}")

    sync.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
