"""``interp demo``: capture, logit lens, attention, steering, SAE features and a circuit (an
attribution graph through transcoders) on one model, as tables and PNGs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import plot
from .._errors import InterpError, UnsupportedAddress
from .._sync import SyncModel
from ..addresses._address import Address
from ..circuits._formats import load_transcoders
from ..protocol._base import ModelBase
from ..sae._readouts import FeatureReadout, Features
from ..sae._sae import Sae, load_sae
from ..steering._spec import FeatureWrite, SteeringSpec, Write
from ._common import (
    DEFAULT_MODEL,
    UserError,
    add_model_options,
    add_plot_options,
    bar,
    open_model,
    opened,
    plots_wanted,
    prompt_ids,
    save_figure,
    show_token,
    table,
)
from ._demo_circuits import DemoTranscoders, attach_demo_transcoders, section_circuits
from ._features import attach_name, describe_sae, feature_cells, feature_names, fired, label
from ._views import lens_top_k, logit_lens, plot_lens

PROMPT = "The capital of France is"
CONTRAST = "The capital of Germany is"
SAE = "interp:tiny-sae"
TRANSCODERS = "interp:tiny-transcoders"
SAE_TOP_K = 4
"""Features shown per token in the demo's SAE section."""
MAX_TRIALS = 16
"""At most this many of the last token's features are ablated one at a time (the strongest)."""


def repeated_random(sync: SyncModel, length: int, seed: int) -> tuple[list[int], int]:
    """A random block of ``length`` tokens shown twice (after any BOS), and where it starts."""
    info = sync.model.info
    prefix: list[int] = sync.to_tokens("")[0].tolist()  # the tokenizer's BOS, if it adds one
    generator = torch.Generator().manual_seed(seed)
    low = min(100, info.vocab_size // 2)
    block = torch.randint(low, info.vocab_size, (length,), generator=generator).tolist()
    return prefix + block + block, len(prefix)


def head_scores(
    sync: SyncModel, ids: list[int], start: int, layers: list[int], spec: SteeringSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of ``layers``, ``[len(layers), heads]`` each: the induction score (mean attention
    from each token of the second copy to the token after its earlier copy) and the
    previous-token score (mean attention to the previous token), under an optional steering spec."""
    length = (len(ids) - start) // 2
    acts = sync.capture_attention(ids, layers, steering_spec=spec)
    queries = torch.arange(start + length, start + 2 * length)
    everyone = torch.arange(start + 1, start + 2 * length)
    induction = torch.stack(
        [acts[Address("attn_pattern", layer)][:, queries, queries - length + 1].mean(-1) for layer in layers]
    )
    previous = torch.stack(
        [acts[Address("attn_pattern", layer)][:, everyone, everyone - 1].mean(-1) for layer in layers]
    )
    return induction, previous


def induction_scores(sync: SyncModel, length: int, seed: int) -> tuple[torch.Tensor, list[int], int]:
    """Every head's induction score on a repeated random sequence (an induction head's
    signature): ``[layers, heads]``, the ids, the offset."""
    ids, start = repeated_random(sync, length, seed)
    scores, _ = head_scores(sync, ids, start, list(range(sync.model.info.n_layers)))
    return scores, ids, start


def top_next(sync: SyncModel, logits: torch.Tensor, k: int) -> str:
    probs = logits.float().softmax(-1).topk(k)
    return ", ".join(
        f"{show_token(sync.to_str_tokens([int(i)])[0])} {float(p):.2f}"
        for p, i in zip(probs.values, probs.indices, strict=True)
    )


def section_capture(sync: SyncModel, ids: list[int]) -> list[Address]:
    info = sync.model.info
    points = [Address("embed")] + [Address("resid_post", layer) for layer in range(info.n_layers)]
    acts = sync.capture(ids, points)
    norms = [float(acts[p][-1].norm()) for p in points]
    print("1. capture: the residual stream's norm at the last token, layer by layer\n")
    rows = [[p, f"{n:.2f}", bar(n, max(norms))] for p, n in zip(points, norms, strict=True)]
    print(table(["address", "norm", ""], rows))
    return points


def section_attention(sync: SyncModel, length: int, seed: int) -> tuple[list[int], int, tuple[int, int], float] | None:
    print(
        f"\n3. attention: induction score of each head on {length} random tokens repeated "
        "(mean attention from a token to the one after its earlier copy; 1.0 is a perfect induction head)\n"
    )
    try:
        scores, rand_ids, start = induction_scores(sync, length, seed)
    except UnsupportedAddress as exc:
        print(f"   skipped: {exc}")
        return None
    best = divmod(int(scores.argmax()), scores.shape[1])
    rows = [[f"layer {i}", *[f"{float(s):.2f}" for s in scores[i]]] for i in range(scores.shape[0])]
    print(table(["", *[f"head {h}" for h in range(scores.shape[1])]], rows))
    print(f"\n   strongest: layer {best[0]} head {best[1]} ({float(scores[best]):.2f})")
    return rand_ids, start, best, float(scores[best])


def section_heads(
    sync: SyncModel, rand_ids: list[int], start: int, best: tuple[int, int], score: float, n_ablate: int
) -> None:
    """Zero-ablate the strongest previous-token heads below the induction head, one at a time,
    and show what is left of its induction score (the circuit: a previous-token head feeds it)."""
    layer, head = best
    print(
        f"\n4. heads: zero-ablate one earlier head at a time (attn_z set to 0 for that head) and measure "
        f"layer {layer} head {head}'s induction score again ({score:.2f} unablated)\n"
    )
    if layer == 0:
        print("   skipped: the strongest induction head is in layer 0; no earlier head can feed it")
        return
    info = sync.model.info
    _, previous = head_scores(sync, rand_ids, start, list(range(layer)))
    order = previous.flatten().argsort(descending=True)[:n_ablate].tolist()
    rows = []
    for index in order:
        src_layer, src_head = divmod(index, info.n_heads)
        off = SteeringSpec([Write(Address("attn_z", src_layer), torch.zeros(info.d_head), op="set", heads=[src_head])])
        after, _ = head_scores(sync, rand_ids, start, [layer], off)
        rows.append(
            [
                f"layer {src_layer} head {src_head}",
                f"{float(previous[src_layer, src_head]):.2f}",
                f"{float(after[0, head]):.2f}",
            ]
        )
    print(table(["ablated head", "previous-token score", f"induction score of {layer}.{head}"], rows))


def section_steering(sync: SyncModel, ids: list[int], contrast: str, layer: int, scale: float, max_tokens: int) -> None:
    point = Address("resid_post", layer)
    other = prompt_ids(sync, contrast)
    here = sync.capture(ids, [point])[point][-1]
    there = sync.capture(other, [point])[point][-1]
    spec = SteeringSpec([Write(point, there - here, op="add", scale=scale, positions=[-1])])
    logits = Address("logits")
    plain = sync.capture(ids, [logits])[logits][-1]
    steered = sync.capture(ids, [logits], steering_spec=spec)[logits][-1]
    print(
        f"\n5. steering: add {scale:g} x (resid_post.{layer} of {contrast!r} - resid_post.{layer} of the prompt), "
        "at the prompt's last token\n"
    )
    target = sync.capture(other, [logits])[logits][-1]
    rows = [
        ["prompt", top_next(sync, plain, 5)],
        ["steered prompt", top_next(sync, steered, 5)],
        ["contrast prompt", top_next(sync, target, 5)],
    ]
    print(table(["", "next token (top 5)"], rows))
    if max_tokens > 0:
        text_plain = "".join(step.text for step in sync.stream(ids, max_tokens=max_tokens))
        text_steered = "".join(step.text for step in sync.stream(ids, max_tokens=max_tokens, steering_spec=spec))
        print(f"\n   plain:   {text_plain!r}\n   steered: {text_steered!r}")


@dataclass
class DemoSae:
    """The SAE the demo attached: its source, attached name, the SAE and its named features."""

    source: str
    name: str
    sae: Sae
    names: dict[int, str]


def attach_demo_sae(sync: SyncModel, source: str, sae: Sae) -> DemoSae | str:
    """Attach ``sae`` before the first request (as ``vllm-static`` needs); the reason it was
    not attached (another model's width, a backend without SAEs) otherwise."""
    attach = getattr(sync.model, "attach_sae", None)
    if attach is None:
        return f"the {sync.model.backend} backend's models take no SAEs (no attach_sae)"
    name = attach_name(source)
    try:
        attach(name, sae)
    except (InterpError, ValueError, KeyError) as exc:
        return " ".join(str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).split())
    names = {i: n for i, n in feature_names(source).items() if 0 <= i < sae.d_sae}
    return DemoSae(source, name, sae, names)


def next_token(sync: SyncModel, ids: list[int], spec: SteeringSpec | None = None) -> torch.Tensor:
    """The next-token probabilities after ``ids`` (under ``spec``)."""
    logits = Address("logits")
    probs: torch.Tensor = sync.capture(ids, [logits], steering_spec=spec)[logits][-1].float().softmax(-1)
    return probs


def active(readout: FeatureReadout, position: int) -> dict[int, float]:
    """Every feature that fires at ``position`` of a dense readout, and its value."""
    row = readout.values[position]
    return {int(i): float(row[i]) for i in torch.nonzero(row > 0).flatten()}


def transplant(name: str, here: Mapping[int, float], there: Mapping[int, float], position: int) -> list[FeatureWrite]:
    """Writes that give ``position`` the features ``there`` in place of ``here``: ablate what fires
    only here, clamp everything that fires there to its value there (the error term is kept)."""
    writes = [FeatureWrite(name, i, "ablate", positions=[position]) for i in here if i not in there]
    return writes + [FeatureWrite(name, i, "clamp", v, positions=[position]) for i, v in there.items()]


@dataclass
class NamedHit:
    """A named feature of the SAE that fires on the prompt: where it fires, and where most."""

    feature: int
    name: str
    positions: list[int]
    strongest: int
    value: float


def named_hits(sync: SyncModel, demo: DemoSae, ids: list[int]) -> list[NamedHit]:
    """The named features that fire on ``ids``, strongest first (values read with ``ids=``, so
    they count outside a token's top k too)."""
    if not demo.names:
        return []
    spec = Features(demo.name, ids=sorted(demo.names))
    values = sync.capture(ids, [spec])[spec].values  # [n, named]
    hits = []
    for col, feature in enumerate(sorted(demo.names)):
        where = [int(p) for p in torch.nonzero(values[:, col] > 0).flatten()]
        if where:
            best = max(where, key=lambda p: float(values[p, col]))
            hits.append(NamedHit(feature, demo.names[feature], where, best, float(values[best, col])))
    return sorted(hits, key=lambda h: -h.value)


def section_features(sync: SyncModel, demo: DemoSae, ids: list[int]) -> list[NamedHit]:
    spec = Features(demo.name, top_k=SAE_TOP_K)
    readout = sync.capture(ids, [spec])[spec]
    tokens = sync.to_str_tokens(ids)
    print(f"\n6. features: {describe_sae(demo.source, demo.sae)}, the top {SAE_TOP_K} at each token\n")
    rows = []
    for position, token in enumerate(tokens):
        error = "-" if readout.error_norm is None else f"{float(readout.error_norm[position]):.2f}"
        rows.append([position, show_token(token), error, feature_cells(fired(readout, position), demo.names)])
    print(table(["pos", "token", "error", "top features (id:value; error: |x - reconstruct(x)|)"], rows))
    hits = named_hits(sync, demo, ids)
    if not demo.names:
        print(f"\n   (no features.json beside {demo.source} names its features)")
    elif not hits:
        print(f"\n   none of the {len(demo.names)} features its features.json names fires on the prompt")
    for hit in hits:
        where = f"on {show_token(tokens[hit.strongest])} ({hit.value:.2f})"
        if len(hit.positions) > 1:
            where = f"on {len(hit.positions)} tokens, most {where}"
        others = len(tokens) - len(hit.positions)
        rest = f"and on none of the other {others} tokens" if others else "(every token)"
        print(f"\n   the {hit.name!r} feature ({hit.feature}) fires {where} {rest}")
    return hits


def _top(sync: SyncModel, probs: torch.Tensor, k: int = 3) -> str:
    top = probs.topk(k)
    return ", ".join(
        f"{show_token(sync.to_str_tokens([int(i)])[0])} {float(p):.2f}"
        for p, i in zip(top.values, top.indices, strict=True)
    )


def section_feature_steering(
    sync: SyncModel, demo: DemoSae, ids: list[int], contrast: str, hits: Sequence[NamedHit]
) -> None:
    """Feature writes that try to change the answer: ablate the strongest named feature where it
    fires, ablate (one at a time) each feature of the last token and keep the one the answer
    needs most, and give the prompt the contrast prompt's features. What each does is measured."""
    tokens = sync.to_str_tokens(ids)
    last = len(ids) - 1
    plain = next_token(sync, ids)
    answer = int(plain.argmax())
    shown = show_token(sync.to_str_tokens([answer])[0])
    print(
        f"\n7. steering by feature: writes through {demo.source} at {demo.sae.address} (ablate = clamp to 0; "
        f"a clamp keeps the SAE's error term), and what they do to the next token\n"
    )
    rows: list[list[object]] = [["none", _top(sync, plain), f"{float(plain[answer]):.2f}"]]
    findings: list[str] = []

    def tried(what: str, writes: list[FeatureWrite]) -> torch.Tensor:
        probs = next_token(sync, ids, SteeringSpec(writes))
        rows.append([what, _top(sync, probs), f"{float(probs[answer]):.2f}"])
        return probs

    def outcome(probs: torch.Tensor) -> str:
        now = int(probs.argmax())
        moved = f"P({shown}) {float(plain[answer]):.3f} -> {float(probs[answer]):.3f}"
        if now == answer:
            return f"the answer stays {shown} ({moved})"
        return f"the answer becomes {show_token(sync.to_str_tokens([now])[0])} ({float(probs[now]):.2f}; {moved})"

    if hits:
        hit = hits[0]
        where = " and ".join(show_token(tokens[p]) for p in hit.positions)
        probs = tried(
            f"ablate {label(hit.feature, demo.names)} at {where}",
            [FeatureWrite(demo.name, hit.feature, "ablate", positions=hit.positions)],
        )
        findings.append(f"ablating the {hit.name!r} feature where it fires: {outcome(probs)}")

    dense = Features(demo.name, dense=True)
    mine = sync.capture(ids, [dense])[dense]
    at_last = active(mine, last)
    candidates = sorted(at_last, key=lambda i: -at_last[i])[:MAX_TRIALS]
    if candidates:
        trials = {
            i: next_token(sync, ids, SteeringSpec([FeatureWrite(demo.name, i, "ablate", positions=[last])]))
            for i in candidates
        }
        needed = min(trials, key=lambda i: float(trials[i][answer]))
        rows.append(
            [
                f"ablate {label(needed, demo.names)} at {show_token(tokens[last])}",
                _top(sync, trials[needed]),
                f"{float(trials[needed][answer]):.2f}",
            ]
        )
        tried_all = "" if len(candidates) == len(at_last) else f" strongest of the {len(at_last)}"
        findings.append(
            f"each of the {len(candidates)}{tried_all} features at the last token ablated in turn: "
            f"ablating {needed} lowers P({shown}) most; {outcome(trials[needed])}"
        )

    other = prompt_ids(sync, contrast)
    theirs = sync.capture(other, [dense])[dense]
    pairs = [(last, len(other) - 1)]  # the last tokens, and the named feature's strongest tokens
    if hits:
        there = [p for p in range(len(other)) if float(theirs.values[p, hits[0].feature]) > 0]
        if there and hits[0].strongest != last:
            best = max(there, key=lambda p: float(theirs.values[p, hits[0].feature]))
            pairs.insert(0, (hits[0].strongest, best))
    writes = [w for p, q in pairs for w in transplant(demo.name, active(mine, p), active(theirs, q), p)]
    where = ", ".join(show_token(tokens[p]) for p, _ in pairs)
    other_tokens = sync.to_str_tokens(other)
    source = ", ".join(show_token(other_tokens[q]) for _, q in pairs)
    probs = tried(f"features of {source} at {where}", writes)
    ablated = sum(w.op == "ablate" for w in writes)
    findings.append(
        f"{where} given the features of {source} in {contrast!r} ({ablated} ablations, "
        f"{len(writes) - ablated} clamps): {outcome(probs)}"
    )
    contrast_probs = next_token(sync, other)
    rows.append(["(the contrast prompt itself)", _top(sync, contrast_probs), f"{float(contrast_probs[answer]):.2f}"])

    print(table(["feature writes", "next token (top 3)", f"P({shown})"], rows))
    for line in findings:
        print(f"\n   {line}")


def check_options(args: argparse.Namespace) -> None:
    """The options that need no model, checked before it loads."""
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be 0 (no generation) or more, got {args.max_tokens}")
    if args.induction_length < 2:
        raise UserError(f"--induction-length must be at least 2 tokens, got {args.induction_length}")
    if args.ablate_heads < 0:
        raise UserError(f"--ablate-heads must be 0 or more, got {args.ablate_heads}")
    if not math.isfinite(args.scale):
        raise UserError(f"--scale must be a finite number, got {args.scale}")
    if args.seed < 0:
        raise UserError(f"--seed must be 0 or more, got {args.seed}")
    if not args.prompt or not args.contrast:
        raise UserError("--prompt and --contrast must not be empty")


def check_against_model(sync: SyncModel, args: argparse.Namespace, ids: list[int]) -> int:
    """The options that need the model (the steering layer, what fits its context), checked
    before anything is printed; returns the steering layer."""
    info = sync.model.info
    layer: int = info.n_layers // 2 if args.layer is None else args.layer
    if not -info.n_layers <= layer < info.n_layers:
        raise UserError(
            f"--layer {layer} is out of range for a model with {info.n_layers} layers "
            f"(valid: {-info.n_layers}..{info.n_layers - 1})"
        )
    if args.max_tokens > 0:
        try:
            if isinstance(sync.model, ModelBase):  # the checks the generation itself runs, without compute
                sync.model._check_generation(ids, [], max_tokens=args.max_tokens, steering_spec=None, sampling={})
            elif len(ids) + args.max_tokens > info.n_ctx:
                raise UserError(f"{len(ids)} + {args.max_tokens} tokens exceed the context of {info.n_ctx}")
        except (InterpError, UserError) as exc:
            raise UserError(f"--max-tokens {args.max_tokens} with the {len(ids)}-token prompt: {exc}") from None
    other = prompt_ids(sync, args.contrast)
    if len(other) > info.n_ctx:
        raise UserError(f"--contrast is {len(other)} tokens, longer than the model's context of {info.n_ctx}")
    prefix = len(sync.to_tokens("")[0])  # the tokenizer's BOS, if it adds one
    if prefix + 2 * args.induction_length > info.n_ctx:
        raise UserError(
            f"--induction-length {args.induction_length}: the repeated sequence ({prefix + 2 * args.induction_length} "
            f"tokens) exceeds the model's context of {info.n_ctx}; the most is {(info.n_ctx - prefix) // 2}"
        )
    return layer % info.n_layers


def run_circuits(sync: SyncModel, args: argparse.Namespace, circuits: DemoTranscoders | str, ids: list[int]) -> None:
    """Section 8 on the demo's model, the graph computed on it (eager) or on the same checkpoint
    loaded on the eager backend (the graph needs gradients)."""
    if isinstance(circuits, str):
        print(f"\n8. circuits: skipped ({args.transcoders} cannot replace this model's MLPs): {circuits}")
        return
    if sync.model.backend == "eager":
        section_circuits(sync, circuits, ids, sync.model)
        return
    try:
        # the same checkpoint and dtype; the other load options are the demo's backend's
        twin = open_model(argparse.Namespace(**{**vars(args), "backend": "eager", "device": None, "option": []}))
    except InterpError as exc:
        print(
            f"\n8. circuits: skipped (the graph is computed on the eager backend, which cannot load "
            f"{args.model}): {exc}"
        )
        return
    try:
        section_circuits(sync, circuits, ids, twin.model)
    finally:
        twin.shutdown()


def cmd_demo(args: argparse.Namespace) -> int:
    check_options(args)
    sae = load_sae(args.sae) if args.sae else None  # a bad --sae is one line, before the model loads
    replacement = load_transcoders(args.transcoders) if args.transcoders else None  # likewise
    with opened(args) as sync:
        demo = attach_demo_sae(sync, args.sae, sae) if sae is not None else None  # before any request
        circuits = None if replacement is None else attach_demo_transcoders(sync, args.transcoders, replacement)
        info = sync.model.info
        ids = prompt_ids(sync, args.prompt)
        layer = check_against_model(sync, args, ids)
        plots = plots_wanted(args)
        print(
            f"model {args.model} on {sync.model.backend}: {info.architecture}, {info.n_layers} layers, "
            f"d_model {info.d_model}, {info.n_heads} heads, vocab {info.vocab_size}"
        )
        print(f"prompt {args.prompt!r}: {len(ids)} tokens\n")

        section_capture(sync, ids)

        lens = logit_lens(sync, ids)
        print("\n2. logit lens: the next token decoded from each layer's residual stream (last token)\n")
        print(lens_top_k(sync, lens, len(ids) - 1, 3))

        induction = section_attention(sync, args.induction_length, args.seed)
        if induction is not None:
            section_heads(sync, *induction, args.ablate_heads)

        section_steering(sync, ids, args.contrast, layer, args.scale, args.max_tokens)

        if isinstance(demo, DemoSae):
            hits = section_features(sync, demo, ids)
            if demo.sae.has_decoder and not demo.sae.is_transcoder:
                section_feature_steering(sync, demo, ids, args.contrast, hits)
            else:
                kind = "a transcoder" if demo.sae.is_transcoder else "a probe"
                print(f"\n7. steering by feature: skipped: {args.sae} is {kind}; the clamps here need an SAE")
        elif demo is not None:
            print(f"\n6. features: skipped ({args.sae} cannot be attached here): {demo}")

        if circuits is not None:
            run_circuits(sync, args, circuits, ids)

        if plots:
            print()
            plot_lens(sync, lens, list(range(len(ids))), args.out, "lens.png")
            if induction is not None:
                rand_ids, start, (layer_, head), score = induction
                pattern = sync.capture_attention(rand_ids, [layer_])[Address("attn_pattern", layer_)]
                title = (
                    f"layer {layer_} on {args.induction_length} random tokens shown twice "
                    f"(strongest: head {head}, induction {score:.2f})"
                )
                fig = plot.induction(
                    pattern, repeat_start=start + args.induction_length, length=args.induction_length, title=title
                )
                save_figure(fig, args.out, "induction.png")
            if isinstance(demo, DemoSae):
                spec = Features(demo.name, top_k=SAE_TOP_K)
                readout = sync.capture(ids, [spec])[spec]
                title = f"{demo.source}: top {SAE_TOP_K} features per token of {args.prompt!r}"
                fig = plot.features(readout, tokens=sync.to_str_tokens(ids), names=demo.names, title=title)
                save_figure(fig, args.out, "features.png")
    return 0


def add_demo(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="a tour: capture, logit lens, attention, steering, SAE features and a circuit, as tables and PNGs",
        description="A tour of one model: the residual stream's norm through the layers, the logit "
        "lens at the prompt's last token, each head's induction score on repeated random tokens, "
        "what zero-ablating the earlier previous-token heads leaves of the strongest one, "
        "steering with the difference of two prompts' residuals, an SAE's top features at the "
        "prompt's tokens, feature writes (ablations, clamps) that move the answer, and the prompt's "
        "attribution graph through transcoders: the features that carry the subject token to the "
        "answer, and what ablating them does. Writes lens.png, induction.png and features.png to --out.",
        epilog="example: interp demo --out demo-plots   (or: interp demo path/to/model --prompt '...')",
    )
    parser.add_argument(
        "model", metavar="MODEL", nargs="?", default=DEFAULT_MODEL, help=f"the model (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--prompt", default=PROMPT, help=f"the prompt (default: {PROMPT!r})")
    parser.add_argument(
        "--contrast", default=CONTRAST, help=f"the prompt whose residual the steering moves toward ({CONTRAST!r})"
    )
    parser.add_argument("--layer", type=int, help="the steering layer (default: the middle one)")
    parser.add_argument("--scale", type=float, default=1.0, help="the steering vector's scale (1.0)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated with and without steering (8)")
    parser.add_argument(
        "--induction-length", type=int, default=16, help="random tokens repeated for the induction test"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")
    parser.add_argument(
        "--ablate-heads", type=int, default=3, help="earlier heads ablated one at a time against the induction head (3)"
    )
    parser.add_argument(
        "--sae",
        default=SAE,
        metavar="NAME_OR_PATH",
        help=f"the SAE of the features sections: a folder in SAELens's format or a shipped name ({SAE}); '' skips them",
    )
    parser.add_argument(
        "--transcoders",
        default=TRANSCODERS,
        metavar="NAME_OR_PATH",
        help="the transcoders of the circuits section: a folder load_transcoders reads (circuit-tracer's or "
        f"SAELens's layouts) or a shipped name ({TRANSCODERS}); '' skips it",
    )
    add_plot_options(parser, "interp-demo")
    add_model_options(parser)
    parser.set_defaults(func=cmd_demo)
