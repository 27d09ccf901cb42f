"""Transcoder feature clamps inside vLLM's workers: read at the transcoder's input address, written
at its output address, the MLP's error term kept.

A transcoder replaces an MLP: it reads the MLP's input (``mlp_in.L`` or ``resid_mid.L``) and
reconstructs its output (``mlp_out.L``). With its features written back, the MLP's output is
``reconstruction + error`` with ``error = mlp_out - reconstruction``, which is ``mlp_out`` itself:
attaching a transcoder leaves the logits exactly the model's. A clamp of feature ``i`` to ``v``
changes only that feature's part of the reconstruction, so the output becomes
``mlp_out + (v - f_i(x)) d_i`` with ``x`` the input rows of the same tokens in the same forward and
``d_i`` the feature's decoder row (de-normalised as :meth:`Sae.feature_direction
<interp_engine.Sae.feature_direction>` gives it): what :meth:`FeatureWrite.apply
<interp_engine.FeatureWrite.apply>` computes on the eager backend.

- :class:`TranscoderMath`: that change as batched tensor work over rows (the dynamic ``vllm``
  worker's clamps: it keeps each clamped request's input rows at the input hook and applies the
  change at the output hook of the same step);
- :class:`StaticTranscoder`: a transcoder compiled into vllm-static's graph at its input address:
  it encodes every row for readouts (as :class:`~._math.StaticSae`) and, for the tokens the
  host marks before each step, computes the change into a buffer;
- :class:`StaticTranscoderOut`: the step at the output address that adds that buffer to the tokens
  it marks (every other token keeps its value bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from interp_engine import Sae

from ._math import SaeLayout, SaeMath, StaticSae


class TranscoderMath(SaeMath):
    """A transcoder's encoder (:class:`~._math.SaeMath`) with its decoder rows, for clamps at
    its output address read from its input rows."""

    def __init__(self, sae: Sae, device: torch.device | str, *, onednn: bool = False) -> None:
        if not (sae.is_transcoder and sae.has_decoder and sae.W_dec is not None):
            raise ValueError(f"{sae!r} is not a transcoder: its clamps are read and written at one address")
        super().__init__(sae, device, onednn=onednn)
        self.d_out = sae.d_out
        self.register_buffer("W_dec", sae.W_dec.detach().to(device, torch.float32).contiguous(), persistent=False)

    def change_rows(self, source: torch.Tensor, feature: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The change a clamp of feature ``feature[r]`` (``[n, 1]`` long) to ``value[r]`` makes at the
        output address, from the input rows ``source`` (``[n, d_in]``), computing only what the
        clamped features need (:meth:`~._math.SaeMath.current_rows`)."""
        _, current, denorm = self.current_rows(source, feature)
        return self.change(current, feature, value, denorm)

    def clamp_output(
        self, out: torch.Tensor, source: torch.Tensor, feature: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Output rows ``out`` (``[n, d_out]``) with the clamps applied: ``out + (value - f(source)) d``,
        float32."""
        return out.reshape(-1, self.d_out).float() + self.change_rows(source, feature, value)


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
