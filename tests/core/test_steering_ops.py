"""The arithmetic ops of a write (``cap``, ``rescale``, ``norm_add``, ``swap``) on every backend.

The eager backend is checked against hand-written HF forward hooks doing the arithmetic (the
:func:`oracle` below, written for the test: it shares no code with the core's ``apply_op``), at a
residual address, at ``mlp_post`` and per head at ``attn_z``; the vllm backend against the eager
backend on the same checkpoint, and vllm-static against vllm (one compiled llama engine, declared
with ``configure_static``; the dynamic engines are the session's shared ones).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidSteering,
    SteeringSpec,
    Write,
    capture_generation,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import ALL_FAMILIES, PROMPT, VLLM_ENGINE_ARGS, hf_oracle, rel_diff, vllm_model_path

from ..support.engines import eager_model

TOL = 1e-4
OPS = ("cap", "rescale", "norm_add", "swap")


# -- the oracle: the arithmetic written out, one row at a time ----------------------------------


def oracle(
    op: str,
    x: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float = 1.0,
    target: torch.Tensor | None = None,
    lo: float | None = None,
    hi: float | None = None,
    max_fraction: float | None = None,
) -> torch.Tensor:
    """``x`` (``[..., width]``) after ``op`` with vector ``v`` (broadcast over the leading axes)."""
    v = v.to(x.dtype)
    if op == "norm_add":
        norm = torch.sqrt((x * x).sum(-1, keepdim=True))
        delta = scale * norm * v
        if max_fraction is not None:
            size = torch.sqrt((delta * delta).sum(-1, keepdim=True))
            delta = delta * torch.where(size > max_fraction * norm, max_fraction * norm / size, torch.ones_like(size))
        return x + delta
    d = v / torch.sqrt((v * v).sum(-1, keepdim=True))
    p = (x * d).sum(-1, keepdim=True)
    if op == "cap":
        bounded = p
        if lo is not None:
            bounded = torch.maximum(bounded, torch.full_like(p, lo))
        if hi is not None:
            bounded = torch.minimum(bounded, torch.full_like(p, hi))
        return x + (bounded - p) * d
    if op == "rescale":
        return x - p * d + scale * p * d
    if op == "swap":
        assert target is not None
        t = target.to(x.dtype)
        t = t / torch.sqrt((t * t).sum(-1, keepdim=True))
        return x + scale * p * (t - d)
    raise AssertionError(op)


def oracle_write(write: Write, x: torch.Tensor, picked: list[int]) -> torch.Tensor:
    """``x`` (``[batch, positions, width]``, or ``[..., heads, d_head]`` at a head address) with
    ``write`` applied at absolute positions ``picked`` (in the vector's row order)."""
    out = x.clone()
    for j, position in enumerate(picked):
        v = write.vector[j] if write.per_position else write.vector
        t = None if write.target is None else write.target[j] if write.target_per_position else write.target
        args = {"scale": write.scale, "target": t, "lo": write.lo, "hi": write.hi, "max_fraction": write.max_fraction}
        if write.heads is not None:
            heads = list(write.heads)
            out[:, position, heads] = oracle(write.op, x[:, position, heads], v, **args)
        else:
            out[:, position] = oracle(write.op, x[:, position], v, **args)
    return out


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cases(width: int, n: int, sample: torch.Tensor, address: str, heads: list[int] | None = None) -> list[Write]:
    """Each op once with a shared vector and once per position (``n`` positions in the prompt).
    ``sample`` (rows of the plain activations) places the cap's bounds inside the projections'
    range, so the cap really clips."""
    positions = [0, 2, n - 1]
    cap_direction = _rand(width, seed=1)
    projections = sample @ (cap_direction / cap_direction.norm())
    lo, hi = (float(q) for q in projections.quantile(torch.tensor([0.3, 0.7])))
    k = len(heads) if heads is not None else 0
    row = (k,) if k > 1 else ()  # one row per selected head when there are several
    rows = (3, k) if heads is not None else (3,)  # per position (and per head at a head address)
    return [
        Write(address, cap_direction, op="cap", lo=lo, hi=hi, heads=heads),
        # one row per position (the same direction, scaled), capped from above at the mean over the
        # written positions: at least one is clipped
        Write(
            address,
            cap_direction.expand(*rows, width) * torch.tensor([1.0, 2.0, 0.5]).view(3, *([1] * len(rows))),
            op="cap",
            hi=float(projections[positions].mean()),
            positions=positions,
            heads=heads,
        ),
        Write(address, _rand(*row, width, seed=3), op="rescale", scale=-1.5, heads=heads),
        Write(address, _rand(*rows, width, seed=4), op="rescale", scale=2.5, positions=positions, heads=heads),
        Write(address, _rand(width, seed=5) / 16, op="norm_add", scale=0.8, heads=heads),
        Write(
            address,
            _rand(*rows, width, seed=6),
            op="norm_add",
            scale=2.0,
            max_fraction=0.3,
            positions=positions,
            heads=heads,
        ),
        Write(address, _rand(*row, width, seed=7), op="swap", target=_rand(width, seed=8), heads=heads),
        Write(
            address,
            _rand(*rows, width, seed=9),
            op="swap",
            target=_rand(*rows, width, seed=10),
            scale=0.5,
            positions=positions,
            heads=heads,
        ),
    ]


CASE_IDS = ["cap", "cap-hi-rows", "rescale", "rescale-rows", "norm_add", "norm_add-max-rows", "swap", "swap-rows"]


def _picked(write: Write, n: int) -> list[int]:
    if write.positions == "all":
        return list(range(n))
    assert isinstance(write.positions, tuple)
    return [p % n for p in write.positions]


# -- where HF keeps each family's layers, MLP down projection and attention output projection ---

LAYERS = {
    "gpt2": "transformer.h",
    "gptj": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "opt": "model.decoder.layers",
}
DOWN = {"gpt2": "mlp.c_proj", "llama": "mlp.down_proj", "gpt_neox": "mlp.dense_4h_to_h", "gemma2": "mlp.down_proj"}
ATTN = {"gpt2": "attn", "gptj": "attn", "gpt_neox": "attention", "opt": "self_attn"}
O_PROJ = {"gpt2": "c_proj", "gptj": "out_proj", "gpt_neox": "dense", "opt": "out_proj", "phi": "dense"}
HEAD_FAMILIES = ("gpt2", "llama", "gpt_neox", "qwen3", "opt")


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _layer(family: str, layer: int) -> Any:
    return _get(hf_oracle(family), LAYERS.get(family, "model.layers"))[layer]


@contextmanager
def _hooked(module: Any, edit: Callable[[torch.Tensor], torch.Tensor], *, inputs: bool) -> Iterator[None]:
    """``edit`` the module's first input (``inputs=True``) or its (first) output."""

    def pre(mod: Any, args: Any) -> Any:
        return (edit(args[0]), *args[1:])

    def post(mod: Any, args: Any, output: Any) -> Any:
        return (edit(output[0]), *output[1:]) if isinstance(output, tuple) else edit(output)

    handle = module.register_forward_pre_hook(pre) if inputs else module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _hf_logits(family: str, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_oracle(family)(tokens).logits


def _eager_against_hf(
    family: str, write: Write, module: Any, inputs: bool, view: Callable[[torch.Tensor], Any]
) -> None:
    model = eager_model(family)
    tokens = model.to_tokens(PROMPT)
    n = tokens.shape[1]
    point = str(write.address)
    got = run_with_cache(model, tokens, [point, "logits"], steering_spec=SteeringSpec([write]))
    plain = run_with_cache(model, tokens, [point, "logits"])
    picked = _picked(write, n)

    def edit(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        rows = view(out)
        rows.copy_(oracle_write(write, view(x), picked))
        return out

    with _hooked(module, edit, inputs=inputs):
        expected = _hf_logits(family, tokens)
    assert rel_diff(got["logits"], expected) <= TOL
    # the captured value is the value after the write, and untouched positions are bit-identical
    assert rel_diff(got[point], oracle_write(write, plain[point], picked)) <= TOL
    untouched = [p for p in range(n) if p not in picked]
    assert torch.equal(got[point][:, untouched], plain[point][:, untouched])
    assert not torch.allclose(got["logits"], plain["logits"], atol=1e-5)  # the op did something


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_ops_at_resid_post_equal_a_hand_written_hf_hook(family: str, case: int) -> None:
    model = eager_model(family)
    n = model.to_tokens(PROMPT).shape[1]
    sample = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0"])["resid_post.0"][0]
    write = _cases(model.info.d_model, n, sample, "resid_post.0")[case]
    _eager_against_hf(family, write, _layer(family, 0), False, lambda x: x)


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("family", sorted(DOWN))
def test_ops_at_mlp_post_equal_a_hand_written_hf_hook(family: str, case: int) -> None:
    model = eager_model(family)
    n = model.to_tokens(PROMPT).shape[1]
    sample = run_with_cache(model, model.to_tokens(PROMPT), ["mlp_post.1"])["mlp_post.1"][0]
    write = _cases(model.info.d_mlp, n, sample, "mlp_post.1")[case]
    _eager_against_hf(family, write, _get(_layer(family, 1), DOWN[family]), True, lambda x: x)


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_ops_per_head_at_attn_z_equal_a_hand_written_hf_hook(family: str, case: int) -> None:
    model = eager_model(family)
    info = model.info
    n = model.to_tokens(PROMPT).shape[1]
    heads = [0, 2] if case % 2 else [1]
    sample = run_with_cache(model, model.to_tokens(PROMPT), ["attn_z.1"])["attn_z.1"][0][:, heads[0]]
    write = _cases(info.d_head, n, sample, "attn_z.1", heads=heads)[case]
    o_proj = _get(_get(_layer(family, 1), ATTN.get(family, "self_attn")), O_PROJ.get(family, "o_proj"))
    _eager_against_hf(family, write, o_proj, True, lambda x: x.view(*x.shape[:-1], info.n_heads, info.d_head))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("op", ["norm_add", "swap", "rescale"])
def test_generated_positions_during_generation_equal_hf_generate_with_the_same_hook(family: str, op: str) -> None:
    """``positions="generated"``: the prompt's forward is untouched, every later token is written."""
    model = eager_model(family)
    tokens = model.to_tokens("Once upon a time")
    width = model.info.d_model
    extra: dict[str, Any] = {"swap": {"target": _rand(width, seed=21)}, "rescale": {"scale": -3.0}}.get(op, {})
    if op == "norm_add":
        extra = {"scale": 1.0, "max_fraction": 0.5}
    write = Write("resid_post.0", _rand(width, seed=20), op=op, positions="generated", **extra)
    completion, acts = capture_generation(
        model, tokens, ["resid_post.0"], max_tokens=6, steering_spec=SteeringSpec([write])
    )
    plain, _ = capture_generation(model, tokens, ["resid_post.0"], max_tokens=6)
    calls = {"n": 0}

    def edit(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:  # the prompt
            return x
        return oracle_write(write, x, list(range(x.shape[1])))

    hf = hf_oracle(family)
    with _hooked(_layer(family, 0), edit, inputs=False), torch.no_grad():
        out = hf.generate(tokens, max_new_tokens=6, do_sample=False)
    assert completion.token_ids == out[0, tokens.shape[1] :].tolist()
    assert completion.token_ids != plain.token_ids
    # the captured residual: the prompt's rows untouched, the generated ones written
    full = tokens[0].tolist() + completion.token_ids
    n_prompt = tokens.shape[1]
    whole = run_with_cache(model, [full], ["resid_post.0"])["resid_post.0"]
    expected = oracle_write(write, whole, list(range(n_prompt, len(full))))
    assert rel_diff(acts["resid_post.0"][:, : len(full) - 1], expected[:, : len(full) - 1]) <= TOL


async def test_eager_batches_requests_with_different_ops_without_mixing_them() -> None:
    model = eager_model("llama")
    width = model.info.d_model
    specs = [
        None,
        SteeringSpec([Write("resid_post.0", _rand(width, seed=30), op="cap", hi=0.0)]),
        SteeringSpec([Write("resid_post.0", _rand(width, seed=31), op="norm_add", scale=0.5)]),
        SteeringSpec([Write("resid_post.0", _rand(width, seed=32), op="swap", target=_rand(width, seed=33))]),
        SteeringSpec([Write("resid_post.0", _rand(width, seed=34), op="rescale", scale=3.0)]),
    ]
    prompts = [PROMPT, "A cat sat on the mat"]
    jobs = [(model.to_tokens(p)[0].tolist(), s) for p in prompts for s in specs]
    points = [Address("logits")]

    batched = await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))
    for (ids, spec), result in zip(jobs, batched, strict=True):
        alone = await model.capture(ids, points, steering_spec=spec)
        assert torch.equal(result[points[0]], alone[points[0]])
    assert len({float(r[points[0]].sum()) for r in batched[: len(specs)]}) == len(specs)


# -- vllm and vllm-static ---------------------------------------------------------------------

STATIC_POINTS = ["resid_post.2", "final_norm", "logits"]
GEN_POINTS = ["resid_post.2", "final_norm"]  # logits are not captured during generation
STATIC_WRITES = ["resid_post.1", "mlp_post.0", "attn_z.1", "attn_v.0"]


@functools.cache
def eager_twin() -> Any:
    """The eager backend on the vllm tests' llama checkpoint."""
    return sync_model(load_model(vllm_model_path("llama"), backend="eager"))


@pytest.fixture(scope="module")
def static_llama() -> Iterator[Any]:
    """One compiled vllm-static llama engine with write points for every spec below."""
    model = load_model(
        vllm_model_path("llama"), backend="vllm-static", static_points="auto", **VLLM_ENGINE_ARGS["llama"]
    )
    model.configure_static(STATIC_POINTS, static_writes=STATIC_WRITES)
    facade = sync_model(model)
    try:
        facade.warmup()
        yield facade
    finally:
        facade.shutdown()


def _ids(facade: Any, text: str = PROMPT) -> list[int]:
    ids: list[int] = facade.to_tokens(text)[0].tolist()
    return ids


def _vllm_specs(info: Any) -> dict[str, SteeringSpec]:
    d, d_mlp, d_head, kv = info.d_model, info.d_mlp, info.d_head, info.n_kv_heads
    line = _rand(d, seed=45)
    return {
        "cap": SteeringSpec([Write("resid_post.1", _rand(d, seed=40), op="cap", lo=-0.05, hi=0.05)]),
        "rescale-mlp_post-rows": SteeringSpec(
            [Write("mlp_post.0", _rand(3, d_mlp, seed=41), op="rescale", scale=-2.0, positions=[0, 2, -1])]
        ),
        "norm_add-max_fraction": SteeringSpec(
            [Write("resid_post.1", _rand(d, seed=42), op="norm_add", scale=1.0, max_fraction=0.5)]
        ),
        "swap-heads-rows": SteeringSpec(
            [
                Write(
                    "attn_z.1",
                    _rand(2, d_head, seed=43),
                    op="swap",
                    target=_rand(3, 2, d_head, seed=44),
                    heads=[1, 3],
                    positions=[0, 1, 2],
                )
            ]
        ),
        "norm_add-value-head": SteeringSpec(
            [Write("attn_v.0", _rand(d_head, seed=46), op="norm_add", scale=0.5, heads=[kv - 1])]
        ),
        "cap-value-heads": SteeringSpec([Write("attn_v.0", _rand(d_head, seed=47), op="cap", lo=-0.02, hi=0.02)]),
        "composed": SteeringSpec(
            [
                Write("resid_post.1", _rand(d, seed=48), op="add"),
                Write("resid_post.1", line, op="rescale", scale=0.5),
                Write("resid_post.1", line, op="swap", target=_rand(d, seed=49), positions=[1, 2, 3]),
                Write("resid_post.1", _rand(d, seed=50), op="cap", hi=0.0),
                Write("resid_post.1", _rand(d, seed=51), op="norm_add", scale=0.2, positions=[-1]),
            ]
        ),
        "generated": SteeringSpec(
            [Write("resid_post.1", _rand(d, seed=52), op="norm_add", scale=0.5, positions="generated")]
        ),
    }


def _close(got: dict[Address, torch.Tensor], expected: dict[Address, torch.Tensor], what: str) -> None:
    for point in expected:
        assert rel_diff(got[point], expected[point]) <= TOL, (what, point)


def test_vllm_ops_equal_the_eager_backend(vllm_engines: Any) -> None:
    model = vllm_engines("llama")
    ids = _ids(model)
    plain = model.capture(ids, ["logits"])
    for name, spec in _vllm_specs(model.info).items():
        got = model.capture(ids, STATIC_POINTS, steering_spec=spec)
        _close(got, eager_twin().capture(ids, STATIC_POINTS, steering_spec=spec), name)
        if name != "generated":
            assert not torch.allclose(got[Address("logits")], plain[Address("logits")], atol=1e-5), name
        completion, acts = model.capture_generation(ids, GEN_POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True)
        ref_completion, ref_acts = eager_twin().capture_generation(
            ids, GEN_POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True
        )
        assert completion.token_ids == ref_completion.token_ids, name
        _close(acts, ref_acts, name)


def test_vllm_static_ops_equal_the_vllm_backend_without_recompiling(static_llama: Any, vllm_engines: Any) -> None:
    static, dynamic = static_llama, vllm_engines("llama")
    (before,) = static.run(static.model.worker_stats)
    assert before["dynamo_compiled_graphs"] >= 1 and before["dynamo_unique_graphs"] >= 1
    for text in (PROMPT, "A cat sat on the mat and looked at the dog"):
        ids = _ids(static, text)
        for name, spec in _vllm_specs(static.info).items():
            got = static.capture(ids, STATIC_POINTS, steering_spec=spec)
            _close(got, dynamic.capture(ids, STATIC_POINTS, steering_spec=spec), name)
            completion, acts = static.capture_generation(
                ids, GEN_POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True
            )
            ref, ref_acts = dynamic.capture_generation(
                ids, GEN_POINTS, max_tokens=4, steering_spec=spec, ignore_eos=True
            )
            assert completion.token_ids == ref.token_ids, name
            _close(acts, ref_acts, name)
    (after,) = static.run(static.model.worker_stats)
    counters = [k for k in before if k.startswith(("vllm_", "dynamo_unique", "dynamo_compiled"))]
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}
    assert after["held_slots"] == 0


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_requests_with_different_ops_batched_together_do_not_touch_each_other(
    backend: str, static_llama: Any, vllm_engines: Any
) -> None:
    facade = static_llama if backend == "vllm-static" else vllm_engines("llama")
    model = facade.model
    specs: list[SteeringSpec | None] = [None, *_vllm_specs(model.info).values()]
    prompts = [PROMPT, "Once upon a time there was"]
    jobs = [(_ids(facade, p), s) for p in prompts for s in specs]
    points = [Address("resid_post", 2), Address("logits")]

    async def together() -> list[Any]:
        return await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))

    batched = facade.run(together)
    for (ids, spec), result in zip(jobs, batched, strict=True):
        alone = facade.capture(ids, points, steering_spec=spec)
        _close(result, alone, repr(spec))


def test_sequences_outside_the_static_pipeline_are_refused_and_served_by_vllm(
    static_llama: Any, vllm_engines: Any
) -> None:
    d = static_llama.info.d_model
    spec = SteeringSpec(
        [
            Write("resid_post.1", _rand(d, seed=60), op="swap", target=_rand(d, seed=61)),
            Write("resid_post.1", _rand(d, seed=62), op="swap", target=_rand(d, seed=63)),
        ]
    )
    ids = _ids(static_llama)
    with pytest.raises(InvalidSteering, match="use the vllm or eager backend"):
        static_llama.capture(ids, ["logits"], steering_spec=spec)
    got = vllm_engines("llama").capture(ids, ["logits"], steering_spec=spec)
    _close(got, eager_twin().capture(ids, ["logits"], steering_spec=spec), "two swaps")
    assert static_llama.generate(ids, max_tokens=2).token_ids  # still serving


@pytest.mark.parametrize("op", ["ablate", "cap", "rescale", "norm_add", "swap"])
def test_ops_needing_the_whole_row_are_refused_at_split_kinds_under_tensor_parallelism(op: str) -> None:
    """Under TP each rank holds part of ``mlp_post``: a projection or a norm over one part is not
    the op, so the front end refuses it (no engine is started here)."""
    model = load_model(vllm_model_path("llama"), backend="vllm")
    d_mlp, d_model = 384, 128

    def write(address: str, width: int, op: str) -> Write:
        extra: dict[str, Any] = {"cap": {"hi": 0.0}, "swap": {"target": torch.ones(width)}}.get(op, {})
        return Write(address, _rand(width, seed=70), op=op, **extra)

    model._payload("r", [], [write("mlp_post.1", d_mlp, op)], 4, 4)  # TP=1: served
    model.tp_size = 2
    with pytest.raises(InvalidSteering, match=f"{op} at mlp_post.1 is not available under tensor parallelism"):
        model._payload("r", [], [write("mlp_post.1", d_mlp, op)], 4, 4)
    model._payload("r", [], [write("mlp_post.1", d_mlp, "add"), write("resid_post.1", d_model, op)], 4, 4)


# -- over HTTP --------------------------------------------------------------------------------


def test_the_server_takes_every_op_and_answers_bad_values_with_a_typed_4xx() -> None:
    import base64

    import numpy as np
    from fastapi.testclient import TestClient

    from interp_engine.server import create_app
    from interp_testkit.suite import tiny_model_path

    direct = sync_model(eager_model("gpt2"))
    d, d_head = direct.info.d_model, direct.info.d_head
    ids = _ids(direct)

    def encoded(value: torch.Tensor) -> dict[str, Any]:
        raw = value.float().contiguous().numpy().astype("<f4").tobytes()
        return {"dtype": "float32", "shape": list(value.shape), "data": base64.b64encode(raw).decode()}

    good = [
        Write("resid_post.0", _rand(d, seed=80), op="cap", lo=-0.3, hi=0.2),
        Write("resid_post.1", _rand(2, d, seed=81), op="rescale", scale=3.0, positions=[0, -1]),
        Write("mlp_post.0", _rand(direct.info.d_mlp, seed=82), op="norm_add", scale=0.5, max_fraction=0.2),
        Write(
            "attn_z.1",
            _rand(d_head, seed=83),
            op="swap",
            target=_rand(3, 1, d_head, seed=84),
            heads=[2],
            positions=[0, 1, 2],
        ),
    ]
    bad: dict[str, dict[str, Any]] = {
        "unknown op": {"address": "resid_post.0", "vector": [1.0] * d, "op": "clip"},
        "lo on an add": {"address": "resid_post.0", "vector": [1.0] * d, "lo": 0.0},
        "cap without bounds": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap"},
        "cap lo > hi": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap", "lo": 1.0, "hi": 0.0},
        "cap with scale": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap", "hi": 1.0, "scale": 2.0},
        "string hi": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap", "hi": "x"},
        "infinite hi": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap", "hi": float("inf")},
        "nan lo": {"address": "resid_post.0", "vector": [1.0] * d, "op": "cap", "lo": float("nan")},
        "zero direction": {"address": "resid_post.0", "vector": [0.0] * d, "op": "rescale"},
        "swap without target": {"address": "resid_post.0", "vector": [1.0] * d, "op": "swap"},
        "swap zero target": {"address": "resid_post.0", "vector": [1.0] * d, "op": "swap", "target": [0.0] * d},
        "swap target width": {"address": "resid_post.0", "vector": [1.0] * d, "op": "swap", "target": [1.0] * 3},
        "swap target rows": {
            "address": "resid_post.0",
            "vector": [1.0] * d,
            "op": "swap",
            "target": encoded(torch.ones(5, d)),
            "positions": [0, 1],
        },
        "ragged target": {"address": "resid_post.0", "vector": [1.0] * d, "op": "swap", "target": [[1.0], [1.0, 2.0]]},
        "negative max_fraction": {"address": "resid_post.0", "vector": [1.0] * d, "op": "norm_add", "max_fraction": -1},
        "model-wide width": {"address": "mlp_post.0", "vector": [1.0] * d, "op": "swap", "target": [1.0] * d},
    }
    app = create_app(tiny_model_path("gpt2"), backend="eager")
    with TestClient(app) as client:
        for write in good:
            data = write.to_dict()
            if write.target is not None:
                data["target"] = encoded(write.target)  # an encoded tensor, like the vector may be
            body = {"token_ids": ids, "points": ["logits"], "steering": {"writes": [data]}}
            response = client.post("/v1/capture", json=body)
            assert response.status_code == 200, response.text
            got = response.json()["activations"]["logits"]
            raw = torch.from_numpy(np.frombuffer(base64.b64decode(got["data"]), dtype="<f4").copy()).reshape(
                got["shape"]
            )
            expected = direct.capture(ids, ["logits"], steering_spec=SteeringSpec([write]))[Address("logits")]
            assert rel_diff(raw, expected) <= TOL, write.op
        for name, write_body in bad.items():
            body = {"token_ids": ids, "points": ["logits"], "steering": {"writes": [write_body]}}
            text = json.dumps(body)  # NaN and Infinity as Python's json writes them
            response = client.post("/v1/capture", content=text, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
            error = response.json()
            assert error.get("error") and error.get("message"), (name, error)
