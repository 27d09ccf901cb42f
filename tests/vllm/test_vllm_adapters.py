"""LoRA adapters per request on the vllm backend (vLLM's LoRA, ``enable_lora``), on the module's
LoRA engines (the tiny Llama at TP=1 and TP=2, the tiny Qwen 2; shut down when the module ends):
every kind under an adapter equals the eager backend's PEFT run (itself equal to HF + PEFT and the
merged model: tests/eager/test_eager_adapters.py) and HF + PEFT's hidden states, on Llama and on
Qwen 2 with adapters on the attention and MLP projections; TP=2 equals TP=1 under adapters, alone,
chunked and mixed in one batch; 16 concurrent requests mixing two adapters and the base model each
equal their solo runs; bad adapters are typed errors before any compute."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    InvalidAdapter,
    InvalidOption,
    LensRequest,
    SteeringSpec,
    UnknownAdapter,
    UnsupportedArchitecture,
    UnsupportedOperation,
    Write,
    capture_generation,
    load_model,
    run_with_cache,
    sync_model,
)
from interp_testkit.suite import LONG, PROMPT, rel_diff, tiny_model_path, vllm_model_path

from ..support.adapters import TARGETS, Lora, make_lora
from ..support.engines import EnginePool, assert_no_leaks
from ..support.saes import tiny_sae

TOL = 1e-4
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4}
"""The engine arguments of the module's LoRA engines (the tiny Llama's, at TP=1 and TP=2, and the
tiny Qwen 2's): no other module starts an engine with them."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module", autouse=True)
def _release_lora_engines(engine_pool: EnginePool) -> Iterator[None]:
    """The LoRA engines serve this module only: shut down when it ends, so that they hold no
    memory while later modules start their own."""
    yield
    engine_pool.release(keep=lambda runner, args: not args.get("enable_lora"))


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Lora]:
    root = tmp_path_factory.mktemp("vllm-loras")
    base = vllm_model_path("llama")
    return {
        "ft": make_lora(base, root / "ft", "llama", seed=1, rank=4),
        "attn": make_lora(base, root / "attn", "llama", seed=2, rank=8, targets=ATTENTION),
        "deep": make_lora(base, root / "deep", "llama", seed=3, rank=16),
        "foreign": make_lora(tiny_model_path("llama"), root / "foreign", "llama", seed=4),
    }


def _register(model: Any, loras: dict[str, Lora]) -> None:
    for name in ("ft", "attn"):
        if name not in model.adapters:
            model.load_adapter(name, loras[name].adapter)


@pytest.fixture(scope="module")
def lora_engine(vllm_engines: Any, loras: dict[str, Lora]) -> Any:
    facade = vllm_engines("llama", **LORA_ENGINE)
    _register(facade, loras)
    return facade


@pytest.fixture(scope="module")
def twin(loras: dict[str, Lora]) -> Iterator[Any]:
    """The eager backend on the same checkpoint with the same adapters (PEFT)."""
    facade = sync_model(load_model(vllm_model_path("llama"), backend="eager"))
    _register(facade, loras)
    yield facade
    facade.shutdown()


def _points(model: Any) -> list[str]:
    out = []
    for kind, info in model.model.points().items():
        layers = range(model.info.n_layers) if info.per_layer else [None]
        out += [kind if layer is None else f"{kind}.{layer}" for layer in layers]
    return out


def _assert_every_kind_equals_peft(engine: Any, twin: Any, adapter: str, base: pathlib.Path, lora: Lora) -> None:
    """Every point of ``engine`` under ``adapter`` equals the eager ``twin``'s (PEFT) and HF +
    PEFT's hidden states and logits, and the adapter moves more than a third of the points."""
    tokens = engine.to_tokens(PROMPT)
    points = _points(engine)
    got = run_with_cache(engine, tokens, points, adapter=adapter)
    want = run_with_cache(twin, tokens, points, adapter=adapter)
    plain = run_with_cache(engine, tokens, points)
    moved = 0
    for point in points:
        assert rel_diff(got[point], want[point]) <= TOL, point
        moved += not torch.allclose(got[point], plain[point], atol=1e-5)
    assert moved > len(points) // 3, "the adapter changed too few points to tell"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    with torch.no_grad():
        out = PeftModel.from_pretrained(hf, lora.adapter).eval()(tokens, output_hidden_states=True)
    for layer in range(engine.info.n_layers - 1):
        assert rel_diff(got[f"resid_post.{layer}"], out.hidden_states[layer + 1]) <= TOL, layer
    assert rel_diff(got["logits"], out.logits) <= TOL


@pytest.mark.parametrize("adapter", ["ft", "attn"])
def test_every_kind_under_an_adapter_equals_peft(
    adapter: str, lora_engine: Any, twin: Any, loras: dict[str, Lora]
) -> None:
    _assert_every_kind_equals_peft(lora_engine, twin, adapter, vllm_model_path("llama"), loras[adapter])


@pytest.fixture(scope="module")
def qwen(vllm_engines: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Lora]]:
    """The tiny Qwen 2 (4 heads of 32, 2 KV heads, biased q/k/v) on a LoRA engine and on the eager
    backend, both with a rank-8 adapter on every attention and MLP projection."""
    base = vllm_model_path("qwen2")
    lora = make_lora(base, tmp_path_factory.mktemp("qwen-lora"), "qwen2", seed=5, rank=8)
    engine = vllm_engines("qwen2", **LORA_ENGINE)
    if "qwen-ft" not in engine.adapters:
        engine.load_adapter("qwen-ft", lora.adapter)
    eager = sync_model(load_model(base, backend="eager", adapters={"qwen-ft": str(lora.adapter)}))
    yield engine, eager, lora
    eager.shutdown()


def test_qwen2_every_kind_under_an_adapter_equals_peft(qwen: tuple[Any, Any, Lora]) -> None:
    engine, eager, lora = qwen
    assert set(engine.adapters["qwen-ft"].targets) == set(TARGETS["qwen2"])  # attention and MLP
    _assert_every_kind_equals_peft(engine, eager, "qwen-ft", vllm_model_path("qwen2"), lora)
    # and a generation with the lens under it, mixed in one batch with base-model rows
    ids = engine.to_tokens(PROMPT)[0].tolist()
    lens = LensRequest(layers=[0, 2], top_k=3)
    got, got_cache = capture_generation(engine, ids, ["resid_post.1"], max_tokens=6, lens=lens, adapter="qwen-ft")
    want, want_cache = capture_generation(eager, ids, ["resid_post.1"], max_tokens=6, lens=lens, adapter="qwen-ft")
    assert got.token_ids == want.token_ids
    assert rel_diff(got_cache["resid_post.1"], want_cache["resid_post.1"]) <= TOL
    assert torch.equal(got_cache.lens.ids, want_cache.lens.ids)
    rows = [ids, ids[:7], ids]
    mixed = run_with_cache(engine, rows, ["resid_post.2"], adapter=["qwen-ft", None, None])
    alone = run_with_cache(eager, rows, ["resid_post.2"], adapter=["qwen-ft", None, None])
    assert rel_diff(mixed["resid_post.2"], alone["resid_post.2"]) <= TOL
    assert not torch.allclose(mixed["resid_post.2"][0], mixed["resid_post.2"][2], atol=1e-4)
    assert_no_leaks(engine)


def test_generation_lens_and_steering_under_an_adapter(lora_engine: Any, twin: Any) -> None:
    tokens = lora_engine.to_tokens(PROMPT)
    spec = SteeringSpec([Write(Address("resid_post", 0), torch.ones(lora_engine.info.d_model), op="add", scale=2.0)])
    lens = LensRequest(layers=[0, 2], top_k=3)
    got, got_cache = capture_generation(
        lora_engine, tokens, ["resid_post.1"], max_tokens=6, steering_spec=spec, lens=lens, adapter="ft"
    )
    want, want_cache = capture_generation(
        twin, tokens, ["resid_post.1"], max_tokens=6, steering_spec=spec, lens=lens, adapter="ft"
    )
    assert got.token_ids == want.token_ids
    assert rel_diff(got_cache["resid_post.1"], want_cache["resid_post.1"]) <= TOL
    assert torch.equal(got_cache.lens.ids, want_cache.lens.ids)
    steps = list(lora_engine.stream(tokens[0].tolist(), max_tokens=6, n_logprobs=2, adapter="attn"))
    assert [s.token_id for s in steps] == twin.generate(tokens[0].tolist(), max_tokens=6, adapter="attn").token_ids
    assert_no_leaks(lora_engine)


def test_sae_readouts_under_an_adapter_equal_the_eager_backend(lora_engine: Any, twin: Any) -> None:
    """The readout is encoded inside vLLM's worker from the adapted activations."""
    sae = tiny_sae(seed=3, hook="blocks.1.hook_resid_post")
    lora_engine.attach_sae("lora_res", sae)
    twin.attach_sae("lora_res", sae)
    try:
        ids = lora_engine.to_tokens(PROMPT)[0].tolist()
        spec = Features("lora_res", top_k=4)
        got = lora_engine.capture(ids, [spec], adapter="ft")[spec]
        want = twin.capture(ids, [spec], adapter="ft")[spec]
        base = lora_engine.capture(ids, [spec])[spec]
        assert torch.equal(got.ids, want.ids)
        assert rel_diff(got.values, want.values) <= TOL
        assert not torch.equal(got.values, base.values)
    finally:
        lora_engine.detach_sae("lora_res")
        twin.detach_sae("lora_res")


def test_sixteen_concurrent_requests_mixing_adapters_equal_their_solo_runs(lora_engine: Any) -> None:
    """Captures, generations and streams under ``ft``, ``attn`` or the base model, all at once on
    the same prompts (so vLLM's prefix cache sees the same tokens under different adapters)."""
    model = lora_engine.model
    ids = lora_engine.to_tokens(PROMPT)[0].tolist()
    choices = ["ft", None, "attn", "ft"] * 4

    async def one(i: int, adapter: str | None) -> Any:
        prompt = ids[: 6 + i % 3]
        if i % 3 == 0:
            return (await model.generate(prompt, max_tokens=4, adapter=adapter)).token_ids
        if i % 3 == 1:
            return [s.token_id async for s in model.stream(prompt, max_tokens=4, adapter=adapter)]
        return (await model.capture(prompt, ["resid_post.2", "attn_z.1"], adapter=adapter))[Address("resid_post", 2)]

    async def together() -> list[Any]:
        return await asyncio.gather(*(one(i, a) for i, a in enumerate(choices)))

    results = lora_engine.run(together)
    for i, adapter in enumerate(choices):
        alone = lora_engine.run(lambda i=i, adapter=adapter: one(i, adapter))  # type: ignore[misc]
        if isinstance(alone, torch.Tensor):
            assert rel_diff(results[i], alone) <= TOL, i
        else:
            assert results[i] == alone, i
    assert not torch.allclose(results[2], results[5]) and not torch.allclose(results[2], results[8])  # attn, base, ft
    assert_no_leaks(lora_engine)


def test_tp2_under_adapters_equals_tp1(vllm_engines: Any, lora_engine: Any, loras: dict[str, Lora]) -> None:
    """The TP=2 LoRA engine (each worker holds a shard of every LoRA's A or B) against the TP=1
    one: every kind under each adapter, a prompt prefilled in 64-token chunks under an adapter,
    and one batch mixing both adapters and the base model."""
    two = vllm_engines("llama", tensor_parallel_size=2, **LORA_ENGINE)
    assert two.model.tp_size == 2, "the engine did not start two tensor-parallel workers"
    _register(two, loras)
    ids = lora_engine.to_tokens(PROMPT)[0].tolist()
    points = [Address.parse(point) for point in _points(lora_engine)]
    for adapter in ("ft", "attn"):
        got = two.capture(ids, points, adapter=adapter)
        want = lora_engine.capture(ids, points, adapter=adapter)
        for point in points:
            assert got[point].shape == want[point].shape, point
            assert rel_diff(got[point], want[point]) <= TOL, (adapter, point)
    deep = ["resid_post.2", "mlp_post.1", "attn_pattern.0", "logits"]
    got = two.capture(LONG, deep, adapter="ft")
    want = lora_engine.capture(LONG, deep, adapter="ft")
    for point in got:
        assert rel_diff(got[point], want[point]) <= TOL, point
    rows = [ids, ids, ids[:8], ids]
    adapters = ["ft", None, "attn", "attn"]
    mixed = run_with_cache(two, rows, ["resid_post.1", "mlp_post.2"], adapter=adapters)
    alone = run_with_cache(lora_engine, rows, ["resid_post.1", "mlp_post.2"], adapter=adapters)
    for point in ("resid_post.1", "mlp_post.2"):
        assert rel_diff(mixed[point], alone[point]) <= TOL, point
    assert not torch.allclose(mixed["resid_post.1"][0], mixed["resid_post.1"][1], atol=1e-4)
    assert not torch.allclose(mixed["resid_post.1"][0], mixed["resid_post.1"][3], atol=1e-4)
    assert (
        two.generate(ids, max_tokens=6, adapter="attn").token_ids
        == lora_engine.generate(ids, max_tokens=6, adapter="attn").token_ids
    )
    assert_no_leaks(two)


def test_bad_adapters_are_typed_errors_before_any_compute(
    lora_engine: Any, loras: dict[str, Lora], tmp_path: pathlib.Path
) -> None:
    ids = lora_engine.to_tokens(PROMPT)[0].tolist()
    with pytest.raises(UnknownAdapter, match="registered: attn, ft"):
        lora_engine.capture(ids, ["resid_post.0"], adapter="nope")
    with pytest.raises(InvalidAdapter, match="max_lora_rank=8"):
        lora_engine.load_adapter("deep", loras["deep"].adapter)
    with pytest.raises(InvalidAdapter, match="another model"):
        lora_engine.generate(ids, max_tokens=2, adapter=str(loras["foreign"].adapter))
    assert set(lora_engine.adapters) == {"ft", "attn"}
    # a LoRA on lm_head: the lens decodes with the base W_U in the workers, so it is refused
    head = make_lora(vllm_model_path("llama"), tmp_path / "head", "llama", seed=6, targets=("lm_head",))
    lora_engine.load_adapter("head", head.adapter)
    lens = LensRequest(layers=[1], top_k=2)
    with pytest.raises(UnsupportedOperation, match=r"'head' adapts the unembedding \(lm_head\).*logit lens"):
        list(lora_engine.stream(ids, max_tokens=2, lens=lens, adapter="head"))
    base = lora_engine.capture(ids, ["resid_post.0"])[Address("resid_post", 0)]  # the engine keeps serving
    assert base.shape == (len(ids), lora_engine.info.d_model)
    assert_no_leaks(lora_engine)


def test_engines_without_lora_refuse_adapters(vllm_engines: Any, loras: dict[str, Lora]) -> None:
    plain = vllm_engines("llama")  # the session's shared engine, started without enable_lora
    with pytest.raises(InvalidAdapter, match="enable_lora=True"):
        plain.capture([1, 2, 3], ["resid_post.0"], adapter=str(loras["ft"].adapter))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel"):  # vLLM's GPT-2 has no LoRA layers
        load_model(vllm_model_path("gpt2"), backend="vllm", enable_lora=True)
    with pytest.raises(InvalidOption, match="backend='vllm'"):
        load_model(vllm_model_path("llama"), backend="vllm-static", enable_lora=True)
    static = load_model(vllm_model_path("llama"), backend="vllm-static")  # never started
    with pytest.raises(InvalidAdapter, match="backend='vllm'"):
        static.load_adapter("ft", loras["ft"].adapter)
