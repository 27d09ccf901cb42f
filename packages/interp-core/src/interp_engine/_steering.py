"""Steering specs: declarative, serialisable writes into the forward pass.

A :class:`SteeringSpec` is a list of :class:`Write` values. It carries no callables, so it can
cross process boundaries (vLLM workers) and arrive in an HTTP request as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._address import Address, AddressLike, as_address
from ._errors import InvalidSteering
from ._writes import apply_op

Op = Literal["add", "set", "ablate"]
OPS: tuple[Op, ...] = ("add", "set", "ablate")
PositionsName = Literal["all", "prompt", "generated"]
Positions = PositionsName | tuple[int, ...]
POSITION_NAMES: tuple[PositionsName, ...] = ("all", "prompt", "generated")


def _as_vector(value: Any) -> torch.Tensor:
    try:
        tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidSteering(f"a steering vector must be a tensor or a list of floats: {exc}") from None
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
        raise InvalidSteering(f"a steering vector must hold real numbers, got dtype {tensor.dtype}")
    tensor = tensor.to(device="cpu", dtype=torch.float32).contiguous().clone()  # never alias the caller's
    if tensor.dim() not in (1, 2, 3) or tensor.numel() == 0:
        raise InvalidSteering(f"a steering vector is [width] or [n_positions, width], got shape {list(tensor.shape)}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidSteering("the steering vector contains NaN or infinite values")
    return tensor


def _as_heads(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        heads = tuple(value)
    except TypeError:
        raise InvalidSteering(f"heads must be a list of head indices, got {value!r}") from None
    if not heads or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads):
        raise InvalidSteering(f"heads must be a non-empty list of head indices >= 0, got {value!r}")
    if len(set(heads)) != len(heads):
        raise InvalidSteering(f"heads repeat an index: {list(heads)}")
    return heads


def _check_shape(address: Address, tensor: torch.Tensor, op: str, heads: tuple[int, ...] | None) -> None:
    """The vector shapes a write at ``address`` accepts (see :class:`Write`)."""
    shape = list(tensor.shape)
    if not address.info.per_head:
        if heads is not None:
            raise InvalidSteering(
                f"heads= selects attention heads at a head address (attn_z, attn_v); {address} has no head axis"
            )
        if tensor.dim() == 3:
            raise InvalidSteering(f"a steering vector is [width] or [n_positions, width], got shape {shape}")
        if op == "ablate" and tensor.dim() != 1:
            raise InvalidSteering("ablate takes one direction of shape [width]")
        return
    if op == "ablate" and tensor.dim() == 3:
        raise InvalidSteering(f"ablate at {address} takes a direction [d_head] or one per head [heads, d_head]")
    if heads is not None and tensor.dim() >= 2 and tensor.shape[-2] != len(heads):
        raise InvalidSteering(
            f"the vector for {address} has {tensor.shape[-2]} head rows (shape {shape}) but heads= lists "
            f"{len(heads)} heads; give [d_head], [len(heads), d_head] or [n_positions, len(heads), d_head]"
        )


def _as_positions(value: Any) -> Positions:
    if isinstance(value, str):
        if value not in POSITION_NAMES:
            raise InvalidSteering(
                f"unknown positions {value!r}; use one of {', '.join(POSITION_NAMES)} or a list of indices"
            )
        return value  # narrowed: checked against POSITION_NAMES
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        indices = tuple(value)
    except TypeError:
        raise InvalidSteering(
            f"positions must be 'all', 'prompt', 'generated' or a list of ints, got {value!r}"
        ) from None
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise InvalidSteering(f"explicit positions must be a non-empty list of ints, got {value!r}")
    if len(set(indices)) != len(indices):
        raise InvalidSteering(f"explicit positions repeat an index: {list(indices)}")
    return indices


@dataclass(frozen=True, eq=False)
class Write:
    """One write into the forward pass at ``address``.

    - ``op="add"``: ``x + scale * vector``;
    - ``op="set"``: ``x := scale * vector`` (activation patching: pass another run's activations);
    - ``op="ablate"``: ``x - scale * (x . d) d`` with ``d = vector / |vector|`` (directional ablation).

    ``vector`` is ``[width]`` (the same vector at every selected position) or
    ``[n_positions, width]`` (one row per selected position, in order). ``positions`` is
    ``"all"``, ``"prompt"``, ``"generated"`` or explicit sequence indices (negative ones count
    back from the end of the prompt). The vector is stored as float32 on the CPU.

    At a head address (``attn_z``, ``attn_v``) a write works per head: ``heads=[h, ...]`` picks
    the heads (default: every head; the others are untouched, bit for bit) and ``vector`` is
    ``[d_head]`` (the same for each listed head), ``[len(heads), d_head]`` (one row per head) or
    ``[n_positions, len(heads), d_head]`` (per position, e.g. another run's captured heads).
    ``ablate`` removes a direction per head. Zero-ablating head 3 of layer 1 is
    ``Write("attn_z.1", torch.zeros(d_head), op="set", heads=[3])``.
    """

    address: Address
    vector: torch.Tensor
    op: Op = "add"
    scale: float = 1.0
    positions: Positions = "all"
    heads: tuple[int, ...] | None = None

    def __init__(
        self,
        address: AddressLike,
        vector: Any,
        op: str = "add",
        scale: float = 1.0,
        positions: Any = "all",
        heads: Any = None,
    ) -> None:
        addr = as_address(address)
        if not addr.info.writable:
            raise InvalidSteering(f"cannot write at {addr}: {addr.kind} is read-only")
        if op not in OPS:
            raise InvalidSteering(f"unknown steering op {op!r}; valid ops: {', '.join(OPS)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InvalidSteering(f"scale must be a finite number, got {scale!r}")
        tensor = _as_vector(vector)
        selected = _as_heads(heads)
        _check_shape(addr, tensor, op, selected)
        if op == "ablate" and bool((tensor.norm(dim=-1) == 0).any()):
            raise InvalidSteering("cannot ablate along a zero vector")
        object.__setattr__(self, "address", addr)
        object.__setattr__(self, "vector", tensor)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "scale", float(scale))
        object.__setattr__(self, "positions", _as_positions(positions))
        object.__setattr__(self, "heads", selected)

    @property
    def width(self) -> int:
        """The width the vector must match at its address (``d_head`` at head addresses)."""
        return int(self.vector.shape[-1])

    @property
    def per_position(self) -> bool:
        """Whether the vector holds one row per selected position (its first axis)."""
        return self.vector.dim() == (3 if self.address.info.per_head else 2)

    @property
    def head_rows(self) -> int | None:
        """How many heads the vector has rows for (``None``: one row shared by every head)."""
        if not self.address.info.per_head or self.vector.dim() == 1:
            return None
        return int(self.vector.shape[-2])

    def apply(self, x: torch.Tensor, vector: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` with this write applied (a new tensor; ``x`` is not modified).

        ``x`` is ``[..., width]`` rows at residual-type addresses and ``[..., n_heads, d_head]`` at
        head addresses, where only the selected heads change. ``vector`` is the vector to use
        for these rows (default :attr:`vector`); for a per-position write, the backend passes the
        rows of the vector that belong to ``x``'s positions (``[n, width]`` or ``[n, len(heads), d_head]``).
        """
        vec = self.vector if vector is None else vector
        if not self.address.info.per_head:
            return apply_op(self.op, self.scale, x, vec)
        if self.heads is None:
            return apply_op(self.op, self.scale, x, vec)
        index = torch.tensor(self.heads, device=x.device)
        changed = apply_op(self.op, self.scale, x.index_select(-2, index), vec)
        return x.index_copy(x.dim() - 2, index, changed)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Write):
            return NotImplemented
        return (
            self.address == other.address
            and self.op == other.op
            and self.scale == other.scale
            and self.positions == other.positions
            and self.heads == other.heads
            and torch.equal(self.vector, other.vector)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Write({str(self.address)!r}, <{list(self.vector.shape)}>, op={self.op!r}, "
            f"scale={self.scale}, positions={self.positions!r}"
            + ("" if self.heads is None else f", heads={list(self.heads)}")
            + ")"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): the vector as nested lists of floats."""
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
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Write:
        """Read what :meth:`to_dict` wrote (validated like the constructor)."""
        if not isinstance(data, dict) or "address" not in data or "vector" not in data:
            raise InvalidSteering(f"a write needs at least 'address' and 'vector', got {data!r:.200}")
        unknown = set(data) - {"address", "vector", "op", "scale", "positions", "heads"}
        if unknown:
            raise InvalidSteering(f"unknown write fields: {sorted(unknown)}")
        return cls(
            data["address"],
            data["vector"],
            op=data.get("op", "add"),
            scale=data.get("scale", 1.0),
            positions=data.get("positions", "all"),
            heads=data.get("heads"),
        )


@dataclass(frozen=True)
class SteeringSpec:
    """A per-request list of writes, applied in order, only to the request that carries it."""

    writes: tuple[Write, ...] = field(default_factory=tuple)

    def __init__(self, writes: Iterable[Write] = ()) -> None:
        items = tuple(writes)
        for item in items:
            if not isinstance(item, Write):
                raise InvalidSteering(f"a SteeringSpec holds Write values, got {type(item).__name__}")
        object.__setattr__(self, "writes", items)

    def __iter__(self) -> Iterator[Write]:
        return iter(self.writes)

    def __len__(self) -> int:
        return len(self.writes)

    def __bool__(self) -> bool:
        return bool(self.writes)

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The addresses written, in order, without repeats."""
        return tuple(dict.fromkeys(w.address for w in self.writes))

    def to_dict(self) -> dict[str, Any]:
        return {"writes": [w.to_dict() for w in self.writes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | Sequence[dict[str, Any]]) -> SteeringSpec:
        """Read ``{"writes": [...]}`` or a bare list of writes."""
        if isinstance(data, dict) and set(data) - {"writes"}:
            raise InvalidSteering(f"unknown steering spec fields: {sorted(set(data) - {'writes'})}")
        items = data.get("writes") if isinstance(data, dict) else data
        if not isinstance(items, (list, tuple)):
            raise InvalidSteering("a steering spec is {'writes': [...]} or a list of writes")
        return cls(Write.from_dict(item) for item in items)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> SteeringSpec:
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise InvalidSteering(f"steering spec is not valid JSON: {exc}") from None
        return cls.from_dict(data)
