"""``Cache.concat``: chunks of a run joined along the batch axis, padding and lengths kept, equal
to the run in one piece (eager, ``interp:tiny`` with the shipped SAE), and clear errors for
caches that do not join."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Cache,
    FeatureReadout,
    Features,
    InvalidActivations,
    InvalidAddress,
    load_model,
    run_with_cache,
    sync_model,
)

PROMPTS = ["The capital of France is", "Paris", "The capital of Germany is Berlin, and", "a b", "one two three"]
POINTS = [
    "embed",
    "resid_post.1",
    "attn_z.1",
    "attn_scores.1",
    "attn_pattern.0",
    "features:res:top4",
    "features:res:dense",
    "logits",
]


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    m = load_model("interp:tiny", backend="eager", saes={"res": "interp:tiny-sae"})
    yield m
    sync_model(m).shutdown()


def assert_same(joined: Cache, whole: Cache) -> None:
    assert list(joined) == list(whole)
    assert joined.lengths is not None and whole.lengths is not None
    assert joined.lengths.tolist() == whole.lengths.tolist()
    assert joined.n_layers == whole.n_layers
    for key, expected in whole.items():
        value = joined[key]
        if isinstance(expected, FeatureReadout):
            assert isinstance(value, FeatureReadout)
            pairs = [
                (value.values, expected.values),
                (value.ids, expected.ids),
                (value.error_norm, expected.error_norm),
            ]
        else:
            pairs = [(value, expected)]
        for got, want in pairs:
            if want is None:
                assert got is None, key
                continue
            assert got is not None and got.shape == want.shape and got.dtype == want.dtype, key
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=str(key))


def test_chunks_joined_equal_one_run(model: Any) -> None:
    whole = run_with_cache(model, PROMPTS, POINTS)
    chunks = [run_with_cache(model, PROMPTS[i : i + 2], POINTS) for i in range(0, len(PROMPTS), 2)]
    assert len({c["resid_post.1"].shape[1] for c in chunks}) == 3  # three different padded lengths
    joined = Cache.concat(chunks)
    assert_same(joined, whole)
    # the padding of the rows re-padded here is exactly what a batch pads with
    short = whole.lengths.tolist().index(min(whole.lengths.tolist()))  # type: ignore[union-attr]
    n = int(joined.lengths[short])  # type: ignore[index]
    assert torch.equal(joined["resid_post.1"][short, n:], torch.zeros_like(joined["resid_post.1"][short, n:]))
    scores = joined["attn_scores.1"][short]
    assert bool(torch.isneginf(scores[:, :, n:]).all())  # masked keys are -inf, as in a batch
    top = joined["features:res:top4"]
    assert isinstance(top, FeatureReadout) and top.ids is not None
    assert bool((top.ids[short, n:] == -1).all()) and bool((top.values[short, n:] == 0).all())


def test_one_prompt_caches_join_as_the_cli_joins_them(model: Any) -> None:
    whole = run_with_cache(model, PROMPTS, POINTS)
    joined = Cache.concat(run_with_cache(model, p, POINTS) for p in PROMPTS)
    assert_same(joined, whole)
    assert Cache.concat([whole]).keys() == whole.keys()


def test_caches_without_lengths_count_their_rows_as_full() -> None:
    a = Cache({"resid_post.0": torch.ones(2, 3, 4)})
    b = Cache({"resid_post.0": torch.full((1, 5, 4), 2.0)})
    joined = Cache.concat([a, b])
    assert joined.lengths is not None and joined.lengths.tolist() == [3, 3, 5]
    value = joined["resid_post.0"]
    assert value.shape == (3, 5, 4)
    assert torch.equal(value[:2, :3], torch.ones(2, 3, 4)) and torch.equal(value[:2, 3:], torch.zeros(2, 2, 4))
    assert torch.equal(value[2], torch.full((5, 4), 2.0))
    same = Cache.concat([a, a])  # nothing padded and no lengths: none needed
    assert same.lengths is None and torch.equal(same["resid_post.0"], torch.ones(4, 3, 4))


def test_dtypes_are_promoted_and_the_layer_count_kept() -> None:
    a = Cache({"resid_post.-1": torch.ones(1, 2, 3, dtype=torch.bfloat16)}, n_layers=4)
    b = Cache({"resid_post.3": torch.ones(1, 2, 3)}, n_layers=4)
    joined = Cache.concat([a, b])
    assert joined["resid_post.-1"].dtype == torch.float32 and joined.n_layers == 4


def test_readouts_of_one_prompt_each() -> None:
    def readout(n: int, k: int) -> FeatureReadout:
        return FeatureReadout(torch.rand(1, n, k) + 0.1, torch.randint(0, 9, (1, n, k)), torch.rand(1, n))

    a = Cache({Features("s", 2): readout(3, 2)}, lengths=torch.tensor([3]))
    b = Cache({Features("s", 2): readout(1, 2)}, lengths=torch.tensor([1]))
    joined = Cache.concat([a, b])["features:s:top2"]
    assert joined.values.shape == (2, 3, 2) and joined.error_norm is not None
    assert joined.ids is not None and bool((joined.ids[1, 1:] == -1).all())
    assert bool((joined.values[1, 1:] == 0).all()) and bool((joined.error_norm[1, 1:] == 0).all())


def test_caches_that_do_not_join_are_refused_clearly() -> None:
    a = Cache({"resid_post.0": torch.ones(1, 2, 4), "embed": torch.ones(1, 2, 4)})
    with pytest.raises(
        InvalidAddress, match=r"cache 1 differs from cache 0: it lacks embed; it also holds resid_post\.1"
    ):
        Cache.concat([a, Cache({"resid_post.0": torch.ones(1, 2, 4), "resid_post.1": torch.ones(1, 2, 4)})])
    with pytest.raises(InvalidActivations, match=r"resid_post\.0: .*\[1, 2, 4\] and \[1, 2, 5\]"):
        Cache.concat([a, Cache({"resid_post.0": torch.ones(1, 2, 5), "embed": torch.ones(1, 2, 4)})])
    with pytest.raises(InvalidActivations, match="at least one"):
        Cache.concat([])
    with pytest.raises(InvalidActivations, match="item 1 is a dict"):
        Cache.concat([a, {"embed": torch.ones(1, 2, 4)}])  # type: ignore[list-item]
    with pytest.raises(InvalidActivations, match="one model"):
        Cache.concat(
            [Cache({"embed": torch.ones(1, 1, 4)}, n_layers=4), Cache({"embed": torch.ones(1, 1, 4)}, n_layers=6)]
        )
    heads = Cache({Address("attn_pattern", 0): torch.ones(1, 4, 2, 2)})
    with pytest.raises(InvalidActivations, match=r"attn_pattern\.0"):
        Cache.concat([heads, Cache({Address("attn_pattern", 0): torch.ones(1, 3, 2, 2)})])
