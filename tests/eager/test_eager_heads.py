"""Per-head addresses on the eager backend (attn_q, attn_k, attn_v, attn_z), against HF itself.

The oracle reads HF's own intermediate values with hooks written here (sharing no code with the
backend): the output projection's input for ``attn_z``, the projection that makes the values for
``attn_v`` (split as each family's attention splits it), and the query and key tensors the
family's attention function receives for ``attn_q``/``attn_k`` (its module-level
``eager_attention_forward``, or GPT-J's ``_attn``). Writes are checked against hand-written
hooks at the same places. Last, the induction-head experiment on the shipped tiny model: with
its previous-token head zero-ablated, the induction head stops looking back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidSteering,
    SteeringSpec,
    UnknownKind,
    Write,
    capture_attention,
    capture_generation,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import ALL_FAMILIES, PROMPT, hf_oracle, rel_diff

from ..support.engines import eager_model

TOL = 1e-4
LAYER = 1

# -- where HF keeps each family's attention parts (the oracle's own table) ---------------------
LAYERS = {
    "gpt2": "transformer.h",
    "gptj": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "opt": "model.decoder.layers",
}
ATTN = {"gpt2": "attn", "gptj": "attn", "gpt_neox": "attention"}
O_PROJ = {"gpt2": "c_proj", "gptj": "out_proj", "gpt_neox": "dense", "opt": "out_proj", "phi": "dense"}


def _v_slice(family: str, out: torch.Tensor, heads: int, kv_heads: int, d: int) -> torch.Tensor:
    """The values ``[batch, pos, kv_heads, d]`` inside the output of the family's value source."""
    if family == "gpt2":  # c_attn: [q | k | v]
        return out[..., 2 * heads * d :].unflatten(-1, (kv_heads, d))
    if family == "phi3":  # qkv_proj: [q heads | k heads | v heads]
        return out[..., (heads + kv_heads) * d :].unflatten(-1, (kv_heads, d))
    if family == "gpt_neox":  # query_key_value: per head [q_h k_h v_h]
        return out.unflatten(-1, (heads, 3 * d))[..., 2 * d :]
    return out.unflatten(-1, (kv_heads, d))


V_SOURCE = {"gpt2": "c_attn", "phi3": "qkv_proj", "gpt_neox": "query_key_value"}


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _attn(family: str, layer: int) -> Any:
    return _get(_get(hf_oracle(family), LAYERS.get(family, "model.layers"))[layer], ATTN.get(family, "self_attn"))


def _o_proj(family: str, layer: int) -> Any:
    return getattr(_attn(family, layer), O_PROJ.get(family, "o_proj"))


def _v_source(family: str, layer: int) -> Any:
    return getattr(_attn(family, layer), V_SOURCE.get(family, "v_proj"))


def _shape(family: str) -> tuple[int, int, int]:
    info = eager_model(family).info
    return info.n_heads, info.n_kv_heads, info.d_head


@contextmanager
def _edit_o_proj_input(family: str, layer: int, edit: Callable[[torch.Tensor], None]) -> Iterator[dict[str, Any]]:
    """Call ``edit(z)`` on the o_proj input viewed ``[batch, pos, heads, d]`` (in place, on a copy)."""
    heads, _, d = _shape(family)
    seen: dict[str, Any] = {}

    def hook(module: Any, args: Any) -> Any:
        x = args[0].clone()
        edit(x.view(*x.shape[:-1], heads, d))
        seen["z"] = x.view(*x.shape[:-1], heads, d).clone()
        return (x, *args[1:])

    handle = _o_proj(family, layer).register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def _edit_values(family: str, layer: int, edit: Callable[[torch.Tensor], None]) -> Iterator[dict[str, Any]]:
    """Call ``edit(v)`` on the values ``[batch, pos, kv_heads, d]`` where the value source makes them."""
    heads, kv_heads, d = _shape(family)
    seen: dict[str, Any] = {}

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        out = output.clone()
        edit(_v_slice(family, out, heads, kv_heads, d))
        seen.setdefault("v", []).append(_v_slice(family, out, heads, kv_heads, d).clone())
        return out

    handle = _v_source(family, layer).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def _record_query_key(family: str, layer: int) -> Iterator[dict[str, torch.Tensor]]:
    """The query and key HF's attention function receives at ``layer`` (eager attention)."""
    attn = _attn(family, layer)
    seen: dict[str, torch.Tensor] = {}
    if family == "gptj":  # GPT-J computes attention in its own method
        original = attn._attn

        def method(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen["q"], seen["k"] = query.clone(), key.clone()
            return original(query, key, *args, **kwargs)

        attn.__dict__["_attn"] = method
        try:
            yield seen
        finally:
            del attn.__dict__["_attn"]
        return
    namespace = type(attn).forward.__globals__  # where the forward looks up eager_attention_forward
    original = namespace["eager_attention_forward"]

    def function(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is attn:
            seen["q"], seen["k"] = query.clone(), key.clone()
        return original(module, query, key, *args, **kwargs)

    namespace["eager_attention_forward"] = function
    try:
        yield seen
    finally:
        namespace["eager_attention_forward"] = original


def _hf_logits(family: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_oracle(family)(torch.tensor([ids])).logits[0]


def _ids(family: str, n: int = 12, seed: int = 0) -> list[int]:
    vocab = eager_model(family).info.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _vector(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _logits(family: str, ids: list[int], *writes: Write) -> torch.Tensor:
    spec = SteeringSpec(list(writes)) if writes else None
    return sync_model(eager_model(family)).capture(ids, ["logits"], steering_spec=spec)[Address("logits")]


# -- reading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_head_values_equal_hfs_own_intermediates(family: str) -> None:
    model = sync_model(eager_model(family))
    heads, kv_heads, d = _shape(family)
    ids = model.to_tokens(PROMPT)[0].tolist()
    n = len(ids)
    points = [Address(kind, layer) for kind in ("attn_q", "attn_k", "attn_v", "attn_z") for layer in (0, LAYER, -1)]
    got = model.capture(ids, points)
    n_layers = model.info.n_layers
    for layer in (0, LAYER, n_layers - 1):
        with (
            _record_query_key(family, layer) as qk,
            _edit_values(family, layer, lambda v: None) as values,
            _edit_o_proj_input(family, layer, lambda z: None) as outputs,
        ):
            _hf_logits(family, ids)
        expected = {
            "attn_q": qk["q"][0].transpose(0, 1),  # [heads, pos, d] -> [pos, heads, d]
            "attn_k": qk["k"][0].transpose(0, 1),
            "attn_v": values["v"][0][0],
            "attn_z": outputs["z"][0],
        }
        for kind, value in expected.items():
            address = Address(kind, layer if layer != n_layers - 1 else -1)
            want = (n, kv_heads if kind in ("attn_k", "attn_v") else heads, d)
            assert tuple(got[address].shape) == want, (kind, layer)
            assert rel_diff(got[address], value) <= TOL, (kind, layer)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "phi3"])
def test_batched_values_and_the_cache_keep_the_head_axis(family: str) -> None:
    model = eager_model(family)
    heads, kv_heads, d = _shape(family)
    rows = [_ids(family, 9, seed=1), _ids(family, 5, seed=2)]
    points = ["attn_q.1", "attn_k.1", "attn_v.0", "attn_z.2"]
    cache = run_with_cache(model, rows, points)
    assert tuple(cache["attn_q.1"].shape) == (2, 9, heads, d)
    assert tuple(cache["attn_k.1"].shape) == (2, 9, kv_heads, d)
    for i, row in enumerate(rows):
        alone = sync_model(model).capture(row, points)
        for point in points:
            assert rel_diff(cache[point][i, : len(row)], alone[Address.parse(point)]) <= TOL, point
            assert not cache[point][i, len(row) :].any(), point  # right-padding is zeros


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gptj", "gemma2", "opt", "phi3"])
def test_values_during_generation_equal_one_forward_over_the_final_sequence(family: str) -> None:
    """Chunked generation (prompt, then one token at a time with the KV cache): queries are the
    current tokens', keys and values the current tokens' too, not the cached ones."""
    model = eager_model(family)
    ids = _ids(family, 7, seed=3)
    points = ["attn_q.1", "attn_k.1", "attn_v.1", "attn_z.1"]
    completion, cache = capture_generation(model, [ids], points, max_tokens=5, ignore_eos=True)
    whole = run_with_cache(model, [ids + completion.token_ids], points)
    for point in points:
        assert cache[point].shape == whole[point].shape, point
        assert rel_diff(cache[point], whole[point]) <= TOL, point


# -- writing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_zero_ablating_a_head_matches_an_oracle_hook(family: str) -> None:
    _, _, d = _shape(family)
    ids = _ids(family)
    head = 1

    def zero(z: torch.Tensor) -> None:
        z[..., head, :] = 0

    got = _logits(family, ids, Write(Address("attn_z", LAYER), torch.zeros(d), op="set", heads=[head]))
    with _edit_o_proj_input(family, LAYER, zero):
        expected = _hf_logits(family, ids)
    assert rel_diff(got, expected) <= TOL
    assert rel_diff(got, _hf_logits(family, ids)) > 1e-3  # the head mattered


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_patching_a_head_from_another_prompt_matches_an_oracle_hook(family: str) -> None:
    model = sync_model(eager_model(family))
    clean, corrupt = _ids(family, seed=4), _ids(family, seed=5)
    head, point = 2, Address("attn_z", LAYER)
    rows = model.capture(clean, [point])[point][:, head : head + 1]  # [n_pos, 1, d_head]
    got = _logits(family, corrupt, Write(point, rows, op="set", heads=[head], positions="all"))
    with _edit_o_proj_input(family, LAYER, lambda z: None) as seen:
        _hf_logits(family, clean)
    source = seen["z"][0, :, head]

    def patch(z: torch.Tensor) -> None:
        z[0, :, head] = source

    with _edit_o_proj_input(family, LAYER, patch):
        expected = _hf_logits(family, corrupt)
    assert rel_diff(got, expected) <= TOL


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_add_and_ablate_per_head_match_an_oracle_hook(family: str) -> None:
    model = sync_model(eager_model(family))
    heads, _, d = _shape(family)
    ids = _ids(family, seed=6)
    point = Address("attn_z", LAYER)
    added = _vector(2, d, seed=7)  # one row per selected head
    direction = _vector(d, seed=8)
    unit = direction / direction.norm()
    writes = [
        Write(point, added, op="add", scale=1.5, heads=[0, 2], positions=[1, 4, -1]),
        Write(point, direction, op="ablate", heads=[1]),
    ]
    spec = SteeringSpec(writes)
    got = model.capture(ids, ["logits", point], steering_spec=spec)
    plain = model.capture(ids, [point])[point]

    def edit(z: torch.Tensor) -> None:
        for pos in (1, 4, len(ids) - 1):
            z[0, pos, 0] += 1.5 * added[0]
            z[0, pos, 2] += 1.5 * added[1]
        z[0, :, 1] -= (z[0, :, 1] @ unit).unsqueeze(-1) * unit

    with _edit_o_proj_input(family, LAYER, edit):
        expected = _hf_logits(family, ids)
    assert rel_diff(got[Address("logits")], expected) <= TOL
    steered = got[point]
    # the heads no write selects are untouched, bit for bit, and so are the unselected positions
    for head in range(3, heads):
        assert torch.equal(steered[:, head], plain[:, head])
    untouched = [p for p in range(len(ids)) if p not in (1, 4, len(ids) - 1)]
    assert torch.equal(steered[untouched][:, [0, 2]], plain[untouched][:, [0, 2]])
    assert float((steered[:, 1] @ unit).abs().max()) <= 1e-5


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_value_writes_match_an_oracle_hook(family: str) -> None:
    """A value write lands where the family makes its values (fused c_attn / qkv_proj /
    interleaved query_key_value included); with GQA, heads index the key/value heads."""
    model = sync_model(eager_model(family))
    _, kv_heads, d = _shape(family)
    ids = _ids(family, seed=9)
    head = kv_heads // 2  # a middle head: its place differs between the fused layouts
    vector = _vector(d, seed=10)
    point = Address("attn_v", LAYER)
    got = model.capture(
        ids, ["logits", point], steering_spec=SteeringSpec([Write(point, vector, heads=[head], scale=2.0)])
    )
    plain = model.capture(ids, [point])[point]

    def add(v: torch.Tensor) -> None:
        v[..., head, :] += 2.0 * vector

    with _edit_values(family, LAYER, add):
        expected = _hf_logits(family, ids)
    assert rel_diff(got[Address("logits")], expected) <= TOL
    assert rel_diff(got[Address("logits")], _hf_logits(family, ids)) > 1e-3
    assert torch.equal(got[point][:, :head], plain[:, :head])
    assert rel_diff(got[point][:, head], plain[:, head] + 2.0 * vector) <= TOL


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gptj", "phi3", "qwen3", "opt"])
@pytest.mark.parametrize("positions", ["prompt", "all"])
def test_value_writes_during_generation_match_hf_generate_with_the_same_hook(family: str, positions: str) -> None:
    """The KV cache holds the written values: decoding steps attend to the steered prompt values."""
    model = sync_model(eager_model(family))
    _, _, d = _shape(family)
    ids = _ids(family, 8, seed=11)
    n_prompt, max_tokens = len(ids), 6
    vector = _vector(d, seed=12)
    spec = SteeringSpec([Write(Address("attn_v", 0), vector, scale=3.0, heads=[0], positions=positions)])
    steps = list(model.stream(ids, max_tokens=max_tokens, n_logprobs=4, steering_spec=spec, ignore_eos=True))
    plain = model.generate(ids, max_tokens=max_tokens, ignore_eos=True)

    def add(v: torch.Tensor) -> None:
        if positions == "all" or v.shape[1] == n_prompt:  # HF's first forward is the whole prompt
            v[..., 0, :] += 3.0 * vector

    hf = hf_oracle(family)
    with _edit_values(family, 0, add), torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [step.token_id for step in steps]
    assert tokens == out.sequences[0, n_prompt:].tolist()
    assert tokens != plain.token_ids
    for step, logits in zip(steps, out.logits, strict=True):
        expected = torch.log_softmax(logits[0].float(), dim=-1)
        for token, logprob in step.logprobs:
            assert abs(logprob - float(expected[token])) <= 1e-3
    # capture_generation sees the same run and reports the written values
    completion, cache = capture_generation(
        model, [ids], ["attn_v.0"], max_tokens=max_tokens, steering_spec=spec, ignore_eos=True
    )
    assert completion.token_ids == tokens
    unsteered = run_with_cache(model, [ids + tokens], ["attn_v.0"])["attn_v.0"][0]
    written = range(n_prompt) if positions == "prompt" else range(n_prompt + max_tokens)
    delta = cache["attn_v.0"][0] - unsteered
    assert rel_diff(delta[list(written), 0], (3.0 * vector).expand(len(written), -1)) <= 1e-3
    assert rel_diff(cache["attn_v.0"][0, :, 1:], unsteered[:, 1:]) <= TOL  # the other heads are not written


# -- errors ------------------------------------------------------------------------------------


async def test_head_write_errors_are_typed_and_name_the_problem() -> None:
    model = eager_model("llama")  # 4 query heads, 2 key/value heads of 16
    ids = _ids("llama", 6)
    d = model.info.d_head

    async def run(*writes: Write) -> None:
        await model.capture(ids, ["logits"], steering_spec=SteeringSpec(list(writes)))

    with pytest.raises(InvalidSteering, match=r"head 4 .*attn_z\.1.* 4 heads"):
        await run(Write("attn_z.1", torch.zeros(d), op="set", heads=[4]))
    with pytest.raises(InvalidSteering, match=r"head 2 .*attn_v\.0.* 2 heads"):
        await run(Write("attn_v.0", torch.zeros(d), heads=[2]))  # GQA: value heads are the KV heads
    with pytest.raises(InvalidSteering, match=r"3 head rows.*2 heads"):
        Write("attn_z.1", torch.zeros(3, d), heads=[0, 1])
    with pytest.raises(InvalidSteering, match=r"2 head rows but the write selects 4 heads"):
        await run(Write("attn_z.1", torch.zeros(2, d)))  # no heads=: one row per head, or one for all
    with pytest.raises(InvalidSteering, match=r"5 rows but selects 2 positions"):
        await run(Write("attn_z.1", torch.zeros(5, 1, d), op="set", heads=[0], positions=[0, 1]))
    with pytest.raises(InvalidSteering, match=r"attn_z\.1 has width 17.* 16 wide per head"):
        await run(Write("attn_z.1", torch.zeros(17), heads=[0]))
    with pytest.raises(InvalidSteering, match=r"heads= .*resid_post\.1 has no head axis"):
        Write("resid_post.1", torch.zeros(model.info.d_model), heads=[0])
    for kind in ("attn_q", "attn_k"):
        with pytest.raises(InvalidSteering, match=rf"{kind}"):
            Write(f"{kind}.1", torch.zeros(d), heads=[0])
    with pytest.raises(UnknownKind):
        await model.capture(ids, ["attn_y.1"])
    # nothing above left a hook or tap behind: a plain capture is the plain model
    plain = await model.capture(ids, ["logits", "attn_q.1"])
    assert rel_diff(plain[Address("logits")], _hf_logits("llama", ids)) <= TOL


def test_head_write_errors_through_the_sync_free_functions() -> None:
    model = eager_model("gpt2")
    d = model.info.d_head
    spec = SteeringSpec([Write("attn_z.0", torch.zeros(d), op="set", heads=[9])])
    with pytest.raises(InvalidSteering, match="head 9"):
        capture_attention(model, [_ids("gpt2", 5)], [1], steering_spec=spec)
    with pytest.raises(InvalidSteering, match="head 9"):
        run_with_cache(model, [_ids("gpt2", 5)], ["attn_pattern.1"], steering_spec=spec)


# -- the induction head of the shipped tiny model ----------------------------------------------


def _induction_score(pattern: torch.Tensor, length: int, head: int) -> float:
    """Mean attention from each token of the second copy to the token after its first occurrence."""
    q = torch.arange(length, 2 * length)
    return float(pattern[:, head, q, q - (length - 1)].mean())


def test_ablating_the_previous_token_head_breaks_the_induction_head() -> None:
    model = load_model("interp:tiny", backend="eager")
    sync = sync_model(model)
    try:
        length, d = 20, model.info.d_head
        run = torch.randint(2, model.info.vocab_size, (4, length), generator=torch.Generator().manual_seed(5))
        tokens = torch.cat([run, run], dim=1)
        ablate = SteeringSpec([Write(Address("attn_z", 0), torch.zeros(d), op="set", heads=[0])])
        pattern = Address("attn_pattern", 1)
        before = _induction_score(capture_attention(model, tokens, [1])[pattern], length, 0)
        after = _induction_score(capture_attention(model, tokens, [1], steering_spec=ablate)[pattern], length, 0)
        assert before > 0.5 and after < 0.2, (before, after)
        # the previous-token head is what it needs most: ablating any other head of layer 0 hurts less
        for head in (1, 2, 3):
            other = SteeringSpec([Write(Address("attn_z", 0), torch.zeros(d), op="set", heads=[head])])
            score = _induction_score(capture_attention(model, tokens, [1], steering_spec=other)[pattern], length, 0)
            assert score > 2 * after, (head, score, after)
        # the same through the model's own method and the sync facade, one prompt at a time
        row = tokens[0].tolist()
        direct = sync.capture_attention(row, [1], steering_spec=ablate)[pattern]
        cache = run_with_cache(model, [row], [pattern], steering_spec=ablate)
        assert torch.equal(direct, cache[pattern][0])
        assert not torch.equal(direct, sync.capture_attention(row, [1])[pattern])
    finally:
        sync.shutdown()
