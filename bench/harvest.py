"""What a harvest costs against plain vLLM prefilling the same corpus, and what it writes.

    python bench/harvest.py [--rows 48] [--rounds 3] [--quick]
    python bench/harvest.py --replicas 2 [--rows 48] [--rounds 1]

The model of ``bench/vllm_overhead.py`` (GPT-2-shaped, 12 layers x 768, random weights, built
locally) on the ``vllm`` backend. The corpus is random token ids (documents of 40-400 tokens,
pre-tokenized), packed as SAELens packs them into ``--rows`` rows of 128 tokens. In one process:

- ``plain``: the engine's own ``AsyncLLM.generate`` of every row with ``max_tokens=1`` (vLLM's
  prefill and one sampled token: the least it computes for a prompt), a unique ``cache_salt``
  each so every token is computed;
- ``every_layer``: :func:`interp_engine.harvest.harvest` of all 12 ``resid_post``, written as
  safetensors shards (the disk write included: the run ends when the last shard is on disk);
- ``one_address``: the same with ``resid_post.6`` only;
- ``readouts``: the top-32 readouts of a random TopK SAE 16x as wide (``d_sae = 12288``) at
  ``resid_post.6``, no dense values.

Throughput is tokens per second. Each round runs ``plain`` before and after each variant, and a
variant's ratio in a round is its rate over the mean of the two ``plain`` runs beside it (this
shared machine's speed drifts); the figure is the median over rounds.

Also: bytes written per activation value (the shards' size over the values they hold, against
the dtype's 4 bytes; the token ids, documents and positions are the rest), and the front end's
peak RSS growth over its RSS before the harvest, while harvesting the corpus and a corpus 10x as
long (one address, 4 MiB shards, sampled every 10 ms; the corpus lists are built before): bounded
memory means the two are about the same.

``--replicas 2`` measures instead a harvest spread over two Ray replicas (``harvest(...,
replicas=2)``: each replica a vLLM engine of the same model in a Ray actor holding one CPU, on a
local Ray cluster of this machine's two cores) against the same harvest in one process (one vLLM
engine, both cores), of ``resid_post.6`` over the same corpus in shards of four rows: the rates
while harvesting (the harvest's own seconds, after the replicas' engines are up), the wall time of
the whole call with the replicas' start, and the tokens each replica did. The two replicas share
the two cores the one process has to itself: the figure is what two replicas cost here, not
what they gain on two machines. Recorded in ``bench/results/harvest_replicas.json``.

Ends with ``RESULT`` lines.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from _results import Results  # bench/, the script's own directory
from _workers import steady_malloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from sae_overhead import random_sae
from vllm_overhead import build_model, plain_run

from interp_engine import load_model, sync_model
from interp_engine.harvest import harvest, pack

MEASURES = ("packages/interp-core/src/interp_engine/harvest", "packages/interp-vllm/src/interp_vllm")
CONTEXT = 128
SAE_NAME = "bench"


def make_corpus(n_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    docs: list[list[int]] = []
    total = 0
    while total < n_tokens:
        length = int(torch.randint(40, 401, (1,), generator=gen))
        docs.append(torch.randint(3, vocab, (length,), generator=gen).tolist())
        total += length
    return docs


def rows_of(docs: list[list[int]], bos: int | None) -> list[list[int]]:
    packed = pack(enumerate(docs), context_size=CONTEXT, packing="concat", bos_id=bos, separator_id=bos)
    return [r.tokens for r in packed]


class PeakRss:
    """The process's peak RSS above its RSS at the start, sampled every 10 ms."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.start = self.process.memory_info().rss
        self.peak = self.start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def main(args: argparse.Namespace) -> int:
    print(f"workers allocate with: {steady_malloc(True)}")
    results = Results("harvest", MEASURES, record=not args.quick)
    path = build_model("gpt2")
    model = sync_model(load_model(path, backend="vllm", max_model_len=512))
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    try:
        model.warmup()
        info = model.model.info
        middle = info.n_layers // 2
        model.attach_sae(SAE_NAME, random_sae(info.d_model, middle))
        bos = model.model.tok.tokenizer.bos_token_id
        docs = make_corpus(args.rows * CONTEXT + 400, info.vocab_size)
        rows = rows_of(docs, bos)[: args.rows]
        n_tokens = sum(len(r) for r in rows)
        every = [f"resid_post.{layer}" for layer in range(info.n_layers)]

        def plain() -> int:
            model.run(lambda: plain_run(model.model, rows, tokens=1, salted=True))
            return n_tokens

        def harvesting(name: str, **options: Any) -> Callable[[], int]:
            def run() -> int:
                out = scratch / name
                shutil.rmtree(out, ignore_errors=True)
                summary = harvest(
                    model,
                    docs,
                    out,
                    formats=["safetensors"],
                    context_size=CONTEXT,
                    max_rows=args.rows,
                    batch_rows=args.rows,
                    progress=False,
                    **options,
                )
                assert summary.tokens == n_tokens, (summary.tokens, n_tokens)
                return summary.tokens

            return run

        variants = {
            "every_layer": harvesting("every", addresses=every),
            "one_address": harvesting("one", addresses=[f"resid_post.{middle}"]),
            "readouts": harvesting("readouts", saes=[SAE_NAME], top_k=32),
        }
        targets = {"every_layer": 0.90, "one_address": 0.97, "readouts": 0.85}

        def rate(run: Callable[[], int]) -> float:
            time.sleep(0.5)
            start = time.perf_counter()
            tokens = run()
            return tokens / (time.perf_counter() - start)

        plain()
        for run in variants.values():  # one untimed pass each
            run()
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        rates: dict[str, list[float]] = {name: [] for name in ["plain", *variants]}
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            before = rate(plain)
            rates["plain"].append(before)
            for name in order:
                value = rate(variants[name])
                after = rate(plain)
                rates[name].append(value)
                rates["plain"].append(after)
                ratios[name].append(value / ((before + after) / 2))
                before = after
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {ratios[n][-1]:.3f}" for n in variants), flush=True)
        print(f"\n{n_tokens} tokens in {len(rows)} rows of {CONTEXT}; tokens/s (median):")
        for name, values in rates.items():
            print(f"  {name:<12} {statistics.median(values):10.0f}")
        for name in variants:
            results.add(f"harvest_{name}_vs_plain", statistics.median(ratios[name]), targets[name], rounds=ratios[name])

        every_out = scratch / "every"
        values = n_tokens * info.d_model * info.n_layers
        written = sum(p.stat().st_size for p in (every_out / "shards").glob("*.safetensors"))
        results.add(
            "harvest_bytes_per_value",
            written / values,
            4.0 * 1.02,
            better="lower",
            note="(float32: 4 bytes a value; the rest is token ids, documents, positions and headers)",
        )
        growth = {}
        for factor in (1, 10):
            long_docs = make_corpus(factor * args.rows * CONTEXT + 400, info.vocab_size, seed=factor)
            out = scratch / f"rss{factor}"
            with PeakRss() as peak:
                harvest(
                    model,
                    long_docs,
                    out,
                    addresses=[f"resid_post.{middle}"],
                    formats=["safetensors"],
                    context_size=CONTEXT,
                    max_rows=factor * args.rows,
                    batch_rows=16,
                    shard_bytes=4 << 20,
                    progress=False,
                )
            growth[factor] = peak.growth
            shutil.rmtree(out)
            print(f"  peak RSS growth, {factor * args.rows} rows: {peak.growth / 2**20:.1f} MiB")
        results.add(
            "harvest_peak_rss_growth_10x_minus_1x_mib",
            (growth[10] - growth[1]) / 2**20,
            "about 0",
            note=f"({growth[1] / 2**20:.1f} MiB and {growth[10] / 2**20:.1f} MiB over the RSS before each harvest)",
            digits=1,
        )
    finally:
        model.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    results.write()
    return 0


def main_replicas(args: argparse.Namespace) -> int:
    import ray

    results = Results("harvest_replicas", MEASURES, record=not args.quick)
    path = build_model("gpt2")
    options = {"max_model_len": 512}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        probe = load_model(path, backend="vllm", **options)  # the tokenizer and sizes; no engine started
        info, bos = probe.info, probe.tok.tokenizer.bos_token_id
        middle = info.n_layers // 2
        docs = make_corpus(args.rows * CONTEXT + 400, info.vocab_size)
        n_tokens = sum(len(r) for r in rows_of(docs, bos)[: args.rows])
        shard_bytes = 4 * CONTEXT * (info.d_model * 4 + 16)  # four rows a shard

        def run(name: str, replicas: int | None) -> tuple[float, float, tuple[int, ...]]:
            out = scratch / name
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            summary = harvest(
                path,
                docs,
                out,
                addresses=[f"resid_post.{middle}"],
                formats=["safetensors"],
                context_size=CONTEXT,
                max_rows=args.rows,
                batch_rows=4,
                shard_bytes=shard_bytes,
                progress=False,
                backend="vllm",
                model_options=options,
                replicas=replicas,
            )
            wall = time.perf_counter() - start
            assert summary.tokens == n_tokens, (summary.tokens, n_tokens)
            return summary.tokens / summary.seconds, wall, summary.replica_tokens

        one_rates, two_rates, one_walls, two_walls = [], [], [], []
        per_replica: tuple[int, ...] = ()
        for round_index in range(args.rounds):
            one_rate, one_wall, _ = run("one", None)
            two_rate, two_wall, per_replica = run("two", 2)
            one_rates.append(one_rate)
            two_rates.append(two_rate)
            one_walls.append(one_wall)
            two_walls.append(two_wall)
            print(
                f"round {round_index + 1}: one process {one_rate:.0f} tok/s ({one_wall:.1f} s with its start), "
                f"two replicas {two_rate:.0f} tok/s ({two_wall:.1f} s with their start), "
                f"tokens per replica {list(per_replica)}",
                flush=True,
            )
        ratios = [b / a for a, b in zip(one_rates, two_rates, strict=True)]
        note = (
            f"({statistics.median(two_rates):.0f} against {statistics.median(one_rates):.0f} tok/s while harvesting "
            f"{n_tokens} tokens; two replicas of one CPU each share the two cores one process uses)"
        )
        ratio = statistics.median(ratios)
        results.add("harvest_two_replicas_vs_one_process", ratio, "report", rounds=ratios, note=note)
        results.add(
            "harvest_two_replicas_wall_s",
            statistics.median(two_walls),
            "report",
            note=f"(the call with the replicas' start; one process: {statistics.median(one_walls):.1f} s)",
            digits=1,
        )
        results.add(
            "harvest_replica_token_share",
            min(per_replica) / max(per_replica),
            "report",
            note=f"(tokens per replica {list(per_replica)}: shard k on replica k mod 2)",
        )
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    results.write()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=48, help="rows of 128 tokens per variant (default 48)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--replicas", type=int, choices=[2], help="measure a harvest on two Ray replicas instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run: print the figures, record nothing")
    parsed = parser.parse_args()
    sys.exit(main_replicas(parsed) if parsed.replicas else main(parsed))
