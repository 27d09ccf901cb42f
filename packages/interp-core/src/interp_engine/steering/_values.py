"""The values a write is made of, read from what a caller passes: finite numbers, vectors,
bounds, heads, positions (named or explicit), and a short form of any value for messages."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._errors import InvalidSteering
from ..addresses._address import Address
from ..chat._spans import parse_position_name
from ._writes import OPS as OPS
from ._writes import Op as Op
from ._writes import op_row

if TYPE_CHECKING:
    pass

PositionsName = Literal["all", "prompt", "generated"]
Positions = PositionsName | str | tuple[int, ...]
"""``"all"``, ``"prompt"``, ``"generated"``, a chat span name (``"user[-1].last"``, see
:mod:`interp_engine.chat`) or explicit indices."""
POSITION_NAMES: tuple[PositionsName, ...] = ("all", "prompt", "generated")


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite float32: activations are float32, so a scale beyond it overflows them."""


def finite_float(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` when it is not a real number or is not finite
    (an int too large for a float included: never ``OverflowError``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


def as_index(value: Any) -> int | None:
    """An integer (numpy integers included, bools not) as an ``int``, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_vector(value: Any, name: str = "vector", *, allow_neg_inf: bool = False) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.device.type == "meta"):
        raise InvalidSteering(
            f"a steering {name} must be a dense tensor with data, got a {value.layout} tensor on {value.device}"
        )
    try:
        tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError, RecursionError) as exc:
        raise InvalidSteering(f"a steering {name} must be a tensor or a list of floats: {str(exc)[:200]}") from None
    if tensor.layout != torch.strided:
        raise InvalidSteering(f"a steering {name} must be a dense tensor, got a {tensor.layout} tensor")
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
        raise InvalidSteering(f"a steering {name} must hold real numbers, got dtype {tensor.dtype}")
    tensor = tensor.to(device="cpu", dtype=torch.float32).contiguous().clone()  # never alias the caller's
    if tensor.dim() not in (1, 2, 3) or tensor.numel() == 0:
        raise InvalidSteering(f"a steering {name} is [width] or [n_positions, width], got shape {list(tensor.shape)}")
    if allow_neg_inf:
        if bool(torch.isnan(tensor).any() | (tensor == math.inf).any()):
            raise InvalidSteering(f"the steering {name} contains NaN or +inf (only -inf is allowed, at router_logits)")
        if bool(torch.isneginf(tensor).all(dim=-1).any()):
            raise InvalidSteering(
                f"the steering {name} is -inf for every expert of a row: a router needs at least one expert to route to"
            )
    elif not bool(torch.isfinite(tensor).all()):
        raise InvalidSteering(f"the steering {name} contains NaN or infinite values")
    return tensor


def as_bound(value: Any, name: str) -> float | None:
    if value is None:
        return None
    number = finite_float(value)
    if number is None:
        raise InvalidSteering(f"{name} must be a finite number (or omitted), got {short_repr(value)}")
    return number


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, elided past ``limit`` characters (a 400-digit number stays readable)."""
    try:
        text = (
            repr(value)
            if not isinstance(value, int) or value.bit_length() < 256
            else f"<an int of {value.bit_length()} bits>"
        )
    except (ValueError, RecursionError):
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-10:]}"


def as_heads(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if as_index(value) is not None:
        value = (value,)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes, Set, Mapping)):
        raise InvalidSteering(f"heads must be a list of head indices (ordered), got a {type(value).__name__}")
    try:
        listed = tuple(value)
    except TypeError:
        raise InvalidSteering(f"heads must be a list of head indices, got {short_repr(value)}") from None
    heads = tuple(as_index(h) for h in listed)
    if not heads or not all(h is not None and h >= 0 for h in heads):
        raise InvalidSteering(f"heads must be a non-empty list of head indices >= 0, got {short_repr(value)}")
    if len(set(heads)) != len(heads):
        raise InvalidSteering(f"heads repeat an index: {short_repr(list(heads))}")
    return heads  # type: ignore[return-value]  # every item checked to be an int


def check_shape(
    address: Address, tensor: torch.Tensor, op: str, heads: tuple[int, ...] | None, name: str = "vector"
) -> None:
    """The vector (or target) shapes a write at ``address`` accepts (see :class:`Write`)."""
    shape = list(tensor.shape)
    if not address.info.per_head:
        if heads is not None:
            raise InvalidSteering(
                f"heads= selects attention heads at a head address (attn_z, attn_v); {address} has no head axis"
            )
        if tensor.dim() == 3:
            raise InvalidSteering(f"a steering {name} is [width] or [n_positions, width], got shape {shape}")
        if not op_row(op).per_position and tensor.dim() != 1:
            raise InvalidSteering(f"{op} takes one direction of shape [width]")
        return
    if not op_row(op).per_position and tensor.dim() == 3:
        raise InvalidSteering(f"{op} at {address} takes a direction [d_head] or one per head [heads, d_head]")
    if heads is not None and tensor.dim() >= 2 and tensor.shape[-2] != len(heads):
        raise InvalidSteering(
            f"the {name} for {address} has {tensor.shape[-2]} head rows (shape {shape}) but heads= lists "
            f"{len(heads)} heads; give [d_head], [len(heads), d_head] or [n_positions, len(heads), d_head]"
        )


def as_positions(value: Any) -> Positions:
    if isinstance(value, str):
        if value not in POSITION_NAMES:
            parse_position_name(value)  # a chat span name, resolved against the request's ChatTokens
        return value
    index = as_index(value)
    if index is not None:
        return (index,)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (bytes, Set, Mapping)):
        raise InvalidSteering(f"explicit positions are an ordered list of ints, got a {type(value).__name__}")
    try:
        listed = tuple(value)
    except TypeError:
        raise InvalidSteering(
            f"positions must be 'all', 'prompt', 'generated', a chat span name ('user[-1].last') or a list of ints, "
            f"got {short_repr(value)}"
        ) from None
    indices = tuple(as_index(i) for i in listed)
    if not indices or not all(i is not None for i in indices):
        raise InvalidSteering(f"explicit positions must be a non-empty list of ints, got {short_repr(value)}")
    if len(set(indices)) != len(indices):
        raise InvalidSteering(f"explicit positions repeat an index: {short_repr(list(indices))}")
    return indices  # type: ignore[return-value]  # every item checked to be an int
