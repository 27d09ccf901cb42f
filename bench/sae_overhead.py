"""What SAE readouts and feature clamps cost inside vLLM's worker, and what they send back.

    python bench/sae_overhead.py [--rounds 3] [--prompts 48] [--static] [--quick]

The model of ``bench/vllm_overhead.py`` (GPT-2-shaped, 12 layers x 768, random weights, built
locally) on the ``vllm`` backend, with a random TopK SAE 16x as wide as the residual stream
(``d_sae = 12288``, ``k = 32``) attached at the middle layer's ``resid_post``. The workload is
``--prompts`` prompts of 96-160 random tokens, each generating 32 tokens, all submitted at once.
In one process:

- ``plain``: the engine's own ``AsyncLLM.generate``, no interp payload, with a unique
  ``cache_salt`` so that, like the requests with readouts or clamps, every prompt token is
  computed (with prefix caching on, vLLM's default, repeated prompts would otherwise skip their
  prefill only here);
- ``readouts``: ``capture_generation`` of ``Features(sae, 32)`` only: the top 32 features and the
  error norm of every prompt and generated token, encoded in the worker;
- ``clamp``: ``generate`` with one feature clamped (``FeatureWrite(..., "clamp", 5.0)``) on every
  token.

Throughput is prompt + generated tokens per second. Each round runs ``plain`` before, between
and after the variants (``plain, readouts, plain, clamp, plain``, the variants' order reversed
every other round); a variant's ratio in a round is its rate over the mean of the two ``plain``
runs beside it, and the reported ratio is the median over rounds (this machine's speed drifts by
10-20% from run to run: paired runs cancel most of it).

Bytes per token are the bytes the workers really return for a request, over its prompt +
generated tokens: for the top-32 readout with float32 and with float16 values, the length of the
packed values (``Fetched.encode()["values"]``, safetensors) of each fetch, measured at the front
end; for a dense ``capture_generation`` of the same ``resid_post``, the float32 rows the workers
write into the front end's shared memory (the size of the tensors it returns).

``--static`` adds a stage on ``vllm-static``: a plain compiled engine next to a compiled engine
with the SAE compiled in (it encodes every token of every request in-graph), readouts and a
clamp there against the plain compiled engine, and plain requests on the SAE engine (what the
compiled-in SAE costs everyone else).

Ends with ``RESULT`` lines.

The engines' processes allocate with a fixed malloc threshold and keep freed memory
(``bench/_workers.py``; ``--default-malloc``: glibc's defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from _results import Results  # bench/, the script's own directory
from _workers import steady_malloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from vllm_overhead import build_model, plain_run

from interp_engine import Address, Features, FeatureWrite, Sae, SteeringSpec, load_model

# the code whose speed the figures measure
MEASURES = ("packages/interp-vllm/src/interp_vllm", "packages/interp-core/src/interp_engine/sae", "bench/_workers.py")
GEN_TOKENS = 32
WIDTH = 16  # d_sae / d_model
K = 32
SAE_NAME = "bench"
CLAMPED = 7  # the feature the clamp variant sets


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(96, 161, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def random_sae(d_model: int, layer: int, seed: int = 0) -> Sae:
    """A random TopK SAE ``WIDTH`` times as wide as the residual stream at ``resid_post.layer``."""
    gen = torch.Generator().manual_seed(seed)
    d_sae = WIDTH * d_model
    return Sae(
        "topk",
        torch.randn(d_model, d_sae, generator=gen) / d_model**0.5,
        torch.randn(d_sae, generator=gen) * 0.1,
        torch.randn(d_sae, d_model, generator=gen) / d_model**0.5,
        torch.randn(d_model, generator=gen) * 0.01,
        f"blocks.{layer}.hook_resid_post",
        k=K,
    )


async def readout_run(model: Any, prompts: list[list[int]], points: list[Any]) -> int:
    results = await asyncio.gather(
        *(model.capture_generation(p, points, max_tokens=GEN_TOKENS, ignore_eos=True) for p in prompts)
    )
    return sum(len(p) + len(c.token_ids) for p, (c, _) in zip(prompts, results, strict=True))


async def steer_run(model: Any, prompts: list[list[int]], spec: SteeringSpec) -> int:
    results = await asyncio.gather(
        *(model.generate(p, max_tokens=GEN_TOKENS, steering_spec=spec, ignore_eos=True) for p in prompts)
    )
    return sum(len(p) + len(c.token_ids) for p, c in zip(prompts, results, strict=True))


async def plain_tokens(model: Any, prompts: list[list[int]]) -> int:
    return sum(len(p) for p in prompts) + await plain_run(model, prompts, GEN_TOKENS, salted=True)


async def timed(run: Callable[[], Awaitable[int]]) -> float:
    start = time.perf_counter()
    tokens = await run()
    return tokens / (time.perf_counter() - start)


async def measure(
    plain: Callable[[], Awaitable[int]], variants: dict[str, Callable[[], Awaitable[int]]], rounds: int, stage: str
) -> tuple[float, dict[str, float], dict[str, list[float]]]:
    """Tokens/s of ``plain`` and of each variant, and each variant against ``plain``.

    After one untimed pass of each, every round runs ``plain`` between consecutive variants
    (``plain, a, plain, b, plain``; the variants' order reversed every other round), and a
    variant's ratio in that round is its rate over the mean of the two ``plain`` runs beside it:
    on a machine whose speed drifts (a shared 2-core VM) the pairs are measured close together.
    Reported: the median rate of each, and each variant's ratios, one per round."""
    await plain()
    for run in variants.values():
        await run()

    async def rate(run: Callable[[], Awaitable[int]]) -> float:
        await asyncio.sleep(1.0)
        return await timed(run)

    plain_rates: list[float] = []
    rates: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        before = await rate(plain)
        plain_rates.append(before)
        for name in order:
            rates[name].append(await rate(variants[name]))
            after = await rate(plain)
            plain_rates.append(after)
            ratios[name].append(rates[name][-1] / ((before + after) / 2))
            before = after
        print(
            f"{stage} round {round_index + 1}: plain "
            + "/".join(f"{r:.0f}" for r in plain_rates[-len(order) - 1 :])
            + ", "
            + ", ".join(f"{n} {rates[n][-1]:.1f} ({ratios[n][-1]:.3f})" for n in variants),
            flush=True,
        )
    median = {name: statistics.median(values) for name, values in rates.items()}
    return statistics.median(plain_rates), median, ratios


async def bytes_per_token(model: Any, prompts: list[list[int]], points: list[Any]) -> float:
    """Bytes the workers return per token (prompt + generated) for ``capture_generation`` of
    ``points``: the packed values of every rank's answer to each fetch, measured as they arrive."""
    seen: list[int] = []
    fetch = model._fetch_blobs

    async def counting(engine: Any, rid: str) -> list[Any]:
        blobs: list[Any] = await fetch(engine, rid)
        seen.append(sum(len(blob.values) for blob in blobs))
        return blobs

    model._fetch_blobs = counting
    try:
        tokens = await readout_run(model, prompts, points)
    finally:
        del model._fetch_blobs  # the class's method again
    return sum(seen) / tokens


async def dense_bytes_per_token(model: Any, prompts: list[list[int]], address: Address) -> float:
    """Bytes per token (prompt + generated) of ``capture_generation`` of ``address``: the float32
    rows the workers write into the front end's shared memory (they travel outside the fetch)."""
    results = await asyncio.gather(
        *(model.capture_generation(p, [address], max_tokens=GEN_TOKENS, ignore_eos=True) for p in prompts)
    )
    size = sum(values[address].numel() * values[address].element_size() for _, values in results)
    return size / sum(len(p) + len(c.token_ids) for p, (c, _) in zip(prompts, results, strict=True))


def worker_ms(before: dict[str, int], after: dict[str, int]) -> str:
    steps = max(after["steps"] - before["steps"], 1)
    step = (after["step_ns"] - before["step_ns"]) / steps / 1e6
    forward = (after["forward_ns"] - before["forward_ns"]) / steps / 1e6
    sae = (after.get("sae_ns", 0) - before.get("sae_ns", 0)) / steps / 1e6
    return f"{steps} steps, {step:.1f} ms/step ({forward:.1f} ms in the forward, {sae:.1f} ms of it SAE work)"


async def dynamic_stage(path: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(path, backend="vllm", max_model_len=512)
    try:
        await model.warmup()
        info = model.info
        middle = info.n_layers // 2
        model.attach_sae(SAE_NAME, random_sae(info.d_model, middle))
        prompts = make_prompts(args.prompts, info.vocab_size)
        top = Features(SAE_NAME, K)
        clamp = SteeringSpec([FeatureWrite(SAE_NAME, CLAMPED, "clamp", 5.0)])
        variants: dict[str, Callable[[], Awaitable[int]]] = {
            "plain": lambda: plain_tokens(model, prompts),
            "readouts": lambda: readout_run(model, prompts, [top]),
            "clamp": lambda: steer_run(model, prompts, clamp),
        }
        plain_rate, median, rounds = await measure(
            variants["plain"], {k: v for k, v in variants.items() if k != "plain"}, args.rounds, "vllm"
        )
        ratio = {name: statistics.median(values) for name, values in rounds.items()}
        for name, run in variants.items():  # where the worker's time goes, one pass each
            (before,) = await model.worker_stats()
            await run()
            (after,) = await model.worker_stats()
            print(f"  worker, {name}: {worker_ms(before, after)}")
        few = prompts[:8]
        sizes = {
            "f32": await bytes_per_token(model, few, [top]),
            "f16": await bytes_per_token(model, few, [Features(SAE_NAME, K, dtype="float16")]),
            "dense": await dense_bytes_per_token(model, few, Address("resid_post", middle)),
        }
    finally:
        await model.shutdown()
    print()
    print(f"{'variant':<10} {'tok/s (median)':>15} {'vs plain (median of paired ratios)':>36}")
    print(f"{'plain':<10} {plain_rate:>15.1f}")
    for name, rate in median.items():
        print(f"{name:<10} {rate:>15.1f} {ratio[name]:>36.3f}")
    return {"ratio": ratio, "rounds": rounds, **{f"bytes_{k}": v for k, v in sizes.items()}}


async def static_stage(path: pathlib.Path, args: argparse.Namespace) -> dict[str, list[float]]:
    plain = load_model(path, backend="vllm", enforce_eager=False, max_model_len=512)
    await plain.warmup()
    info = plain.info
    middle = info.n_layers // 2
    prompts = make_prompts(args.prompts, info.vocab_size)
    static = load_model(
        path,
        backend="vllm-static",
        static_points=[],
        max_model_len=512,
        saes={SAE_NAME: random_sae(info.d_model, middle)},
    )
    try:
        await static.warmup()
        clamp = SteeringSpec([FeatureWrite(SAE_NAME, CLAMPED, "clamp", 5.0)])
        variants: dict[str, tuple[Any, Callable[[], Awaitable[int]]]] = {
            "static_untapped": (static, lambda: plain_tokens(static, prompts)),
            "static_readouts": (static, lambda: readout_run(static, prompts, [Features(SAE_NAME, K)])),
            "static_clamp": (static, lambda: steer_run(static, prompts, clamp)),
        }
        reference = lambda: plain_tokens(plain, prompts)  # noqa: E731
        plain_rate, median, rounds = await measure(
            reference, {name: run for name, (_, run) in variants.items()}, args.rounds, "static"
        )
        ratio = {name: statistics.median(values) for name, values in rounds.items()}
        for name, (engine, run) in [("plain", (plain, reference)), *variants.items()]:  # in-graph: inside the forward
            (before,) = await engine.worker_stats()
            await run()
            (after,) = await engine.worker_stats()
            print(f"  worker, {name}: {worker_ms(before, after)}")
    finally:
        await static.shutdown()
        await plain.shutdown()
    print()
    print(f"{'plain compiled':<16} {plain_rate:>10.1f} tok/s")
    for name, rate in median.items():
        print(f"{name:<16} {rate:>10.1f} tok/s {ratio[name]:>7.3f} x plain compiled vLLM")
    return rounds


async def main(args: argparse.Namespace) -> int:
    path = build_model("gpt2")
    print(f"workers allocate with: {steady_malloc(not args.default_malloc)}")
    results = Results("sae_overhead", MEASURES, record=not args.quick)
    dynamic = await dynamic_stage(path, args)
    static = await static_stage(path, args) if args.static else {}
    print()
    for name in ("readouts", "clamp"):
        results.add(f"sae_{name}_vs_plain", dynamic["ratio"][name], 0.95, rounds=dynamic["rounds"][name])
    dense = dynamic["bytes_dense"]
    for dtype in ("f32", "f16"):
        size = dynamic[f"bytes_{dtype}"]
        note = f"{size:.1f} bytes per token against {dense:.1f} dense (1/{dense / size:.1f})"
        name = f"bytes_per_token_readout_{dtype}_vs_dense"
        results.add(name, size / dense, 1 / 20, better="lower", note=note, digits=4)
    for name, rounds in static.items():
        results.add(f"sae_{name}_vs_plain_compiled", statistics.median(rounds), rounds=rounds)
    results.write()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--default-malloc", action="store_true", help="the engines on glibc malloc's defaults")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--static", action="store_true", help="add the vllm-static stage (two more engines)")
    parser.add_argument("--quick", action="store_true", help="1 round of 8 prompts (a smoke test)")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.prompts = 1, 8
    sys.exit(asyncio.run(main(ns)))
