"""TransformerLens hook names, read as addresses.

``Address.parse("blocks.5.hook_resid_post")`` is ``Address("resid_post", 5)``: a researcher can
paste the names they know from TransformerLens wherever an address is accepted. A name maps to
the address with its meaning (where TransformerLens's value differs by a norm weight or on a
family, below says how); a TransformerLens name without a counterpart raises ``UnknownKind``
naming the nearest address and how it differs.

Heads: ``attn.hook_z`` is ``attn_z`` and ``attn.hook_v`` is ``attn_v``. Queries and keys are
``attn_q``/``attn_k`` as the attention product uses them, i.e. after rotary embeddings and any
q/k norm: that is TransformerLens's ``attn.hook_rot_q``/``hook_rot_k`` on rotary models and its
``attn.hook_q``/``hook_k`` on the others (GPT-2; on OPT HF scales the queries before the product,
so there ``attn_q`` is TransformerLens's ``hook_q`` times ``d_head ** -0.5``). Both spellings parse
to ``attn_q``/``attn_k``; on a rotary model ``hook_q``'s own value (before rotary) is not an address.
With grouped-query attention ``attn_k``/``attn_v`` keep the key/value heads.

Norm outputs: ``ln1.hook_normalized``/``ln2.hook_normalized`` are ``attn_in``/``mlp_in``, the
sublayer's input after its norm. TransformerLens (3.x) fires ``hook_normalized`` before the
norm's weight and bias, so ours is its value times the weight (plus the bias for LayerNorm); the
same holds for ``ln_final.hook_normalized`` and ``final_norm``. On OLMo 2, which has no pre-norms,
TransformerLens's ``ln1``/``ln2`` are the post-sublayer norms (our ``attn_out_post``/``mlp_out_post``
divided by the weight). ``hook_attn_out``/``hook_mlp_out`` are ``attn_out``/``mlp_out``, the
sublayer's output; on the sandwich-norm families (Gemma 2/3, OLMo 2) TransformerLens fires them
after the post-sublayer norms, i.e. they are our ``attn_out_post``/``mlp_out_post`` there.
``tests/eager/test_tl_oracle.py`` checks each of these against TransformerLens itself.

Mixtures of experts: ``mlp.hook_expert_indices`` is ``expert_indices``; TransformerLens's
``mlp.hook_expert_weights`` (the softmax over every expert) is not an address, ``router_logits``
holds the logits it is taken of.
"""

from __future__ import annotations

import re

from .._errors import UnknownKind

TL_PER_LAYER: dict[str, str] = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "mlp.hook_post": "mlp_post",
    "attn.hook_pattern": "attn_pattern",
    "attn.hook_q": "attn_q",
    "attn.hook_k": "attn_k",
    "attn.hook_v": "attn_v",
    "attn.hook_z": "attn_z",
    "attn.hook_rot_q": "attn_q",
    "attn.hook_rot_k": "attn_k",
    "ln1.hook_normalized": "attn_in",
    "ln2.hook_normalized": "mlp_in",
    "mlp.hook_pre": "mlp_pre",
    "mlp.hook_pre_linear": "mlp_pre_linear",
    "attn.hook_attn_scores": "attn_scores",
    "mlp.hook_expert_indices": "expert_indices",
}
"""``blocks.L.<suffix>`` -> our per-layer kind."""

TL_MODEL_LEVEL: dict[str, str] = {
    "ln_final.hook_normalized": "final_norm",
}
"""Whole TransformerLens names -> our model-level kind."""

_EMBED_HINT = (
    "interp-engine's 'embed' is the token + position embedding entering layer 0, i.e. TransformerLens's "
    "blocks.0.hook_resid_pre = hook_embed + hook_pos_embed (on models without learned position "
    "embeddings, e.g. rotary ones, it equals hook_embed alone); use 'embed'"
)

_NEAR_MISSES: dict[str, str] = {  # unmapped suffixes of blocks.L.* -> what to use instead
    "hook_mlp_in": "TransformerLens's hook_mlp_in is the residual before ln2: resid_mid.L on sequential models "
    "(resid_pre.L on parallel-attention ones); mlp_in.L is the MLP's input after the norm",
    "hook_attn_in": "TransformerLens's hook_attn_in is the residual before ln1, resid_pre.L; "
    "attn_in.L is after the norm",
    "hook_q_input": "the attention's input is resid_pre.L",
    "hook_k_input": "the attention's input is resid_pre.L",
    "hook_v_input": "the attention's input is resid_pre.L",
    "attn.hook_result": "per-head results are not an address; attn_out.L is their sum",
    "ln1.hook_scale": "norm scales are not addresses; resid_pre.L is the norm's input, attn_in.L its output",
    "ln2.hook_scale": "norm scales are not addresses; resid_mid.L is the norm's input, mlp_in.L its output",
    "mlp.hook_expert_weights": "TransformerLens's hook_expert_weights is the softmax over every expert, before the "
    "top-k; router_logits.L are the logits it is taken of, expert_weights.L the chosen experts' weights after the "
    "family's renormalisation",
}

_BLOCK = re.compile(r"blocks\.(-?[0-9]+)\.(.+)")


def is_tl_name(text: str) -> bool:
    """Whether ``text`` is spelled like a TransformerLens hook name (a ``hook_`` part)."""
    return any(part.startswith("hook_") for part in text.split("."))


def _unknown(text: str, why: str) -> UnknownKind:
    mapped = [f"blocks.L.{suffix}" for suffix in TL_PER_LAYER] + list(TL_MODEL_LEVEL)
    return UnknownKind(
        f"TransformerLens name {text!r} has no interp-engine address: {why}. "
        f"Mapped TransformerLens names: {', '.join(mapped)}",
        address=text,
        valid=tuple(mapped),
    )


def parse_tl_name(text: str) -> tuple[str, int | None]:
    """``(kind, layer)`` of a TransformerLens hook name, or ``UnknownKind`` saying what to use."""
    if text in TL_MODEL_LEVEL:
        return TL_MODEL_LEVEL[text], None
    if text in ("hook_embed", "hook_pos_embed", "embed.hook_out", "pos_embed.hook_out"):
        raise _unknown(text, _EMBED_HINT)
    if text.startswith("ln_final."):
        raise _unknown(text, "of the final norm only its output, ln_final.hook_normalized (final_norm), is an address")
    match = _BLOCK.fullmatch(text)
    if match is None:
        raise _unknown(text, "it is not a blocks.L.* name this mapping knows")
    layer, suffix = int(match.group(1)), match.group(2)
    if suffix in TL_PER_LAYER:
        return TL_PER_LAYER[suffix], layer
    hint = _NEAR_MISSES.get(suffix, "it is not part of the address vocabulary")
    raise _unknown(text, hint.replace(".L", f".{layer}"))


def tl_name(kind: str, layer: int | None) -> str | None:
    """The TransformerLens name of an address, or ``None`` where TransformerLens has none."""
    for suffix, ours in TL_PER_LAYER.items():
        if ours == kind:
            return f"blocks.{layer}.{suffix}"
    for name, ours in TL_MODEL_LEVEL.items():
        if ours == kind:
            return name
    return None
