"""Addresses: where in a model an activation is read or written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._errors import InvalidAddress, LayerOutOfRange, UnknownKind
from ._tl_names import is_tl_name, parse_tl_name, tl_name

Width = Literal["d_model", "d_mlp", "heads x keys", "heads x d_head", "kv_heads x d_head", "vocab"]


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
    "attn_out": KindInfo(True, "d_model", True, "attention block output added to the residual"),
    "mlp_out": KindInfo(True, "d_model", True, "MLP block output added to the residual"),
    "mlp_post": KindInfo(True, "d_mlp", True, "MLP hidden activations after the nonlinearity"),
    "attn_pattern": KindInfo(True, "heads x keys", False, "attention probabilities"),
    "final_norm": KindInfo(False, "d_model", True, "final norm output, input to the unembedding"),
    "logits": KindInfo(False, "vocab", False, "output logits"),
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
}
"""The address vocabulary (TransformerLens meanings), in the order of SPEC §3's table."""

_KIND_ORDER = {  # the order values are computed in, inside one layer
    kind: i
    for i, kind in enumerate(
        (
            "resid_pre",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_pattern",
            "attn_z",
            "attn_out",
            "resid_mid",
            "mlp_post",
            "mlp_out",
            "resid_post",
        )
    )
}
_MODEL_LEVEL_ORDER = {"embed": -1, "final_norm": 1 << 30, "logits": (1 << 30) + 1}


class LayerTypeError(InvalidAddress, TypeError):
    """An address layer that is not an ``int``."""


@dataclass(frozen=True)
class Address:
    """A point in a transformer's forward pass, in TransformerLens vocabulary.

    ``Address("resid_post", 5)`` is the residual stream leaving layer 5; ``Address("logits")``
    is a model-level point with no layer. Negative layers count from the end and are resolved
    against a model with :meth:`resolve`. The string form ``"resid_post.5"`` round-trips through
    :meth:`parse`, but an ``Address`` is never equal to its string: keys stay typed.
    :meth:`parse` also reads TransformerLens hook names (``"blocks.5.hook_resid_post"``).
    """

    kind: str
    layer: int | None = None

    def __post_init__(self) -> None:
        info = KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if info is None:
            raise UnknownKind(
                f"unknown address kind {self.kind!r}; valid kinds: {', '.join(KINDS)}",
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
        try:
            layer = int(layer_text)
        except ValueError:
            raise LayerTypeError(
                f"cannot read the layer of address {text!r}: {layer_text!r} is not an integer",
                address=text,
                valid=("kind.layer with an integer layer",),
            ) from None
        return cls(kind, layer)

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
