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

:class:`TranscoderMath` is that change as batched tensor work over rows (the dynamic ``vllm``
worker's clamps: it keeps each clamped request's input rows at the input hook and applies the
change at the output hook of the same step); vllm-static's compiled-in transcoders
(:class:`~interp_vllm.static._saes.StaticTranscoder`, ``StaticTranscoderOut``) compute it with
:class:`~._math.SaeMath`'s :meth:`~._math.SaeMath.change`.
"""

from __future__ import annotations

import torch

from interp_engine import Sae

from ._math import SaeMath


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
