"""SAEs inside vLLM's workers as batched tensor work, for the dynamic workers and vllm-static.

- :class:`SaeMath`: an SAE's encoder, reconstruction error and feature clamp as batched tensor
  work, equal to :class:`~interp_engine.Sae`'s to float32 rounding (the dynamic workers' encoder,
  and the base of vllm-static's compiled-in SAE, :class:`~interp_vllm.static._saes.StaticSae`);
- :class:`SaeLayout`: what a compiled-in SAE keeps of each token, and why a readout cannot be
  served from that; :func:`pick` takes a readout out of what an encode kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from interp_engine import FeatureReadout, Features, InvalidFeatures, Sae
from interp_engine.backend import select_features

from .. import _compat


@dataclass(frozen=True)
class SaeLayout:
    """What a compiled-in SAE keeps of each token: the ``width`` largest features (sorted,
    ids and values), its reconstruction error norm, and, for a small dictionary, every feature.

    ``complete``: every feature that can fire is among the kept ones (a TopK SAE whose ``k`` is
    at most the declared width, or a dictionary no wider than it), so a top-k of any size is
    served. ``dense``: every feature is kept (``d_sae <= dense_max``), so ``ids=`` and ``dense``
    readouts are served too."""

    width: int
    complete: bool
    dense: bool

    @classmethod
    def of(cls, sae: Sae, top_k: int, dense_max: int) -> SaeLayout:
        if sae.k is not None:  # TopK: at most k features fire, and topk(pre, k) finds them
            return cls(min(top_k, sae.k), sae.k <= top_k, sae.d_sae <= dense_max)
        return cls(min(top_k, sae.d_sae), sae.d_sae <= top_k, sae.d_sae <= dense_max)

    def refusal(self, spec: Features, d_sae: int) -> str | None:
        """Why ``spec`` cannot be served from what is kept (``None``: it can)."""
        if spec.top_k is not None and (spec.width(d_sae) <= self.width or self.complete or self.dense):
            return None
        if spec.top_k is None and self.dense:
            return None
        kept = f"the top {self.width} features per token" + (" (every feature that can fire)" if self.complete else "")
        if spec.top_k is not None:
            fix = "load the model with a larger static_sae_top_k"
        else:
            fix = "ids= and dense readouts need static_sae_dense_max >= d_sae"
        return (
            f"vllm-static encodes {spec.sae!r} ({d_sae} features) in the compiled graph and keeps {kept}; "
            f"{spec} asks for more: {fix}, or use the vllm backend (which encodes per request)"
        )


_PROBE_ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda t: t,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


READ_BLOCK_BYTES = 8 << 20
"""How many bytes of pre-activations :meth:`SaeMath.read` encodes at a time."""

SAMPLE_FRACTION = 8
"""A TopK clamp's membership pre-check encodes ``1 / SAMPLE_FRACTION`` of the features (at least
``2 k``): :meth:`SaeMath.clamp_rows`."""


@dataclass
class Encoded:
    """One batch of rows through an SAE's encoder (:meth:`SaeMath.encode`)."""

    x: torch.Tensor  # [n, d_in] float32
    pre: torch.Tensor  # [n, d_sae] pre-activations
    top: torch.Tensor  # [n, w] the largest features, sorted (TopK: its k features, relu'd)
    ids: torch.Tensor  # [n, w] their ids
    features: torch.Tensor | None  # [n, d_sae] every feature (when asked for; always for non-TopK)
    denorm: tuple[Any, Any, Any]  # (mul, div, add) of the output de-normalisation


class SaeMath(nn.Module):
    """An SAE's encoder, reconstruction error and feature clamp as batched tensor work, equal to
    :class:`~interp_engine.Sae`'s (:func:`~interp_engine.sae._readouts.read_features`,
    :meth:`FeatureWrite.apply <interp_engine.FeatureWrite.apply>`) to float32 rounding, with its
    weights as float32 buffers on one device. Pure tensor work: traceable into a compiled graph.

    TopK SAEs never build the dense feature matrix unless asked: the top ``k`` pre-activations
    are the features, and the reconstruction is the sum of their ``k`` decoder rows
    (``embedding_bag``) instead of a ``[n, d_sae] x [d_sae, d]`` product.

    ``onednn``: on a CPU inside vLLM, the encoder's product runs through vLLM's own oneDNN
    matmul (what its CPU linear layers use; float32, prepacked weights), about twice as fast
    as ``torch.addmm`` on the benchmark machine; elsewhere, and if vLLM lacks it, ``addmm``."""

    W_enc: torch.Tensor
    W_sample: torch.Tensor
    b_sample: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor
    dec_norm: torch.Tensor

    def __init__(self, sae: Sae, device: torch.device | str, *, onednn: bool = False) -> None:
        super().__init__()
        self.d_in, self.d_sae = sae.d_in, sae.d_sae
        self.architecture = sae.architecture
        self.k = sae.k
        self.activation = sae.activation
        self.normalize = sae.normalize_activations
        self.factor = float(sae.norm_scaling_factor or 1.0)
        self.b_dec_in = sae.apply_b_dec_to_input
        self.rescale = sae.rescale_acts_by_decoder_norm
        self.transcoder = sae.is_transcoder
        self.sparse = sae.architecture != "probe"
        self.has_error = sae.has_decoder and not sae.is_transcoder
        """Whether it reconstructs its own input: error norms, and feature clamps."""

        def keep(name: str, tensor: torch.Tensor | None) -> None:
            if tensor is not None:
                self.register_buffer(name, tensor.detach().to(device, torch.float32).contiguous(), persistent=False)

        keep("W_enc", sae.W_enc)
        keep("b_enc", sae.b_enc)
        keep("threshold", sae.threshold)
        if self.has_error:
            keep("W_dec", sae.W_dec)
        keep("b_dec", sae.b_dec if self.has_error or self.b_dec_in else None)
        if self.rescale and sae.W_dec is not None:
            keep("dec_norm", sae.W_dec.float().norm(dim=-1))
        self._onednn: tuple[Any, Any] | None = None  # (vLLM's ops module, the prepacked W_enc)
        if onednn and torch.device(device).type == "cpu":
            self._onednn = _compat.onednn_matmul(self.W_enc)
        self.sample = 0
        """How many features (the first ones) a TopK clamp's membership pre-check encodes; 0: none."""
        if self.k is not None and max(2 * self.k, self.d_sae // SAMPLE_FRACTION) < self.d_sae:
            self.sample = max(2 * self.k, self.d_sae // SAMPLE_FRACTION)
            keep("W_sample", self.W_enc[:, : self.sample])
            keep("b_sample", self.b_enc[: self.sample])
        self._onednn_sample = _compat.onednn_matmul(self.W_sample) if self._onednn is not None and self.sample else None

    def kept(self, width: int) -> int:
        """How many features :meth:`encode` keeps per row when asked for ``width``."""
        return min(width, self.k if self.k is not None else self.d_sae)

    def _normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, Any, Any]]:
        """SAELens's input normalisation, and its output de-normalisation ``y * mul / div + add``
        (``None`` where a term is absent; transcoders keep only the constant factor's)."""
        if self.normalize == "expected_average_only_in":
            return x * self.factor, (None, self.factor, None)
        if self.normalize == "constant_norm_rescale":
            coeff = (self.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, (None, None if self.transcoder else coeff, None)
        if self.normalize == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            normed = centred / (std + 1e-5)
            return normed, (None, None, None) if self.transcoder else (std, None, mu)
        return x, (None, None, None)

    @staticmethod
    def _denorm(y: torch.Tensor, mul: Any, div: Any, add: Any) -> torch.Tensor:
        if mul is not None:
            y = y * mul
        if div is not None:
            y = y / div
        if add is not None:
            y = y + add
        return y

    def _activate(self, pre: torch.Tensor) -> torch.Tensor:
        if self.architecture == "probe":
            return _PROBE_ACTIVATIONS[self.activation](pre)
        if self.architecture in ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder"):
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        return torch.relu(pre)

    def encode(self, x: torch.Tensor, width: int, dense: bool = False) -> Encoded:
        """Rows ``x`` (``[..., d_in]``, any float dtype) encoded: the :meth:`kept` ``(width)``
        largest features per row, sorted, and every feature if ``dense``."""
        x32 = x.reshape(-1, self.d_in).float()
        sae_in, denorm = self._normalise(x32)
        if self.b_dec_in:
            sae_in = sae_in - self.b_dec
        pre = self._pre(sae_in)
        if self.k is not None:
            top, ids = pre.topk(self.k, dim=-1)  # sorted: the k features, largest first
            top = top.relu()
            features = torch.zeros_like(pre).scatter(-1, ids, top) if dense else None
        else:
            features = self._activate(pre)
            top, ids = features.topk(self.kept(width), dim=-1)
        return Encoded(x32, pre, top, ids, features, denorm)

    def read(
        self, x: torch.Tensor, width: int, *, dense: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows ``x`` encoded for readouts: the :meth:`kept` ``(width)`` largest features per
        row (values and ids, sorted), the reconstruction error norms (SAEs that decode back to
        their input, else ``None``) and, if ``dense``, every feature. Encoded a block of rows at
        a time (:data:`READ_BLOCK_BYTES` of pre-activations per block), so that a prefill step's
        thousands of rows never hold a whole ``[rows, d_sae]`` matrix: each block's
        pre-activations stay in cache for the top-k and are reused from the allocator's heap
        rather than mapped afresh (on the CPU; an accelerator encodes every row at once). Each
        row's arithmetic does not depend on the rows beside it, so the blocks give what one
        encode of every row gives."""
        rows = x.reshape(-1, self.d_in)
        block = self._block() or max(rows.shape[0], 1)
        kept = self.kept(width)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for start in range(0, max(rows.shape[0], 1), block):
            enc = self.encode(rows[start : start + block], width, dense=dense)
            error = self.error(enc) if self.has_error else None
            features = enc.features if dense else None
            parts.append((enc.top[:, :kept], enc.ids[:, :kept], error, features))
        if len(parts) == 1:
            return parts[0]
        top = torch.cat([part[0] for part in parts])
        ids = torch.cat([part[1] for part in parts])
        errors = [part[2] for part in parts if part[2] is not None]
        dense_parts = [part[3] for part in parts if part[3] is not None]
        return top, ids, torch.cat(errors) if errors else None, torch.cat(dense_parts) if dense_parts else None

    def error(self, enc: Encoded) -> torch.Tensor:
        """``|x - reconstruct(x)|`` per row (SAEs that decode back to their input)."""
        if self.k is not None:  # the k decoder rows, weighted
            weights = enc.top / self.dec_norm[enc.ids] if self.rescale else enc.top
            linear = F.embedding_bag(enc.ids, self.W_dec, per_sample_weights=weights, mode="sum")
        else:
            if enc.features is None:
                raise RuntimeError("the SAE encode kept no features to read from")
            linear = enc.features @ self.W_dec
        recon = self._denorm(linear + self.b_dec, *enc.denorm)
        norm: torch.Tensor = (enc.x - recon).norm(dim=-1)
        return norm

    def current(self, enc: Encoded, feature: torch.Tensor) -> torch.Tensor:
        """Feature ``feature[r]`` (``[n, 1]`` long) of each encoded row, as :meth:`Sae.encode
        <interp_engine.Sae.encode>` gives it (``[n, 1]``)."""
        if self.k is not None:  # f_i = relu(pre_i) if i is among the top k, else 0
            member = (enc.ids == feature).any(-1, keepdim=True)
            fired = enc.pre.gather(-1, feature).relu()
            return torch.where(member, fired, torch.zeros_like(fired))
        if enc.features is None:
            raise RuntimeError("the SAE encode kept no features to read from")
        return enc.features.gather(-1, feature)

    def clamp(self, enc: Encoded, feature: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Each row with feature ``feature[r]`` (``[n, 1]`` long) clamped to ``value[r]``
        (``[n, 1]``): ``x + (value - f(x)) d(x)``, float32 ``[n, d_in]``."""
        return enc.x + self.change(self.current(enc, feature), feature, value, enc.denorm)

    def clamp_rows(self, x: torch.Tensor, feature: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """:meth:`clamp` of rows ``x`` (``[n, d_in]``), computing only what the clamped features
        need (:meth:`current_rows`). Equal to :meth:`clamp` of a whole encode to float32 rounding;
        the row selection makes its shapes depend on the values, so the compiled graph keeps
        :meth:`clamp`."""
        x32, current, denorm = self.current_rows(x, feature)
        return x32 + self.change(current, feature, value, denorm)

    def current_rows(self, x: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Feature ``feature[r]`` (``[n, 1]`` long) of rows ``x`` (``[n, d_in]``), computing only
        what it needs: its own pre-activation (one column of the encoder per distinct feature),
        and, for a TopK SAE, whether it is among the row's top ``k``. That is decided only for the
        rows where its pre-activation is positive (elsewhere it is 0 either way), first against a
        sample of the features (:attr:`sample`, the first ones): where more than ``k`` of them
        exceed it, it is not among the top ``k`` of all of them. The rows left are encoded whole
        and counted (features above it < ``k``), not sorted. Both passes go a block of rows at a
        time on the CPU. Returns the rows as float32, the features (``[n, 1]``) and the rows'
        output de-normalisation."""
        x32 = x.reshape(-1, self.d_in).float()
        sae_in, denorm = self._normalise(x32)
        if self.b_dec_in:
            sae_in = sae_in - self.b_dec
        flat = feature.reshape(-1)
        wanted, where = torch.unique(flat, return_inverse=True)
        pre = torch.addmm(self.b_enc[wanted], sae_in, self.W_enc[:, wanted]).gather(-1, where.unsqueeze(-1))
        if self.rescale:
            pre = pre * self.dec_norm[feature]
        if self.k is None:
            return x32, self._activate_at(pre, feature), denorm
        current = torch.zeros_like(pre)
        rows = torch.nonzero(pre.squeeze(-1) > 0).flatten()
        if self.sample and rows.numel():
            rows = torch.cat(
                [some[self._may_be_member(sae_in[some], pre[some])] for some in self._blocks(rows, self.sample)]
            )
        for some in self._blocks(rows, self.d_sae):
            current[some] = self._topk_member(sae_in[some], feature[some])
        return x32, current, denorm

    def change(self, current: torch.Tensor, feature: torch.Tensor, value: torch.Tensor, denorm: Any) -> torch.Tensor:
        """``(value - current) d_feature`` per row (``[n, 1]`` each; ``denorm`` the output
        de-normalisation of the rows' encode), float32 ``[n, d_out]``: what a clamp adds at the
        SAE's output address (its own for an SAE, the MLP's output for a transcoder)."""
        direction = self.W_dec[feature.squeeze(-1)]
        if self.rescale:
            direction = direction * (1 / self.dec_norm[feature])
        mul, div, _ = denorm
        direction = self._denorm(direction, mul, div, None)
        delta: torch.Tensor = (value - current) * direction
        return delta

    def _block(self, width: int | None = None) -> int:
        """How many rows of ``width`` (default: every feature) pre-activations :meth:`read` and
        :meth:`clamp_rows` encode at a time (0: all at once)."""
        if self.W_enc.device.type != "cpu":
            return 0
        return max(16, READ_BLOCK_BYTES // (4 * (width or self.d_sae)))

    def _blocks(self, rows: torch.Tensor, width: int) -> list[torch.Tensor]:
        """Row indices ``rows`` in blocks of :meth:`_block` ``(width)`` (one block off the CPU)."""
        block = self._block(width) or max(rows.numel(), 1)
        return [rows[start : start + block] for start in range(0, rows.numel(), block)]

    def _may_be_member(self, sae_in: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """Whether pre-activations ``mine`` (``[n, 1]``) may be among the top ``k`` of their rows:
        ``False`` where more than ``k`` of the :attr:`sample` features' pre-activations exceed
        them (then more than ``k`` of all do). One more than ``k``, because the clamped feature may
        itself be in the sample, rounded apart from ``mine``."""
        if self._onednn_sample is not None:
            ops, handler = self._onednn_sample
            sampled: torch.Tensor = ops.onednn_mm(handler, sae_in.contiguous(), self.b_sample)
        else:
            sampled = torch.addmm(self.b_sample, sae_in, self.W_sample)
        if self.rescale:
            sampled = sampled * self.dec_norm[: self.sample]
        return (sampled > mine).sum(-1) <= (self.k or self.d_sae)

    def _pre(self, sae_in: torch.Tensor) -> torch.Tensor:
        """Every pre-activation of encoder inputs ``sae_in`` (normalised, ``b_dec`` taken off)."""
        if self._onednn is not None:
            ops, handler = self._onednn
            pre: torch.Tensor = ops.onednn_mm(handler, sae_in.contiguous(), self.b_enc)
        else:
            pre = torch.addmm(self.b_enc, sae_in, self.W_enc)
        return pre * self.dec_norm if self.rescale else pre

    def _topk_member(self, sae_in: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """A TopK SAE's feature ``feature[r]`` (``[n, 1]``) on encoder inputs ``sae_in``: its
        relu'd pre-activation where fewer than ``k`` features exceed it (it is among the row's
        top ``k``), else 0, without sorting the row."""
        pre = self._pre(sae_in)
        mine = pre.gather(-1, feature)
        member = (pre > mine).sum(-1, keepdim=True) < (self.k or self.d_sae)
        return torch.where(member, mine.relu(), torch.zeros_like(mine))

    def _activate_at(self, pre: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """:meth:`_activate` of pre-activations ``pre`` (``[n, 1]``) of features ``feature``."""
        if self.architecture in ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder"):
            return torch.relu(pre) * (pre > self.threshold[feature]).to(pre.dtype)
        return self._activate(pre)


def pick(
    spec: Features,
    layout: SaeLayout,
    d_sae: int,
    sparse: bool,
    values: torch.Tensor,
    ids: torch.Tensor,
    error: torch.Tensor | None,
    dense: torch.Tensor | None,
) -> FeatureReadout:
    """The readout ``spec`` from what an encode kept (``values``/``ids``: the sorted top
    features, ``dense``: every feature or ``None``), as
    :func:`~interp_engine.sae._readouts.select_features` gives it."""
    wanted = spec.width(d_sae)
    if spec.top_k is not None and (wanted <= layout.width or layout.complete):
        v, i = values[:, :wanted], ids[:, :wanted]
        if sparse:
            fired = v > 0
            i = torch.where(fired, i, torch.full_like(i, -1))
            v = torch.where(fired, v, torch.zeros_like(v))
        if wanted > v.shape[1]:  # a TopK SAE asked for more than its k: nothing else fires
            pad = wanted - v.shape[1]
            v = F.pad(v, (0, pad), value=0.0)
            i = F.pad(i, (0, pad), value=-1)
        return FeatureReadout(v, i, error)
    if dense is None:  # pragma: no cover - the front end refuses it first
        raise InvalidFeatures(layout.refusal(spec, d_sae) or str(spec))
    return select_features(dense, spec, sparse=sparse, error_norm=error)
