"""Compiled islands (``interp_vllm.worker._compiled``) under torch.compile, with no engine.

A vLLM-shaped toy model (each layer takes ``(positions, hidden_states, residual)`` and returns
``(hidden, residual)``, the stream being their sum; layer 0 gets ``residual=None``) is compiled
with Inductor, as vLLM compiles its models, once with islands at every layer's input and output
and once without. The taps have the TapManager's form (``tap(module, args, output)`` /
``tap(module, args, kwargs)`` returning ``None`` or a replacement), set as the islands' plan
between forwards of the same compiled graph: what a compiled engine does from step to step.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from interp_vllm.hooks import arg_value, set_arg
from interp_vllm.worker._compiled import (
    ISLANDS_KEY,
    ISLANDS_LAYOUT,
    CompiledIslands,
    captures_graphs,
    compiles,
    islands_wanted,
    mark_config,
)
from interp_vllm.worker._islands import layer_sites

LAYERS, D = 3, 32
FAMILY = SimpleNamespace(hidden_arg=(1, "hidden_states"), residual_arg=(2, "residual"), deferred_residual=True)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states if residual is None else hidden_states + residual
        hidden = self.down(torch.nn.functional.gelu(self.up(self.norm(residual)))) * positions[:, None].float().cos()
        return hidden, residual


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual


class Reference(Model):
    """The same model under its own code object: Dynamo keeps one compiled graph per code object
    and does not guard on module hooks, so a compiled model with islands and one without must
    not share ``Model.forward``."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, x)


class Plain(Reference):
    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, x)


def _copies(seed: int = 0) -> tuple[Model, Model, Model]:
    torch.manual_seed(seed)
    tapped = Model().eval()
    reference, plain = Reference().eval(), Plain().eval()
    reference.load_state_dict(tapped.state_dict())
    plain.load_state_dict(tapped.state_dict())
    return reference, plain, tapped


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.arange(tokens), torch.randn(tokens, D, generator=gen)


def _islands(model: Model) -> CompiledIslands:
    keys = layer_sites(range(LAYERS))
    return CompiledIslands(keys, lambda key: model.layers[key[2]], FAMILY).place()  # type: ignore[arg-type]


def _reader(seen: list[torch.Tensor], rows: slice) -> Any:
    def post(module: nn.Module, args: Any, output: Any) -> None:
        seen.append((output[0] + output[1])[rows].clone())

    return post


def _adder(vector: torch.Tensor, rows: slice) -> Any:
    """A write at a layer's input, as ``_layer_in`` makes it: ``(stream, 0)`` with rows moved."""

    def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        hidden, residual = arg_value(args, kwargs, 1, "hidden_states"), arg_value(args, kwargs, 2, "residual")
        stream = hidden + residual if residual is not None else hidden.clone()
        stream[rows] += vector
        args, kwargs = set_arg(args, kwargs, 1, "hidden_states", stream)
        if residual is not None:
            args, kwargs = set_arg(args, kwargs, 2, "residual", torch.zeros_like(residual))
        return args, kwargs

    return pre


def _eager_hooks(model: Model, taps: dict[tuple[str, None, int], Any]) -> list[Any]:
    """The same taps as ordinary torch hooks on the uncompiled model (the reference)."""
    handles = []
    for (where, _, layer), tap in taps.items():
        module = model.layers[layer]
        if where == "layer_out":
            handles.append(module.register_forward_hook(tap))
        else:
            handles.append(module.register_forward_pre_hook(tap, with_kwargs=True))
    return handles


@pytest.fixture(scope="module")
def compiled() -> tuple[Model, Any, Any, CompiledIslands]:
    """An uncompiled reference, and the same weights compiled without and with islands."""
    reference, plain, tapped = _copies()
    islands = _islands(tapped)
    return reference, torch.compile(plain, dynamic=True), torch.compile(tapped, dynamic=True), islands


@torch.inference_mode()
def test_islands_with_no_plan_change_nothing_bit_for_bit(compiled: Any) -> None:
    _, plain, tapped, islands = compiled
    before = islands.fired()
    for tokens, seed in ((5, 0), (9, 1), (5, 2)):  # one compiled graph serves every length
        assert torch.equal(plain(*_inputs(tokens, seed)), tapped(*_inputs(tokens, seed)))
    assert islands.fired() - before == 3 * 2 * LAYERS  # every island's op ran in every compiled forward


@torch.inference_mode()
def test_the_compiled_graph_runs_each_steps_plan(compiled: Any) -> None:
    reference, plain, tapped, islands = compiled
    positions, x = _inputs(7, 3)
    rows = slice(2, 5)
    for step in range(2):  # the plan changes between forwards of the same graph
        vector = torch.linspace(-1, 1, D) * (step + 1)
        seen: list[torch.Tensor] = []
        assert (
            islands.begin({("layer_in", None, 1): _adder(vector, rows), ("layer_out", None, 2): _reader(seen, rows)})
            == []
        )
        out = tapped(positions, x.clone())  # a write at layer 1's input zeroes the residual: x itself here
        assert islands.end() == []
        expected_seen: list[torch.Tensor] = []
        handles = _eager_hooks(
            reference,
            {("layer_in", None, 1): _adder(vector, rows), ("layer_out", None, 2): _reader(expected_seen, rows)},
        )
        try:
            expected = reference(positions, x)
        finally:
            for handle in handles:
                handle.remove()
        untouched = plain(positions, x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert len(seen) == 1 and len(expected_seen) == 1
        torch.testing.assert_close(seen[0], expected_seen[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out[rows], untouched[rows])  # the write moved its rows
        assert torch.equal(out[:2], untouched[:2]) and torch.equal(out[5:], untouched[5:])  # and no others
    assert torch.equal(tapped(positions, x), plain(positions, x))  # after end(): no plan, nothing changes


def test_which_engines_get_compiled_islands() -> None:
    def config(mode: int, eager: bool = False, graphs: str = "NONE", extra: Any = None) -> Any:
        return SimpleNamespace(
            compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=SimpleNamespace(name=graphs)),
            model_config=SimpleNamespace(enforce_eager=eager),
            additional_config={} if extra is None else extra,
        )

    assert compiles(config(2)) and compiles(config(3))
    assert not compiles(config(0)) and not compiles(config(1)) and not compiles(config(2, eager=True))
    assert captures_graphs(config(3, graphs="PIECEWISE")) and not captures_graphs(config(3))
    assert islands_wanted(config(2)) and not islands_wanted(config(3, graphs="FULL_AND_PIECEWISE"))
    marked = config(2, extra={"other": 1})
    mark_config(marked)
    assert marked.additional_config == {"other": 1, ISLANDS_KEY: ISLANDS_LAYOUT}


def test_the_islands_change_vllms_compile_cache_key() -> None:
    """vLLM's compile caches are keyed by ``VllmConfig.compute_hash()``: it covers the mark."""
    from vllm.config import VllmConfig  # the vLLM folders never run without vLLM

    config = VllmConfig()
    before = config.compute_hash()
    mark_config(config)
    assert config.additional_config == {ISLANDS_KEY: ISLANDS_LAYOUT}
    assert config.compute_hash() != before
