"""Train the tiny model that ships with interp-core (``load_model("interp:tiny")``).

    python packages/interp-core/scripts/train_tiny.py            # writes the shipped model
    python packages/interp-core/scripts/train_tiny.py --out DIR --steps 20   # a quick check

What it does, deterministically for a given ``--seed`` (and library versions, thread count):

1. trains a byte-level BPE tokenizer (``tokenizers``) on ``tiny_corpus.txt`` and saves it as a
   ``transformers`` fast tokenizer (``tokenizer.json``), so HF ``AutoTokenizer`` and vLLM load it;
2. trains a GPT-2-shaped ``GPT2LMHeadModel`` (4 layers, d_model 128, 4 heads of 32, 256 positions)
   with AdamW, in two phases. Phase 1 (``--circuit-steps``) sees only short rows of random-token
   runs each shown twice (only the second copies are scored: only copying the first copy predicts
   them). Phase 2 (``--steps``) sees 256-token rows: windows of the corpus that start at a
   sentence, with such repeat rows mixed in. Throughout, two auxiliary attention losses ask
   head 0.0 to attend to the previous token and head 1.0 to the token after the current token's
   earlier occurrence (an induction head): at this size and step budget the plain objective alone
   learns to copy through a circuit offset by one position (attending one token further on, and
   reading the answer from there), which the standard induction score does not see, or not at all;
3. saves ``model.safetensors`` (float32), ``config.json``, ``generation_config.json``, the tokenizer
   files and ``training.json`` (the arguments, the final loss and the time it took);
4. prints what it learned, measured with plain ``transformers``: greedy capitals, the logit lens
   on "The capital of France is", the best induction head and a steering flip.

Needs ``torch``, ``transformers`` and ``tokenizers`` (installed with interp-eager). Not part of
the installed package: the package ships only the trained files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE / "tiny_corpus.txt"
SHIPPED = HERE.parent / "src" / "interp_engine" / "models" / "tiny"

EOS = "<|endoftext|>"  # GPT-2's convention: one token is BOS and EOS; nothing is prepended
PAD = "<|pad|>"


def _countries() -> tuple[tuple[str, str], ...]:
    """(country, capital) pairs from the corpus generator's table."""
    spec = importlib.util.spec_from_file_location("make_tiny_corpus", HERE / "make_tiny_corpus.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HERE / 'make_tiny_corpus.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple((country, capital) for country, capital, _, _ in module.COUNTRIES)


def train_tokenizer(docs: Sequence[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's pipeline) trained on ``docs``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


class Batches:
    """Training rows: corpus windows that start at a sentence, or runs of random tokens shown twice."""

    def __init__(
        self,
        stream: torch.Tensor,
        starts: torch.Tensor,
        n_special: int,
        vocab: int,
        args: Any,
        shape: tuple[int, int, float] | None = None,
    ) -> None:
        """``shape``: ``(rows, tokens per row, fraction of repeat rows)``, by default the
        arguments' ``batch_size``, ``seq_len`` and ``repeat_fraction``."""
        self.stream, self.starts = stream, starts
        self.n_special, self.vocab = n_special, vocab
        self.batch, self.seq, self.p_repeat = shape or (args.batch_size, args.seq_len, args.repeat_fraction)
        self.min_run, self.max_run = args.min_run, args.max_run
        self.gen = torch.Generator().manual_seed(args.seed)

    def _int(self, low: int, high: int) -> int:
        """Uniform in ``[low, high]``."""
        return int(torch.randint(low, high + 1, (1,), generator=self.gen))

    def _repeats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A row of consecutive ``run, run`` pairs of random tokens; only the second copies are
        scored. Also, per position of a second copy, where an induction head looks: the token
        after the same token's first occurrence (-1 elsewhere)."""
        row = torch.empty(self.seq, dtype=torch.long)
        target = torch.full((self.seq,), -100, dtype=torch.long)
        induct = torch.full((self.seq,), -1, dtype=torch.long)
        at = 0
        while at < self.seq:
            run = self._int(self.min_run, self.max_run)
            tokens = torch.randint(self.n_special, self.vocab, (run,), generator=self.gen)
            pair = torch.cat([tokens, tokens])[: self.seq - at]
            row[at : at + len(pair)] = pair
            # the second copy's first token follows nothing predictable; the rest follow the first copy
            target[at + run + 1 : at + len(pair)] = pair[run + 1 :]
            queries = torch.arange(at + run, max(at + run, min(at + 2 * run - 1, self.seq)))
            induct[queries] = queries - run + 1
            at += len(pair)
        return row, target, induct

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, targets, induction_keys)``, each ``[batch, seq]``; a target of -100 is
        not scored, an induction key of -1 is no induction query."""
        rows, targets, keys = [], [], []
        for _ in range(self.batch):
            if float(torch.rand((), generator=self.gen)) < self.p_repeat:
                row, target, induct = self._repeats()
            else:
                start = int(self.starts[self._int(0, len(self.starts) - 1)])
                row = self.stream[start : start + self.seq]
                target, induct = row, torch.full((self.seq,), -1, dtype=torch.long)
            rows.append(row)
            targets.append(target)
            keys.append(induct)
        return torch.stack(rows), torch.stack(targets), torch.stack(keys)


def _head(spec: str) -> tuple[int, int]:
    layer, head = spec.split(".")
    return int(layer), int(head)


def circuit_loss(
    attentions: Sequence[torch.Tensor], induct: torch.Tensor, args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The auxiliary attention losses that give this tiny model a canonical induction circuit:
    ``-log`` of the attention a previous-token head pays to ``t-1`` (every row) and of the
    attention the induction head pays to the token after the earlier occurrence (repeat rows)."""
    layer, head = _head(args.prev_head)
    pattern = attentions[layer][:, head]  # [batch, q, k]
    t = torch.arange(1, pattern.shape[1])
    prev = -torch.log(pattern[:, t, t - 1] + 1e-6).mean()
    layer, head = _head(args.induction_head)
    pattern = attentions[layer][:, head]
    rows, queries = torch.nonzero(induct >= 0, as_tuple=True)
    if len(rows) == 0:
        return prev, pattern.sum() * 0.0
    return prev, -torch.log(pattern[rows, queries, induct[rows, queries]] + 1e-6).mean()


def _lr(step: int, args: Any) -> float:
    if step < args.warmup:
        return float(args.lr * (step + 1) / args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return float(args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))


def train(args: argparse.Namespace) -> pathlib.Path:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    docs = [line for line in args.corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenizer = train_tokenizer(docs, args.vocab_size, args.seq_len)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer(docs)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in [*doc, eos]], dtype=torch.long)
    # a row starts where a sentence does: after an end of sentence or of document
    enders = torch.tensor([tokenizer.convert_tokens_to_ids(t) for t in (".", "?", EOS)])
    starts = torch.nonzero(torch.isin(stream[:-1], enders)).flatten() + 1
    starts = starts[starts <= len(stream) - args.seq_len]
    batches = Batches(stream, starts, n_special=2, vocab=len(tokenizer), args=args)
    print(f"corpus: {len(docs)} documents, {len(stream)} tokens; vocabulary {len(tokenizer)}", flush=True)

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.seq_len,
        n_embd=args.d_model,
        n_layer=args.n_layers,
        n_head=args.d_model // args.head_dim,
        n_inner=4 * args.d_model,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = GPT2LMHeadModel(config)
    if args.prev_aux > 0 or args.induction_aux > 0:
        model.set_attn_implementation("eager")  # the circuit losses read the attention patterns
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wpe" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "wpe" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    model.train()
    began = time.perf_counter()
    circuit = args.prev_aux > 0 or args.induction_aux > 0
    smooth = None

    def step(batch: Batches, lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets, induct = batch.next()
        out = model(input_ids=inputs, output_attentions=circuit)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-100)
        if circuit:
            prev, induction = circuit_loss(out.attentions, induct, args)
            loss = loss + args.prev_aux * prev + args.induction_aux * induction
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss.item())

    def log(phase: str, index: int, last: int, value: float) -> None:
        if index % args.log_every == 0 or index == last:
            print(
                f"{phase} {index:5d}  loss {value:.3f}  (smoothed {smooth:.3f})  {time.perf_counter() - began:6.0f}s",
                flush=True,
            )

    # phase 1: short rows of repeated random tokens only, where the induction circuit forms
    # fastest; phase 2: the corpus, with repeat rows mixed in so the circuit stays
    repeats = Batches(stream, starts, 2, len(tokenizer), args, (args.circuit_batch, args.circuit_seq, 1.0))
    for index in range(args.circuit_steps):
        value = step(repeats, args.circuit_lr * min(1.0, (index + 1) / args.warmup))
        smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
        log("circuit", index, args.circuit_steps - 1, value)
    smooth = None
    for index in range(args.steps):
        value = step(batches, _lr(index, args))
        smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
        log("step", index, args.steps - 1, value)
    seconds = time.perf_counter() - began

    model.eval()
    model.set_attn_implementation("sdpa")
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    record = {
        "arguments": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in sorted(vars(args).items())},
        "final_loss_smoothed": round(smooth or float("nan"), 4),
        "train_seconds": round(seconds),
        "torch_threads": torch.get_num_threads(),
    }
    record["arguments"]["corpus"] = args.corpus.name
    record["arguments"].pop("out")
    return _save(model, tokenizer, record, args.out)


def _write_chat_template(folder: pathlib.Path) -> None:
    """The minimal chat template (``interp_engine._shipped.TINY_CHAT_TEMPLATE``) written into
    ``tokenizer_config.json``, the file the package ships (not a separate ``.jinja``)."""
    from interp_engine._shipped import TINY_CHAT_TEMPLATE

    (folder / "chat_template.jinja").unlink(missing_ok=True)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")


def _save(
    model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, record: dict[str, Any], out: pathlib.Path
) -> pathlib.Path:
    """Write into a temporary sibling and swap it in, so a failed run never leaves half a model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_chat_template(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the package data should be readable by all
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@torch.no_grad()
def report(path: pathlib.Path) -> dict[str, Any]:
    """What the saved model does, measured with plain ``transformers`` (eager attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()

    def residuals(prompt: str) -> list[torch.Tensor]:
        """The embedding and every block's output (resid_post) at the last position."""
        seen: list[torch.Tensor] = []

        def keep(module: Any, inputs: Any, output: Any) -> None:
            seen.append((output[0] if isinstance(output, tuple) else output)[0, -1].clone())

        handles = [block.register_forward_hook(keep) for block in model.transformer.h]
        try:
            out = model(**tok(prompt, return_tensors="pt"), output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        return [out.hidden_states[0][0, -1], *seen]

    correct = []
    for country, capital in _countries():
        ids = tok(f"The capital of {country} is", return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        text = tok.decode(out[0, ids.shape[1] :])
        correct.append(text.startswith(f" {capital}"))
    print(f"greedy capitals: {sum(correct)}/{len(correct)} correct", flush=True)

    paris = tok.convert_tokens_to_ids("ĠParis")
    print("logit lens, 'The capital of France is' -> ' Paris' (0: embedding, i: resid_post of layer i-1):")
    lens = []
    for layer, h in enumerate(residuals("The capital of France is")):
        probs = model.lm_head(model.transformer.ln_f(h)).softmax(-1)
        rank = int((probs > probs[paris]).sum())
        lens.append((layer, rank, float(probs[paris])))
        top = tok.decode([int(probs.argmax())])
        print(f"  {layer}: rank {rank:4d}  p {float(probs[paris]):.3f}  top {top!r}")

    gen = torch.Generator().manual_seed(1)
    run = torch.randint(2, len(tok), (4, 40), generator=gen)
    seq = torch.cat([run, run], dim=1)
    att = model(input_ids=seq, output_attentions=True).attentions
    n = run.shape[1]
    q = torch.arange(n, 2 * n - 1)
    scores = torch.stack([a[:, :, q, q - n + 1].mean(dim=(0, 2)) for a in att])  # [layer, head]
    best = divmod(int(scores.argmax()), scores.shape[1])
    print(f"best induction head: layer {best[0]} head {best[1]}, score {float(scores.max()):.3f}")

    france = residuals("The capital of France is")
    germany = residuals("The capital of Germany is")
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    flips = {}
    for layer in range(model.config.n_layer):
        delta = germany[layer + 1] - france[layer + 1]  # index 0 is the embedding

        def add(module: Any, inputs: Any, output: Any, delta: torch.Tensor = delta) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, -1] += delta
            return output

        handle = model.transformer.h[layer].register_forward_hook(add)
        try:
            top = int(model(input_ids=ids).logits[0, -1].argmax())
        finally:
            handle.remove()
        flips[layer] = tok.decode([top])
    print("steering France -> France + (Germany - France) at resid_post, last position:", flips)
    return {"capitals": sum(correct), "lens": lens, "induction": float(scores.max()), "steering": flips}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; its defaults are the run that produced the shipped model."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=SHIPPED, help="default: the package's shipped model")
    parser.add_argument("--corpus", type=pathlib.Path, default=CORPUS)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (0: torch's default); one is robust on a busy machine"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--vocab-size", type=int, default=2048, help="an upper bound: merges run out near 1,000")
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeat-fraction", type=float, default=0.25)
    parser.add_argument("--min-run", type=int, default=5)
    parser.add_argument("--max-run", type=int, default=40)
    parser.add_argument(
        "--circuit-steps", type=int, default=1000, help="phase 1: steps on repeated random tokens only (0: none)"
    )
    parser.add_argument("--circuit-batch", type=int, default=24)
    parser.add_argument("--circuit-seq", type=int, default=96)
    parser.add_argument("--circuit-lr", type=float, default=1e-3)
    parser.add_argument(
        "--prev-aux", type=float, default=1.0, help="weight of the previous-token attention loss (0: none)"
    )
    parser.add_argument("--prev-head", default="0.0", help="LAYER.HEAD asked to attend to the previous token")
    parser.add_argument(
        "--induction-aux", type=float, default=1.0, help="weight of the induction attention loss (0: none)"
    )
    parser.add_argument("--induction-head", default="1.0", help="LAYER.HEAD asked to attend like an induction head")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--no-report", action="store_true", help="skip the behaviour report at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = train(args)
    print(f"saved to {path}", flush=True)
    if not args.no_report:
        report(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
