"""Shared fixtures: tiny local models for every supported family, built once and reused.

Models are random-weight HF checkpoints with a tokenizer trained locally (``interp_testkit``, the
dev-only package in ``tests/testkit``: no backend is needed to build them), written under
``.cache/test-models`` in the repository so a second run reuses them. Nothing is downloaded. Each
family's eager model and its HF oracle are loaded once per session.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The test suite's third-party backend (tests/toy_backend) serves "toy" only where this is set:
# for this session and the subprocesses it starts, never for a user of the dev install.
os.environ["INTERP_TOY_BACKEND"] = "1"
MODELS = ROOT / ".cache" / "test-models"

REQUIRED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt_neox", "opt", "phi")
EXTRA_FAMILIES = ("gemma3_text", "gptj", "olmo2", "phi3", "stablelm")
ALL_FAMILIES = REQUIRED_FAMILIES + EXTRA_FAMILIES
SWEEP_DENSE = (
    "apertus",
    "arcee",
    "biogpt",
    "bitnet",
    "bloom",
    "codegen",
    "cohere",
    "cohere2",
    "ernie4_5",
    "exaone4",
    "falcon",
    "glm",
    "glm4",
    "gpt_bigcode",
    "gpt_neo",
    "granite",
    "helium",
    "hunyuan_v1_dense",
    "ministral",
    "mpt",
    "nemotron",
    "olmo",
    "olmo3",
    "persimmon",
    "seed_oss",
    "smollm3",
    "starcoder2",
    "xglm",
)
SWEEP_MOE = (
    "ernie4_5_moe",
    "flex_olmo",
    "gpt_oss",
    "hunyuan_v1_moe",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
)
SWEEP_FAMILIES = SWEEP_DENSE + SWEEP_MOE
"""Model types the eager breadth sweep (tests/test_eager_families.py) verifies against HF."""
REFUSED_VARIANTS: dict[str, dict[str, Any]] = {
    # Bloom adding the normalised input, not the residual stream, back after each sublayer
    "bloom": {"apply_residual_connection_post_layernorm": True},
}
"""Config variants the eager backend refuses with ``UnsupportedArchitecture`` (the sweep checks why):
every model type's tiny default config resolves."""


@functools.cache
def tiny_model_path(family: str) -> pathlib.Path:
    from interp_testkit import build_tiny_model

    return build_tiny_model(family, MODELS / family)


def assert_no_leaks(facade: Any) -> None:
    """Every request of a vLLM model (behind a sync facade) is finished in the engine and its
    state gone from every worker, within 10 s."""
    engine = facade.model._engine
    deadline = time.monotonic() + 10
    stats: list[dict[str, int]] = []
    while time.monotonic() < deadline:
        stats = facade.worker_stats()
        if engine.get_num_unfinished_requests() == 0 and all(s["live_requests"] == 0 for s in stats):
            return
        time.sleep(0.2)
    raise AssertionError(f"requests left behind: {engine.get_num_unfinished_requests()} unfinished, {stats}")


@pytest.fixture(scope="module")
def direct() -> Iterator[Any]:
    """``interp:tiny`` on eager behind a sync facade, one per module (to compare a served or
    command-line answer with the model's own); a module may define its own ``direct``."""
    from interp_engine import load_model, sync_model

    model = sync_model(load_model("interp:tiny", backend="eager"))
    yield model
    model.shutdown()


@functools.cache
def eager_model(family: str) -> Any:
    """The session's eager model for ``family`` (loaded through the core's ``load_model``)."""
    from interp_engine import load_model

    return load_model(tiny_model_path(family), backend="eager")


@functools.cache
def hf_oracle(family: str) -> Any:
    """The same checkpoint in plain ``transformers`` with eager attention: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(family), attn_implementation="eager")
    return model.eval()


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max absolute difference relative to the expected activation scale (non-finite entries,
    such as masked attention scores, must be the same on both sides)."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    finite = torch.isfinite(expected)
    if not bool(finite.all()):  # attention scores: -inf where masked, on both sides exactly
        assert torch.equal(torch.isfinite(actual), finite), "non-finite entries in different places"
        assert torch.equal(actual[~finite], expected[~finite]), "non-finite entries differ"
        actual, expected = actual[finite], expected[finite]
    scale = expected.abs().max().clamp_min(1e-6)
    return float((actual - expected).abs().max() / scale)


PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="session")
def gpt2_path() -> pathlib.Path:
    return tiny_model_path("gpt2")


@pytest.fixture(scope="session")
def llama_path() -> pathlib.Path:
    return tiny_model_path("llama")


VLLM_SHAPE = {"d_model": 128, "head_dim": 32, "max_positions": 256}
"""vLLM's CPU attention kernels refuse head_dim 16: the vLLM tests use 4 heads of 32."""


@functools.cache
def vllm_model_path(family: str) -> pathlib.Path:
    from interp_testkit import build_tiny_model

    return build_tiny_model(family, MODELS / f"{family}-vllm", **VLLM_SHAPE)


@functools.cache
def hf_for(path: pathlib.Path) -> Any:
    """The HF oracle (eager attention, fp32) for any local model directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


VLLM_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    # llama's engine also forces chunked prefill: prompts over 64 tokens take several steps
    "llama": {"max_num_batched_tokens": 64},
    # qwen2's engine asks for prefix caching explicitly: the prefix-cache tests depend on it
    "qwen2": {"enable_prefix_caching": True},
}


def started_engine(path: pathlib.Path, backend: str = "vllm", **engine_args: Any) -> Any:
    """A vLLM engine of its own (outside the session's shared ones), warmed up, behind its sync
    facade; shut down again if it fails to start."""
    from interp_engine import load_model, sync_model

    facade = sync_model(load_model(path, backend=backend, **engine_args))
    try:
        facade.warmup()
    except BaseException:
        facade.shutdown()
        raise
    return facade


@pytest.fixture(scope="session")
def vllm_engines() -> Any:
    """``get(family, **engine_args)``: one started vLLM engine per (family, args) for the whole
    session, behind its sync facade (the facade's loop owns the engine); all shut down at the end."""
    from interp_engine import load_model, sync_model

    started: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}

    def get(family: str, **engine_args: Any) -> Any:
        args = {**VLLM_ENGINE_ARGS.get(family, {}), **engine_args}
        key = (family, tuple(sorted(args.items())))
        if key not in started:
            model = load_model(vllm_model_path(family), backend="vllm", **args)
            facade = sync_model(model)
            facade.warmup()
            started[key] = facade
        return started[key]

    yield get
    # shut them down side by side: each waits seconds for its engine core to exit
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
        for future in [pool.submit(facade.shutdown) for facade in started.values()]:
            future.result()
