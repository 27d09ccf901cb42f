"""Read-only access to a loaded model's weights, on every backend.

```python
from interp_engine import load_model, weights

model = load_model("interp:tiny")
w = weights(model)
w.W_U.shape            # [d_model, d_vocab]
w.W_O(1).shape         # [n_heads, d_head, d_model]: attn_out.1 = sum_h attn_z.1[h] @ W_O[h] + b_O
w.final_norm(x)        # the final norm as the model applies it (kind, eps, weight, bias, offset)
```

The names follow TransformerLens (:data:`WEIGHT_NAMES`). Each value is a float32 copy on the CPU,
whatever the served dtype (:attr:`WeightInfo.dtype`), equal to the full HF tensor: on vLLM the
workers send their tensor-parallel shards of the served weights (vocabulary-parallel embedding and
unembedding, row-parallel output projection), the front end joins them, and under pipeline
parallelism each weight comes from the stage that holds it.

Underneath is an optional capability of a backend's model (:class:`WeightAccess`: async
``weight_info()`` and ``weight(name, layer, vocab=)``), which the eager, vllm and vllm-static
backends implement; :func:`weights` wraps it in a sync object that caches what it fetched.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from .._errors import InvalidOption, InvalidTokens, LayerOutOfRange, UnknownWeight, UnsupportedOperation
from ..protocol._protocol import InterpModel, ModelInfo
from ..steering._values import short_repr
from ._metrics import token_id

if TYPE_CHECKING:
    from .._sync import SyncModel

NormKind = Literal["layernorm", "rmsnorm", "none"]


@dataclass(frozen=True)
class WeightName:
    """One weight interp-engine serves: whether it takes a layer, its shape and what it is."""

    per_layer: bool
    shape: str
    meaning: str
    vocab: bool = False
    """Whether it has a vocabulary axis (``vocab=`` selects entries of it)."""


WEIGHT_NAMES: dict[str, WeightName] = {
    "W_E": WeightName(
        False,
        "[d_vocab, d_model]",
        "the token embedding table as stored (before any embedding scale the model's forward applies, "
        "such as Gemma's sqrt(d_model))",
        vocab=True,
    ),
    "W_U": WeightName(False, "[d_model, d_vocab]", "the unembedding (tied embeddings: W_E.T)", vocab=True),
    "b_U": WeightName(False, "[d_vocab]", "the unembedding's bias, where it has one (GPT-J, Phi)", vocab=True),
    "W_O": WeightName(
        True,
        "[n_heads, d_head, d_model]",
        "the attention's output projection split by head: attn_out = sum_h attn_z[h] @ W_O[h] + b_O",
    ),
    "b_O": WeightName(True, "[d_model]", "the attention output projection's bias, where it has one"),
    "ln_final.w": WeightName(
        False,
        "[d_model]",
        "the final norm's weight as stored (Gemma's norms multiply by 1 + w: see FinalNorm.scale)",
    ),
    "ln_final.b": WeightName(False, "[d_model]", "the final norm's bias, where it has one (LayerNorm)"),
}
"""Every weight name, in a fixed order (a model serves those of :attr:`WeightInfo.names`)."""


@dataclass(frozen=True)
class WeightInfo:
    """What a model's :meth:`WeightAccess.weight` serves and how its output end computes.

    The logits are ``logit_scale * (final_norm(resid) @ W_U + b_U)``, then, with a
    ``logit_softcap`` ``c``, ``c * tanh(logits / c)`` (Gemma 2)."""

    names: tuple[str, ...]
    """The weights this model has (a subset of :data:`WEIGHT_NAMES`, in its order)."""
    norm: NormKind
    """The final norm: ``"layernorm"`` (centre, divide by the standard deviation), ``"rmsnorm"``
    (divide by the root mean square) or ``"none"`` (the model has no final norm)."""
    norm_eps: float = 0.0
    norm_weight_offset: float = 0.0
    """What the norm adds to its stored weight before multiplying: ``1.0`` for Gemma's ``x * (1 + w)``."""
    tied: bool = False
    """Whether the unembedding is the embedding table (``W_U == W_E.T``)."""
    logit_scale: float = 1.0
    """A constant the logits are multiplied by (Cohere's ``logit_scale``)."""
    logit_softcap: float | None = None
    """The final logit soft-cap (Gemma 2), or ``None``."""
    dtype: str = "float32"
    """The dtype the backend serves the weights in (they are returned as float32 copies)."""
    unembed_inputs: tuple[str, ...] = ()
    """Modules between the final norm and the unembedding (OPT's ``project_out``): ``W_U`` then reads
    their output, not the final norm's (direct logit attribution refuses such a model)."""
    residual_multiplier: float = 1.0
    """The constant each sublayer's output is multiplied by before it is added to the residual
    (Granite's ``residual_multiplier``). ``attn_out`` and ``mlp_out`` are what is added, so
    ``attn_out = residual_multiplier * (attn_z @ W_O + b_O)``: ``W_O`` and ``b_O`` are the output
    projection's own parameters."""


@dataclass(frozen=True, eq=False)
class FinalNorm:
    """The final norm as the model applies it, to use on any residual ``[..., d_model]``::

        layernorm: (x - mean(x)) / sqrt(var(x) + eps) * (weight + weight_offset) + bias
        rmsnorm:   x / sqrt(mean(x**2) + eps) * (weight + weight_offset) + bias

    (``var`` is the biased variance; a missing weight is 1, a missing bias 0; ``weight_offset`` is 1
    for Gemma-style norms, whose stored weight is the difference from 1.)"""

    kind: NormKind
    eps: float
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    weight_offset: float = 0.0

    @property
    def scale(self) -> torch.Tensor | None:
        """The multiplier the norm applies after normalising: ``weight + weight_offset``."""
        return None if self.weight is None else self.weight + self.weight_offset

    def normalise(self, x: torch.Tensor, *, like: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` centred (LayerNorm) and divided by the norm's denominator, without weight or bias.
        With ``like``, the denominator (and nothing else) is computed from ``like`` instead, as
        TransformerLens applies the final norm to each component of a decomposed residual."""
        source = x if like is None else like
        if self.kind == "none":
            return x
        if self.kind == "layernorm":
            denominator = (source.var(-1, unbiased=False, keepdim=True) + self.eps).sqrt()
            return (x - x.mean(-1, keepdim=True)) / denominator
        return x / (source.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.normalise(x)
        scale = self.scale
        if scale is not None:
            out = out * scale.to(out.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out


@runtime_checkable
class WeightAccess(Protocol):
    """A model whose weights can be read (the eager, vllm and vllm-static backends)."""

    async def weight_info(self) -> WeightInfo:
        """The weight names this model has and how its final norm and logits compute."""
        ...

    async def weight(self, name: str, layer: int | None = None, *, vocab: Sequence[int] | None = None) -> torch.Tensor:
        """A float32 CPU copy of weight ``name`` (:data:`WEIGHT_NAMES`), of ``layer`` for a per-layer
        weight; ``vocab`` picks entries of a vocabulary axis (``W_U[:, vocab]``, ``W_E[vocab]``)."""
        ...


def check_weight_request(
    info: WeightInfo, model: ModelInfo, name: Any, layer: Any, vocab: Any
) -> tuple[str, int | None, list[int] | None]:
    """``(name, layer, vocab)`` checked against the model (the layer made non-negative), or the
    typed error naming what is valid: ``UnknownWeight``, ``LayerOutOfRange``, ``InvalidOption``
    (a layer where none is taken, or none where one is), ``InvalidTokens`` (a vocabulary id)."""
    if not isinstance(name, str) or name not in WEIGHT_NAMES:
        raise UnknownWeight(
            f"unknown weight {short_repr(name)}; this model has {', '.join(info.names)}", name=name, valid=info.names
        )
    if name not in info.names:
        raise UnknownWeight(
            f"this model has no {name} ({WEIGHT_NAMES[name].meaning}); it has {', '.join(info.names)}",
            name=name,
            valid=info.names,
        )
    spec = WEIGHT_NAMES[name]
    if not spec.per_layer:
        if layer is not None:
            raise InvalidOption(f"{name} is one weight for the whole model: it takes no layer, got {short_repr(layer)}")
    else:
        if layer is None:
            raise InvalidOption(f"{name} is per layer: give a layer in {-model.n_layers}..{model.n_layers - 1}")
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise InvalidOption(f"the layer of {name} must be an int, got {short_repr(layer)}")
        layer = int(layer)
        if not -model.n_layers <= layer < model.n_layers:
            raise LayerOutOfRange(
                f"layer {layer} of {name} is out of range for a model with {model.n_layers} layers; "
                f"valid layers are {-model.n_layers}..{model.n_layers - 1}",
                address=f"{name}.{layer}",
                valid=f"{-model.n_layers}..{model.n_layers - 1}",
            )
        layer %= model.n_layers
    ids: list[int] | None = None
    if vocab is not None:
        if not spec.vocab:
            raise InvalidOption(f"{name} has no vocabulary axis: vocab= applies to W_E, W_U and b_U")
        items = [vocab] if isinstance(vocab, numbers.Integral) else vocab
        try:
            ids = [_vocab_id(v, model.vocab_size) for v in items]
        except TypeError:
            raise InvalidTokens(f"vocab must be token ids, got {short_repr(vocab)}") from None
        if not ids:
            raise InvalidTokens("vocab= selects no token; give at least one id (or None for all)")
    return name, layer, ids


def _vocab_id(value: Any, vocab_size: int) -> int:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTokens(f"vocab ids must be ints, got {short_repr(value)}")
    if not 0 <= int(value) < vocab_size:
        raise InvalidTokens(f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return int(value)


# -- what a backend's final norm is ------------------------------------------------------------

_EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "variance_eps")
_EPS_CONFIG = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
_EPS_DEFAULTS = (1e-5, 1e-6, 1e-12, 1e-8)


@dataclass(frozen=True)
class NormProbe:
    """What :func:`probe_norm` found: the kind, epsilon and weight offset that reproduce a norm
    module's outputs, and its parameters (``None`` where it has none)."""

    kind: NormKind
    eps: float
    weight_offset: float
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def norm_parameters(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(weight, bias)`` of a norm module: its ``weight``/``bias`` parameters, ``None`` where it
    has none (a buffer of ones, as vLLM's weightless ``RMSNorm`` keeps, is no weight)."""
    found: list[torch.Tensor | None] = []
    for attribute in ("weight", "bias"):
        value = getattr(module, attribute, None)
        found.append(value if isinstance(value, nn.Parameter) else None)
    return found[0], found[1]


def probe_norm(
    norm: Callable[[torch.Tensor], Any],
    module: nn.Module,
    *,
    d_model: int,
    device: torch.device,
    dtype: torch.dtype,
    config: Any = None,
) -> NormProbe | None:
    """Which formula a final-norm module computes (for a backend's ``weight_info``): run it on
    rows with a non-zero mean (where LayerNorm and RMSNorm differ), at a unit scale and at one
    where ``eps`` matters, and keep the kind, weight offset (0, or 1 for Gemma's ``1 + w``) and
    ``eps`` (the module's, the config's, or a usual default) that reproduce it; ``None`` if none
    does. ``norm`` calls the module (it may return a tuple: its first element is the output)."""
    weight, bias = norm_parameters(module)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, d_model, generator=generator, dtype=torch.float64)
    base = base + torch.randn(6, 1, generator=generator, dtype=torch.float64)
    pairs = []
    with torch.inference_mode():
        for scale in (3.0, 1e-3):
            x = (base * scale).to(device=device, dtype=dtype)
            y = norm(x)
            if isinstance(y, tuple):
                y = y[0]
            pairs.append((x.detach().to("cpu", torch.float64), y.detach().to("cpu", torch.float64)))
    w = None if weight is None else weight.detach().to("cpu", torch.float64)
    b = None if bias is None else bias.detach().to("cpu", torch.float64)
    best: tuple[float, NormKind, float, float] | None = None
    kinds: tuple[NormKind, ...] = ("rmsnorm", "layernorm")
    for kind in kinds:
        for offset in (0.0, 1.0) if w is not None else (0.0,):
            for eps in _eps_candidates(module, config, dtype):
                candidate = FinalNorm(kind, eps, w, b, offset)
                error = max(_relative(candidate(x), y) for x, y in pairs)
                if best is None or error < best[0]:
                    best = (error, kind, offset, eps)
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if best is None or not best[0] <= tolerance:
        return None
    _, kind, offset, eps = best
    return NormProbe(kind, eps, offset, weight, bias)


def _eps_candidates(module: nn.Module, config: Any, dtype: torch.dtype) -> list[float]:
    found: list[float] = []
    if isinstance(module, nn.RMSNorm) and module.eps is None:  # torch's RMSNorm: None means the dtype's
        found.append(float(torch.finfo(dtype).eps))
    for attribute in _EPS_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            found.append(float(value))
    for key in _EPS_CONFIG:
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            found.append(float(value))
    return list(dict.fromkeys([*found, *_EPS_DEFAULTS]))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max().clamp_min(1e-12))
    difference = float((actual - expected).abs().max())
    return difference / scale if math.isfinite(difference) else math.inf


# -- the sync object ---------------------------------------------------------------------------


class Weights:
    """A loaded model's weights, fetched on first use and kept (float32 CPU copies; see
    :data:`WEIGHT_NAMES` for the names and shapes). Get one with :func:`weights`.

    ``W_E``, ``W_U``, ``b_U`` and ``final_norm`` are properties, ``W_O(layer)`` and ``b_O(layer)``
    methods (no layer: every layer stacked); a weight the model lacks (``b_U`` without a bias) is
    ``None`` there and an ``UnknownWeight`` from :meth:`get`. Whole tables can be large (``W_U`` of
    a 128k-token vocabulary at d_model 4096 is 2 GiB in float32): ``get(name, vocab=ids)`` and
    :meth:`logit_direction` fetch only the entries asked for, and :meth:`clear` drops what is kept."""

    def __init__(self, model: InterpModel | SyncModel) -> None:
        from .._sync import sync_model

        facade = sync_model(model)
        inner = facade.model
        if not isinstance(inner, WeightAccess):
            raise UnsupportedOperation(
                f"the {inner.backend} backend does not expose its weights; the eager, vllm and vllm-static backends do"
            )
        self.facade = facade
        """The model's sync facade (``sync_model(model)``)."""
        self._model: WeightAccess = inner
        self.info: ModelInfo = inner.info
        self.layout: WeightInfo = facade.run(inner.weight_info)
        self._kept: dict[tuple[str, int | None], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Weights({', '.join(self.names)}; served as {self.layout.dtype}, final norm {self.layout.norm})"

    @property
    def names(self) -> tuple[str, ...]:
        """The weights this model has."""
        return self.layout.names

    def get(self, name: str, layer: int | None = None, *, vocab: Sequence[int] | None = None) -> torch.Tensor:
        """Weight ``name`` (of ``layer``, for ``W_O``/``b_O``); ``vocab`` picks vocabulary entries
        (``get("W_U", vocab=[a, b])`` is ``W_U[:, [a, b]]``), fetched alone and not kept."""
        model = self._model
        if vocab is not None:
            return self.facade.run(lambda: model.weight(name, layer, vocab=vocab))
        n = self.info.n_layers
        in_range = isinstance(layer, int) and not isinstance(layer, bool) and -n <= layer < n
        key = (name, layer % n if in_range and layer is not None else layer)  # anything else: the backend says why
        if key not in self._kept:
            self._kept[key] = self.facade.run(lambda: model.weight(name, layer))
        return self._kept[key]

    def _maybe(self, name: str, layer: int | None = None) -> torch.Tensor | None:
        return self.get(name, layer) if name in self.names else None

    @property
    def W_E(self) -> torch.Tensor:
        """``[d_vocab, d_model]``: the token embedding table as stored."""
        return self.get("W_E")

    @property
    def W_U(self) -> torch.Tensor:
        """``[d_model, d_vocab]``: the unembedding (tied: ``W_E.T``)."""
        return self.get("W_U")

    @property
    def b_U(self) -> torch.Tensor | None:
        """``[d_vocab]``: the unembedding's bias, or ``None``."""
        return self._maybe("b_U")

    def W_O(self, layer: int | None = None) -> torch.Tensor:
        """``[n_heads, d_head, d_model]`` of ``layer``; without a layer ``[n_layers, n_heads, d_head, d_model]``."""
        if layer is None:
            return torch.stack([self.get("W_O", i) for i in range(self.info.n_layers)])
        return self.get("W_O", layer)

    def b_O(self, layer: int | None = None) -> torch.Tensor | None:
        """``[d_model]`` of ``layer`` (without a layer ``[n_layers, d_model]``), or ``None``."""
        if "b_O" not in self.names:
            return None
        if layer is None:
            return torch.stack([self.get("b_O", i) for i in range(self.info.n_layers)])
        return self.get("b_O", layer)

    @property
    def final_norm(self) -> FinalNorm:
        """The final norm (kind, eps, weight, bias, weight offset), callable on residuals."""
        layout = self.layout
        return FinalNorm(
            layout.norm,
            layout.norm_eps,
            self._maybe("ln_final.w"),
            self._maybe("ln_final.b"),
            layout.norm_weight_offset,
        )

    def logit_direction(self, answer: int | str, wrong: int | str | None = None) -> torch.Tensor:
        """``W_U[:, answer] - W_U[:, wrong]`` (``[d_model]``; without ``wrong``, ``W_U[:, answer]``):
        the direction in the final norm's output whose dot product is the logit difference (before
        ``b_U``, the logit scale and any soft-cap). Tokens are ids or one-token texts."""
        ids = [token_id(self.facade.model, answer, "answer")]
        if wrong is not None:
            ids.append(token_id(self.facade.model, wrong, "wrong"))
        columns = self.get("W_U", vocab=ids)
        return columns[:, 0] - columns[:, 1] if wrong is not None else columns[:, 0]

    def clear(self) -> None:
        """Drop every weight kept so far."""
        self._kept.clear()


def weights(model: InterpModel | SyncModel) -> Weights:
    """The weights of ``model`` on any backend that exposes them: ``weights(model).W_U``,
    ``.W_O(layer)``, ``.final_norm``, ... (float32 CPU copies; see :class:`Weights`)."""
    return Weights(model)
