"""Addresses: where in a model an activation is read or written (the kinds are in :mod:`._kinds`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal, TypeGuard

from .._errors import InvalidAddress, LayerOutOfRange, UnknownKind
from ._kinds import ALIASES, KINDS, KindInfo
from ._tl_names import is_tl_name, parse_tl_name, tl_name


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
    (``"blocks.5.hook_resid_post"``). ``name=`` is accepted for ``kind`` (the public package's
    field name; :attr:`name` reads it back).
    """

    kind: str
    layer: int | None = None

    def __init__(self, kind: str | None = None, layer: int | None = None, *, name: str | None = None) -> None:
        if name is not None:  # the public interp-engine package's field name for the kind
            if kind is not None:
                raise InvalidAddress(
                    f"Address got both kind={kind!r} and name={name!r}; they are the same field (give one)",
                    address=name,
                    valid=("Address(kind, layer)", "Address(name=kind, layer=layer)"),
                )
            kind = name
        if kind is None:
            raise InvalidAddress("an Address needs a kind, e.g. Address('resid_post', 5)", address=None)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "layer", layer)
        self.__post_init__()

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

    @property
    def name(self) -> str:
        """The kind (the public ``interp-engine`` package's field name for it)."""
        return self.kind

    @classmethod
    def parse(cls, text: str | Address) -> Address:
        """Read ``"kind.layer"`` or ``"kind"`` (an ``Address`` is returned unchanged).

        TransformerLens hook names are read too: ``"blocks.5.hook_resid_post"`` is
        ``Address("resid_post", 5)``, ``"ln_final.hook_normalized"`` is ``Address("final_norm")``;
        one without an exact counterpart raises ``UnknownKind`` naming what to use instead.
        (A ``(kind, layer)`` tuple is read by :func:`to_address` and wherever points are taken.)
        """
        if isinstance(text, Address):
            return text
        if not isinstance(text, str):
            tuple_hint = "; a (kind, layer) tuple is read by to_address" if isinstance(text, tuple) else ""
            raise InvalidAddress(
                f"an address is an Address or a string like 'resid_post.5', got {type(text).__name__}{tuple_hint}",
                address=text,
                valid=("kind", "kind.layer"),
            )
        return _parse_text(text) if len(text) <= _KEPT_LENGTH else Address._from_text(text)

    @classmethod
    def _from_text(cls, text: str) -> Address:
        """:meth:`parse` of a string, uncached."""
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
            return (KINDS[self.kind].order, 0)
        return (self.layer, KINDS[self.kind].order)


_KEPT_LENGTH = 64
"""The longest string whose parse is kept (every address's own spelling is far shorter; a longer
one, padded or zero-filled, is parsed each time, so the kept parses stay small)."""


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Address:
    """:meth:`Address.parse` of a string, kept per string: an ``Address`` is immutable, and a
    request names the same few points call after call (an error is raised again each time)."""
    return Address._from_text(text)


AddressLike = Address | str | tuple[str, int | None]
"""An :class:`Address`, its string form, or a ``(kind, layer)`` tuple."""


def is_point_tuple(value: object) -> TypeGuard[tuple[str, int | None]]:
    """Whether ``value`` is one point as a ``(kind, layer)`` tuple (a kind string, then an int
    layer or ``None``), not a list of points."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and (value[1] is None or (isinstance(value[1], int) and not isinstance(value[1], bool)))
    )


def as_address(point: AddressLike) -> Address:
    """An ``Address`` from an ``Address``, its string form or a ``(kind, layer)`` tuple."""
    if is_point_tuple(point):
        return Address(point[0], point[1])
    if isinstance(point, tuple):
        raise InvalidAddress(
            f"a point as a tuple is (kind, layer) with a kind string and an int layer, got {point!r:.80}",
            address=point,
            valid=("(kind, layer)",),
        )
    return Address.parse(point)


def parse_address(text: str | Address) -> Address:
    """``Address.parse(text)``: ``parse_address("resid_post.10")`` is ``Address("resid_post", 10)``
    (the public ``interp-engine`` package's name for it)."""
    return Address.parse(text)


def to_address(point: AddressLike) -> Address:
    """Any accepted spelling of a point as an :class:`Address`: an ``Address``, its string, or a
    ``(kind, layer)`` tuple (``to_address(("mlp_out", 3))`` is ``Address("mlp_out", 3)``). Use it to
    look up a plain result dict, which is keyed by ``Address``."""
    return as_address(point)


def format_address(address: AddressLike) -> str:
    """The canonical string form of a point (``format_address(Address("resid_post", 10))`` is
    ``"resid_post.10"``); aliases and TransformerLens names print as our kind."""
    return str(as_address(address))
