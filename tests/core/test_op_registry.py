"""The steering op registry (``interp_engine.steering._writes.OP_ROWS``) drives everything an op touches.

The op type, the checks of a ``Write``, the HTTP schema's op enum and field docs, docs/guides/steering.md's op
table, the eager/vllm write path (``apply_op``) and vllm-static's slot tables (``Pipeline`` folds
evaluated by ``StaticWrites``) all come from the rows: each test below loops over the rows, so an
op added as a row is checked here with no edit to this file.
"""

from __future__ import annotations

import itertools
import math
import pathlib
from typing import Any, get_args

import pytest
import torch

from interp_engine import InvalidSteering, Write
from interp_engine.server._schemas import WriteBody
from interp_engine.steering._writes import (
    DIRECTION_OPS,
    ELEMENTWISE_OPS,
    OP_ROWS,
    OPS,
    PARAM_DOCS,
    WHOLE_ROW_OPS,
    Op,
    OpRow,
    Pipeline,
    apply_op,
    op_table,
    param_doc,
)
from interp_vllm.static._taps import StaticWrites, compose, plan_writes

WIDTH = 16
ROWS = {row.name: row for row in OP_ROWS}


def _vec(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, WIDTH, generator=torch.Generator().manual_seed(seed))


def _args(row: OpRow, seed: int) -> dict[str, Any]:
    """Values for the parameters ``row`` takes (a cap with both bounds, a max_fraction that bites)."""
    given: dict[str, Any] = {}
    if "scale" in row.takes:
        given["scale"] = 0.5 + (seed % 5) * 0.3
    if "target" in row.takes:
        given["target"] = _vec(1000 + seed)
    if "lo" in row.takes:
        given["lo"] = -0.3
    if "hi" in row.takes:
        given["hi"] = 0.4
    if "max_fraction" in row.takes:
        given["max_fraction"] = 0.2
    return given


def _write(row: OpRow, seed: int, **extra: Any) -> Write:
    return Write("resid_post.0", _vec(seed), op=row.name, **_args(row, seed), **extra)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_the_op_type_and_the_derived_tuples_are_the_rows() -> None:
    assert get_args(Op) == OPS == tuple(ROWS)
    assert len(set(OPS)) == len(OPS)
    # the derived tuples keep the order the error messages name them in
    assert DIRECTION_OPS == ("ablate", "cap", "rescale", "swap")
    assert WHOLE_ROW_OPS == ("ablate", "cap", "rescale", "swap", "norm_add")
    assert ELEMENTWISE_OPS == ("add", "set")
    assert set(DIRECTION_OPS) <= set(WHOLE_ROW_OPS)
    for row in OP_ROWS:
        assert row.takes <= {"scale", "target", "lo", "hi", "max_fraction"}
        assert row.doc and row.vector and "\n" not in row.doc


def test_the_http_schema_takes_its_op_enum_and_field_docs_from_the_rows() -> None:
    schema = WriteBody.model_json_schema()["properties"]
    assert schema["op"]["enum"] == list(OPS)
    for name in PARAM_DOCS:
        takers = [row.name for row in OP_ROWS if name in row.takes]
        assert takers, f"{name} is taken by no op"
        assert schema[name]["description"] == param_doc(name)
        assert param_doc(name).startswith("/".join(takers) + " only: ")
    for op in OPS:  # every op's body validates
        WriteBody.model_validate({"address": "resid_post.0", "vector": [1.0, 0.0], "op": op})
    with pytest.raises(ValueError, match="op"):
        WriteBody.model_validate({"address": "resid_post.0", "vector": [1.0], "op": "nope"})


STEERING_GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "steering.md"


def test_the_guide_op_table_is_the_registry() -> None:
    """The steering guide's op table is generated from :func:`op_table` when the site builds
    (tests/docs/test_docs_site.py checks the built page)."""
    table = op_table()
    assert "<!-- generated: ops -->" in STEERING_GUIDE.read_text()
    assert table.count("\n") == len(OP_ROWS) + 2


@pytest.mark.parametrize("op", OPS)
def test_write_checks_come_from_the_row(op: str) -> None:
    row = ROWS[op]
    write = _write(row, 1)
    assert write.op == op
    for name in ("target", "lo", "hi", "max_fraction"):
        if name in row.takes:
            continue
        value: Any = _vec(2) if name == "target" else 0.5
        first = next(other.name for other in OP_ROWS if name in other.takes)
        with pytest.raises(InvalidSteering, match=f"{name} is only for op='{first}'"):
            Write("resid_post.0", _vec(3), op=op, **{**_args(row, 3), name: value})
    if "scale" not in row.takes:
        with pytest.raises(InvalidSteering, match="scale"):
            _write(row, 4, scale=2.0)
    if row.direction:
        with pytest.raises(InvalidSteering, match="zero vector"):
            Write("resid_post.0", torch.zeros(WIDTH), op=op, **_args(row, 5))
    banned = torch.zeros(WIDTH)
    banned[3] = -math.inf
    if row.whole_row:
        with pytest.raises(InvalidSteering, match="NaN or infinite"):
            Write("router_logits.0", banned, op=op, **_args(row, 6))
    else:
        assert bool(torch.isneginf(Write("router_logits.0", banned, op=op, **_args(row, 6)).vector).any())
    if not row.per_position:
        with pytest.raises(InvalidSteering, match=f"{op} takes one direction"):
            Write("resid_post.0", _vec(7, 2), op=op, positions=[0, 1], **_args(row, 7))
    else:
        Write("resid_post.0", _vec(7, 2), op=op, positions=[0, 1], **_args(row, 7))


def _fold(writes: list[Write]) -> Pipeline:
    return compose([(w, w.vector, w.target) for w in writes], WIDTH)


def _applied(writes: list[Write], x: torch.Tensor) -> torch.Tensor:
    for w in writes:
        x = apply_op(w.op, w.scale, x, w.vector, target=w.target, lo=w.lo, hi=w.hi, max_fraction=w.max_fraction)
    return x


def _table(pipeline: Pipeline, x: torch.Tensor) -> torch.Tensor:
    table = StaticWrites(2, WIDTH, x.shape[0], dtype=x.dtype, device="cpu", bans=True)
    (slot,) = table.allocate(1)
    table.fill(slot, pipeline)
    table.set_index(torch.full((x.shape[0],), slot))
    out: torch.Tensor = table(x)
    return out


@pytest.mark.parametrize("op", OPS)
def test_each_ops_fold_equals_its_apply_and_the_slot_table_is_the_pipeline(op: str) -> None:
    x = torch.randn(12, WIDTH, generator=torch.Generator().manual_seed(7)) * 3
    for seed in range(3):
        writes = [_write(ROWS[op], 10 + seed)]
        expected = _applied(writes, x)
        pipeline = _fold(writes)
        assert _rel(pipeline.apply(x), expected) <= 1e-5
        assert torch.equal(_table(pipeline, x), pipeline.apply(x))  # the table runs the pipeline's stages


@pytest.mark.parametrize(("first", "second"), list(itertools.product(OPS, OPS)))
def test_every_pair_of_ops_folds_to_its_sequence_or_is_refused(first: str, second: str) -> None:
    x = torch.randn(12, WIDTH, generator=torch.Generator().manual_seed(8)) * 3
    writes = [_write(ROWS[first], 20), _write(ROWS[second], 21)]
    try:
        pipeline = _fold(writes)
    except InvalidSteering as exc:
        assert "use the vllm or eager backend" in str(exc)
        return
    expected = _applied(writes, x)
    assert _rel(pipeline.apply(x), expected) <= 1e-5
    assert torch.equal(_table(pipeline, x), pipeline.apply(x))


def test_the_static_planner_serves_every_op() -> None:
    n = len(OPS)
    writes = [_write(row, 30 + i, positions=[i]) for i, row in enumerate(OP_ROWS)]
    (plan,) = plan_writes(writes, n, n + 1).values()
    assert len(plan.ops) == n  # one slot per op, each token its own
    x = torch.randn(n + 1, WIDTH, generator=torch.Generator().manual_seed(9))
    table = StaticWrites(n + 1, WIDTH, n + 1, dtype=torch.float32, device="cpu")
    slots = table.allocate(n)
    for slot, pipeline in zip(slots, plan.ops, strict=True):
        table.fill(slot, pipeline)
    table.set_index(torch.tensor([0, *slots])[plan.combo])
    got = table(x)
    for i, write in enumerate(writes):
        assert _rel(got[i], write.apply(x[i])) <= 1e-5, write.op
    assert torch.equal(got[n], x[n])  # untouched: bit for bit
