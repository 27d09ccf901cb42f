"""Where vLLM's model classes keep the parts interp-engine reads and writes.

vLLM reimplements each architecture, so these tables describe vLLM's modules (not HF's): the
decoder-layer list, whether layers defer the residual add into the next norm (returning
``(hidden, residual)``), the attention block, the attention kernel module that receives
post-rotary queries and keys, the q/k norms where the family has them, the MLP, the projection
whose output holds the pre-activation (fused ``[gate | up]`` on gated MLPs: vLLM merges
``gate_proj`` and ``up_proj`` into one ``gate_up_proj``), the down-projection, the post-sublayer
(sandwich) norms where the family has them, and the final norm.
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
    mlp_up: str = "mlp.gate_up_proj"
    """The projection whose output holds the MLP's pre-activation (``mlp_pre``)."""
    gated: bool = True
    """Whether :attr:`mlp_up`'s output is ``[gate | up]`` (per rank, under tensor parallelism):
    ``mlp_pre`` is its first half and ``mlp_pre_linear`` its second."""
    mlp_down: str = "mlp.down_proj"
    q_norm: str | None = None
    """The q-norm (called on ``[tokens, heads, d_head]``), where the family has one."""
    k_norm: str | None = None
    unembed: str = "lm_head"
    """The unembedding module the logits processor projects with (tied Gemma: the embedding)."""
    attn_post_norm: str | None = None
    """The post-attention (sandwich) norm, where the family has one: its output is ``attn_out_post``."""
    mlp_post_norm: str | None = None

    @property
    def attn_contrib(self) -> str:
        """The module whose output the layer adds to the residual after attention."""
        return self.attn_post_norm or self.attn

    def lacks(self) -> frozenset[str]:
        """The address kinds this family does not have."""
        missing = set()
        if not self.gated:
            missing.add("mlp_pre_linear")
        if self.q_norm is None:
            missing |= {"q_norm_in", "q_norm_out"}
        if self.k_norm is None:
            missing |= {"k_norm_in", "k_norm_out"}
        if self.attn_post_norm is None:
            missing.add("attn_out_post")
        if self.mlp_post_norm is None:
            missing.add("mlp_out_post")
        return frozenset(missing)


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
        mlp_up="mlp.c_fc",
        gated=False,
        mlp_down="mlp.c_proj",
    ),
    VllmFamily(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        layers="model.layers",
        final_norm="model.norm",
    ),
    VllmFamily(
        "qwen3",
        ("Qwen3ForCausalLM",),
        layers="model.layers",
        final_norm="model.norm",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    ),
    # sandwich norms: each sublayer's output is normed again before vLLM adds it to the residual
    VllmFamily(
        "gemma2",
        ("Gemma2ForCausalLM",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="model.embed_tokens",
        attn_post_norm="post_attention_layernorm",
        mlp_post_norm="post_feedforward_layernorm",
    ),
    VllmFamily(
        "gemma3",
        ("Gemma3ForCausalLM",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="model.embed_tokens",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        attn_post_norm="post_attention_layernorm",
        mlp_post_norm="post_feedforward_layernorm",
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
