"""Overhead of capturing residual-stream activations: interp-engine vs TransformerLens vs nnsight.

Run ``python bench/eager_overhead.py [--quick] [--device cuda] [--narrow]``.

Model and data
    A GPT-2-small-shaped ``GPT2LMHeadModel`` (12 layers, d_model 768, 12 heads, n_positions 1024,
    vocab 50257) with random fp32 weights (seed 0), saved once with ``save_pretrained`` (plus a
    small byte-level tokenizer, trained locally, so that the directory loads offline) under
    ``.cache/bench-gpt2``.  The input is one batch of 8 x 128 random token ids (``--batch``,
    ``--seq``).

The overhead-bound regime (``--narrow``)
    On a GPU, or any device where a GPT-2-small forward takes a few milliseconds, what a tool
    does per call in Python -- checking the request, planning and installing its hooks, handing
    the work between threads, building its result -- costs as much as whole layers, while on a
    small CPU, where the forward takes about a second, it vanishes.  ``--narrow`` measures that
    regime on a CPU: the same 12 layers at d_model 64 (4 heads, GPT-2's 1024 positions) with a
    1000-token vocabulary (so the logits do not dominate), saved under ``.cache/bench-gpt2-narrow``,
    and one prompt of 16 tokens unless ``--batch``/``--seq`` say otherwise; a forward then costs a
    few milliseconds, most of it the per-op work of HF's own Python.  What a request costs per
    token (its ids checked, converted and padded: about a millisecond for 8 x 128 ids on a slow
    CPU) is left out at 16 tokens, and a narrow forward over 8 x 128 tokens is compute-bound on a
    CPU again.  A call being short, 100 rounds are timed by default, on one torch thread (ops this
    small gain nothing from more, and a shared machine's other work then disturbs them less).
    RESULT names are the same; compare figures only between runs of the same shape.

Variants (all under ``torch.inference_mode()`` in one process)
    ``plain``    ``hf_model(input_ids)``: the HF forward, logits computed, as a user would.
    ``body``     (opt-in, ``--variants``) ``hf_model.transformer(input_ids, use_cache=False)``:
                 the 12 blocks and ``ln_f`` without the unembedding, a floor for a tool that
                 captures every layer and stops before the logits.
    ``ie_2pts``  ``interp_engine.run_with_cache(model, tokens, ["resid_post.5", "resid_post.10"])``.
    ``ie_all``   the same with ``resid_post.0`` .. ``resid_post.11``.
    ``tl_2pts``  TransformerLens ``TransformerBridge.run_with_cache(tokens, names_filter=...)`` on
                 ``blocks.{5,10}.hook_resid_post`` (the bridge's alias of ``blocks.N.hook_out``).
    ``tl_all``   the same for all 12 blocks.
    ``nn_2pts``  nnsight ``NNsight(hf_model)``: a trace on the tokens saving
                 ``transformer.h[i].output`` for layers 5 and 10.
    ``nn_all``   the same for all 12 layers.

Which HF model object each variant runs
    Every tool runs the same weights, but not the same ``nn.Module`` object: TransformerLens 4.x
    ``boot_transformers(path, hf_model=m)`` replaces ``m``'s blocks *in place* with its bridge
    components (and switches ``m`` to eager attention), and ``NNsight(m)`` replaces the
    ``forward`` of ``m``'s modules with its interceptors.  Had all variants shared one object,
    ``plain`` (and the others) would have measured those wrappers too.  So ``plain`` runs a
    pristine ``from_pretrained`` copy, TL and nnsight each wrap a ``copy.deepcopy`` of it, and
    interp-engine runs the model that its own ``load_model`` loaded from the same directory (its
    weights are checked equal to the pristine copy's).  Before timing, every tool's capture of
    ``resid_post.5`` and ``resid_post.10`` (and, for the ``all`` variants, of every layer) is
    compared with HF's ``output_hidden_states``; a relative error (max abs diff / max abs value)
    above 1e-4 aborts the run.  ``resid_post.11`` is compared after ``ln_f``, because HF's last
    hidden state is taken after the final norm.

Attention implementation
    TransformerLens forces eager attention on the model it wraps (it needs the probabilities for
    its attention hooks); that is part of what using it costs, so TL runs eager.  ``plain`` and
    nnsight run ``--attn`` (default: whatever interp-engine's backend loaded by default, or
    ``sdpa``, HF's default, without it), so that ``ie_*_vs_plain`` compares like with like;
    interp-engine is loaded with ``attn_implementation=--attn`` when it is given.  The
    implementations used are printed.  ``--attn eager`` runs all four eager (apples to apples with
    TL); the default shows what each tool costs as shipped.

Timing
    After ``--warmup`` calls of each variant, ``--reps`` rounds run every variant once, in an order
    rotated by one each round (interleaved round robin, so slow drift of a shared machine hits all
    variants alike).  Each call is timed with ``time.perf_counter`` (after
    ``torch.cuda.synchronize`` on CUDA); the median of each variant is reported, with its ratio to
    ``plain``'s median.

Memory
    ``held``: the bytes of the tensors a variant hands back (plain: the logits; TL: logits and its
    cache; ie and nnsight: the captures), counting shared storage once.
    ``peak``: the most memory that one call needed above what was in use before it.
    On CUDA this is ``torch.cuda.max_memory_allocated()`` during one call (after
    ``reset_peak_memory_stats``) minus ``memory_allocated()`` before it, measured in this process.
    On CPU, torch has no allocator statistics, so each variant runs in a fresh subprocess that
    builds only that variant, calls it once to warm up, resets the kernel's peak-RSS mark (write
    ``5`` to ``/proc/self/clear_refs``), calls it once more and reports ``VmHWM`` minus the
    ``VmRSS`` before that call.  The subprocess runs with ``MALLOC_MMAP_THRESHOLD_=65536``, which
    turns off glibc's adaptive threshold so every large tensor is ``mmap``ed and returned to the
    kernel when freed; otherwise memory freed by the warm-up call would be reused from the heap and
    hide the second call's peak.  RSS counts whole pages and anything else the process touches, so
    treat differences below a few MB as noise.  Without ``/proc/self/clear_refs`` the subprocess
    falls back to ``ru_maxrss`` over a single cold call (flagged ``cold`` in the table).

Output
    A table, then one line per figure: ``RESULT <name> <ratio> (target <t>)``; ``n/a`` where a
    tool is unavailable (interp-engine not importable).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _results import Results  # bench/, the script's own directory
from torch import nn

# Everything is local: never let a loader reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / ".cache" / "bench-gpt2"

N_LAYERS = 12
N_POSITIONS = 1024
BATCH = 8
SEQ = 128
SEED = 0
TWO_LAYERS = (5, 10)
ALL_LAYERS = tuple(range(N_LAYERS))
REL_TOL = 1e-4

# the code whose speed the figures measure
MEASURES = ("packages/interp-eager/src/interp_eager", "packages/interp-core/src/interp_engine")

VARIANTS = ("plain", "ie_2pts", "ie_all", "tl_2pts", "tl_all", "nn_2pts", "nn_all")
EXTRA_VARIANTS = ("body",)  # opt-in (``--variants``): a reference, not a tool

# (name, numerator, denominator, target): ratios of median times.
RESULTS: tuple[tuple[str, str, str, float | None], ...] = (
    ("ie_2pts_vs_plain", "ie_2pts", "plain", 0.80),
    ("ie_all_vs_plain", "ie_all", "plain", 0.95),
    ("ie_2pts_vs_tl", "ie_2pts", "tl_2pts", 1.00),
    ("ie_all_vs_tl", "ie_all", "tl_all", 1.00),
    ("ie_2pts_vs_nnsight", "ie_2pts", "nn_2pts", 1.00),
    ("ie_all_vs_nnsight", "ie_all", "nn_all", 1.00),
    ("tl_2pts_vs_plain", "tl_2pts", "plain", None),
    ("tl_all_vs_plain", "tl_all", "plain", None),
    ("nnsight_2pts_vs_plain", "nn_2pts", "plain", None),
    ("nnsight_all_vs_plain", "nn_all", "plain", None),
    # Only with ``--variants ...,body``: the capture cost over the bare transformer stack.
    ("ie_2pts_vs_body", "ie_2pts", "body", None),
    ("ie_all_vs_body", "ie_all", "body", None),
)

Call = Callable[[], Any]


@dataclass(frozen=True)
class Shape:
    """The benchmark model's width, heads and vocabulary (12 layers, 1024 positions each time)."""

    d_model: int
    n_heads: int
    vocab: int
    default_dir: Path


GPT2_SMALL = Shape(768, 12, 50257, DEFAULT_MODEL_DIR)
NARROW = Shape(64, 4, 1000, REPO / ".cache" / "bench-gpt2-narrow")
"""``--narrow``: the overhead-bound regime (module docstring)."""
NARROW_SEQ = 16


def layers_of(variant: str) -> tuple[int, ...]:
    return TWO_LAYERS if variant.endswith("_2pts") else ALL_LAYERS


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The model directory
# --------------------------------------------------------------------------------------------


def _stamp(shape: Shape) -> dict[str, Any]:
    import transformers

    return {
        "format": 1,
        "n_layer": N_LAYERS,
        "n_embd": shape.d_model,
        "n_head": shape.n_heads,
        "n_positions": N_POSITIONS,
        "vocab_size": shape.vocab,
        "seed": SEED,
        "transformers": transformers.__version__,
    }


def _tokenizer() -> Any:
    """A small byte-level BPE tokenizer (the benchmark feeds token ids; loaders want one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=N_POSITIONS,
    )


def ensure_model_dir(out: Path, shape: Shape = GPT2_SMALL) -> Path:
    """Write the random GPT-2-shaped model + tokenizer to ``out`` unless already there."""
    from transformers import GPT2Config, GPT2LMHeadModel

    stamp = _stamp(shape)
    stamp_file = out / "bench_stamp.json"
    try:
        if json.loads(stamp_file.read_text()) == stamp and (out / "config.json").is_file():
            return out
    except (OSError, ValueError):
        pass
    log(f"writing a random GPT-2-shaped model to {out} ...")
    config = GPT2Config(
        n_layer=N_LAYERS,
        n_embd=shape.d_model,
        n_head=shape.n_heads,
        n_positions=N_POSITIONS,
        vocab_size=shape.vocab,
    )
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]
    out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    stamp_file.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return out


# --------------------------------------------------------------------------------------------
# The tools
# --------------------------------------------------------------------------------------------


def _resolve_attn(requested: str | None, ie_attn: str | None) -> str:
    return requested or ie_attn or "sdpa"


@dataclass
class Setup:
    """Everything the variants need; tools that are not needed (or not importable) stay None."""

    device: torch.device
    tokens: torch.Tensor
    reference: Any  # the pristine HF ``GPT2LMHeadModel``: ``plain`` runs it
    attn: str
    ie_model: Any = None
    ie_hf: nn.Module | None = None
    ie_error: str | None = None
    tl_bridge: Any = None
    nn_model: Any = None
    attn_used: dict[str, str] = field(default_factory=dict)


def _attn_of(model: nn.Module) -> str:
    return str(getattr(model.config, "_attn_implementation", "?"))


def _load_ie(path: Path, device: torch.device, attn: str | None) -> tuple[Any, nn.Module]:
    from interp_engine import load_model

    options: dict[str, Any] = {"device": str(device)}
    if attn:
        options["attn_implementation"] = attn
    model = load_model(path, backend="eager", **options)
    hf = getattr(model, "hf_model", None)
    if not isinstance(hf, nn.Module):
        raise SystemExit("FAIL: the interp-engine model has no .hf_model module")
    param = next(hf.parameters())
    if param.device.type != device.type or param.dtype != torch.float32:
        raise SystemExit(f"FAIL: interp-engine loaded {param.dtype} on {param.device}, want fp32 on {device}")
    return model, hf


def build(
    path: Path,
    device: torch.device,
    variants: Sequence[str],
    attn: str | None,
    batch: int = BATCH,
    seq: int = SEQ,
) -> Setup:
    from transformers import GPT2Config, GPT2LMHeadModel

    tools = {v.split("_")[0] for v in variants}
    gen = torch.Generator().manual_seed(SEED + 1)
    vocab = int(GPT2Config.from_pretrained(path).vocab_size)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

    ie_model: Any = None
    ie_hf: nn.Module | None = None
    ie_error: str | None = None
    if "ie" in tools:
        try:
            import interp_eager  # noqa: F401  (the eager backend must be installed too)
            import interp_engine  # noqa: F401
        except ImportError as exc:
            ie_error = f"not importable: {exc}"
            log(f"interp-engine {ie_error}; its variants are skipped")
        else:
            ie_model, ie_hf = _load_ie(path, device, attn)
    chosen = _resolve_attn(attn, _attn_of(ie_hf) if ie_hf is not None else None)
    reference: Any = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32, attn_implementation=chosen)
    reference = reference.to(device).eval()
    setup = Setup(device, tokens, reference, chosen, ie_model, ie_hf, ie_error)
    setup.attn_used["plain"] = _attn_of(reference)
    if ie_hf is not None:
        _check_same_weights(reference, ie_hf)
        setup.attn_used["ie"] = _attn_of(ie_hf)
    if "tl" in tools:
        from transformer_lens.model_bridge import TransformerBridge

        tl_hf = copy.deepcopy(reference)
        setup.tl_bridge = TransformerBridge.boot_transformers(
            str(path), hf_model=tl_hf, device=str(device), dtype=torch.float32
        )
        setup.attn_used["tl"] = _attn_of(tl_hf)
    if "nn" in tools:
        from nnsight import NNsight

        nn_hf = copy.deepcopy(reference)
        setup.nn_model = NNsight(nn_hf)
        setup.attn_used["nn"] = _attn_of(nn_hf)
    _check_untouched(reference)
    return setup


def _check_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for name, value in sa.items():
        other = sb.get(name)
        if other is None or not torch.equal(value, other.to(value.device)):
            raise SystemExit(f"FAIL: interp-engine's model differs from the reference at {name}")


def _check_untouched(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
            raise SystemExit(f"FAIL: the reference model was modified by a tool at {name!r}")


def _tl_names(layers: Sequence[int]) -> list[str]:
    return [f"blocks.{i}.hook_resid_post" for i in layers]


def make_calls(setup: Setup) -> dict[str, Call]:
    """The variants that can run, each a zero-argument call returning what a user would hold."""
    tokens = setup.tokens
    calls: dict[str, Call] = {}

    def plain() -> Any:
        return setup.reference(tokens).logits

    calls["plain"] = plain

    def body() -> Any:
        return setup.reference.transformer(tokens, use_cache=False).last_hidden_state

    calls["body"] = body

    if setup.ie_model is not None:
        from interp_engine import run_with_cache

        ie_model = setup.ie_model

        def ie_call(points: list[str]) -> Call:
            return lambda: run_with_cache(ie_model, tokens, points)

        calls["ie_2pts"] = ie_call([f"resid_post.{i}" for i in TWO_LAYERS])
        calls["ie_all"] = ie_call([f"resid_post.{i}" for i in ALL_LAYERS])

    if setup.tl_bridge is not None:
        bridge = setup.tl_bridge

        def tl_call(names: list[str]) -> Call:
            return lambda: bridge.run_with_cache(tokens, names_filter=names)

        calls["tl_2pts"] = tl_call(_tl_names(TWO_LAYERS))
        calls["tl_all"] = tl_call(_tl_names(ALL_LAYERS))

    if setup.nn_model is not None:
        nn_model = setup.nn_model

        def nn_call(layers: tuple[int, ...]) -> Call:
            def run() -> list[Any]:
                # Append to a list made outside the trace: nnsight runs the body out of line
                # and does not write names first bound inside it back to a function's locals.
                saved: list[Any] = []
                with nn_model.trace(tokens):
                    for i in layers:
                        saved.append(nn_model.transformer.h[i].output.save())
                return saved

            return run

        calls["nn_2pts"] = nn_call(TWO_LAYERS)
        calls["nn_all"] = nn_call(ALL_LAYERS)
    return calls


def captures(variant: str, result: Any) -> dict[int, torch.Tensor]:
    """``{layer: resid_post tensor}`` out of what ``variant`` returned."""
    layers = layers_of(variant)
    if variant.startswith("ie_"):
        return {i: result[f"resid_post.{i}"] for i in layers}
    if variant.startswith("tl_"):
        _, cache = result
        return {i: cache[f"blocks.{i}.hook_resid_post"] for i in layers}
    if variant.startswith("nn_"):
        out: dict[int, torch.Tensor] = {}
        for i, value in zip(layers, result, strict=True):
            value = getattr(value, "value", value)
            out[i] = value[0] if isinstance(value, tuple) else value
        return out
    raise ValueError(variant)


# --------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------


def _hidden_states(setup: Setup, attn: str) -> list[torch.Tensor]:
    model = setup.reference
    before = _attn_of(model)
    model.set_attn_implementation(attn)
    try:
        with torch.inference_mode():
            out = model(setup.tokens, output_hidden_states=True)
    finally:
        model.set_attn_implementation(before)
    return [h.float() for h in out.hidden_states]


def check(setup: Setup, calls: dict[str, Call]) -> None:
    references: dict[str, list[torch.Tensor]] = {}
    ln_f = setup.reference.transformer.ln_f
    for variant, call in calls.items():
        if variant in ("plain", "body"):
            continue
        attn = setup.attn_used[variant.split("_")[0]]
        if attn not in references:
            references[attn] = _hidden_states(setup, attn)
        hidden = references[attn]
        with torch.inference_mode():
            got = captures(variant, call())
            worst = 0.0
            for layer, value in got.items():
                want = hidden[layer + 1]
                if layer == N_LAYERS - 1:
                    value = ln_f(value)
                value = value.float()
                if value.shape != want.shape:
                    raise SystemExit(
                        f"FAIL: {variant} resid_post.{layer} has shape {tuple(value.shape)}, HF {tuple(want.shape)}"
                    )
                err = float((value - want).abs().max() / want.abs().max())
                worst = max(worst, err)
                if err > REL_TOL:
                    raise SystemExit(
                        f"FAIL: {variant} resid_post.{layer} disagrees with HF "
                        f"output_hidden_states (attn={attn}): rel err {err:.2e} > {REL_TOL:.0e}"
                    )
        print(f"check {variant:8s} ok: layers {list(got)} rel err <= {worst:.1e} (attn={attn})")


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all(calls: dict[str, Call], device: torch.device, warmup: int, reps: int) -> dict[str, list[float]]:
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                calls[name]()
        _sync(device)
        for r in range(reps):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                gc.collect()
                _sync(device)
                start = time.perf_counter()
                result = calls[name]()
                _sync(device)
                times[name].append(time.perf_counter() - start)
                del result
            log(f"round {r + 1}/{reps}: " + " ".join(f"{n}={times[n][-1]:.3f}s" for n in names))
    return times


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def held_bytes(result: Any) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        obj = getattr(obj, "value", obj)  # nnsight saved proxies, if any
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)
        elif hasattr(obj, "values") and callable(obj.values):  # Cache / ActivationCache
            for v in obj.values():
                visit(v)

    visit(result)
    return total


def _proc_kib(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE)
    if found is None:
        raise OSError(f"no {field_name} in /proc/self/status")
    return int(found.group(1))


def cuda_peak(call: Call, device: torch.device) -> tuple[int, int]:
    with torch.inference_mode():
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        held = held_bytes(result)
    return peak, held


def mem_child(args: argparse.Namespace) -> None:
    """Subprocess: build one variant, warm it up, report one call's peak RSS increase."""
    variant = args.mem_child
    device = torch.device(args.device)
    setup = build(Path(args.model_dir), device, [variant], args.attn, args.batch, args.seq)
    calls = make_calls(setup)
    if variant not in calls:
        print(json.dumps({"variant": variant, "error": setup.ie_error or "unavailable"}))
        return
    call = calls[variant]
    with torch.inference_mode():
        try:
            call()  # warm-up
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")
            base = _proc_kib("VmRSS")
            result = call()
            peak = _proc_kib("VmHWM") - base
            method = "hwm"
        except OSError:
            import resource

            gc.collect()
            base = _proc_kib("VmRSS")
            result = call()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
            method = "cold"
        held = held_bytes(result)
    print(json.dumps({"variant": variant, "peak": peak * 1024, "held": held, "method": method}))


def cpu_peaks(args: argparse.Namespace, variants: Sequence[str]) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out: dict[str, dict[str, Any]] = {}
    for variant in variants:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--mem-child",
            variant,
            "--model-dir",
            str(args.model_dir),
            "--device",
            args.device,
            "--threads",
            str(torch.get_num_threads()),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ]
        if args.attn:
            cmd += ["--attn", args.attn]
        log(f"memory: {variant} in a subprocess ...")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            log(proc.stderr[-2000:])
            out[variant] = {"error": f"subprocess exited {proc.returncode}"}
        else:
            out[variant] = json.loads(lines[-1])
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.1f}"


def report(
    setup: Setup,
    times: dict[str, list[float]],
    memory: dict[str, dict[str, Any]],
    versions: dict[str, str],
    results: Results,
) -> None:
    medians = {n: statistics.median(t) for n, t in times.items()}
    base = medians.get("plain")
    print()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"device {setup.device}, torch threads {torch.get_num_threads()}, "
        f"batch {setup.tokens.shape[0]}x{setup.tokens.shape[1]}, d_model {setup.reference.config.n_embd}, "
        f"attention: " + ", ".join(f"{k}={v}" for k, v in setup.attn_used.items())
    )
    print(f"{'variant':8s} {'median s':>9s} {'min s':>8s} {'n':>3s} {'vs plain':>8s} {'peak MB':>8s} {'held MB':>8s}")
    for name in VARIANTS + EXTRA_VARIANTS:
        if name not in medians:
            if name in EXTRA_VARIANTS:
                continue
            why = setup.ie_error if name.startswith("ie_") else "not run"
            print(f"{name:8s} skipped ({why})")
            continue
        mem = memory.get(name, {})
        ratio = medians[name] / base if base else float("nan")
        note = " (cold)" if mem.get("method") == "cold" else ""
        note += f" [{mem['error']}]" if "error" in mem else ""
        print(
            f"{name:8s} {medians[name]:9.4f} {min(times[name]):8.4f} {len(times[name]):3d} "
            f"{ratio:8.3f} {_mb(mem.get('peak'))} {_mb(mem.get('held'))}{note}"
        )
    print()
    for label, num, den, target in RESULTS:
        if any(v in EXTRA_VARIANTS and v not in medians for v in (num, den)):
            continue
        if num in medians and den in medians:
            per_round = [a / b for a, b in zip(times[num], times[den], strict=False)]
            results.add(label, medians[num] / medians[den], target, rounds=per_round, better="lower")
        else:
            results.add(label, None, target, better="lower")
    results.write()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "interp-core", "interp-eager", "transformer-lens", "nnsight"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="few repetitions: a smoke test")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 10, narrow 100; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 2; quick 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (narrow: 1)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default=None, help="attention of plain, ie, nnsight")
    p.add_argument(
        "--narrow", action="store_true", help="the overhead-bound regime: d_model 64, vocabulary 1000 (docstring)"
    )
    p.add_argument("--batch", type=int, default=None, help=f"prompts in the input batch (default {BATCH}; narrow 1)")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per prompt (default {SEQ}; narrow {NARROW_SEQ})")
    p.add_argument("--model-dir", type=Path, default=None, help="where the model is written and read")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.quick else 100 if args.narrow else 10
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    args.shape = NARROW if args.narrow else GPT2_SMALL
    if args.threads is None and args.narrow:
        args.threads = 1
    if args.batch is None:
        args.batch = 1 if args.narrow else BATCH
    if args.seq is None:
        args.seq = NARROW_SEQ if args.narrow else SEQ
    if args.model_dir is None:
        args.model_dir = args.shape.default_dir
    if not (args.batch >= 1 and 1 <= args.seq <= N_POSITIONS):
        p.error(f"--batch must be >= 1 and --seq from 1 to {N_POSITIONS}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_child:
        mem_child(args)
        return
    name = "eager_overhead_narrow" if args.narrow else "eager_overhead"
    # a run of another shape than the defaults' (or a smoke run) prints its figures, records none
    default_shape = (args.batch, args.seq) == ((1, NARROW_SEQ) if args.narrow else (BATCH, SEQ))
    results = Results(name, MEASURES, record=not args.quick and default_shape and args.device == "cpu")
    device = torch.device(args.device)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS + EXTRA_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    ensure_model_dir(args.model_dir, args.shape)
    setup = build(args.model_dir, device, variants, args.attn, args.batch, args.seq)
    calls = {n: c for n, c in make_calls(setup).items() if n in variants}
    if setup.ie_hf is not None:
        n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in setup.ie_hf.modules())
        log(f"interp-engine model: {n_hooks} forward hooks installed between calls")
    check(setup, calls)
    times = time_all(calls, device, args.warmup, args.reps)
    memory: dict[str, dict[str, Any]] = {}
    if not args.no_memory:
        if device.type == "cuda":
            for name, call in calls.items():
                peak, held = cuda_peak(call, device)
                memory[name] = {"peak": peak, "held": held, "method": "cuda"}
        else:
            memory = cpu_peaks(args, list(calls))
    report(setup, times, memory, _versions(), results)


if __name__ == "__main__":
    main()
