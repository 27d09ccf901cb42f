"""Address: the frozen, typed name of a point in the forward pass (SPEC §3)."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest

from interp_engine import (
    ALIASES,
    KINDS,
    Address,
    InterpError,
    InvalidAddress,
    LayerOutOfRange,
    LayerTypeError,
    UnknownKind,
)

PER_LAYER = [kind for kind, info in KINDS.items() if info.per_layer]
MODEL_LEVEL = [kind for kind, info in KINDS.items() if not info.per_layer]


def all_addresses() -> list[Address]:
    out = [Address(kind) for kind in MODEL_LEVEL]
    out += [Address(kind, layer) for kind in PER_LAYER for layer in (0, 5, -1)]
    return out


def test_vocabulary_is_the_spec_table() -> None:
    assert list(KINDS) == [
        "embed",
        "resid_pre",
        "resid_mid",
        "resid_post",
        "attn_out",
        "mlp_out",
        "mlp_post",
        "attn_pattern",
        "final_norm",
        "logits",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_z",
        "attn_in",
        "mlp_in",
        "mlp_pre",
        "mlp_gate_act",
        "mlp_pre_linear",
        "attn_scores",
        "q_norm_in",
        "q_norm_out",
        "k_norm_in",
        "k_norm_out",
        "attn_out_post",
        "mlp_out_post",
        "logits_raw",
        "router_logits",
        "expert_indices",
        "expert_weights",
    ]
    assert MODEL_LEVEL == ["embed", "final_norm", "logits", "logits_raw"]
    assert KINDS["mlp_post"].width == "d_mlp"
    assert KINDS["mlp_pre"].width == KINDS["mlp_pre_linear"].width == "d_mlp"
    assert KINDS["logits"].width == KINDS["logits_raw"].width == "vocab"
    assert KINDS["attn_scores"].width == "heads x keys"
    assert KINDS["q_norm_out"].per_head and KINDS["k_norm_in"].width == "kv_heads x d_head"
    read_only = [kind for kind, info in KINDS.items() if not info.writable]
    assert read_only == [
        "attn_pattern",
        "logits",
        "attn_q",
        "attn_k",
        "mlp_gate_act",
        "attn_scores",
        "logits_raw",
        "expert_indices",
        "expert_weights",
    ]
    assert KINDS["router_logits"].writable and KINDS["expert_weights"].width == "experts per token"


@pytest.mark.parametrize(
    ("alias", "kind"),
    [
        ("embeddings", "embed"),
        ("z", "attn_z"),
        ("value", "attn_v"),
        ("mlp_act", "mlp_post"),
        ("attn_probs", "attn_pattern"),
        ("lm_head", "logits_raw"),
    ],
)
def test_the_public_interp_engine_names_are_aliases(alias: str, kind: str) -> None:
    """The public interp-engine package's names read as ours: same address, same string, round trip."""
    assert ALIASES[alias] == kind
    layer = 3 if KINDS[kind].per_layer else None
    address = Address(alias, layer)
    assert address == Address(kind, layer) and address.kind == kind
    text = alias if layer is None else f"{alias}.{layer}"
    assert Address.parse(text) == address
    assert Address.parse(str(address)) == address  # the string form is ours
    assert hash(address) == hash(Address(kind, layer))


def test_every_kind_is_in_the_per_backend_table() -> None:
    """The reference's table of how each backend reads a kind (written by hand, unlike the
    vocabulary and alias tables it generates from KINDS and ALIASES) has a row for every kind."""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "reference" / "addresses.md").read_text()
    status = page[page.index("| kind | eager |") :]
    for kind in KINDS:
        listed = f"`{kind}`" in status or f"`{kind.rsplit('_', 1)[0]}_*`" in status
        assert listed, f"{kind} has no row in the per-backend table"


def test_address_is_frozen() -> None:
    address = Address("resid_post", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        address.layer = 6  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        address.kind = "resid_pre"  # type: ignore[misc]
    assert address == Address("resid_post", 5)


def test_address_is_hashable_and_equal_by_value() -> None:
    a, b = Address("resid_post", 5), Address.parse("resid_post.5")
    assert a == b and a is not b
    assert hash(a) == hash(b)
    assert len({a, b, Address("resid_post", 4), Address("resid_pre", 5)}) == 3
    assert {a: 1}[b] == 1
    assert Address("resid_post", 5) != Address("resid_post", 4)
    assert Address("resid_post", 5) != Address("resid_pre", 5)


@pytest.mark.parametrize("address", all_addresses(), ids=str)
def test_string_round_trip(address: Address) -> None:
    text = str(address)
    assert Address.parse(text) == address
    if address.layer is None:
        assert text == address.kind
    else:
        assert text == f"{address.kind}.{address.layer}"


def test_string_forms() -> None:
    assert str(Address("resid_post", 5)) == "resid_post.5"
    assert str(Address("resid_post", -1)) == "resid_post.-1"
    assert str(Address("logits")) == "logits"
    assert Address.parse("resid_post.5") == Address("resid_post", 5)
    assert Address.parse("  mlp_post.2 ") == Address("mlp_post", 2)
    assert Address.parse("final_norm") == Address("final_norm")
    assert repr(Address("resid_post", 5)) == "Address('resid_post', 5)"
    address = Address("attn_out", 1)
    assert Address.parse(address) is address


def test_address_is_not_its_string() -> None:
    address = Address("resid_post", 5)
    assert address != "resid_post.5"
    assert "resid_post.5" != address  # noqa: SIM300 - the reflected comparison, on purpose
    table = {address: 1}
    with pytest.raises(KeyError):
        table["resid_post.5"]  # type: ignore[index]
    assert "resid_post.5" not in table


@pytest.mark.parametrize("layer", ["5", 1.0, True, False, 2.5, [1]], ids=repr)
def test_non_int_layer_is_a_layer_type_error(layer: object) -> None:
    with pytest.raises(LayerTypeError) as info:
        Address("resid_post", layer)  # type: ignore[arg-type]
    error = info.value
    assert isinstance(error, InvalidAddress)
    assert isinstance(error, ValueError)
    assert isinstance(error, TypeError)
    assert isinstance(error, InterpError)
    assert "int" in str(error)


@pytest.mark.parametrize(
    "text", ["resid_post.\u0663", "resid_post.1_0", "resid_post.+1", "resid_post. 1", "blocks.\u0663.hook_resid_post"]
)
def test_parse_reads_only_ascii_integer_layers(text: str) -> None:
    # int() would take Arabic-Indic digits, underscores, a plus sign and inner spaces
    with pytest.raises(InvalidAddress):
        Address.parse(text)


def test_parse_error_is_bounded_in_size() -> None:
    with pytest.raises(LayerTypeError) as info:
        Address.parse("resid_post." + "x" * 100_000)
    assert len(str(info.value)) < 400


def test_parse_gives_the_same_address_every_time_and_the_same_error_every_time() -> None:
    for text in ("resid_post.5", " resid_post.5 ", "blocks.5.hook_resid_post", "resid_post.0005"):
        assert Address.parse(text) == Address.parse(text) == Address("resid_post", 5)
    padded = "resid_post." + "0" * 200 + "7"  # longer than the parses kept, read all the same
    assert Address.parse(padded) == Address.parse(padded) == Address("resid_post", 7)
    for _ in range(2):  # a refused string is refused again, never remembered as an address
        with pytest.raises(UnknownKind):
            Address.parse("residual.3")
        with pytest.raises(LayerTypeError):
            Address.parse("resid_post.x")


def test_layer_type_error_is_catchable_as_both_builtins() -> None:
    with pytest.raises(TypeError):
        Address("resid_post", "5")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Address("resid_post", "5")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["resid", "RESID_POST", "hook_resid_post", "", "blocks.0.hook_resid_post"])
def test_unknown_kind(kind: str) -> None:
    with pytest.raises(UnknownKind) as info:
        Address(kind, 0)
    error = info.value
    assert isinstance(error, InvalidAddress) and isinstance(error, ValueError) and isinstance(error, InterpError)
    assert tuple(error.valid) == tuple(KINDS)
    assert error.address == kind
    for valid in KINDS:
        assert valid in str(error)


def test_unknown_kind_through_parse() -> None:
    with pytest.raises(UnknownKind):
        Address.parse("residual.3")
    with pytest.raises(UnknownKind):
        Address.parse("nonsense")


@pytest.mark.parametrize("kind", PER_LAYER)
def test_per_layer_kind_needs_a_layer(kind: str) -> None:
    with pytest.raises(InvalidAddress) as info:
        Address(kind)
    assert not isinstance(info.value, (UnknownKind, LayerTypeError))
    assert kind in str(info.value)
    with pytest.raises(InvalidAddress):
        Address.parse(kind)


@pytest.mark.parametrize("kind", MODEL_LEVEL)
def test_model_level_kind_takes_no_layer(kind: str) -> None:
    with pytest.raises(InvalidAddress) as info:
        Address(kind, 0)
    assert not isinstance(info.value, UnknownKind)
    assert kind in str(info.value)
    with pytest.raises(InvalidAddress):
        Address.parse(f"{kind}.0")


@pytest.mark.parametrize(
    ("layer", "n_layers", "expected"),
    [(0, 12, 0), (11, 12, 11), (-1, 12, 11), (-12, 12, 0), (-3, 4, 1), (3, 4, 3)],
)
def test_resolve(layer: int, n_layers: int, expected: int) -> None:
    assert Address("resid_post", layer).resolve(n_layers) == Address("resid_post", expected)


def test_resolve_keeps_kind_and_model_level_points() -> None:
    assert Address("mlp_post", -2).resolve(6) == Address("mlp_post", 4)
    assert Address("logits").resolve(6) == Address("logits")
    assert Address("embed").resolve(1) == Address("embed")


@pytest.mark.parametrize(("layer", "n_layers"), [(12, 12), (100, 12), (-13, 12), (1, 1), (-2, 1)])
def test_resolve_out_of_range(layer: int, n_layers: int) -> None:
    address = Address("resid_post", layer)
    with pytest.raises(LayerOutOfRange) as info:
        address.resolve(n_layers)
    error = info.value
    assert isinstance(error, InvalidAddress) and isinstance(error, ValueError) and isinstance(error, InterpError)
    assert error.address == address
    message = str(error)
    assert str(address) in message
    assert f"{-n_layers}..{n_layers - 1}" in message


@pytest.mark.parametrize("text", ["resid_post.x", "resid_post.", "resid_post.1.2", "resid_post.five", "logits.x"])
def test_parse_bad_layer(text: str) -> None:
    with pytest.raises(InvalidAddress) as info:
        Address.parse(text)
    assert isinstance(info.value, ValueError)
    assert text in str(info.value)


@pytest.mark.parametrize("value", [5, None, 1.5, ("resid_post", 5)], ids=repr)
def test_parse_non_string(value: object) -> None:
    with pytest.raises(InvalidAddress):
        Address.parse(value)  # type: ignore[arg-type]


def test_sort_key_is_layer_major_forward_order() -> None:
    expected = [
        Address("embed"),
        Address("resid_pre", 0),
        Address("resid_mid", 0),
        Address("resid_post", 0),
        Address("resid_pre", 1),
        Address("resid_mid", 1),
        Address("resid_post", 1),
        Address("resid_pre", 10),
        Address("resid_post", 10),
        Address("final_norm"),
        Address("logits"),
    ]
    shuffled = expected[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != expected
    assert sorted(shuffled, key=Address.sort_key) == expected


def test_sort_key_is_numeric_not_lexical() -> None:
    layers = [Address("resid_post", n) for n in (10, 2, 1, 0, 21)]
    assert [a.layer for a in sorted(layers, key=Address.sort_key)] == [0, 1, 2, 10, 21]


def test_sort_key_follows_the_computation_inside_a_layer() -> None:
    # resid_pre -> attention (pattern, output) -> resid_mid -> MLP (neurons, output) -> resid_post
    forward = [
        Address("resid_pre", 3),
        Address("attn_pattern", 3),
        Address("attn_out", 3),
        Address("resid_mid", 3),
        Address("mlp_post", 3),
        Address("mlp_out", 3),
        Address("resid_post", 3),
        Address("resid_pre", 4),
    ]
    assert sorted(reversed(forward), key=Address.sort_key) == forward
