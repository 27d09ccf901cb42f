"""Steering specs: declarative, serialisable writes into the forward pass.

A :class:`SteeringSpec` is a list of :class:`Write` values. It carries no callables, so it can
cross process boundaries (vLLM workers) and arrive in an HTTP request as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._errors import InvalidSteering
from ..addresses._address import Address, AddressLike, as_address
from ..chat._spans import is_span_name, span_positions
from ._ops import LayerSteeringSpec, OpSpec, SteerSpec, op_spec
from ._writes import OPS as OPS
from ._writes import Op as Op
from ._writes import OpArgs, apply_op, check_op_args, op_row

if TYPE_CHECKING:
    from ..sae._sae import Sae

from ._values import (
    FLOAT32_MAX,
    Positions,
    as_bound,
    as_heads,
    as_index,
    as_positions,
    as_vector,
    check_shape,
    finite_float,
    short_repr,
)


@dataclass(frozen=True, eq=False)
class Write:
    """One write into the forward pass at ``address``.

    With ``d = vector / |vector|`` (per row) and ``p = x . d`` over the last axis:

    - ``op="add"``: ``x + scale * vector``;
    - ``op="set"``: ``x := scale * vector`` (activation patching: pass another run's activations);
    - ``op="ablate"``: ``x - scale * p d`` (directional ablation);
    - ``op="cap"``: ``x + (clamp(p, lo, hi) - p) d`` (projection capping; ``lo``, ``hi`` or both,
      ``scale`` stays 1);
    - ``op="rescale"``: ``x + (scale - 1) p d`` (the component along ``d`` times ``scale``, the
      rest kept);
    - ``op="norm_add"``: ``x + scale * |x| * vector`` with ``vector`` as given (pass a unit vector
      for ``scale * |x| * d``); with ``max_fraction`` the added vector's norm is at most
      ``max_fraction * |x|``;
    - ``op="swap"``: ``x + scale * p (t - d)`` with ``t = target / |target|`` (the component
      along ``d`` moved onto ``t``; ``scale`` 1 is the whole move).

    ``vector`` is ``[width]`` (the same vector at every selected position) or
    ``[n_positions, width]`` (one row per selected position, in order); ``target`` follows the
    same rules, independently. ``positions`` is ``"all"``, ``"prompt"``, ``"generated"``,
    explicit sequence indices (negative ones count back from the end of the prompt) or a chat span
    name (``"user[-1].last"``, ``"assistant"``, ``"reasoning[0]"``: :mod:`interp_engine.chat`),
    resolved per request against its prompt's :class:`~interp_engine.ChatTokens`. Vectors are
    stored as float32 on the CPU.

    At a head address (``attn_z``, ``attn_v``) a write works per head: ``heads=[h, ...]`` picks
    the heads (default: every head; the others are untouched, bit for bit) and ``vector`` is
    ``[d_head]`` (the same for each listed head), ``[len(heads), d_head]`` (one row per head) or
    ``[n_positions, len(heads), d_head]`` (per position, e.g. another run's captured heads).
    Every op works per head there (``p`` and ``|x|`` are per head). Zero-ablating head 3 of
    layer 1 is ``Write("attn_z.1", torch.zeros(d_head), op="set", heads=[3])``.

    At ``router_logits`` (an ``add`` or ``set``) a vector may hold ``-inf``: the router then never
    picks that expert, its weight is 0 and the others are renormalised as the family does. Ablating
    expert 2 of layer 1 is ``Write("router_logits.1", v, op="add")`` with ``v`` zeros and
    ``v[2] = -inf``. JSON has no infinity: over HTTP use a large negative number (``-1e30``), which
    routes identically (the softmax of it is 0 in float32). NaN and ``+inf`` are refused everywhere.
    """

    address: Address
    vector: torch.Tensor
    op: Op = "add"
    scale: float = 1.0
    positions: Positions = "all"
    heads: tuple[int, ...] | None = None
    target: torch.Tensor | None = None
    lo: float | None = None
    hi: float | None = None
    max_fraction: float | None = None

    def __init__(
        self,
        address: AddressLike,
        vector: Any,
        op: str = "add",
        scale: float = 1.0,
        positions: Any = "all",
        heads: Any = None,
        *,
        target: Any = None,
        lo: float | None = None,
        hi: float | None = None,
        max_fraction: float | None = None,
    ) -> None:
        addr = as_address(address)
        if not addr.info.writable:
            raise InvalidSteering(f"cannot write at {addr}: {addr.kind} is read-only")
        row = op_row(op)
        factor = finite_float(scale)
        if factor is None:
            raise InvalidSteering(f"scale must be a finite number, got {short_repr(scale)}")
        if abs(factor) > FLOAT32_MAX:
            raise InvalidSteering(f"scale {factor:g} overflows float32 activations (largest finite: {FLOAT32_MAX:g})")
        low, high = as_bound(lo, "lo"), as_bound(hi, "hi")
        fraction = as_bound(max_fraction, "max_fraction")
        check_op_args(op, OpArgs(factor, target, low, high, fraction))
        # an expert is ablated by its router logit at -inf (an elementwise op: add or set); nowhere
        # else is inf allowed
        expert_ablation = addr.kind == "router_logits" and not row.whole_row
        tensor = as_vector(vector, allow_neg_inf=expert_ablation)
        if expert_ablation and bool(torch.isneginf(tensor).any()) and factor <= 0:
            raise InvalidSteering(f"a -inf router logit needs scale > 0 (scale {factor:g} would make it NaN or +inf)")
        finite = tensor.masked_fill(torch.isneginf(tensor), 0.0) if expert_ablation else tensor
        if not row.direction and not bool(torch.isfinite(finite * factor).all()):
            raise InvalidSteering(
                f"scale {factor:g} times the vector overflows float32 (largest finite: {FLOAT32_MAX:g}); "
                "use a smaller scale"
            )
        selected = as_heads(heads)
        check_shape(addr, tensor, op, selected)
        if row.direction and bool((tensor.norm(dim=-1) == 0).any()):
            raise InvalidSteering(f"cannot {op} along a zero vector: {op} uses vector as a direction")
        onto = None
        if target is not None:
            onto = as_vector(target, "target")
            check_shape(addr, onto, op, selected, "target")
            if onto.shape[-1] != tensor.shape[-1]:
                raise InvalidSteering(
                    f"the target has width {onto.shape[-1]} but the vector has width {tensor.shape[-1]}; "
                    "they must match"
                )
            if bool((onto.norm(dim=-1) == 0).any()):
                raise InvalidSteering("cannot swap onto a zero target: target is a direction")
        object.__setattr__(self, "address", addr)
        object.__setattr__(self, "vector", tensor)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "scale", factor)
        object.__setattr__(self, "positions", as_positions(positions))
        object.__setattr__(self, "heads", selected)
        object.__setattr__(self, "target", onto)
        object.__setattr__(self, "lo", low)
        object.__setattr__(self, "hi", high)
        object.__setattr__(self, "max_fraction", fraction)

    @property
    def width(self) -> int:
        """The width the vector must match at its address (``d_head`` at head addresses)."""
        return int(self.vector.shape[-1])

    def _per_position(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() == (3 if self.address.info.per_head else 2)

    def _head_rows(self, tensor: torch.Tensor) -> int | None:
        if not self.address.info.per_head or tensor.dim() == 1:
            return None
        return int(tensor.shape[-2])

    @property
    def per_position(self) -> bool:
        """Whether the vector holds one row per selected position (its first axis)."""
        return self._per_position(self.vector)

    @property
    def head_rows(self) -> int | None:
        """How many heads the vector has rows for (``None``: one row shared by every head)."""
        return self._head_rows(self.vector)

    @property
    def target_per_position(self) -> bool:
        """Whether ``target`` holds one row per selected position (``False`` without a target)."""
        return self.target is not None and self._per_position(self.target)

    @property
    def target_head_rows(self) -> int | None:
        """How many heads ``target`` has rows for (``None``: shared by every head, or no target)."""
        return None if self.target is None else self._head_rows(self.target)

    def apply(
        self, x: torch.Tensor, vector: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` with this write applied (a new tensor; ``x`` is not modified).

        ``x`` is ``[..., width]`` rows at residual-type addresses and ``[..., n_heads, d_head]`` at
        head addresses, where only the selected heads change. ``vector`` and ``target`` are the
        tensors to use for these rows (default :attr:`vector` / :attr:`target`); for a
        per-position write, the backend passes the rows that belong to ``x``'s positions
        (``[n, width]`` or ``[n, len(heads), d_head]``), for the vector and for a per-position target.
        """
        vec = self.vector if vector is None else vector
        onto = self.target if target is None else target

        def op(rows: torch.Tensor) -> torch.Tensor:
            return apply_op(
                self.op, self.scale, rows, vec, target=onto, lo=self.lo, hi=self.hi, max_fraction=self.max_fraction
            )

        if not self.address.info.per_head or self.heads is None:
            return op(x)
        index = torch.tensor(self.heads, device=x.device)
        changed = op(x.index_select(-2, index))
        return x.index_copy(x.dim() - 2, index, changed)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Write):
            return NotImplemented
        same_target = (self.target is None and other.target is None) or (
            self.target is not None and other.target is not None and torch.equal(self.target, other.target)
        )
        return (
            self.address == other.address
            and self.op == other.op
            and self.scale == other.scale
            and self.positions == other.positions
            and self.heads == other.heads
            and torch.equal(self.vector, other.vector)
            and same_target
            and (self.lo, self.hi, self.max_fraction) == (other.lo, other.hi, other.max_fraction)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        extra = "" if self.heads is None else f", heads={list(self.heads)}"
        if self.target is not None:
            extra += f", target=<{list(self.target.shape)}>"
        for name in ("lo", "hi", "max_fraction"):
            if getattr(self, name) is not None:
                extra += f", {name}={getattr(self, name)}"
        return (
            f"Write({str(self.address)!r}, <{list(self.vector.shape)}>, op={self.op!r}, "
            f"scale={self.scale}, positions={self.positions!r}{extra})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): tensors as nested lists of floats; unset optional fields
        (``heads``, ``target``, ``lo``, ``hi``, ``max_fraction``) are left out."""
        positions: Any = self.positions if isinstance(self.positions, str) else list(self.positions)
        data: dict[str, Any] = {
            "address": str(self.address),
            "vector": self.vector.tolist(),
            "op": self.op,
            "scale": self.scale,
            "positions": positions,
        }
        if self.heads is not None:
            data["heads"] = list(self.heads)
        if self.target is not None:
            data["target"] = self.target.tolist()
        for name in ("lo", "hi", "max_fraction"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Write:
        """Read what :meth:`to_dict` wrote (validated like the constructor)."""
        if not isinstance(data, dict) or "address" not in data or "vector" not in data:
            raise InvalidSteering(f"a write needs at least 'address' and 'vector', got {data!r:.200}")
        unknown = set(data) - set(WRITE_FIELDS)
        if unknown:
            raise InvalidSteering(f"unknown write fields: {sorted(unknown)}; valid fields: {', '.join(WRITE_FIELDS)}")
        return cls(
            data["address"],
            data["vector"],
            op=data.get("op", "add"),
            scale=data.get("scale", 1.0),
            positions=data.get("positions", "all"),
            heads=data.get("heads"),
            target=data.get("target"),
            lo=data.get("lo"),
            hi=data.get("hi"),
            max_fraction=data.get("max_fraction"),
        )


WRITE_FIELDS = ("address", "vector", "op", "scale", "positions", "heads", "target", "lo", "hi", "max_fraction")
"""The fields of a write's plain-data form (:meth:`Write.to_dict`)."""


FeatureOp = Literal["clamp", "add", "ablate"]
FEATURE_OPS: tuple[FeatureOp, ...] = ("clamp", "add", "ablate")
FEATURE_WRITE_FIELDS = ("sae", "feature", "op", "value", "positions", "address")
"""The fields of a feature write's plain-data form (:meth:`FeatureWrite.to_dict`)."""


@dataclass(frozen=True)
class FeatureWrite:
    """A write by SAE feature: the SAE attached to the model as ``sae`` is referenced by name.

    With ``f_i(x)`` feature ``feature``'s activation on ``x`` and ``d_i`` its decoder direction
    (``W_dec[i]``):

    - ``op="clamp"``: ``x + (value - f_i(x)) d_i`` -- the feature set to ``value``, the SAE's
      error term kept (only the feature's contribution to the reconstruction changes);
    - ``op="ablate"``: the clamp to 0;
    - ``op="add"``: ``x + value * d_i`` (a transcoder's ``add`` writes at its output address).

    On a transcoder the feature is read at its input address and its decoder written at its
    output address: ``clamp`` is ``y + (value - f_i(x)) d_i`` with ``x`` the transcoder's input
    and ``y`` the MLP output there (so the MLP's output stays reconstruction + error, with only
    feature ``i``'s part changed); served where the backend can read both in one forward
    (``ModelBase.transcoder_clamps``).

    ``positions`` as for :class:`Write`. ``address`` is filled in by the model from the
    attached SAE when a request is checked (leave it ``None``); a transcoder's is its output
    address.
    """

    sae: str
    feature: int
    op: FeatureOp = "clamp"
    value: float = 0.0
    positions: Positions = "all"
    address: Address | None = None

    def __init__(
        self,
        sae: str,
        feature: int,
        op: str = "clamp",
        value: float = 0.0,
        positions: Any = "all",
        *,
        address: AddressLike | None = None,
    ) -> None:
        if not isinstance(sae, str) or not sae:
            raise InvalidSteering(f"a feature write names an attached SAE, got sae={sae!r}")
        feature_id = as_index(feature)
        if feature_id is None or feature_id < 0:
            raise InvalidSteering(f"feature must be a feature id >= 0, got {short_repr(feature)}")
        if not isinstance(op, str) or op not in FEATURE_OPS:
            raise InvalidSteering(f"unknown feature op {op!r}; valid feature ops: {', '.join(FEATURE_OPS)}")
        number = finite_float(value)
        if number is None or abs(number) > FLOAT32_MAX:
            raise InvalidSteering(f"value must be a finite float32 number, got {short_repr(value)}")
        if op == "ablate" and number != 0.0:
            raise InvalidSteering(f"ablate clamps the feature to 0 and takes no value; got value={number}")
        object.__setattr__(self, "sae", sae)
        object.__setattr__(self, "feature", feature_id)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "value", number)
        object.__setattr__(self, "positions", as_positions(positions))
        object.__setattr__(self, "address", None if address is None else as_address(address))

    # what position checks and backends read of any write
    heads = None
    target = None
    per_position = False
    target_per_position = False

    def bound(self, address: Address) -> FeatureWrite:
        """This write placed at ``address`` (the model does it from the attached SAE)."""
        return FeatureWrite(self.sae, self.feature, self.op, self.value, self.positions, address=address)

    def apply(self, x: torch.Tensor, sae: Sae, *, source: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (rows ``[..., width]``) with this write applied through ``sae`` (an
        :class:`~interp_engine.Sae`); a new tensor in ``x``'s dtype. For a transcoder, ``x`` is
        the rows at its output address and ``source`` the same positions' rows at its input
        address (what the feature is read from)."""
        rows = x.float()
        if rows.dim() >= 2 and rows.shape[-1] != sae.d_out:  # a head address: [..., heads, d_head]
            rows = rows.flatten(-2)
        if sae.is_transcoder and self.op != "add":
            if source is None:
                raise InvalidSteering(
                    f"a {self.op} of transcoder {self.sae!r} reads the feature at {sae.address}: pass source="
                )
            read_from = source.float()
            direction = sae.feature_direction(self.feature).to(device=x.device, dtype=torch.float32)
        else:
            read_from = rows
            direction = sae.feature_direction(self.feature, x=rows).to(device=x.device, dtype=torch.float32)
        if self.op == "add":
            out = rows + self.value * direction
        else:
            current = sae.encode(read_from)[..., self.feature : self.feature + 1].to(torch.float32)
            out = rows + (self.value - current) * direction
        result: torch.Tensor = out.reshape(x.shape).to(x.dtype)
        return result

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); ``address`` only once bound."""
        positions: Any = self.positions if isinstance(self.positions, str) else list(self.positions)
        data: dict[str, Any] = {
            "sae": self.sae,
            "feature": self.feature,
            "op": self.op,
            "value": self.value,
            "positions": positions,
        }
        if self.address is not None:
            data["address"] = str(self.address)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureWrite:
        if not isinstance(data, dict) or "sae" not in data or "feature" not in data:
            raise InvalidSteering(f"a feature write needs 'sae' and 'feature', got {data!r:.200}")
        unknown = set(data) - set(FEATURE_WRITE_FIELDS)
        if unknown:
            raise InvalidSteering(
                f"unknown feature write fields: {sorted(unknown)}; valid fields: {', '.join(FEATURE_WRITE_FIELDS)}"
            )
        return cls(
            data["sae"],
            data["feature"],
            op=data.get("op", "clamp"),
            value=data.get("value", 0.0),
            positions=data.get("positions", "all"),
            address=data.get("address"),
        )


AnyWrite = Write | FeatureWrite


@dataclass(frozen=True)
class SteeringSpec:
    """A per-request list of writes (:class:`Write` and :class:`FeatureWrite`), applied in
    order, only to the request that carries it.

    The public ``interp-engine`` package's spelling builds the same value: ``layers`` maps layer
    indices to a :class:`LayerSteeringSpec` (or a list) of op objects (:class:`AddSpec`,
    :class:`ProjectionCapSpec`, :class:`OrthogonalDecompSpec`, :class:`NormScaledAddSpec`,
    :class:`AblateSpec`, :class:`SwapSpec`), each written at ``Address(point, layer)`` at every
    position, layers in the mapping's order (``point`` defaults to ``"resid_post"``)::

        SteeringSpec(layers={10: LayerSteeringSpec(operations=[AddSpec(vector=v, scale=4.0)])})
        # is
        SteeringSpec([Write("resid_post.10", v, op="add", scale=4.0)])

    Writes given with ``layers`` come first. :meth:`at` builds a spec from an address and op
    objects; :attr:`layers` and :attr:`point` read a spec back in that form where it has one.
    ``stream`` (a residual stream of a hyper-connection trunk) must be ``None``: no family served
    here has several residual streams.
    """

    writes: tuple[AnyWrite, ...] = field(default_factory=tuple)

    def __init__(
        self,
        writes: Iterable[AnyWrite] | Mapping[int, Any] = (),
        *,
        layers: Mapping[int, Any] | None = None,
        point: str | None = None,
        stream: int | None = None,
    ) -> None:
        items: tuple[AnyWrite, ...] = ()
        if isinstance(writes, Mapping):  # SteeringSpec({10: LayerSteeringSpec(...)}): the public package's layers
            if layers is not None:
                raise InvalidSteering("SteeringSpec got layers twice: as its first argument and as layers=")
            layers = writes
        else:
            items = tuple(writes)
        for item in items:
            if not isinstance(item, (Write, FeatureWrite)):
                raise InvalidSteering(f"a SteeringSpec holds Write and FeatureWrite values, got {type(item).__name__}")
        if stream is not None:
            raise InvalidSteering(
                f"stream={stream!r} names one residual stream of a hyper-connection trunk; no family served here "
                "has several (every model has one residual stream): leave stream=None"
            )
        if layers is not None:
            items += _layer_writes(layers, "resid_post" if point is None else point)
        elif point is not None:
            raise InvalidSteering(
                f"point={point!r} names where layers= writes; without layers= there is nothing to write there "
                "(SteeringSpec.at(address, *ops) writes op objects at one address)"
            )
        object.__setattr__(self, "writes", items)

    @classmethod
    def at(cls, address: AddressLike, *ops: OpSpec, positions: Any = "all") -> SteeringSpec:
        """The op objects ``ops`` written at ``address`` in order, e.g. ``SteeringSpec.at("mlp_out.12",
        ProjectionCapSpec(vector=v, max=2.0))``; ``positions`` as for :class:`Write`."""
        where = as_address(address)
        for item in ops:
            if not isinstance(item, OpSpec):
                raise InvalidSteering(
                    f"SteeringSpec.at takes op objects after the address (AddSpec, ProjectionCapSpec, ...), "
                    f"got {type(item).__name__}; a Write goes in SteeringSpec([...])"
                )
        return cls([Write(where, positions=positions, **item.write_args()) for item in ops])

    @classmethod
    def combine(cls, specs: Iterable[SteeringSpec | SteerSpec | None]) -> SteeringSpec:
        """One spec with every write of ``specs`` in list order (``None`` entries skipped): what a
        list of specs means where one request takes one spec. A :class:`SteerSpec` (the public
        package's lower-level form) is its one write."""
        writes: list[AnyWrite] = []
        for i, spec in enumerate(specs):
            if spec is None:
                continue
            if isinstance(spec, SteerSpec):
                spec = cls.at(spec.address, spec.op_spec())
            if not isinstance(spec, SteeringSpec):
                raise InvalidSteering(
                    f"a list of steering specs holds SteeringSpec (or SteerSpec) values; item {i} is a "
                    f"{type(spec).__name__}"
                )
            writes.extend(spec.writes)
        return cls(writes)

    def is_empty(self) -> bool:
        """Whether the spec writes nothing."""
        return not self.writes

    @property
    def point(self) -> str:
        """The kind every write of this spec writes at (the public package's ``point``);
        ``InvalidSteering`` when the writes are at several kinds or none."""
        kinds = list(dict.fromkeys(w.address.kind for w in self.writes if w.address is not None))
        if len(kinds) != 1 or len(self.writes) != sum(1 for w in self.writes if w.address is not None):
            raise InvalidSteering(
                f"this spec writes at {', '.join(kinds) or 'no address'}, not at one point; read spec.writes "
                "(or split it into one spec per point)"
            )
        return kinds[0]

    @property
    def layers(self) -> dict[int, LayerSteeringSpec]:
        """The writes as ``{layer: LayerSteeringSpec(operations=[op objects])}`` at :attr:`point`
        (``SteeringSpec(layers=spec.layers, point=spec.point) == spec``). ``InvalidSteering`` for a
        spec with no such form: writes at several kinds or a model-level one, an op with no op
        object (``set``), a feature write, positions other than ``"all"``, heads, or one row per
        position; its :attr:`writes` hold everything."""
        self.point  # noqa: B018 (raises unless one point)
        out: dict[int, list[OpSpec]] = {}
        for write in self.writes:
            if not isinstance(write, Write):
                raise InvalidSteering(f"{write!r} is a feature write, which has no op object; read spec.writes")
            reason = _no_op_object(write)
            if reason:
                raise InvalidSteering(f"{write!r} has no op-object form: {reason}; read spec.writes")
            if write.address.layer is None:
                raise InvalidSteering(f"{write!r} is at a model-level address, which has no layer; read spec.writes")
            out.setdefault(write.address.layer, []).append(
                op_spec(
                    write.op,
                    write.vector,
                    scale=write.scale,
                    target=write.target,
                    lo=write.lo,
                    hi=write.hi,
                    max_fraction=write.max_fraction,
                )
            )
        return {layer: LayerSteeringSpec(ops) for layer, ops in out.items()}

    def __iter__(self) -> Iterator[AnyWrite]:
        return iter(self.writes)

    def __len__(self) -> int:
        return len(self.writes)

    def __bool__(self) -> bool:
        return bool(self.writes)

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The addresses written, in order, without repeats (unbound feature writes left out)."""
        return tuple(dict.fromkeys(w.address for w in self.writes if w.address is not None))

    def to_dict(self) -> dict[str, Any]:
        return {"writes": [w.to_dict() for w in self.writes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | Sequence[dict[str, Any]]) -> SteeringSpec:
        """Read ``{"writes": [...]}`` or a bare list of writes."""
        try:
            return cls._from_dict(data)
        except RecursionError:
            raise InvalidSteering("the steering spec is nested too deeply to be a spec") from None

    @classmethod
    def _from_dict(cls, data: dict[str, Any] | Sequence[dict[str, Any]]) -> SteeringSpec:
        if isinstance(data, dict) and set(data) - {"writes"}:
            raise InvalidSteering(f"unknown steering spec fields: {sorted(set(data) - {'writes'})}")
        items = data.get("writes") if isinstance(data, dict) else data
        if not isinstance(items, (list, tuple)):
            raise InvalidSteering("a steering spec is {'writes': [...]} or a list of writes")
        return cls(
            FeatureWrite.from_dict(item) if isinstance(item, dict) and "sae" in item else Write.from_dict(item)
            for item in items
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> SteeringSpec:
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, bytes that are not UTF-8, a number of too many digits
            raise InvalidSteering(f"steering spec is not valid JSON: {str(exc)[:200]}") from None
        except RecursionError:
            raise InvalidSteering("steering spec is not valid JSON: nested too deeply") from None
        return cls.from_dict(data)


def _layer_writes(layers: Mapping[int, Any], point: str) -> tuple[Write, ...]:
    """The writes of ``SteeringSpec(layers=..., point=...)``: each layer's op objects at
    ``Address(point, layer)``, every position."""
    if not isinstance(layers, Mapping):
        raise InvalidSteering(
            f"layers= maps layer indices to LayerSteeringSpec(operations=[...]), got {type(layers).__name__}"
        )
    if not isinstance(point, str):
        raise InvalidSteering(f"point= is a kind such as 'resid_post', got {type(point).__name__}")
    if "." in point:
        raise InvalidSteering(
            f"point= is a kind without a layer (such as 'resid_post'), got {point!r}; layers= gives the layers"
        )
    writes: list[Write] = []
    for layer, ops in layers.items():
        index = as_index(layer)
        if index is None:
            raise InvalidSteering(f"layers= is keyed by layer index (an int), got {short_repr(layer)}")
        held = ops if isinstance(ops, LayerSteeringSpec) else LayerSteeringSpec(ops)
        writes.extend(Write(Address(point, index), **item.write_args()) for item in held.operations)
    return tuple(writes)


def _no_op_object(write: Write) -> str:
    """Why ``write`` has no op-object form (``""``: it has one)."""
    if write.positions != "all":
        return f"positions={write.positions!r} (op objects write every position)"
    if write.heads is not None:
        return "heads= (op objects write whole rows)"
    if write.vector.dim() != 1 or (write.target is not None and write.target.dim() != 1):
        return "one vector row per position or head (op objects hold one vector)"
    if write.op == "set":
        return "op='set' (no op object patches)"
    return ""


RowSpecs = SteeringSpec | SteerSpec | Sequence[SteeringSpec | SteerSpec | None] | None
"""What a batched call takes as ``steering_spec``: one spec for every row (or ``None``), or a list
of one spec (or ``None``) per row; a list of the public package's :class:`SteerSpec` is one spec
for every row."""


def row_specs(steering_spec: Any, n_rows: int) -> list[SteeringSpec | None]:
    """``steering_spec`` as one spec (or ``None``) per row of a batch of ``n_rows``; a single spec
    (or ``None``) is every row's. The same object repeats where rows share a spec."""
    if steering_spec is None or isinstance(steering_spec, SteeringSpec):
        return [steering_spec] * n_rows
    if isinstance(steering_spec, SteerSpec) or _steer_specs(steering_spec):  # the public package's form: every row's
        return [SteeringSpec.combine(_listed(steering_spec))] * n_rows
    if isinstance(steering_spec, (str, bytes, Mapping)) or not isinstance(steering_spec, Sequence):
        raise InvalidSteering(
            f"steering_spec must be a SteeringSpec, None, or a list of one SteeringSpec (or None) per row; "
            f"got a {type(steering_spec).__name__}"
        )
    specs = list(steering_spec)
    if any(isinstance(item, (Write, FeatureWrite)) for item in specs):
        raise InvalidSteering(
            "a list as steering_spec holds one SteeringSpec (or None) per row of the batch, not writes; "
            "wrap writes that apply to every row in SteeringSpec([...])"
        )
    for i, item in enumerate(specs):
        if item is not None and not isinstance(item, (SteeringSpec, SteerSpec)):
            raise InvalidSteering(f"steering_spec[{i}] must be a SteeringSpec or None, got {type(item).__name__}")
    if n_rows == 1 and len(specs) > 1 and all(isinstance(item, (SteeringSpec, SteerSpec)) for item in specs):
        return [SteeringSpec.combine(specs)]  # one prompt: the list is several specs for it, applied in order
    specs = [SteeringSpec.combine([item]) if isinstance(item, SteerSpec) else item for item in specs]
    if len(specs) != n_rows:
        raise InvalidSteering(
            f"steering_spec lists {len(specs)} specs but the batch has {n_rows} rows; give one per row "
            "(None for an unsteered row) or a single SteeringSpec for every row (several specs for every row: "
            "SteeringSpec.combine([...]))"
        )
    return specs


def one_spec(steering_spec: Any) -> SteeringSpec | None:
    """What a one-prompt call takes as ``steering_spec``: a :class:`SteeringSpec`, ``None``, or a
    list of specs applied in list order (:meth:`SteeringSpec.combine`)."""
    if steering_spec is None or isinstance(steering_spec, SteeringSpec):
        return steering_spec
    if isinstance(steering_spec, SteerSpec):
        return SteeringSpec.combine([steering_spec])
    if isinstance(steering_spec, (str, bytes, Mapping)) or not isinstance(steering_spec, Sequence):
        raise InvalidSteering(
            f"steering_spec must be a SteeringSpec, a list of them (applied in order) or None, "
            f"got {type(steering_spec).__name__}"
        )
    if any(isinstance(item, (Write, FeatureWrite)) for item in steering_spec):
        raise InvalidSteering(
            "a list as steering_spec holds SteeringSpec values, not writes; wrap writes in SteeringSpec([...])"
        )
    return SteeringSpec.combine(steering_spec)


def _steer_specs(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of the public package's :class:`SteerSpec` only."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(item, SteerSpec) for item in value)


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def named_positions(spec: SteeringSpec | None) -> bool:
    """Whether any write of ``spec`` names its positions by chat span."""
    return spec is not None and any(is_span_name(w.positions) for w in spec.writes)


def resolve_named_positions(spec: SteeringSpec | None, tokens: Any, n_prompt: int) -> SteeringSpec | None:
    """``spec`` with each write whose positions name chat spans replaced by the same write at the
    absolute positions they select in ``tokens`` (a :class:`~interp_engine.ChatTokens`); ``spec``
    itself when no write names a span. ``InvalidSteering`` when ``tokens`` has no spans or a name
    selects nothing."""
    if spec is None or not named_positions(spec):
        return spec
    writes: list[AnyWrite] = []
    for write in spec.writes:
        if is_span_name(write.positions):
            found = tuple(span_positions(str(write.positions), tokens, n_prompt))
            write = dataclasses.replace(write, positions=found)
        writes.append(write)
    return SteeringSpec(writes)
