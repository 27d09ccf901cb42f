"""Architecture knowledge, one small table entry per model family.

Each :class:`Family` names, relative to the HF ``*ForCausalLM`` module, where the decoder
layers, the final norm and the unembedding are, and, relative to one decoder layer, where each
point of the address vocabulary is read:

- the attention module (its input is ``attn_in``, its output ``attn_out``, its weights
  ``attn_pattern``) and the MLP (input ``mlp_in``, output ``mlp_out``);
- the MLP's input projections (their outputs are ``mlp_pre`` and, in a gated MLP, the linear
  branch ``mlp_pre_linear``; Phi-3's fused ``gate_up_proj`` holds both, as halves) and the
  linear layer that reads the post-nonlinearity neurons (``mlp_post``);
- the q/k norms (``q_norm_in``/``q_norm_out``/``k_norm_in``/``k_norm_out``, and how heads are
  laid out in the tensors they see) and the sandwich norms after each sublayer
  (``attn_out_post``/``mlp_out_post``): optional, served where the loaded model has them;
- the per-head values: the projection whose output holds the values (and how they are laid out
  in it), the output projection (whose input is ``attn_z``) and, for a family whose attention
  does not call transformers' attention interface, the method that receives queries and keys
  (and how it scales their product, for ``attn_scores``).

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

QkNormLayout = Literal["flat", "tokens x heads", "heads x tokens"]
"""How the queries (keys) a q-norm (k-norm) sees are laid out: ``[batch, tokens, heads * d_head]``
(OLMo 2's norms work on the flattened heads), ``[batch, tokens, heads, d_head]`` (Qwen3) or
``[batch, heads, tokens, d_head]`` (Gemma 3, StableLM, Phi)."""


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
    """The attention module in a layer: its first input is ``attn_in`` (the residual after the
    pre-attention norm, or the residual itself where there is none) and its output
    ``(attn_output, attn_weights)`` gives ``attn_out`` and ``attn_pattern``."""
    mlp_in: str = "mlp"
    """The module whose first input is ``mlp_in`` (the MLP; OPT, which has no MLP module: ``fc1``)."""
    mlp_out: str = "mlp"
    """The module whose output is ``mlp_out``, the MLP's own output (OPT: ``fc2``)."""
    mlp_pre: str = "mlp.gate_proj"
    """The linear layer whose output is ``mlp_pre`` (the gate branch of a gated MLP)."""
    mlp_pre_linear: str | None = "mlp.up_proj"
    """The linear layer whose output is ``mlp_pre_linear`` (a gated MLP's up branch); ``None``:
    the MLP is not gated."""
    gate_up_fused: bool = False
    """Whether :attr:`mlp_pre` and :attr:`mlp_pre_linear` name one module whose output is
    ``[gate | up]``: ``mlp_pre`` is its first half, ``mlp_pre_linear`` its second (Phi-3)."""
    mlp_down: str = "mlp.down_proj"
    """The linear layer whose input is the post-nonlinearity MLP hidden (``mlp_post``)."""
    attn_post_norm: str | None = None
    """The sandwich norm applied to the attention's output before it is added to the residual
    (its output is ``attn_out_post``); ``None`` or absent from the loaded model: no such norm."""
    mlp_post_norm: str | None = None
    """Likewise after the MLP (``mlp_out_post``)."""
    q_norm: str | None = None
    """The q-norm module (its input and output are ``q_norm_in``/``q_norm_out``), served where
    the loaded model has it on every layer (StableLM and Phi only build it with ``qk_layernorm``)."""
    k_norm: str | None = None
    """The k-norm module (``k_norm_in``/``k_norm_out``), likewise."""
    qk_norm_layout: QkNormLayout = "heads x tokens"
    """How heads are laid out in the tensors the q/k norms see."""
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
    """The attention module's own method called as ``fn(query, key, value, attention_mask)`` when
    the family does not go through transformers' ``ALL_ATTENTION_FUNCTIONS`` (GPT-J's ``_attn``);
    ``None``: queries and keys are read where the attention interface's function receives them."""
    attn_score_divisor: str | None = None
    """For :attr:`attn_fn`: the attention module's attribute that method divides ``q @ k^T`` by,
    in float32 (GPT-J's ``scale_attn``); ``None``: the attention function's ``scaling`` argument
    multiplies it (default ``d_head ** -0.5``)."""


def _llama_like(name: str, model_types: tuple[str, ...], **overrides: Any) -> Family:
    """A family laid out like Llama: ``model.layers``, ``self_attn``, a gated ``mlp`` (``gate_proj``,
    ``up_proj``, ``down_proj``), ``model.norm``."""
    return Family(name, model_types, layers="model.layers", final_norm="model.norm", **overrides)


_NOT_GATED: dict[str, Any] = {"mlp_pre_linear": None}

FAMILIES: tuple[Family, ...] = (
    Family(
        "gpt2",
        ("gpt2",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        attn="attn",
        mlp_pre="mlp.c_fc",
        mlp_down="mlp.c_proj",
        attn_o="attn.c_proj",
        attn_v="attn.c_attn",
        qkv_layout="q|k|v",
        **_NOT_GATED,
    ),
    _llama_like("llama", ("llama",)),
    _llama_like("mistral", ("mistral",)),
    _llama_like("qwen2", ("qwen2",)),
    _llama_like(
        "qwen3", ("qwen3",), q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_layout="tokens x heads"
    ),
    _llama_like("gemma", ("gemma",)),
    _llama_like(
        "gemma2",
        ("gemma2", "gemma3_text"),
        attn_post_norm="post_attention_layernorm",
        mlp_post_norm="post_feedforward_layernorm",
        q_norm="self_attn.q_norm",  # Gemma 3 only
        k_norm="self_attn.k_norm",
    ),
    _llama_like(
        "olmo2",
        ("olmo2",),
        attn_post_norm="post_attention_layernorm",
        mlp_post_norm="post_feedforward_layernorm",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        qk_norm_layout="flat",
    ),
    _llama_like(
        "stablelm",
        ("stablelm",),
        parallel=_uses_parallel_residual,
        q_norm="self_attn.q_layernorm",  # with qk_layernorm
        k_norm="self_attn.k_layernorm",
    ),
    _llama_like(
        "phi3",
        ("phi3",),
        mlp_pre="mlp.gate_up_proj",
        mlp_pre_linear="mlp.gate_up_proj",
        gate_up_fused=True,
        attn_v="self_attn.qkv_proj",
        qkv_layout="q|k|v",
    ),
    Family(
        "phi",
        ("phi",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        mlp_pre="mlp.fc1",
        mlp_down="mlp.fc2",
        q_norm="self_attn.q_layernorm",  # with qk_layernorm
        k_norm="self_attn.k_layernorm",
        parallel=lambda c: True,
        attn_o="self_attn.dense",
        **_NOT_GATED,
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        layers="gpt_neox.layers",
        final_norm="gpt_neox.final_layer_norm",
        attn="attention",
        mlp_pre="mlp.dense_h_to_4h",
        mlp_down="mlp.dense_4h_to_h",
        parallel=lambda c: bool(getattr(c, "use_parallel_residual", True)),
        attn_o="attention.dense",
        attn_v="attention.query_key_value",
        qkv_layout="per-head q|k|v",
        **_NOT_GATED,
    ),
    Family(
        "gptj",
        ("gptj",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        attn="attn",
        mlp_pre="mlp.fc_in",
        mlp_down="mlp.fc_out",
        parallel=lambda c: True,
        attn_o="attn.out_proj",
        attn_v="attn.v_proj",
        attn_fn="_attn",
        attn_score_divisor="scale_attn",
        **_NOT_GATED,
    ),
    Family(
        "opt",
        ("opt",),
        layers="model.decoder.layers",
        final_norm="model.decoder.final_layer_norm",
        mlp_in="fc1",
        mlp_out="fc2",
        mlp_pre="fc1",
        mlp_down="fc2",
        before_unembed=("model.decoder.project_out",),
        post_norm=lambda c: not bool(getattr(c, "do_layer_norm_before", True)),
        attn_o="self_attn.out_proj",
        **_NOT_GATED,
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
