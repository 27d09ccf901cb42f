"""SAEs and transcoders compiled into vllm-static's graph, at their addresses' hooks.

- :class:`StaticSae`: one SAE inside the compiled graph: it keeps each step's top features (and
  the error norm, and every feature of a small dictionary) in buffers the host reads after the
  step, and applies the per-token feature clamps the host fills before it;
- :class:`StaticTranscoder`: a transcoder at its input address: it encodes every row for
  readouts (as :class:`StaticSae`) and, for the tokens the host marks before each step, computes
  the change of their clamps into a buffer;
- :class:`StaticTranscoderOut`: the step at the output address that adds that buffer to the tokens
  it marks (every other token keeps its value bit for bit).

Their math is the workers' shared :class:`~interp_vllm.sae._math.SaeMath`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from interp_engine import FeatureReadout, Features, Sae

from ..sae._math import SaeLayout, SaeMath, pick


class StaticSae(SaeMath):
    """One SAE (or probe, or transcoder) inside the compiled graph, at its address's hook.

    ``forward(x)`` encodes every row of the step (:class:`SaeMath`) and keeps the step's sorted
    top ``layout.width`` ids and values, the reconstruction error norm (SAEs with a decoder back
    to their input) and, for a small dictionary, every feature, in buffers sized ``max_tokens``;
    the host reads a request's rows after the step (:meth:`readout`). With ``clamps`` it also
    applies per-token feature clamps, one ``(feature, value)`` per token from buffers the host
    fills before each step (:meth:`set_clamps`); tokens without a clamp get ``x`` back (a
    ``where``), bit for bit.
    """

    values: torch.Tensor
    ids: torch.Tensor
    error_norm: torch.Tensor
    dense: torch.Tensor
    clamp_on: torch.Tensor
    clamp_feature: torch.Tensor
    clamp_value: torch.Tensor

    def __init__(
        self,
        sae: Sae,
        layout: SaeLayout,
        max_tokens: int,
        *,
        clamps: bool,
        device: torch.device | str,
        onednn: bool = False,
    ) -> None:
        super().__init__(sae, device, onednn=onednn)
        self.layout = layout
        self.clamps = clamps and self.has_error
        if clamps and not self.clamps:
            raise ValueError(f"{sae!r} has no decoder back to its input: it cannot clamp features")

        self._buffer("values", device, max_tokens, layout.width)
        self._buffer("ids", device, max_tokens, layout.width, dtype=torch.long)
        if self.has_error:
            self._buffer("error_norm", device, max_tokens)
        if layout.dense:
            self._buffer("dense", device, max_tokens, self.d_sae)
        if self.clamps:
            self._clamp_buffers(device, max_tokens)
        self._dirty = 0  # clamp rows [0, _dirty) may be set

    def _buffer(self, name: str, device: torch.device | str, *shape: int, dtype: torch.dtype = torch.float32) -> None:
        self.register_buffer(name, torch.zeros(*shape, dtype=dtype, device=device), persistent=False)

    def _clamp_buffers(self, device: torch.device | str, max_tokens: int) -> None:
        """The per-token clamps :meth:`set_clamps` fills: whether, which feature, what value."""
        self._buffer("clamp_on", device, max_tokens, dtype=torch.bool)
        self._buffer("clamp_feature", device, max_tokens, dtype=torch.long)
        self._buffer("clamp_value", device, max_tokens)

    # -- in-graph: tensor work only ------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.d_in)
        n = rows.shape[0]
        width = self.layout.width
        enc = self.encode(rows, width, dense=self.layout.dense)
        self.values[:n].copy_(enc.top[:, :width])
        self.ids[:n].copy_(enc.ids[:, :width])
        if enc.features is not None and self.layout.dense:
            self.dense[:n].copy_(enc.features)
        if self.has_error:
            self.error_norm[:n].copy_(self.error(enc))
        if not self.clamps:
            return x
        on = self.clamp_on[:n].unsqueeze(-1)
        out = self.clamp(enc, self.clamp_feature[:n].unsqueeze(-1), self.clamp_value[:n].unsqueeze(-1))
        return torch.where(on, out.to(x.dtype), rows).reshape(x.shape)

    def steered(self, n: int) -> torch.Tensor:
        """``[n, 1]`` bool: which of this step's first ``n`` tokens get a clamp (in-graph)."""
        return self.clamp_on[:n].unsqueeze(-1)

    # -- host side, between steps --------------------------------------------------------------
    def set_clamps(self, clamps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """This step's clamps: per token ``(on, feature, value)`` (``None``: no token is clamped)."""
        n = 0 if clamps is None else int(clamps[0].shape[0])
        if clamps is not None and n:
            on, feature, value = clamps
            self.clamp_on[:n].copy_(on, non_blocking=True)
            self.clamp_feature[:n].copy_(feature, non_blocking=True)
            self.clamp_value[:n].copy_(value, non_blocking=True)
        if self._dirty > n:
            self.clamp_on[n : self._dirty].zero_()
        self._dirty = n

    def readout(self, rows: torch.Tensor, specs: Sequence[Features]) -> dict[Features, FeatureReadout]:
        """Each of ``specs`` over ``rows`` (indices into the last step's tokens), float32 on the
        CPU, as :func:`~interp_engine.sae._readouts.read_features` gives them: one read of the
        buffers for all of them."""
        rows = rows.to(self.values.device)
        values = self.values[rows].to("cpu")
        ids = self.ids[rows].to("cpu")
        error = self.error_norm[rows].to("cpu") if self.has_error else None
        dense = self.dense[rows].to("cpu") if self.layout.dense else None
        return {
            spec: pick(spec, self.layout, self.d_sae, self.sparse, values, ids, error, dense)
            for spec in dict.fromkeys(specs)
        }


class StaticTranscoder(StaticSae):
    """A transcoder inside vllm-static's compiled graph, at its input address.

    Its forward encodes every row of the step and keeps the readout buffers of
    :class:`~._math.StaticSae`; with ``clamps`` it also computes, for the tokens the host
    marked (:meth:`~._math.StaticSae.set_clamps`: one ``(feature, value)`` per token), the
    change ``(value - f(x)) d`` into :attr:`delta` (zero elsewhere), and hands ``x`` back unchanged:
    the change is added at the output address by a :class:`StaticTranscoderOut`."""

    delta: torch.Tensor

    def __init__(
        self,
        sae: Sae,
        layout: SaeLayout,
        max_tokens: int,
        *,
        clamps: bool,
        device: torch.device | str,
        onednn: bool = False,
    ) -> None:
        if not (sae.is_transcoder and sae.has_decoder and sae.W_dec is not None):
            raise ValueError(f"{sae!r} is not a transcoder")
        super().__init__(sae, layout, max_tokens, clamps=False, device=device, onednn=onednn)
        self.d_out = sae.d_out
        self.clamps = clamps
        if clamps:
            self.register_buffer("W_dec", sae.W_dec.detach().to(device, torch.float32).contiguous(), persistent=False)
            self._clamp_buffers(device, max_tokens)
            self._buffer("delta", device, max_tokens, sae.d_out)

    # -- in-graph: tensor work only ------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.d_in)
        n = rows.shape[0]
        width = self.layout.width
        enc = self.encode(rows, width, dense=self.layout.dense)
        self.values[:n].copy_(enc.top[:, :width])
        self.ids[:n].copy_(enc.ids[:, :width])
        if enc.features is not None and self.layout.dense:
            self.dense[:n].copy_(enc.features)
        if self.clamps:
            on = self.clamp_on[:n].unsqueeze(-1)
            feature = self.clamp_feature[:n].unsqueeze(-1)
            delta = self.change(self.current(enc, feature), feature, self.clamp_value[:n].unsqueeze(-1), enc.denorm)
            self.delta[:n].copy_(torch.where(on, delta, torch.zeros_like(delta)))
        return x

    def add_change(self, x: torch.Tensor) -> torch.Tensor:
        """Output rows ``x`` with this step's change added to the marked tokens (in-graph)."""
        rows = x.reshape(-1, self.d_out)
        n = rows.shape[0]
        on = self.clamp_on[:n].unsqueeze(-1)
        out = (rows.float() + self.delta[:n]).to(x.dtype)
        return torch.where(on, out, rows).reshape(x.shape)


class StaticTranscoderOut(nn.Module):
    """The output-address step of a :class:`StaticTranscoder`'s clamps: its change added to the
    tokens it marked this step. Registered on the module hooked at the output address (the
    transcoder a submodule of both hooked modules, so the graph reads the buffers it wrote)."""

    def __init__(self, transcoder: StaticTranscoder) -> None:
        super().__init__()
        if not transcoder.clamps:
            raise ValueError("a transcoder compiled in without clamps has no output step")
        self.transcoder = transcoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transcoder.add_change(x)

    def steered(self, n: int) -> torch.Tensor:
        """``[n, 1]`` bool: which of this step's first ``n`` tokens get a clamp (in-graph)."""
        return self.transcoder.steered(n)
