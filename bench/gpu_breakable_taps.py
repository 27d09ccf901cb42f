"""Per-request taps as eager islands inside a breakable CUDA graph, against one full CUDA graph, without vLLM.

    python bench/gpu_breakable_taps.py [--layers 12] [--width 768] [--tokens 256] [--reps 50]
    python bench/gpu_breakable_taps.py --dry-run     # CPU: the same path, closures for CUDA graphs

Builds a vLLM-shaped decoder stack with torch alone (each layer takes ``(positions,
hidden_states=, residual=)`` and returns ``(hidden, residual)`` with the residual add deferred, as
vLLM's layers do: fused add + RMS norm, causal attention over the batch's tokens, a gated MLP),
puts :mod:`interp_vllm.worker._islands` islands on its layers, and times one forward over static
inputs, in one run:

- ``eager``: no graph;
- ``full_graph``: one ``torch.cuda.CUDAGraph`` of the whole forward with no islands (the ceiling);
- ``breakable``: a breakable capture (``SegmentCapture`` below: a ``torch.cuda.CUDAGraph`` per
  segment, all in one memory pool, ended and restarted by ``add_eager`` around each island, as
  vLLM's ``BreakableCUDAGraphCapture`` does; each graph here has a memory pool of its own) with
  islands at one layer's output, at every layer's output, and at every layer's input and output
  (``layer_sites``), with no request tapping;
- the same with a plan: 8 requests over the tokens, 4 capturing their rows at every layer's
  output (``_capture`` copies rows out; here a clone on the device), and then 2 more steered
  (an add on their rows) at the middle layer;
- ``eager_hooks``: the eager forward with the same taps registered as torch hooks (the TapManager's
  path today).

Every figure is a time ratio to ``full_graph`` (lower is better). Before timing, a replay of the
breakable graph with the taps must give the eager-with-hooks forward's captures and output, and
its replay with no plan the full graph's output (``breakable_taps_correct``).

The taps have the TapManager's form (``tap(module, args, output)`` returning ``(stream, 0)`` where
they write, wrapped as ``_guarded`` wraps them), handed to ``IslandSet.begin`` each step. Islands
hold the static tensors strongly here (vLLM's ``weak_ref_tensor`` needs vLLM's ops). ``--dry-run``
(and any run without CUDA) uses a fake capture whose graph segments are Python closures over the
static CPU tensors: it checks the harness and the islands' path, times nothing meaningful and
records nothing. With CUDA the figures go to ``bench/results/gpu_breakable_taps.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
try:
    import interp_vllm  # noqa: F401
except ImportError:  # a machine with torch but without the packages installed: their sources
    sys.path[:0] = [str(ROOT / "packages" / "interp-vllm" / "src"), str(ROOT / "packages" / "interp-core" / "src")]

from _results import Results  # noqa: E402

from interp_vllm.model import _sites  # noqa: E402
from interp_vllm.worker._islands import Breakable, IslandSet, layer_sites  # noqa: E402

HookKey = _sites.HookKey
Plan = dict[HookKey, Callable[..., Any]]

# -- graph captures -----------------------------------------------------------------------------------

_RECORDER: list[Any] = []
"""The closure capture recording kernels now (CPU only; empty: kernels run)."""


def launch(kernel: Callable[[], None]) -> None:
    """Run ``kernel`` (on CUDA a capture records what it launches), or record it for a closure capture."""
    if _RECORDER:
        _RECORDER[-1].record(kernel)
    else:
        kernel()


class SegmentCapture:
    """A breakable CUDA graph capture: the forward as graph segments, each a ``torch.cuda.CUDAGraph``
    in one memory pool; :meth:`add_eager` ends the segment, runs ``fn`` eagerly, keeps it for
    replay and starts the next segment. Capture runs on a side stream (CUDA graphs cannot be
    captured on the default one)."""

    _tls: ClassVar[threading.local] = threading.local()

    @classmethod
    def current(cls) -> SegmentCapture | None:
        return getattr(cls._tls, "active", None)

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.segments: list[Callable[[], Any]] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._capturing = False

    def __enter__(self) -> SegmentCapture:
        SegmentCapture._tls.active = self
        self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._close()
        finally:
            SegmentCapture._tls.active = None

    def _open(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self._graph, self._capturing = graph, True

    def _close(self) -> None:
        if not self._capturing or self._graph is None:
            return
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self.segments.append(self._graph.replay)
        self._graph, self._capturing = None, False

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        self._close()
        result = fn()
        self.segments.append(fn)
        self._open()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()


class ClosureCapture:
    """The CPU stand-in: the same protocol, each graph segment a closure over the kernels recorded."""

    _active: ClassVar[ClosureCapture | None] = None

    @classmethod
    def current(cls) -> ClosureCapture | None:
        return cls._active

    def __init__(self, pool: Any = None) -> None:
        self.segments: list[Callable[[], Any]] = []
        self._kernels: list[Callable[[], None]] = []
        self._capturing = False

    def __enter__(self) -> ClosureCapture:
        ClosureCapture._active = self
        self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close()
        ClosureCapture._active = None

    def _open(self) -> None:
        self._kernels, self._capturing = [], True
        _RECORDER.append(self)

    def _close(self) -> None:
        if not self._capturing:
            return
        _RECORDER.remove(self)
        kernels = tuple(self._kernels)

        def graph() -> None:
            for kernel in kernels:
                kernel()

        self.segments.append(graph)
        self._capturing = False

    def record(self, kernel: Callable[[], None]) -> None:
        self._kernels.append(kernel)

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        self._close()
        result = fn()
        self.segments.append(fn)
        self._open()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()


# -- the model ------------------------------------------------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Layer(nn.Module):
    """A decoder layer as vLLM writes one: ``(positions, hidden_states, residual) -> (hidden, residual)``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.Parameter(torch.ones(width), requires_grad=False)
        self.norm2 = nn.Parameter(torch.ones(width), requires_grad=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 8 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_h, out_r = torch.empty_like(hidden_states), torch.empty_like(hidden_states)

        def kernel() -> None:
            res = hidden_states if residual is None else hidden_states + residual
            tokens, width = res.shape
            q, k, v = self.qkv(rms(res, self.norm1)).view(tokens, 3, self.heads, -1).unbind(1)
            # the tokens as one sequence: [1, heads, tokens, head_dim]
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
            res = res + self.o(attn.transpose(0, 1).reshape(tokens, width))
            gate, up = self.gate_up(rms(res, self.norm2)).chunk(2, dim=-1)
            out_h.copy_(self.down(F.silu(gate) * up))
            out_r.copy_(res)

        launch(kernel)
        return out_h, out_r


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(width, max(1, width // 64)) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(width), requires_grad=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden_states=hidden, residual=residual)
        assert residual is not None
        out = torch.empty_like(x)

        def final(hidden: torch.Tensor = hidden, residual: torch.Tensor = residual) -> None:
            out.copy_(rms(hidden + residual, self.norm))

        launch(final)
        return out


# -- the taps, in the TapManager's form ------------------------------------------------------------------


class Request:
    def __init__(self, start: int, end: int, captures: bool, steer: torch.Tensor | None) -> None:
        self.start, self.end, self.captures, self.steer = start, end, captures, steer
        self.rows: dict[int, torch.Tensor] = {}
        self.failed: Exception | None = None


def layer_out_tap(layer: int, members: list[Request], steer_at: int) -> Callable[..., Any]:
    """As ``Hooks._layer_out`` + ``_guarded``: writes on the stream, then row copies; ``(stream, 0)`` back."""
    writers = [r for r in members if r.steer is not None and layer == steer_at]

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        try:
            hidden, residual = output
            stream = hidden + residual
            for r in writers:
                stream[r.start : r.end] += r.steer
            for r in members:
                if r.captures:
                    r.rows[layer] = stream[r.start : r.end].clone()
            return (stream, torch.zeros_like(residual)) if writers else None
        except Exception as exc:
            for r in members:
                r.failed = exc
            return None

    return post


def steering_vectors(width: int, device: torch.device) -> dict[int, torch.Tensor]:
    """The steered requests' vectors, on the device once (the TapManager caches its writes' vectors)."""
    gen = torch.Generator().manual_seed(3)
    return {i: torch.randn(width, generator=gen).to(device) for i in (4, 5)}


def requests(tokens: int, vectors: dict[int, torch.Tensor], steer: bool) -> list[Request]:
    """8 requests over the tokens: 0-3 capture at every layer, 4-5 steered (when ``steer``), 6-7 plain."""
    bounds = [tokens * i // 8 for i in range(9)]
    return [
        Request(bounds[i], bounds[i + 1], captures=i < 4, steer=vectors[i] if steer and i in vectors else None)
        for i in range(8)
    ]


def plan_of(reqs: list[Request], layers: int) -> Plan:
    steer_at = layers // 2
    active = [r for r in reqs if r.captures or r.steer is not None]
    plan: Plan = {}
    for layer in range(layers):
        members = [r for r in active if r.captures or (r.steer is not None and layer == steer_at)]
        if members:
            plan[("layer_out", None, layer)] = layer_out_tap(layer, members, steer_at)
    return plan


@contextmanager
def hooked(model: Stack, plan: Plan) -> Any:
    handles = [model.layers[key[2]].register_forward_hook(tap) for key, tap in plan.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- the run ----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cuda = args.device == "cuda"
        self.device = torch.device(args.device)
        self.layers, self.width, self.tokens, self.reps = args.layers, args.width, args.tokens, args.reps
        torch.manual_seed(0)
        self.model = Stack(self.layers, self.width).to(self.device).eval()
        self.x = torch.zeros(self.tokens, self.width, device=self.device)
        self.positions = torch.arange(self.tokens, device=self.device)
        self.stream = torch.cuda.Stream() if self.cuda else None  # type: ignore[no-untyped-call]
        self.vectors = steering_vectors(self.width, self.device)
        self.capture_cls: Any = SegmentCapture if self.cuda else ClosureCapture
        self.breakable = Breakable(api=self.capture_cls, weak=lambda t: t, plain_capturing=lambda: False)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def side(self) -> Any:
        if not self.cuda:
            yield
            return
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def eager(self) -> torch.Tensor:
        out: torch.Tensor = self.model(self.positions, self.x)
        return out

    def full_graph(self) -> tuple[Callable[[], None], torch.Tensor]:
        """One graph of the whole forward (CPU: one closure segment)."""
        with self.side():
            for _ in range(3):
                self.eager()
        if self.cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
                out = self.eager()
            return graph.replay, out
        capture = ClosureCapture()
        with capture:
            out = self.eager()
        return capture.replay, out

    def breakable_graph(self, keys: list[HookKey]) -> tuple[IslandSet, Callable[[], None], torch.Tensor]:
        islands = IslandSet(keys, lambda key: self.model.layers[key[2]], self.breakable).place()
        with self.side():
            for _ in range(3):
                self.eager()
            capture = self.capture_cls(torch.cuda.graph_pool_handle() if self.cuda else None)
            with torch.no_grad(), capture:
                out = self.eager()
        islands.remove()  # the graph keeps its islands; later captures and eager forwards have none
        return islands, capture.replay, out

    def timed(self, fn: Callable[[], Any]) -> float:
        fn()  # once untimed
        times = []
        for _ in range(self.reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def step(self, islands: IslandSet, replay: Callable[[], None], steer: bool | None) -> Callable[[], None]:
        """One step of the host: the step's plan built and handed over (none: ``steer is None``), the replay."""

        def run() -> None:
            plan = {} if steer is None else plan_of(requests(self.tokens, self.vectors, steer), self.layers)
            islands.begin(plan)
            replay()
            missed = islands.end()
            assert not missed, missed

        return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="default 12 (4 in a dry run)")
    parser.add_argument("--width", type=int, default=None, help="default 768 (64 in a dry run)")
    parser.add_argument("--tokens", type=int, default=None, help="default 256 (32 in a dry run)")
    parser.add_argument("--reps", type=int, default=None, help="default 50 (3 in a dry run)")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, closures for graphs, small sizes, nothing recorded"
    )
    args = parser.parse_args(argv)
    dry = args.dry_run or args.device != "cuda"
    if args.dry_run:
        args.device = "cpu"
    for name, full, small in (("layers", 12, 4), ("width", 768, 64), ("tokens", 256, 32), ("reps", 50, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    if dry and not args.dry_run:
        print("no CUDA: a dry run (closures for graphs); nothing is recorded")
    results = Results("gpu_breakable_taps", ["packages/interp-vllm/src/interp_vllm/worker/_islands.py"], record=not dry)
    bench = Bench(args)
    layers, middle = args.layers, args.layers // 2

    with torch.no_grad():
        # graphs: the ceiling, then breakable ones with islands at one layer, every output, every input and output
        full_replay, full_out = bench.full_graph()
        one = bench.breakable_graph([("layer_out", None, middle)])
        outs = bench.breakable_graph(layer_sites(range(layers), inputs=False))
        both = bench.breakable_graph(layer_sites(range(layers)))

        # correctness: new inputs; no plan equals the full graph, the taps' plan equals eager hooks
        bench.x.copy_(torch.randn(args.tokens, args.width, generator=torch.Generator().manual_seed(1)).to(bench.device))
        full_replay()
        reference_plain = full_out.clone()
        noplan_err, noplan_equal = 0.0, True
        for graph in (one, outs, both):
            bench.step(*graph[:2], steer=None)()
            noplan_err = max(noplan_err, rel(graph[2], reference_plain))
            noplan_equal = noplan_equal and bool(torch.equal(graph[2], reference_plain))
        tapped = requests(args.tokens, bench.vectors, True)
        outs[0].begin(plan_of(tapped, layers))
        outs[1]()
        missed = outs[0].end()
        graph_out = outs[2].clone()
        eager_reqs = requests(args.tokens, bench.vectors, True)
        with hooked(bench.model, plan_of(eager_reqs, layers)):
            eager_out = bench.eager()
        steer_err = rel(graph_out, eager_out)
        capture_err = max(
            rel(r.rows[layer], e.rows[layer])
            for r, e in zip(tapped, eager_reqs, strict=True)
            if r.captures
            for layer in range(layers)
        )
        complete = all(set(r.rows) == set(range(layers)) for r in tapped if r.captures)
        failed = [r.failed for r in tapped if r.failed is not None]
        steered = rel(graph_out, reference_plain) > 1e-3
        tolerance = 1e-4 if bench.cuda else 1e-6
        ok = (
            not missed
            and not failed
            and complete
            and steered
            and noplan_err <= tolerance
            and steer_err <= tolerance
            and capture_err <= tolerance
        )

        # timing
        def eager_hooks() -> None:
            with hooked(bench.model, plan_of(requests(args.tokens, bench.vectors, True), layers)):
                bench.eager()

        times = {
            "full_graph": bench.timed(full_replay),
            "eager": bench.timed(bench.eager),
            "eager_hooks_captures_steer": bench.timed(eager_hooks),
            "breakable_1_noplan": bench.timed(bench.step(*one[:2], steer=None)),
            "breakable_all_noplan": bench.timed(bench.step(*outs[:2], steer=None)),
            "breakable_all_io_noplan": bench.timed(bench.step(*both[:2], steer=None)),
            "breakable_all_captures": bench.timed(bench.step(*outs[:2], steer=False)),
            "breakable_all_captures_steer": bench.timed(bench.step(*outs[:2], steer=True)),
        }

    print(f"device {args.device}, {layers} layers x {args.width}, {args.tokens} tokens, {args.reps} reps")
    print(f"no plan vs full graph:          max rel diff {noplan_err:.2e} (bit-identical: {noplan_equal})")
    print(f"taps' output vs eager hooks:    max rel diff {steer_err:.2e}")
    print(f"taps' captures vs eager hooks:  max rel diff {capture_err:.2e}")
    print(
        f"islands (graph breaks): {len(one[0])}, {len(outs[0])} (every output), {len(both[0])} (every input and output)"
    )
    for name, seconds in times.items():
        print(f"{name:30} {seconds * 1e3:9.3f} ms")
    results.add("breakable_taps_correct", 1.0 if ok else 0.0, 1.0, digits=0)
    base = times["full_graph"]
    for name, seconds in times.items():
        if name != "full_graph":
            results.add(f"{name}_vs_full_graph", seconds / base, None, better="lower")
    results.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
