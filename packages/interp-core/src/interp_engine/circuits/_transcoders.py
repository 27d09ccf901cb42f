"""Transcoders that replace a model's MLPs: per-layer sets and cross-layer transcoders.

A *replacement* maps each covered layer's MLP input (``mlp_in.L``, or the residual before the
MLP's norm, ``resid_mid.L``) to features, and the features back to MLP outputs (``mlp_out``):

- :class:`TranscoderSet` -- per-layer transcoders (PLTs): one :class:`~interp_engine.Sae` of a
  transcoder architecture per layer, reading at layer ``L`` and writing ``mlp_out.L``;
- :class:`CrossLayerTranscoder` -- a CLT: an encoder at each layer's MLP input, and each layer's
  features decoded into the MLP outputs of that layer and every later one.

Both answer the same questions (:class:`Replacement`): the features of a layer, their encoder
rows (what a feature's pre-activation reads), their decoder rows at each output layer, and the
reconstruction of every MLP output from the features of all layers. The error term of a layer is
what its MLP computed minus that reconstruction, so that replacement + error is the model.

Everything is float32 on the tensors' device; the weights keep the dtype they were given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from .._errors import InvalidFeatures, UnsupportedSae
from ..addresses._address import Address
from ..sae._sae import Sae

INPUT_KINDS = ("mlp_in", "resid_mid")
"""Where a replacement's encoders may read (both are linear in the residual stream once the MLP's
pre-norm scale is frozen)."""
OUTPUT_KIND = "mlp_out"
"""Where a replacement's decoders write."""

_SERVED_ARCHITECTURES = ("transcoder", "jumprelu_transcoder", "skip_transcoder", "jumprelu_skip_transcoder")
_LINEAR_NORMS = ("none", "expected_average_only_in")


@runtime_checkable
class Replacement(Protocol):
    """What the attribution graph and the replacement model need of a set of transcoders."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers whose MLP input is encoded, ascending."""
        ...

    @property
    def input_kind(self) -> str:
        """``"mlp_in"`` or ``"resid_mid"``."""
        ...

    @property
    def d_in(self) -> int: ...

    @property
    def d_out(self) -> int: ...

    def d_sae(self, layer: int) -> int:
        """The number of features at ``layer``."""
        ...

    def pre_acts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Pre-activations ``[..., d_sae]`` of ``layer``'s features on its input ``x``."""
        ...

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of ``layer`` on its input ``x``."""
        ...

    def encoder(self, layer: int) -> torch.Tensor:
        """``[d_in, d_sae]``: pre-activation = ``x @ encoder(layer) + encoder_bias(layer)``."""
        ...

    def encoder_bias(self, layer: int) -> torch.Tensor: ...

    def out_layers(self, layer: int) -> tuple[int, ...]:
        """The MLP outputs ``layer``'s features write into."""
        ...

    def decoder(self, layer: int, out_layer: int) -> torch.Tensor:
        """``[d_sae, d_out]``: how ``layer``'s features move ``mlp_out.out_layer`` per unit."""
        ...

    def decoder_bias(self, out_layer: int) -> torch.Tensor:
        """``[d_out]``: what the reconstruction of ``mlp_out.out_layer`` holds with no feature on."""
        ...

    def skip(self, layer: int) -> torch.Tensor | None:
        """``[d_out, d_in]`` of a skip transcoder (``x @ skip.T`` is added), else ``None``."""
        ...


def reconstruct(replacement: Replacement, inputs: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each MLP output the replacement writes, rebuilt from ``inputs`` (layer -> ``[..., d_in]``
    at the replacement's input kind): decoder bias + every feature's decoder row times its
    activation (+ the skip term), float32."""
    acts = {layer: replacement.encode(layer, inputs[layer]) for layer in replacement.layers}
    return reconstruct_from(replacement, acts, inputs)


def reconstruct_from(
    replacement: Replacement, acts: Mapping[int, torch.Tensor], inputs: Mapping[int, torch.Tensor] | None = None
) -> dict[int, torch.Tensor]:
    """As :func:`reconstruct`, from feature activations ``acts`` (layer -> ``[..., d_sae]``)."""
    out: dict[int, torch.Tensor] = {}
    for layer in replacement.layers:
        a = acts[layer].float()
        for target in replacement.out_layers(layer):
            part = a @ replacement.decoder(layer, target).to(a.device)
            out[target] = out[target] + part if target in out else part
        skip = replacement.skip(layer)
        if skip is not None:
            if inputs is None:
                raise InvalidFeatures("a skip transcoder's reconstruction needs its inputs")
            out[layer] = out[layer] + inputs[layer].float() @ skip.to(a.device).T
    for target in list(out):
        out[target] = out[target] + replacement.decoder_bias(target).to(out[target].device)
    return out


def _check_transcoder(sae: Sae, where: str) -> tuple[int, str]:
    if not isinstance(sae, Sae):
        raise UnsupportedSae(f"{where} must be a transcoder (an Sae), got {type(sae).__name__}")
    if sae.architecture not in _SERVED_ARCHITECTURES:
        raise UnsupportedSae(
            f"{where} is a {sae.architecture!r}, not a transcoder; a replacement takes the architectures "
            f"{', '.join(_SERVED_ARCHITECTURES)}"
        )
    if sae.address.kind not in INPUT_KINDS or sae.address_out.kind != OUTPUT_KIND:
        raise UnsupportedSae(
            f"{where} reads {sae.address} and writes {sae.address_out}; a transcoder that replaces an MLP reads "
            f"{' or '.join(k + '.L' for k in INPUT_KINDS)} and writes {OUTPUT_KIND}.L of the same layer"
        )
    if sae.address.layer != sae.address_out.layer or sae.address.layer is None or sae.address.layer < 0:
        raise UnsupportedSae(f"{where} reads {sae.address} but writes {sae.address_out}: not the same layer's MLP")
    if sae.normalize_activations not in _LINEAR_NORMS:
        raise UnsupportedSae(
            f"{where} normalises each input by its own norm ({sae.normalize_activations}), which is not linear "
            f"in the input: a replacement takes normalize_activations in {', '.join(_LINEAR_NORMS)}"
        )
    if sae.k is not None:
        raise UnsupportedSae(f"{where} is a top-k SAE, not a transcoder")
    return sae.address.layer, sae.address.kind


class TranscoderSet:
    """Per-layer transcoders (PLTs): one transcoder :class:`~interp_engine.Sae` per covered layer,
    each reading ``mlp_in.L`` (or ``resid_mid.L``) and writing ``mlp_out.L``.

    Built from the SAEs (any order; at most one per layer, all reading the same kind), or read
    with :func:`load_transcoders`. Layers left out keep their MLP whole: in an attribution graph
    their MLP output is all error. ``names`` are the names the transcoders get when attached to a
    model (:meth:`attach`, default ``"tc.L"``), which feature writes on them use.
    """

    def __init__(self, transcoders: Iterable[Sae] | Mapping[int, Sae], *, names: Mapping[int, str] | None = None):
        items = list(transcoders.values()) if isinstance(transcoders, Mapping) else list(transcoders)
        if not items:
            raise UnsupportedSae("a TranscoderSet needs at least one transcoder")
        by_layer: dict[int, Sae] = {}
        kinds = set()
        for i, sae in enumerate(items):
            layer, kind = _check_transcoder(sae, f"transcoder {i}")
            if layer in by_layer:
                raise UnsupportedSae(f"two transcoders replace layer {layer}'s MLP; give one per layer")
            by_layer[layer] = sae
            kinds.add(kind)
        if len(kinds) > 1:
            raise UnsupportedSae(f"the transcoders read different kinds ({', '.join(sorted(kinds))}); use one")
        widths = {(s.d_in, s.d_out) for s in by_layer.values()}
        if len(widths) > 1:
            raise UnsupportedSae(f"the transcoders have different widths (d_in, d_out): {sorted(widths)}")
        self.transcoders: dict[int, Sae] = dict(sorted(by_layer.items()))
        self._kind = kinds.pop()
        self.names: dict[int, str] = {layer: f"tc.{layer}" for layer in self.transcoders}
        if names is not None:
            for layer, name in names.items():
                if layer not in self.transcoders:
                    raise UnsupportedSae(f"names[{layer}]: no transcoder replaces layer {layer}")
                self.names[layer] = name

    def __repr__(self) -> str:
        first = self.transcoders[self.layers[0]]
        return (
            f"TranscoderSet({len(self.transcoders)} PLTs, layers {list(self.layers)}, {self._kind} -> {OUTPUT_KIND}, "
            f"d_sae={first.d_sae})"
        )

    def __getitem__(self, layer: int) -> Sae:
        if layer not in self.transcoders:
            raise InvalidFeatures(f"no transcoder replaces layer {layer}; layers: {list(self.layers)}")
        return self.transcoders[layer]

    def __len__(self) -> int:
        return len(self.transcoders)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.transcoders)

    @property
    def input_kind(self) -> str:
        return self._kind

    @property
    def d_in(self) -> int:
        return self.transcoders[self.layers[0]].d_in

    @property
    def d_out(self) -> int:
        return self.transcoders[self.layers[0]].d_out

    def d_sae(self, layer: int) -> int:
        return self[layer].d_sae

    def pre_acts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self[layer].pre_acts(x)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self[layer].encode(x)

    def encoder(self, layer: int) -> torch.Tensor:
        sae = self[layer]
        w = sae.W_enc.float()
        if sae.norm_scaling_factor is not None:
            w = w * sae.norm_scaling_factor
        return w

    def encoder_bias(self, layer: int) -> torch.Tensor:
        return self[layer].b_enc.float()

    def out_layers(self, layer: int) -> tuple[int, ...]:
        self[layer]
        return (layer,)

    def decoder(self, layer: int, out_layer: int) -> torch.Tensor:
        sae = self[layer]
        if out_layer != layer or sae.W_dec is None:
            raise InvalidFeatures(f"the transcoder of layer {layer} writes mlp_out.{layer} only, not layer {out_layer}")
        w = sae.W_dec.float()
        if sae.norm_scaling_factor is not None:
            w = w / sae.norm_scaling_factor
        return w

    def decoder_bias(self, out_layer: int) -> torch.Tensor:
        sae = self[out_layer]
        if sae.b_dec is None:  # pragma: no cover - transcoders have one
            raise InvalidFeatures(f"the transcoder of layer {out_layer} has no decoder bias")
        b = sae.b_dec.float()
        return b / sae.norm_scaling_factor if sae.norm_scaling_factor is not None else b

    def skip(self, layer: int) -> torch.Tensor | None:
        sae = self[layer]
        return None if sae.W_skip is None else sae.W_skip.float()

    def attach(self, model: object) -> None:
        """Attach every transcoder to ``model`` under its name (:attr:`names`), so that feature
        writes (``FeatureWrite(names[L], i, "clamp", v)``) and readouts can name them."""
        attach = getattr(model, "attach_sae", None)
        if attach is None:
            raise InvalidFeatures(f"{type(model).__name__} has no attach_sae: pass a model from load_model")
        for layer, sae in self.transcoders.items():
            attach(self.names[layer], sae)

    def save(self, folder: str, *, format: str = "circuit-tracer") -> None:
        """Write the set to ``folder``: ``format="circuit-tracer"`` (``layer_L.safetensors`` and a
        ``config.yaml``, circuit-tracer's transcoder-set layout) or ``"saelens"`` (one SAELens
        folder per layer, ``layer_L/``); :func:`load_transcoders` reads both back."""
        from ._save import save_plt_circuit_tracer, save_plt_saelens

        if format == "circuit-tracer":
            save_plt_circuit_tracer(self, folder)
        elif format == "saelens":
            save_plt_saelens(self, folder)
        else:
            raise InvalidFeatures(f"unknown transcoder format {format!r}; valid: 'circuit-tracer', 'saelens'")


class CrossLayerTranscoder:
    """A cross-layer transcoder (CLT): an encoder at each of ``n_layers`` layers' MLP input
    (``mlp_in.L`` or ``resid_mid.L``), and the features of layer ``L`` decoded into the MLP
    outputs of layers ``L, L+1, ..., n_layers - 1``.

    - ``W_enc [n_layers, d_in, d_sae]``, ``b_enc [n_layers, d_sae]``;
    - ``W_dec``: one tensor per source layer, ``W_dec[L]`` of shape ``[d_sae, n_layers - L, d_out]``
      (row ``j`` of its middle axis writes ``mlp_out.(L + j)``);
    - ``b_dec [n_layers, d_out]``, the bias of each layer's reconstructed MLP output;
    - ``threshold [n_layers, d_sae]`` for JumpReLU features (``pre * (pre > threshold)``), else ReLU.

    :func:`load_transcoders` reads circuit-tracer's CLT folders; :meth:`save` writes one.
    """

    def __init__(
        self,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        W_dec: Sequence[torch.Tensor],
        b_dec: torch.Tensor,
        threshold: torch.Tensor | None = None,
        *,
        input_kind: str = "resid_mid",
    ) -> None:
        if not isinstance(W_enc, torch.Tensor) or W_enc.dim() != 3 or not W_enc.is_floating_point():
            raise UnsupportedSae(f"a CLT's W_enc is a float tensor [n_layers, d_in, d_sae], got {_shape(W_enc)}")
        n_layers, _, d_sae = W_enc.shape
        self.W_enc = W_enc.detach()
        self.b_enc = _checked(b_enc, (n_layers, d_sae), "b_enc", "one bias per layer and feature")
        if not isinstance(b_dec, torch.Tensor) or b_dec.dim() != 2 or b_dec.shape[0] != n_layers:
            raise UnsupportedSae(f"a CLT's b_dec is [n_layers={n_layers}, d_out], got {_shape(b_dec)}")
        self.b_dec = b_dec.detach()
        d_out = int(b_dec.shape[1])
        decoders = list(W_dec)
        if len(decoders) != n_layers:
            raise UnsupportedSae(
                f"a CLT with {n_layers} layers has {n_layers} decoders (one per source layer), got {len(decoders)}"
            )
        self.W_dec = [
            _checked(
                w,
                (d_sae, n_layers - i, d_out),
                f"W_dec[{i}]",
                f"layer {i} writes the {n_layers - i} MLP outputs from layer {i} on",
            )
            for i, w in enumerate(decoders)
        ]
        self.threshold = (
            None
            if threshold is None
            else _checked(threshold, (n_layers, d_sae), "threshold", "one per layer and feature")
        )
        if input_kind not in INPUT_KINDS:
            raise UnsupportedSae(f"a CLT reads {' or '.join(INPUT_KINDS)}, got input_kind={input_kind!r}")
        self._kind = input_kind

    def __repr__(self) -> str:
        act = "jumprelu" if self.threshold is not None else "relu"
        return (
            f"CrossLayerTranscoder({self.n_layers} layers, {self._kind} -> {OUTPUT_KIND}, d_in={self.d_in}, "
            f"d_sae={self.W_enc.shape[2]} per layer, {act})"
        )

    @property
    def n_layers(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers))

    @property
    def input_kind(self) -> str:
        return self._kind

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.b_dec.shape[1])

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise InvalidFeatures(f"layer {layer!r} is out of range for this CLT: layers 0..{self.n_layers - 1}")
        return layer

    def d_sae(self, layer: int) -> int:
        self._layer(layer)
        return int(self.W_enc.shape[2])

    def encoder(self, layer: int) -> torch.Tensor:
        return self.W_enc[self._layer(layer)].float()

    def encoder_bias(self, layer: int) -> torch.Tensor:
        return self.b_enc[self._layer(layer)].float()

    def pre_acts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape[-1] != self.d_in:
            raise InvalidFeatures(f"this CLT reads activations of width {self.d_in}, got {_shape(x)}")
        w = self.encoder(layer).to(x.device)
        return x.float() @ w + self.encoder_bias(layer).to(x.device)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        pre = self.pre_acts(layer, x)
        if self.threshold is None:
            return torch.relu(pre)
        return pre * (pre > self.threshold[layer].float().to(pre.device)).to(pre.dtype)

    def out_layers(self, layer: int) -> tuple[int, ...]:
        return tuple(range(self._layer(layer), self.n_layers))

    def decoder(self, layer: int, out_layer: int) -> torch.Tensor:
        if out_layer not in self.out_layers(layer):
            raise InvalidFeatures(
                f"layer {layer}'s features write the MLP outputs of layers {layer}..{self.n_layers - 1}, "
                f"not {out_layer}"
            )
        return self.W_dec[layer][:, out_layer - layer].float()

    def decoder_bias(self, out_layer: int) -> torch.Tensor:
        return self.b_dec[self._layer(out_layer)].float()

    def skip(self, layer: int) -> torch.Tensor | None:
        return None

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
        """A copy with the tensors on ``device`` in ``dtype``."""
        return CrossLayerTranscoder(
            self.W_enc.to(device=device, dtype=dtype),
            self.b_enc.to(device=device, dtype=dtype),
            [w.to(device=device, dtype=dtype) for w in self.W_dec],
            self.b_dec.to(device=device, dtype=dtype),
            None if self.threshold is None else self.threshold.to(device=device, dtype=dtype),
            input_kind=self._kind,
        )

    def save(self, folder: str) -> None:
        """Write circuit-tracer's CLT layout into ``folder``: ``W_enc_L.safetensors`` (``W_enc_L``
        ``[d_sae, d_in]``, ``b_enc_L``, ``b_dec_L``, ``threshold_L``), ``W_dec_L.safetensors``
        (``W_dec_L [d_sae, n_layers - L, d_out]``) and ``config.yaml``."""
        from ._save import save_clt_circuit_tracer

        save_clt_circuit_tracer(self, folder)


def _shape(x: object) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _checked(t: object, shape: tuple[int, ...], name: str, meaning: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise UnsupportedSae(f"a CLT's {name} must be a float tensor, got {_shape(t)}")
    if tuple(t.shape) != shape:
        raise UnsupportedSae(f"a CLT's {name} has shape {list(t.shape)}, expected {list(shape)} ({meaning})")
    return t.detach()


def input_address(replacement: Replacement, layer: int) -> Address:
    """Where ``replacement`` reads at ``layer``."""
    return Address(replacement.input_kind, layer)


def as_replacement(transcoders: object) -> Replacement:
    """``transcoders`` as a :class:`Replacement`: a :class:`TranscoderSet`, a
    :class:`CrossLayerTranscoder`, or a list / layer-keyed mapping of transcoder SAEs."""
    if isinstance(transcoders, (TranscoderSet, CrossLayerTranscoder)):
        return transcoders
    if isinstance(transcoders, Sae):
        return TranscoderSet([transcoders])
    if isinstance(transcoders, (Mapping, list, tuple)):
        return TranscoderSet(transcoders)
    raise UnsupportedSae(
        "transcoders must be a TranscoderSet, a CrossLayerTranscoder, a list of transcoder Sae objects "
        f"or load_transcoders(path); got {type(transcoders).__name__}"
    )
