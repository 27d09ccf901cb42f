"""TransformerLens hook names are accepted wherever an address is, mapped to the vocabulary."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (
    Address,
    Cache,
    InvalidAddress,
    SteeringSpec,
    UnknownKind,
    Write,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import PROMPT

from ..support.engines import eager_model

MAPPED = [
    ("blocks.5.hook_resid_pre", Address("resid_pre", 5)),
    ("blocks.5.hook_resid_mid", Address("resid_mid", 5)),
    ("blocks.5.hook_resid_post", Address("resid_post", 5)),
    ("blocks.5.hook_attn_out", Address("attn_out", 5)),
    ("blocks.5.hook_mlp_out", Address("mlp_out", 5)),
    ("blocks.5.mlp.hook_post", Address("mlp_post", 5)),
    ("blocks.3.attn.hook_pattern", Address("attn_pattern", 3)),
    ("ln_final.hook_normalized", Address("final_norm")),
    ("blocks.0.hook_resid_pre", Address("resid_pre", 0)),
    ("blocks.-1.hook_resid_post", Address("resid_post", -1)),
    ("blocks.12.hook_resid_post", Address("resid_post", 12)),
    ("  blocks.2.hook_mlp_out ", Address("mlp_out", 2)),
    ("blocks.1.attn.hook_z", Address("attn_z", 1)),
    ("blocks.1.attn.hook_v", Address("attn_v", 1)),
    ("blocks.1.attn.hook_q", Address("attn_q", 1)),
    ("blocks.1.attn.hook_k", Address("attn_k", 1)),
    ("blocks.1.ln1.hook_normalized", Address("attn_in", 1)),
    ("blocks.1.ln2.hook_normalized", Address("mlp_in", 1)),
    ("blocks.1.mlp.hook_pre", Address("mlp_pre", 1)),
    ("blocks.1.mlp.hook_pre_linear", Address("mlp_pre_linear", 1)),
    ("blocks.1.attn.hook_attn_scores", Address("attn_scores", 1)),
    ("blocks.1.mlp.hook_expert_indices", Address("expert_indices", 1)),
]


def test_rotated_query_and_key_names_are_the_head_addresses() -> None:
    # on rotary models TransformerLens's hook_rot_q/k hold what attn_q/k hold (post-rotary)
    assert Address.parse("blocks.2.attn.hook_rot_q") == Address("attn_q", 2)
    assert Address.parse("blocks.2.attn.hook_rot_k") == Address("attn_k", 2)


@pytest.mark.parametrize(("name", "address"), MAPPED, ids=[m[0].strip() for m in MAPPED])
def test_every_mapped_name(name: str, address: Address) -> None:
    assert Address.parse(name) == address
    assert Address.parse(name).tl_name == name.strip()


def test_tl_name_of_every_kind() -> None:
    assert Address("resid_post", 5).tl_name == "blocks.5.hook_resid_post"
    assert Address("attn_pattern", 0).tl_name == "blocks.0.attn.hook_pattern"
    assert Address("final_norm").tl_name == "ln_final.hook_normalized"
    # no TransformerLens hook holds exactly these values
    assert Address("embed").tl_name is None
    assert Address("logits").tl_name is None


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("hook_embed", "blocks.0.hook_resid_pre"),
        ("hook_pos_embed", "use 'embed'"),
        ("blocks.2.attn.hook_result", "attn_out.2"),
        ("blocks.2.hook_mlp_in", "resid_mid.2"),
        ("blocks.2.hook_attn_in", "attn_in.2"),
        ("ln_final.hook_scale", "ln_final.hook_normalized"),
        ("blocks.2.hook_nonsense", "not part of the address vocabulary"),
        ("blocks.2.mlp.hook_expert_weights", "router_logits.2"),
        ("hook_resid_post", "blocks.L.hook_resid_post"),
        ("blocks.x.hook_resid_post", "blocks.L"),
    ],
)
def test_unmapped_names_say_what_to_use(name: str, hint: str) -> None:
    with pytest.raises(UnknownKind) as info:
        Address.parse(name)
    error = info.value
    assert isinstance(error, InvalidAddress) and isinstance(error, ValueError)
    assert error.address == name
    assert name in str(error) and hint in str(error)
    assert "blocks.L.hook_resid_post" in error.valid


def test_cache_lookup_by_tl_name() -> None:
    value = torch.randn(1, 3, 8)
    pattern = torch.rand(1, 2, 3, 3)
    cache = Cache({Address("resid_post", 1): value, "blocks.0.attn.hook_pattern": pattern})
    assert cache["blocks.1.hook_resid_post"] is value
    assert cache[Address("attn_pattern", 0)] is pattern
    assert "blocks.1.hook_resid_post" in cache
    assert "blocks.1.hook_mlp_out" not in cache
    assert "blocks.1.attn.hook_z" not in cache  # unmapped: not in, rather than an error


def test_write_and_spec_accept_tl_names() -> None:
    write = Write("blocks.1.hook_resid_post", torch.ones(8), scale=2.0)
    assert write.address == Address("resid_post", 1)
    spec = SteeringSpec([write])
    assert SteeringSpec.from_json(spec.to_json()) == spec
    with pytest.raises(UnknownKind):
        Write("hook_embed", torch.ones(8))


# -- on a model: the same values as the native addresses -----------------------------------


def test_capture_through_tl_names_equals_native() -> None:
    sync = sync_model(eager_model("gpt2"))
    ids = sync.to_tokens(PROMPT)[0].tolist()
    tl = [
        "blocks.1.hook_resid_pre",
        "blocks.1.hook_resid_mid",
        "blocks.1.hook_resid_post",
        "blocks.1.hook_attn_out",
        "blocks.1.hook_mlp_out",
        "blocks.1.mlp.hook_post",
        "blocks.-1.attn.hook_pattern",
        "ln_final.hook_normalized",
    ]
    native = [Address.parse(name) for name in tl]
    assert [str(a) for a in native] == [
        "resid_pre.1",
        "resid_mid.1",
        "resid_post.1",
        "attn_out.1",
        "mlp_out.1",
        "mlp_post.1",
        "attn_pattern.-1",
        "final_norm",
    ]
    by_tl = sync.capture(ids, tl)
    by_native = sync.capture(ids, native)
    assert set(by_tl) == set(native)
    for address in native:
        assert torch.equal(by_tl[address], by_native[address]), address
    cache = run_with_cache(sync, ids, tl)
    assert torch.equal(cache["blocks.1.hook_resid_post"][0], by_native[Address("resid_post", 1)])
    # the documented equivalence: our embed is TransformerLens's blocks.0.hook_resid_pre
    both = sync.capture(ids, ["embed", "blocks.0.hook_resid_pre"])
    assert torch.equal(both[Address("embed")], both[Address("resid_pre", 0)])


def test_steering_write_through_a_tl_name_equals_native() -> None:
    sync = sync_model(eager_model("gpt2"))
    ids = sync.to_tokens(PROMPT)[0].tolist()
    vector = torch.randn(sync.model.info.d_model, generator=torch.Generator().manual_seed(0))
    tl_spec = SteeringSpec([Write("blocks.0.hook_resid_post", vector, scale=3.0)])
    native_spec = SteeringSpec([Write(Address("resid_post", 0), vector, scale=3.0)])
    logits = Address("logits")
    steered_tl = sync.capture(ids, [logits], steering_spec=tl_spec)[logits]
    steered_native = sync.capture(ids, [logits], steering_spec=native_spec)[logits]
    plain = sync.capture(ids, [logits])[logits]
    assert torch.equal(steered_tl, steered_native)
    assert not torch.allclose(steered_tl, plain)
