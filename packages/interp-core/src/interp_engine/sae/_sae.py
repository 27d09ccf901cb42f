"""Sparse dictionaries (SAEs, transcoders) and linear probes: their maths, as SAELens 6 computes it.

:class:`Sae` encodes and decodes as SAELens 6 does, always in float32 on the input's device::

    pre  = (normalise(x) - b_dec * apply_b_dec_to_input) @ W_enc + b_enc   (transcoders: no b_dec)
    f    = relu(pre) | relu(pre) * (pre > threshold) | topk(pre, k) with relu
    out  = denormalise(f @ W_dec + b_dec)   (+ x @ W_skip.T in reconstruct, skip transcoders)

TopK SAEs with ``rescale_acts_by_decoder_norm`` scale ``pre`` by the decoder row norms before
the top-k and divide ``f`` by them before decoding. The normalisations SAELens applies at run
time are served (:data:`NORMALIZATIONS`); ``expected_average_only_in`` needs its scaling factor
(``norm_scaling_factor`` in ``cfg.json``, or the ``activation_scaler.json`` SAELens checkpoints
keep beside it), since SAELens only applies it by folding it into the weights.

A :class:`Probe` is the same object without a decoder: ``k`` projections ``act(x @ W.T + b)``.
:func:`load_sae` reads an SAE folder in SAELens's format and :meth:`Sae.save` writes one SAELens
reads back; the format itself (files, cfg versions) is ``sae._format``.
"""

from __future__ import annotations

import copy
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import InvalidFeatures, UnsupportedSae
from ..addresses._address import Address
from ._format import (
    ARCHITECTURES,
    CFG_FILENAME,
    JUMPRELU,
    NORMALIZATIONS,
    PROBE_ACTIVATIONS,
    SCALER_FILENAME,
    SKIP,
    TRANSCODERS,
    WEIGHTS_FILENAME,
    SaeFields,
    dtype_name,
    read_bytes,
    read_folder,
    sae_arguments,
    synced_cfg,
    to_bytes,
    unsupported_architecture,
    write_folder,
)
from ._parts import check_normalisation, check_shape, float_tensor, hook_address

__all__ = [
    "ARCHITECTURES",
    "CFG_FILENAME",
    "NORMALIZATIONS",
    "PROBE_ACTIVATIONS",
    "SCALER_FILENAME",
    "WEIGHTS_FILENAME",
    "Probe",
    "Sae",
    "load_sae",
]

_PER_INPUT_NORMS = frozenset({"constant_norm_rescale", "layer_norm"})
_LAYER_NORM_EPS = 1e-5  # SAELens's layer_norm adds it to the standard deviation


@dataclass(frozen=True)
class _Denorm:
    """SAELens's output de-normalisation, ``y * mul / div + add`` (each optional)."""

    mul: torch.Tensor | None = None
    div: torch.Tensor | float | None = None
    add: torch.Tensor | None = None

    def __call__(self, y: torch.Tensor, *, shift: bool = True) -> torch.Tensor:
        if self.mul is not None:
            y = y * self.mul
        if self.div is not None:
            y = y / self.div
        if shift and self.add is not None:
            y = y + self.add
        return y


_IDENTITY = _Denorm()


@dataclass(frozen=True)
class _Weights:
    """The tensors in float32 on one device (what every computation uses)."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor | None
    b_dec: torch.Tensor | None
    threshold: torch.Tensor | None
    W_skip: torch.Tensor | None
    dec_norm: torch.Tensor | None  # TopK with rescale_acts_by_decoder_norm: ||W_dec[i]||


class Sae(SaeFields):
    """One sparse dictionary (or linear probe) at one address.

    Built from tensors (``Sae("topk", W_enc, b_enc, W_dec, b_dec, "blocks.3.hook_resid_post", k=32)``)
    or read with :func:`load_sae`. Shapes are checked here: ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``,
    ``W_dec [d_sae, d_out]``, ``b_dec [d_out]`` (``d_out == d_in`` except for transcoders),
    ``threshold [d_sae]`` for JumpReLU kinds, ``W_skip [d_out, d_in]`` for skip transcoders. All
    tensors are kept in ``W_enc``'s dtype and device; computations run in float32 on the input's
    device (float32 copies are cached per device). ``cfg`` is the cfg.json :meth:`save` writes:
    the one given (as read from disk, or extra fields such as ``model_name``), with the fields this
    object owns brought up to date; without one, a cfg in SAELens 6's layout.

    The keyword-only options are SAELens's: ``rescale_acts_by_decoder_norm`` (TopK),
    ``norm_scaling_factor`` (the factor of ``normalize_activations="expected_average_only_in"``),
    ``reshape_activations="hook_z"`` (an SAE over flattened heads, which also takes
    ``[..., heads, d_head]``); ``activation`` is a probe's. Anything inconsistent raises
    ``UnsupportedSae`` naming the field.
    """

    # the fields a cfg.json records are declared by SaeFields
    cfg: dict[str, Any]
    b_enc: torch.Tensor
    W_dec: torch.Tensor | None
    b_dec: torch.Tensor | None
    threshold: torch.Tensor | None
    W_skip: torch.Tensor | None

    def __init__(
        self,
        architecture: str,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        W_dec: torch.Tensor | None,
        b_dec: torch.Tensor | None,
        hook_name: str,
        threshold: torch.Tensor | None = None,
        k: int | None = None,
        W_skip: torch.Tensor | None = None,
        hook_name_out: str | None = None,
        apply_b_dec_to_input: bool = False,
        normalize_activations: str = "none",
        cfg: Mapping[str, Any] | None = None,
        *,
        rescale_acts_by_decoder_norm: bool = False,
        norm_scaling_factor: float | None = None,
        reshape_activations: str = "none",
        activation: str | None = None,
    ) -> None:
        if architecture not in ARCHITECTURES:
            raise unsupported_architecture(architecture)
        arch = architecture
        self.architecture = arch
        W_enc = float_tensor(W_enc, "W_enc", arch)
        if W_enc.dim() != 2:
            raise UnsupportedSae(f"W_enc of a {arch!r} SAE is [d_in, d_sae], got shape {list(W_enc.shape)}")
        d_in, d_sae = W_enc.shape
        dtype_name(W_enc.dtype)
        self.W_enc = W_enc
        self.b_enc = float_tensor(b_enc, "b_enc", arch).to(device=W_enc.device, dtype=W_enc.dtype)
        check_shape(self.b_enc, (d_sae,), "b_enc", arch, "one bias per feature")

        if arch == "probe":
            if W_dec is not None or b_dec is not None:
                raise UnsupportedSae("a probe has no decoder: pass W_dec=None and b_dec=None")
            self.W_dec = self.b_dec = None
        else:
            if W_dec is None or b_dec is None:
                raise UnsupportedSae(f"a {arch!r} SAE needs W_dec [d_sae, d_out] and b_dec [d_out]")
            self.W_dec = float_tensor(W_dec, "W_dec", arch).to(device=W_enc.device, dtype=W_enc.dtype)
            if self.W_dec.dim() != 2 or self.W_dec.shape[0] != d_sae:
                raise UnsupportedSae(
                    f"W_dec of this {arch!r} SAE has shape {list(self.W_dec.shape)}, expected [{d_sae}, d_out]: "
                    f"W_enc {list(W_enc.shape)} gives d_sae={d_sae}"
                )
            if arch not in TRANSCODERS:
                check_shape(self.W_dec, (d_sae, d_in), "W_dec", arch, "an SAE decodes to its input width d_in")
            self.b_dec = float_tensor(b_dec, "b_dec", arch).to(device=W_enc.device, dtype=W_enc.dtype)
            check_shape(self.b_dec, (self.W_dec.shape[1],), "b_dec", arch, "one bias per output unit")

        self.threshold = None
        if arch in JUMPRELU:
            if threshold is None:
                raise UnsupportedSae(f"a {arch!r} SAE needs threshold [d_sae] (one JumpReLU threshold per feature)")
            self.threshold = float_tensor(threshold, "threshold", arch).to(device=W_enc.device, dtype=W_enc.dtype)
            check_shape(self.threshold, (d_sae,), "threshold", arch, "one JumpReLU threshold per feature")
        elif threshold is not None:
            raise UnsupportedSae(f"threshold is only for JumpReLU architectures, not {arch!r}")

        self.k = None
        if arch == "topk":
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae:
                raise UnsupportedSae(f"a 'topk' SAE needs k, an int in 1..d_sae={d_sae}; got {k!r}")
            self.k = k
        elif k is not None:
            raise UnsupportedSae(f"k is only for the 'topk' architecture, not {arch!r}")
        if rescale_acts_by_decoder_norm and arch != "topk":
            raise UnsupportedSae(f"rescale_acts_by_decoder_norm is only for the 'topk' architecture, not {arch!r}")
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)

        self.W_skip = None
        if arch in SKIP:
            if W_skip is None:
                raise UnsupportedSae(f"a {arch!r} needs W_skip [d_out, d_in]")
            self.W_skip = float_tensor(W_skip, "W_skip", arch).to(device=W_enc.device, dtype=W_enc.dtype)
            check_shape(self.W_skip, (self.d_out, d_in), "W_skip", arch, "the skip connection maps d_in to d_out")
        elif W_skip is not None:
            raise UnsupportedSae(f"W_skip is only for skip transcoders, not {arch!r}")

        if apply_b_dec_to_input and (arch in TRANSCODERS or arch == "probe"):
            raise UnsupportedSae(
                f"apply_b_dec_to_input is not available to a {arch!r} (b_dec is not in its input space)"
            )
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)

        check_normalisation(arch, normalize_activations, norm_scaling_factor)
        self.normalize_activations = normalize_activations
        self.norm_scaling_factor = None if norm_scaling_factor is None else float(norm_scaling_factor)
        if reshape_activations not in ("none", "hook_z"):
            raise UnsupportedSae(f"reshape_activations must be 'none' or 'hook_z', got {reshape_activations!r}")
        self.reshape_activations = reshape_activations

        if arch == "probe":
            if activation is not None and activation not in PROBE_ACTIVATIONS:
                raise UnsupportedSae(
                    f"unknown probe activation {activation!r}; valid: None, {', '.join(PROBE_ACTIVATIONS)}"
                )
        elif activation is not None:
            raise UnsupportedSae(f"activation is only for probes; a {arch!r} SAE's activation is its architecture")
        self.activation = activation

        self._address = hook_address(hook_name, "hook_name")
        self.hook_name = str(self._address) if arch == "probe" else hook_name
        if hook_name_out is not None and arch not in TRANSCODERS:
            raise UnsupportedSae(f"hook_name_out is only for transcoders, not {arch!r}")
        self.hook_name_out = hook_name_out
        self._address_out = self._address if hook_name_out is None else hook_address(hook_name_out, "hook_name_out")
        self.cfg = synced_cfg(self, cfg)
        self._cache: dict[str, _Weights] = {}
        self._moved: dict[tuple[str | None, torch.dtype | None], Sae] = {}

    # -- what it is ------------------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """Where the SAE reads: ``as_address(hook_name)``."""
        return self._address

    @property
    def address_out(self) -> Address:
        """Where :meth:`decode` writes to: ``hook_name_out`` for transcoders, else :attr:`address`."""
        return self._address_out

    @property
    def d_in(self) -> int:
        """The input width."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """The number of features (probes: of projections)."""
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        """The width :meth:`decode` returns (probes: the width at :attr:`address_out`, ``d_in``)."""
        return self.d_in if self.W_dec is None else int(self.W_dec.shape[1])

    @property
    def is_transcoder(self) -> bool:
        """Whether it decodes to another point (``hook_name_out``) than it reads."""
        return self.architecture in TRANSCODERS

    @property
    def has_decoder(self) -> bool:
        """False for probes."""
        return self.W_dec is not None

    def __repr__(self) -> str:
        where = str(self.address)
        if self.is_transcoder:
            where += f" -> {self.address_out}"
        extra = f", d_out={self.d_out}" if self.is_transcoder else ""
        if self.k is not None:
            extra += f", k={self.k}"
        if self.normalize_activations != "none":
            extra += f", normalize_activations={self.normalize_activations}"
        return f"Sae({self.architecture}, {where}, d_in={self.d_in}, d_sae={self.d_sae}{extra})"

    # -- computing -------------------------------------------------------------------------------

    def _weights(self, device: torch.device) -> _Weights:
        key = str(device)
        cached = self._cache.get(key)
        if cached is None:

            def f32(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.to(device=device, dtype=torch.float32)

            W_dec = f32(self.W_dec)
            dec_norm = W_dec.norm(dim=-1) if self.rescale_acts_by_decoder_norm and W_dec is not None else None
            cached = _Weights(
                self.W_enc.to(device=device, dtype=torch.float32),
                self.b_enc.to(device=device, dtype=torch.float32),
                W_dec,
                f32(self.b_dec),
                f32(self.threshold),
                f32(self.W_skip),
                dec_norm,
            )
            self._cache[key] = cached
        return cached

    def _input(self, x: object, device: torch.device | None = None) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """``x`` as float32 rows ``[..., d_in]``, and the head shape it was flattened from (hook_z)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise InvalidFeatures(f"{self!r} encodes a tensor [..., {self.d_in}], got {type(x).__name__}")
        heads = None
        flat = x.dim() >= 2 and x.shape[-1] != self.d_in and x.shape[-2] * x.shape[-1] == self.d_in
        if self.reshape_activations == "hook_z" and flat:
            heads = (int(x.shape[-2]), int(x.shape[-1]))
            x = x.flatten(-2)
        if x.shape[-1] != self.d_in:
            raise InvalidFeatures(f"{self!r} reads activations of width {self.d_in}, got shape {list(x.shape)}")
        return x.to(device=device, dtype=torch.float32), heads

    def _normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, _Denorm]:
        """SAELens's input normalisation of float32 ``x``, and the matching output de-normalisation."""
        mode = self.normalize_activations
        if mode == "expected_average_only_in":
            factor = float(self.norm_scaling_factor or 1.0)
            return x * factor, _Denorm(div=factor)
        if mode == "constant_norm_rescale":
            coeff = (self.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, (_IDENTITY if self.is_transcoder else _Denorm(div=coeff))
        if mode == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            return centred / (std + _LAYER_NORM_EPS), (_IDENTITY if self.is_transcoder else _Denorm(mul=std, add=mu))
        return x, _IDENTITY

    def _pre(self, x: torch.Tensor, w: _Weights) -> tuple[torch.Tensor, _Denorm]:
        sae_in, denorm = self._normalise(x)
        if self.apply_b_dec_to_input and w.b_dec is not None:
            sae_in = sae_in - w.b_dec
        pre = sae_in @ w.W_enc + w.b_enc
        if w.dec_norm is not None:
            pre = pre * w.dec_norm
        return pre, denorm

    def _activate(self, pre: torch.Tensor, w: _Weights) -> torch.Tensor:
        if self.architecture == "probe":
            return _PROBE_FNS[self.activation](pre)
        if w.threshold is not None:
            return torch.relu(pre) * (pre > w.threshold).to(pre.dtype)
        if self.k is not None:
            values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        return torch.relu(pre)

    def _decode_linear(self, f: torch.Tensor, w: _Weights) -> torch.Tensor:
        if w.W_dec is None or w.b_dec is None:
            raise InvalidFeatures(f"{self!r} is a probe: it has no decoder")
        if w.dec_norm is not None:
            f = f * (1 / w.dec_norm)
        return f @ w.W_dec + w.b_dec

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden pre-activations ``[..., d_sae]``: what ReLU, the JumpReLU threshold or the top-k is
        applied to (TopK with ``rescale_acts_by_decoder_norm``: after scaling by the decoder norms,
        as SAELens's training ``hidden_pre``). Float32 on ``x``'s device."""
        x32, _ = self._input(x)
        return self._pre(x32, self._weights(x32.device))[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_in] -> [..., d_sae]`` (probes: their projections), computed
        as SAELens's ``encode`` in float32 on ``x``'s device. A hook_z SAE also takes ``[..., heads, d_head]``."""
        x32, _ = self._input(x)
        w = self._weights(x32.device)
        return self._activate(self._pre(x32, w)[0], w)

    def decode(self, f: torch.Tensor, *, x: torch.Tensor | None = None) -> torch.Tensor:
        """Features ``[..., d_sae] -> [..., d_out]``, as SAELens's ``decode`` (``b_dec`` and output
        de-normalisation included), float32 on ``f``'s device.

        SAEs that normalise each input (``constant_norm_rescale``, ``layer_norm``) undo that with the
        input's own norm: pass ``x``, the activations ``f`` was encoded from (or use :meth:`reconstruct`).
        Probes raise ``InvalidFeatures``."""
        if not self.has_decoder:
            raise InvalidFeatures(f"{self!r} is a probe: it has no decoder")
        if not isinstance(f, torch.Tensor) or f.dim() == 0 or f.shape[-1] != self.d_sae:
            shape = list(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise InvalidFeatures(f"{self!r} decodes features [..., {self.d_sae}], got {shape}")
        f32 = f.to(torch.float32)
        w = self._weights(f32.device)
        return self._denorm_for(x, f32.device)(self._decode_linear(f32, w))

    def _denorm_for(self, x: torch.Tensor | None, device: torch.device) -> _Denorm:
        """The output de-normalisation, from ``x`` where it depends on the input."""
        if self.normalize_activations == "expected_average_only_in":
            return _Denorm(div=float(self.norm_scaling_factor or 1.0))
        if self.normalize_activations in _PER_INPUT_NORMS and not self.is_transcoder:
            if x is None:
                raise InvalidFeatures(
                    f"{self!r} rescales each input by its own norm, so its outputs depend on the input: "
                    "pass x= (the activations the features came from), or use reconstruct(x)"
                )
            return self._normalise(self._input(x, device)[0])[1]
        return _IDENTITY

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """What SAELens's ``forward`` returns: ``decode(encode(x))``, plus ``x @ W_skip.T`` for skip
        transcoders; float32 on ``x``'s device (a hook_z SAE given heads returns heads)."""
        if not self.has_decoder:
            raise InvalidFeatures(f"{self!r} is a probe: it has no decoder to reconstruct with")
        x32, heads = self._input(x)
        w = self._weights(x32.device)
        pre, denorm = self._pre(x32, w)
        out = denorm(self._decode_linear(self._activate(pre, w), w))
        if w.W_skip is not None:
            out = out + x32 @ w.W_skip.T
        return out if heads is None else out.reshape(*out.shape[:-1], *heads)

    def feature_direction(self, i: int, *, x: torch.Tensor | None = None) -> torch.Tensor:
        """How the output moves per unit of feature ``i``: ``W_dec[i]`` with any output
        de-normalisation (TopK ``rescale_acts_by_decoder_norm``: the unit row), float32 ``[d_out]``
        on the SAE's device. Per-input normalisations (``constant_norm_rescale``, ``layer_norm``)
        scale it by each input's norm: pass ``x`` (``[..., d_in]``) for ``[..., d_out]``."""
        if not self.has_decoder:
            raise InvalidFeatures(f"{self!r} is a probe: it has no feature directions")
        try:
            index = operator.index(i) if not isinstance(i, bool) else None
        except TypeError:
            index = None
        if index is None:
            raise InvalidFeatures(f"a feature id is an int, got {type(i).__name__} {i!r}")
        if not 0 <= index < self.d_sae:
            raise InvalidFeatures(
                f"feature {index} is out of range for {self!r}: it has {self.d_sae} features (0..{self.d_sae - 1})"
            )
        device = self.W_enc.device
        w = self._weights(device)
        if w.W_dec is None:
            raise InvalidFeatures(f"{self!r} is a probe: it has no feature directions")
        direction = w.W_dec[index]
        if w.dec_norm is not None:
            direction = direction * (1 / w.dec_norm[index])
        return self._denorm_for(x, device)(direction, shift=False)

    # -- moving, saving, sending -----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors, named as in SAELens's ``sae_weights.safetensors``."""
        named = {
            "W_enc": self.W_enc,
            "b_enc": self.b_enc,
            "W_dec": self.W_dec,
            "b_dec": self.b_dec,
            "threshold": self.threshold,
            "W_skip": self.W_skip,
        }
        return {name: t for name, t in named.items() if t is not None}

    def _cpu_state(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Sae:
        """A copy with its tensors on ``device`` in ``dtype`` (``cfg`` shared unless the dtype
        changes); ``self`` when nothing moves. Copies are cached per (device, dtype)."""
        target = None if device is None else torch.device(device)
        if dtype is not None:
            dtype_name(dtype)
        if (target is None or target == self.W_enc.device) and (dtype is None or dtype == self.W_enc.dtype):
            return self
        key = (None if target is None else str(target), dtype)
        moved = self._moved.get(key)
        if moved is None:
            moved = copy.copy(self)
            for name, tensor in self.state_dict().items():
                setattr(moved, name, tensor.to(device=target, dtype=dtype))
            if dtype is not None and "dtype" in self.cfg:
                moved.cfg = {**self.cfg, "dtype": dtype_name(dtype)}
            moved._cache = {}
            moved._moved = {}
            self._moved[key] = moved
        return moved

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write ``cfg.json`` and ``sae_weights.safetensors`` into ``folder`` (created if needed),
        in SAELens's format: SAELens's ``SAE.load_from_disk`` reads it (probes: only :func:`load_sae`).
        SAELens ignores ``norm_scaling_factor``, which it applies only by folding."""
        write_folder(folder, self._cpu_state(), self.cfg)

    def to_bytes(self) -> bytes:
        """The tensors as safetensors bytes with ``cfg`` in the header's metadata (for sending the
        SAE to worker processes); :meth:`from_bytes` reads it."""
        return to_bytes(self._cpu_state(), self.cfg)

    @classmethod
    def from_bytes(cls, data: bytes) -> Sae:
        """The SAE (or probe) :meth:`to_bytes` wrote."""
        cfg, tensors = read_bytes(data)
        return _from_parts(cfg, tensors)


class Probe(Sae):
    """Linear probes / direction sets: ``k`` projections ``act(x @ W.T + b)`` per token.

    ``W`` is ``[k, d_in]`` (stored as ``W_enc = W.T``), ``bias`` ``[k]`` (zeros if omitted),
    ``activation`` one of ``None``, ``"relu"``, ``"sigmoid"``, ``"tanh"``. Saved as a cfg.json
    ``{"architecture": "probe", "hook_name", "d_in", "d_sae", "activation"}`` beside
    ``sae_weights.safetensors`` ``{W_enc, b_enc}``; it has no decoder.
    """

    def __init__(
        self,
        W: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        activation: str | None = None,
        address: Address | str = "resid_post.0",
    ) -> None:
        W = float_tensor(W, "W", "probe")
        if W.dim() != 2:
            raise UnsupportedSae(f"a probe's W is [k, d_in], got shape {list(W.shape)}")
        b = torch.zeros(W.shape[0], dtype=W.dtype, device=W.device) if bias is None else bias
        name = str(address) if isinstance(address, Address) else address
        super().__init__("probe", W.T.contiguous(), b, None, None, name, activation=activation)

    def __repr__(self) -> str:
        return f"Probe({self.address}, d_in={self.d_in}, d_sae={self.d_sae}, activation={self.activation})"


_PROBE_FNS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda t: t,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def _from_parts(cfg: object, tensors: dict[str, torch.Tensor], *, scaler_factor: object = None) -> Sae:
    """The SAE (or probe) a cfg.json and its tensors describe (:func:`sae_arguments`)."""
    arguments = sae_arguments(cfg, tensors, scaler_factor=scaler_factor)
    if arguments["architecture"] == "probe":
        probe = Probe.__new__(Probe)
        Sae.__init__(probe, **arguments)
        return probe
    return Sae(**arguments)


def load_sae(source: str | os.PathLike[str] | Sae, *, device: str | torch.device | None = None) -> Sae:
    """A folder with ``cfg.json`` + ``sae_weights.safetensors`` (SAELens's format, or a probe saved
    by :meth:`Probe.save`), the name of an SAE that ships with interp-core (``"interp:tiny-sae"``),
    or an :class:`Sae` returned as is (moved to ``device`` if given).

    Tensors are loaded onto ``device`` (default CPU) in the cfg's dtype, as SAELens loads them.
    Raises ``UnsupportedSae`` for a folder that is not in this format or an architecture,
    normalisation or hook point that is not served.
    """
    if isinstance(source, Sae):
        return source if device is None else source.to(device)
    kind = type(source).__name__
    if kind == "CrossLayerTranscoder":  # interp_engine.circuits (which imports this module)
        raise UnsupportedSae(
            "a CrossLayerTranscoder is not attached to a model: each of its features writes the MLP outputs "
            "of several layers, which no FeatureWrite names. Intervene on its features with "
            "AttributionGraph.steering_spec(nodes, mode='constant') (plain writes at those MLP outputs, served "
            "on every backend), or attach per-layer transcoders (TranscoderSet.attach) to clamp by name"
        )
    if kind == "TranscoderSet":
        raise UnsupportedSae(
            "a TranscoderSet holds one transcoder per layer: attach them with transcoders.attach(model) "
            "(each under transcoders.names[L]), or attach_sae(name, transcoders[L]) for one layer"
        )
    if not isinstance(source, (str, os.PathLike)):
        raise UnsupportedSae(f"load_sae takes a folder path or an Sae, got {kind}")
    cfg, tensors, scaler_factor = read_folder(source, device)
    return _from_parts(cfg, tensors, scaler_factor=scaler_factor)
