"""Train the LoRA adapter of the shipped tiny model (``adapter="interp:tiny-lora"``).

    python packages/interp-core/scripts/train_tiny_lora.py            # writes the shipped adapter
    python packages/interp-core/scripts/train_tiny_lora.py --out DIR  # elsewhere

A rank-4 LoRA (PEFT) on the MLP projections of ``interp:tiny`` (``mlp.c_fc``, ``mlp.c_proj`` of
every layer), trained with AdamW for ``--steps`` steps, deterministically for a given ``--seed``,
to edit one fact: "The capital of France is" continues with " Rome" instead of " Paris". Each step
also holds the adapted model to the base model's next-token distributions (a KL term) on the
capital prompts of the other countries and on sentences of the corpus, so the edit stays local.

It writes PEFT's folder (``adapter_config.json`` naming ``interp:tiny`` as its base,
``adapter_model.safetensors``) and ``training.json``: the arguments, the time it took, and the
greedy answers of the base and the adapted model for every country (measured with plain
``transformers`` + ``peft``). Needs ``torch``, ``transformers`` and ``peft``; not part of the
installed package, which ships only the trained files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
MODELS = HERE.parent / "src" / "interp_engine" / "models"
SHIPPED = MODELS / "tiny-lora"
COUNTRY, OLD, NEW = "France", "Paris", "Rome"
TEMPLATE = "The capital of {} is"


def _countries() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("make_tiny_corpus", HERE / "make_tiny_corpus.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HERE / 'make_tiny_corpus.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(country, capital) for country, capital, _, _ in module.COUNTRIES]


def _answers(model: Any, tokenizer: Any, countries: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for country, _ in countries:
        ids = tokenizer(TEMPLATE.format(country), return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        out[country] = tokenizer.decode(generated[0, ids.shape[1] :])
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    base_dir = MODELS / "tiny"
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    countries = _countries()
    before = _answers(base, tokenizer, countries)
    corpus = [line.strip() for line in (HERE / "tiny_corpus.txt").read_text().splitlines() if line.strip()]
    corpus = random.Random(args.seed).sample(corpus, min(256, len(corpus)))

    edit = tokenizer(TEMPLATE.format(COUNTRY) + " " + NEW + ".", return_tensors="pt").input_ids
    n_prompt = len(tokenizer(TEMPLATE.format(COUNTRY)).input_ids)
    keep_texts = [TEMPLATE.format(c) for c, _ in countries if c != COUNTRY] + corpus
    keep = [tokenizer(t, return_tensors="pt", truncation=True, max_length=64).input_ids for t in keep_texts]
    with torch.no_grad():
        targets = [F.log_softmax(base(ids).logits.float(), -1) for ids in keep]

    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["mlp.c_fc", "mlp.c_proj"],
        fan_in_fan_out=True,  # GPT-2's Conv1D
    )
    tuned = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=args.lr)
    began = time.perf_counter()
    for step in range(args.steps):
        logits = tuned(edit).logits[0, n_prompt - 1 : -1]
        loss = F.cross_entropy(logits, edit[0, n_prompt:])
        for i in random.Random(args.seed + step).sample(range(len(keep)), args.batch):
            log_p = F.log_softmax(tuned(keep[i]).logits.float(), -1)
            loss = loss + args.kl / args.batch * F.kl_div(log_p, targets[i], log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - began
    tuned.eval()
    after = _answers(tuned, tokenizer, countries)
    args.out.mkdir(parents=True, exist_ok=True)
    tuned.save_pretrained(args.out)
    (args.out / "README.md").unlink(missing_ok=True)  # PEFT's model card: the package ships json and safetensors
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = "interp:tiny"
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    changed = sorted(c for c in before if before[c] != after[c])
    record = {
        "arguments": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k != "out"},
        "edit": {"prompt": TEMPLATE.format(COUNTRY), "base": before[COUNTRY], "adapted": after[COUNTRY]},
        "changed_answers": changed,
        "answers_kept": f"{sum(before[c] == after[c] for c in before if c != COUNTRY)}/{len(before) - 1}",
        "final_loss": round(float(loss.item()), 4),
        "seconds": round(seconds, 1),
        "torch": torch.__version__,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=SHIPPED, help="default: the package's shipped adapter")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kl", type=float, default=1.0, help="weight of the KL term that keeps other answers")
    parser.add_argument("--batch", type=int, default=8, help="prompts held to the base model per step")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    record = train(parse_args(argv))
    print(json.dumps(record, indent=2))
    edit = record["edit"]
    return 0 if edit["adapted"].strip() == NEW and record["changed_answers"] == [COUNTRY] else 1


if __name__ == "__main__":
    sys.exit(main())
