"""What the vllm backend's taps cost while vLLM batches a real workload.

    python bench/vllm_overhead.py [--rounds 3] [--prompts 64] [--family gpt2|llama|MODEL_TYPE | --model DIR]
                                  [--only capture_1,steer_1] [--compiled]

One engine (the backend's defaults: V1 runner, eager mode) serves a GPT-2-shaped model
(12 layers x 768, random weights, built locally; ``--family llama``: Llama-shaped, 12 x 768,
gated MLP with vLLM's fused ``gate_up_proj``, grouped-query attention; any other model type the
test kit builds, e.g. ``--family gemma2`` or ``--family mixtral``, gets the same 12 x 768 shape;
``--model DIR``: any local model directory). The workload is ``--prompts`` prompts of
64-256 random tokens, each generating 32 tokens, all submitted at once. In one process, with the
variants alternating round by round:

- ``plain``: the same engine's own ``AsyncLLM.generate``, no interp payload (the plugin only
  checks the step for tapped requests), with a unique ``cache_salt`` so that, like captures and
  steered requests, it computes every prompt token (with vLLM's prefix caching on, repeated
  prompts would otherwise skip their prefill only here);
- ``capture_1``: ``capture_generation`` of ``resid_post.6``;
- ``capture_all``: ``capture_generation`` of every layer's ``resid_post``;
- ``steer_1``: ``generate`` with an ``add`` at ``resid_post.6``;
- ``capture_z_1``: ``capture_generation`` of ``attn_z.6`` (every head's output, ``[tokens, heads, d_head]``);
- ``ablate_head_1``: ``generate`` with head 0 of layer 6 zero-ablated (``set`` zeros at ``attn_z.6``);
- ``capture_mlp_pre_1``: ``capture_generation`` of ``mlp_pre.6`` (on Llama: the gate half of the
  fused ``gate_up_proj`` output, split off in the hook);
- ``capture_scores_1``: ``capture_generation`` of ``attn_scores.6`` (pre-softmax scores, recomputed
  from the queries and keys the kernel received: every step scores its tokens against the whole
  context kept so far, so its cost grows with the context);
- ``lens_4``: ``stream`` with the logit lens at 4 layers (evenly spaced, the last included),
  top-10, every step's lens drained from the workers as it is produced (a live lens); it also
  asks for the prompt's last position as a prompt position, which gives it a cache salt (every
  prompt token computed, as for the salted plain requests).

Under LoRA adapters, on a second engine started after the first is shut down (vLLM has no LoRA
layers for GPT-2): the Llama-shaped model of ``--family llama`` (12 x 768, the size of the GPT-2
one) with ``enable_lora=True``, ``max_lora_rank=16``, ``max_loras=4`` and prefix caching off (so
that every variant computes every prompt token, round after round), and four random rank-16
LoRAs (``peft``, on every attention and MLP projection, built once under ``.cache``), relative to
``lora_plain`` (that engine's own ``AsyncLLM.generate`` of every prompt under the first adapter,
no interp payload):

- ``lora_capture_1``: ``capture_generation`` of ``resid_post.6`` under the first adapter;
- ``lora_mixed_4``: ``generate`` through the backend with the prompts spread over the four
  adapters (prompt ``i`` under adapter ``i % 4``: every batch holds all four), against one
  adapter for every prompt in ``lora_plain`` (what mixing four adapters costs, the backend's
  own request handling included).

With ``lens_4`` the bytes leaving the engine are measured too, on 8 of the prompts: the pickled
size of what the workers return for the lens streams' drains, per generated token, against the
pickled size of what they return for ``capture_generation`` of the same 4 layers' ``resid_post``
(dense), per captured position.

``--compiled``: instead, the taps on an engine vLLM compiles (``enforce_eager=False``, its
default), in one process with two engines of plain vLLM that run without this project's plugin
(``VLLM_PLUGINS`` empty while they start): ``compiled_plain`` (compiled) and ``eager_plain``
(``enforce_eager=True``), each serving the salted plain requests. On the compiled engine with the
plugin: ``c_plain`` (plain requests: no step is tapped), ``c_capture_1``, ``c_capture_all``,
``c_steer_1`` (the residual stream, served by the compiled islands inside the compiled graph)
and ``c_capture_z_1`` (a site inside a layer: those steps run vLLM's uncompiled forward). Each is
reported against ``compiled_plain`` (the targets) and against ``eager_plain`` (what the backend
served before it ran compiled), with the worker's count of steps that ran uncompiled.

Every variant runs once as a warm-up first. The worker's own timers (``worker_stats()``: its
steps, the forwards, the hooks' time inside them and the copies into captured values, SAE and
lens work, fetches) are printed per variant and round. Throughput is generated tokens per
second (median over rounds), reported relative to ``plain``, with each variant's round-to-round
spread ((fastest - slowest) / median) beside plain's in the same run. What the scores cost per token
of context is measured apart, one request at a time (no batching to hide it): a prompt of 64,
256 and 448 tokens generates 32 tokens plainly and with ``attn_scores.6`` captured, alternating,
3 times each; the extra milliseconds per generated token over plain, against the context length,
give its cost per 100 tokens of context (the slope).

The engine's processes allocate with a fixed malloc threshold and keep freed memory
(``bench/_workers.py``; ``--default-malloc``: glibc's defaults, under which page faults of
re-allocated activations add seconds of noise to every variant's rounds).

Then 32 prompt captures are run concurrently and one after another. Ends with
``RESULT <name> <ratio> (target <t>)`` lines. ``--only`` runs ``plain`` and the named variants
alone (no scores-per-context or concurrency figures; LoRA variants only: just the LoRA engine,
with ``lora_plain``); variants whose address the model does not
have (``mlp_pre`` on a mixture-of-experts layer, heads where the model has none) are left out,
and on a mixture of experts ``capture_router_1`` (``router_logits`` of the middle layer) is added.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time
import types
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from _results import Results  # bench/, the script's own directory
from _workers import steady_malloc

from interp_engine import Address, SteeringSpec, Write, load_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
GEN_TOKENS = 32


def build_model(family: str = "gpt2") -> pathlib.Path:
    from interp_testkit import build_tiny_model

    if family not in ("gpt2", "llama"):  # other shapes: what the test kit builds, at this size
        return build_tiny_model(
            family, ROOT / ".cache" / f"bench-vllm-{family}", n_layers=12, d_model=768, head_dim=64, max_positions=512
        )

    return build_tiny_model(
        family, ROOT / ".cache" / f"bench-vllm-{family}", n_layers=12, d_model=768, head_dim=64, max_positions=512
    )


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


async def concurrency(call: Callable[[list[int]], Awaitable[Any]], prompts: list[list[int]]) -> tuple[float, float]:
    """Seconds for all prompts at once, and one after another."""
    start = time.perf_counter()
    await asyncio.gather(*(call(p) for p in prompts))
    concurrent = time.perf_counter() - start
    start = time.perf_counter()
    for p in prompts:
        await call(p)
    return concurrent, time.perf_counter() - start


async def plain_run(model: Any, prompts: list[list[int]], tokens: int = GEN_TOKENS, salted: bool = False) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = model._engine
    # the same request settings the backend uses (delta outputs), minus the interp payload
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(ids: list[int]) -> int:
        count = 0
        rid = f"plain-{uuid.uuid4().hex}"
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salted:  # like a capture: no prefix-cache reuse, every prompt token computed
            prompt["cache_salt"] = rid
        async for out in engine.generate(prompt, params, rid):
            count += len(out.outputs[0].token_ids)
        return count

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def capture_run(model: Any, prompts: list[list[int]], points: list[Address], adapter: str | None = None) -> int:
    results = await asyncio.gather(
        *(model.capture_generation(p, points, max_tokens=GEN_TOKENS, ignore_eos=True, adapter=adapter) for p in prompts)
    )
    return sum(len(completion.token_ids) for completion, _ in results)


async def lora_plain_run(model: Any, prompts: list[list[int]], adapter: str) -> int:
    """vLLM's own ``AsyncLLM.generate`` of every prompt under ``adapter`` (the ``LoRARequest`` the
    backend sends for it), with no interp payload."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = model._engine
    lora = model._lora_request(adapter)
    params = SamplingParams(
        max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def one(ids: list[int]) -> int:
        count = 0
        rid = f"lora-plain-{uuid.uuid4().hex}"
        prompt = TokensPrompt(prompt_token_ids=ids)
        async for out in engine.generate(prompt, params, rid, lora_request=lora):
            count += len(out.outputs[0].token_ids)
        return count

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def mixed_run(model: Any, prompts: list[list[int]], adapters: list[str]) -> int:
    """``generate`` through the backend, prompt ``i`` under ``adapters[i % len(adapters)]``."""
    results = await asyncio.gather(
        *(
            model.generate(p, max_tokens=GEN_TOKENS, ignore_eos=True, adapter=adapters[i % len(adapters)])
            for i, p in enumerate(prompts)
        )
    )
    return sum(len(c.token_ids) for c in results)


async def steer_run(model: Any, prompts: list[list[int]], spec: SteeringSpec) -> int:
    results = await asyncio.gather(
        *(model.generate(p, max_tokens=GEN_TOKENS, steering_spec=spec, ignore_eos=True) for p in prompts)
    )
    return sum(len(c.token_ids) for c in results)


async def lens_run(model: Any, prompts: list[list[int]], lens: Any) -> int:
    """Streams with the lens, every step consumed as it comes (the live lens)."""

    async def one(ids: list[int]) -> int:
        count = 0
        async for step in model.stream(ids, max_tokens=GEN_TOKENS, lens=lens, ignore_eos=True):
            count += step.lens is not None
        return count

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def lens_bytes(model: Any, prompts: list[list[int]], lens: Any) -> tuple[float, float]:
    """Bytes leaving the engine per generated token of lens streams (the pickled answers of the
    workers' drains), and per captured position of ``capture_generation`` of the lens layers'
    ``resid_post`` (dense: the fetches' pickled answers plus the float32 rows the workers write
    into the front end's shared memory, which travel outside the fetch)."""
    import pickle

    engine = model._engine
    original = engine.collective_rpc
    sent: dict[str, int] = {"interp_drain_many": 0, "interp_fetch_many": 0}

    async def counting(method: str, *args: Any, **kwargs: Any) -> Any:
        answer = await original(method, *args, **kwargs)
        if method in sent:
            sent[method] += len(pickle.dumps(answer))
        return answer

    engine.collective_rpc = counting
    try:
        generated = await lens_run(model, prompts, lens)
        points = [Address("resid_post", layer) for layer in lens.layers]
        results = await asyncio.gather(
            *(model.capture_generation(p, points, max_tokens=GEN_TOKENS, ignore_eos=True) for p in prompts)
        )
    finally:
        del engine.collective_rpc
    positions = sum(len(p) + len(completion.token_ids) for p, (completion, _) in zip(prompts, results, strict=True))
    rows = sum(t.numel() * t.element_size() for _, values in results for t in values.values())
    return sent["interp_drain_many"] / generated, (sent["interp_fetch_many"] + rows) / positions


async def scores_cost(model: Any, layer: int, lengths: tuple[int, ...] = (64, 256, 448)) -> list[float]:
    """Extra seconds per generated token of capturing ``attn_scores.layer`` over plain, one request
    at a time, for prompts of each length (medians of 3 alternating runs)."""
    point = [Address("attn_scores", layer)]
    extra = []
    for length in lengths:
        ids = make_prompts(1, model.info.vocab_size, seed=length)[0]
        ids = (ids * (length // len(ids) + 1))[:length]
        plain, scores = [], []
        for _ in range(3):
            start = time.perf_counter()
            await plain_run(model, [ids], salted=True)
            plain.append((time.perf_counter() - start) / GEN_TOKENS)
            start = time.perf_counter()
            await model.capture_generation(ids, point, max_tokens=GEN_TOKENS, ignore_eos=True)
            scores.append((time.perf_counter() - start) / GEN_TOKENS)
        extra.append(statistics.median(scores) - statistics.median(plain))
    return extra


async def timed(run: Callable[[], Awaitable[int]]) -> float:
    start = time.perf_counter()
    tokens = await run()
    return tokens / (time.perf_counter() - start)


TARGETS: dict[str, float | None] = {
    "capture_1": 0.98,
    "capture_all": 0.97,
    "steer_1": 0.98,
    "capture_z_1": 0.95,
    "ablate_head_1": 0.95,
    "capture_mlp_pre_1": 0.95,
    "capture_scores_1": None,
    "capture_router_1": 0.95,
    "lens_4": 0.90,
    "lora_capture_1": 0.95,
    "lora_mixed_4": 0.90,
}
LORA_VARIANTS = ("lora_capture_1", "lora_mixed_4")
"""The variants of the LoRA engine, measured against ``lora_plain``."""
LORA_RANK = 16
N_ADAPTERS = 4
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapters(base: pathlib.Path, n: int = N_ADAPTERS) -> list[pathlib.Path]:
    """``n`` random rank-16 LoRAs of ``base`` on every attention and MLP projection (``peft``,
    random ``A`` and ``B``), saved once beside it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = [base.parent / f"{base.name}-lora{i}" for i in range(n)]
    for i, folder in enumerate(folders):
        if (folder / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(100 + i)
        config = LoraConfig(
            r=LORA_RANK,
            lora_alpha=2 * LORA_RANK,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            init_lora_weights=False,
        )
        get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder)
    return folders


# the code whose speed the figures measure
MEASURES = ("packages/interp-vllm/src/interp_vllm", "packages/interp-core/src/interp_engine", "bench/_workers.py")

WORKER_TIMES = ("step_ns", "forward_ns", "hook_ns", "copy_ns", "sae_ns", "lens_ns", "fetch_ns")


def report_worker(worker: dict[str, dict[str, int]], rounds: int) -> None:
    """Where the worker's (rank 0's) time went per round: its steps, the forwards in them, our
    hooks inside the forwards (of which the copies into captured values), SAE and lens work,
    and the fetches."""
    if not rounds:
        return
    print()
    print("worker seconds per round: " + ", ".join(key.removesuffix("_ns") for key in WORKER_TIMES))
    for name, times in worker.items():
        print(f"{name:<18} " + " ".join(f"{times.get(key, 0) / rounds / 1e9:8.3f}" for key in WORKER_TIMES))


def spread(values: list[float]) -> float:
    """How far apart a variant's rounds are: (fastest - slowest) / median."""
    return (max(values) - min(values)) / statistics.median(values) if values else float("nan")


def report(results: Results, median: dict[str, float], rates: dict[str, list[float]], base: str = "plain") -> None:
    """The table of medians and round spreads, a ``RESULT`` line per variant relative to
    ``base`` (its rounds: each round's rate over the base's in the same round), and, over two
    rounds or more, each variant's spread against the base's."""
    print()
    print(f"{'variant':<18} {'tok/s (median)':>15} {'vs ' + base:>14} {'spread':>7}")
    for name, rate in median.items():
        print(f"{name:<18} {rate:>15.1f} {rate / median[base]:>14.3f} {spread(rates[name]):>7.3f}")
    print()
    for name, rate in median.items():
        if name != base:
            per_round = [r / p for r, p in zip(rates[name], rates[base], strict=False)]
            results.add(f"{name}_vs_{base}", rate / median[base], TARGETS[name], rounds=per_round)
    if len(rates[base]) >= 2:
        for name in median:
            if name != base:
                results.add(f"{name}_spread", spread(rates[name]), spread(rates[base]), better="lower")


def report_lens(results: Results, lens: Any, sizes: tuple[float, float] | None) -> None:
    if sizes is None:
        return
    per_token, dense = sizes
    print(
        f"lens at layers {list(lens.layers)}, top-{lens.top_k}: {per_token:.0f} bytes per generated token leave "
        f"the engine; capturing those {len(lens.layers)} layers densely: {dense:.0f} bytes per position "
        f"({dense / per_token:.1f}x)"
    )
    results.add("lens_4_bytes_per_token", per_token, digits=0)
    results.add("dense_4_bytes_per_token", dense, digits=0)


async def measure(
    model: Any, variants: dict[str, Callable[[], Awaitable[int]]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Each variant's generated tokens per second per round (after one warm-up run of each), the
    variants alternating round by round, and rank 0's worker timers per variant, summed."""
    if rounds:
        for run in variants.values():  # warm-up of every path (and the slab's pages for each capture)
            await timed(run)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    worker: dict[str, dict[str, int]] = {name: {} for name in variants}  # rank 0's counters, summed
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            (before,) = (await model.worker_stats())[:1]
            rates[name].append(await timed(variants[name]))
            (after,) = (await model.worker_stats())[:1]
            for key in WORKER_TIMES:
                worker[name][key] = worker[name].get(key, 0) + after.get(key, 0) - before.get(key, 0)
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in variants), flush=True)
    return rates, worker


async def lora_stage(results: Results, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """The LoRA variants ``names`` against ``lora_plain`` on their own engine (module docstring)."""
    path = build_model("llama")
    folders = build_adapters(path)
    adapters = [f"lora{i}" for i in range(len(folders))]
    model = load_model(
        path,
        backend="vllm",
        max_model_len=512,
        enable_lora=True,
        max_lora_rank=LORA_RANK,
        max_loras=N_ADAPTERS,
        enable_prefix_caching=False,  # every variant computes every prompt token (plain generate is unsalted)
        adapters={name: str(folder) for name, folder in zip(adapters, folders, strict=True)},
    )
    try:
        await model.warmup()
        info = model.info
        print(f"LoRA model: {path} ({info.architecture}, {info.n_layers} layers x {info.d_model}), adapters {adapters}")
        prompts = make_prompts(args.prompts, info.vocab_size)
        middle = info.n_layers // 2
        every: dict[str, Callable[[], Awaitable[int]]] = {
            "lora_plain": lambda: lora_plain_run(model, prompts, adapters[0]),
            "lora_capture_1": lambda: capture_run(model, prompts, [Address("resid_post", middle)], adapters[0]),
            "lora_mixed_4": lambda: mixed_run(model, prompts, adapters),
        }
        variants = {name: run for name, run in every.items() if name == "lora_plain" or name in names}
        rates, worker = await measure(model, variants, args.rounds)
    finally:
        await model.shutdown()
    report_worker(worker, args.rounds)
    median = {name: statistics.median(values) if values else float("nan") for name, values in rates.items()}
    report(results, median, rates, base="lora_plain")


COMPILED_TARGETS: dict[str, float | None] = {
    "c_plain": 0.99,
    "c_capture_1": 0.95,
    "c_capture_all": 0.90,
    "c_steer_1": 0.95,
    "c_capture_z_1": None,
}
"""``--compiled``: each variant's target against ``compiled_plain`` (vLLM compiled, no plugin)."""


async def bare_engine(path: pathlib.Path, enforce_eager: bool) -> Any:
    """Plain vLLM, without this project's plugin (``VLLM_PLUGINS`` names none while its processes
    start), with the engine arguments the backend gives its own engines on this machine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from interp_vllm.frontend._engine_config import CPU_ENGINE_DEFAULTS, CPU_ENV_DEFAULTS

    for name, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    before = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = ""
    try:
        args = AsyncEngineArgs(
            model=str(path), enforce_eager=enforce_eager, dtype="float32", max_model_len=512, **CPU_ENGINE_DEFAULTS
        )
        engine = AsyncLLM.from_engine_args(args)
        bare = types.SimpleNamespace(_engine=engine)
        await plain_run(bare, [[5, 6, 7]], 2)  # started, and its compiled graph warm
        return bare
    finally:
        if before is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = before


async def compiled_stage(results: Results, args: argparse.Namespace) -> None:
    """``--compiled``: the taps on an engine vLLM compiles (``enforce_eager=False``) against plain
    vLLM compiled and plain vLLM eager, both without the plugin, in one run (module docstring)."""
    path = pathlib.Path(args.model) if args.model else build_model(args.family)
    eager_plain = await bare_engine(path, enforce_eager=True)
    compiled_plain = await bare_engine(path, enforce_eager=False)
    model = load_model(path, backend="vllm", max_model_len=512, enforce_eager=False)
    try:
        await model.warmup()
        info = model.info
        print(f"model: {path} ({info.architecture}, {info.n_layers} layers x {info.d_model}), compiled")
        prompts = make_prompts(args.prompts, info.vocab_size)
        middle = info.n_layers // 2
        spec = SteeringSpec([Write(Address("resid_post", middle), torch.randn(info.d_model), op="add", scale=2.0)])
        variants: dict[str, Callable[[], Awaitable[int]]] = {
            "eager_plain": lambda: plain_run(eager_plain, prompts, salted=True),
            "compiled_plain": lambda: plain_run(compiled_plain, prompts, salted=True),
            "c_plain": lambda: plain_run(model, prompts, salted=True),
            "c_capture_1": lambda: capture_run(model, prompts, [Address("resid_post", middle)]),
            "c_capture_all": lambda: capture_run(
                model, prompts, [Address("resid_post", i) for i in range(info.n_layers)]
            ),
            "c_steer_1": lambda: steer_run(model, prompts, spec),
        }
        if "attn_z" in model.points():
            variants["c_capture_z_1"] = lambda: capture_run(model, prompts, [Address("attn_z", middle)])
        if args.only:
            variants = {n: r for n, r in variants.items() if n in ("eager_plain", "compiled_plain") or n in args.only}
        for run in variants.values():  # warm-up of every path
            await timed(run)
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                rates[name].append(await timed(variants[name]))
            print(
                f"round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in variants), flush=True
            )
        (stats,) = (await model.worker_stats())[:1]
    finally:
        await model.shutdown()
        for bare in (eager_plain, compiled_plain):
            bare._engine.shutdown()
    median = {name: statistics.median(values) for name, values in rates.items()}
    print()
    print(f"{'variant':<16} {'tok/s (median)':>15} {'vs compiled':>12} {'vs eager':>9} {'spread':>7}")
    for name, rate in median.items():
        print(
            f"{name:<16} {rate:>15.1f} {rate / median['compiled_plain']:>12.3f} "
            f"{rate / median['eager_plain']:>9.3f} {spread(rates[name]):>7.3f}"
        )
    print(
        f"worker: {stats.get('uncompiled_steps', 0)} of {stats.get('steps', 0)} tapped steps ran uncompiled; "
        f"island ops run: {stats.get('islands_fired', 0)}"
    )
    print()
    results.add(
        "compiled_plain_vs_eager_plain",
        median["compiled_plain"] / median["eager_plain"],
        rounds=[c / e for c, e in zip(rates["compiled_plain"], rates["eager_plain"], strict=True)],
    )
    for name in median:
        if name in ("eager_plain", "compiled_plain"):
            continue
        for base in ("compiled_plain", "eager_plain"):
            per_round = [r / b for r, b in zip(rates[name], rates[base], strict=True)]
            target = COMPILED_TARGETS[name] if base == "compiled_plain" else None
            results.add(f"{name}_vs_{base}", median[name] / median[base], target, rounds=per_round)
    results.add("compiled_plain_spread", spread(rates["compiled_plain"]), better="lower")


async def main(args: argparse.Namespace) -> int:
    if args.compiled:  # its own figures file: bench/results/vllm_overhead_compiled.json
        compiled_results = Results("vllm_overhead_compiled", MEASURES, record=not args.quick)
        await compiled_stage(compiled_results, args)
        compiled_results.write()
        return 0
    results = Results("vllm_overhead", MEASURES, record=not args.quick)
    print(f"workers allocate with: {steady_malloc(not args.default_malloc)}")
    lora_names = tuple(name for name in LORA_VARIANTS if not args.only or name in args.only)
    if args.only and set(args.only) <= set(LORA_VARIANTS):  # the LoRA engine alone
        await lora_stage(results, args, lora_names)
        results.write()
        return 0
    path = pathlib.Path(args.model) if args.model else build_model(args.family)
    model = load_model(path, backend="vllm", max_model_len=512)
    await model.warmup()
    info = model.info
    print(f"model: {path} ({info.architecture}, {info.n_layers} layers x {info.d_model}, {info.n_experts} experts)")
    prompts = make_prompts(args.prompts, info.vocab_size)
    middle = info.n_layers // 2
    spec = SteeringSpec([Write(Address("resid_post", middle), torch.randn(info.d_model), op="add", scale=2.0)])
    head_off = SteeringSpec([Write(Address("attn_z", middle), torch.zeros(info.d_head), op="set", heads=[0])])
    from interp_engine.results._lens import LensRequest

    step = max(1, info.n_layers // 4)
    # positions=[-1]: also the prompt's last position (which the first step reads anyway) as a prompt
    # position, so that the lens requests carry a cache salt and compute every prompt token, as
    # the salted plain requests do (a lens without prompt positions may reuse vLLM's prefix cache)
    layers = sorted({info.n_layers - 1 - i * step for i in range(4)} & set(range(info.n_layers)))
    lens = LensRequest(layers, top_k=10, positions=[-1])
    variants: dict[str, Callable[[], Awaitable[int]]] = {
        # salted: captures and steered requests compute every prompt token, and with prefix
        # caching on (vLLM's default) the rounds' repeated prompts would otherwise skip their
        # prefill only for plain requests
        "plain": lambda: plain_run(model, prompts, salted=True),
        "capture_1": lambda: capture_run(model, prompts, [Address("resid_post", middle)]),
        "capture_all": lambda: capture_run(model, prompts, [Address("resid_post", i) for i in range(info.n_layers)]),
        "steer_1": lambda: steer_run(model, prompts, spec),
        "capture_z_1": lambda: capture_run(model, prompts, [Address("attn_z", middle)]),
        "ablate_head_1": lambda: steer_run(model, prompts, head_off),
        "capture_mlp_pre_1": lambda: capture_run(model, prompts, [Address("mlp_pre", middle)]),
        "capture_scores_1": lambda: capture_run(model, prompts, [Address("attn_scores", middle)]),
        "lens_4": lambda: lens_run(model, prompts, lens),
    }
    if info.n_experts:
        variants["capture_router_1"] = lambda: capture_run(model, prompts, [Address("router_logits", middle)])
    kind_of = {
        "capture_z_1": "attn_z",
        "ablate_head_1": "attn_z",
        "capture_mlp_pre_1": "mlp_pre",
        "capture_scores_1": "attn_scores",
    }
    served = model.points()
    for name, kind in kind_of.items():
        if kind not in served:
            print(f"({name} left out: this model has no {kind})")
            variants.pop(name)
    if args.only:
        unknown = set(args.only) - set(variants) - set(LORA_VARIANTS)
        if unknown:
            valid = ", ".join([*variants, *LORA_VARIANTS])
            print(f"unknown or unserved variants {sorted(unknown)}; these run here: {valid}")
            await model.shutdown()
            return 2
        variants = {name: run for name, run in variants.items() if name == "plain" or name in args.only}
    rates, worker = await measure(model, variants, args.rounds)
    report_worker(worker, args.rounds)

    median = {name: statistics.median(values) if values else float("nan") for name, values in rates.items()}
    lens_sizes = await lens_bytes(model, prompts[:8], lens) if "lens_4" in variants else None
    if args.only:
        await model.shutdown()
        report(results, median, rates)
        report_lens(results, lens, lens_sizes)
        if lora_names:
            await lora_stage(results, args, lora_names)
        results.write()
        return 0

    point = [Address("resid_post", middle)]
    few = prompts[:32]
    concurrent, sequential = await concurrency(lambda p: model.capture(p, point), few)
    # the same 32 prompts through plain vLLM (prefill + one token, no prefix-cache reuse, as a
    # capture): how much batching buys on this machine at all
    plain_concurrent, plain_sequential = await concurrency(lambda p: plain_run(model, [p], 1, salted=True), few)
    lengths = (64, 256, 448)
    extra = await scores_cost(model, middle, lengths) if "attn_scores" in served else []
    await model.shutdown()

    report(results, median, rates)
    report_lens(results, lens, lens_sizes)
    print(f"32 captures: concurrent {concurrent:.2f} s, sequential {sequential:.2f} s")
    print(f"32 plain vLLM prefills: concurrent {plain_concurrent:.2f} s, sequential {plain_sequential:.2f} s")
    if extra:
        for length, seconds in zip(lengths, extra, strict=True):
            print(f"attn_scores.{middle}, one request, {length}-token prompt: {seconds * 1e3:+.2f} ms per token")
        slope = (extra[-1] - extra[0]) / (lengths[-1] - lengths[0]) * 100
        results.add("capture_scores_1_extra_ms_per_token_per_100_context", slope * 1e3)
    results.add("concurrent_vs_sequential", sequential / concurrent, 8.0, digits=2)
    results.add("plain_vllm_concurrent_vs_sequential", plain_sequential / plain_concurrent, digits=2)
    await lora_stage(results, args, lora_names)
    results.write()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--family", default="gpt2", help="gpt2, llama, or another model type the test kit builds")
    parser.add_argument("--model", help="a local model directory (instead of --family)")
    parser.add_argument("--only", type=lambda text: text.split(","), help="comma-separated variants (plain always)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--default-malloc", action="store_true", help="the workers on glibc malloc's defaults")
    parser.add_argument("--quick", action="store_true", help="1 round of 16 prompts (a smoke test)")
    parser.add_argument("--compiled", action="store_true", help="the compiled engine's variants (module docstring)")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.prompts = 1, 16
    sys.exit(asyncio.run(main(ns)))
