"""Architecture knowledge, one small table entry per model family.

Each :class:`Family` names, relative to the HF ``*ForCausalLM`` module, where the decoder
layers, the final norm and the unembedding are, and, relative to one decoder layer, which
module is the attention, which module's output is added to the residual after attention and
after the MLP, which linear layer reads the MLP's post-nonlinearity neurons, and where the
per-head values are: the projection whose output holds the values (and how they are laid out
in it), the output projection (whose input is ``attn_z``) and, for a family whose attention
does not call transformers' attention interface, the method that receives queries and keys.
The capture code never branches on the family; it only reads these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from interp_engine import UnsupportedArchitecture


def _never(config: Any) -> bool:
    return False


def _uses_parallel_residual(config: Any) -> bool:
    return bool(getattr(config, "use_parallel_residual", False))


QkvLayout = Literal["v", "q|k|v", "per-head q|k|v"]
"""How values sit in the output of :attr:`Family.attn_v`: alone (``v_proj``), after the
queries and keys (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``: ``[q heads | k heads | v heads]``),
or interleaved per head (GPT-NeoX's ``query_key_value``: ``[q_h k_h v_h]`` for each head ``h``)."""


@dataclass(frozen=True)
class Family:
    """Where one family keeps the parts interp-engine reads and writes."""

    name: str
    model_types: tuple[str, ...]
    layers: str
    """The ``nn.ModuleList`` of decoder layers."""
    final_norm: str | None
    """The final norm (its output is ``final_norm``); ``None`` reads the unembedding's input."""
    attn: str = "self_attn"
    """The attention module in a layer; its output is ``(attn_output, attn_weights)``."""
    attn_out: str | None = None
    """The module whose output is added to the residual after attention (default: ``attn``)."""
    mlp_out: str = "mlp"
    """The module whose output is added to the residual after the MLP."""
    mlp_down: str = "mlp.down_proj"
    """The linear layer whose input is the post-nonlinearity MLP hidden (``mlp_post``)."""
    before_unembed: tuple[str, ...] = ()
    """Modules applied between the final norm and the unembedding, when present (OPT)."""
    parallel: Callable[[Any], bool] = _never
    """Whether attention and MLP both read ``resid_pre`` (GPT-NeoX, Phi, GPT-J)."""
    post_norm: Callable[[Any], bool] = _never
    """Whether the residual stream is normalised after each block (OPT-350m): no ``resid_mid``."""
    attn_o: str = "self_attn.o_proj"
    """The attention's output projection; its input, split per head, is ``attn_z``."""
    attn_v: str = "self_attn.v_proj"
    """The projection whose output holds the values (``attn_v``), before they enter the KV cache."""
    qkv_layout: QkvLayout = "v"
    """Where the values are in :attr:`attn_v`'s output."""
    attn_fn: str | None = None
    """The attention module's own method called as ``fn(query, key, value, ...)`` when the family
    does not go through transformers' ``ALL_ATTENTION_FUNCTIONS`` (GPT-J's ``_attn``); ``None``:
    queries and keys are read where the attention interface's function receives them."""

    @property
    def attn_out_module(self) -> str:
        return self.attn_out or self.attn


def _llama_like(name: str, model_types: tuple[str, ...], **overrides: Any) -> Family:
    """A family laid out like Llama: ``model.layers``, ``self_attn``, ``mlp.down_proj``, ``model.norm``."""
    return Family(name, model_types, layers="model.layers", final_norm="model.norm", **overrides)


FAMILIES: tuple[Family, ...] = (
    Family(
        "gpt2",
        ("gpt2",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        attn="attn",
        mlp_down="mlp.c_proj",
        attn_o="attn.c_proj",
        attn_v="attn.c_attn",
        qkv_layout="q|k|v",
    ),
    _llama_like("llama", ("llama",)),
    _llama_like("mistral", ("mistral",)),
    _llama_like("qwen2", ("qwen2",)),
    _llama_like("qwen3", ("qwen3",)),
    _llama_like("gemma", ("gemma",)),
    _llama_like(
        "gemma2",
        ("gemma2", "gemma3_text"),
        attn_out="post_attention_layernorm",
        mlp_out="post_feedforward_layernorm",
    ),
    _llama_like("olmo2", ("olmo2",), attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"),
    _llama_like("stablelm", ("stablelm",), parallel=_uses_parallel_residual),
    _llama_like("phi3", ("phi3",), attn_v="self_attn.qkv_proj", qkv_layout="q|k|v"),
    Family(
        "phi",
        ("phi",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        mlp_down="mlp.fc2",
        parallel=lambda c: True,
        attn_o="self_attn.dense",
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        layers="gpt_neox.layers",
        final_norm="gpt_neox.final_layer_norm",
        attn="attention",
        mlp_down="mlp.dense_4h_to_h",
        parallel=lambda c: bool(getattr(c, "use_parallel_residual", True)),
        attn_o="attention.dense",
        attn_v="attention.query_key_value",
        qkv_layout="per-head q|k|v",
    ),
    Family(
        "gptj",
        ("gptj",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        attn="attn",
        mlp_down="mlp.fc_out",
        parallel=lambda c: True,
        attn_o="attn.out_proj",
        attn_v="attn.v_proj",
        attn_fn="_attn",
    ),
    Family(
        "opt",
        ("opt",),
        layers="model.decoder.layers",
        final_norm="model.decoder.final_layer_norm",
        mlp_out="fc2",
        mlp_down="fc2",
        before_unembed=("model.decoder.project_out",),
        post_norm=lambda c: not bool(getattr(c, "do_layer_norm_before", True)),
        attn_o="self_attn.out_proj",
    ),
)

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` the eager backend has an adapter for, sorted."""
    return sorted(_BY_MODEL_TYPE)


def family_for(config: Any) -> Family:
    """The adapter for an HF config, or ``UnsupportedArchitecture`` naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    family = _BY_MODEL_TYPE.get(str(model_type))
    if family is None:
        raise UnsupportedArchitecture(
            f"the eager backend has no adapter for model_type {model_type!r}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return family
