"""The public ``interp-engine`` package's steering vocabulary, as rows of our op registry.

Its op objects (:class:`AddSpec`, :class:`ProjectionCapSpec`, :class:`OrthogonalDecompSpec`,
:class:`NormScaledAddSpec`, :class:`AblateSpec`, :class:`SwapSpec`) each name one row of
:data:`~interp_engine.steering._writes.OP_ROWS` (:attr:`OpSpec.op`) and carry that row's parameters
under the public package's field names; a :class:`~interp_engine.SteeringSpec` turns them into
:class:`~interp_engine.Write` values, so there is one algebra, one set of checks and one JSON form.
:class:`LayerSteeringSpec` is the list of ops at one layer that ``SteeringSpec(layers={...})`` takes.

========================  ==============  ==============================================
op object                 our op          fields (ours)
========================  ==============  ==============================================
``AddSpec``               ``add``         ``scale`` (``normalize``: vector made unit)
``ProjectionCapSpec``     ``cap``         ``min`` (``lo``), ``max`` (``hi``)
``OrthogonalDecompSpec``  ``rescale``     ``coeff`` (``scale``)
``NormScaledAddSpec``     ``norm_add``    ``strength`` (``scale``), ``max_fraction``
``AblateSpec``            ``ablate``      ``scale`` (1: the whole component)
``SwapSpec``              ``swap``        ``target``, ``scale`` (1: the whole move)
========================  ==============  ==============================================

``set`` has no op object (write it with :class:`~interp_engine.Write`). :class:`SteerSpec` is
the public package's lower-level form, one op at one layer named by ``method`` (the row's
:attr:`~interp_engine.steering._writes.OpRow.steer_method`); it builds the same op object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._errors import InvalidSteering
from ..addresses._address import Address
from ._values import as_bound, as_index, as_vector, finite_float, short_repr
from ._writes import OP_ROWS, Op, op_row


def _vector(value: Any, what: str, op: Op, *, direction: bool) -> torch.Tensor:
    """``value`` as a float32 CPU vector ``[width]``, refused (``InvalidSteering``) when it holds
    inf or NaN, or is zero where ``op`` uses only its direction."""
    tensor = as_vector(value, what)
    if tensor.dim() != 1:
        raise InvalidSteering(
            f"a {op} op object's {what} is one vector [width], got shape {list(tensor.shape)}; "
            "for one row per position or per head use Write(...)"
        )
    if direction and not bool(tensor.any()):
        raise InvalidSteering(f"the {what} of a {op} op is a zero vector, which has no direction")
    return tensor


def _number(value: Any, name: str) -> float:
    number = finite_float(value)
    if number is None:
        raise InvalidSteering(f"{name} must be a finite number, got {short_repr(value)}")
    return number


def _unit(vector: torch.Tensor) -> torch.Tensor:
    unit: torch.Tensor = vector / vector.norm()
    return unit


class OpSpec:
    """One steering op as an object: the row of our registry it writes (:attr:`op`) and its
    parameters. Equal when the class and every field are equal (vectors compared exactly)."""

    op: ClassVar[Op]
    """The row of :data:`~interp_engine.steering._writes.OP_ROWS` this object writes."""

    def write_args(self) -> dict[str, Any]:
        """The :class:`~interp_engine.Write` arguments besides the address and positions:
        ``vector``, ``op`` and whichever of ``scale``, ``target``, ``lo``, ``hi``,
        ``max_fraction`` the op takes."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                if not torch.equal(mine, theirs):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            parts.append(
                f"{f.name}=<{list(value.shape)}>" if isinstance(value, torch.Tensor) else f"{f.name}={value!r}"
            )
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True, eq=False, repr=False)
class AddSpec(OpSpec):
    """Add ``scale * vector`` (our ``op="add"``). ``normalize=True`` makes ``vector`` unit length
    here, so ``scale`` is the length added (then a zero vector is refused)."""

    vector: torch.Tensor
    scale: float
    normalize: bool = False
    op: ClassVar[Op] = "add"

    def __post_init__(self) -> None:
        vector = _vector(self.vector, "vector", self.op, direction=bool(self.normalize))
        object.__setattr__(self, "vector", _unit(vector) if self.normalize else vector)
        object.__setattr__(self, "scale", _number(self.scale, "scale"))
        object.__setattr__(self, "normalize", bool(self.normalize))

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "scale": self.scale}


@dataclass(frozen=True, eq=False, repr=False)
class ProjectionCapSpec(OpSpec):
    """Clamp the projection ``x . d`` onto the unit ``vector`` into ``[min, max]`` (our
    ``op="cap"`` with ``lo=min``, ``hi=max``); at least one bound is needed."""

    vector: torch.Tensor
    min: float | None = None
    max: float | None = None
    op: ClassVar[Op] = "cap"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", _vector(self.vector, "vector", self.op, direction=True))
        low, high = as_bound(self.min, "min"), as_bound(self.max, "max")
        if low is None and high is None:
            raise InvalidSteering("ProjectionCapSpec needs min=, max= or both (the bounds of the projection x.d)")
        if low is not None and high is not None and low > high:
            raise InvalidSteering(f"ProjectionCapSpec needs min <= max, got min={low} and max={high}")
        object.__setattr__(self, "min", low)
        object.__setattr__(self, "max", high)

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "lo": self.min, "hi": self.max}


@dataclass(frozen=True, eq=False, repr=False)
class OrthogonalDecompSpec(OpSpec):
    """Rescale the component along ``vector`` by ``coeff``, keeping the orthogonal part:
    ``x + (coeff - 1) (x . d) d`` (our ``op="rescale"`` with ``scale=coeff``)."""

    vector: torch.Tensor
    coeff: float = 1.0
    op: ClassVar[Op] = "rescale"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", _vector(self.vector, "vector", self.op, direction=True))
        object.__setattr__(self, "coeff", _number(self.coeff, "coeff"))

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "scale": self.coeff}


@dataclass(frozen=True, eq=False, repr=False)
class NormScaledAddSpec(OpSpec):
    """Add ``strength * |x| * vector``, its norm capped at ``max_fraction * |x|`` (our
    ``op="norm_add"`` with ``scale=strength``; ``max_fraction=None``: no cap). ``vector`` is
    added as given; ``normalize=True`` makes it unit length first."""

    vector: torch.Tensor
    strength: float
    max_fraction: float | None = 1.0
    normalize: bool = False
    op: ClassVar[Op] = "norm_add"

    def __post_init__(self) -> None:
        vector = _vector(self.vector, "vector", self.op, direction=bool(self.normalize))
        object.__setattr__(self, "vector", _unit(vector) if self.normalize else vector)
        object.__setattr__(self, "strength", _number(self.strength, "strength"))
        fraction = as_bound(self.max_fraction, "max_fraction")
        if fraction is not None and fraction <= 0:
            raise InvalidSteering(f"max_fraction must be > 0 (a fraction of |x|), got {fraction}")
        object.__setattr__(self, "max_fraction", fraction)
        object.__setattr__(self, "normalize", bool(self.normalize))

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "scale": self.strength, "max_fraction": self.max_fraction}


@dataclass(frozen=True, eq=False, repr=False)
class AblateSpec(OpSpec):
    """Remove the component along ``vector``: ``x - scale (x . d) d`` (our ``op="ablate"``;
    ``scale`` 1, the default, removes all of it)."""

    vector: torch.Tensor
    scale: float = 1.0
    op: ClassVar[Op] = "ablate"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", _vector(self.vector, "vector", self.op, direction=True))
        object.__setattr__(self, "scale", _number(self.scale, "scale"))

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "scale": self.scale}


@dataclass(frozen=True, eq=False, repr=False)
class SwapSpec(OpSpec):
    """Move the component along ``vector`` onto ``target``: ``x + scale (x . d) (t - d)`` with
    ``d``, ``t`` the unit vectors (our ``op="swap"``; ``scale`` 1, the default, is the whole move)."""

    vector: torch.Tensor
    target: torch.Tensor
    scale: float = 1.0
    op: ClassVar[Op] = "swap"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", _vector(self.vector, "vector", self.op, direction=True))
        object.__setattr__(self, "target", _vector(self.target, "target", self.op, direction=True))
        if self.target.shape != self.vector.shape:
            raise InvalidSteering(
                f"the target has width {self.target.shape[0]} but the vector has width {self.vector.shape[0]}; "
                "they must match"
            )
        object.__setattr__(self, "scale", _number(self.scale, "scale"))

    def write_args(self) -> dict[str, Any]:
        return {"vector": self.vector, "op": self.op, "scale": self.scale, "target": self.target}


OP_SPECS: tuple[type[OpSpec], ...] = (  # each named by its row's op_object
    AddSpec,
    ProjectionCapSpec,
    OrthogonalDecompSpec,
    NormScaledAddSpec,
    AblateSpec,
    SwapSpec,
)
"""Every op object class, each writing a different row of the op registry."""

_BY_NAME: dict[str, type[OpSpec]] = {cls.__name__: cls for cls in OP_SPECS}


def op_spec(
    op: str,
    vector: torch.Tensor,
    *,
    scale: float,
    target: torch.Tensor | None,
    lo: float | None,
    hi: float | None,
    max_fraction: float | None,
) -> OpSpec:
    """The op object that writes ``op`` with these parameters (a write's own, read back): the
    one its row of the registry names (:attr:`OpRow.op_object <interp_engine.steering._writes.OpRow>`);
    ``InvalidSteering`` for an op with none (``set``)."""
    name = op_row(op).op_object
    cls = _BY_NAME.get(name) if name is not None else None
    if cls is None:
        objects = ", ".join(f"{c.__name__} ({c.op})" for c in OP_SPECS)
        raise InvalidSteering(f"op={op!r} has no op object (they are {objects}); keep it as a Write")
    if cls is AddSpec:
        return AddSpec(vector, scale)
    if cls is ProjectionCapSpec:
        return ProjectionCapSpec(vector, min=lo, max=hi)
    if cls is OrthogonalDecompSpec:
        return OrthogonalDecompSpec(vector, coeff=scale)
    if cls is NormScaledAddSpec:
        return NormScaledAddSpec(vector, strength=scale, max_fraction=max_fraction)
    if cls is AblateSpec:
        return AblateSpec(vector, scale=scale)
    if target is None:
        raise InvalidSteering("a swap needs a target direction")
    return SwapSpec(vector, target, scale=scale)


@dataclass(frozen=True, eq=False)
class LayerSteeringSpec:
    """The op objects applied at one layer, in order (``SteeringSpec(layers={10:
    LayerSteeringSpec(operations=[AddSpec(vector=v, scale=4.0)])})``)."""

    operations: tuple[OpSpec, ...] = ()

    def __init__(self, operations: Iterable[OpSpec] = ()) -> None:
        if isinstance(operations, OpSpec):
            operations = [operations]
        ops = tuple(operations)
        for item in ops:
            if not isinstance(item, OpSpec):
                names = ", ".join(c.__name__ for c in OP_SPECS)
                raise InvalidSteering(
                    f"LayerSteeringSpec.operations holds op objects ({names}), got {type(item).__name__}"
                )
        object.__setattr__(self, "operations", ops)

    def __iter__(self) -> Iterator[OpSpec]:
        return iter(self.operations)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayerSteeringSpec):
            return NotImplemented
        return len(self.operations) == len(other.operations) and all(
            a == b for a, b in zip(self.operations, other.operations, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LayerSteeringSpec(operations={list(self.operations)!r})"


@dataclass(frozen=True, eq=False, repr=False)
class SteerSpec:
    """The public ``interp-engine`` package's lower-level steering form: one op at
    ``Address(point, layer)``, every position, named by ``method`` as that package spells it.
    It builds the op object of the same row of our op registry (:meth:`op_spec`), so a list of
    them is taken wherever a list of specs is (``steer(model, [SteerSpec(vector=v, layer=10,
    coeff=4.0)])``, ``steering_spec=``), on every backend, and is the same value as
    ``SteeringSpec.at(f"resid_post.{layer}", AddSpec(vector=v, scale=4.0))``.

    =====================  ==========================  ======================================
    ``method``             op object (our op)          fields read
    =====================  ==========================  ======================================
    ``"additive"``         ``AddSpec`` (``add``)        ``coeff`` (the scale), ``normalize``
    ``"orthogonal"``       ``OrthogonalDecompSpec``    ``coeff``
    ``"projection_cap"``   ``ProjectionCapSpec``       ``min``, ``max``
    ``"norm_scaled_add"``  ``NormScaledAddSpec``       ``coeff`` (the strength), ``max_fraction``, ``normalize``
    ``"ablate"``           ``AblateSpec``              (the whole component)
    ``"swap"``             ``SwapSpec``                ``target``
    =====================  ==========================  ======================================

    ``stream`` (a residual stream of a hyper-connection trunk) must be ``None``: no family served
    here has several residual streams. The op object is built, and checked, when the spec is made.
    """

    vector: torch.Tensor
    layer: int
    coeff: float = 1.0
    method: str = "additive"
    point: str = "resid_post"
    normalize: bool = False
    stream: int | None = None
    min: float | None = None
    max: float | None = None
    max_fraction: float | None = 1.0
    target: torch.Tensor | None = None

    def __post_init__(self) -> None:
        methods = {row.steer_method: row for row in OP_ROWS if row.steer_method is not None}
        method = str(self.method.value if hasattr(self.method, "value") else self.method)
        if method not in methods:
            raise InvalidSteering(
                f"unknown SteerSpec method {short_repr(self.method)}; expected one of {', '.join(methods)}"
            )
        object.__setattr__(self, "method", method)
        index = as_index(self.layer)
        if index is None:
            raise InvalidSteering(f"SteerSpec.layer is a layer index (an int), got {short_repr(self.layer)}")
        object.__setattr__(self, "layer", index)
        if not isinstance(self.point, str) or "." in self.point:
            raise InvalidSteering(
                f"SteerSpec.point is a kind without a layer (such as 'resid_post'), got {short_repr(self.point)}"
            )
        if self.stream is not None:
            raise InvalidSteering(
                f"stream={self.stream!r} names one residual stream of a hyper-connection trunk; no family served "
                "here has several (every model has one residual stream): leave stream=None"
            )
        object.__setattr__(self, "_address", Address(self.point, index))
        object.__setattr__(self, "_op", self._build(methods[method].name))

    def _build(self, op: Op) -> OpSpec:
        if op == "add":
            return AddSpec(self.vector, scale=self.coeff, normalize=self.normalize)
        if op == "rescale":
            return OrthogonalDecompSpec(self.vector, coeff=self.coeff)
        if op == "cap":
            return ProjectionCapSpec(self.vector, min=self.min, max=self.max)
        if op == "norm_add":
            return NormScaledAddSpec(
                self.vector, strength=self.coeff, max_fraction=self.max_fraction, normalize=self.normalize
            )
        if op == "ablate":
            return AblateSpec(self.vector)
        if self.target is None:
            raise InvalidSteering("SteerSpec(method='swap') needs target=, the direction the component moves onto")
        return SwapSpec(self.vector, self.target)

    def op_spec(self) -> OpSpec:
        """The op object this spec writes (:class:`AddSpec`, ...), at :attr:`address`."""
        built: OpSpec = object.__getattribute__(self, "_op")
        return built

    @property
    def address(self) -> Address:
        """Where it writes, ``Address(point, layer)``."""
        where: Address = object.__getattribute__(self, "_address")
        return where

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteerSpec):
            return NotImplemented
        return self.address == other.address and self.op_spec() == other.op_spec()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SteerSpec({str(self.address)!r}, {self.op_spec()!r})"
