"""What the test suite's folders share without a backend: where the tiny models are built, the
families each sweep covers, the prompt, the HF oracle and the comparison of two activations.

Models are random-weight HF checkpoints with a tokenizer trained locally (:func:`build_tiny_model`),
written under ``.cache/test-models`` in the repository so a second run reuses them. Nothing is
downloaded. Each family's HF oracle is loaded once per process.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import torch

from interp_testkit import build_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[4]
"""The repository (this package is installed editable from ``tests/testkit/src``)."""
MODELS = ROOT / ".cache" / "test-models"

REQUIRED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt_neox", "opt", "phi")
EXTRA_FAMILIES = ("gemma3_text", "gptj", "olmo2", "phi3", "stablelm")
ALL_FAMILIES = REQUIRED_FAMILIES + EXTRA_FAMILIES
VLLM_FAMILIES = ("gpt2", "llama", "qwen2", "qwen3")
"""The families every vLLM backend test covers (each is one of the session's shared engines)."""
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
"""Model types the eager breadth sweep (tests/eager/test_eager_families.py) verifies against HF."""
REFUSED_VARIANTS: dict[str, dict[str, Any]] = {
    # Bloom adding the normalised input, not the residual stream, back after each sublayer
    "bloom": {"apply_residual_connection_post_layernorm": True},
}
"""Config variants the eager backend refuses with ``UnsupportedArchitecture`` (the sweep checks why):
every model type's tiny default config resolves."""


PROMPT = "The quick brown fox jumps over the lazy dog because"
LONG = [(13 * i + 7) % 512 for i in range(150)]
"""Token ids of a prompt over 64 tokens (the vLLM models' 512-token vocabulary): chunked prefill on
the llama engines, which take at most 64 tokens a step (:data:`VLLM_ENGINE_ARGS`)."""

VLLM_SHAPE = {"d_model": 128, "head_dim": 32, "max_positions": 256}
"""vLLM's CPU attention kernels refuse head_dim 16: the vLLM tests use 4 heads of 32."""

KV_CACHE_BYTES = 128 << 20
"""The KV cache of the suite's shared and per-test engines: 128 MiB holds every batch the tests
send (the tiny models' layers take ~4 KiB a token) in an eighth of the backend's 1 GiB default,
so that the engines a session holds at once fit in memory."""

VLLM_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    # llama's engine also forces chunked prefill: prompts over 64 tokens take several steps
    "llama": {"max_num_batched_tokens": 64},
    # qwen2's engine asks for prefix caching explicitly: the prefix-cache tests depend on it
    "qwen2": {"enable_prefix_caching": True},
}


@functools.cache
def tiny_model_path(family: str) -> pathlib.Path:
    """``family``'s tiny checkpoint (the eager tests' shape), built on first use."""
    return build_tiny_model(family, MODELS / family)


@functools.cache
def vllm_model_path(family: str) -> pathlib.Path:
    """``family``'s tiny checkpoint in the vLLM tests' shape (:data:`VLLM_SHAPE`), built on first use."""
    return build_tiny_model(family, MODELS / f"{family}-vllm", **VLLM_SHAPE)


@functools.cache
def hf_oracle(family: str) -> Any:
    """``family``'s tiny checkpoint in plain ``transformers`` with eager attention: the oracle
    (a model object of its own, apart from :func:`hf_for`'s)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_path(family), attn_implementation="eager")
    return model.eval()


@functools.cache
def hf_for(path: pathlib.Path) -> Any:
    """The HF oracle (eager attention, fp32) for any local model directory."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
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
