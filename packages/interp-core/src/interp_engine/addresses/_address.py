"""Addresses: where in a model an activation is read or written."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .._errors import InvalidAddress, LayerOutOfRange, UnknownKind
from ._tl_names import is_tl_name, parse_tl_name, tl_name

Width = Literal[
    "d_model", "d_mlp", "heads x keys", "heads x d_head", "kv_heads x d_head", "vocab", "experts", "experts per token"
]


@dataclass(frozen=True)
class KindInfo:
    """What one address kind means: whether it is per layer, its width, whether it can be written."""

    per_layer: bool
    width: Width
    writable: bool
    meaning: str

    @property
    def per_head(self) -> bool:
        """Whether values keep a head axis (``[n_tokens, heads, d_head]``) and writes select heads."""
        return self.width in ("heads x d_head", "kv_heads x d_head")


KINDS: dict[str, KindInfo] = {
    "embed": KindInfo(False, "d_model", True, "token (+ position) embedding entering layer 0"),
    "resid_pre": KindInfo(True, "d_model", True, "residual stream entering layer L"),
    "resid_mid": KindInfo(True, "d_model", True, "residual after attention, before the MLP"),
    "resid_post": KindInfo(True, "d_model", True, "residual stream leaving layer L"),
    "attn_out": KindInfo(
        True, "d_model", True, "the attention sublayer's output (after its output projection, before any post-norm)"
    ),
    "mlp_out": KindInfo(True, "d_model", True, "the MLP sublayer's output (before any post-norm)"),
    "mlp_post": KindInfo(True, "d_mlp", True, "MLP hidden activations after the nonlinearity"),
    "attn_pattern": KindInfo(True, "heads x keys", False, "attention probabilities"),
    "final_norm": KindInfo(False, "d_model", True, "final norm output, input to the unembedding"),
    "logits": KindInfo(False, "vocab", False, "output logits (after any soft-cap or scaling)"),
    "attn_q": KindInfo(
        True, "heads x d_head", False, "queries as the attention product uses them (after rotary, q-norm)"
    ),
    "attn_k": KindInfo(
        True, "kv_heads x d_head", False, "keys as the attention product uses them (after rotary, k-norm)"
    ),
    "attn_v": KindInfo(True, "kv_heads x d_head", True, "values, per key/value head"),
    "attn_z": KindInfo(
        True, "heads x d_head", True, "each head's output, the input of the attention's output projection"
    ),
    "attn_in": KindInfo(True, "d_model", True, "the attention sublayer's input, after its pre-norm"),
    "mlp_in": KindInfo(True, "d_model", True, "the MLP's input, after its pre-norm"),
    "mlp_pre": KindInfo(True, "d_mlp", True, "MLP pre-activation (gated MLPs: the gate branch)"),
    "mlp_pre_linear": KindInfo(True, "d_mlp", True, "gated MLPs: the linear (up) branch"),
    "attn_scores": KindInfo(
        True,
        "heads x keys",
        False,
        "pre-softmax attention scores with the model's scaling, soft-cap, window and mask (-inf where masked)",
    ),
    "q_norm_in": KindInfo(True, "heads x d_head", True, "queries entering the q-norm (before rotary)"),
    "q_norm_out": KindInfo(True, "heads x d_head", True, "queries leaving the q-norm (before rotary)"),
    "k_norm_in": KindInfo(True, "kv_heads x d_head", True, "keys entering the k-norm (before rotary)"),
    "k_norm_out": KindInfo(True, "kv_heads x d_head", True, "keys leaving the k-norm (before rotary)"),
    "attn_out_post": KindInfo(
        True, "d_model", True, "sandwich-norm families: the post-attention norm's output, added to the residual"
    ),
    "mlp_out_post": KindInfo(
        True, "d_model", True, "sandwich-norm families: the post-MLP norm's output, added to the residual"
    ),
    "logits_raw": KindInfo(
        False, "vocab", False, "the bare unembedding of final_norm, before any logit soft-cap or scaling"
    ),
    "router_logits": KindInfo(
        True, "experts", True, "mixture-of-experts layers: the router's logits per expert, before softmax and top-k"
    ),
    "expert_indices": KindInfo(
        True,
        "experts per token",
        False,
        "mixture-of-experts layers: the experts each token is routed to (int64), in the router's order",
    ),
    "expert_weights": KindInfo(
        True,
        "experts per token",
        False,
        "mixture-of-experts layers: the weights the chosen experts' outputs are multiplied by "
        "(after the family's renormalisation), in the order of expert_indices",
    ),
}
"""The address vocabulary (TransformerLens meanings), in the order of SPEC §3's table."""

ALIASES: dict[str, str] = {
    "embeddings": "embed",
    "z": "attn_z",
    "value": "attn_v",
    "mlp_act": "mlp_post",
    "attn_probs": "attn_pattern",
    "lm_head": "logits_raw",
}
"""The public ``interp-engine`` package's point names that differ from ours, read as our kinds
(its other names -- ``attn_in``, ``mlp_pre``, ``q_norm_out``, ``attn_out_post``, ... -- are ours too,
with the same meaning)."""

MISSING_REASONS: dict[str, str] = {
    "attn_in": "its attention does not read a normed copy of the residual",
    "mlp_in": "its MLP does not read a normed copy of the residual",
    "mlp_pre_linear": "its MLP is not gated (one up projection and an activation: use mlp_pre)",
    "q_norm_in": "it has no q-norm",
    "q_norm_out": "it has no q-norm",
    "k_norm_in": "it has no k-norm",
    "k_norm_out": "it has no k-norm",
    "attn_out_post": "it has no post-attention (sandwich) norm: attn_out is what is added to the residual",
    "mlp_out_post": "it has no post-MLP (sandwich) norm: mlp_out is what is added to the residual",
    "resid_mid": "there is no residual between its attention and MLP",
    "router_logits": "it is not a mixture of experts",
    "expert_indices": "it is not a mixture of experts",
    "expert_weights": "it is not a mixture of experts",
}
"""Why a family may lack a kind (the default reason a backend gives with ``KindNotInFamily``)."""


@dataclass(frozen=True)
class PointInfo:
    """One kind a loaded model serves (:meth:`ModelBase.points <interp_engine.ModelBase.points>`)."""

    kind: str
    shape: tuple[int, ...]
    """One token's value shape on this model (attention scores and patterns: ``(heads,)``, the
    key axis grows with the sequence)."""
    per_layer: bool
    writable: bool
    """Whether a steering spec may write here on this backend."""
    how: Literal["hook", "recompute"]
    """``hook``: read where the model computes it; ``recompute``: rebuilt exactly from tensors the
    model computed (e.g. vLLM's attention probabilities from the queries and keys its kernel got)."""
    meaning: str
    layers: tuple[int, ...] | None = None
    """The layers it exists at when that is not every layer (``None``: every layer, or no layer
    axis): a model mixing dense and mixture-of-experts layers has the router points only on the
    latter and ``mlp_post`` only on the former."""


_KIND_ORDER = {  # the order values are computed in, inside one layer
    kind: i
    for i, kind in enumerate(
        (
            "resid_pre",
            "attn_in",
            "q_norm_in",
            "q_norm_out",
            "k_norm_in",
            "k_norm_out",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_scores",
            "attn_pattern",
            "attn_z",
            "attn_out",
            "attn_out_post",
            "resid_mid",
            "mlp_in",
            "router_logits",
            "expert_indices",
            "expert_weights",
            "mlp_pre",
            "mlp_pre_linear",
            "mlp_post",
            "mlp_out",
            "mlp_out_post",
            "resid_post",
        )
    )
}
_MODEL_LEVEL_ORDER = {"embed": -1, "final_norm": 1 << 30, "logits_raw": (1 << 30) + 1, "logits": (1 << 30) + 2}


_LAYER_TEXT = re.compile(r"-?[0-9]+")


class LayerTypeError(InvalidAddress, TypeError):
    """An address layer that is not an ``int``."""


@dataclass(frozen=True)
class Address:
    """A point in a transformer's forward pass, in TransformerLens vocabulary.

    ``Address("resid_post", 5)`` is the residual stream leaving layer 5; ``Address("logits")``
    is a model-level point with no layer. The public ``interp-engine`` package's names are read
    as aliases (``Address("z", 3)`` is ``Address("attn_z", 3)``; see :data:`ALIASES`). Negative
    layers count from the end and are resolved against a model with :meth:`resolve`. The string
    form ``"resid_post.5"`` round-trips through :meth:`parse`, but an ``Address`` is never equal
    to its string: keys stay typed. :meth:`parse` also reads TransformerLens hook names
    (``"blocks.5.hook_resid_post"``).
    """

    kind: str
    layer: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kind, str) and self.kind in ALIASES:
            object.__setattr__(self, "kind", ALIASES[self.kind])
        info = KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if info is None:
            raise UnknownKind(
                f"unknown address kind {self.kind!r}; valid kinds: {', '.join(KINDS)} "
                f"(also read: {', '.join(f'{a} = {k}' for a, k in ALIASES.items())})",
                address=self.kind,
                valid=tuple(KINDS),
            )
        if info.per_layer:
            if self.layer is None:
                raise InvalidAddress(
                    f"address kind {self.kind!r} needs a layer, e.g. Address({self.kind!r}, 0)",
                    address=self.kind,
                    valid=(f"{self.kind}.<layer>",),
                )
            if isinstance(self.layer, bool) or not isinstance(self.layer, int):
                raise LayerTypeError(
                    f"address layer must be an int, got {type(self.layer).__name__} {self.layer!r}",
                    address=self.layer,
                    valid=("int",),
                )
        elif self.layer is not None:
            raise InvalidAddress(
                f"address kind {self.kind!r} is model-level and takes no layer (got {self.layer!r})",
                address=self.kind,
                valid=(self.kind,),
            )

    def __str__(self) -> str:
        return self.kind if self.layer is None else f"{self.kind}.{self.layer}"

    def __repr__(self) -> str:
        if self.layer is None:
            return f"Address({self.kind!r})"
        return f"Address({self.kind!r}, {self.layer})"

    @classmethod
    def parse(cls, text: str | Address) -> Address:
        """Read ``"kind.layer"`` or ``"kind"`` (an ``Address`` is returned unchanged).

        TransformerLens hook names are read too: ``"blocks.5.hook_resid_post"`` is
        ``Address("resid_post", 5)``, ``"ln_final.hook_normalized"`` is ``Address("final_norm")``;
        one without an exact counterpart raises ``UnknownKind`` naming what to use instead.
        """
        if isinstance(text, Address):
            return text
        if not isinstance(text, str):
            raise InvalidAddress(
                f"an address is an Address or a string like 'resid_post.5', got {type(text).__name__}",
                address=text,
                valid=("kind", "kind.layer"),
            )
        text = text.strip()
        if is_tl_name(text):
            return cls(*parse_tl_name(text))
        kind, sep, layer_text = text.partition(".")
        if not sep:
            return cls(kind)
        if _LAYER_TEXT.fullmatch(layer_text) is None:  # int() would also take "1_0", " 1", "٣"
            shown = text if len(text) <= 80 else f"{text[:50]}...{text[-20:]}"
            raise LayerTypeError(
                f"cannot read the layer of address {shown!r}: the layer is not an integer "
                "(ASCII digits, optionally after a minus sign)",
                address=shown,
                valid=("kind.layer with an integer layer",),
            )
        return cls(kind, int(layer_text))

    @property
    def tl_name(self) -> str | None:
        """The TransformerLens hook name of this address (``"blocks.5.hook_resid_post"``), or
        ``None`` where TransformerLens has no hook with exactly this value (``embed``, ``logits``)."""
        return tl_name(self.kind, self.layer)

    @property
    def info(self) -> KindInfo:
        """The vocabulary entry for this address's kind."""
        return KINDS[self.kind]

    def resolve(self, n_layers: int) -> Address:
        """This address with a negative layer made absolute; raises if out of range."""
        if self.layer is None:
            return self
        if not -n_layers <= self.layer < n_layers:
            raise LayerOutOfRange(
                f"layer {self.layer} of {self} is out of range for a model with {n_layers} layers; "
                f"valid layers are {-n_layers}..{n_layers - 1}",
                address=self,
                valid=f"{-n_layers}..{n_layers - 1}",
            )
        return self if self.layer >= 0 else Address(self.kind, self.layer + n_layers)

    def sort_key(self) -> tuple[int, int]:
        """Forward order: by layer, then by position inside the layer."""
        if self.layer is None:
            return (_MODEL_LEVEL_ORDER[self.kind], 0)
        return (self.layer, _KIND_ORDER[self.kind])


AddressLike = Address | str


def as_address(point: AddressLike) -> Address:
    """An ``Address`` from an ``Address`` or its string form."""
    return Address.parse(point)
