"""Per-request taps as eager islands inside a breakable CUDA graph (``interp_vllm.worker._islands``),
with no engine and no GPU.

A fake breakable capture (``tests/support/islands.py``) stands in for vLLM's
``BreakableCUDAGraphCapture`` over a vLLM-shaped model whose "kernels" it records into graph
segments and replays. The taps have the form the
TapManager builds (``_layer_out`` / ``_layer_in`` and ``_guarded`` in ``worker/_hooks.py``):
``tap(module, args, output)`` or ``tap(module, args, kwargs)``, reading each request's rows of the
stream ``hidden + residual`` and, where they write, returning ``(stream, 0)``. The reference is an
eager forward with the same taps registered as ordinary torch hooks.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from interp_engine import IncompatibleDependency
from interp_vllm import _compat
from interp_vllm.model import _sites
from interp_vllm.worker import _islands
from interp_vllm.worker._islands import Breakable, IslandError, IslandSet, layer_sites

from ..support.islands import LAYERS, ClosureCapture, D, Model, PlainCapture, T, inputs, vec

ROOT = pathlib.Path(__file__).resolve().parents[2]
HookKey = _sites.HookKey
# -- taps in the TapManager's form ----------------------------------------------------------------


@dataclass
class Req:
    """One request of a step: its rows, where it reads, where it writes (``(op, vector)``)."""

    name: str
    start: int
    end: int
    reads: tuple[HookKey, ...] = ()
    writes: dict[HookKey, tuple[str, torch.Tensor]] = field(default_factory=dict)
    got: dict[HookKey, torch.Tensor] = field(default_factory=dict)
    failed: str | None = None

    def fresh(self) -> Req:
        return Req(self.name, self.start, self.end, self.reads, dict(self.writes))


def visit(stream: torch.Tensor, reqs: list[Req], key: HookKey) -> bool:
    """Each request's writes at ``key`` on its rows (in place), then its reads (copies)."""
    changed = False
    for r in reqs:
        if key in r.writes:
            op, vector = r.writes[key]
            rows = stream[r.start : r.end]
            if op == "add":
                rows += vector
            else:
                rows[:] = vector
            changed = True
    for r in reqs:
        if key in r.reads:
            r.got[key] = stream[r.start : r.end].clone()
    return changed


def layer_out(key: HookKey, reqs: list[Req]) -> Callable[..., Any]:
    def post(module: nn.Module, args: Any, output: Any) -> Any:
        hidden, residual = output
        stream = hidden + residual
        if not visit(stream, reqs, key):
            return None
        return (stream, torch.zeros_like(residual))

    return post


def layer_in(key: HookKey, reqs: list[Req]) -> Callable[..., Any]:
    def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        hidden, residual = kwargs["hidden_states"], kwargs["residual"]
        stream = hidden + residual if residual is not None else hidden.clone()
        if not visit(stream, reqs, key):
            return None
        new = {**kwargs, "hidden_states": stream}
        if residual is not None:
            new["residual"] = torch.zeros_like(residual)
        return args, new

    return pre


def guarded(reqs: list[Req], tap: Callable[..., Any]) -> Callable[..., Any]:
    """As ``Hooks._guarded``: a tap that raises marks its requests failed and changes nothing."""

    def run(*args: Any) -> Any:
        try:
            return tap(*args)
        except Exception as exc:
            for r in reqs:
                r.failed = f"{type(exc).__name__}: {exc}"
            return None

    return run


def plan_of(reqs: list[Req]) -> dict[HookKey, Callable[..., Any]]:
    """The step's ``{HookKey: tap}``, as the TapManager would hand it over."""
    members: dict[HookKey, list[Req]] = {}
    for r in reqs:
        for key in (*r.reads, *r.writes):
            members.setdefault(key, [])
            if r not in members[key]:
                members[key].append(r)
    return {
        key: guarded(group, (layer_in if key[0] == "layer_in" else layer_out)(key, group))
        for key, group in members.items()
    }


@contextmanager
def hooked(model: Model, plan: dict[HookKey, Callable[..., Any]]) -> Iterator[None]:
    """``plan`` registered as ordinary torch hooks: the eager path the TapManager has today."""
    handles = []
    for key, tap in plan.items():
        module = model.layers[key[2]]
        if key[0] == "layer_in":
            handles.append(module.register_forward_pre_hook(tap, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(tap))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- fixtures ----------------------------------------------------------------------------------------


class Rig:
    """A model, islands at every layer's input and output, and one breakable graph captured over
    static inputs with no plan (as vLLM captures with dummy batches)."""

    def __init__(self, keys: list[HookKey] | None = None, place: bool = True) -> None:
        torch.manual_seed(0)
        self.model = Model()
        self.weak_calls = 0

        def weak(tensor: torch.Tensor) -> torch.Tensor:
            self.weak_calls += 1
            return tensor.view(tensor.shape)  # another tensor over the same memory

        self.breakable = Breakable(api=ClosureCapture, weak=weak, plain_capturing=lambda: PlainCapture.capturing)
        self.keys = keys if keys is not None else layer_sites(range(LAYERS))
        self.islands = IslandSet(self.keys, lambda key: self.model.layers[key[2]], self.breakable)
        if place:
            self.islands.place()
        self.x = torch.zeros(T, D)
        self.positions = torch.arange(T, dtype=torch.float32)
        self.errors: list[tuple[HookKey, Exception]] = []
        self.capture = ClosureCapture()
        with self.capture:
            self.out = self.model(self.positions, self.x)

    def replay(self, x: torch.Tensor, plan: dict[HookKey, Callable[..., Any]]) -> tuple[torch.Tensor, list[HookKey]]:
        self.x.copy_(x)
        undeclared = self.islands.begin(plan, on_error=lambda key, exc: self.errors.append((key, exc)))
        assert undeclared == []
        self.capture.replay()
        return self.out.clone(), self.islands.end()

    def eager(self, x: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        with hooked(self.model, plan_of(reqs)):
            out: torch.Tensor = self.model(self.positions, x)
        return out


PLAN_A = [
    Req(
        "a",
        0,
        5,
        reads=(("layer_out", None, 1), ("layer_in", None, 3)),
        writes={("layer_out", None, 2): ("add", vec(1))},
    ),
    Req("b", 5, 12, reads=(("layer_out", None, 3),), writes={("layer_in", None, 1): ("set", vec(2))}),
]
PLAN_B = [
    Req("c", 0, 3, reads=(("layer_in", None, 0), ("layer_out", None, 3))),
    Req("d", 3, 4, writes={("layer_in", None, 0): ("set", vec(3))}, reads=(("layer_out", None, 0),)),
    Req("e", 7, 12, reads=(("layer_in", None, 2),), writes={("layer_out", None, 1): ("add", vec(4))}),
]


def check_equal(graph: tuple[torch.Tensor, list[Req]], eager: tuple[torch.Tensor, list[Req]]) -> None:
    out, reqs = graph
    ref, ref_reqs = eager
    assert torch.equal(out, ref)
    for r, e in zip(reqs, ref_reqs, strict=True):
        assert r.failed is None and e.failed is None
        assert set(r.got) == set(r.reads) == set(e.got)
        for key in r.reads:
            assert torch.equal(r.got[key], e.got[key]), (r.name, key)


# -- the tests ---------------------------------------------------------------------------------------


def test_replay_runs_each_steps_plan_as_an_eager_forward_with_those_taps() -> None:
    rig = Rig()
    assert rig.capture.kinds.count("eager") == len(rig.islands) == 2 * LAYERS
    assert rig.capture.kinds.count("graph") == 2 * LAYERS + 1
    plain = rig.replay(inputs(1), {})[0]
    for seed, spec in ((1, PLAN_A), (2, PLAN_B), (1, PLAN_A)):
        reqs = [r.fresh() for r in spec]
        out, missed = rig.replay(inputs(seed), plan_of(reqs))
        assert missed == [] and rig.errors == []
        ref_reqs = [r.fresh() for r in spec]
        check_equal((out, reqs), (rig.eager(inputs(seed), ref_reqs), ref_reqs))
    # the plans steer: the output differs from the unsteered one
    assert not torch.equal(out, plain)
    # the same islands in an eager forward (no capture active) run the plan too
    reqs = [r.fresh() for r in PLAN_B]
    rig.islands.begin(plan_of(reqs))
    out = rig.model(rig.positions, inputs(2))
    assert rig.islands.end() == []
    ref_reqs = [r.fresh() for r in PLAN_B]
    check_equal((out, reqs), (rig.eager(inputs(2), ref_reqs), ref_reqs))


def test_islands_with_no_plan_change_nothing_bit_for_bit() -> None:
    rig = Rig()
    bare = Rig(place=False)  # the same model captured without islands: one graph segment
    assert bare.capture.kinds == ["graph"]
    for seed in range(3):
        x = inputs(seed)
        with_islands = rig.replay(x, {})[0]
        without = bare.replay(x, {})[0]
        assert torch.equal(with_islands, without)
        # a plan that only reads somewhere changes nothing either
        reader = Req("r", 2, 9, reads=(("layer_out", None, 2), ("layer_in", None, 1)))
        assert torch.equal(rig.replay(x, plan_of([reader]))[0], without)
        assert set(reader.got) == set(reader.reads)
    assert rig.weak_calls > 0  # the capture held the static tensors through weak references


def test_writes_go_into_the_static_tensors_the_next_segment_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig()
    # the static tensors layer 2 reads: the ones layer 1 returned at capture
    seen: dict[str, torch.Tensor] = {}

    def remember(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen.update(hidden=kwargs["hidden_states"], residual=kwargs["residual"])

    handle = rig.model.layers[2].register_forward_pre_hook(remember, with_kwargs=True)
    capture = ClosureCapture()
    with capture:
        out = rig.model(rig.positions, rig.x)
    handle.remove()
    rig.capture, rig.out = capture, out

    target = vec(7)
    writer = Req("w", 2, 6, writes={("layer_out", None, 1): ("set", target)}, reads=(("layer_in", None, 2),))
    x = inputs(4)
    steered, missed = rig.replay(x, plan_of([writer]))
    assert missed == []
    stream = seen["hidden"] + seen["residual"]
    assert torch.equal(stream[2:6], target.expand(4, D))  # in the static memory itself
    assert torch.equal(seen["residual"], torch.zeros(T, D))
    assert torch.equal(writer.got[("layer_in", None, 2)][:], target.expand(4, D))  # the next island sees it
    ref = Req("w", 2, 6, writes={("layer_out", None, 1): ("set", target)})
    assert torch.equal(steered, rig.eager(x, [ref]))

    # control: a replacement that is not written back never reaches the next segment
    monkeypatch.setattr(_islands, "_write_in_place", lambda pairs: None)
    lost = Req("w", 2, 6, writes={("layer_out", None, 1): ("set", target)}, reads=(("layer_in", None, 2),))
    out_lost = rig.replay(x, plan_of([lost]))[0]
    assert torch.equal(out_lost, rig.replay(x, {})[0])
    assert not torch.equal(out_lost, steered)


def test_islands_captured_once_serve_many_steps_with_changing_rows() -> None:
    rig = Rig()
    keys = rig.keys
    gen = torch.Generator().manual_seed(5)
    for step in range(25):
        # 1-3 requests over random rows of the padded batch (rows after the last are padding)
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: int(torch.randint(1, 4, (1,), generator=gen))].tolist())
        bounds = [0, *[c + 1 for c in cuts]]
        spec = []
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            picks = torch.randperm(len(keys), generator=gen)[:3].tolist()
            reads = tuple(keys[p] for p in picks[:2])
            writes = {}
            if torch.rand(1, generator=gen).item() < 0.7:
                writes[keys[picks[2]]] = ("add" if i % 2 else "set", torch.randn(D, generator=gen))
            spec.append(Req(f"s{step}r{i}", start, end, reads=reads, writes=writes))
        x = torch.randn(T, D, generator=gen)
        reqs = [r.fresh() for r in spec]
        out, missed = rig.replay(x, plan_of(reqs))
        assert missed == []
        ref_reqs = [r.fresh() for r in spec]
        check_equal((out, reqs), (rig.eager(x, ref_reqs), ref_reqs))
    counts = rig.islands.counts()
    assert counts == {"islands": 2 * LAYERS, "captured": 2 * LAYERS, "sealed": 0}
    assert rig.capture.kinds.count("eager") == 2 * LAYERS  # registered once, at capture
    assert rig.errors == []


def test_a_failing_tap_marks_its_requests_failed_and_leaves_the_values() -> None:
    rig = Rig()
    x = inputs(9)
    plain = rig.replay(x, {})[0]
    # a guarded tap that raises (a vector of the wrong width): its requests fail, the others go on
    bad = Req("bad", 0, 4, writes={("layer_out", None, 1): ("add", torch.ones(D + 1))}, reads=(("layer_out", None, 1),))
    good = Req("good", 4, 8, writes={("layer_out", None, 2): ("add", vec(5))}, reads=(("layer_out", None, 3),))
    out, missed = rig.replay(x, plan_of([bad, good]))
    assert missed == [] and rig.errors == []
    assert bad.failed is not None and "RuntimeError" in bad.failed and bad.got == {}
    assert good.failed is None
    ref_good = Req("good", 4, 8, writes={("layer_out", None, 2): ("add", vec(5))}, reads=(("layer_out", None, 3),))
    check_equal((out, [good]), (rig.eager(x, [ref_good]), [ref_good]))

    # an unguarded tap that raises: the step's on_error hears it, the values stay
    def boom(module: nn.Module, args: Any, output: Any) -> Any:
        raise ValueError("boom")

    out, _ = rig.replay(x, {("layer_out", None, 2): boom})
    assert torch.equal(out, plain)
    assert [(key, type(exc)) for key, exc in rig.errors] == [(("layer_out", None, 2), ValueError)]

    # a replacement that does not fit: nothing of it is written (not even its first, fitting element)
    def misfit(module: nn.Module, args: Any, output: Any) -> Any:
        return (output[0] + 1.0, torch.zeros(3))

    def new_argument(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        return args, {**kwargs, "extra": torch.zeros(1)}

    def not_a_tensor(module: nn.Module, args: Any, output: Any) -> Any:
        return (output[0] + 1.0, None)

    cases: list[tuple[HookKey, Callable[..., Any]]] = [
        (("layer_out", None, 1), misfit),
        (("layer_in", None, 2), new_argument),
        (("layer_out", None, 0), not_a_tensor),
    ]
    for key, tap in cases:
        rig.errors.clear()
        out, _ = rig.replay(x, {key: tap})
        assert torch.equal(out, plain), key
        assert [(k, type(exc)) for k, exc in rig.errors] == [(key, IslandError)]


def test_a_replacement_over_the_static_memory_is_read_before_anything_is_written() -> None:
    """A tap may hand back the static tensors themselves in other places (here: swapped): each
    static tensor gets what the tap returned for it, not what an earlier copy left there."""
    rig = Rig(keys=[("layer_out", None, 0)])
    hidden, residual = torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3)
    before = (hidden.clone(), residual.clone())
    rig.islands.begin({("layer_out", None, 0): lambda module, args, output: (output[1], output[0])})
    rig.islands.islands[("layer_out", None, 0)].run((), (hidden, residual))
    assert rig.islands.end() == []
    assert torch.equal(hidden, before[1]) and torch.equal(residual, before[0])


def test_a_graph_that_cannot_break_seals_its_islands_and_the_step_reports_them_missed() -> None:
    rig = Rig()
    full = PlainCapture()
    with full:
        out = rig.model(rig.positions, rig.x)
    assert rig.islands.counts()["sealed"] == 2 * LAYERS
    reqs = [r.fresh() for r in PLAN_A]
    plan = plan_of(reqs)
    rig.x.copy_(inputs(3))
    rig.islands.begin(plan)
    full.replay()
    assert rig.islands.end() == list(plan)
    assert all(r.got == {} for r in reqs)
    assert torch.equal(out, rig.replay(inputs(3), {})[0])  # nothing was written either


def test_undeclared_sites_are_handed_back_and_missed_under_replay() -> None:
    outputs_only = layer_sites(range(LAYERS), inputs=False)
    rig = Rig(keys=outputs_only)
    assert rig.capture.kinds.count("eager") == LAYERS
    key: HookKey = ("layer_in", None, 2)
    reader = Req("r", 0, 6, reads=(key, ("layer_out", None, 1)))
    plan = plan_of([reader])
    assert rig.islands.begin(plan) == [key]
    handle = rig.model.layers[2].register_forward_pre_hook(rig.islands.marked(key, plan[key]), with_kwargs=True)
    rig.x.copy_(inputs(1))
    rig.capture.replay()  # Python hooks do not run at replay
    assert rig.islands.end() == [key]
    assert set(reader.got) == {("layer_out", None, 1)}
    rig.islands.begin(plan)
    rig.model(rig.positions, inputs(1))  # an eager forward runs the ordinary hook
    assert rig.islands.end() == []
    handle.remove()
    assert set(reader.got) == set(reader.reads)
    with pytest.raises(ValueError, match="model_out"):
        IslandSet([("model_out", None, 0)], lambda key: rig.model, rig.breakable)


def test_vllms_breakable_capture_is_found_and_matches_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from interp_vllm._compat_check import check_patch, check_reads, tree_source

    breakable = _islands.vllm_breakable()
    assert breakable.api.current() is None  # no capture outside vLLM's graph capture
    assert breakable.plain_capturing() is False
    site = tree_source(pathlib.Path(vllm.__file__).resolve().parents[1])
    assert check_reads(_islands.BREAKABLE_CAPTURE, site) is None
    assert check_patch(_islands.WEAK_REF_TENSOR, site) is None
    # a vLLM the rows are not written for, or one where the capture moved: a typed error
    moved = dataclasses.replace(_islands.BREAKABLE_CAPTURE, names=("current", "add_eager", "no_such_field"))
    monkeypatch.setattr(_islands, "BREAKABLE_CAPTURE", moved)
    with pytest.raises(IncompatibleDependency, match="no_such_field"):
        _islands.vllm_breakable()
    monkeypatch.setattr(_compat, "_installed", lambda package: "0.35.0")
    with pytest.raises(IncompatibleDependency, match=r"vllm>=0\.32,<0\.35"):
        _islands.vllm_breakable()


def test_whether_vllm_breaks_its_graphs_is_its_config_then_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    class Config:
        def __init__(self, resolved: bool | None) -> None:
            self.compilation_config = type("CompilationConfig", (), {"use_breakable_cudagraph": resolved})()

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    assert _islands.breakable_enabled(Config(None)) and _islands.breakable_enabled(object())
    assert not _islands.breakable_enabled(Config(False))  # 0.34's resolved config wins
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert _islands.breakable_enabled(Config(True)) and not _islands.breakable_enabled(Config(None))


def test_the_gpu_benchmark_runs_its_cpu_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_breakable_taps.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT breakable_taps_correct 1" in done.stdout
    assert "results:" not in done.stdout  # a dry run records nothing
