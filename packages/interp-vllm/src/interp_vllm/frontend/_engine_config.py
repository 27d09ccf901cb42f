"""What the ``vllm`` backend's engine is built with before it starts: the front end's own options,
the defaults of the engine's arguments and environment (and a CPU machine's), and the checks and
reads of the model's configuration that need no engine."""

from __future__ import annotations

import dataclasses
from typing import Any

from interp_engine import UnsupportedArchitecture

FRONT_END_OPTIONS = ("tokenizer_path", "capture_transport", "capture_memory_bytes")
CAPTURE_TRANSPORTS = ("auto", "shared_memory", "rpc")
"""How captured values leave the workers: ``shared_memory`` (:mod:`.._transport`: the workers write
them where the front end maps them; only metadata crosses vLLM's RPC path), ``rpc`` (packed into
the fetch's answer), or ``auto``: shared memory where every worker sees the front end's
directory (one machine), else the RPC."""

CPU_ENV_DEFAULTS = {
    # measured on a 2-core machine: without thread binding the worker is ~1.4x faster in steady
    # state than vLLM's default pinning
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
ENGINE_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
}
CPU_ENGINE_DEFAULTS: dict[str, Any] = {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 1 << 30}
"""On a CPU machine: 1 GiB of KV cache (host memory) starts reliably on a 2-core machine. An engine
argument rather than vLLM's ``VLLM_CPU_KVCACHE_SPACE``: that variable overrides the argument for
every engine the process builds after it is set; where the caller has set it, it is theirs."""


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; say so before starting."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise UnsupportedArchitecture(
            f"vLLM's CPU attention kernels support head sizes {sizes}; this model's is {head}. "
            "Use the eager backend for it on this machine."
        )


def _engine_fields() -> dict[str, Any]:
    """``AsyncEngineArgs`` field names and their defaults."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f.default for f in dataclasses.fields(AsyncEngineArgs)}


def _config_d_mlp(config: Any, d_model: int) -> int:
    """The width of ``mlp_post`` on a model with no dense MLP (every layer a mixture of experts):
    one expert's hidden, from the config, by the names the eager backend reads."""
    for name in ("moe_intermediate_size", "intermediate_size", "ffn_dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * d_model


def _generation_config(name_or_path: str, trust: bool) -> Any:
    """The checkpoint's generation config (its end-of-sequence ids), or ``None`` if it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(name_or_path, trust_remote_code=trust)
    except (OSError, ValueError):
        return None


__all__ = [
    "CAPTURE_TRANSPORTS",
    "CPU_ENGINE_DEFAULTS",
    "CPU_ENV_DEFAULTS",
    "ENGINE_DEFAULTS",
    "FRONT_END_OPTIONS",
    "_check_cpu_head_size",
    "_config_d_mlp",
    "_engine_fields",
    "_generation_config",
    "_is_cpu_platform",
]
