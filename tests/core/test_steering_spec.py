"""SteeringSpec / Write (SPEC §6) and the shared input checks of ``interp_engine.protocol._checks``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    ContextTooLong,
    InterpError,
    InvalidAddress,
    InvalidSteering,
    InvalidTokens,
    LayerOutOfRange,
    ModelInfo,
    SteeringSpec,
    UnsupportedAddress,
    Write,
)
from interp_engine.protocol._checks import (
    check_spec,
    check_token_ids,
    check_write_shapes,
    resolve_points,
    width_of,
    write_positions,
)

WIDTH = 8
INFO = ModelInfo(
    architecture="HandMade",
    n_layers=4,
    d_model=WIDTH,
    d_mlp=32,
    n_heads=2,
    n_kv_heads=2,
    vocab_size=100,
    n_ctx=16,
)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def round_trip(spec: SteeringSpec) -> SteeringSpec:
    text = spec.to_json()
    json.loads(text)  # plain JSON, no pickles
    return SteeringSpec.from_json(text)


# -- the canonical spelling --------------------------------------------------------------


def test_canonical_snippet() -> None:
    vector = rand(WIDTH)

    spec = SteeringSpec([Write(Address("resid_post", 3), vector, op="add", scale=4.0)])
    assert SteeringSpec.from_json(spec.to_json()) == spec

    (write,) = SteeringSpec.from_json(spec.to_json()).writes
    assert write.address == Address("resid_post", 3)
    assert write.op == "add" and write.scale == 4.0 and write.positions == "all"
    assert write.vector.dtype == torch.float32
    assert torch.equal(write.vector, vector)  # float32 survives JSON bit for bit


def test_equality_is_by_value() -> None:
    vector = rand(WIDTH)
    spec = SteeringSpec([Write(Address("resid_post", 3), vector, op="add", scale=4.0)])
    assert spec == SteeringSpec([Write("resid_post.3", vector.clone(), op="add", scale=4.0)])
    assert spec != SteeringSpec([Write("resid_post.3", vector, op="add", scale=2.0)])
    assert spec != SteeringSpec([Write("resid_post.2", vector, op="add", scale=4.0)])
    assert spec != SteeringSpec([Write("resid_post.3", vector + 1e-6, op="add", scale=4.0)])
    assert spec != SteeringSpec([Write("resid_post.3", vector, op="set", scale=4.0)])
    assert spec != SteeringSpec([Write("resid_post.3", vector, op="add", scale=4.0, positions="prompt")])
    assert spec != SteeringSpec([])


def test_set_with_one_row_per_position_round_trips() -> None:
    rows = rand(3, WIDTH, seed=1)
    spec = SteeringSpec([Write(Address("resid_pre", 0), rows, op="set", positions=[0, 2, -1])])
    back = round_trip(spec)
    assert back == spec
    assert back.writes[0].vector.shape == (3, WIDTH)
    assert back.writes[0].positions == (0, 2, -1)


def test_ablate_round_trips() -> None:
    spec = SteeringSpec([Write("mlp_out.1", rand(WIDTH, seed=2), op="ablate")])
    assert round_trip(spec) == spec
    assert round_trip(spec).writes[0].op == "ablate"


@pytest.mark.parametrize(
    ("positions", "stored"),
    [
        ("all", "all"),
        ("prompt", "prompt"),
        ("generated", "generated"),
        ([0, 1, 5], (0, 1, 5)),
        ([3, -1, -2], (3, -1, -2)),
        ((4,), (4,)),
        (2, (2,)),
        (-1, (-1,)),
        (torch.tensor([1, 0]), (1, 0)),
    ],
    ids=repr,
)
def test_every_positions_form_round_trips(positions: Any, stored: Any) -> None:
    write = Write("resid_post.1", rand(WIDTH), positions=positions)
    assert write.positions == stored
    spec = SteeringSpec([write])
    assert round_trip(spec) == spec
    assert round_trip(spec).writes[0].positions == stored


def test_several_writes_keep_their_order() -> None:
    spec = SteeringSpec(
        [
            Write("resid_post.2", rand(WIDTH, seed=1), scale=-1.5),
            Write("embed", rand(WIDTH, seed=2), op="set", positions="prompt"),
            Write("resid_post.2", rand(WIDTH, seed=3), op="ablate", positions=[0]),
            Write("mlp_post.0", rand(32, seed=4), positions="generated"),
        ]
    )
    back = round_trip(spec)
    assert back == spec
    assert [str(w.address) for w in back] == ["resid_post.2", "embed", "resid_post.2", "mlp_post.0"]
    assert spec.addresses == (Address("resid_post", 2), Address("embed"), Address("mlp_post", 0))
    assert len(spec) == 4 and bool(spec) and not bool(SteeringSpec())


def test_from_dict_accepts_a_bare_list_and_defaults() -> None:
    spec = SteeringSpec.from_dict([{"address": "resid_post.0", "vector": [1.0] * WIDTH}])
    (write,) = spec.writes
    assert (write.op, write.scale, write.positions) == ("add", 1.0, "all")
    assert SteeringSpec.from_json(json.dumps({"writes": []})) == SteeringSpec()


def test_string_addresses_are_accepted() -> None:
    vector = rand(WIDTH)
    write = Write("resid_post.3", vector, op="add", scale=4.0)
    assert write.address == Address("resid_post", 3)
    assert isinstance(write.address, Address)
    assert write == Write(Address("resid_post", 3), vector, op="add", scale=4.0)
    assert Write("final_norm", vector).address == Address("final_norm")


def test_vector_is_stored_as_float32_on_cpu() -> None:
    write = Write("resid_post.0", torch.arange(WIDTH, dtype=torch.float64))
    assert write.vector.dtype == torch.float32
    assert write.vector.device.type == "cpu"
    assert Write("resid_post.0", [1, 2, 3]).vector.dtype == torch.float32
    assert Write("resid_post.0", rand(WIDTH)).width == WIDTH


def test_write_does_not_alias_the_callers_tensor() -> None:
    vector = rand(WIDTH)
    write = Write("resid_post.0", vector)
    before = write.vector.clone()
    vector.add_(1.0)  # in-place change after construction must not leak into a serialised spec
    assert torch.equal(write.vector, before)


# -- steering errors ---------------------------------------------------------------------

BAD_WRITES: dict[str, Any] = {
    "nan vector": lambda: Write("resid_post.0", torch.tensor([1.0, math.nan])),
    "inf vector": lambda: Write("resid_post.0", torch.tensor([1.0, math.inf])),
    "-inf in a set tensor": lambda: Write("resid_post.0", torch.tensor([[1.0], [-math.inf]]), op="set"),
    "too large for float32": lambda: Write("resid_post.0", torch.tensor([1e300], dtype=torch.float64)),
    "empty vector": lambda: Write("resid_post.0", torch.tensor([])),
    "empty list": lambda: Write("resid_post.0", []),
    "0-d tensor": lambda: Write("resid_post.0", torch.tensor(1.0)),
    "3-D tensor": lambda: Write("resid_post.0", torch.zeros(2, 3, 4)),
    "bool vector": lambda: Write("resid_post.0", torch.tensor([True, False])),
    "complex vector": lambda: Write("resid_post.0", torch.tensor([1 + 1j])),
    "text vector": lambda: Write("resid_post.0", "abc"),
    "ragged rows": lambda: Write("resid_post.0", [[1.0, 2.0], [3.0]], op="set"),
    "unknown op": lambda: Write("resid_post.0", rand(WIDTH), op="multiply"),
    "nan scale": lambda: Write("resid_post.0", rand(WIDTH), scale=math.nan),
    "inf scale": lambda: Write("resid_post.0", rand(WIDTH), scale=math.inf),
    "string scale": lambda: Write("resid_post.0", rand(WIDTH), scale="4"),
    "bool scale": lambda: Write("resid_post.0", rand(WIDTH), scale=True),
    "ablate zero vector": lambda: Write("resid_post.0", torch.zeros(WIDTH), op="ablate"),
    "ablate 2-D tensor": lambda: Write("resid_post.0", rand(2, WIDTH), op="ablate"),
    "write at logits": lambda: Write("logits", rand(WIDTH)),
    "write at attn_pattern": lambda: Write(Address("attn_pattern", 0), rand(WIDTH)),
    "unknown positions name": lambda: Write("resid_post.0", rand(WIDTH), positions="last"),
    "repeated positions": lambda: Write("resid_post.0", rand(WIDTH), positions=[1, 2, 1]),
    "empty positions": lambda: Write("resid_post.0", rand(WIDTH), positions=[]),
    "float positions": lambda: Write("resid_post.0", rand(WIDTH), positions=[1.5]),
    "bool positions": lambda: Write("resid_post.0", rand(WIDTH), positions=True),
    "None positions": lambda: Write("resid_post.0", rand(WIDTH), positions=None),
    "spec of non-writes": lambda: SteeringSpec([{"address": "resid_post.0", "vector": [1.0]}]),
}


@pytest.mark.parametrize("make", BAD_WRITES.values(), ids=BAD_WRITES.keys())
def test_bad_writes_raise_invalid_steering(make: Any) -> None:
    with pytest.raises(InvalidSteering) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, InterpError)
    assert str(info.value)


def test_read_only_errors_name_the_address() -> None:
    with pytest.raises(InvalidSteering, match="logits"):
        Write("logits", rand(WIDTH))
    with pytest.raises(InvalidSteering, match=r"attn_pattern\.2"):
        Write("attn_pattern.2", rand(WIDTH))


def test_unknown_op_and_positions_errors_list_the_valid_ones() -> None:
    with pytest.raises(InvalidSteering) as info:
        Write("resid_post.0", rand(WIDTH), op="multiply")
    assert all(op in str(info.value) for op in ("add", "set", "ablate"))
    with pytest.raises(InvalidSteering) as info:
        Write("resid_post.0", rand(WIDTH), positions="last")
    assert all(name in str(info.value) for name in ("all", "prompt", "generated"))


GOOD = {"address": "resid_post.0", "vector": [0.5] * WIDTH}
BAD_JSON: dict[str, str | bytes] = {
    "not json": "{not json",
    "truncated": '{"writes": [',
    "empty": "",
    "not utf-8 bytes": b'{"writes": [\xff]}',
    "null": "null",
    "a number": "3",
    "writes not a list": json.dumps({"writes": {"address": "resid_post.0"}}),
    "no writes key": json.dumps({"nope": []}),
    "unknown write field": json.dumps({"writes": [{**GOOD, "layer": 3}]}),
    "unknown top-level field": json.dumps({"writes": [GOOD], "model": "gpt2"}),
    "write missing vector": json.dumps({"writes": [{"address": "resid_post.0"}]}),
    "write not an object": json.dumps({"writes": [[1, 2]]}),
    "vector of strings": json.dumps({"writes": [{**GOOD, "vector": ["a", "b"]}]}),
    "nan vector": '{"writes": [{"address": "resid_post.0", "vector": [NaN, 1.0]}]}',
    "bad op": json.dumps({"writes": [{**GOOD, "op": "scale"}]}),
    "string scale": json.dumps({"writes": [{**GOOD, "scale": "4"}]}),
    "read-only address": json.dumps({"writes": [{**GOOD, "address": "logits"}]}),
}


@pytest.mark.parametrize("text", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_from_json_rejects_bad_input_with_invalid_steering(text: str | bytes) -> None:
    with pytest.raises(InvalidSteering) as info:
        SteeringSpec.from_json(text)
    assert isinstance(info.value, ValueError)


def test_from_json_accepts_bytes() -> None:
    spec = SteeringSpec([Write("resid_post.0", rand(WIDTH))])
    assert SteeringSpec.from_json(spec.to_json().encode()) == spec


# -- interp_engine.protocol._checks ------------------------------------------------------------


def test_check_token_ids_accepts_lists_and_tensors() -> None:
    assert check_token_ids([1, 2, 99], INFO) == [1, 2, 99]
    assert check_token_ids((0,), INFO) == [0]
    ids = check_token_ids(torch.tensor([[5, 6, 7]]), INFO)  # [1, n], as to_tokens returns
    assert ids == [5, 6, 7] and all(type(i) is int for i in ids)
    assert check_token_ids(torch.tensor([5, 6]), INFO) == [5, 6]
    assert check_token_ids(list(range(INFO.n_ctx)), INFO) == list(range(INFO.n_ctx))


def test_check_token_ids_returns_a_new_list_of_plain_ints() -> None:
    given = [4, 5, 6]
    ids = check_token_ids(given, INFO)
    assert ids == given and ids is not given  # the caller's list is never handed back to be mutated
    ids.append(7)
    assert given == [4, 5, 6]

    class Id(int):
        pass

    mixed = check_token_ids([Id(3), 4], INFO)  # an int subclass among plain ints
    assert mixed == [3, 4] and [type(i) for i in mixed] == [int, int]


BAD_TOKENS: dict[str, Any] = {
    "empty list": [],
    "empty tensor": torch.tensor([], dtype=torch.long),
    "empty [1, 0] tensor": torch.zeros(1, 0, dtype=torch.long),
    "id == vocab": [1, 100],
    "id > vocab": [1000],
    "negative id": [3, -1],
    "a string": "hello",
    "bytes": b"hello",
    "list of strings": ["a", "b"],
    "floats": [1.0, 2.0],
    "float tensor": torch.tensor([1.0, 2.0]),
    "bools": [True, False],
    "nested lists": [[1, 2]],
    "2-D batch tensor": torch.tensor([[1, 2], [3, 4]]),
    "3-D tensor": torch.zeros(1, 1, 2, dtype=torch.long),
    "None": None,
    "an int": 5,
}


@pytest.mark.parametrize("token_ids", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_check_token_ids_rejects(token_ids: Any) -> None:
    with pytest.raises(InvalidTokens) as info:
        check_token_ids(token_ids, INFO)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InterpError)
    assert not isinstance(info.value, ContextTooLong)


def test_out_of_vocab_message_names_the_id_and_the_vocab() -> None:
    with pytest.raises(InvalidTokens) as info:
        check_token_ids([1, 2, 123], INFO)
    assert "123" in str(info.value) and "100" in str(info.value)


def test_too_long_is_context_too_long() -> None:
    with pytest.raises(ContextTooLong) as info:
        check_token_ids(list(range(INFO.n_ctx + 1)), INFO)
    assert isinstance(info.value, InvalidTokens) and isinstance(info.value, ValueError)
    assert str(INFO.n_ctx) in str(info.value)


def test_context_too_long_counts_the_tokens_to_generate() -> None:
    prompt = list(range(10))
    assert check_token_ids(prompt, INFO, extra=6) == prompt  # exactly the window
    with pytest.raises(ContextTooLong) as info:
        check_token_ids(prompt, INFO, extra=7)
    assert "7" in str(info.value) and "16" in str(info.value)


def test_resolve_points_resolves_and_deduplicates_in_request_order() -> None:
    points = ["resid_post.-1", Address("resid_pre", 0), "resid_post.3", "logits", "mlp_post.-4", "logits"]
    assert resolve_points(points, INFO) == [
        Address("resid_post", 3),
        Address("resid_pre", 0),
        Address("logits"),
        Address("mlp_post", 0),
    ]


def test_resolve_points_takes_one_point() -> None:
    assert resolve_points("resid_post.-2", INFO) == [Address("resid_post", 2)]
    assert resolve_points(Address("embed"), INFO) == [Address("embed")]


def test_resolve_points_rejects_an_unsupported_kind() -> None:
    supported = ("embed", "resid_post", "logits")
    assert resolve_points(["resid_post.1"], INFO, supported) == [Address("resid_post", 1)]
    with pytest.raises(UnsupportedAddress) as info:
        resolve_points(["resid_post.1", "mlp_post.0"], INFO, supported)
    error = info.value
    assert isinstance(error, InvalidAddress) and isinstance(error, ValueError)
    assert error.address == Address("mlp_post", 0)
    assert tuple(error.valid) == supported
    assert "mlp_post.0" in str(error) and "resid_post" in str(error)


def test_resolve_points_errors() -> None:
    with pytest.raises(LayerOutOfRange):
        resolve_points(["resid_post.4"], INFO)
    with pytest.raises(LayerOutOfRange):
        resolve_points(["resid_post.-5"], INFO)
    with pytest.raises(InvalidAddress):
        resolve_points(["residual.0"], INFO)
    with pytest.raises(UnsupportedAddress):
        resolve_points([], INFO)


def test_width_of() -> None:
    assert width_of(Address("resid_post", 0), INFO) == WIDTH
    assert width_of(Address("embed"), INFO) == WIDTH
    assert width_of(Address("final_norm"), INFO) == WIDTH
    assert width_of(Address("mlp_post", 1), INFO) == INFO.d_mlp


def test_check_spec_accepts_and_resolves() -> None:
    assert check_spec(None, INFO) == []
    spec = SteeringSpec(
        [
            Write("resid_post.-1", rand(WIDTH), scale=2.0, positions=[0, -1]),
            Write("mlp_post.0", rand(INFO.d_mlp), op="ablate"),
            Write("embed", rand(3, WIDTH), op="set", positions="prompt"),
        ]
    )
    writes = check_spec(spec, INFO)
    assert [w.address for w in writes] == [Address("resid_post", 3), Address("mlp_post", 0), Address("embed")]
    assert writes[0].scale == 2.0 and writes[0].positions == (0, -1)
    assert torch.equal(writes[0].vector, spec.writes[0].vector)
    assert writes[1].op == "ablate" and writes[2].op == "set"


def test_check_spec_width_mismatch_names_both_widths() -> None:
    spec = SteeringSpec([Write("resid_post.1", rand(WIDTH - 1))])
    with pytest.raises(InvalidSteering) as info:
        check_spec(spec, INFO)
    message = str(info.value)
    assert str(WIDTH - 1) in message and str(WIDTH) in message and "resid_post.1" in message


def test_check_spec_mlp_post_is_d_mlp_wide() -> None:
    with pytest.raises(InvalidSteering) as info:
        check_spec(SteeringSpec([Write("mlp_post.0", rand(WIDTH))]), INFO)
    assert "32" in str(info.value) and "8" in str(info.value)
    with pytest.raises(InvalidSteering):
        check_spec(SteeringSpec([Write("resid_post.0", rand(INFO.d_mlp))]), INFO)


def test_check_spec_other_errors() -> None:
    with pytest.raises(LayerOutOfRange):
        check_spec(SteeringSpec([Write("resid_post.4", rand(WIDTH))]), INFO)
    with pytest.raises(UnsupportedAddress) as info:
        check_spec(SteeringSpec([Write("resid_mid.0", rand(WIDTH))]), INFO, writable=("resid_post",))
    assert "resid_mid.0" in str(info.value)
    with pytest.raises(InvalidSteering):
        check_spec([Write("resid_post.0", rand(WIDTH))], INFO)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("positions", "expected"),
    [
        ("all", [0, 1, 2, 3, 4]),
        ("prompt", [0, 1, 2]),
        ("generated", [3, 4]),
        ([0, 2], [0, 2]),
        ([-1], [2]),  # negative indices count back from the end of the prompt
        ([-3, 4], [0, 4]),
    ],
    ids=repr,
)
def test_write_positions(positions: Any, expected: list[int]) -> None:
    write = Write("resid_post.0", rand(WIDTH), positions=positions)
    assert write_positions(write, n_prompt=3, n_total=5) == expected


def test_write_positions_before_the_start() -> None:
    with pytest.raises(InvalidSteering):
        write_positions(Write("resid_post.0", rand(WIDTH), positions=[-4]), n_prompt=3, n_total=5)


def test_check_write_shapes() -> None:
    ok = [
        Write("resid_post.0", rand(3, WIDTH), op="set", positions="prompt"),
        Write("resid_post.0", rand(2, WIDTH), op="set", positions="generated"),
        Write("resid_post.0", rand(WIDTH), positions=[4]),
        Write("resid_post.0", rand(2, WIDTH), op="add", positions=[0, -1]),
    ]
    check_write_shapes(ok, n_prompt=3, n_total=5)


def test_check_write_shapes_row_count_mismatch() -> None:
    write = Write("resid_post.1", rand(2, WIDTH), op="set", positions="prompt")
    with pytest.raises(InvalidSteering) as info:
        check_write_shapes([write], n_prompt=3, n_total=5)
    assert "2 rows" in str(info.value) and "3 positions" in str(info.value)
    with pytest.raises(InvalidSteering):
        check_write_shapes([Write("resid_post.1", rand(4, WIDTH), op="set")], n_prompt=3, n_total=5)


def test_check_write_shapes_position_beyond_the_sequence() -> None:
    write = Write("resid_post.1", rand(WIDTH), positions=[0, 5])
    with pytest.raises(InvalidSteering) as info:
        check_write_shapes([write], n_prompt=3, n_total=5)
    assert "5" in str(info.value)


# -- heads ------------------------------------------------------------------------------------


def test_head_writes_round_trip_through_json() -> None:
    spec = SteeringSpec(
        [
            Write("attn_z.1", torch.zeros(8), op="set", heads=[1]),
            Write("attn_z.0", torch.randn(2, 8), op="add", scale=2.0, heads=[0, 1], positions=[0, -1]),
            Write("attn_v.1", torch.randn(3, 1, 8), op="set", heads=[0], positions=[0, 1, 2]),
            Write("attn_z.1", torch.randn(8), op="ablate"),
        ]
    )
    back = SteeringSpec.from_json(spec.to_json())
    assert back == spec
    assert [w.heads for w in back] == [(1,), (0, 1), (0,), None]
    assert spec.writes[0] != Write("attn_z.1", torch.zeros(8), op="set", heads=[0])


def test_write_apply_changes_only_the_selected_heads() -> None:
    x = torch.randn(5, 4, 8)
    rows = torch.randn(2, 8)
    out = Write("attn_z.0", rows, op="add", heads=[3, 1]).apply(x)
    assert torch.equal(out[:, [0, 2]], x[:, [0, 2]])
    assert torch.allclose(out[:, 3], x[:, 3] + rows[0]) and torch.allclose(out[:, 1], x[:, 1] + rows[1])
    direction = torch.randn(8)
    ablated = Write("attn_z.0", direction, op="ablate", heads=[2]).apply(x)
    assert float((ablated[:, 2] @ (direction / direction.norm())).abs().max()) < 1e-5
    assert torch.equal(ablated[:, [0, 1, 3]], x[:, [0, 1, 3]])
    assert torch.equal(x, x.clone())  # apply never writes into its input


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Write("resid_post.0", torch.zeros(16), heads=[0]), "no head axis"),
        (lambda: Write("attn_q.0", torch.zeros(8)), "read-only"),
        (lambda: Write("attn_z.0", torch.zeros(3, 8), heads=[0, 1]), "head rows"),
        (lambda: Write("attn_z.0", torch.zeros(8), heads=[0, 0]), "repeat"),
        (lambda: Write("attn_z.0", torch.zeros(8), heads=[-1]), "head indices"),
        (lambda: Write("attn_z.0", torch.zeros(2, 2, 8), op="ablate", heads=[0, 1]), "ablate"),
    ],
)
def test_bad_head_writes_are_clear(make: Any, match: str) -> None:
    with pytest.raises(InvalidSteering, match=match):
        make()


def test_head_writes_are_checked_against_the_model() -> None:
    with pytest.raises(InvalidSteering, match="out of range"):
        check_spec(SteeringSpec([Write("attn_z.0", torch.zeros(INFO.d_head), heads=[INFO.n_heads])]), INFO)
    with pytest.raises(InvalidSteering, match="per head"):
        check_spec(SteeringSpec([Write("attn_z.0", torch.zeros(INFO.d_head + 1))]), INFO)
    with pytest.raises(InvalidSteering, match="head rows"):
        check_spec(SteeringSpec([Write("attn_v.0", torch.zeros(INFO.n_kv_heads + 1, INFO.d_head))]), INFO)
    (write,) = check_spec(SteeringSpec([Write("attn_z.-1", torch.zeros(INFO.d_head), heads=[1])]), INFO)
    assert write.address == Address("attn_z", INFO.n_layers - 1) and write.heads == (1,)


# -- the arithmetic ops: cap, rescale, norm_add, swap -------------------------------------------


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True)


def test_each_op_does_its_arithmetic() -> None:
    x = rand(5, WIDTH, seed=20)
    v, t = rand(WIDTH, seed=21), rand(WIDTH, seed=22)
    d, u = _unit(v), _unit(t)
    p = (x @ d).unsqueeze(-1)
    capped = Write("resid_post.0", v, op="cap", lo=-0.2, hi=0.3).apply(x)
    assert torch.allclose(capped, x + (p.clamp(-0.2, 0.3) - p) * d, atol=1e-6)
    assert float((capped @ d).max()) <= 0.3 + 1e-6 and float((capped @ d).min()) >= -0.2 - 1e-6
    only_hi = Write("resid_post.0", v, op="cap", hi=0.0).apply(x)
    assert torch.allclose(only_hi, x - p.clamp(min=0) * d, atol=1e-6)
    rescaled = Write("resid_post.0", v, op="rescale", scale=3.0).apply(x)
    assert torch.allclose(rescaled, x + 2.0 * p * d, atol=1e-6)
    assert torch.allclose(rescaled @ d, 3.0 * (x @ d), atol=1e-5)
    grown = Write("resid_post.0", v, op="norm_add", scale=0.5).apply(x)
    assert torch.allclose(grown, x + 0.5 * x.norm(dim=-1, keepdim=True) * v, atol=1e-6)
    capped_add = Write("resid_post.0", d, op="norm_add", scale=4.0, max_fraction=0.25).apply(x)
    assert torch.allclose((capped_add - x).norm(dim=-1), 0.25 * x.norm(dim=-1), atol=1e-5)
    small = Write("resid_post.0", d, op="norm_add", scale=0.1, max_fraction=0.25).apply(x)  # under the cap
    assert torch.allclose(small, x + 0.1 * x.norm(dim=-1, keepdim=True) * d, atol=1e-6)
    swapped = Write("resid_post.0", v, op="swap", target=t).apply(x)
    assert torch.allclose(swapped, x + p * (u - d), atol=1e-6)
    half = Write("resid_post.0", v, op="swap", target=t, scale=0.5).apply(x)
    assert torch.allclose(half, x + 0.5 * p * (u - d), atol=1e-6)
    # ablate keeps its meaning; rescale by 0 is a full ablation
    ablated = Write("resid_post.0", v, op="ablate", scale=0.5).apply(x)
    assert torch.allclose(ablated, x - 0.5 * p * d, atol=1e-6)
    assert torch.allclose(Write("resid_post.0", v, op="rescale", scale=0.0).apply(x), x - p * d, atol=1e-6)
    assert torch.equal(x, rand(5, WIDTH, seed=20))  # apply never writes into its input


def test_ops_work_per_head_and_per_position() -> None:
    x = rand(3, 4, 8, seed=23)  # [positions, heads, d_head]
    v = rand(3, 2, 8, seed=24)  # per position, per selected head
    t = rand(8, seed=25)
    write = Write("attn_z.0", v, op="swap", target=t, heads=[1, 3], positions=[0, 1, 2])
    assert write.per_position and not write.target_per_position and write.target_head_rows is None
    out = write.apply(x)
    assert torch.equal(out[:, [0, 2]], x[:, [0, 2]])
    for i, head in enumerate((1, 3)):
        d = _unit(v[:, i])
        p = (x[:, head] * d).sum(-1, keepdim=True)
        assert torch.allclose(out[:, head], x[:, head] + p * (_unit(t) - d), atol=1e-6)
    grown = Write("attn_z.0", rand(8, seed=26), op="norm_add", scale=0.3, heads=[2]).apply(x)
    norms = x[:, 2].norm(dim=-1, keepdim=True)  # |x| per head
    assert torch.allclose(grown[:, 2], x[:, 2] + 0.3 * norms * rand(8, seed=26), atol=1e-6)
    # a per-position target, with the backend passing this chunk's rows
    targets = rand(2, WIDTH, seed=27)
    swap = Write("resid_post.0", rand(WIDTH, seed=28), op="swap", target=targets, positions=[0, 3])
    assert swap.target_per_position and not swap.per_position
    rows = rand(2, WIDTH, seed=29)
    expected = torch.stack(
        [Write("resid_post.0", swap.vector, op="swap", target=targets[i]).apply(rows[i]) for i in (0, 1)]
    )
    assert torch.allclose(swap.apply(rows, None, targets), expected, atol=1e-6)


NEW_OPS = [
    Write("resid_post.1", rand(WIDTH, seed=30), op="cap", lo=-1.5, hi=2.0, positions=[0, -1]),
    Write("resid_post.1", rand(WIDTH, seed=31), op="cap", hi=0.0),
    Write("resid_post.1", rand(WIDTH, seed=32), op="cap", lo=0.5),
    Write("mlp_out.0", rand(3, WIDTH, seed=33), op="rescale", scale=-2.0, positions="prompt"),
    Write("resid_pre.2", rand(WIDTH, seed=34), op="norm_add", scale=0.25),
    Write("resid_pre.2", rand(2, WIDTH, seed=35), op="norm_add", scale=1.5, max_fraction=0.1, positions=[1, 2]),
    Write("resid_mid.0", rand(WIDTH, seed=36), op="swap", target=rand(WIDTH, seed=37), scale=0.5),
    Write("resid_mid.0", rand(2, WIDTH, seed=38), op="swap", target=rand(2, WIDTH, seed=39), positions=[0, 1]),
    Write("attn_z.1", rand(2, 8, seed=40), op="swap", target=rand(3, 2, 8, seed=41), heads=[0, 1], positions=[0, 1, 2]),
    Write("attn_v.0", rand(8, seed=42), op="cap", lo=-0.1, hi=0.1, heads=[1]),
]


def test_new_ops_round_trip_through_json_leaving_unset_fields_out() -> None:
    spec = SteeringSpec(NEW_OPS)
    back = round_trip(spec)
    assert back == spec
    for write, data in zip(back.writes, json.loads(spec.to_json())["writes"], strict=True):
        assert write.op == data["op"]
        assert write.lo == data.get("lo") and write.hi == data.get("hi")
        assert write.max_fraction == data.get("max_fraction")
        assert ("target" in data) == (write.target is not None)
        if write.target is not None:
            assert torch.equal(write.target, torch.tensor(data["target"]))
    assert "lo" not in Write("resid_post.0", rand(WIDTH), op="cap", hi=1.0).to_dict()
    plain = Write("resid_post.0", rand(WIDTH)).to_dict()
    assert not {"target", "lo", "hi", "max_fraction"} & set(plain)
    # every field takes part in equality
    base = NEW_OPS[0]
    assert base != Write("resid_post.1", base.vector, op="cap", lo=-1.5, hi=2.5, positions=[0, -1])
    swap = NEW_OPS[6]
    assert swap != Write("resid_mid.0", swap.vector, op="swap", target=rand(WIDTH, seed=99), scale=0.5)
    assert "target=<[8]>" in repr(swap) and "lo=-1.5" in repr(base)


BAD_OPS: dict[str, tuple[Any, str]] = {
    "cap without bounds": (lambda: Write("resid_post.0", rand(WIDTH), op="cap"), "lo, hi or both"),
    "cap lo > hi": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", lo=1.0, hi=0.5), "lo <= hi"),
    "cap with a scale": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", hi=1.0, scale=2.0), "scale"),
    "cap nan bound": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", hi=math.nan), "hi must be a finite"),
    "cap inf bound": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", lo=-math.inf), "lo must be a finite"),
    "cap string bound": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", lo="0"), "lo must be a finite"),
    "cap bool bound": (lambda: Write("resid_post.0", rand(WIDTH), op="cap", lo=True), "lo must be a finite"),
    "cap zero vector": (lambda: Write("resid_post.0", torch.zeros(WIDTH), op="cap", hi=1.0), "zero vector"),
    "rescale zero row": (
        lambda: Write("resid_post.0", torch.stack([rand(WIDTH), torch.zeros(WIDTH)]), op="rescale", positions=[0, 1]),
        "zero vector",
    ),
    "lo on an add": (lambda: Write("resid_post.0", rand(WIDTH), lo=0.0), "lo is only for op='cap'"),
    "hi on a rescale": (lambda: Write("resid_post.0", rand(WIDTH), op="rescale", hi=0.0), "hi is only for op='cap'"),
    "max_fraction on an add": (
        lambda: Write("resid_post.0", rand(WIDTH), max_fraction=0.5),
        "max_fraction is only for op='norm_add'",
    ),
    "max_fraction zero": (
        lambda: Write("resid_post.0", rand(WIDTH), op="norm_add", max_fraction=0.0),
        "max_fraction must be > 0",
    ),
    "max_fraction inf": (
        lambda: Write("resid_post.0", rand(WIDTH), op="norm_add", max_fraction=math.inf),
        "max_fraction must be a finite",
    ),
    "target on an ablate": (
        lambda: Write("resid_post.0", rand(WIDTH), op="ablate", target=rand(WIDTH)),
        "target is only for op='swap'",
    ),
    "swap without target": (lambda: Write("resid_post.0", rand(WIDTH), op="swap"), "swap needs target"),
    "swap zero target": (
        lambda: Write("resid_post.0", rand(WIDTH), op="swap", target=torch.zeros(WIDTH)),
        "zero target",
    ),
    "swap zero vector": (
        lambda: Write("resid_post.0", torch.zeros(WIDTH), op="swap", target=rand(WIDTH)),
        "zero vector",
    ),
    "swap target width": (
        lambda: Write("resid_post.0", rand(WIDTH), op="swap", target=rand(WIDTH + 1)),
        "target has width 9",
    ),
    "swap nan target": (
        lambda: Write("resid_post.0", rand(WIDTH), op="swap", target=[math.nan] * WIDTH),
        "target contains NaN",
    ),
    "swap 3-D target": (
        lambda: Write("resid_post.0", rand(WIDTH), op="swap", target=torch.ones(2, 2, WIDTH)),
        "steering target is",
    ),
    "swap target head rows": (
        lambda: Write("attn_z.0", rand(8), op="swap", target=torch.ones(3, 8), heads=[0, 1]),
        "the target for attn_z.0 has 3 head rows",
    ),
    "swap text target": (lambda: Write("resid_post.0", rand(WIDTH), op="swap", target="abc"), "steering target"),
}


@pytest.mark.parametrize(("make", "match"), BAD_OPS.values(), ids=BAD_OPS.keys())
def test_bad_op_fields_are_clear_invalid_steering(make: Any, match: str) -> None:
    with pytest.raises(InvalidSteering, match=match) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_unknown_fields_and_ops_name_the_valid_ones() -> None:
    with pytest.raises(InvalidSteering) as info:
        SteeringSpec.from_dict([{**GOOD, "op": "cap", "hi": 1.0, "lower": 0.0}])
    assert "lower" in str(info.value) and "max_fraction" in str(info.value) and "target" in str(info.value)
    with pytest.raises(InvalidSteering) as info:
        Write("resid_post.0", rand(WIDTH), op="clip")
    assert all(op in str(info.value) for op in ("cap", "rescale", "norm_add", "swap"))
    bad = {
        "lo on add": {**GOOD, "lo": 1.0},
        "cap string hi": {**GOOD, "op": "cap", "hi": "1"},
        "swap without target": {**GOOD, "op": "swap"},
        "swap ragged target": {**GOOD, "op": "swap", "target": [[1.0], [1.0, 2.0]]},
    }
    for name, data in bad.items():
        with pytest.raises(InvalidSteering):
            SteeringSpec.from_json(json.dumps({"writes": [data]}))
        assert name


def test_check_spec_checks_the_target_like_the_vector() -> None:
    vector = rand(WIDTH)
    (write,) = check_spec(SteeringSpec([Write("resid_post.-1", vector, op="swap", target=rand(WIDTH))]), INFO)
    assert write.address == Address("resid_post", INFO.n_layers - 1) and write.target is not None
    # the target's width is the vector's (checked when the write is made), and the model's
    with pytest.raises(InvalidSteering, match=r"target has width 8 but the vector has width 32"):
        Write("mlp_post.0", rand(INFO.d_mlp), op="swap", target=rand(WIDTH))
    with pytest.raises(InvalidSteering, match=r"for mlp_post.0 has width 8, but mlp_post is 32 wide"):
        check_spec(SteeringSpec([Write("mlp_post.0", rand(WIDTH), op="swap", target=rand(WIDTH))]), INFO)
    with pytest.raises(InvalidSteering, match=r"the target for attn_z.0 has 3 head rows"):
        head = INFO.d_head
        check_spec(SteeringSpec([Write("attn_z.0", rand(head), op="swap", target=rand(3, head))]), INFO)
    spec = SteeringSpec([Write("resid_post.0", vector, op="swap", target=rand(3, WIDTH), positions="prompt")])
    check_write_shapes(check_spec(spec, INFO), n_prompt=3, n_total=5)
    with pytest.raises(InvalidSteering, match=r"target for resid_post.0 has 3 rows but the write selects 2"):
        check_write_shapes(check_spec(spec, INFO), n_prompt=2, n_total=5)
