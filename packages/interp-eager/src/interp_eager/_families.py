"""What the eager backend knows about a model family: the resolved :class:`Family`, and the data
structure cannot tell.

A :class:`Family` names, relative to the HF ``*ForCausalLM`` module, where the decoder layers, the
final norm and the unembedding are, and, relative to one decoder layer, where each point of the
address vocabulary is read:

- the attention module (its input is ``attn_in``, its output ``attn_out``, its weights
  ``attn_pattern``) and the MLP (input ``mlp_in``, output ``mlp_out``; on a mixture-of-experts
  layer the whole block, shared experts included);
- the MLP's input projections (their outputs are ``mlp_pre`` and, in a gated MLP, the linear
  branch ``mlp_pre_linear``; a fused ``gate_up_proj`` holds both, as halves) and the linear layer
  that reads the post-nonlinearity neurons (``mlp_post``);
- a mixture of experts' router (whose logits are ``router_logits``) and experts module (called
  with the chosen experts and their weights: ``expert_indices``, ``expert_weights``);
- the q/k norms and the sandwich norms after each sublayer (optional, served where present);
- the per-head values: the projection whose output holds the values (and how they are laid out
  in it), the output projection (whose input is ``attn_z``) and, for a family whose attention
  does not call transformers' attention interface, the method that receives queries and keys.

Families are not listed here: :func:`interp_eager._resolve.resolve` builds the :class:`Family` of
a loaded model from its module tree and one traced forward. :data:`FAMILY_DATA` holds the little
that structure cannot tell, by ``model_type``. The capture code never branches on the family; it
only reads the resolved table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

QkvLayout = Literal["v", "q|k|v", "per-head q|k|v", "per-group q|k|v", "grouped q|v|k"]
"""How values sit in the output of :attr:`Family.attn_v`: alone (``v_proj``), after the
queries and keys (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``: ``[q heads | k heads | v heads]``),
interleaved per head (GPT-NeoX's ``query_key_value``: ``[q_h k_h v_h]`` for each head ``h``),
per key/value head after the queries it serves (Falcon's ``new_decoder_architecture``:
``[q ... q k v]`` for each key/value head), or in :attr:`Family.qkv_groups` model-parallel groups
each holding its heads' ``[q | v | k]`` (CodeGen's ``qkv_proj``)."""

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
    mlp_pre: str | None = "mlp.gate_proj"
    """The linear layer whose output is ``mlp_pre`` (the gate branch of a gated MLP); ``None``: no
    layer has a dense MLP (every layer is a mixture of experts)."""
    mlp_pre_linear: str | None = "mlp.up_proj"
    """The linear layer whose output is ``mlp_pre_linear`` (a gated MLP's up branch); ``None``:
    the MLP is not gated."""
    mlp_act: str | None = "mlp.act_fn"
    """The module applying a gated MLP's activation to the gate branch alone (its output is
    ``mlp_gate_act``); ``None``: the MLP is not gated, or applies its activation in a function."""
    gate_up_fused: bool = False
    """Whether :attr:`mlp_pre` and :attr:`mlp_pre_linear` name one module whose output is
    ``[gate | up]``: ``mlp_pre`` is its first half, ``mlp_pre_linear`` its second (Phi-3)."""
    mlp_down: str | None = "mlp.down_proj"
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
    parallel: bool = False
    """Whether attention and MLP both read ``resid_pre`` (GPT-NeoX, Phi, GPT-J, Cohere)."""
    post_norm: bool = False
    """Whether the residual stream is normalised after each block (OPT-350m): no ``resid_mid``."""
    attn_o: str = "self_attn.o_proj"
    """The attention's output projection; its input, split per head, is ``attn_z``."""
    attn_sub_norm: str | None = None
    """A norm between the heads' weighted values and :attr:`attn_o` (BitNet's ``attn_sub_norm``):
    ``attn_z`` is its input then."""
    mlp_sub_norm: str | None = None
    """A norm between the MLP's nonlinearity and :attr:`mlp_down` (BitNet's ``ffn_sub_norm``):
    ``mlp_post`` is its input then."""
    attn_out_at: str | None = None
    """The module whose output is ``attn_out`` when the attention module adds the residual to its
    own output (Bloom's ``self_attention`` returns ``residual + dense(...)``): its output
    projection; ``None``: the attention module's output is ``attn_out``."""
    attn_v: str = "self_attn.v_proj"
    """The projection whose output holds the values (``attn_v``), before they enter the KV cache."""
    qkv_layout: QkvLayout = "v"
    """Where the values are in :attr:`attn_v`'s output."""
    qkv_groups: int = 1
    """The model-parallel groups of a ``"grouped q|v|k"`` layout (CodeGen: 4)."""
    kv_repeat: int = 1
    """How many times each key/value head is repeated in the keys and values the attention product
    receives (Falcon's ``new_decoder_architecture`` broadcasts them to every query head):
    ``attn_k`` keeps one of each."""
    attn_fn: str | None = None
    """The attention module's own method called as ``fn(query, key, value, attention_mask)`` when
    the family does not go through transformers' ``ALL_ATTENTION_FUNCTIONS`` (GPT-J's ``_attn``);
    ``"forward"``: the attention module computes attention in its own forward, read at its
    products (Bloom, Falcon, MPT, XGLM): queries and keys are the operands of the ``q @ k^T``
    product its softmax's input comes from, the scores what that softmax receives (ALiBi biases
    and masks included), the values the operand the softmax's output multiplies (or the
    arguments of ``scaled_dot_product_attention``); ``None``: queries and keys are read where the
    attention interface's function receives them."""
    attn_score_divisor: str | None = None
    """For :attr:`attn_fn`: the attention module's attribute that method divides ``q @ k^T`` by,
    in float32 (GPT-J's ``scale_attn``); ``None``: the attention function's ``scaling`` argument
    multiplies it (default ``d_head ** -0.5``)."""
    attn_scores_at_softmax: bool = False
    """For :attr:`attn_fn`: read ``attn_scores`` where the method's softmax receives them (its own
    masks applied: GPT-Neo's local-attention band) instead of recomputing them from q and k."""
    n_heads: int = 0
    """Query heads, as the attention function receives them (``0``: the config's)."""
    n_kv_heads: int = 0
    """Key/value heads, read off the value projection (``0``: the config's)."""
    d_head: int = 0
    """Width of one head, as the attention function receives them (``0``: the config's)."""
    router: str | None = None
    """The router of a mixture-of-experts layer (its first linear output is ``router_logits``);
    ``None``: no layer is a mixture of experts. Present only on the layers that are."""
    experts: str | None = None
    """The experts module, called with the chosen experts and their weights."""
    expert_index_arg: int = 1
    """Which positional argument of :attr:`experts` holds the chosen experts (``expert_indices``)."""
    expert_weight_arg: int = 2
    """Which holds their weights (``expert_weights``)."""
    n_experts: int = 0
    experts_per_token: int = 0
    attention_sinks: bool = False
    """Whether the attention function also normalises over a per-head sink logit (gpt-oss): no
    ``attn_scores`` then (their softmax would not be the pattern)."""
    logit_multiplier: float = 1.0
    """The constant the model multiplies its unembedding's output by (Cohere's ``logit_scale``)."""
    residual_multiplier: float = 1.0
    """The constant each sublayer's output is multiplied by before it is added to the residual
    (Granite's ``residual_multiplier``): ``attn_out`` and ``mlp_out`` are read after it, as added."""


FAMILY_DATA: dict[str, dict[str, Any]] = {
    # GPT-J computes attention in its own ``_attn`` method and divides ``q @ k^T`` by ``scale_attn``.
    "gptj": {"attn_fn": "_attn", "attn_score_divisor": "scale_attn"},
}
"""What structure cannot tell, by ``model_type``: how GPT-J's own attention method scales its scores
(an own ``_attn(query, key, value, mask)`` method is otherwise found from the module tree -- GPT-Neo's,
CodeGen's -- and its scores read where its softmax receives them; attention computed in the
attention module's own forward -- Bloom, Falcon, MPT, XGLM -- is read at its products and its
softmax, ALiBi biases included). Everything else -- fused, per-head, per-group or model-parallel
q/k/v layouts, soft-caps, logit and embedding scales, sandwich, post and sub-norms, parallel
blocks, a residual added inside a sublayer -- is read from the module tree, the config and one
traced forward (:mod:`interp_eager._resolve`)."""

VERIFIED_MODEL_TYPES: tuple[str, ...] = (
    "apertus",
    "arcee",
    "biogpt",
    "bitnet",
    "bloom",
    "codegen",
    "cohere",
    "cohere2",
    "ernie4_5",
    "ernie4_5_moe",
    "exaone4",
    "falcon",
    "flex_olmo",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm",
    "glm4",
    "gpt2",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gpt_oss",
    "gptj",
    "granite",
    "helium",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "llama",
    "ministral",
    "mistral",
    "mixtral",
    "mpt",
    "nemotron",
    "olmo",
    "olmo2",
    "olmo3",
    "olmoe",
    "opt",
    "persimmon",
    "phi",
    "phi3",
    "phimoe",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "seed_oss",
    "smollm3",
    "stablelm",
    "starcoder2",
    "xglm",
)
"""The ``model_type`` values the test suite verifies against HF on this backend
(``tests/eager/test_eager_families.py``); named in error messages, never consulted by resolution."""


def verified_model_types() -> list[str]:
    """The ``model_type`` values verified against HF on the eager backend, sorted."""
    return sorted(VERIFIED_MODEL_TYPES)
