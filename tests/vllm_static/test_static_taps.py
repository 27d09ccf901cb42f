"""The tensor-only taps and writes of vllm-static, on an HF model under torch.compile.

They must give the eager numbers (captures equal HF, steering equal the eager backend), leave
unsteered tokens bit for bit alone, and never recompile when only the tables change.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import Address, InvalidSteering, SteeringSpec, Write, sync_model
from interp_testkit.suite import PROMPT, hf_for, rel_diff, tiny_model_path
from interp_vllm.static._taps import StaticTap, StaticWrites, compose, plan_writes

from ..support.engines import eager_model

MAX_TOKENS = 64


class _Tapped:
    """A fresh HF llama with a tap and a write table on layer 1's output, compiled."""

    def __init__(self) -> None:
        self.hf = (
            type(hf_for(tiny_model_path("llama")))
            .from_pretrained(tiny_model_path("llama"), attn_implementation="eager")
            .eval()
        )
        d_model = self.hf.config.hidden_size
        self.tap = StaticTap(MAX_TOKENS, d_model, dtype=torch.float32, device="cpu")
        self.writes = StaticWrites(8, d_model, MAX_TOKENS, dtype=torch.float32, device="cpu")

        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            return self.tap(self.writes(output))

        self.hf.model.layers[1].register_forward_hook(hook)
        self.graphs = 0

        def counting_backend(gm: Any, example_inputs: Any) -> Any:
            self.graphs += 1
            return gm.forward

        torch._dynamo.reset()
        self.compiled = torch.compile(self.hf, backend=counting_backend, dynamic=True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.compiled(torch.tensor([ids]), use_cache=False).logits[0]


@pytest.fixture(scope="module")
def tapped() -> _Tapped:
    return _Tapped()


def _ids(text: str = PROMPT) -> list[int]:
    ids: list[int] = eager_model("llama").to_tokens(text)[0].tolist()
    return ids


def test_the_tap_captures_what_hf_computes(tapped: _Tapped) -> None:
    tapped.writes.clear()
    ids = _ids()
    tapped.logits(ids)
    with torch.no_grad():
        hidden = hf_for(tiny_model_path("llama"))(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert rel_diff(tapped.tap.read(0, len(ids)), hidden[2][0]) <= 1e-5


def _vec(seed: int, rows: int = 0, width: int = 64) -> torch.Tensor:
    return torch.randn(*((rows,) if rows else ()), width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "write",
    [
        Write("resid_post.1", torch.randn(64, generator=torch.Generator().manual_seed(1)), op="add", scale=3.0),
        Write("resid_post.1", torch.randn(64, generator=torch.Generator().manual_seed(2)), op="ablate"),
        Write(
            "resid_post.1",
            torch.randn(3, 64, generator=torch.Generator().manual_seed(3)),
            op="set",
            positions=[1, 4, 6],
        ),
        Write("resid_post.1", _vec(4), op="cap", lo=-0.1, hi=0.1),
        Write("resid_post.1", _vec(5), op="cap", hi=0.0, positions=[0, 2, 3, 5]),
        Write("resid_post.1", _vec(6), op="rescale", scale=-2.0),
        Write("resid_post.1", _vec(7), op="norm_add", scale=0.7),
        Write("resid_post.1", _vec(8, rows=3), op="norm_add", scale=2.0, max_fraction=0.4, positions=[1, 4, 6]),
        Write("resid_post.1", _vec(9), op="swap", target=_vec(10)),
        Write("resid_post.1", _vec(11), op="swap", target=_vec(12, rows=3), scale=0.5, positions=[0, 1, 7]),
    ],
    ids=["add", "ablate", "set", "cap", "cap-hi", "rescale", "norm_add", "norm_add-max_fraction", "swap", "swap-rows"],
)
def test_table_writes_equal_the_eager_backend(tapped: _Tapped, write: Write) -> None:
    ids = _ids()
    positions = list(range(len(ids))) if write.positions == "all" else list(write.positions)
    tapped.writes.clear()
    rows = torch.tensor(positions)
    per_position = write.per_position or write.target_per_position
    tapped.writes.assign(write, rows, torch.arange(len(positions)) if per_position else None)
    got = tapped.logits(ids)
    oracle = sync_model(eager_model("llama")).capture(ids, [Address("logits")], steering_spec=SteeringSpec([write]))
    assert rel_diff(got, oracle[Address("logits")]) <= 1e-4


def test_unsteered_tokens_are_bit_identical(tapped: _Tapped) -> None:
    ids = _ids()
    tapped.writes.clear()
    plain = tapped.logits(ids)
    plain_capture = tapped.tap.read(0, len(ids))
    # steer only the last token: every earlier row of layer 1 is untouched, bit for bit
    tapped.writes.assign(Write("resid_post.1", torch.ones(64), op="add"), torch.tensor([len(ids) - 1]))
    tapped.logits(ids)
    steered_capture = tapped.tap.read(0, len(ids))
    assert torch.equal(steered_capture[:-1], plain_capture[:-1])
    assert not torch.equal(steered_capture[-1], plain_capture[-1])
    tapped.writes.clear()
    assert torch.equal(tapped.logits(ids), plain)


def test_changing_tables_and_lengths_never_recompiles(tapped: _Tapped) -> None:
    tapped.writes.clear()
    tapped.logits(_ids("Hello there friend"))
    before = tapped.graphs
    assert before >= 1  # the forward really went through the compiler, taps included
    gen = torch.Generator().manual_seed(9)
    for i, text in enumerate(["A cat sat on the mat", PROMPT, "Once upon a time", "Hello"] * 5):
        ids = _ids(text)
        tapped.writes.clear()
        op = ("add", "set", "ablate")[i % 3]
        tapped.writes.assign(Write("resid_post.1", torch.randn(64, generator=gen), op=op), torch.arange(len(ids)))
        tapped.logits(ids)
    assert tapped.graphs == before


def test_changing_ops_never_recompiles(tapped: _Tapped) -> None:
    """Every op, and a composed slot, only fills the tables allocated before compilation."""
    ids = _ids()
    tapped.writes.clear()
    tapped.logits(ids)
    before = tapped.graphs
    gen = torch.Generator().manual_seed(13)
    direction = torch.randn(64, generator=gen)
    writes = [
        Write("resid_post.1", torch.randn(64, generator=gen), op="cap", lo=-0.2, hi=0.3),
        Write("resid_post.1", torch.randn(64, generator=gen), op="rescale", scale=0.5),
        Write("resid_post.1", torch.randn(64, generator=gen), op="norm_add", scale=0.5, max_fraction=0.2),
        Write("resid_post.1", torch.randn(64, generator=gen), op="swap", target=torch.randn(64, generator=gen)),
        Write("resid_post.1", torch.randn(64, generator=gen), op="set"),
        Write("resid_post.1", torch.randn(64, generator=gen), op="ablate"),
    ]
    plain = tapped.logits(ids)
    for write in writes:
        tapped.writes.clear()
        tapped.writes.assign(write, torch.arange(len(ids)))
        assert not torch.equal(tapped.logits(ids), plain), write.op
    tapped.writes.clear()
    (slot,) = tapped.writes.allocate(1)
    steps = [
        (Write("resid_post.1", direction, op="rescale", scale=2.0), direction, None),
        (Write("resid_post.1", direction, op="cap", lo=-0.5, hi=0.5), direction, None),
        (Write("resid_post.1", direction, op="norm_add", scale=0.1), direction, None),
    ]
    tapped.writes.fill(slot, compose(steps, 64))
    tapped.writes.set_index(torch.full((len(ids),), slot))
    tapped.logits(ids)
    assert tapped.graphs == before


# -- the per-slot pipeline against the core's apply_op (no model) -------------------------------

WIDTH = 24


def _w(seed: int, rows: int = 0) -> torch.Tensor:
    return _vec(seed, rows, WIDTH)


D = _w(100)
SEQUENCES: dict[str, list[Write]] = {
    "add": [Write("resid_post.0", _w(1), op="add", scale=2.0)],
    "set": [Write("resid_post.0", _w(2), op="set", scale=-1.0)],
    "ablate": [Write("resid_post.0", _w(3), op="ablate", scale=0.7)],
    "cap": [Write("resid_post.0", _w(4), op="cap", lo=-0.5, hi=0.8)],
    "cap-lo": [Write("resid_post.0", _w(5), op="cap", lo=0.3)],
    "rescale": [Write("resid_post.0", _w(6), op="rescale", scale=-1.5)],
    "norm_add": [Write("resid_post.0", _w(7), op="norm_add", scale=0.3)],
    "norm_add-max_fraction": [Write("resid_post.0", _w(8), op="norm_add", scale=-2.0, max_fraction=0.5)],
    "swap": [Write("resid_post.0", _w(9), op="swap", target=_w(10), scale=0.75)],
    "composed": [
        Write("resid_post.0", _w(11), op="add"),
        Write("resid_post.0", D, op="ablate", scale=0.5),
        Write("resid_post.0", -D, op="rescale", scale=2.0),  # the same line, the other way
        Write("resid_post.0", D, op="swap", target=_w(12)),
        Write("resid_post.0", _w(13), op="add", scale=0.5),
        Write("resid_post.0", _w(14), op="cap", lo=-0.4, hi=0.6),
        Write("resid_post.0", _w(15), op="add"),  # an add after a cap moves the cap's bounds
        Write("resid_post.0", _w(16), op="norm_add", scale=0.2, max_fraction=0.1),
    ],
    "two caps on one line": [
        Write("resid_post.0", D, op="cap", lo=-1.0, hi=0.5),
        Write("resid_post.0", -2.0 * D, op="cap", lo=-0.2, hi=3.0),
    ],
    "set then projections": [
        Write("resid_post.0", _w(17), op="set"),
        Write("resid_post.0", _w(18), op="ablate"),
        Write("resid_post.0", _w(19), op="swap", target=_w(20)),
        Write("resid_post.0", _w(21), op="cap", hi=0.0),
    ],
    "projection then set": [
        Write("resid_post.0", _w(22), op="norm_add", scale=3.0),
        Write("resid_post.0", _w(23), op="set", scale=2.0),
        Write("resid_post.0", _w(24), op="rescale", scale=3.0),
    ],
}


@pytest.mark.parametrize("writes", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_the_slot_pipeline_equals_apply_op(writes: list[Write]) -> None:
    x = torch.randn(10, WIDTH, generator=torch.Generator().manual_seed(50)) * 2
    expected = x
    for write in writes:
        expected = write.apply(expected)  # the core's apply_op, one write at a time
    table = StaticWrites(4, WIDTH, 16, dtype=torch.float32, device="cpu")
    (slot,) = table.allocate(1)
    table.fill(slot, compose([(w, w.vector, w.target) for w in writes], WIDTH))
    table.set_index(torch.tensor([slot] * 7 + [0] * 3))
    got = table(x)
    assert rel_diff(got[:7], expected[:7]) <= 1e-5
    assert torch.equal(got[7:], x[7:])  # slot 0: bit for bit
    assert not torch.equal(got[:7], x[:7])
    assert bool(torch.isfinite(got).all())


def test_plan_writes_folds_per_position_vectors_and_targets_per_head() -> None:
    heads, d, n = 4, 8, 5
    gen = torch.Generator().manual_seed(60)
    writes = [
        Write(
            "attn_z.1",
            torch.randn(3, 2, d, generator=gen),
            op="swap",
            heads=[1, 3],
            positions=[0, 2, 4],
            target=torch.randn(d, generator=gen),
        ),
        Write("attn_z.1", torch.randn(d, generator=gen), op="norm_add", scale=0.2, heads=[3]),
        Write(
            "attn_z.1", torch.randn(d, generator=gen), op="swap", heads=[0], target=torch.randn(n, 1, d, generator=gen)
        ),
        Write("attn_z.1", torch.randn(d, generator=gen), op="cap", hi=0.1, heads=[0], positions=[1]),
    ]
    (plan,) = plan_writes(writes, n, n, lambda address: heads).values()
    x = torch.randn(n, heads, d, generator=gen)
    expected = x
    for write in writes:
        picked = [p for p in range(n) if write.positions == "all" or p in write.positions]
        expected = expected.clone()
        expected[picked] = write.apply(expected[picked])  # per-position rows are in position order
    table = StaticWrites(len(plan.ops) + 1, d, n * heads, dtype=torch.float32, device="cpu")
    slots = table.allocate(len(plan.ops))
    for slot, op in zip(slots, plan.ops, strict=True):
        table.fill(slot, op)
    table.set_index(torch.tensor([0, *slots])[plan.combo])
    got = table(x.reshape(n * heads, d)).reshape(n, heads, d)
    assert rel_diff(got, expected) <= 1e-5
    assert torch.equal(got[:, 2], x[:, 2])  # no write touches head 2


UNFOLDABLE: dict[str, list[Write]] = {
    "two swaps": [
        Write("resid_post.0", _w(1), op="swap", target=_w(2)),
        Write("resid_post.0", _w(3), op="swap", target=_w(4)),
    ],
    "rescale then ablate": [
        Write("resid_post.0", _w(5), op="rescale", scale=2.0),
        Write("resid_post.0", _w(6), op="ablate"),
    ],
    "ablate after a cap": [Write("resid_post.0", _w(7), op="cap", hi=0.0), Write("resid_post.0", _w(8), op="ablate")],
    "two caps": [Write("resid_post.0", _w(9), op="cap", hi=0.0), Write("resid_post.0", _w(10), op="cap", lo=0.0)],
    "two norm_adds": [
        Write("resid_post.0", _w(11), op="norm_add"),
        Write("resid_post.0", _w(12), op="norm_add"),
    ],
    "add after norm_add": [Write("resid_post.0", _w(13), op="norm_add"), Write("resid_post.0", _w(14))],
    "cap after norm_add": [
        Write("resid_post.0", _w(15), op="norm_add"),
        Write("resid_post.0", _w(16), op="cap", hi=1.0),
    ],
}


@pytest.mark.parametrize("writes", UNFOLDABLE.values(), ids=UNFOLDABLE.keys())
def test_sequences_outside_the_pipeline_are_refused(writes: list[Write]) -> None:
    with pytest.raises(InvalidSteering, match="use the vllm or eager backend"):
        compose([(w, w.vector, w.target) for w in writes], WIDTH)
    # the same writes at different tokens fold fine
    plan = plan_writes(
        [
            Write(w.address, w.vector, op=w.op, scale=w.scale, positions=[i], target=w.target, lo=w.lo, hi=w.hi)
            for i, w in enumerate(writes)
        ],
        len(writes),
        len(writes),
    )
    assert len(next(iter(plan.values())).ops) == len(writes)


def _banned(seed: int, *experts: int) -> torch.Tensor:
    vector = _w(seed) * 0.1
    vector[list(experts)] = -torch.inf
    return vector


BANS: dict[str, list[Write]] = {
    "add -inf": [Write("router_logits.0", _banned(30, 3))],
    "set with -inf": [Write("router_logits.0", _banned(31, 0, 5), op="set", scale=2.0)],
    "add, cap, then add -inf": [
        Write("router_logits.0", _w(32)),
        Write("router_logits.0", _w(33), op="cap", hi=0.2),
        Write("router_logits.0", _banned(34, 7)),
        Write("router_logits.0", _banned(35, 1), scale=0.5),
    ],
    "a set after -inf clears it": [
        Write("router_logits.0", _banned(36, 2)),
        Write("router_logits.0", _w(37), op="set"),
    ],
}


@pytest.mark.parametrize("writes", BANS.values(), ids=BANS.keys())
def test_minus_inf_router_logits_in_the_slot_pipeline(writes: list[Write]) -> None:
    """An expert ablated by a -inf logit: the table forces -inf where apply_op gives it, with no
    NaN from -inf * 0 in the pipeline's other stages, and untouched tokens stay bit for bit."""
    x = torch.randn(10, WIDTH, generator=torch.Generator().manual_seed(51))
    expected = x
    for write in writes:
        expected = write.apply(expected)
    table = StaticWrites(4, WIDTH, 16, dtype=torch.float32, device="cpu", bans=True)
    (slot,) = table.allocate(1)
    table.fill(slot, compose([(w, w.vector, w.target) for w in writes], WIDTH))
    table.set_index(torch.tensor([slot] * 7 + [0] * 3))
    got = table(x)
    assert not bool(torch.isnan(got).any())
    assert rel_diff(got[:7], expected[:7]) <= 1e-5  # -inf in the same places on both sides
    assert torch.equal(got[7:], x[7:])
    # a table without bans (any address but router_logits) refuses such a slot
    plain = StaticWrites(4, WIDTH, 16, dtype=torch.float32, device="cpu")
    (slot,) = plain.allocate(1)
    if any(bool(torch.isneginf(w.vector).any()) for w in writes[-1:]):
        with pytest.raises(InvalidSteering, match="router_logits"):
            plain.fill(slot, compose([(w, w.vector, w.target) for w in writes], WIDTH))


def test_minus_inf_is_refused_outside_router_logits_and_before_other_ops() -> None:
    with pytest.raises(InvalidSteering, match="NaN or infinite"):
        Write("resid_post.0", _banned(40, 1))
    with pytest.raises(InvalidSteering, match="every expert"):
        Write("router_logits.0", torch.full((WIDTH,), -torch.inf))
    with pytest.raises(InvalidSteering, match="scale > 0"):
        Write("router_logits.0", _banned(41, 1), scale=0.0)
    with pytest.raises(InvalidSteering, match="NaN or infinite"):
        Write("router_logits.0", _banned(42, 1), op="ablate")
    with pytest.raises(InvalidSteering, match="would be NaN"):
        compose(
            [
                (w, w.vector, w.target)
                for w in [Write("router_logits.0", _banned(43, 1)), Write("router_logits.0", _w(44), op="ablate")]
            ],
            WIDTH,
        )
