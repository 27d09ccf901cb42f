"""Steering on the eager backend, checked against hand-written hooks on the plain HF model.

The oracle hooks below are deliberately naive (one forward hook each, written for the test),
so they share no code with the backend's plan machinery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from interp_engine import Address, SteeringSpec, Write, capture_generation, run_with_cache, sync_model
from interp_testkit.suite import PROMPT, hf_oracle, rel_diff

from ..support.engines import eager_model

TOL = 1e-4
FAMILIES = ("gpt2", "llama", "gpt_neox", "gemma2", "opt")

# where each family's layer list, MLP down-projection and block outputs are, for the oracle
LAYERS = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "gpt_neox": "gpt_neox.layers",
    "gemma2": "model.layers",
    "opt": "model.decoder.layers",
}
DOWN = {"gpt2": "mlp.c_proj", "llama": "mlp.down_proj", "gpt_neox": "mlp.dense_4h_to_h", "gemma2": "mlp.down_proj"}


def _module(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _direction(width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, generator=gen)


@contextmanager
def _hook_output(module: Any, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    def hook(mod: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (edit(output[0]), *output[1:])
        return edit(output)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _hook_input(module: Any, edit: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    def hook(mod: Any, args: Any) -> Any:
        return (edit(args[0]), *args[1:])

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _hf_logits(family: str, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_oracle(family)(tokens).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("positions", ["all", [1, 3], [-1]])
def test_add_at_resid_post_matches_an_oracle_hook(family: str, positions: Any) -> None:
    model = eager_model(family)
    tokens = model.to_tokens(PROMPT)
    n = tokens.shape[1]
    vector = _direction(model.info.d_model, 1)
    spec = SteeringSpec([Write(Address("resid_post", 0), vector, op="add", scale=3.0, positions=positions)])
    cache = run_with_cache(model, tokens, ["resid_post.0", "logits"], steering_spec=spec)
    plain = run_with_cache(model, tokens, ["resid_post.0"])

    picked = list(range(n)) if positions == "all" else [p % n for p in positions]

    def add(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, picked] += 3.0 * vector
        return x

    with _hook_output(_module(hf_oracle(family), LAYERS[family])[0], add):
        expected = _hf_logits(family, tokens)
    assert rel_diff(cache["logits"], expected) <= TOL
    # the captured value at the written address is the value after the write
    delta = cache["resid_post.0"] - plain["resid_post.0"]
    assert torch.allclose(delta[0, picked], (3.0 * vector).expand(len(picked), -1), atol=1e-4)
    untouched = [p for p in range(n) if p not in picked]
    assert not delta[0, untouched].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_patching_with_set_reproduces_the_clean_run(family: str) -> None:
    model = eager_model(family)
    sync = sync_model(model)
    clean = model.to_tokens("The cat sat on the mat and")[0].tolist()
    corrupt = list(clean)
    corrupt[2] = model.to_tokens(" dog")[0].tolist()[-1]  # same length, one token swapped
    assert corrupt != clean
    layer = Address("resid_post", 1)
    clean_acts = sync.capture(clean, [layer, "logits"])
    # patch the whole residual at layer 1: everything downstream is the clean run
    spec = SteeringSpec([Write(layer, clean_acts[layer], op="set", positions="all")])
    patched = sync.capture(corrupt, ["logits"], steering_spec=spec)
    assert rel_diff(patched[Address("logits")], clean_acts[Address("logits")]) <= TOL
    # patching one position changes only what attends to it, and that position's residual is clean
    last = len(clean) - 1
    one = SteeringSpec([Write(layer, clean_acts[layer][last], op="set", positions=[last])])
    partial = sync.capture(corrupt, [layer], steering_spec=one)[layer]
    corrupt_acts = sync.capture(corrupt, [layer])[layer]
    assert torch.equal(partial[last], clean_acts[layer][last])
    assert torch.equal(partial[:last], corrupt_acts[:last])


@pytest.mark.parametrize("family", FAMILIES)
def test_ablate_projects_out_a_direction(family: str) -> None:
    model = eager_model(family)
    tokens = model.to_tokens(PROMPT)
    direction = _direction(model.info.d_model, 2)
    unit = direction / direction.norm()
    spec = SteeringSpec([Write(Address("resid_post", 1), direction, op="ablate")])
    cache = run_with_cache(model, tokens, ["resid_post.1", "logits"], steering_spec=spec)
    assert float((cache["resid_post.1"] @ unit).abs().max()) <= 1e-4

    def ablate(x: torch.Tensor) -> torch.Tensor:
        return x - (x @ unit).unsqueeze(-1) * unit

    with _hook_output(_module(hf_oracle(family), LAYERS[family])[1], ablate):
        expected = _hf_logits(family, tokens)
    assert rel_diff(cache["logits"], expected) <= TOL


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gemma2"])
def test_writes_inside_the_block(family: str) -> None:
    """mlp_post (neurons), attn_out and resid_mid, each against an oracle hook."""
    model = eager_model(family)
    tokens = model.to_tokens(PROMPT)
    hf = hf_oracle(family)
    layer = _module(hf, LAYERS[family])[1]
    neurons = _direction(model.info.d_mlp, 3)
    spec = SteeringSpec([Write("mlp_post.1", neurons, op="add", scale=0.5)])
    got = run_with_cache(model, tokens, ["logits"], steering_spec=spec)["logits"]
    with _hook_input(_module(layer, DOWN[family]), lambda x: x + 0.5 * neurons):
        assert rel_diff(got, _hf_logits(family, tokens)) <= TOL

    # adding v to attn_out (on sandwich-norm families: attn_out_post, the post-norm's output;
    # attn_out is before the norm there) or to resid_mid adds v to the residual after attention
    vector = _direction(model.info.d_model, 4)
    base = run_with_cache(model, tokens, ["resid_mid.1", "resid_post.1"])
    for kind in ("attn_out_post" if family == "gemma2" else "attn_out", "resid_mid"):
        spec = SteeringSpec([Write(Address(kind, 1), vector, op="add")])
        cache = run_with_cache(model, tokens, ["resid_mid.1", "logits"], steering_spec=spec)
        assert rel_diff(cache["resid_mid.1"], base["resid_mid.1"] + vector) <= TOL, kind
        attn_path = {
            "gpt2": "attn",
            "llama": "self_attn",
            "gpt_neox": "attention",
            "gemma2": "post_attention_layernorm",
        }
        with _hook_output(_module(layer, attn_path[family]), lambda x: x + vector):
            assert rel_diff(cache["logits"], _hf_logits(family, tokens)) <= TOL, kind


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_steered_greedy_generation_matches_hf_generate_with_the_same_hook(family: str) -> None:
    model = eager_model(family)
    tokens = model.to_tokens("Once upon a time")
    vector = _direction(model.info.d_model, 5)
    spec = SteeringSpec([Write("resid_post.0", vector, op="add", scale=4.0)])
    completion = sync_model(model).generate(tokens[0].tolist(), max_tokens=8, steering_spec=spec)
    plain = sync_model(model).generate(tokens[0].tolist(), max_tokens=8)
    hf = hf_oracle(family)
    with _hook_output(_module(hf, LAYERS[family])[0], lambda x: x + 4.0 * vector), torch.no_grad():
        expected = hf.generate(tokens, max_new_tokens=8, do_sample=False)[0, tokens.shape[1] :].tolist()
    assert completion.token_ids == expected
    assert completion.token_ids != plain.token_ids


def test_generated_and_prompt_positions_during_generation() -> None:
    model = eager_model("llama")
    tokens = model.to_tokens("Once upon a time")
    n_prompt = tokens.shape[1]
    vector = _direction(model.info.d_model, 6)
    point = Address("resid_post", 0)
    plain_completion, plain = capture_generation(model, tokens, [point], max_tokens=6, ignore_eos=True)
    for positions in ("generated", "prompt"):
        spec = SteeringSpec([Write(point, vector, op="add", scale=2.0, positions=positions)])
        completion, steered = capture_generation(
            model, tokens, [point], max_tokens=6, steering_spec=spec, ignore_eos=True
        )
        full = tokens[0].tolist() + completion.token_ids
        # one forward over the final sequence with the same positions steered explicitly
        picked = list(range(n_prompt, len(full))) if positions == "generated" else list(range(n_prompt))
        explicit = SteeringSpec([Write(point, vector, op="add", scale=2.0, positions=picked)])
        whole = run_with_cache(model, [full], [point], steering_spec=explicit)
        assert rel_diff(steered[point], whole[point]) <= TOL, positions
        if positions == "generated":
            # the prompt is untouched, and so is the first generated token (chosen from the prompt)
            assert torch.equal(steered[point][0, :n_prompt], plain[point][0, :n_prompt])
            assert completion.token_ids[0] == plain_completion.token_ids[0]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
async def test_concurrent_requests_with_different_specs_equal_their_solo_runs(family: str) -> None:
    model = eager_model(family)
    prompts = ["Hello there", PROMPT, "A cat sat on the mat", "Once upon a time"]
    specs: list[SteeringSpec | None] = [None]
    for seed, (kind, op) in enumerate([("resid_post", "add"), ("mlp_post", "add"), ("resid_mid", "ablate")]):
        width = model.info.d_mlp if kind == "mlp_post" else model.info.d_model
        specs.append(SteeringSpec([Write(Address(kind, 1), _direction(width, 10 + seed), op=op, scale=2.0)]))
    points = [Address("resid_post", -1), Address("logits")]
    jobs = [(model.to_tokens(p)[0].tolist(), s) for p in prompts for s in specs]
    together = await asyncio.gather(*(model.capture(ids, points, steering_spec=s) for ids, s in jobs))
    for (ids, spec), result in zip(jobs, together, strict=True):
        alone = await model.capture(ids, points, steering_spec=spec)
        for point in points:
            assert torch.equal(result[point], alone[point])
    # and the specs did something: steered results differ from the unsteered one
    assert not torch.equal(together[1][points[1]], together[0][points[1]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_write_that_overflows_the_logits_is_a_typed_error(temperature: float) -> None:
    from interp_engine import InvalidSteering

    model = sync_model(eager_model("llama"))
    ids = model.to_tokens(PROMPT)[0].tolist()
    huge = torch.full((model.info.d_model,), 3e38)
    spec = SteeringSpec([Write(Address("final_norm"), huge, op="add")])
    with pytest.raises(InvalidSteering, match="NaN or infinite logits"):
        model.generate(ids, max_tokens=2, steering_spec=spec, temperature=temperature, seed=0)
    # the model keeps serving
    assert len(model.generate(ids, max_tokens=2).token_ids) == 2
