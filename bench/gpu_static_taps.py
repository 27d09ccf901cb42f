"""Prove the vllm-static mechanism under CUDA graphs, without vLLM.

    python bench/gpu_static_taps.py [--device cuda] [--layers 12] [--width 768] [--tokens 128]

Builds a Llama-shaped model with random weights, installs the same tap and write modules the
vllm-static backend uses (``interp_vllm.static._taps``: a ``StaticTap`` and a ``StaticWrites`` table
on every layer's output), captures one forward in a ``torch.cuda.CUDAGraph`` and replays it:

1. with new input ids and every token on slot 0: captures equal eager HF ``hidden_states`` and
   logits equal the plain model's;
2. with per-token steering indices (add on some tokens, ablate on others, set on one): logits
   equal an eager HF forward with the same edits written as ordinary hooks, and the unsteered
   tokens of the tapped layers are bit-identical to the plain run;
3. timing: replay with taps against replay of the same model captured without them;
4. the transport out of the taps (``interp_vllm._transport``): after each replay every layer's
   tapped rows go into a shared-memory slab region of their own as the vllm backends' workers
   write them, through :class:`~interp_vllm._transport.HostCopier` (on CUDA: a device gather,
   a non-blocking copy to pinned host memory on a side stream, one synchronisation per step,
   then the write into the slab), half the layers as one block of rows and half through an
   indexed copy (prefill chunks and decode rows); the slab's rows must equal the taps', and
   the replay plus transport is timed against the plain replay.

On ``--device cpu`` (no CUDA) the same static forward runs eagerly, which checks the harness but
not graph capture. Ends with ``RESULT`` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from interp_engine import Write
from interp_vllm._transport import HostCopier, Slab, SlabWriter, new_prefix
from interp_vllm.static._taps import StaticTap, StaticWrites


def build(layers: int, width: int, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 3,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 128),
        vocab_size=4096,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    return model


def install(model: Any, tokens: int) -> tuple[list[StaticTap], list[StaticWrites], list[Any]]:
    width = model.config.hidden_size
    device = next(model.parameters()).device
    taps, tables, handles = [], [], []
    for layer in model.model.layers:
        tap = StaticTap(tokens, width, dtype=torch.float32, device=device)
        table = StaticWrites(8, width, tokens, dtype=torch.float32, device=device)

        def hook(module: Any, args: Any, output: Any, tap: StaticTap = tap, table: StaticWrites = table) -> Any:
            return tap(table(output))

        handles.append(layer.register_forward_hook(hook))
        taps.append(tap)
        tables.append(table)
    return taps, tables, handles


def graphed(model: Any, ids: torch.Tensor, device: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """A replay function over static input ``ids`` and the logits buffer it fills."""

    def forward() -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits
        return logits

    if device != "cuda":
        out = forward()
        return (lambda: out.copy_(forward())), out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def timing(replay: Callable[[], Any], device: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        replay()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    device, n = args.device, args.tokens
    gen = torch.Generator().manual_seed(1)

    plain = build(args.layers, args.width, device)
    tapped = build(args.layers, args.width, device)
    taps, tables, _ = install(tapped, n)
    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    replay, logits = graphed(tapped, ids, device)
    plain_ids = torch.zeros(1, n, dtype=torch.long, device=device)
    plain_replay, plain_logits = graphed(plain, plain_ids, device)

    # 1. new inputs, no writes: captures equal HF hidden states, logits equal the plain model's
    fresh = torch.randint(0, 4096, (1, n), generator=gen).to(device)
    ids.copy_(fresh)
    for table in tables:
        table.clear()
    replay()
    with torch.no_grad():
        reference = plain(input_ids=fresh, output_hidden_states=True, use_cache=False)
    capture_err = max(rel(tap.buffer[:n], reference.hidden_states[i + 1][0]) for i, tap in enumerate(taps[:-1]))
    logits_err = rel(logits[0], reference.logits[0])

    # 2. per-token writes at layer L: add on tokens 1-9, ablate on 20-29, set on 40
    layer = args.layers // 2
    width = args.width
    add = Write(f"resid_post.{layer}", torch.randn(width, generator=gen), op="add", scale=2.0)
    ablate = Write(f"resid_post.{layer}", torch.randn(width, generator=gen), op="ablate")
    set_to = Write(f"resid_post.{layer}", torch.randn(width, generator=gen), op="set")
    tables[layer].assign(add, torch.arange(1, 10))
    tables[layer].assign(ablate, torch.arange(20, 30))
    tables[layer].assign(set_to, torch.tensor([40]))
    plain_capture = taps[layer].buffer[:n].clone()
    replay()

    def edit(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        out = output.clone()
        out[0, 1:10] += 2.0 * add.vector.to(device)
        unit = (ablate.vector / ablate.vector.norm()).to(device)
        block = out[0, 20:30]
        out[0, 20:30] = block - (block @ unit).unsqueeze(-1) * unit
        out[0, 40] = set_to.vector.to(device)
        return out

    handle = plain.model.layers[layer].register_forward_hook(edit)
    with torch.no_grad():
        steered_reference = plain(input_ids=fresh, use_cache=False).logits
    handle.remove()
    steer_err = rel(logits[0], steered_reference[0])
    untouched = [i for i in range(n) if not (1 <= i < 10 or 20 <= i < 30 or i == 40)]
    bit_identical = bool(torch.equal(taps[layer].buffer[untouched], plain_capture[untouched]))

    # 3. replay timing, taps (all layers, writes at one) against no taps
    tapped_time = timing(replay, device, args.reps)
    plain_time = timing(plain_replay, device, args.reps)
    del plain_logits

    # 4. the taps' rows into a shared-memory slab after each replay, as the workers write them
    slab = Slab(new_prefix("/dev/shm"))
    try:
        regions = slab.allocate([(n, [width])] * len(taps))
        writer = SlabWriter(HostCopier(torch.device(device)))
        index = torch.arange(n)

        def transport() -> None:
            replay()
            for i, (tap, region) in enumerate(zip(taps, regions, strict=True)):
                # slab rows: the region's first row on (a block), or its first row + each position
                at = region.first_row if i % 2 == 0 else index + region.first_row
                writer.write(region, at, tap.buffer[:n].detach(), None)
            writer.copier.step_done()

        transport()
        slab_equal = all(
            torch.equal(slab.read(region, n), tap.buffer[:n].cpu()) for tap, region in zip(taps, regions, strict=True)
        )
        regions = slab.allocate([(n, [width])] * len(taps))  # the read ones belong to their tensors now
        transport_time = timing(transport, device, args.reps)
    finally:
        slab.close()

    print(f"device {device}, {args.layers} layers x {args.width}, {n} tokens")
    print(f"captures vs HF hidden states: max rel diff {capture_err:.2e}")
    print(f"logits (no writes) vs plain:   max rel diff {logits_err:.2e}")
    print(f"steered logits vs eager hooks: max rel diff {steer_err:.2e}")
    print(f"unsteered rows bit-identical:  {bit_identical}")
    print(f"replay: taps {tapped_time * 1e3:.3f} ms, plain {plain_time * 1e3:.3f} ms")
    megabytes = len(taps) * n * width * 4 / 1e6
    print(f"replay + every tap's rows into the slab ({megabytes:.1f} MB): {transport_time * 1e3:.3f} ms")
    print(f"slab rows equal the taps':     {slab_equal}")
    ok = capture_err <= 1e-4 and logits_err <= 1e-4 and steer_err <= 1e-4 and bit_identical
    print(f"RESULT static_taps_correct {int(ok)} (target 1)")
    print(f"RESULT slab_transport_correct {int(slab_equal)} (target 1)")
    print(f"RESULT replay_taps_vs_plain {tapped_time / plain_time:.3f} (target -)")
    print(f"RESULT replay_taps_slab_vs_plain {transport_time / plain_time:.3f} (target -)")
    return 0 if ok and slab_equal else 1


if __name__ == "__main__":
    sys.exit(main())
