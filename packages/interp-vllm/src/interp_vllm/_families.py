"""Where vLLM's model classes keep the parts interp-engine reads and writes.

vLLM reimplements each architecture, so these tables describe vLLM's modules (not HF's): the
decoder-layer list, whether layers defer the residual add into the next norm (returning
``(hidden, residual)``), the attention block, the attention kernel module that receives
post-rotary queries and keys, the MLP and its down-projection, and the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from interp_engine import UnsupportedArchitecture


@dataclass(frozen=True)
class VllmFamily:
    """Module paths in one family of vLLM model classes."""

    name: str
    architectures: tuple[str, ...]
    """HF ``config.architectures`` names vLLM serves with this layout."""
    layers: str
    final_norm: str
    deferred_residual: bool = True
    """Layers take and return ``(hidden, residual)``: the stream is ``hidden + residual``."""
    attn: str = "self_attn"
    attn_kernel: str = "self_attn.attn"
    """The ``Attention`` module called as ``attn(q, k, v)`` with post-rotary q and k."""
    attn_o_proj: str = "self_attn.o_proj"
    """The attention's output projection: its input is every head's output (``attn_z``)."""
    mlp: str = "mlp"
    mlp_down: str = "mlp.down_proj"


FAMILIES: tuple[VllmFamily, ...] = (
    VllmFamily(
        "gpt2",
        ("GPT2LMHeadModel",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        deferred_residual=False,
        attn="attn",
        attn_kernel="attn.attn",
        attn_o_proj="attn.c_proj",
        mlp_down="mlp.c_proj",
    ),
    VllmFamily(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        layers="model.layers",
        final_norm="model.norm",
    ),
)

_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def family_for(config: Any) -> VllmFamily:
    """The layout for an HF config, or ``UnsupportedArchitecture`` naming the supported ones."""
    for arch in getattr(config, "architectures", None) or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    raise UnsupportedArchitecture(
        f"the vllm backend has no adapter for {getattr(config, 'architectures', None)}; "
        f"supported: {', '.join(supported_architectures())}"
    )
