"""Taps and writes made only of tensors, for compiled graphs and CUDA graphs (vllm-static).

A compiled graph (torch.compile, CUDA graph capture) freezes Python control flow at trace time,
so everything that changes per request must live in tensors the host fills before each step:

- :class:`StaticTap` copies the rows it sees into a fixed buffer (``max_tokens x width``),
  allocated before compilation; after the step the host reads each request's real rows.
- :class:`StaticWrites` applies per-token writes from slot tables: token ``t`` uses slot
  ``index[t]``, and ``x' = x * keep[s] - ablate[s] * (x . u[s]) u[s] + shift[s]``. Slot 0 is the
  identity (``keep=1``, everything else 0), so an unsteered token is returned bit for bit;
  ``add`` is a shift, ``set`` is ``keep=0`` plus a shift, ``ablate`` a unit direction and scale.

Both are ``nn.Module`` s whose ``forward`` is pure tensor work: the same objects serve vLLM's
compiled runner and ``bench/gpu_static_taps.py`` (an HF model under ``torch.cuda.CUDAGraph``).
The host side (:meth:`StaticWrites.assign`, :meth:`StaticWrites.clear`) runs between steps.
"""

from __future__ import annotations

import torch
from torch import nn

from interp_engine import InvalidSteering, Write


class StaticTap(nn.Module):
    """A fixed capture buffer: ``forward(x)`` copies ``x``'s rows in and returns ``x`` untouched."""

    buffer: torch.Tensor

    def __init__(self, max_tokens: int, width: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("buffer", torch.zeros(max_tokens, width, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        self.buffer[: rows.shape[0]].copy_(rows)
        return x

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the last step, as a float32 CPU copy."""
        return self.buffer[start:end].to("cpu", torch.float32, copy=True)


class StaticWrites(nn.Module):
    """Per-token writes at one site from slot tables (slot 0 = no write)."""

    keep: torch.Tensor
    shift: torch.Tensor
    direction: torch.Tensor
    ablate: torch.Tensor
    index: torch.Tensor

    def __init__(
        self, slots: int, width: int, max_tokens: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        if slots < 2:
            raise ValueError("a write table needs slot 0 (identity) and at least one more")
        self.slots, self.width = slots, width
        self.register_buffer("keep", torch.ones(slots, dtype=dtype, device=device), persistent=False)
        self.register_buffer("shift", torch.zeros(slots, width, dtype=dtype, device=device), persistent=False)
        self.register_buffer("direction", torch.zeros(slots, width, dtype=dtype, device=device), persistent=False)
        self.register_buffer("ablate", torch.zeros(slots, dtype=dtype, device=device), persistent=False)
        self.register_buffer("index", torch.zeros(max_tokens, dtype=torch.long, device=device), persistent=False)
        self._next = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        slot = self.index[: rows.shape[0]]
        unit = self.direction[slot]
        projection = (rows * unit).sum(-1, keepdim=True)
        out = rows * self.keep[slot].unsqueeze(-1) - (self.ablate[slot].unsqueeze(-1) * projection) * unit
        return (out + self.shift[slot]).reshape(x.shape)

    # -- host side, between steps -----------------------------------------------------------
    def clear(self) -> None:
        """Every token back to slot 0 and every slot free (call before filling a step)."""
        self.index.zero_()
        self.keep[1:] = 1
        self.shift[1:] = 0
        self.direction[1:] = 0
        self.ablate[1:] = 0
        self._next = 1

    def assign(self, write: Write, rows: torch.Tensor, vector_rows: torch.Tensor | None = None) -> None:
        """Point token ``rows`` of this step at ``write``; ``vector_rows[i]`` picks the row of a
        ``[n, width]`` vector for ``rows[i]`` (one slot per distinct row)."""
        vector = write.vector
        if vector.shape[-1] != self.width:
            raise InvalidSteering(f"the vector for {write.address} has width {vector.shape[-1]}, not {self.width}")
        if vector.dim() == 2:
            if vector_rows is None:
                raise InvalidSteering("a [n, width] write needs the vector row of each token")
            distinct, inverse = torch.unique(vector_rows, return_inverse=True)
            slots = self._take(len(distinct))
            for slot, row in zip(slots, distinct.tolist(), strict=True):
                self._fill(slot, write, vector[row])
            self.index[rows.to(self.index.device)] = torch.tensor(slots, device=self.index.device)[
                inverse.to(self.index.device)
            ]
            return
        (slot,) = self._take(1)
        self._fill(slot, write, vector)
        self.index[rows.to(self.index.device)] = slot

    def _take(self, count: int) -> list[int]:
        if self._next + count > self.slots:
            raise InvalidSteering(
                f"this step needs more than the {self.slots - 1} steering slots declared for the site"
            )
        taken = list(range(self._next, self._next + count))
        self._next += count
        return taken

    def _fill(self, slot: int, write: Write, vector: torch.Tensor) -> None:
        vector = vector.to(device=self.shift.device, dtype=self.shift.dtype)
        if write.op == "add":
            self.shift[slot] = write.scale * vector
        elif write.op == "set":
            self.keep[slot] = 0
            self.shift[slot] = write.scale * vector
        else:
            self.direction[slot] = vector / vector.norm()
            self.ablate[slot] = write.scale
