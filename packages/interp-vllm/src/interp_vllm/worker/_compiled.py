"""Per-request taps on an engine vLLM compiles (``enforce_eager=False``, vLLM's default).

vLLM traces the model once with Dynamo and compiles it with Inductor; the compiled graph skips
Dynamo's guards, so Python in a torch hook is frozen at trace time (a hook added later never
runs, a branch on per-step state is taken once). Two things serve per-request taps there:

Islands at every layer's input and output
    Right after the model is loaded (before vLLM compiles it), every layer of this pipeline stage
    gets a persistent hook at its input and its output (:func:`~._islands.layer_sites`: where
    ``embed``, ``resid_pre`` and ``resid_post`` live, and so the lens, and SAE readouts and
    clamps at those kinds). While Dynamo traces, the hook calls a ``torch.library`` custom op,
    ``interp_vllm::island`` (or ``island_pair`` where the layer passes a deferred residual), that
    declares the layer's hidden (and residual) tensors mutated and has a fake implementation
    that does nothing: the graph keeps it as one opaque node that Inductor calls at run time, so
    its Python body runs at every compiled forward and sees the step's state. The body is the
    island's (:meth:`~._islands.Island.run`): it looks up the step's plan and runs the site's tap
    there, the same function a module hook runs in an uncompiled forward, its replacement copied
    into the tensors in place. With no plan it returns after one dict lookup and touches
    nothing, so a step no request taps computes what the compiled model computes without the
    islands, bit for bit (Inductor re-inplaces the op's mutations: no copies are added).

An uncompiled forward for steps that need more
    A step whose requests tap a site no island serves (inside a layer: ``attn_z``, ``mlp_pre``,
    attention patterns, ...) runs vLLM's uncompiled forward, where module hooks run
    (:func:`interp_vllm._compat.uncompiled_forward`: vLLM's own per-step ``skip_compiled``
    switch); its islands run eagerly there too. Steps with no such request stay compiled.

The compile cache
    vLLM keys its compile caches (Inductor's, and its own AOT artifacts) by
    ``VllmConfig.compute_hash()``, which covers ``additional_config``. :func:`mark_config` adds
    :data:`ISLANDS_KEY` there (in the worker, before the first compile), so a graph compiled
    without the islands (by a vLLM without this plugin, or an older island layout) is never
    loaded for an engine that has them, nor the other way round.

Where this applies (:func:`islands_wanted`): an engine that compiles and captures no CUDA
graphs (vLLM's CPU platform). Under CUDA graphs the op would be recorded into the graph and its
Python would not run at replay: there the breakable graphs' islands (:mod:`._islands`) serve
the taps, and elsewhere the front end's default stays ``enforce_eager``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..hooks import arg_value
from ..model._families import VllmFamily
from ..model._sites import HookKey
from ._islands import Breakable, Island, IslandSet

ISLANDS_KEY = "interp_engine_islands"
"""The ``additional_config`` entry naming the islands compiled into the graph (part of vLLM's
compile-cache key)."""

ISLANDS_LAYOUT = "layer-io/1"
"""What the islands are: an op at every layer's input and output, this version of the op."""

_COMPILED_MODES = (2, 3)
"""vLLM's ``CompilationMode`` values under which its model decorator compiles the model
(``DYNAMO_TRACE_ONCE``, ``VLLM_COMPILE``; ``NONE`` and ``STOCK_TORCH_COMPILE`` do not)."""

_REGISTRY: list[CompiledIsland] = []
"""Every compiled island of this process, by its index (the op's ``site`` argument)."""


def compiles(vllm_config: Any) -> bool:
    """Whether vLLM compiles the model of an engine with this config."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "mode", None)
    if mode is None or int(mode) not in _COMPILED_MODES:
        return False
    return not getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False)


def captures_graphs(vllm_config: Any) -> bool:
    """Whether vLLM captures CUDA graphs for this engine (never on its CPU platform)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def islands_wanted(vllm_config: Any) -> bool:
    """Whether the taps place compiled islands on this engine's model (:mod:`this module <.>`)."""
    return compiles(vllm_config) and not captures_graphs(vllm_config)


def mark_config(vllm_config: Any) -> None:
    """Name the islands in the engine's ``additional_config`` (this process's copy), so vLLM's
    compile-cache key covers them (call before vLLM compiles)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        extra[ISLANDS_KEY] = ISLANDS_LAYOUT


@torch.library.custom_op("interp_vllm::island", mutates_args=("hidden",))
def _island(hidden: torch.Tensor, site: int, layout: int) -> None:
    _REGISTRY[site].fire((hidden,), layout)


@_island.register_fake
def _island_fake(hidden: torch.Tensor, site: int, layout: int) -> None:
    return None


@torch.library.custom_op("interp_vllm::island_pair", mutates_args=("hidden", "residual"))
def _island_pair(hidden: torch.Tensor, residual: torch.Tensor, site: int, layout: int) -> None:
    _REGISTRY[site].fire((hidden, residual), layout)


@_island_pair.register_fake
def _island_pair_fake(hidden: torch.Tensor, residual: torch.Tensor, site: int, layout: int) -> None:
    return None


TENSOR, TUPLE = 0, 1
"""How a layer's output came (the op's ``layout`` at a post site): one tensor, or a tuple whose
first one or two elements are the tensors passed."""


class CompiledIsland(Island):
    """An island whose hook, while Dynamo traces, puts the island op into the graph; run
    eagerly (an uncompiled forward) it runs the step's tap directly."""

    def __init__(self, owner: IslandSet, key: HookKey, module: nn.Module, family: VllmFamily) -> None:
        super().__init__(owner, key, module)
        self.family = family
        self.index = len(_REGISTRY)
        self.fired = 0
        """How many compiled forwards ran this island's op."""
        _REGISTRY.append(self)

    def _reached(self, args: Any, value: Any) -> None:
        if not torch.compiler.is_compiling():
            self.run(args, value)
            return
        if self.pre:  # the layer's hidden-states argument and, where it defers the add, its residual
            hidden = arg_value(args, value, *self.family.hidden_arg)
            at = self.family.residual_arg
            residual = arg_value(args, value, *at) if at is not None else None
            layout = TENSOR
        else:
            hidden = value[0] if isinstance(value, tuple) else value
            residual = value[1] if isinstance(value, tuple) and self.family.deferred_residual else None
            layout = TUPLE if isinstance(value, tuple) else TENSOR
        if residual is None:
            torch.ops.interp_vllm.island(hidden, self.index, layout)
        else:
            torch.ops.interp_vllm.island_pair(hidden, residual, self.index, layout)

    def fire(self, tensors: tuple[torch.Tensor, ...], layout: int) -> None:
        """The op's body: the step's tap over the layer's tensors, rebuilt as the hook saw them."""
        self.fired += 1
        if self.key not in self.owner.plan:
            return
        if self.pre:
            kwargs = {self.family.hidden_arg[1]: tensors[0]}
            if len(tensors) > 1 and self.family.residual_arg is not None:
                kwargs[self.family.residual_arg[1]] = tensors[1]
            self.run((), kwargs)
        else:
            self.run((), tensors if layout == TUPLE else tensors[0])


class CompiledIslands(IslandSet):
    """The compiled islands of one model (:class:`CompiledIsland` at each of ``keys``)."""

    def __init__(self, keys: Iterable[HookKey], module_of: Any, family: VllmFamily) -> None:
        super().__init__((), module_of, Breakable(api=_NoCapture()))
        for key in keys:
            if key not in self.islands:
                self.islands[key] = CompiledIsland(self, key, module_of(key), family)

    def fired(self) -> int:
        """How many island ops compiled forwards have run (all islands together)."""
        return sum(island.fired for island in self.islands.values() if isinstance(island, CompiledIsland))

    def counts(self) -> dict[str, int]:
        """How many islands there are and how often compiled forwards ran their ops (``fired``)."""
        return {**super().counts(), "fired": self.fired()}


class _NoCapture:
    """No breakable capture is ever active for compiled islands."""

    def current(self) -> None:
        return None


__all__ = [
    "ISLANDS_KEY",
    "ISLANDS_LAYOUT",
    "CompiledIsland",
    "CompiledIslands",
    "captures_graphs",
    "compiles",
    "islands_wanted",
    "mark_config",
]
