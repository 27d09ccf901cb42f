"""The vLLM site table: one entry per address kind, read by both workers and the front end.

No engine here: these check the table itself, and the tensor-parallel rules that route head
writes and merge head reads (the engine tests check the same rules end to end at TP=2).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from interp_engine import KINDS, Address, Write
from interp_vllm.model._sites import SITES, STATIC_WRITE_KINDS, WRITE_KINDS, local_write, merge_ranks, owned_heads

SRC = pathlib.Path(__file__).resolve().parents[2] / "packages" / "interp-vllm" / "src" / "interp_vllm"


def test_every_kind_has_one_site() -> None:
    assert set(SITES) == set(KINDS)
    for kind, site in SITES.items():
        assert site.kind == kind
        if KINDS[kind].per_head:
            assert site.shard in ("heads", "kv_heads"), kind
    assert set(WRITE_KINDS) == {k for k, info in KINDS.items() if info.writable}
    assert {"attn_z", "attn_v"} <= set(STATIC_WRITE_KINDS)


def test_the_recomputed_kinds_are_the_readmes() -> None:
    """What ``points()`` reports as recomputed on vLLM: docs/reference/addresses.md's table of where each kind lives
    says the same (its vLLM column)."""
    recomputed = {kind for kind, site in SITES.items() if site.how == "recompute"}
    assert recomputed == {
        "attn_scores",
        "attn_pattern",
        "mlp_gate_act",
        "logits_raw",
        "expert_indices",
        "expert_weights",
    }


def test_no_module_outside_the_table_names_an_address_kind() -> None:
    """A new kind is a table entry: the workers and the front end dispatch on the site's fields,
    never on kind names (the derived kinds, resid_mid, attn_scores and attn_pattern, and the
    model outputs are computed, not located, and are the only names allowed)."""
    derived = {"resid_mid", "attn_scores", "attn_pattern"}
    allowed = derived | {"final_norm", "logits_raw", "logits", "embed", "resid_pre", "resid_post"}
    workers = (*sorted(SRC.glob("worker/*.py")), SRC / "static/_worker.py", SRC / "static/_hooks.py", SRC / "hooks.py")
    front = (*sorted(SRC.glob("frontend/*.py")), SRC / "static/_model.py")
    for path in (*workers, *front):
        name = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        named = {s for s in strings if s in KINDS} - allowed
        assert not named, f"{name} names {sorted(named)}: put what it needs in the site table"


@pytest.mark.parametrize(
    ("tp", "total", "expected"), [(2, 4, [[0, 1], [2, 3]]), (2, 1, [[0], [0]]), (4, 2, [[0], [0], [1], [1]])]
)
def test_owned_heads_follow_vllm(tp: int, total: int, expected: list[list[int]]) -> None:
    assert [owned_heads(rank, tp, total) for rank in range(tp)] == expected


def test_head_writes_go_to_the_rank_that_holds_each_head() -> None:
    rows = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)  # one row per listed head
    write = Write("attn_z.1", rows, op="add", heads=[3, 0, 2])
    site = SITES["attn_z"]
    zero = local_write(write, site, 0, 2, 4, 8)
    one = local_write(write, site, 1, 2, 4, 8)
    assert zero is not None and zero.heads == (0,) and torch.equal(zero.vector, rows[[1]])
    assert one is not None and one.heads == (1, 0) and torch.equal(one.vector, rows[[0, 2]])
    only_rank_one = Write("attn_z.1", torch.ones(4), op="set", heads=[2])
    assert local_write(only_rank_one, site, 0, 2, 4, 8) is None
    # per-position rows keep their positions axis
    patch = Write("attn_z.1", torch.ones(5, 2, 4), op="set", heads=[1, 2], positions=[0, 1, 2, 3, 4])
    part = local_write(patch, site, 1, 2, 4, 8)
    assert part is not None and part.heads == (0,) and part.vector.shape == (5, 1, 4)


def test_reads_merge_over_ranks() -> None:
    a, b = torch.zeros(3, 2, 4), torch.ones(3, 2, 4)
    assert torch.equal(merge_ranks(Address("attn_z", 0), [a, b], 4), torch.cat([a, b], dim=1))
    # a replicated key/value head (fewer of them than ranks): one copy
    k0, k1 = torch.zeros(3, 1, 4), torch.zeros(3, 1, 4)
    assert merge_ranks(Address("attn_k", 0), [k0, k1], 1).shape == (3, 1, 4)
    assert torch.equal(merge_ranks(Address("resid_post", 0), [a, b], 4), a)
