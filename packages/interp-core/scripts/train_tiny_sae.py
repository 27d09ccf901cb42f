"""Train the sparse autoencoder that ships with interp-core (``interp:tiny-sae``) on ``interp:tiny``.

    python packages/interp-core/scripts/train_tiny_sae.py             # writes the shipped SAE
    python packages/interp-core/scripts/train_tiny_sae.py --out DIR   # elsewhere
    python packages/interp-core/scripts/train_tiny_sae.py --layer 1 --no-save   # just measure

What it does, deterministically for a given ``--seed`` (and library versions, thread count):

1. collects ``resid_post`` of the tiny model with the eager backend on every token of its own
   training corpus (``tiny_corpus.txt``: 1,200 documents, about 64,000 tokens), and on held-out
   text written by the corpus generator (``make_tiny_corpus.documents``) with another seed;
2. trains a TopK SAE (``k`` active latents per token, SAELens's ``topk`` architecture) on the
   corpus's activations, scaled to unit mean squared norm per dimension: Adam, unit-norm decoder
   rows, the encoder initialised as the decoder's transpose, the decoder bias at the mean, and the
   auxiliary loss of Gao et al. (2024): the latents that have not fired for a while are asked, by
   their own top ``k_aux``, to reconstruct the main reconstruction's error, which revives them;
   with ``--layer auto`` (the default) it does this at both middle layers, 1 and 2, and keeps the
   one whose features name the corpus generator's word categories best (the mean, over the
   categories, of the best single feature's F1 on held-out text);
3. measures on the held-out text: the fraction of variance explained, the fraction of dead
   features (those that never fire there) and the mean L0; and, for each category of word the
   generator writes (countries, capitals, languages, continents, names, animals, objects,
   adjectives, weather, numbers, places), the feature whose firing (activation > 0) best matches
   "this token is a word of that category" (F1), with its precision and recall; those with an F1
   of at least ``NAMED_MIN_F1`` are the named features;
4. saves the SAE in SAELens's on-disk format (``cfg.json`` + ``sae_weights.safetensors``, float32,
   the input scale folded into the weights so it encodes raw ``resid_post``) with
   ``interp_engine.Sae.save``, checks that ``load_sae`` reads it back to the same codes, writes
   ``features.json`` beside it (the figures, the named features and their top tokens), and prints
   ``RESULT`` lines.

Needs ``torch`` and ``transformers`` (installed with interp-eager). Not part of the installed
package: the package ships only the trained files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from interp_engine import Sae, load_model, load_sae, tiny_model_path

# the data set-up the two dictionaries' scripts share (_tiny_data.py, beside this one), also
# when this file is loaded by its path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _tiny_data import HELD_OUT_DOCS, HELD_OUT_SEED, capture_rows, corpus_documents, corpus_generator

HERE = pathlib.Path(__file__).resolve().parent
SHIPPED = HERE.parent / "src" / "interp_engine" / "models" / "tiny-sae"
MIDDLE_LAYERS = (1, 2)
NAMED_MIN_F1 = 0.5
"""A category's best feature is listed as a named feature from this F1 on held-out text."""
_WORD = re.compile(r"[A-Za-z]+|[0-9]+")


def categories(gen: ModuleType) -> dict[str, frozenset[str]]:
    """The word categories the corpus generator fills its templates with, as sets of words.

    Plurals are included where the templates write them (``"{animal}s"``); a two-word continent
    contributes both words. A word may be in two categories ("warm": an adjective and weather).
    """
    countries: Sequence[tuple[str, str, str, str]] = gen.COUNTRIES
    return {
        "country": frozenset(c[0] for c in countries),
        "capital city": frozenset(c[1] for c in countries),
        "language": frozenset(c[2] for c in countries),
        "continent": frozenset(word for c in countries for word in c[3].split()),
        "person name": frozenset(gen.NAMES),
        "animal": frozenset(gen.ANIMALS) | {a + "s" for a in gen.ANIMALS},
        "object": frozenset(gen.THINGS) | {t + "s" for t in gen.THINGS},
        "adjective": frozenset(gen.ADJECTIVES),
        "weather": frozenset(gen.WEATHER),
        "number": frozenset(str(n) for n in range(0, 100)),
        "place": frozenset(p.split()[-1] for p in gen.PLACES),
    }


def label_tokens(tokenizer: Any, text: str, cats: dict[str, frozenset[str]]) -> tuple[list[int], torch.Tensor]:
    """``text``'s token ids and a ``[n_tokens, n_categories]`` bool matrix: token ``i`` is part of
    a word of category ``j`` (every piece of a word split into several tokens is)."""
    enc = tokenizer(text, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    words = [(m.start(), m.end(), m.group()) for m in _WORD.finditer(text)]
    names = list(cats)
    labels = torch.zeros(len(ids), len(names), dtype=torch.bool)
    w = 0
    for i, (start, end) in enumerate(enc["offset_mapping"]):
        piece = text[start:end]
        first = start + len(piece) - len(piece.lstrip())  # the token's first non-space character
        while w < len(words) and words[w][1] <= first:
            w += 1
        if w == len(words) or not words[w][0] <= first < words[w][1]:
            continue  # punctuation, spaces
        word = words[w][2]
        for j, name in enumerate(names):
            labels[i, j] = word in cats[name]
    return ids, labels


@dataclass
class Tokens:
    """Activations of every real (non-padding) token of some documents, flattened."""

    acts: torch.Tensor  # [n, d_model] float32
    ids: torch.Tensor  # [n] token ids
    labels: torch.Tensor  # [n, n_categories] bool


def collect(
    model: Any, tokenizer: Any, docs: Sequence[str], layers: Sequence[int], cats: dict[str, frozenset[str]]
) -> dict[int, Tokens]:
    """``resid_post`` at ``layers`` for every token of ``docs`` (one document per row), with labels."""
    rows, labels = [], []
    for doc in docs:
        ids, lab = label_tokens(tokenizer, doc, cats)
        rows.append(ids)
        labels.append(lab)
    acts = capture_rows(model, rows, [f"resid_post.{layer}" for layer in layers])
    ids = torch.tensor([i for row in rows for i in row])
    flat = torch.cat(labels)
    return {layer: Tokens(torch.cat(acts[f"resid_post.{layer}"]), ids, flat) for layer in layers}


class TopKSae(torch.nn.Module):
    """A TopK SAE on scaled inputs: ``f = TopK(ReLU((x - b_dec) W_enc + b_enc))``, ``x̂ = f W_dec + b_dec``."""

    def __init__(self, d_in: int, d_sae: int, k: int, gen: torch.Generator) -> None:
        super().__init__()
        self.k = k
        w_dec = torch.randn(d_sae, d_in, generator=gen)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.W_dec = torch.nn.Parameter(w_dec)
        self.W_enc = torch.nn.Parameter(w_dec.T.clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor, k: int | None = None, pre: torch.Tensor | None = None) -> torch.Tensor:
        pre = self.pre(x) if pre is None else pre
        top = pre.topk(k or self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, F.relu(top.values))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = self.pre(x)
        f = self.encode(x, pre=pre)
        return f @ self.W_dec + self.b_dec, f, pre

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True)

    @torch.no_grad()
    def project_decoder_grad(self) -> None:
        """Remove the gradient's component along each (unit) decoder row: a step keeps its norm."""
        if self.W_dec.grad is not None:
            along = (self.W_dec.grad * self.W_dec).sum(dim=1, keepdim=True)
            self.W_dec.grad -= along * self.W_dec


def _fve(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return 1.0 - float((x - x_hat).pow(2).sum() / (x - x.mean(dim=0)).pow(2).sum())


def train_sae(acts: torch.Tensor, args: argparse.Namespace) -> tuple[TopKSae, float]:
    """A TopK SAE trained on ``acts / scale`` and the ``scale`` (``acts``'s root mean square per dimension)."""
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    scale = float(acts.pow(2).mean().sqrt())
    x_all = acts / scale
    sae = TopKSae(x_all.shape[1], args.d_sae, args.k, gen)
    with torch.no_grad():
        sae.b_dec.copy_(x_all.mean(dim=0))
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr, betas=(0.9, 0.999))
    decay_from = int(args.steps * 0.8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 if s < decay_from else max(0.0, (args.steps - s) / (args.steps - decay_from))
    )
    since_fired = torch.zeros(args.d_sae, dtype=torch.long)
    order = torch.randperm(len(x_all), generator=gen)
    at = 0
    for step in range(args.steps):
        if at + args.batch_size > len(order):
            order, at = torch.randperm(len(x_all), generator=gen), 0
        x = x_all[order[at : at + args.batch_size]]
        at += args.batch_size
        x_hat, f, pre = sae(x)
        err = x - x_hat
        nmse = err.pow(2).sum() / (x - x.mean(dim=0)).pow(2).sum()
        loss = nmse
        fired = (f > 0).any(dim=0)
        since_fired = torch.where(fired, 0, since_fired + len(x))
        dead = since_fired > args.dead_tokens
        aux = torch.zeros(())
        if bool(dead.any()) and args.aux_coef > 0:
            k_aux = min(args.k_aux, int(dead.sum()))
            f_aux = sae.encode(x, k=k_aux, pre=pre.masked_fill(~dead, float("-inf")))
            e = err.detach()
            aux = (e - f_aux @ sae.W_dec).pow(2).sum() / e.pow(2).sum().clamp_min(1e-8)
            loss = loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        sae.project_decoder_grad()
        opt.step()
        sched.step()
        sae.normalize_decoder()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  nmse {float(nmse.detach()):.4f}  aux {float(aux.detach()):.4f}  "
                f"dead {int(dead.sum())}/{args.d_sae}",
                flush=True,
            )
    return sae, scale


@torch.no_grad()
def to_sae(sae: TopKSae, scale: float, layer: int) -> Sae:
    """The trained SAE as an :class:`interp_engine.Sae` on raw ``resid_post.{layer}``, the input
    scale and ``b_dec``'s subtraction folded in: ``f = TopK(ReLU(x W_enc + b_enc))``,
    ``x̂ = f W_dec + b_dec``. Decoder rows keep unit norm, so an activation is the norm of the
    feature's contribution. (Scaling ``pre`` by ``scale`` does not change which ``k`` are on top.)"""
    return Sae(
        "topk",
        sae.W_enc.detach().clone().contiguous(),
        (scale * (sae.b_enc - sae.b_dec @ sae.W_enc)).detach().clone(),
        sae.W_dec.detach().clone().contiguous(),
        (scale * sae.b_dec).detach().clone(),
        f"blocks.{layer}.hook_resid_post",
        k=sae.k,
        apply_b_dec_to_input=False,
        normalize_activations="none",
        cfg={
            "model_name": "interp:tiny",
            "hook_layer": layer,
            "context_size": 256,
            "prepend_bos": False,
            "dataset_path": "packages/interp-core/scripts/tiny_corpus.txt",
        },
    )


def measure(f: torch.Tensor, x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """FVE, dead fraction (never fires on these tokens) and mean L0 of codes ``f`` of ``x``."""
    fires = f > 0
    return {
        "fve": _fve(x, x_hat),
        "dead_fraction": float((~fires.any(dim=0)).float().mean()),
        "mean_l0": float(fires.sum(dim=1).float().mean()),
    }


def precision_recall(fires: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (feature, category): precision, recall and F1 of "the feature fires" for "the token is of
    the category". ``fires`` ``[n, d_sae]``, ``labels`` ``[n, n_categories]``, both bool."""
    both = fires.float().T @ labels.float()  # [d_sae, n_cat]
    precision = both / fires.sum(dim=0).clamp_min(1)[:, None]
    recall = both / labels.sum(dim=0).clamp_min(1)[None, :]
    f1 = 2 * precision * recall / (precision + recall).clamp_min(1e-12)
    return precision, recall, f1


def name_features(
    f: torch.Tensor, data: Tokens, cat_names: Sequence[str], tokenizer: Any, top: int = 8
) -> list[dict[str, Any]]:
    """For each category, the feature with the best F1, its precision and recall, the distinct
    tokens it fires on most strongly and those it fires on most often; best F1 first."""
    precision, recall, f1 = precision_recall(f > 0, data.labels)
    named = []
    for j, name in enumerate(cat_names):
        if not bool(data.labels[:, j].any()):
            continue
        feature = int(f1[:, j].argmax())
        column = f[:, feature]
        best: dict[int, float] = {}
        for i in column.argsort(descending=True).tolist():
            if float(column[i]) <= 0 or len(best) == top:
                break
            best.setdefault(int(data.ids[i]), float(column[i]))
        fired = data.ids[column > 0]
        counts = torch.bincount(fired, minlength=int(data.ids.max()) + 1)
        frequent = [t for t in counts.argsort(descending=True)[:top].tolist() if int(counts[t]) > 0]
        named.append(
            {
                "category": name,
                "feature": feature,
                "precision": round(float(precision[feature, j]), 4),
                "recall": round(float(recall[feature, j]), 4),
                "f1": round(float(f1[feature, j]), 4),
                "category_tokens": int(data.labels[:, j].sum()),
                "fires_on": int((column > 0).sum()),
                "top_tokens": [
                    {"token": tokenizer.decode([tid]), "activation": round(act, 3)} for tid, act in best.items()
                ],
                "frequent_tokens": [
                    {"token": tokenizer.decode([t]), "share": round(int(counts[t]) / max(1, len(fired)), 3)}
                    for t in frequent
                ],
            }
        )
    return sorted(named, key=lambda n: -float(n["f1"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; its defaults are the run that produced the shipped SAE."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=SHIPPED, help="default: the package's shipped SAE")
    parser.add_argument("--no-save", action="store_true", help="measure only, write nothing")
    parser.add_argument(
        "--layer", default="auto", help="a layer, or auto: of 1 and 2, the one whose features name categories best"
    )
    parser.add_argument("--d-sae", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--k-aux", type=int, default=64, help="latents of the dead-latent auxiliary loss")
    parser.add_argument("--aux-coef", type=float, default=1 / 32, help="its weight (0: none)")
    parser.add_argument("--dead-tokens", type=int, default=20_000, help="dead after this many tokens unfired")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--log-every", type=int, default=500)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from transformers import AutoTokenizer

    gen = corpus_generator()
    cats = categories(gen)
    cat_names = list(cats)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = load_model("interp:tiny", backend="eager")
    layers = list(MIDDLE_LAYERS) if args.layer == "auto" else [int(args.layer)]
    train = collect(model, tokenizer, corpus_documents(), layers, cats)
    held = collect(model, tokenizer, gen.documents(HELD_OUT_DOCS, seed=HELD_OUT_SEED), layers, cats)
    print(f"{len(train[layers[0]].ids)} training tokens, {len(held[layers[0]].ids)} held-out tokens", flush=True)

    results = []
    for layer in layers:
        print(f"-- layer {layer}", flush=True)
        sae = to_sae(*train_sae(train[layer].acts, args), layer)
        x = held[layer].acts
        f = sae.encode(x)
        figures = measure(f, x, sae.decode(f))
        named = name_features(f, held[layer], cat_names, tokenizer)
        score = sum(float(n["f1"]) for n in named) / len(named)
        print(
            f"layer {layer}: fve {figures['fve']:.4f}  dead {figures['dead_fraction']:.4f}  "
            f"l0 {figures['mean_l0']:.2f}  mean best F1 over categories {score:.3f}",
            flush=True,
        )
        results.append((score, layer, sae, figures, named))
    score, layer, sae, figures, named = max(results, key=lambda r: r[0])
    report: dict[str, Any] = {
        "model": "interp:tiny",
        "sae": "interp:tiny-sae",
        "hook_name": sae.hook_name,
        "address": str(sae.address),
        "layer": layer,
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "fve": round(figures["fve"], 4),
        "dead_fraction": round(figures["dead_fraction"], 4),
        "mean_l0": round(figures["mean_l0"], 3),
        "mean_best_f1": round(score, 4),
        "layers_compared": {f"resid_post.{r[1]}": round(r[0], 4) for r in results},
        "training_tokens": len(train[layer].ids),
        "held_out": {"generator_seed": HELD_OUT_SEED, "documents": HELD_OUT_DOCS, "tokens": len(held[layer].ids)},
        "fires": "activation > 0; precision and recall are per token, on the held-out text",
        "named_min_f1": NAMED_MIN_F1,
        "features": [n for n in named if n["f1"] >= NAMED_MIN_F1],
        "unnamed_categories": [n for n in named if n["f1"] < NAMED_MIN_F1],
        "arguments": {k: (v.name if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k != "out"},
    }
    if not args.no_save:
        sae.save(args.out)
        (args.out / "sae_weights.safetensors").chmod(0o644)  # package data: readable by all, as git checks it out
        (args.out / "features.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", "utf-8")
        reread = load_sae(args.out).encode(held[layer].acts)
        if not torch.equal(reread, f):
            raise SystemExit("the saved SAE does not encode as the trained one")
        print(f"saved to {args.out}", flush=True)
    print(f"RESULT layer={layer} address={sae.address} d_in={sae.d_in} d_sae={sae.d_sae} k={sae.k}")
    print(
        f"RESULT fve={figures['fve']:.4f} dead_fraction={figures['dead_fraction']:.4f} "
        f"mean_l0={figures['mean_l0']:.2f} mean_best_f1={score:.3f}"
    )
    for n in named:
        tops = " ".join(repr(t["token"]) for t in n["top_tokens"][:5])
        print(
            f"RESULT feature category={n['category']!r} id={n['feature']} precision={n['precision']:.3f} "
            f"recall={n['recall']:.3f} f1={n['f1']:.3f} named={n['f1'] >= NAMED_MIN_F1} top={tops}",
            flush=True,
        )
    print(f"RESULT seconds={time.perf_counter() - started:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
