"""A two-minute tour on a local model: capture, logit lens, attention and steering.

    python -m interp_eager.demo [MODEL_DIR]

Without an argument it builds a small GPT-2-shaped model with random weights and a locally
trained tokenizer under ``.cache/demo-model`` (nothing is downloaded). The numbers printed are
true for that model; they are meaningful as mechanics, not as language.
"""

from __future__ import annotations

import argparse
import pathlib
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

PROMPT = "The quick brown fox jumps over the lazy dog because"


def _bar(value: float, top: float, width: int = 24) -> str:
    filled = round(width * value / top) if top > 0 else 0
    return "#" * filled + "." * (width - filled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a local HF model directory or hub id (default: build one)")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args(argv)

    path = args.model
    if path is None:
        from .testing import build_tiny_model

        path = build_tiny_model("gpt2", pathlib.Path(".cache") / "demo-model", n_layers=4, d_model=128)
        print(f"built a 4-layer, 128-wide GPT-2-shaped model with random weights in {path}\n")

    model = load_model(path, backend="eager")
    info = model.info
    tokens = model.to_tokens(args.prompt)
    words = model.to_str_tokens(tokens)
    print(f"model: {info.architecture}, {info.n_layers} layers, d_model {info.d_model}, {info.n_heads} heads")
    print(f"prompt: {args.prompt!r} -> {len(words)} tokens\n")

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
        probs = logits.softmax(-1)
        top = probs.topk(3)
        guesses = ", ".join(
            f"{model.to_string([int(i)])!r} {float(p):.2f}" for p, i in zip(top.values, top.indices, strict=True)
        )
        print(f"   {point!s:>14}  {guesses}")

    # 3. attention: where the last token looks, in layer 0
    pattern = capture_attention(model, tokens, [0])[Address("attn_pattern", 0)][0]
    print("\n3. attention - layer 0, mean over heads, from the last token to each earlier token")
    row = pattern.mean(0)[-1]
    for word, weight in zip(words, row.tolist(), strict=True):
        print(f"   {word!r:>14}  {weight:5.2f}  {_bar(weight, float(row.max()))}")

    # 4. steering: add a direction to the residual stream and watch the generation change
    prompt_ids = tokens[0].tolist()
    plain = sync.generate(prompt_ids, max_tokens=12, ignore_eos=True)
    direction = cache[Address("resid_post", 0)][0].mean(0)
    spec = SteeringSpec([Write(Address("resid_post", 0), direction, op="add", scale=-4.0)])
    steered = sync.generate(prompt_ids, max_tokens=12, steering_spec=spec, ignore_eos=True)
    print("\n4. steering - subtract 4x the mean layer-0 residual at every position")
    print(f"   plain:   {plain.text!r}")
    print(f"   steered: {steered.text!r}")

    sync.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
