"""Train the per-layer transcoders that ship with interp-core (``interp:tiny-transcoders``) on ``interp:tiny``.

    python packages/interp-core/scripts/train_tiny_transcoders.py             # writes the shipped set
    python packages/interp-core/scripts/train_tiny_transcoders.py --out DIR   # elsewhere
    python packages/interp-core/scripts/train_tiny_transcoders.py --no-save   # just measure

What it does, deterministically for a given ``--seed`` (and library versions, thread count):

1. collects, with the eager backend, every layer's MLP input (``mlp_in``, after the layer norm) and
   output (``mlp_out``) on every token of the tiny model's training corpus (``tiny_corpus.txt``,
   about 64,000 tokens), and on held-out documents from the corpus generator with another seed;
2. trains one ReLU transcoder per layer, ``f = ReLU(x W_enc + b_enc)``, ``y = f W_dec + b_dec``,
   predicting the MLP's output from its input: Adam on the normalised squared error plus an L1
   penalty on ``f`` weighted by each decoder row's norm, inputs and outputs scaled to unit mean
   squared norm per dimension (folded back into the weights when saved);
3. measures on the held-out text, per layer: the fraction of the MLP output's variance the
   transcoder explains, the mean L0 and the fraction of dead features;
4. saves the set in circuit-tracer's layout (``layer_L.safetensors`` + ``config.yaml``) with
   :meth:`interp_engine.circuits.TranscoderSet.save`, checks that ``load_transcoders`` reads it
   back to the same outputs, writes ``transcoders.json`` (the figures), and prints ``RESULT`` lines.

Needs ``torch`` and ``transformers`` (installed with interp-eager). Not part of the installed
package: the package ships only the trained files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import torch

from interp_engine import Sae, load_model
from interp_engine.circuits import TranscoderSet, load_transcoders

# the data set-up the two dictionaries' scripts share (_tiny_data.py, beside this one), also
# when this file is loaded by its path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _tiny_data import capture_rows, corpus_documents, held_out_documents

HERE = pathlib.Path(__file__).resolve().parent

SHIPPED = HERE.parent / "src" / "interp_engine" / "models" / "tiny-transcoders"
N_LAYERS = 4


def collect(model: Any, docs: list[str]) -> dict[str, torch.Tensor]:
    """``mlp_in.L`` and ``mlp_out.L`` of every token of ``docs``: ``{"mlp_in.L": [n, 128], "mlp_out.L": ...}``."""
    rows = [model.to_tokens(doc)[0].tolist() for doc in docs]
    points = [f"{kind}.{layer}" for layer in range(N_LAYERS) for kind in ("mlp_in", "mlp_out")]
    return {p: torch.cat(v) for p, v in capture_rows(model, rows, points).items()}


def train_layer(x: torch.Tensor, y: torch.Tensor, layer: int, args: argparse.Namespace) -> Sae:
    """One ReLU transcoder from ``x`` (``mlp_in``) to ``y`` (``mlp_out``), as an :class:`Sae` on raw
    activations (the scales folded into the weights: ``f`` is unchanged)."""
    gen = torch.Generator().manual_seed(args.seed + layer)
    torch.manual_seed(args.seed + layer)
    sx, sy = float(x.pow(2).mean().sqrt()), float(y.pow(2).mean().sqrt())
    xs, ys = x / sx, y / sy
    d, k = x.shape[1], args.d_sae
    dec = torch.randn(k, d, generator=gen)
    W_dec = torch.nn.Parameter(dec / dec.norm(dim=1, keepdim=True) * 0.1)
    W_enc = torch.nn.Parameter(torch.randn(d, k, generator=gen) / d**0.5)
    b_enc = torch.nn.Parameter(torch.zeros(k))
    b_dec = torch.nn.Parameter(ys.mean(0).clone())
    opt = torch.optim.Adam([W_enc, W_dec, b_enc, b_dec], lr=args.lr)
    var = (ys - ys.mean(0)).pow(2).sum(1).mean()
    order = torch.randperm(len(xs), generator=gen)
    at = 0
    for step in range(args.steps):
        if at + args.batch_size > len(order):
            order, at = torch.randperm(len(xs), generator=gen), 0
        idx = order[at : at + args.batch_size]
        at += args.batch_size
        f = torch.relu(xs[idx] @ W_enc + b_enc)
        mse = ((f @ W_dec + b_dec) - ys[idx]).pow(2).sum(1).mean() / var
        l1 = (f * W_dec.norm(dim=1)).sum(1).mean()
        loss = mse + min(1.0, step / (0.3 * args.steps)) * args.l1 * l1
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            l0 = float((f > 0).float().sum(1).mean())
            print(f"  layer {layer} step {step:5d}  nmse {float(mse):.4f}  l0 {l0:.1f}", flush=True)
    with torch.no_grad():
        return Sae(
            "transcoder",
            (W_enc / sx).contiguous(),
            b_enc.clone(),
            (W_dec * sy).contiguous(),
            b_dec * sy,
            f"mlp_in.{layer}",
            hook_name_out=f"mlp_out.{layer}",
            cfg={"model_name": "interp:tiny", "dataset_path": "packages/interp-core/scripts/tiny_corpus.txt"},
        )


def measure(sae: Sae, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Fraction of ``y``'s variance explained, mean L0 and dead fraction on held-out tokens."""
    f = sae.encode(x)
    pred = sae.decode(f)
    fve = 1.0 - float((y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    fires = f > 0
    return {
        "fve": round(fve, 4),
        "mean_l0": round(float(fires.sum(1).float().mean()), 2),
        "dead_fraction": round(float((~fires.any(0)).float().mean()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=SHIPPED)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-sae", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--l1", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = load_model("interp:tiny", backend="eager")
    docs = [d for d in corpus_documents() if d.strip()]
    held_out = held_out_documents()
    train, test = collect(model, docs), collect(model, held_out)
    print(f"collected {len(train['mlp_in.0'])} training and {len(test['mlp_in.0'])} held-out tokens", flush=True)
    saes, figures = [], {}
    for layer in range(N_LAYERS):
        sae = train_layer(train[f"mlp_in.{layer}"], train[f"mlp_out.{layer}"], layer, args)
        saes.append(sae)
        figures[layer] = measure(sae, test[f"mlp_in.{layer}"], test[f"mlp_out.{layer}"])
        print(f"RESULT layer={layer} " + " ".join(f"{k}={v}" for k, v in figures[layer].items()), flush=True)
    tcs = TranscoderSet(saes)
    if not args.no_save:
        tcs.save(str(args.out))
        back = load_transcoders(args.out)
        for layer in range(N_LAYERS):
            x = test[f"mlp_in.{layer}"][:256]
            if not torch.equal(back[layer].encode(x), tcs[layer].encode(x)):  # type: ignore[index]
                raise SystemExit(f"layer {layer} does not read back to the same codes")
        info = {
            "model": "interp:tiny",
            "architecture": "transcoder (ReLU), mlp_in.L -> mlp_out.L, one per layer",
            "d_sae": args.d_sae,
            "train_tokens": len(train["mlp_in.0"]),
            "held_out_tokens": len(test["mlp_in.0"]),
            "held_out": {str(layer): figures[layer] for layer in range(N_LAYERS)},
            "training": {k: v for k, v in vars(args).items() if k not in ("out", "no_save")},
            "script": "packages/interp-core/scripts/train_tiny_transcoders.py",
        }
        (args.out / "transcoders.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"wrote {args.out}")
    print(f"RESULT seconds={time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
