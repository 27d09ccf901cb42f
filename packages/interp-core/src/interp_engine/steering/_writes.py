"""The algebra of a write, once for every backend.

:func:`apply_op` is what each op does to activations; :class:`Pipeline` is the same algebra
folded into one fixed per-token map (an affine stage, a cap, a norm-scaled add), which is how a
compiled graph applies several writes at one address from a table. Backends call
:meth:`Write.apply <interp_engine.Write.apply>` (which selects heads and calls :func:`apply_op`)
or fold writes with :meth:`Pipeline.then`; neither is written anywhere else.

Notation: ``d = vector / |vector|`` per row, ``p = x . d`` over the last axis (per head at a head
address), ``|x|`` the norm of ``x`` over the last axis.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import InvalidSteering

OPS = ("add", "set", "ablate", "cap", "rescale", "norm_add", "swap")
"""Every steering op, in the order the docs list them."""
DIRECTION_OPS = ("ablate", "cap", "rescale", "swap")
"""Ops that use ``vector`` as a direction (a zero row has none)."""
WHOLE_ROW_OPS = ("ablate", "cap", "rescale", "swap", "norm_add")
"""Ops that need a dot product or a norm over the whole row: not applicable per shard of a row
that tensor parallelism splits across ranks."""


def _unit(vector: torch.Tensor) -> torch.Tensor:
    unit: torch.Tensor = vector / vector.norm(dim=-1, keepdim=True)
    return unit


def _dot(x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    return (x * direction).sum(-1, keepdim=True)


def norm_add_coefficient(scale: float, vector: torch.Tensor, max_fraction: float | None) -> torch.Tensor:
    """``norm_add``'s coefficient per row of ``vector`` (``[..., 1]``): ``scale``, shrunk so the
    added vector's norm ``|coef| |v| |x|`` is at most ``max_fraction * |x|``."""
    coef = torch.full_like(vector[..., :1], scale)
    if max_fraction is None or scale == 0.0:
        return coef
    room = max_fraction / (abs(scale) * vector.norm(dim=-1, keepdim=True))  # inf for a zero row: no cap
    capped: torch.Tensor = coef * room.clamp(max=1.0)
    return capped


def apply_op(
    op: str,
    scale: float,
    x: torch.Tensor,
    vector: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    lo: float | None = None,
    hi: float | None = None,
    max_fraction: float | None = None,
) -> torch.Tensor:
    """``x`` after one write (a new tensor): ``vector`` (and ``target``) broadcast against ``x``
    over the last axis.

    - ``add``: ``x + scale * vector``;
    - ``set``: ``scale * vector`` everywhere ``x`` is (activation patching);
    - ``ablate``: ``x - scale * p d``;
    - ``cap``: ``x + (clamp(p, lo, hi) - p) d`` (``lo``/``hi`` ``None``: unbounded on that side);
    - ``rescale``: ``x + (scale - 1) p d`` (the component along ``d`` scaled by ``scale``);
    - ``norm_add``: ``x + c |x| vector`` with ``c = scale``, shrunk so the added norm is at most
      ``max_fraction * |x|`` when ``max_fraction`` is given;
    - ``swap``: ``x + scale * p (t - d)`` with ``t = target / |target|`` (the component along
      ``d`` moved onto ``t``).
    """
    vector = vector.to(device=x.device, dtype=x.dtype)
    if op == "add":
        return x + scale * vector
    if op == "set":
        constant: torch.Tensor = torch.broadcast_to(scale * vector, x.shape)
        return constant.clone()
    if op == "norm_add":
        coef = norm_add_coefficient(scale, vector, max_fraction)
        grown: torch.Tensor = x + coef * x.norm(dim=-1, keepdim=True) * vector
        return grown
    if op not in DIRECTION_OPS:
        raise InvalidSteering(f"unknown steering op {op!r}; valid ops: {', '.join(OPS)}")
    direction = _unit(vector)
    projection = _dot(x, direction)
    out: torch.Tensor
    if op == "ablate":
        out = x - scale * projection * direction
    elif op == "rescale":
        out = x + (scale - 1.0) * projection * direction
    elif op == "cap":
        out = x + (projection.clamp(min=lo, max=hi) - projection) * direction
    else:  # swap
        if target is None:
            raise InvalidSteering("swap needs a target direction")
        onto = _unit(target.to(device=x.device, dtype=x.dtype))
        out = x + scale * projection * (onto - direction)
    return out


_UNFOLDABLE = (
    "cannot be folded into one slot of vllm-static's per-token pipeline (one affine map "
    "keep*x + (x.u)m + shift along a single direction u, then one cap, then one norm_add, in that "
    "order); apply them at different addresses or tokens, or use the vllm or eager backend"
)


@dataclass(frozen=True)
class Pipeline:
    """One token's writes folded into a fixed map (float32, CPU vectors of one width):

    1. ``y = keep * x + (x . u) m + shift`` (``u`` a unit vector, or zeros with ``m`` zeros);
    2. ``y = y + (clamp(y . c, lo, hi) - y . c) c`` (``c`` a unit vector or zeros; ``lo``/``hi``
       are ``-inf``/``inf`` on an unbounded side);
    3. ``y = y + |y| w``;
    4. ``y = -inf`` where ``ban`` is set (an expert's router logit ablated by a ``-inf`` write;
       the ``-inf`` never enters stages 1-3, where ``-inf * 0`` would be NaN).

    ``add`` moves the shift; ``set`` makes the map constant; ``ablate``, ``rescale`` and
    ``swap`` move the component along one direction (``m``), ``cap`` is stage 2 and
    ``norm_add`` stage 3 (its ``max_fraction`` folds into ``w``: the coefficient is a constant
    per row). Sequences with no map of this form (two projections along different directions,
    an ablation after a cap, two norm_adds, ...) raise ``InvalidSteering``.
    """

    keep: float
    direction: torch.Tensor
    move: torch.Tensor
    shift: torch.Tensor
    cap: torch.Tensor
    lo: float
    hi: float
    grow: torch.Tensor
    ban: torch.Tensor | None = None
    """``[width]`` bool: the entries forced to ``-inf`` last (``None``: none)."""

    @classmethod
    def identity(cls, width: int) -> Pipeline:
        zeros = torch.zeros(width)
        return cls(1.0, zeros, zeros, zeros, zeros, -math.inf, math.inf, zeros)

    @property
    def width(self) -> int:
        return int(self.shift.shape[0])

    @property
    def capped(self) -> bool:
        return bool(self.cap.any())

    @property
    def grows(self) -> bool:
        return bool(self.grow.any())

    def _replace(self, **changes: Any) -> Pipeline:
        return dataclasses.replace(self, **changes)

    def then(
        self,
        op: str,
        scale: float,
        vector: torch.Tensor,
        *,
        target: torch.Tensor | None = None,
        lo: float | None = None,
        hi: float | None = None,
        max_fraction: float | None = None,
    ) -> Pipeline:
        """This map followed by one write of ``vector`` (``[width]``; ``target`` likewise)."""
        width = self.width
        v = vector.detach().to("cpu", torch.float32).reshape(width)
        infinite = torch.isneginf(v)
        banned = bool(infinite.any())
        if banned:  # -inf entries (router logits): banned at the end, kept out of the shift
            v = v.masked_fill(infinite, 0.0)
            if op not in ("set", "add"):
                raise InvalidSteering(f"a -inf entry is only for add or set, not {op}")
        if op == "set":
            zeros = torch.zeros(width)
            return Pipeline(
                0.0, zeros, zeros, scale * v, zeros, -math.inf, math.inf, zeros, infinite if banned else None
            )
        if self.ban is not None and op != "add":
            raise InvalidSteering(f"{op} after a -inf write on the same token would be NaN; only add or set may follow")
        if op == "add":
            if self.grows:
                raise InvalidSteering(f"add after norm_add on the same token {_UNFOLDABLE}")
            shift = self.shift + scale * v
            ban = self.ban if not banned else infinite if self.ban is None else self.ban | infinite
            if not self.capped:
                return self._replace(shift=shift, ban=ban)
            # cap(y) + k c + v_perp = cap'(y + k c + v_perp), the bounds moved by k = (s v) . c
            k = float((scale * v) @ self.cap)
            return self._replace(shift=shift, lo=self.lo + k, hi=self.hi + k, ban=ban)
        if op == "norm_add":
            if self.grows:
                raise InvalidSteering(f"two norm_adds on the same token {_UNFOLDABLE}")
            coef = float(norm_add_coefficient(scale, v, max_fraction))
            return self._replace(grow=coef * v)
        if op not in DIRECTION_OPS:
            raise InvalidSteering(f"unknown steering op {op!r}; valid ops: {', '.join(OPS)}")
        d = v / v.norm()
        if op == "cap":
            return self._then_cap(d, lo, hi)
        if self.capped or self.grows:
            raise InvalidSteering(f"{op} after a cap or a norm_add on the same token {_UNFOLDABLE}")
        # y + (y . d) n for each of these
        if op == "ablate":
            n = -scale * d
        elif op == "rescale":
            n = (scale - 1.0) * d
        else:
            if target is None:
                raise InvalidSteering("swap needs a target direction")
            t = target.detach().to("cpu", torch.float32).reshape(width)
            n = scale * (t / t.norm() - d)
        return self._then_projection(op, d, n)

    def _then_projection(self, op: str, d: torch.Tensor, n: torch.Tensor) -> Pipeline:
        """Stage 1 followed by ``y + (y . d) n``:
        ``keep x + (x.u)(m + (m.d) n) + keep (x.d) n + shift + (shift.d) n``."""
        shift = self.shift + (self.shift @ d) * n
        move = self.move + (self.move @ d) * n
        if self.keep == 0.0:  # a constant so far: no (x . d) term
            return self._replace(move=move, shift=shift)
        if not bool(self.direction.any()):  # no direction yet: it becomes d
            return self._replace(direction=d, move=self.keep * n, shift=shift)
        alignment = float(self.direction @ d)
        if abs(alignment) > 1 - 1e-6:  # the same line: (x . d) = +-(x . u)
            sign = 1.0 if alignment > 0 else -1.0
            return self._replace(move=move + sign * self.keep * n, shift=shift)
        raise InvalidSteering(
            f"two projection writes (ablate, rescale or swap) along different directions on the same token "
            f"({op} after an earlier one) {_UNFOLDABLE}"
        )

    def _then_cap(self, d: torch.Tensor, lo: float | None, hi: float | None) -> Pipeline:
        if self.grows:
            raise InvalidSteering(f"cap after norm_add on the same token {_UNFOLDABLE}")
        low = -math.inf if lo is None else lo
        high = math.inf if hi is None else hi
        if not self.capped:
            return self._replace(cap=d, lo=low, hi=high)
        alignment = float(self.cap @ d)
        if abs(alignment) <= 1 - 1e-6:
            raise InvalidSteering(f"two caps along different directions on the same token {_UNFOLDABLE}")
        if alignment < 0:  # capping -p in [lo, hi] is capping p in [-hi, -lo]
            low, high = -high, -low

        def clamp(value: float) -> float:
            return min(max(value, low), high)

        # clamp(clamp(p, a, b), lo, hi) = clamp(p, clamp(a, lo, hi), clamp(b, lo, hi))
        return self._replace(lo=clamp(self.lo), hi=clamp(self.hi))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The map applied to rows ``x`` (``[..., width]``): the host-side reference of
        vllm-static's in-graph tables."""

        def vec(value: torch.Tensor) -> torch.Tensor:
            return value.to(device=x.device, dtype=x.dtype)

        y = x * self.keep + _dot(x, vec(self.direction)) * vec(self.move) + vec(self.shift)
        c = vec(self.cap)
        p = _dot(y, c)
        y = y + (p.clamp(min=self.lo, max=self.hi) - p) * c
        out: torch.Tensor = y + y.norm(dim=-1, keepdim=True) * vec(self.grow)
        if self.ban is not None:
            out = out.masked_fill(self.ban.to(x.device), -math.inf)
        return out
