"""The logit lens during generation on the eager backend: ``stream(..., lens=LensRequest(...))``
and ``capture_generation(..., lens=...)``, checked against ``lens_top_k(decode_residuals(...))``
of the ``resid_post`` that ``capture_generation`` records over the same tokens (same request,
same seed: the same tokens), on the shipped tiny model (GPT-2 shaped) and a Gemma 2 test model
(its (1 + w) RMSNorm and final logit soft-capping); the sync facade, the free functions, the
``Cache`` holding the lens, the ``Labelled`` view and the plot."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Cache,
    Features,
    InvalidActivations,
    InvalidOption,
    LensRequest,
    LensResult,
    LensTopK,
    SteeringSpec,
    Write,
    capture_generation,
    generate_stream,
    lens_top_k,
    load_model,
    load_sae,
    sync_model,
)
from interp_engine._shipped import resolve_sae

from ..support.engines import eager_model

TEXT = "The capital of France is"
PROB_TOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> Iterator[Any]:
    model = load_model("interp:tiny", backend="eager")
    yield model
    sync_model(model).shutdown()


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _steps(model: Any, ids: list[int], **kwargs: Any) -> list[Any]:
    stream: AsyncIterator[Any] = model.stream(ids, **kwargs)
    return [step async for step in stream]


def _reference(model: Any, ids: list[int], lens: LensRequest, **kwargs: Any) -> tuple[list[int], dict[int, Any]]:
    """The generated tokens and, per absolute lens layer, ``(ids, probs)`` ``[n_seq, k]`` of
    ``lens_top_k(decode_residuals(resid_post))`` captured by ``capture_generation`` over them."""
    n = model.info.n_layers
    layers = [layer % n for layer in lens.layers]
    points = [Address("resid_post", layer) for layer in layers]
    completion, acts = _run(model.capture_generation(ids, points, **kwargs))
    out = {}
    for layer, point in zip(layers, points, strict=True):
        logits = _run(model.decode_residuals(acts[point]))
        out[layer] = lens_top_k(logits, lens.top_k)
    return completion.token_ids, out


def _check_step_lens(found: LensTopK, reference: dict[int, Any], position: int) -> None:
    assert found.position == position
    assert found.ids.dtype == torch.int64 and found.probs.dtype == torch.float32
    for row, layer in enumerate(found.layers):
        ids, probs = reference[layer]
        assert found.ids[row].tolist() == ids[position].tolist(), f"layer {layer}, position {position}"
        torch.testing.assert_close(found.probs[row], probs[position], atol=PROB_TOL, rtol=0)


def _check_stream(model: Any, ids: list[int], lens: LensRequest, max_tokens: int = 6, **kwargs: Any) -> list[Any]:
    steps = _run(_steps(model, ids, max_tokens=max_tokens, lens=lens, **kwargs))
    tokens, reference = _reference(model, ids, lens, max_tokens=max_tokens, **kwargs)
    assert [s.token_id for s in steps] == tokens
    n = model.info.n_layers
    assert all(s.lens.layers == tuple(layer % n for layer in lens.layers) for s in steps)
    for index, step in enumerate(steps):
        assert step.position == len(ids) - 1 + index
        _check_step_lens(step.lens, reference, step.position)
        assert step.lens.ids.shape == (len(lens.layers), lens.top_k)
    return steps


@pytest.mark.parametrize("which", ["tiny", "gemma2"])
def test_each_step_is_the_lens_of_the_captured_residuals(which: str, tiny: Any) -> None:
    model = tiny if which == "tiny" else eager_model("gemma2")
    ids = model.to_tokens(TEXT)[0].tolist()
    n = model.info.n_layers
    lens = LensRequest([0, -1, n - 2], top_k=5)  # a negative layer, in an order of our own
    steps = _check_stream(model, ids, lens)
    assert [s.lens.layers for s in steps[:1]] == [(0, n - 1, n - 2)]
    assert all(s.prompt_lens is None for s in steps)
    # the last layer's lens is the model's own next-token distribution: greedy picks its top-1
    assert all(int(s.lens.ids[1, 0]) == s.token_id for s in steps)
    assert all(float(s.lens.probs[1].sum()) <= 1.0 + 1e-6 for s in steps)


def test_gemma2_lens_is_soft_capped() -> None:
    """Without the soft-cap the lens differs: the cap is part of what the lens decodes."""
    model = eager_model("gemma2")
    ids = model.to_tokens(TEXT)[0].tolist()
    step = _run(_steps(model, ids, max_tokens=1, lens=LensRequest([-1], top_k=3)))[0]
    hf = model.hf_model
    last = Address("resid_post", model.info.n_layers - 1)
    resid = _run(model.capture(ids, [last]))[last][-1]
    with torch.inference_mode():
        raw = hf.lm_head(hf.model.norm(resid))  # by hand: Gemma's (1 + w) RMSNorm, the tied unembedding
    cap = hf.config.final_logit_softcapping
    assert cap
    capped_ids, capped = lens_top_k(torch.tanh(raw / cap) * cap, 3)
    assert step.lens.ids[0].tolist() == capped_ids.tolist()
    torch.testing.assert_close(step.lens.probs[0], capped, atol=PROB_TOL, rtol=0)
    assert not torch.allclose(lens_top_k(raw, 3)[1], capped, atol=1e-4)


def test_prompt_positions(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    n_prompt = len(ids)
    for positions, expected in [("prompt", list(range(n_prompt))), ([2, 0, -2], [0, 2, n_prompt - 2])]:
        lens = LensRequest([1, -1], top_k=4, positions=positions)
        steps = _check_stream(tiny, ids, lens, max_tokens=3)
        _, reference = _reference(tiny, ids, lens, max_tokens=3)
        first = steps[0].prompt_lens
        assert isinstance(first, LensResult)
        assert list(first.positions) == expected
        assert first.ids.shape == (2, len(expected), 4)
        for position in expected:
            _check_step_lens(first.at(position), reference, position)
        assert all(s.prompt_lens is None for s in steps[1:])
        if n_prompt - 1 in expected:  # the prompt's last position is also the first step's
            assert torch.equal(first.at(n_prompt - 1).ids, steps[0].lens.ids)


def test_capture_generation_holds_the_lens_of_the_stream(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    n_prompt = len(ids)
    lens = LensRequest([-1, 0], top_k=3, positions=[0, 1])
    steps = _run(_steps(tiny, ids, max_tokens=5, lens=lens))
    completion, acts = _run(tiny.capture_generation(ids, ["resid_post.2"], max_tokens=5, lens=lens))
    assert completion.token_ids == [s.token_id for s in steps]
    result = acts[lens]
    assert isinstance(result, LensResult)
    assert list(result.positions) == [0, 1, *range(n_prompt - 1, n_prompt + 4)]
    assert acts[Address("resid_post", 2)].shape[0] == n_prompt + 5  # the capture itself unchanged
    for step in steps:
        at = result.at(step.position)
        assert torch.equal(at.ids, step.lens.ids) and torch.equal(at.probs, step.lens.probs)
    for position in (0, 1):
        assert torch.equal(result.at(position).ids, steps[0].prompt_lens.at(position).ids)
    with pytest.raises(KeyError, match="not read at position"):
        result.at(n_prompt + 4)  # the last generated token produced nothing
    # the lens alone, no points
    _, only = _run(tiny.capture_generation(ids, [], max_tokens=5, lens=lens))
    assert list(only) == [lens] and torch.equal(only[lens].ids, result.ids)


def test_lens_under_steering_and_sampling(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    d = tiny.info.d_model
    spec = SteeringSpec([Write("resid_post.1", torch.randn(d, generator=torch.Generator().manual_seed(0)), scale=8.0)])
    lens = LensRequest([1, 2, -1], top_k=5)
    steered = _check_stream(tiny, ids, lens, steering_spec=spec)
    plain = _run(_steps(tiny, ids, max_tokens=6, lens=lens))
    assert not torch.equal(steered[0].lens.probs, plain[0].lens.probs)  # the lens sees the write
    sampled = _check_stream(tiny, ids, lens, temperature=1.0, seed=7)
    again = _run(_steps(tiny, ids, max_tokens=6, lens=lens, temperature=1.0, seed=7))
    assert [s.token_id for s in again] == [s.token_id for s in sampled]
    both = _check_stream(tiny, ids, lens, steering_spec=spec, temperature=0.8, top_k=20, seed=3)
    assert both  # it may stop early at the end-of-text token


def test_lens_with_sae_readouts_and_generate_unaffected(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    sae = load_sae(resolve_sae("interp:tiny-sae"))
    tiny.attach_sae("lens-test", sae)
    readout = Features("lens-test", 4)
    lens = LensRequest([sae.address.layer, 0], top_k=3)  # the SAE's own layer too
    with_lens = _run(_steps(tiny, ids, max_tokens=4, features=[readout], lens=lens, n_logprobs=3))
    without = _run(_steps(tiny, ids, max_tokens=4, features=[readout], n_logprobs=3))
    for a, b in zip(with_lens, without, strict=True):
        assert a.token_id == b.token_id and a.logprobs == b.logprobs
        assert torch.equal(a.features[readout].values, b.features[readout].values)
        assert torch.equal(a.features[readout].ids, b.features[readout].ids)
        assert b.lens is None and a.lens is not None
    _, reference = _reference(tiny, ids, lens, max_tokens=4)
    for step in with_lens:
        _check_step_lens(step.lens, reference, step.position)
    completion = _run(tiny.generate(ids, max_tokens=4))
    assert completion.token_ids == [s.token_id for s in with_lens]


def test_only_the_needed_rows_are_kept(tiny: Any) -> None:
    """The plan keeps the lens layers' rows at the positions asked, nothing else."""
    from interp_eager._plan import Chunk, Plan

    ids = tiny.to_tokens(TEXT)[0].tolist()
    point = Address("resid_post", 1)
    plan = Plan(tiny.arch, [], [], [len(ids)], rows_at={point: frozenset({1, 3})})
    tiny._forward(plan, Chunk(1, len(ids), 0), torch.tensor([ids]))
    assert not plan.values and not plan.wanted
    assert sorted(plan.rows[point]) == [1, 3]
    captured = _run(tiny.capture(ids, [point]))[point]
    for position, row in plan.rows[point].items():
        assert row.shape == (1, tiny.info.d_model)
        torch.testing.assert_close(row[0].float(), captured[position], atol=1e-6, rtol=0)


def test_errors_are_typed(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    n = tiny.info.n_layers

    def refused(lens: Any, match: str) -> None:
        with pytest.raises(InvalidOption, match=match):
            _run(_steps(tiny, ids, max_tokens=2, lens=lens))
        with pytest.raises(InvalidOption, match=match):
            _run(tiny.capture_generation(ids, [], max_tokens=2, lens=lens))

    refused(LensRequest([n]), f"outside this {n}-layer model")
    refused(LensRequest([-n - 1]), "outside")
    refused(LensRequest([-1, n - 1]), "name one layer twice")
    refused(LensRequest([0], positions=[len(ids)]), "outside the")
    refused(LensRequest([0], positions=[-len(ids) - 1]), "outside the")
    refused({"layers": [0], "top_k": 2, "colour": "red"}, "unknown lens field")
    refused({"top_k": 2}, "needs 'layers'")
    refused("resid_post.0", "must be a LensRequest")
    for bad, match in [
        (lambda: LensRequest([]), "non-empty"),
        (lambda: LensRequest(["0"]), "list of ints"),
        (lambda: LensRequest([0, 0]), "repeat"),
        (lambda: LensRequest([0], top_k=0), "top_k"),
        (lambda: LensRequest([0], top_k=101), "top_k"),
        (lambda: LensRequest([0], top_k=2.5), "top_k"),
        (lambda: LensRequest([0], positions="generated"), "every generated token is read already"),
        (lambda: LensRequest([0], positions="all"), "every generated token"),
        (lambda: LensRequest([0], positions=[1.5]), "lens positions"),
        (lambda: LensRequest([0], positions=[1, 1]), "repeat"),
        (lambda: LensRequest.from_json([0]), "an object"),
    ]:
        with pytest.raises(InvalidOption, match=match):
            bad()


def test_json_round_trips(tiny: Any) -> None:
    for lens in [
        LensRequest([0, -1]),
        LensRequest(2, top_k=7, positions=[0, -1]),
        LensRequest([1], positions="prompt"),
    ]:
        assert LensRequest.from_json(lens.to_json()) == lens
        assert hash(LensRequest.from_json(lens.to_json())) == hash(lens)
    ids = tiny.to_tokens(TEXT)[0].tolist()
    lens = LensRequest([0, -1], top_k=2, positions=[0])
    # a JSON object works as the request itself
    step = _run(_steps(tiny, ids, max_tokens=1, lens=lens.to_json()))[0]
    assert step.lens.to_json()["layers"] == [0, tiny.info.n_layers - 1]
    assert step.prompt_lens.to_json()["positions"] == [0]
    assert len(step.lens.to_json()["ids"][0]) == 2


def test_sync_facade_and_free_functions(tiny: Any, tmp_path: pathlib.Path) -> None:
    sync = sync_model(tiny)
    ids = tiny.to_tokens(TEXT)[0].tolist()
    lens = LensRequest([0, -1], top_k=3, positions="prompt")
    steps = list(sync.stream(ids, max_tokens=4, lens=lens))
    assert [s.lens.position for s in steps] == [len(ids) - 1 + i for i in range(4)]
    free = list(generate_stream(tiny, TEXT, max_tokens=4, lens=lens))
    assert [torch.equal(a.lens.probs, b.lens.probs) for a, b in zip(steps, free, strict=True)] == [True] * 4
    assert torch.equal(free[0].prompt_lens.ids, steps[0].prompt_lens.ids)
    completion, acts = sync.capture_generation(ids, [], max_tokens=4, lens=lens)
    assert isinstance(acts[lens], LensResult)
    # the free function: the Cache carries the lens
    completion2, cache = capture_generation(tiny, TEXT, ["resid_post.1"], max_tokens=4, lens=lens)
    assert completion2.token_ids == completion.token_ids == [s.token_id for s in steps]
    assert isinstance(cache.lens, LensResult) and list(cache) == [Address("resid_post", 1)]
    assert torch.equal(cache.lens.ids, acts[lens].ids)
    assert cache.lens.positions == tuple(range(len(ids) + 3))
    assert cache.to("cpu").lens is cache.lens
    assert repr(cache).endswith(f"lens=layers [0, 3] x {len(ids) + 3} positions x top-3)")
    path = tmp_path / "gen.safetensors"
    cache.save(path)
    loaded = Cache.load(path)
    assert loaded.lens is not None and loaded.lens.layers == cache.lens.layers
    assert loaded.lens.positions == cache.lens.positions
    assert torch.equal(loaded.lens.ids, cache.lens.ids) and torch.equal(loaded.lens.probs, cache.lens.probs)
    assert torch.equal(loaded["resid_post.1"], cache["resid_post.1"])
    _, plain = capture_generation(tiny, TEXT, ["resid_post.1"], max_tokens=4)
    assert plain.lens is None and Cache.load(_saved(plain, tmp_path / "plain.safetensors")).lens is None
    assert Cache.concat([plain, plain])["resid_post.1"].shape[0] == 2
    with pytest.raises(InvalidActivations, match="holds a logit lens"):
        Cache.concat([plain, cache])
    joined = Cache.concat(Cache(c, lengths=c.lengths, n_layers=c.n_layers) for c in [plain, cache])
    assert joined.lens is None and joined["resid_post.1"].shape[0] == 2


def _saved(cache: Cache, path: pathlib.Path) -> pathlib.Path:
    cache.save(path)
    return path


def test_labelled_view(tiny: Any) -> None:
    ids = tiny.to_tokens(TEXT)[0].tolist()
    lens = LensRequest([2, 0], top_k=4, positions=[0])
    _, cache = capture_generation(tiny, ids, [], max_tokens=3, lens=lens)
    result = cache.lens
    view = result.labelled(decode=tiny.to_str_tokens)
    assert view.dims == ("layer", "position", "rank")
    assert view.shape == (2, 1 + 3, 4)
    assert view.labels("layer") == [2, 0] and view.labels("position") == [0, *range(len(ids) - 1, len(ids) + 2)]
    assert view.labels("rank") == [0, 1, 2, 3]
    assert view.at(layer=0, position=0, rank=0) == pytest.approx(float(result.probs[1, 0, 0]))
    assert view.meta["ids"] == result.ids.tolist()
    assert view.meta["tokens"][1][0] == tiny.to_str_tokens(result.ids[1, 0].tolist())
    assert "tokens" not in result.labelled().meta
    assert view.to_dict()["meta"]["tokens"][0][2][1] == tiny.to_str_tokens([int(result.ids[0, 2, 1])])[0]
    with pytest.raises(InvalidActivations, match="one string per id"):
        result.labelled(decode=lambda ids: ["x"])


def test_plot_renders(tiny: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from interp_engine import plot

    ids = tiny.to_tokens(TEXT)[0].tolist()
    lens = LensRequest([0, 1, 2, 3], top_k=2, positions="prompt")
    completion, cache = capture_generation(tiny, ids, [], max_tokens=3, lens=lens)
    result = cache.lens
    tokens = tiny.to_str_tokens(ids + completion.token_ids)
    fig = result.plot(decode=tiny.to_str_tokens, tokens=tokens)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"resid_post.{layer}" for layer in range(4)]
    columns = [t.get_text() for t in ax.get_xticklabels()]
    assert columns[0] == "0 The" and columns[-1] == f"{len(ids) + 1} {plot.token_label(tokens[len(ids) + 1])}"
    image = torch.as_tensor(ax.get_images()[0].get_array().data)
    torch.testing.assert_close(image, result.probs[..., 0])
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    assert len(cells) == 4 * len(result.positions)
    last = len(result.positions) - 1
    assert cells[(3, last)] == plot.token_label(tiny.to_str_tokens([int(result.ids[3, last, 0])])[0], 9)
    fig.canvas.draw()
    bare = plot.lens(result)  # no decode: no token names; positions as column labels
    assert not bare.axes[0].texts
    assert [t.get_text() for t in bare.axes[0].get_xticklabels()][:2] == ["0", "1"]
    with pytest.raises(InvalidActivations, match="tokens for positions"):
        plot.lens(result, tokens=tokens[:2])
    with pytest.raises(InvalidActivations, match="draws a LensResult"):
        plot.lens(result.labelled())  # type: ignore[arg-type]


def test_chat_span_positions(tiny: Any) -> None:
    """A chat span name as the lens's prompt positions: the span's positions, resolved against
    the prompt's own spans (the shipped model's chat template)."""
    messages = [{"role": "user", "content": "The capital of France is"}]
    tokens = tiny.chat_tokens(messages)
    span = tokens.positions("user[-1]")
    assert span == list(range(tokens.messages[0].start, tokens.messages[0].end)) and span
    lens = LensRequest([0, -1], top_k=3, positions="user[-1]")
    steps = _run(_steps(tiny, tokens, max_tokens=2, lens=lens))
    assert list(steps[0].prompt_lens.positions) == sorted(span)
    explicit = _run(_steps(tiny, tokens.ids, max_tokens=2, lens=LensRequest([0, -1], top_k=3, positions=span)))
    assert torch.equal(explicit[0].prompt_lens.ids, steps[0].prompt_lens.ids)
    with pytest.raises(InvalidOption, match="lens positions"):
        _run(_steps(tiny, tokens.ids, max_tokens=2, lens=lens))  # plain ids carry no spans
    last = LensRequest([1], top_k=2, positions="user[-1].last")
    (free,) = list(generate_stream(tiny, tokens, max_tokens=1, lens=last))  # the free function keeps the spans
    assert free.prompt_lens.positions == (span[-1],)
    _, cache = capture_generation(tiny, tokens, [], max_tokens=2, lens=last)
    assert cache.lens.positions == (span[-1], len(tokens.ids) - 1, len(tokens.ids))


def test_concurrent_mixed_requests_equal_their_solo_runs(tiny: Any) -> None:
    """16 concurrent streams, half with a lens (different layers, k, positions), half plain, some
    steered: each equals its own solo run bit for bit, and the plain ones carry no lens."""
    texts = [TEXT, "Once upon a time", "The cat sat on the", "Water boils at"]
    d = tiny.info.d_model
    spec = SteeringSpec([Write("resid_post.2", torch.ones(d), scale=3.0)])
    requests = []
    for i in range(16):
        kwargs: dict[str, Any] = {"max_tokens": 4 + i % 3, "n_logprobs": 2}
        if i % 2:
            kwargs["lens"] = LensRequest(
                [i % 4, -1] if i % 4 != 3 else [-1], top_k=1 + i % 5, positions=[0] if i % 3 else None
            )
        if i % 4 == 1:
            kwargs["steering_spec"] = spec
        if i % 5 == 0:
            kwargs.update(temperature=0.9, seed=i)
        requests.append((tiny.to_tokens(texts[i % 4])[0].tolist(), kwargs))

    async def together() -> list[list[Any]]:
        return list(await asyncio.gather(*(_steps(tiny, ids, **kwargs) for ids, kwargs in requests)))

    concurrent = _run(together())
    for (ids, kwargs), got in zip(requests, concurrent, strict=True):
        solo = _run(_steps(tiny, ids, **kwargs))
        assert [s.token_id for s in got] == [s.token_id for s in solo]
        assert [s.logprobs for s in got] == [s.logprobs for s in solo]
        for a, b in zip(got, solo, strict=True):
            if "lens" not in kwargs:
                assert a.lens is None and a.prompt_lens is None
                continue
            assert torch.equal(a.lens.ids, b.lens.ids) and torch.equal(a.lens.probs, b.lens.probs)
            assert (a.prompt_lens is None) == (b.prompt_lens is None)
            if a.prompt_lens is not None:
                assert torch.equal(a.prompt_lens.probs, b.prompt_lens.probs)
