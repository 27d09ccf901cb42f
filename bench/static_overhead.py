"""What vllm-static's compiled taps cost, against plain compiled vLLM and the dynamic backend.

    python bench/static_overhead.py [--rounds 3] [--prompts 64] [--quick]

The workload of ``bench/vllm_overhead.py``: a GPT-2-shaped model (12 layers x 768, random
weights, built locally), ``--prompts`` prompts of 64-256 random tokens each generating 32
tokens, all submitted at once. Every request computes all of its prompt tokens, as new traffic
does: captures and steered requests never use vLLM's prefix cache, so plain requests carry a
unique ``cache_salt`` too (otherwise, with prefix caching on, vLLM's default, the rounds'
repeated prompts would skip their prefill only for plain requests).

The reference is one plain compiled vLLM engine (``enforce_eager=False``, no taps, requests
through ``AsyncLLM.generate``) that stays up for the whole run. The engines under test are
built one at a time next to it (on a 2-core machine more live engines slow each other), and in
each stage the reference's ``plain`` alternates round by round with the stage's variants:

1. a vllm-static engine declaring ``resid_post.6`` as its only point and write:
   ``static_capture_1`` (``capture_generation`` of it), ``static_steer_1`` (``generate`` with an
   ``add`` there), ``static_capture_steer_1`` (both in one request) and ``static_untapped``
   (plain requests on the static engine: what the compiled-in taps cost everyone else);
2. a vllm-static engine declaring every layer's ``resid_post``: ``static_capture_all``;
3. a vllm-static engine declaring ``attn_z.6`` as its only point and write: ``static_capture_z_1``
   (``capture_generation`` of every head's output there) and ``static_ablate_head_1``
   (``generate`` with head 0 of layer 6 zero-ablated);
4. the ``vllm`` backend (its default eager mode, hooks installed per step):
   ``dynamic_capture_1``, ``dynamic_steer_1`` and ``dynamic_untapped`` (plain requests: eager
   vLLM against compiled vLLM, the most static can gain over dynamic on this machine).

Throughput is generated tokens per second; each variant is reported against the reference's
median in its own stage. Static against dynamic divides the two stage-relative figures, so
drift between stages cancels. Ends with ``RESULT`` lines: static against plain compiled vLLM
(target 0.95) and static against dynamic (target 1.5).

The engines' processes allocate with a fixed malloc threshold and keep freed memory
(``bench/_workers.py``; ``--default-malloc``: glibc's defaults).
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
from _results import Results  # bench/, the script's own directory
from _workers import steady_malloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from vllm_overhead import GEN_TOKENS, build_model, capture_run, make_prompts, plain_run, steer_run, timed

from interp_engine import Address, SteeringSpec, Write, load_model

# the code whose speed the figures measure
MEASURES = ("packages/interp-vllm/src/interp_vllm", "packages/interp-core/src/interp_engine", "bench/_workers.py")
STATIC = (
    "static_capture_1",
    "static_steer_1",
    "static_capture_steer_1",
    "static_untapped",
    "static_capture_z_1",
    "static_ablate_head_1",
    "static_capture_all",
)


async def capture_steer_run(model: Any, prompts: list[list[int]], points: list[Address], spec: SteeringSpec) -> int:
    results = await asyncio.gather(
        *(
            model.capture_generation(p, points, max_tokens=GEN_TOKENS, steering_spec=spec, ignore_eos=True)
            for p in prompts
        )
    )
    return sum(len(completion.token_ids) for completion, _ in results)


async def measure(variants: dict[str, Callable[[], Awaitable[int]]], rounds: int, stage: str) -> dict[str, list[float]]:
    """Tokens/s per variant in each of ``rounds`` rounds (order reversed every other round),
    after one untimed pass of each; a pause before each timed run lets the other engine's
    workers stop polling."""
    for run in variants.values():
        await run()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            await asyncio.sleep(1.5)
            rates[name].append(await timed(variants[name]))
        print(f"{stage} round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in variants), flush=True)
    return rates


async def main(args: argparse.Namespace) -> int:
    results = Results("static_overhead", MEASURES, record=not args.quick)
    path = build_model()
    print(f"workers allocate with: {steady_malloc(not args.default_malloc)}")
    common = {"max_model_len": 512}
    plain = load_model(path, backend="vllm", enforce_eager=False, **common)
    await plain.warmup()
    info = plain.info
    middle = Address("resid_post", info.n_layers // 2)
    every = [Address("resid_post", i) for i in range(info.n_layers)]
    prompts = make_prompts(args.prompts, info.vocab_size)
    spec = SteeringSpec([Write(middle, torch.randn(info.d_model), op="add", scale=2.0)])
    z = Address("attn_z", info.n_layers // 2)
    head_off = SteeringSpec([Write(z, torch.zeros(info.d_head), op="set", heads=[0])])

    def reference() -> Awaitable[int]:
        return plain_run(plain, prompts, salted=True)

    stages: list[tuple[str, Callable[[], Any], Callable[[Any], dict[str, Callable[[], Awaitable[int]]]]]] = [
        (
            "static-1",
            lambda: load_model(path, backend="vllm-static", static_points=[middle], static_writes=[middle], **common),
            lambda m: {
                "static_untapped": lambda: plain_run(m, prompts, salted=True),
                "static_capture_1": lambda: capture_run(m, prompts, [middle]),
                "static_steer_1": lambda: steer_run(m, prompts, spec),
                "static_capture_steer_1": lambda: capture_steer_run(m, prompts, [middle], spec),
            },
        ),
        (
            "static-all",
            lambda: load_model(path, backend="vllm-static", static_points=every, **common),
            lambda m: {"static_capture_all": lambda: capture_run(m, prompts, every)},
        ),
        (
            "static-heads",
            lambda: load_model(path, backend="vllm-static", static_points=[z], static_writes=[z], **common),
            lambda m: {
                "static_capture_z_1": lambda: capture_run(m, prompts, [z]),
                "static_ablate_head_1": lambda: steer_run(m, prompts, head_off),
            },
        ),
        (
            "dynamic",
            lambda: load_model(path, backend="vllm", **common),
            lambda m: {
                "dynamic_untapped": lambda: plain_run(m, prompts, salted=True),
                "dynamic_capture_1": lambda: capture_run(m, prompts, [middle]),
                "dynamic_steer_1": lambda: steer_run(m, prompts, spec),
            },
        ),
    ]
    rows: list[tuple[str, str, float, float]] = []  # stage, variant, tok/s, vs the reference
    relative: dict[str, float] = {}
    per_round: dict[str, list[float]] = {}
    for stage, build, make_variants in stages:
        model = build()
        try:
            await model.warmup()
            rates = await measure({"plain": reference, **make_variants(model)}, args.rounds, stage)
            median = {name: statistics.median(values) for name, values in rates.items()}
        finally:
            await model.shutdown()
        for name, rate in median.items():
            rows.append((stage, name, rate, rate / median["plain"]))
            if name != "plain":
                relative[name] = rate / median["plain"]
                per_round[name] = [r / p for r, p in zip(rates[name], rates["plain"], strict=True)]
    await plain.shutdown()

    print()
    print(f"{'stage':<13} {'variant':<24} {'tok/s (median)':>15} {'vs plain':>9}")
    for stage, name, rate, ratio in rows:
        print(f"{stage:<13} {name:<24} {rate:>15.1f} {ratio:>9.3f}")
    print()

    def vs(a: str, b: str) -> float:
        return relative[a] / relative[b]

    for name in STATIC:
        results.add(f"{name}_vs_plain", relative[name], 0.95, rounds=per_round[name])
    results.add("static_vs_dynamic_capture_1", vs("static_capture_1", "dynamic_capture_1"), 1.5)
    results.add("static_vs_dynamic_steer_1", vs("static_steer_1", "dynamic_steer_1"), 1.5)
    # what compiling buys vLLM itself here: static over dynamic cannot exceed it by much
    results.add("compiled_vs_eager_plain", 1 / relative["dynamic_untapped"])
    results.write()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--default-malloc", action="store_true", help="the engines on glibc malloc's defaults")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 prompts (a smoke test)")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.prompts = 1, 8
    sys.exit(asyncio.run(main(ns)))
