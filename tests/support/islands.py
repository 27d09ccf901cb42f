"""A vLLM-shaped toy model and a fake breakable CUDA graph capture, with no engine and no GPU, for
the tests of ``interp_vllm.worker._islands``.

While a capture records, the model's "kernels" are recorded, not run (as a CUDA stream capture
records them), into graph segments that are closures over the tensors allocated during capture;
``add_eager`` ends a segment, runs its function and starts the next; replay runs the list. Each
decoder layer takes ``(positions, hidden_states=, residual=)`` and returns ``(hidden, residual)``
with the residual add deferred to the next layer, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

T, D, LAYERS = 12, 16, 4

# -- a fake breakable capture, and the model's kernels -------------------------------------------

_RECORDER: list[Any] = []
"""The capture recording kernels right now (empty: kernels run)."""


def launch(kernel: Callable[[], None]) -> None:
    """A kernel launch: recorded while a capture records, run otherwise."""
    if _RECORDER:
        _RECORDER[-1].record(kernel)
    else:
        kernel()


class ClosureCapture:
    """``BreakableCUDAGraphCapture``'s protocol, with closures for CUDA graphs."""

    _active: ClassVar[ClosureCapture | None] = None

    @classmethod
    def current(cls) -> ClosureCapture | None:
        return cls._active

    def __init__(self) -> None:
        self.segments: list[Callable[[], Any]] = []
        self.kinds: list[str] = []
        self._kernels: list[Callable[[], None]] = []
        self._capturing = False

    def __enter__(self) -> ClosureCapture:
        ClosureCapture._active = self
        self._begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._end()
        ClosureCapture._active = None

    def _begin(self) -> None:
        self._kernels = []
        self._capturing = True
        _RECORDER.append(self)

    def _end(self) -> None:
        _RECORDER.remove(self)
        kernels = tuple(self._kernels)

        def graph() -> None:
            for kernel in kernels:
                kernel()

        self.segments.append(graph)
        self.kinds.append("graph")
        self._capturing = False

    def record(self, kernel: Callable[[], None]) -> None:
        assert self._capturing
        self._kernels.append(kernel)

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        self._end()
        result = fn()
        self.segments.append(fn)
        self.kinds.append("eager")
        self._begin()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()


class PlainCapture:
    """A graph that cannot break (vLLM's FULL graphs): one segment, islands sealed inside."""

    capturing = False

    def __init__(self) -> None:
        self.kernels: list[Callable[[], None]] = []

    def __enter__(self) -> PlainCapture:
        PlainCapture.capturing = True
        _RECORDER.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _RECORDER.remove(self)
        PlainCapture.capturing = False

    def record(self, kernel: Callable[[], None]) -> None:
        self.kernels.append(kernel)

    def replay(self) -> None:
        for kernel in self.kernels:
            kernel()


class Layer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(D, D, generator=gen) / D**0.5, requires_grad=False)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_h, out_r = torch.empty_like(hidden_states), torch.empty_like(hidden_states)
        weight = self.weight

        def kernel() -> None:
            if residual is None:
                out_r.copy_(hidden_states)
            else:
                torch.add(hidden_states, residual, out=out_r)
            torch.matmul(torch.tanh(out_r) + positions[:, None] * 0.01, weight, out=out_h)

        launch(kernel)
        return out_h, out_r


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(seed) for seed in range(LAYERS))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden_states=hidden, residual=residual)
        assert residual is not None
        out = torch.empty_like(x)

        def final(hidden: torch.Tensor = hidden, residual: torch.Tensor = residual) -> None:
            torch.tanh(hidden + residual, out=out)

        launch(final)
        return out


def inputs(seed: int) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def vec(seed: int) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(100 + seed))
