"""Per-request taps as eager islands inside a breakable CUDA graph's replay.

vLLM's V2 runner can capture a forward as a *breakable* CUDA graph
(``VLLM_USE_BREAKABLE_CUDAGRAPH``; ``vllm/compilation/breakable_cudagraph.py``): a capture context
(``BreakableCUDAGraphCapture``, thread-local, ``current()``) records the forward as a list of
graph segments, and anything that calls its ``add_eager(fn)`` while it captures (``_capturing``)
ends the current segment, runs ``fn`` once, records ``fn`` in the list and starts a new segment.
Replay then runs the list in order: graph, ``fn``, graph, ... Python code in the model's modules
(and so every torch hook) runs only while a graph is captured; at replay only the recorded
``fn``\\ s run. ``fn`` must work on the same static tensors the capture used, in place: the next
graph segment reads those addresses.

This module places the dynamic taps there.

Sites and islands
    An :class:`IslandSet` is declared before vLLM captures its graphs (right after the model is
    loaded) over a fixed set of sites, each a :data:`~..model._sites.HookKey` (the hook the
    taps of an address use: ``("layer_out", None, 7)`` is layer 7's output, where ``resid_post.7``
    lives). For each site it adds one persistent torch hook to the site's module, an *island*
    (:class:`Island`): a forward hook for ``layer_out`` / ``output`` sites, a forward pre-hook
    (with keyword arguments) for ``layer_in`` / ``input`` sites (the attention kernel's inputs
    through :func:`~interp_vllm.hooks.forward_pre_hook`, as the taps' own hooks do). The island
    never changes what the module returns or receives; what it does depends on when it runs:

    - under a breakable capture (``current()`` returns a capture whose ``_capturing`` is true):
      it calls ``capture.add_eager(body)``, where ``body`` runs the island over the tensors the
      hook sees, held through ``weak`` (vLLM's ``weak_ref_tensor``: a tensor over the same memory
      that does not keep the graph pool's block alive; the graph owns the block and its address
      is stable across replays). ``add_eager`` runs ``body`` once at capture (when the graph
      segments before it have been recorded, not run: vLLM captures with dummy batches, and the
      plan is empty then) and again at every replay of that graph, after the segments before it;
    - under a plain (unbreakable) CUDA graph capture (a FULL graph): nothing. No Python runs at a
      FULL graph's replay; a tap that ran now would be frozen into the graph. Its steps report
      the planned sites as missed (below);
    - otherwise (an eager step, or vLLM's graph mode is off): the body runs now.

    The body looks up the step's *plan*, ``{HookKey: tap}``, and runs the site's tap, if it has
    one, on the static tensors: ``tap(module, args, output)`` at a post site,
    ``tap(module, args, kwargs)`` at a pre site: the same callables, with the same signature and
    the same return values, that the TapManager registers as torch hooks where no island serves
    a site (:meth:`Hooks.tap <._hooks.Hooks.tap>`: ``_guarded(hook, _layer_out(hook))`` and so
    on). A
    tap that returns ``None`` changed nothing. A tap that returns a replacement (a new output,
    or new ``(args, kwargs)``) has its replaced tensors copied **into** the tensors they replace
    (``copy_``, after checking every pair's shape first, so a bad replacement changes nothing):
    ``_layer_out``'s ``(stream, zeros_like(residual))`` becomes ``hidden.copy_(stream)`` and
    ``residual.copy_(0)``, and the next segment's fused add-norm reads exactly ``stream``. Reads
    need nothing more: the taps copy their rows out (``_capture`` clones them). Rows are the
    step's: the static tensors are as long as the captured size (the step's tokens padded up),
    and each request's rows are where this step's :class:`~._runner.StepBatch` puts them, so one
    island captured once serves every later step, whatever requests and rows it has.

    A step with no plan costs one Python call and one dict lookup per island (plus, at replay, the
    graph launch each break adds: ``n`` islands make ``n + 1`` segments). The sites are fixed
    before capture because an island exists only where the capture met it; which of them a
    step uses is free. :func:`layer_sites` declares every layer's input and output (the residual
    stream kinds: ``embed``, ``resid_pre``, ``resid_post``); the sites inside a layer are
    declared by key as vllm-static declares its points (``("input", "attn_o_proj", L)`` for
    ``attn_z``, ``("output", "attn", L)`` for ``attn_out`` and ``resid_mid``, whose stash of
    ``resid_pre`` the layer's input island takes, ``("input", "mlp_down", L)`` for
    ``mlp_post``, the attention kernel's inputs). Islands at every layer's input and
    output are ``2 * layers`` breaks, half of them around an empty segment (nothing runs between
    a layer's output and the next layer's input); ``bench/gpu_breakable_taps.py`` measures what
    that costs against one full graph. An island at an ``input`` site writes into the tensor the
    module reads: declare one only where that tensor has no other reader (true of the sites named
    above).

    Errors are contained: the taps are ``_guarded`` already (a tap that raises marks its
    requests failed and returns ``None``); anything else a body raises (a tap that is not
    guarded, a replacement that does not fit) goes to the step's ``on_error(key, exc)`` and leaves
    the values as they were. Replay never raises out of an island.

Whether vLLM breaks its graphs at all is :func:`breakable_enabled` (the runner's config, else
``VLLM_USE_BREAKABLE_CUDAGRAPH``). The capture API is injected (:class:`Breakable`):
:func:`vllm_breakable` gives vLLM's own (``BreakableCUDAGraphCapture`` and ``weak_ref_tensor``,
looked up when called, for the vLLM releases :data:`BREAKABLE_CAPTURE` and
:data:`WEAK_REF_TENSOR` are written for); the unit tests (``tests/vllm/test_vllm_islands.py``)
and ``bench/gpu_breakable_taps.py --dry-run`` pass a fake whose "graph segments" are Python
closures.

The TapManager's step with islands
    :func:`~._manager.tap_manager` gives the TapManager an :class:`IslandSet` over
    :func:`layer_sites` of the layers its pipeline stage holds where :func:`breakable_enabled`
    says so (built by the seam's ``after_load``, before vLLM captures). A step then builds each
    site's function (:meth:`Hooks.tap <._hooks.Hooks.tap>`), hands them to :meth:`IslandSet.begin`,
    registers the ones no island serves as module hooks (:meth:`Hooks.register
    <._hooks.Hooks.register>`, through :meth:`IslandSet.marked`: they run only in an eager
    forward), and after the forward takes those hooks out and fails the requests of every site
    :meth:`IslandSet.end` reports as not run with a :class:`~interp_engine.BackendError` that
    says why (a FULL replay, an undeclared site, a site inside a compiled region): such a step
    answers with an error, never with nothing. ``model_out`` stays where it is (after the
    forward, on its output). Without islands the step registers every function as a module hook.

The V2 seam with islands
    The step itself must be driven
    from outside the model: at a breakable replay vLLM's ``CudaGraphManager.run_pw_graph(model,
    model_inputs)`` replays the captured segments without calling the model (and
    ``ModelCudaGraphManager.run_fullgraph(desc)`` replays a FULL graph), so hooks on the
    runner's model never fire there. Wrapping those two (``vllm/v1/worker/gpu/cudagraph_utils.py``,
    0.32 to 0.34) around the step -- open before, the output sent after -- keeps one step per
    forward; at capture the model is called inside ``run_pw_graph``, where the step is already
    open.

    The islands need the sites' Python to run while vLLM captures: a site inside a region
    vLLM compiles with ``torch.compile`` is traced once with no plan and then never runs (its
    steps report it missed). They belong where vLLM runs the layers uncompiled under its breakable graphs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .. import _compat
from ..hooks import forward_pre_hook
from ..model._sites import HookKey

Tap = Callable[[nn.Module, Any, Any], Any]
"""A step's function at a site: ``tap(module, args, output)`` at a post site,
``tap(module, args, kwargs)`` at a pre site, returning ``None`` or a replacement, exactly as a
torch forward hook / forward pre-hook (``with_kwargs=True``) does."""

OnError = Callable[[HookKey, Exception], None]
"""Told of anything an island's body raised (the values are left as they were)."""

PRE_SITES = ("layer_in", "input")
"""Where the island runs before the module (the other sites: after it)."""


class Capture(Protocol):
    """A breakable capture as the islands use it (vLLM's ``BreakableCUDAGraphCapture``)."""

    _capturing: bool

    def add_eager(self, fn: Callable[[], Any]) -> Any: ...


class CaptureApi(Protocol):
    """Where the active breakable capture is found (the class, whose ``current()`` is a classmethod)."""

    def current(self) -> Capture | None: ...


def _strong(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _cuda_capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class Breakable:
    """How islands meet the capture: ``api.current()``; ``weak(tensor)``, the reference an island
    keeps to a static tensor it will run on at replay; ``plain_capturing()``, whether a CUDA graph
    that cannot break is being captured now."""

    api: CaptureApi
    weak: Callable[[torch.Tensor], torch.Tensor] = _strong
    plain_capturing: Callable[[], bool] = _cuda_capturing


# -- what this reads of vLLM (its rows live in interp_vllm._compat, checked with the others) --------

BREAKABLE_CAPTURE = _compat.BREAKABLE_CAPTURE
WEAK_REF_TENSOR = _compat.WEAK_REF_TENSOR
BREAKABLE_CONFIG = _compat.BREAKABLE_CONFIG


def breakable_enabled(vllm_config: Any) -> bool:
    """Whether vLLM captures breakable CUDA graphs for this engine (``vllm_config``: the runner's):
    the compilation config's resolved ``use_breakable_cudagraph`` where it has one (0.34), else the
    ``VLLM_USE_BREAKABLE_CUDAGRAPH`` variable, as vLLM reads it."""
    resolved = getattr(getattr(vllm_config, "compilation_config", None), "use_breakable_cudagraph", None)
    if resolved is not None:
        return bool(resolved)
    return os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1"


def vllm_breakable() -> Breakable:
    """vLLM's breakable capture and weak tensor references, checked against the rows above.
    Raises :class:`IncompatibleDependency` for a vLLM they are not written for, or where they moved."""
    for row in (BREAKABLE_CAPTURE, WEAK_REF_TENSOR):
        if not row.in_range():
            raise row._error("the islands are not written for it")
    capture = BREAKABLE_CAPTURE.check()
    weak = getattr(WEAK_REF_TENSOR.check(), "weak_ref_tensor")  # noqa: B009 - the row names it
    return Breakable(api=capture, weak=weak, plain_capturing=_cuda_capturing)


# -- the sites ------------------------------------------------------------------------------------


def layer_sites(layers: Iterable[int], inputs: bool = True, outputs: bool = True) -> list[HookKey]:
    """Every given layer's input (``layer_in``) and output (``layer_out``) sites, in forward order."""
    keys: list[HookKey] = []
    for layer in layers:
        if inputs:
            keys.append(("layer_in", None, layer))
        if outputs:
            keys.append(("layer_out", None, layer))
    return keys


def is_pre(key: HookKey) -> bool:
    """Whether the site's island runs before its module (it sees ``(args, kwargs)``)."""
    return key[0] in PRE_SITES


class IslandError(RuntimeError):
    """A tap's replacement cannot be written into the static tensors it replaces."""


def _weakly(value: Any, weak: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return weak(value)
    if isinstance(value, tuple):
        return tuple(_weakly(v, weak) for v in value)
    if isinstance(value, list):
        return [_weakly(v, weak) for v in value]
    if isinstance(value, dict):
        return {k: _weakly(v, weak) for k, v in value.items()}
    return value


def _pairs(old: Any, new: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(static, replacement)`` for each tensor ``new`` replaces in ``old`` (element by element
    in tuples, lists and dicts). Raises :class:`IslandError` for a replacement that cannot be
    copied in place."""
    if new is old:
        return []
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise IslandError(f"a tensor replaced by {type(new).__name__}")
        if new.shape != old.shape:
            raise IslandError(f"a tensor of shape {tuple(old.shape)} replaced by one of shape {tuple(new.shape)}")
        return [(old, new)]
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)):
        if len(new) != len(old):
            raise IslandError(f"{len(old)} values replaced by {len(new)}")
        return [pair for o, n in zip(old, new, strict=True) for pair in _pairs(o, n)]
    if isinstance(old, dict) and isinstance(new, dict):
        if set(new) - set(old):
            raise IslandError(f"new arguments {sorted(set(new) - set(old))} cannot be added in place")
        return [pair for name, n in new.items() for pair in _pairs(old[name], n)]
    raise IslandError(f"a {type(old).__name__} replaced by a {type(new).__name__}: only tensors are replaced in place")


def _write_in_place(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each replacement into its static tensor (a replacement over memory that one of the
    static tensors shares is cloned first, so no copy reads what an earlier one wrote)."""
    statics = {old.untyped_storage().data_ptr() for old, _ in pairs}
    staged = []
    for old, new in pairs:
        if new.data_ptr() == old.data_ptr() and new.stride() == old.stride() and new.dtype == old.dtype:
            continue  # the tap wrote into the static tensor itself
        if new.untyped_storage().data_ptr() in statics:
            new = new.clone()
        staged.append((old, new))
    for old, new in staged:
        old.copy_(new)


class Island:
    """One site's island: its persistent hook and the body that runs the step's tap there."""

    def __init__(self, owner: IslandSet, key: HookKey, module: nn.Module) -> None:
        self.owner = owner
        self.key = key
        self.module = module
        self.pre = is_pre(key)
        self.captured = 0
        """Breakable captures that recorded this island (one per captured graph)."""
        self.sealed = 0
        """Plain (unbreakable) captures that met it: their replays never run it."""
        self.handle: Any = None

    def place(self) -> None:
        if self.handle is not None:
            return
        module = self.module
        if not self.pre:
            self.handle = module.register_forward_hook(self._post)
        elif self.key[1] == "attn_kernel":  # called through .forward by some backends (see _hooks.py)
            self.handle = forward_pre_hook(module, self._pre)
        else:
            self.handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    # -- the hook: what the module's call does (capture, or an eager step) -----------------------
    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._reached(args, output)

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._reached(args, kwargs)

    def _reached(self, args: Any, value: Any) -> None:
        breakable = self.owner.breakable
        capture = breakable.api.current()
        if capture is not None and capture._capturing:
            body = functools.partial(self.run, _weakly(args, breakable.weak), _weakly(value, breakable.weak))
            self.captured += 1
            capture.add_eager(body)
        elif breakable.plain_capturing():
            self.sealed += 1
        else:
            self.run(args, value)

    # -- the body: at capture, at each replay, and in eager steps --------------------------------
    def run(self, args: Any, value: Any) -> None:
        """The step's tap at this site over ``args`` and ``value`` (the output, or the keyword
        arguments at a pre site), its replacement written into them in place. Never raises."""
        owner = self.owner
        tap = owner.plan.get(self.key)
        if tap is None:
            return
        owner.ran.add(self.key)
        try:
            result = tap(self.module, args, value)
            if result is None:
                return
            if self.pre:
                new_args, new_kwargs = result if _is_args_kwargs(result) else (result, value)
                pairs = _pairs(args, new_args) + _pairs(value, new_kwargs)
            else:
                pairs = _pairs(value, result)
            _write_in_place(pairs)
        except Exception as exc:
            owner.on_error(self.key, exc)


def _is_args_kwargs(result: Any) -> bool:
    return isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)


def _ignore(key: HookKey, exc: Exception) -> None:
    return None


class IslandSet:
    """The islands of one model: declared over ``keys`` (each placed on ``module_of(key)``)
    before vLLM captures its graphs; each step's taps are handed over with :meth:`begin` and
    accounted for with :meth:`end`."""

    def __init__(
        self, keys: Iterable[HookKey], module_of: Callable[[HookKey], nn.Module], breakable: Breakable
    ) -> None:
        self.breakable = breakable
        self.islands: dict[HookKey, Island] = {}
        for key in keys:
            if key[0] == "model_out":
                raise ValueError("model_out is read after the forward, outside the graph: it needs no island")
            if key not in self.islands:
                self.islands[key] = Island(self, key, module_of(key))
        self.plan: dict[HookKey, Tap] = {}
        self.ran: set[HookKey] = set()
        self.expected: tuple[HookKey, ...] = ()
        self.on_error: OnError = _ignore

    def __contains__(self, key: object) -> bool:
        return key in self.islands

    def __len__(self) -> int:
        return len(self.islands)

    def place(self) -> IslandSet:
        """Put every island's hook on its module (idempotent): before vLLM captures its graphs."""
        for island in self.islands.values():
            island.place()
        return self

    def remove(self) -> None:
        """Take the hooks out (graphs captured with them still run their islands' bodies)."""
        for island in self.islands.values():
            island.remove()

    def begin(self, plan: Mapping[HookKey, Tap], on_error: OnError = _ignore) -> list[HookKey]:
        """The step's taps, from now until :meth:`end`: the islands run them, at capture, at each
        replay and in an eager forward. Returns the keys of ``plan`` that no island serves (the
        caller registers those as ordinary hooks, through :meth:`marked`, for an eager forward)."""
        self.plan = {key: tap for key, tap in plan.items() if key in self.islands}
        self.ran = set()
        self.expected = tuple(plan)
        self.on_error = on_error
        return [key for key in plan if key not in self.islands]

    def marked(self, key: HookKey, tap: Tap) -> Tap:
        """``tap``, recording that it ran (for a key registered as an ordinary hook)."""

        def ran(*args: Any) -> Any:
            self.ran.add(key)
            return tap(*args)

        return ran

    def end(self) -> list[HookKey]:
        """The step is over: the keys it planned whose tap did not run (a replayed graph without
        an island at the site: a FULL graph, or one captured before the site was declared).
        Replays after this run no tap until the next :meth:`begin`."""
        missed = [key for key in self.expected if key not in self.ran]
        self.plan, self.ran, self.expected, self.on_error = {}, set(), (), _ignore
        return missed

    def counts(self) -> dict[str, int]:
        """How many islands there are, and how often captures recorded or sealed them."""
        return {
            "islands": len(self.islands),
            "captured": sum(i.captured for i in self.islands.values()),
            "sealed": sum(i.sealed for i in self.islands.values()),
        }


__all__ = [
    "BREAKABLE_CAPTURE",
    "BREAKABLE_CONFIG",
    "WEAK_REF_TENSOR",
    "Breakable",
    "Capture",
    "CaptureApi",
    "Island",
    "IslandError",
    "IslandSet",
    "Tap",
    "breakable_enabled",
    "is_pre",
    "layer_sites",
    "vllm_breakable",
]
