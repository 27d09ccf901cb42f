"""Cache: the read-only, batched result of the sync free functions (SPEC §4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_engine import Address, Cache, InvalidAddress

BATCH, POS, WIDTH, VOCAB, HEADS = 2, 5, 8, 11, 3


def make_cache(lengths: tuple[int, ...] | None = (3, 5)) -> Cache:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # deliberately out of forward order, keyed by both strings and Addresses
    data = {
        "logits": rand(BATCH, POS, VOCAB),
        "resid_post.2": rand(BATCH, POS, WIDTH),
        Address("resid_post", 0): rand(BATCH, POS, WIDTH),
        "embed": rand(BATCH, POS, WIDTH),
        "attn_pattern.1": rand(BATCH, HEADS, POS, POS),
        "resid_post.1": rand(BATCH, POS, WIDTH),
        "resid_pre.1": rand(BATCH, POS, WIDTH),
    }
    return Cache(data, lengths=None if lengths is None else torch.tensor(lengths))


@pytest.fixture
def cache() -> Cache:
    return make_cache()


def test_lookup_by_address_and_by_string(cache: Cache) -> None:
    by_address = cache[Address("resid_post", 2)]
    assert by_address is cache["resid_post.2"]
    assert by_address.shape == (BATCH, POS, WIDTH)
    assert cache["attn_pattern.1"].shape == (BATCH, HEADS, POS, POS)
    assert cache["logits"] is cache[Address("logits")]
    assert not torch.equal(cache["resid_post.1"], cache["resid_post.2"])


def test_contains(cache: Cache) -> None:
    assert Address("resid_post", 0) in cache
    assert "resid_post.0" in cache
    assert "resid_post.3" not in cache
    assert "resid_mid.0" not in cache
    assert "not_a_kind.0" not in cache
    assert 0 not in cache


@pytest.mark.parametrize("key", ["resid_post.7", Address("mlp_out", 0), "final_norm"], ids=str)
def test_missing_key_raises_key_error_listing_what_it_holds(cache: Cache, key: object) -> None:
    with pytest.raises(KeyError) as info:
        cache[key]  # type: ignore[index]
    message = str(info.value)
    assert str(Address.parse(key)) in message  # type: ignore[arg-type]
    for held in ("embed", "resid_post.0", "resid_post.2", "attn_pattern.1", "logits"):
        assert held in message


def test_invalid_key_is_an_address_error(cache: Cache) -> None:
    with pytest.raises(InvalidAddress):
        cache["not_a_kind.0"]


def test_keys_len_and_forward_iteration_order(cache: Cache) -> None:
    expected = [
        Address("embed"),
        Address("resid_post", 0),
        Address("resid_pre", 1),
        Address("attn_pattern", 1),
        Address("resid_post", 1),
        Address("resid_post", 2),
        Address("logits"),
    ]
    assert len(cache) == 7
    assert list(cache) == expected
    assert list(cache.keys()) == expected
    assert all(isinstance(k, Address) for k in cache)
    assert [a for a, _ in cache.items()] == expected
    assert dict(cache)[Address("resid_post", 1)] is cache["resid_post.1"]


def test_stack_over_layers(cache: Cache) -> None:
    stacked = cache.stack("resid_post")
    assert stacked.shape == (3, BATCH, POS, WIDTH)
    for i, layer in enumerate((0, 1, 2)):
        assert torch.equal(stacked[i], cache[Address("resid_post", layer)])
    assert cache.layers("resid_post") == [0, 1, 2]
    assert cache.stack("resid_pre").shape == (1, BATCH, POS, WIDTH)
    assert cache.stack("attn_pattern").shape == (1, BATCH, HEADS, POS, POS)


def test_stack_is_in_layer_order_even_when_built_out_of_order() -> None:
    values = {Address("resid_post", layer): torch.full((1, 2, 3), float(layer)) for layer in (7, 2, 10, 0)}
    stacked = Cache(values).stack("resid_post")
    assert stacked[:, 0, 0, 0].tolist() == [0.0, 2.0, 7.0, 10.0]


@pytest.mark.parametrize("kind", ["logits", "embed", "final_norm", "nonsense"])
def test_stack_of_a_model_level_kind_is_an_error(cache: Cache, kind: str) -> None:
    with pytest.raises(InvalidAddress) as info:
        cache.stack(kind)
    assert isinstance(info.value, ValueError)
    assert "resid_post" in str(info.value)


def test_stack_of_a_kind_not_held(cache: Cache) -> None:
    with pytest.raises(KeyError):
        cache.stack("mlp_out")


def test_to_returns_a_new_cache(cache: Cache) -> None:
    moved = cache.to("cpu")
    assert isinstance(moved, Cache)
    assert moved is not cache
    assert list(moved) == list(cache)
    for address in cache:
        assert torch.equal(moved[address], cache[address])
        assert moved[address].device.type == "cpu"
    assert moved.lengths is not None and torch.equal(moved.lengths, torch.tensor([3, 5]))
    as_device = cache.to(torch.device("cpu"))
    assert isinstance(as_device, Cache) and as_device is not cache


def test_save_load_round_trip(cache: Cache, tmp_path: Path) -> None:
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    assert path.stat().st_size > 0
    loaded = Cache.load(path)
    assert isinstance(loaded, Cache)
    assert list(loaded) == list(cache)
    for address in cache:
        assert loaded[address].dtype == cache[address].dtype
        assert torch.equal(loaded[address], cache[address])  # bit-identical
    assert loaded.lengths is not None
    assert loaded.lengths.tolist() == [3, 5]


def test_save_load_keeps_dtypes_and_non_contiguous_values(tmp_path: Path) -> None:
    base = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(1))
    data = {
        "resid_post.0": base.transpose(1, 2)[:, :, :3].transpose(1, 2),  # non-contiguous view
        "resid_post.1": base.to(torch.bfloat16),
        "resid_post.2": base.to(torch.float16),
    }
    assert not data["resid_post.0"].is_contiguous()
    cache = Cache(data)
    path = tmp_path / "mixed.safetensors"
    cache.save(str(path))
    loaded = Cache.load(str(path))
    for address, value in cache.items():
        assert loaded[address].dtype == value.dtype
        assert torch.equal(loaded[address], value)
    assert loaded.lengths is None


def test_save_load_without_lengths(tmp_path: Path) -> None:
    cache = make_cache(lengths=None)
    cache.save(tmp_path / "c.safetensors")
    assert Cache.load(tmp_path / "c.safetensors").lengths is None


def test_cache_is_read_only(cache: Cache) -> None:
    assert not hasattr(cache, "__setitem__")
    assert not hasattr(cache, "__delitem__")
    with pytest.raises(TypeError):
        cache["resid_post.0"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(TypeError):
        del cache["resid_post.0"]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        cache.update({})  # type: ignore[attr-defined]
    assert "resid_post.0" in cache and len(cache) == 7


def test_cache_does_not_alias_the_input_mapping() -> None:
    data = {Address("resid_post", 0): torch.zeros(1, 2, 3)}
    cache = Cache(data)
    data[Address("resid_post", 1)] = torch.ones(1, 2, 3)
    assert list(cache) == [Address("resid_post", 0)]


def test_save_adds_metadata_that_load_ignores(cache: Cache, tmp_path: Path) -> None:
    from safetensors import safe_open

    path = tmp_path / "cache.safetensors"
    cache.save(path, metadata={"interp.prompts": '["a", "b"]', "format": "not overridable"})
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    assert header["interp.prompts"] == '["a", "b"]'
    assert header["format"] == "interp-engine-cache"
    loaded = Cache.load(path)
    assert list(loaded) == list(cache)
    assert loaded.lengths is not None and cache.lengths is not None
    assert loaded.lengths.tolist() == cache.lengths.tolist()
