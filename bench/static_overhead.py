"""What vllm-static's compiled taps cost, against plain compiled vLLM and the dynamic backend.

    python bench/static_overhead.py [--rounds 3] [--prompts 64] [--quick]

The workload of ``bench/vllm_overhead.py``: a GPT-2-shaped model (12 layers x 768, random
weights, built locally), ``--prompts`` prompts of 64-256 random tokens each generating 32
tokens, all submitted at once. Four engines live side by side in one process and the variants
alternate round by round:

- ``plain``: compiled vLLM (``enforce_eager=False``) with no taps, through ``AsyncLLM.generate``;
- ``static_capture_1`` / ``static_steer_1`` / ``static_capture_steer_1``: a vllm-static engine
  declaring ``resid_post.6`` as its only point and write: ``capture_generation`` of it,
  ``generate`` with an ``add`` there, and both in one request;
- ``static_capture_all``: a vllm-static engine declaring every layer's ``resid_post``;
- ``dynamic_capture_1`` / ``dynamic_steer_1``: the ``vllm`` backend (its default eager mode,
  hooks installed per step) doing the same as the static variants.

Throughput is generated tokens per second (median over rounds). Ends with ``RESULT`` lines:
static against plain compiled vLLM (target 0.95) and static against dynamic (target 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from vllm_overhead import GEN_TOKENS, build_model, capture_run, make_prompts, plain_run, steer_run, timed

from interp_engine import Address, SteeringSpec, Write, load_model


async def capture_steer_run(model: Any, prompts: list[list[int]], points: list[Address], spec: SteeringSpec) -> int:
    results = await asyncio.gather(
        *(
            model.capture_generation(p, points, max_tokens=GEN_TOKENS, steering_spec=spec, ignore_eos=True)
            for p in prompts
        )
    )
    return sum(len(completion.token_ids) for completion, _ in results)


async def main(args: argparse.Namespace) -> int:
    path = build_model()
    common = {"max_model_len": 512}
    plain = load_model(path, backend="vllm", enforce_eager=False, **common)
    info = plain.info
    middle = Address("resid_post", info.n_layers // 2)
    every = [Address("resid_post", i) for i in range(info.n_layers)]
    one = load_model(path, backend="vllm-static", static_points=[middle], static_writes=[middle], **common)
    full = load_model(path, backend="vllm-static", static_points=every, **common)
    dynamic = load_model(path, backend="vllm", **common)
    for model in (plain, one, full, dynamic):  # one at a time: compiling is CPU-bound
        await model.warmup()

    prompts = make_prompts(args.prompts, info.vocab_size)
    spec = SteeringSpec([Write(middle, torch.randn(info.d_model), op="add", scale=2.0)])
    variants: dict[str, Callable[[], Awaitable[int]]] = {
        "plain": lambda: plain_run(plain, prompts),
        "static_capture_1": lambda: capture_run(one, prompts, [middle]),
        "static_steer_1": lambda: steer_run(one, prompts, spec),
        "static_capture_steer_1": lambda: capture_steer_run(one, prompts, [middle], spec),
        "static_capture_all": lambda: capture_run(full, prompts, every),
        "dynamic_capture_1": lambda: capture_run(dynamic, prompts, [middle]),
        "dynamic_steer_1": lambda: steer_run(dynamic, prompts, spec),
    }
    if args.rounds:  # warm every path once
        for run in variants.values():
            await run()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            rates[name].append(await timed(variants[name]))
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in variants), flush=True)
    for model in (plain, one, full, dynamic):
        await model.shutdown()

    median = {name: statistics.median(values) if values else float("nan") for name, values in rates.items()}
    print()
    print(f"{'variant':<24} {'tok/s (median)':>15} {'vs plain':>9}")
    for name, rate in median.items():
        print(f"{name:<24} {rate:>15.1f} {rate / median['plain']:>9.3f}")
    print()

    def ratio(a: str, b: str) -> float:
        return median[a] / median[b]

    print(f"RESULT static_capture_1_vs_plain {ratio('static_capture_1', 'plain'):.3f} (target 0.95)")
    print(f"RESULT static_steer_1_vs_plain {ratio('static_steer_1', 'plain'):.3f} (target 0.95)")
    print(f"RESULT static_capture_steer_1_vs_plain {ratio('static_capture_steer_1', 'plain'):.3f} (target 0.95)")
    print(f"RESULT static_capture_all_vs_plain {ratio('static_capture_all', 'plain'):.3f} (target -)")
    print(f"RESULT static_vs_dynamic_capture_1 {ratio('static_capture_1', 'dynamic_capture_1'):.3f} (target 1.50)")
    print(f"RESULT static_vs_dynamic_steer_1 {ratio('static_steer_1', 'dynamic_steer_1'):.3f} (target 1.50)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 prompts (a smoke test)")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.prompts = 1, 8
    sys.exit(asyncio.run(main(ns)))
