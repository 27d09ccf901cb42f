"""The steering ops as data, and the algebra of a write, once for every backend.

:data:`OP_ROWS` holds one :class:`OpRow` per op: its name, the parameters it takes, whether it
uses ``vector`` as a direction or needs the whole row, its one-line doc, and its math twice over
-- ``apply`` on activations (what :meth:`Write.apply <interp_engine.Write.apply>` runs on the
eager and vllm backends, through :func:`apply_op`) and ``fold`` into a :class:`Pipeline`, the
fixed per-token map (an affine stage, a cap, a norm-scaled add) that a compiled graph applies
from slot tables (vllm-static evaluates :func:`run_stages` on them). The op type :data:`Op`, the
checks of a :class:`~interp_engine.Write`, the HTTP schema's op enum and field docs, the
documentation's op table (:func:`op_table`) and the tensor-parallel refusal all read these rows: a new
op is one row here and its two functions.

Notation: ``d = vector / |vector|`` per row, ``p = x . d`` over the last axis (per head at a head
address), ``|x|`` the norm of ``x`` over the last axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._errors import InvalidSteering

Op = Literal["add", "set", "ablate", "cap", "rescale", "norm_add", "swap"]
"""A steering op's name (the names of :data:`OP_ROWS`, in order)."""


@dataclass(frozen=True)
class OpArgs:
    """A write's parameters as its op reads them (``target`` the row that applies, or ``None``)."""

    scale: float = 1.0
    target: torch.Tensor | None = None
    lo: float | None = None
    hi: float | None = None
    max_fraction: float | None = None


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

    Each op's :attr:`OpRow.fold` extends the map: ``add`` moves the shift; ``set`` makes the map
    constant; ``ablate``, ``rescale`` and ``swap`` move the component along one direction
    (``m``), ``cap`` is stage 2 and ``norm_add`` stage 3 (its ``max_fraction`` folds into ``w``:
    the coefficient is a constant per row). Sequences with no map of this form (two projections
    along different directions, an ablation after a cap, two norm_adds, ...) raise
    ``InvalidSteering``. :func:`run_stages` evaluates the map.
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
        """This map followed by one write of ``vector`` (``[width]``; ``target`` likewise): the
        op's :attr:`OpRow.fold`."""
        row = op_row(op)
        width = self.width
        v = vector.detach().to("cpu", torch.float32).reshape(width)
        infinite = torch.isneginf(v)
        ban = None
        if bool(infinite.any()):  # -inf entries (router logits): banned at the end, kept out of the shift
            v = v.masked_fill(infinite, 0.0)
            if row.whole_row:
                raise InvalidSteering(f"a -inf entry is only for {_ELEMENTWISE}, not {op}")
            ban = infinite
        if self.ban is not None and row.whole_row:
            raise InvalidSteering(
                f"{op} after a -inf write on the same token would be NaN; only {_ELEMENTWISE} may follow"
            )
        onto = None if target is None else target.detach().to("cpu", torch.float32).reshape(width)
        return row.fold(self, v, ban, OpArgs(scale, onto, lo, hi, max_fraction))

    def _then_projection(self, op: str, d: torch.Tensor, n: torch.Tensor) -> Pipeline:
        """Stage 1 followed by ``y + (y . d) n`` (the fold of ``ablate``, ``rescale`` and ``swap``):
        ``keep x + (x.u)(m + (m.d) n) + keep (x.d) n + shift + (shift.d) n``."""
        if self.capped or self.grows:
            raise InvalidSteering(f"{op} after a cap or a norm_add on the same token {_UNFOLDABLE}")
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
        """The map applied to rows ``x`` (``[..., width]``): :func:`run_stages` on this one slot,
        its tables in ``x``'s dtype, as vllm-static's in-graph tables evaluate it."""

        def scalar(value: float) -> torch.Tensor:
            return torch.tensor([value], device=x.device, dtype=x.dtype)

        tables = {
            name: value.to(device=x.device, dtype=x.dtype) if isinstance(value, torch.Tensor) else scalar(value)
            for name, value in ((name, getattr(self, name)) for name in PIPELINE_TABLES)
        }
        return run_stages(x, **tables, ban=None if self.ban is None else self.ban.to(x.device))


PIPELINE_TABLES = ("keep", "direction", "move", "shift", "cap", "lo", "hi", "grow")
"""A :class:`Pipeline`'s per-slot values, the keyword arguments of :func:`run_stages`: ``keep``,
``lo`` and ``hi`` are numbers (one per row, ``[..., 1]``), the others ``[..., width]`` vectors."""


def run_stages(
    x: torch.Tensor,
    *,
    keep: torch.Tensor,
    direction: torch.Tensor,
    move: torch.Tensor,
    shift: torch.Tensor,
    cap: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    grow: torch.Tensor,
    ban: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stages 1-4 of :class:`Pipeline` on rows ``x`` (``[..., width]``), with each table's row
    for each of them (broadcast against ``x``; pure tensor work, traceable into a compiled graph).
    With ``cap`` zero and bounds at ``-inf``/``inf`` the cap's correction is exactly 0 (no
    ``inf * 0``); the ``-inf`` of ``ban`` never enters stages 1-3."""
    # 1. affine: keep*x + (x.u) m + shift
    projection = (x * direction).sum(-1, keepdim=True)
    out = x * keep + projection * move + shift
    # 2. cap along c
    along = (out * cap).sum(-1, keepdim=True)
    capped = torch.minimum(torch.maximum(along, lo), hi)
    out = out + (capped - along) * cap
    # 3. norm-scaled add
    out = out + torch.linalg.vector_norm(out, dim=-1, keepdim=True) * grow
    if ban is not None:  # 4. entries banned to -inf
        out = out.masked_fill(ban, -torch.inf)
    result: torch.Tensor = out
    return result


# -- the ops: each one's math on activations (apply) and folded into a Pipeline (fold) ----------

Apply = Callable[[torch.Tensor, torch.Tensor, OpArgs], torch.Tensor]
"""``(x, vector, args) -> x after the write`` (``vector`` already in ``x``'s dtype and device)."""
Fold = Callable[[Pipeline, torch.Tensor, torch.Tensor | None, OpArgs], Pipeline]
"""``(pipeline, vector, ban, args) -> pipeline followed by the write``: ``vector`` is a float32
CPU ``[width]`` row with any ``-inf`` entries zeroed, ``ban`` those entries (``None``: none)."""


def _along(x: torch.Tensor, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d`` and ``p = x . d``."""
    direction = _unit(vector)
    return direction, _dot(x, direction)


def _apply_add(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    return x + a.scale * v


def _fold_add(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    if pipe.grows:
        raise InvalidSteering(f"add after norm_add on the same token {_UNFOLDABLE}")
    shift = pipe.shift + a.scale * v
    banned = pipe.ban if ban is None else ban if pipe.ban is None else pipe.ban | ban
    if not pipe.capped:
        return pipe._replace(shift=shift, ban=banned)
    # cap(y) + k c + v_perp = cap'(y + k c + v_perp), the bounds moved by k = (s v) . c
    k = float((a.scale * v) @ pipe.cap)
    return pipe._replace(shift=shift, lo=pipe.lo + k, hi=pipe.hi + k, ban=banned)


def _apply_set(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    constant: torch.Tensor = torch.broadcast_to(a.scale * v, x.shape)
    return constant.clone()


def _fold_set(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    zeros = torch.zeros(pipe.width)
    return Pipeline(0.0, zeros, zeros, a.scale * v, zeros, -math.inf, math.inf, zeros, ban)


def _apply_ablate(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    d, p = _along(x, v)
    out: torch.Tensor = x - a.scale * p * d
    return out


def _fold_ablate(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    d = v / v.norm()
    return pipe._then_projection("ablate", d, -a.scale * d)


def _apply_cap(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    d, p = _along(x, v)
    out: torch.Tensor = x + (p.clamp(min=a.lo, max=a.hi) - p) * d
    return out


def _fold_cap(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    return pipe._then_cap(v / v.norm(), a.lo, a.hi)


def _check_cap(a: OpArgs) -> None:
    if a.lo is None and a.hi is None:
        raise InvalidSteering("cap needs lo, hi or both (the bounds of the projection x.d)")
    if a.lo is not None and a.hi is not None and a.lo > a.hi:
        raise InvalidSteering(f"cap needs lo <= hi, got lo={a.lo} and hi={a.hi}")
    if a.scale != 1.0:
        raise InvalidSteering(f"cap takes no scale (its bounds say how far to cap); got scale={a.scale}")


def _apply_rescale(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    d, p = _along(x, v)
    out: torch.Tensor = x + (a.scale - 1.0) * p * d
    return out


def _fold_rescale(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    d = v / v.norm()
    return pipe._then_projection("rescale", d, (a.scale - 1.0) * d)


def _apply_norm_add(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    coef = norm_add_coefficient(a.scale, v, a.max_fraction)
    grown: torch.Tensor = x + coef * x.norm(dim=-1, keepdim=True) * v
    return grown


def _fold_norm_add(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    if pipe.grows:
        raise InvalidSteering(f"two norm_adds on the same token {_UNFOLDABLE}")
    coef = float(norm_add_coefficient(a.scale, v, a.max_fraction))
    return pipe._replace(grow=coef * v)


def _check_norm_add(a: OpArgs) -> None:
    if a.max_fraction is not None and a.max_fraction <= 0:
        raise InvalidSteering(f"max_fraction must be > 0 (a fraction of |x|), got {a.max_fraction}")


def _apply_swap(x: torch.Tensor, v: torch.Tensor, a: OpArgs) -> torch.Tensor:
    d, p = _along(x, v)
    if a.target is None:
        raise InvalidSteering("swap needs a target direction")
    onto = _unit(a.target.to(device=x.device, dtype=x.dtype))
    out: torch.Tensor = x + a.scale * p * (onto - d)
    return out


def _fold_swap(pipe: Pipeline, v: torch.Tensor, ban: torch.Tensor | None, a: OpArgs) -> Pipeline:
    if a.target is None:
        raise InvalidSteering("swap needs a target direction")
    d = v / v.norm()
    return pipe._then_projection("swap", d, a.scale * (a.target / a.target.norm() - d))


def _check_swap(a: OpArgs) -> None:
    if a.target is None:
        raise InvalidSteering("swap needs target= (the direction the component along vector is moved onto)")


# -- the registry ---------------------------------------------------------------------------------

PARAMS = ("scale", "target", "lo", "hi", "max_fraction")
"""A write's parameters besides ``vector``, which every op takes."""
PARAM_DOCS = {
    "target": "the direction the component along vector moves onto",
    "lo": "lower bound of the projection x.d",
    "hi": "upper bound of the projection x.d",
    "max_fraction": "the added vector's norm is at most max_fraction * |x|",
}
"""What each op-specific parameter means (the HTTP schema's field descriptions)."""


@dataclass(frozen=True)
class OpRow:
    """One steering op: what it takes, how it is checked, its math, and its docs."""

    name: Op
    doc: str
    """Its effect, one line (the documentation's op table, Markdown)."""
    vector: str
    """The vector shapes it takes (the documentation's op table, Markdown)."""
    apply: Apply
    """Its math on activations (:func:`apply_op`)."""
    fold: Fold
    """Its math folded into a :class:`Pipeline` (:meth:`Pipeline.then`), or ``InvalidSteering``
    where the sequence so far followed by it has no such map."""
    takes: frozenset[str] = frozenset({"scale"})
    """Which of :data:`PARAMS` it takes (a parameter it does not take is refused when given)."""
    direction: bool = False
    """Uses ``vector`` as a direction (a zero row is refused; ``scale * vector`` never enters the output)."""
    whole_row: bool = False
    """Needs a dot product or a norm over the whole row: not applicable per shard of a row that
    tensor parallelism splits across ranks, and ``-inf`` entries (an expert ablated at
    ``router_logits``) can neither be written by it nor precede it."""
    per_position: bool = True
    """Takes one vector row per position (or per head) as well as a single one."""
    check: Callable[[OpArgs], None] | None = None
    """Its own checks of the parameters (``InvalidSteering``), after the generic ones."""
    op_object: str | None = None
    """The op object of the public ``interp-engine`` package's vocabulary that writes it
    (:mod:`interp_engine.steering._ops`: ``AddSpec``, ...), or ``None``."""
    steer_method: str | None = None
    """Its name as the public package's ``SteerSpec(method=...)`` spells it (``"additive"``, ...),
    or ``None``."""


OP_ROWS: tuple[OpRow, ...] = (
    OpRow(
        "add",
        "`x + scale * v`",
        "`[width]`, or `[n_positions, width]` (one row per selected position)",
        _apply_add,
        _fold_add,
        op_object="AddSpec",
        steer_method="additive",
    ),
    OpRow(
        "set",
        "`x := scale * v` — activation patching: pass another run's activations",
        "same",
        _apply_set,
        _fold_set,
    ),
    OpRow(
        "ablate",
        "`x − scale * p d̂` (directional ablation)",  # noqa: RUF001 (the documentation's minus sign)
        "`[width]`",
        _apply_ablate,
        _fold_ablate,
        direction=True,
        whole_row=True,
        per_position=False,
        op_object="AblateSpec",
        steer_method="ablate",
    ),
    OpRow(
        "cap",
        "`x + (clamp(p, lo, hi) − p) d̂` — projection capping; `lo`, `hi` or both, `scale` stays 1",  # noqa: RUF001 (the documentation's minus sign)
        "same as `add`",
        _apply_cap,
        _fold_cap,
        takes=frozenset({"lo", "hi"}),
        direction=True,
        whole_row=True,
        check=_check_cap,
        op_object="ProjectionCapSpec",
        steer_method="projection_cap",
    ),
    OpRow(
        "rescale",
        "`x + (scale − 1) p d̂` — the component along `d̂` times `scale`, the rest kept",  # noqa: RUF001 (the documentation's minus sign)
        "same as `add`",
        _apply_rescale,
        _fold_rescale,
        direction=True,
        whole_row=True,
        op_object="OrthogonalDecompSpec",
        steer_method="orthogonal",
    ),
    OpRow(
        "norm_add",
        "`x + scale * ‖x‖ * v` with `v` as given (a unit `v` adds `scale*‖x‖*d̂`); `max_fraction` caps the "
        "added norm at `max_fraction * ‖x‖`",
        "same as `add`",
        _apply_norm_add,
        _fold_norm_add,
        takes=frozenset({"scale", "max_fraction"}),
        whole_row=True,
        check=_check_norm_add,
        op_object="NormScaledAddSpec",
        steer_method="norm_scaled_add",
    ),
    OpRow(
        "swap",
        "`x + scale * p (t̂ − d̂)`, `t̂ = target/‖target‖` — the component along `d̂` moved onto `t̂`",  # noqa: RUF001 (the documentation's minus sign)
        "same as `add`; `target` too",
        _apply_swap,
        _fold_swap,
        takes=frozenset({"scale", "target"}),
        direction=True,
        whole_row=True,
        check=_check_swap,
        op_object="SwapSpec",
        steer_method="swap",
    ),
)
"""Every steering op, in the order the docs list them."""

_BY_NAME: dict[str, OpRow] = {row.name: row for row in OP_ROWS}
OPS: tuple[Op, ...] = tuple(row.name for row in OP_ROWS)
"""Every steering op's name, in the order the docs list them."""
DIRECTION_OPS = tuple(row.name for row in OP_ROWS if row.direction)
"""Ops that use ``vector`` as a direction (a zero row has none)."""
WHOLE_ROW_OPS = DIRECTION_OPS + tuple(row.name for row in OP_ROWS if row.whole_row and not row.direction)
"""Ops that need a dot product or a norm over the whole row (the direction ops, then the
others): not applicable per shard of a row that tensor parallelism splits across ranks."""
ELEMENTWISE_OPS = tuple(row.name for row in OP_ROWS if not row.whole_row)
"""Ops that act entry by entry: the ones a tensor-parallel shard can apply, and the only ones
that take ``-inf`` entries."""
_ELEMENTWISE = " or ".join(ELEMENTWISE_OPS)


def op_row(op: str) -> OpRow:
    """The row of ``op`` (``InvalidSteering`` naming the valid ops for any other name)."""
    row = _BY_NAME.get(op) if isinstance(op, str) else None
    if row is None:
        raise InvalidSteering(f"unknown steering op {op!r}; valid ops: {', '.join(OPS)}")
    return row


def check_op_args(op: str, args: OpArgs) -> None:
    """``InvalidSteering`` unless ``op`` takes the parameters given (``target``, ``lo``, ``hi``,
    ``max_fraction``: the ones not ``None``) with values it accepts."""
    row = op_row(op)
    for name in ("lo", "hi", "max_fraction", "target"):
        if getattr(args, name) is not None and name not in row.takes:
            first = next(other.name for other in OP_ROWS if name in other.takes)
            raise InvalidSteering(f"{name} is only for op={first!r}; this write is op={op!r}")
    if row.check is not None:
        row.check(args)


def param_doc(name: str) -> str:
    """``"cap only: lower bound of the projection x.d"``: which ops take an op-specific
    parameter, and what it means."""
    ops = "/".join(row.name for row in OP_ROWS if name in row.takes)
    return f"{ops} only: {PARAM_DOCS[name]}"


def _op_object_cell(row: OpRow) -> str:
    if row.op_object is None:
        return "—"
    return f"`{row.op_object}`, `SteerSpec(method={row.steer_method!r})`"


def op_table() -> str:
    """The documentation's op table (Markdown, docs/guides/steering.md), one line per row of :data:`OP_ROWS`."""
    lines = ["| op | effect | vector | op object |", "|---|---|---|---|"]
    lines += [f"| `{row.name}` | {row.doc} | {row.vector} | {_op_object_cell(row)} |" for row in OP_ROWS]
    return "\n".join(lines) + "\n"


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
    over the last axis; the op's :attr:`OpRow.apply` (``OpRow.doc`` says what each does, ``lo``
    or ``hi`` ``None`` leaving a cap unbounded on that side)."""
    row = op_row(op)
    vector = vector.to(device=x.device, dtype=x.dtype)
    return row.apply(x, vector, OpArgs(scale, target, lo, hi, max_fraction))
