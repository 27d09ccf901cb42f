"""What interp-vllm's endpoint plugin costs inside ``vllm serve``.

    python bench/vllm_serve_overhead.py [--rounds 3] [--prompts 64] [--quick] [--compiled] [--static]
                                        [--only lens_4,readouts]

Two ``vllm serve`` processes (``interp_testkit.vllm_serve.VllmServe``: the CPU build, eager mode
(``--enforce-eager``) unless ``--compiled``, float32, each on its own loopback port) serve the
model of ``bench/vllm_overhead.py`` (GPT-2-shaped, 12 layers x 768, random weights, built
locally), both alive for the whole run:

- **A**, with the plugin (``VLLM_PLUGINS=interp_vllm``): a random TopK SAE of
  ``bench/sae_overhead.py`` (16x as wide as the residual stream, k 32) at ``resid_post.6``,
  saved to a folder and attached by path as ``bench``, and a preset (``additional_config``);
- **B**, without it (``VLLM_PLUGINS=""``: vLLM reads it as an allow-list that matches nothing, so
  neither of interp-vllm's plugins loads; checked from the logs, where vLLM names each endpoint
  plugin it loads, and from B's missing ``/interp`` routes).

The workload is ``vllm_overhead.py``'s: ``--prompts`` prompts of 64-256 random token ids, each
generating 32 tokens (``ignore_eos``, temperature 0), all sent at once from one asyncio client:

- ``plain_without_plugin``: ``/v1/completions`` on B through the ``openai`` client
  (``AsyncOpenAI``, the prompt as token ids);
- ``plain``: the same on A;
- ``steer_1``: the same on A with ``"interp": {"steering": SPEC}`` in the body, ``SPEC`` an
  ``add`` of a random vector (scale 2) at ``resid_post.6``;
- ``preset``: the same on A with ``model=`` the preset whose spec is ``steer_1``'s, nothing else
  in the body;
- ``lens_4``: ``POST /interp/v1/generate`` on A (``httpx.AsyncClient``) with the logit lens at
  layers 2, 5, 8 and 11, top-10, every generated token's lens returned in the answer's ``steps``;
- ``readouts``: ``POST /interp/v1/generate`` on A with ``features: ["features:bench:top8"]``, the
  SAE's top 8 features of every generated token.

Every request computes its whole prompt: the plain ones carry a unique ``cache_salt``, as steered
requests and readouts get one of their own (vLLM's prefix caching would otherwise let the
rounds' repeated prompts skip their prefill only for plain requests), and the lens requests ask
for the prompt's last position too, which gives them one.

Before timing, one prompt checks the servers: plain completions on A and B are equal, and the
preset's equals ``steer_1``'s and differs from plain. Every variant runs once as a warm-up, then
``--rounds`` rounds alternate the variants (the order reversed every other round). Throughput is
generated tokens over the round's wall seconds; the median over rounds is reported relative to
``plain_without_plugin``, with each variant's round-to-round spread ((fastest - slowest) /
median). Ends with ``RESULT <name>_vs_plain_without_plugin <ratio> (target <t>)`` lines. Both
servers are stopped at the end, on an error too; their logs are left in ``.cache/bench-vllm-serve/``.
``--only lens_4,readouts`` runs B's plain and the named variants alone (recorded like a whole run).

``--compiled``: both servers compile the model as vLLM does by default (no ``--enforce-eager``;
on the CPU build: Dynamo and Inductor, no CUDA graphs), B being plain compiled ``vllm serve``;
recorded as ``vllm_serve_overhead_compiled``, with the targets of a compiled server (plain 0.98,
steering 0.93, lens and readouts 0.88). ``--static`` (implies ``--compiled``) adds a third
server, **C**, with the plugin and a vllm-static declaration in its ``--additional-config``
(``"static": {"points": [the lens layers' resid_post], "writes": ["resid_post.6"]}``, the SAE
compiled in), and runs ``plain``, ``steer_1``, ``lens_4`` and ``readouts`` on it too
(``static_*``), each against B, in the same rounds; those figures are recorded as
``vllm_serve_overhead_static``, the others as ``vllm_serve_overhead_compiled``.

The servers' processes allocate with a fixed malloc threshold and keep freed memory
(``bench/_workers.py``; ``--default-malloc``: glibc's defaults).

The lens and the readouts add arithmetic that plain serving does not do, whatever the plugin's
own overhead: each generated token's lens is a final norm and a full unembedding (``d_model x
vocab``) at each of the 4 layers, each readout an SAE encode (``d_model x d_sae``). On a CPU the
forward is compute-bound, so the best ratio a variant can reach is plain's multiply-adds over
plain's plus the variant's (:func:`arithmetic_floor`, from the model's shapes and the prompts'
lengths: each layer's projections and attention over the positions before, and the logits of
every sampled position). Recorded as ``<variant>_floor`` (no target) beside the measured ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import torch
from _results import Results  # bench/, the script's own directory
from _workers import steady_malloc
from sae_overhead import random_sae
from vllm_overhead import GEN_TOKENS, build_model, make_prompts

from interp_engine import Address, SteeringSpec, Write
from interp_testkit.vllm_serve import VllmServe

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench-vllm-serve"
SERVED = "bench"
PRESET = "bench-steered"
SAE_NAME = "bench"
LAYER = 6
LENS_LAYERS = [2, 5, 8, 11]
READOUT = f"features:{SAE_NAME}:top8"
COMPILED_ARGS = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "512"]
ARGS = [*COMPILED_ARGS, "--enforce-eager"]
BASELINE = "plain_without_plugin"
TARGETS = {"plain": 0.98, "steer_1": 0.95, "preset": 0.95, "lens_4": 0.90, "readouts": 0.90}
COMPILED_TARGETS = {"plain": 0.98, "steer_1": 0.93, "preset": 0.93, "lens_4": 0.88, "readouts": 0.88}
"""``--compiled``: a compiled server with the plugin against plain compiled ``vllm serve``."""
STATIC_VARIANTS = ("plain", "steer_1", "lens_4", "readouts")
"""``--static``: what also runs on server C (``static_<name>``, with ``COMPILED_TARGETS``' target)."""
# the code whose speed the figures measure
MEASURES = (
    "packages/interp-vllm/src/interp_vllm",
    "packages/interp-core/src/interp_engine/server",
    "bench/_workers.py",
)


def server_config(spec: SteeringSpec, sae_path: pathlib.Path, static: bool = False) -> str:
    """The plugin's ``--additional-config``: the SAE by path and the preset (``static``: and a
    vllm-static declaration of the lens layers' ``resid_post`` and the steered address)."""
    config: dict[str, Any] = {"saes": {SAE_NAME: str(sae_path)}, "presets": {PRESET: spec.to_dict()}}
    if static:
        config["static"] = {"points": [f"resid_post.{n}" for n in LENS_LAYERS], "writes": [f"resid_post.{LAYER}"]}
    return json.dumps({"interp": config})


def arithmetic_floor(config: Any, prompts: list[list[int]], d_sae: int) -> dict[str, float]:
    """``{"lens_4": r, "readouts": r}``: plain's multiply-adds over plain's plus what the variant
    adds (module docstring), for ``prompts`` each generating ``GEN_TOKENS`` tokens on a model of
    ``config`` (GPT-2's names or the common ones)."""
    d = int(config.hidden_size)
    layers = int(getattr(config, "num_hidden_layers", getattr(config, "n_layer", 0)))
    d_mlp = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d)
    vocab = int(config.vocab_size)
    per_position = layers * (4 * d * d + 2 * d * d_mlp)  # q, k, v, o and the MLP's two projections
    plain = lens = readouts = 0
    for ids in prompts:
        positions = len(ids) + GEN_TOKENS - 1  # the last generated token is not fed back
        attention = layers * 2 * d * positions * (positions + 1) // 2  # scores and values over the positions before
        plain += positions * per_position + attention + GEN_TOKENS * d * vocab  # logits of each sampled position
        lens += GEN_TOKENS * len(LENS_LAYERS) * d * vocab  # each generated token's lens at each lens layer
        readouts += GEN_TOKENS * d * d_sae  # each generated token's SAE encode
    return {"lens_4": plain / (plain + lens), "readouts": plain / (plain + readouts)}


def check_servers(with_plugin: VllmServe, without: VllmServe) -> None:
    """A loaded the plugin and serves ``/interp`` and the preset; B loaded none of interp-vllm."""
    loaded = "Loading plugin interp_vllm"
    if loaded not in with_plugin.tail(10**7):
        raise RuntimeError(f"server A's log does not show {loaded!r}:\n{with_plugin.tail()}")
    if loaded in without.tail(10**7) or "interp-engine:" in without.tail(10**7):
        raise RuntimeError(f"server B loaded interp-vllm:\n{without.tail()}")
    if httpx.get(f"{with_plugin.url}/interp/v1/health", timeout=30).status_code != 200:
        raise RuntimeError(f"server A has no /interp routes:\n{with_plugin.tail()}")
    if httpx.get(f"{without.url}/interp/v1/health", timeout=30).status_code != 404:
        raise RuntimeError("server B answers /interp")
    models = [m["id"] for m in httpx.get(f"{with_plugin.url}/v1/models", timeout=30).json()["data"]]
    if PRESET not in models:
        raise RuntimeError(f"server A does not list the preset {PRESET!r}: {models}")


async def completions(client: Any, prompts: list[list[int]], model: str, extra: dict[str, Any] | None) -> int:
    """All prompts at once on ``/v1/completions``; generated tokens. Without ``extra``, each request
    gets a unique ``cache_salt``."""

    async def one(ids: list[int]) -> int:
        body = extra if extra is not None else {"cache_salt": f"plain-{uuid.uuid4().hex}"}
        out = await client.completions.create(
            model=model, prompt=ids, max_tokens=GEN_TOKENS, temperature=0, extra_body={"ignore_eos": True, **body}
        )
        return int(out.usage.completion_tokens)

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def interp_generate(client: httpx.AsyncClient, prompts: list[list[int]], fields: dict[str, Any]) -> int:
    """All prompts at once on ``/interp/v1/generate`` with ``fields``; generated tokens (checking
    every step carries what was asked)."""

    async def one(ids: list[int]) -> int:
        body = {"token_ids": ids, "max_tokens": GEN_TOKENS, "ignore_eos": True, "temperature": 0, **fields}
        answer = await client.post("/interp/v1/generate", json=body)
        if answer.status_code != 200:
            raise RuntimeError(f"/interp/v1/generate answered {answer.status_code}: {answer.text[:500]}")
        out = answer.json()
        asked = [key for key in ("lens", "features") if key in fields]
        if any(key not in step for step in out["steps"] for key in asked):
            raise RuntimeError(f"a step lacks {asked}: {str(out['steps'][:1])[:500]}")
        return len(out["token_ids"])

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def check_steering(on_a: Any, on_b: Any, ids: list[int], steering: dict[str, Any]) -> None:
    """On one prompt: plain on A equals plain on B, and the preset equals ``steer_1`` and differs
    from plain (the steering reached the model)."""

    async def text(client: Any, model: str, extra: dict[str, Any]) -> str:
        out = await client.completions.create(
            model=model, prompt=ids, max_tokens=GEN_TOKENS, temperature=0, extra_body={"ignore_eos": True, **extra}
        )
        return str(out.choices[0].text)

    plain_b, plain_a = await text(on_b, SERVED, {}), await text(on_a, SERVED, {})
    steered, preset = await text(on_a, SERVED, steering), await text(on_a, PRESET, {})
    if plain_a != plain_b or preset != steered or steered == plain_a:
        raise RuntimeError(f"unexpected completions: {plain_b=} {plain_a=} {steered=} {preset=}")


async def timed(run: Callable[[], Awaitable[int]]) -> float:
    start = time.perf_counter()
    tokens = await run()
    return tokens / (time.perf_counter() - start)


def spread(values: list[float]) -> float:
    """How far apart a variant's rounds are: (fastest - slowest) / median."""
    return (max(values) - min(values)) / statistics.median(values) if values else float("nan")


def report(
    results: Results,
    rates: dict[str, list[float]],
    targets: dict[str, float],
    static: Results | None = None,
    floors: dict[str, float] | None = None,
) -> None:
    median = {name: statistics.median(values) for name, values in rates.items()}
    base = median[BASELINE]
    print()
    print(f"{'variant':<22} {'tok/s (median)':>15} {'vs B plain':>11} {'spread':>7}")
    for name, rate in median.items():
        print(f"{name:<22} {rate:>15.1f} {rate / base:>11.3f} {spread(rates[name]):>7.3f}")
    print()
    for name, rate in median.items():
        if name != BASELINE:
            per_round = [r / b for r, b in zip(rates[name], rates[BASELINE], strict=True)]
            target = targets[name.removeprefix("static_")]
            into = static if static is not None and name.startswith("static_") else results
            into.add(f"{name}_vs_{BASELINE}", rate / base, target, rounds=per_round)
    for name, floor in (floors or {}).items():
        results.add(f"{name}_floor", floor, note="(plain's multiply-adds over plain's and the variant's)")
    results.write()
    if static is not None:
        static.write()


async def measure(
    results: Results,
    a: VllmServe,
    b: VllmServe,
    c: VllmServe | None,
    prompts: list[list[int]],
    spec: SteeringSpec,
    rounds: int,
    targets: dict[str, float],
    static: Results | None = None,
    floors: dict[str, float] | None = None,
    only: list[str] | None = None,
) -> None:
    import openai

    steering = {"interp": {"steering": spec.to_dict()}}
    lens = {"lens": {"layers": LENS_LAYERS, "top_k": 10, "positions": [-1]}}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    c_url = (c or a).url
    async with (
        openai.AsyncOpenAI(base_url=f"{a.url}/v1", api_key="none", max_retries=0, timeout=900) as on_a,
        openai.AsyncOpenAI(base_url=f"{b.url}/v1", api_key="none", max_retries=0, timeout=900) as on_b,
        openai.AsyncOpenAI(base_url=f"{c_url}/v1", api_key="none", max_retries=0, timeout=900) as on_c,
        httpx.AsyncClient(base_url=a.url, timeout=900, limits=limits) as interp,
        httpx.AsyncClient(base_url=c_url, timeout=900, limits=limits) as interp_c,
    ):
        variants: dict[str, Callable[[], Awaitable[int]]] = {
            BASELINE: lambda: completions(on_b, prompts, SERVED, None),
            "plain": lambda: completions(on_a, prompts, SERVED, None),
            "steer_1": lambda: completions(on_a, prompts, SERVED, steering),
            "preset": lambda: completions(on_a, prompts, PRESET, {}),
            "lens_4": lambda: interp_generate(interp, prompts, lens),
            "readouts": lambda: interp_generate(interp, prompts, {"features": [READOUT]}),
        }
        if c is not None:
            variants.update(
                {
                    "static_plain": lambda: completions(on_c, prompts, SERVED, None),
                    "static_steer_1": lambda: completions(on_c, prompts, SERVED, steering),
                    "static_lens_4": lambda: interp_generate(interp_c, prompts, lens),
                    "static_readouts": lambda: interp_generate(interp_c, prompts, {"features": [READOUT]}),
                }
            )
            await check_steering(on_c, on_b, prompts[0], steering)
        await check_steering(on_a, on_b, prompts[0], steering)
        if only:  # B's plain, the ratios' base, always runs
            variants = {name: run for name, run in variants.items() if name == BASELINE or name in only}
        for name, run in variants.items():
            print(f"warm-up {name}: {await timed(run):.1f} tok/s", flush=True)
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for index in range(rounds):
            order = list(variants) if index % 2 == 0 else list(reversed(variants))
            for name in order:
                rates[name].append(await timed(variants[name]))
            print(f"round {index + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in variants), flush=True)
    report(results, rates, targets, static, floors)


def main(args: argparse.Namespace) -> int:
    args.compiled = args.compiled or args.static
    results = Results("vllm_serve_overhead" + ("_compiled" if args.compiled else ""), MEASURES, record=not args.quick)
    static = Results("vllm_serve_overhead_static", MEASURES, record=not args.quick) if args.static else None
    server_args = COMPILED_ARGS if args.compiled else ARGS
    path = build_model("gpt2")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    d_model, vocab = int(config.hidden_size), int(config.vocab_size)
    WORK.mkdir(parents=True, exist_ok=True)
    sae_path = WORK / "sae"
    sae = random_sae(d_model, LAYER)
    sae.save(sae_path)
    vector = torch.randn(d_model, generator=torch.Generator().manual_seed(1))
    spec = SteeringSpec([Write(Address("resid_post", LAYER), vector, op="add", scale=2.0)])
    prompts = make_prompts(args.prompts, vocab)
    floors = arithmetic_floor(config, prompts, int(sae.d_sae))
    print(f"servers allocate with: {steady_malloc(not args.default_malloc)}")
    print(f"model: {path}; {len(prompts)} prompts x {GEN_TOKENS} tokens; SAE at resid_post.{LAYER}: {sae_path}")

    servers: list[VllmServe] = []
    try:
        a = VllmServe(
            path,
            [*server_args, "--additional-config", server_config(spec, sae_path)],
            WORK / "with-plugin.log",
            env={"VLLM_PLUGINS": "interp_vllm"},
        )
        servers.append(a)
        b = VllmServe(path, server_args, WORK / "without-plugin.log", env={"VLLM_PLUGINS": ""})
        servers.append(b)
        c = None
        if args.static:
            c = VllmServe(
                path,
                [*server_args, "--additional-config", server_config(spec, sae_path, static=True)],
                WORK / "static.log",
                env={"VLLM_PLUGINS": "interp_vllm"},
            )
            servers.append(c)
        for server in servers:
            server.wait(1800)
        check_servers(a, b)
        if c is not None:
            check_servers(c, b)
            workers = httpx.get(f"{c.url}/interp/v1/workers", timeout=30).json()["workers"]
            if not all(w.get("static_taps", 0) >= len(LENS_LAYERS) and w.get("static_tables") == 1 for w in workers):
                raise RuntimeError(f"server C does not serve its declared taps compiled in: {workers}")
        mode = "compiled" if args.compiled else "eager"
        print(f"A (with the plugin) at {a.url}, B (without) at {b.url}, {mode}", flush=True)
        targets = COMPILED_TARGETS if args.compiled else TARGETS
        if args.only:
            floors = {name: floor for name, floor in floors.items() if name in args.only}
        asyncio.run(measure(results, a, b, c, prompts, spec, args.rounds, targets, static, floors, args.only))
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--default-malloc", action="store_true", help="the servers on glibc malloc's defaults")
    parser.add_argument("--quick", action="store_true", help="1 round of 16 prompts (a smoke test)")
    parser.add_argument(
        "--only", type=lambda text: text.split(","), help="comma-separated variants (B's plain always runs)"
    )
    parser.add_argument("--compiled", action="store_true", help="servers that compile the model (no --enforce-eager)")
    parser.add_argument("--static", action="store_true", help="--compiled, and a server with declared vllm-static taps")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.prompts = 1, 16
    known = {*COMPILED_TARGETS, *(f"static_{name}" for name in STATIC_VARIANTS)}
    if ns.only and not set(ns.only) <= known:
        parser.error(f"--only: unknown variants {sorted(set(ns.only) - known)}; valid: {', '.join(sorted(known))}")
    sys.exit(main(ns))
