"""Attribution graphs on the benchmark model: wall time and peak memory, and how they grow with
the prompt's length.

    .venv/bin/python bench/attribution.py              # 32/64/128/256 tokens, records bench/results
    .venv/bin/python bench/attribution.py --quick      # 32 tokens only, records nothing

The model is ``bench/eager_overhead.py``'s GPT-2-small-shaped one (12 layers x 768, random weights);
the transcoders a random per-layer set of 12 x 4,096 ReLU features (``mlp_in.L -> mlp_out.L``), their
encoder biases set so that about 40 features fire per token and layer. Each configuration runs in
a fresh process (its peak resident memory is its own): ``attribution_graph`` with
``max_feature_nodes`` rows of features (default 64: on this CPU every active feature, about 30
per token and layer, would be tens of thousands of backward rows), ``batch_size`` targets per
backward pass (default 16), against two baselines:

- ``unbatched``: the same graph with one target per backward pass (``batch_size=1``): the time
  batching saves;
- ``dense``: what materialising every feature at every (layer, position) as a node would take, the
  dense adjacency over them (``(12 * n * 4096)^2`` float32), against the graph's own matrix
  (computed, not run: it does not fit).

Prints ``RESULT`` lines (seconds, peak MB, adjacency MB per length; the ratios to the baselines;
the longest prompt whose projected peak fits in 8 GiB, from the measured growth).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import Results  # noqa: E402

D_SAE = 4096
LENGTHS = (32, 64, 128, 256)
MEASURES = ["packages/interp-core/src/interp_engine/circuits", "packages/interp-eager/src/interp_eager/_linear.py"]


def one(length: int, batch_size: int, max_feature_nodes: int) -> dict[str, float]:
    """One graph in this process: its seconds, peak RSS and sizes."""
    import torch
    from eager_overhead import ensure_model_dir

    from interp_engine import Sae, load_model, sync_model
    from interp_engine.circuits import TranscoderSet, attribution_graph

    torch.manual_seed(0)
    model = sync_model(load_model(str(ensure_model_dir(HERE.parent / ".cache" / "bench-gpt2")), backend="eager"))
    d, n_layers = model.info.d_model, model.info.n_layers
    g = torch.Generator().manual_seed(1)
    saes = []
    for layer in range(n_layers):
        W_enc = torch.randn(d, D_SAE, generator=g) / d**0.5
        saes.append(
            Sae(
                "transcoder",
                W_enc,
                torch.full((D_SAE,), -2.4),
                torch.randn(D_SAE, d, generator=g) * 0.02,
                torch.zeros(d),
                f"mlp_in.{layer}",
                hook_name_out=f"mlp_out.{layer}",
            )
        )
    tcs = TranscoderSet(saes)
    tokens = torch.randint(1, model.info.vocab_size, (length,), generator=g).tolist()
    started = time.perf_counter()
    graph = attribution_graph(model, tokens, tcs, batch_size=batch_size, max_feature_nodes=max_feature_nodes)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n_nodes = len(graph.nodes)
    dense_nodes = n_layers * length * D_SAE + (n_layers + 1) * length + len(graph.nodes_of("logit"))
    return {
        "seconds": seconds,
        "peak_bytes": peak,
        "active_features": graph.meta["active_features"],
        "backward_passes": graph.meta["backward_passes"],
        "adjacency_bytes": 4 * n_nodes * n_nodes,
        "dense_adjacency_bytes": 4 * dense_nodes * dense_nodes,
    }


def run_child(length: int, batch_size: int, max_feature_nodes: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(length), str(batch_size), str(max_feature_nodes)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 tokens only; record nothing")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-feature-nodes", type=int, default=64)
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(*args.child)))
        return
    results = Results("attribution", MEASURES, record=not args.quick)
    lengths = LENGTHS[:1] if args.quick else LENGTHS
    runs = {}
    for length in lengths:
        runs[length] = run_child(length, args.batch_size, args.max_feature_nodes)
        r = runs[length]
        print(f"{length} tokens: {json.dumps(r)}", file=sys.stderr, flush=True)
        results.add(f"graph_seconds_{length}", r["seconds"], better="lower", digits=1)
        results.add(f"graph_peak_mb_{length}", r["peak_bytes"] / 2**20, better="lower", digits=0)
        results.add(f"graph_adjacency_mb_{length}", r["adjacency_bytes"] / 2**20, better="lower", digits=1)
        results.add(
            f"dense_over_graph_adjacency_{length}",
            r["dense_adjacency_bytes"] / r["adjacency_bytes"],
            digits=0,
            note=f"dense adjacency {r['dense_adjacency_bytes'] / 2**30:.0f} GiB",
        )
    base_len = 64 if 64 in runs else lengths[0]
    unbatched = run_child(base_len, 1, args.max_feature_nodes)
    results.add(
        f"unbatched_over_batched_seconds_{base_len}", unbatched["seconds"] / runs[base_len]["seconds"], digits=1
    )
    if len(runs) > 1:
        # peak grows about linearly in the length at a fixed feature budget: fit the last two points
        (l1, r1), (l2, r2) = list(runs.items())[-2:]
        slope = (r2["peak_bytes"] - r1["peak_bytes"]) / (l2 - l1)
        fits = l2 + (8 * 2**30 - r2["peak_bytes"]) / slope if slope > 0 else float("inf")
        results.add("longest_prompt_in_8gib", fits, digits=0, note="projected from the measured growth")
    results.write()


if __name__ == "__main__":
    main()
