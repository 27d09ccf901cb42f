"""The address vocabulary: one row per kind with every fact about it.

A row says what the kind means (TransformerLens meanings), whether it has a layer, its width per
token, whether steering may write it, where it is computed inside a layer (``order``: the sort
key of a forward pass), and what a model family must have to serve it (``needs``) with the
sentence that explains its absence (``missing``). Backends answer which :data:`Need` a loaded
family has; the kinds it serves, and the reason for each one it does not, follow from the rows
(:func:`lacking`, :func:`missing_reason`). Adding a kind is one row here and one row in each
backend's site table.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

Width = Literal[
    "d_model", "d_mlp", "heads x keys", "heads x d_head", "kv_heads x d_head", "vocab", "experts", "experts per token"
]

Need = Literal[
    "attn_pre_norm",
    "mlp_pre_norm",
    "resid_mid",
    "dense_mlp",
    "gated_mlp",
    "gate_activation",
    "q_norm",
    "k_norm",
    "attn_post_norm",
    "mlp_post_norm",
    "moe",
    "key_softmax",
]
"""What a family may lack, and the kinds that need it:

- ``attn_pre_norm`` / ``mlp_pre_norm``: the attention / MLP reads a normed copy of the residual;
- ``resid_mid``: a residual between attention and MLP (not parallel attention);
- ``dense_mlp``: (some) layers have one MLP with a hidden layer; ``gated_mlp``: it is gated;
- ``gate_activation``: its gate's activation is applied by a module of its own, apart from the
  product with the linear branch (or fused with it in a kernel the backend can call on the gate alone);
- ``q_norm`` / ``k_norm``: a norm on the queries / keys;
- ``attn_post_norm`` / ``mlp_post_norm``: sandwich norms after the attention / MLP;
- ``moe``: (some) layers are mixtures of experts;
- ``key_softmax``: the attention's softmax runs over the keys alone (no sink logits)."""

NEEDS: tuple[Need, ...] = Need.__args__  # type: ignore[attr-defined]
"""Every :data:`Need`."""

IMPLIED: dict[Need, tuple[Need, ...]] = {"gated_mlp": ("dense_mlp",), "gate_activation": ("dense_mlp", "gated_mlp")}
"""What having a need implies: a gated MLP is a dense MLP; a gate activation is a gated MLP's."""


@dataclass(frozen=True)
class KindInfo:
    """What one address kind means: whether it is per layer, its width, whether it can be written."""

    per_layer: bool
    width: Width
    writable: bool
    meaning: str
    order: int = 0
    """Where it is computed: inside a layer for per-layer kinds, in the whole model for the others
    (``embed`` first, ``logits`` last)."""
    needs: Need | None = None
    """What a family must have to serve it (``None``: every family has it)."""
    missing: str | None = None
    """Why a family may lack it (the default reason a backend gives with ``KindNotInFamily``)."""

    @property
    def per_head(self) -> bool:
        """Whether values keep a head axis (``[n_tokens, heads, d_head]``) and writes select heads."""
        return self.width in ("heads x d_head", "kv_heads x d_head")


_MOE = "it is not a mixture of experts"
_END = 1 << 30  # after every layer

KINDS: dict[str, KindInfo] = {
    "embed": KindInfo(False, "d_model", True, "token (+ position) embedding entering layer 0", order=-1),
    "resid_pre": KindInfo(True, "d_model", True, "residual stream entering layer L", order=0),
    "resid_mid": KindInfo(
        True,
        "d_model",
        True,
        "residual after attention, before the MLP",
        order=140,
        needs="resid_mid",
        missing="there is no residual between its attention and MLP",
    ),
    "resid_post": KindInfo(True, "d_model", True, "residual stream leaving layer L", order=240),
    "attn_out": KindInfo(
        True,
        "d_model",
        True,
        "the attention sublayer's output (after its output projection, before any post-norm)",
        order=120,
    ),
    "mlp_out": KindInfo(True, "d_model", True, "the MLP sublayer's output (before any post-norm)", order=220),
    "mlp_post": KindInfo(
        True,
        "d_mlp",
        True,
        "MLP hidden activations after the nonlinearity",
        order=210,
        needs="dense_mlp",
        missing="its MLPs are mixtures of experts: there is no single MLP hidden",
    ),
    "attn_pattern": KindInfo(True, "heads x keys", False, "attention probabilities", order=100),
    "final_norm": KindInfo(False, "d_model", True, "final norm output, input to the unembedding", order=_END),
    "logits": KindInfo(False, "vocab", False, "output logits (after any soft-cap or scaling)", order=_END + 2),
    "attn_q": KindInfo(
        True, "heads x d_head", False, "queries as the attention product uses them (after rotary, q-norm)", order=60
    ),
    "attn_k": KindInfo(
        True, "kv_heads x d_head", False, "keys as the attention product uses them (after rotary, k-norm)", order=70
    ),
    "attn_v": KindInfo(True, "kv_heads x d_head", True, "values, per key/value head", order=80),
    "attn_z": KindInfo(
        True, "heads x d_head", True, "each head's output, the input of the attention's output projection", order=110
    ),
    "attn_in": KindInfo(
        True,
        "d_model",
        True,
        "the attention sublayer's input, after its pre-norm",
        order=10,
        needs="attn_pre_norm",
        missing="its attention does not read a normed copy of the residual",
    ),
    "mlp_in": KindInfo(
        True,
        "d_model",
        True,
        "the MLP's input, after its pre-norm",
        order=150,
        needs="mlp_pre_norm",
        missing="its MLP does not read a normed copy of the residual",
    ),
    "mlp_pre": KindInfo(
        True,
        "d_mlp",
        True,
        "MLP pre-activation (gated MLPs: the gate branch)",
        order=190,
        needs="dense_mlp",
        missing="its MLPs are mixtures of experts: there is no single MLP hidden",
    ),
    "mlp_gate_act": KindInfo(
        True,
        "d_mlp",
        False,
        "gated MLPs: the gate branch after its activation, act(mlp_pre), before it multiplies mlp_pre_linear",
        order=195,
        needs="gate_activation",
        missing="its MLP is not gated (one up projection and an activation: its output is mlp_post)",
    ),
    "mlp_pre_linear": KindInfo(
        True,
        "d_mlp",
        True,
        "gated MLPs: the linear (up) branch",
        order=200,
        needs="gated_mlp",
        missing="its MLP is not gated (one up projection and an activation: use mlp_pre)",
    ),
    "attn_scores": KindInfo(
        True,
        "heads x keys",
        False,
        "pre-softmax attention scores with the model's scaling, soft-cap, window and mask (-inf where masked)",
        order=90,
        needs="key_softmax",
        missing="its attention also normalises over a sink logit per head: there are no scores over the keys alone",
    ),
    "q_norm_in": KindInfo(
        True,
        "heads x d_head",
        True,
        "queries entering the q-norm (before rotary)",
        order=20,
        needs="q_norm",
        missing="it has no q-norm",
    ),
    "q_norm_out": KindInfo(
        True,
        "heads x d_head",
        True,
        "queries leaving the q-norm (before rotary)",
        order=30,
        needs="q_norm",
        missing="it has no q-norm",
    ),
    "k_norm_in": KindInfo(
        True,
        "kv_heads x d_head",
        True,
        "keys entering the k-norm (before rotary)",
        order=40,
        needs="k_norm",
        missing="it has no k-norm",
    ),
    "k_norm_out": KindInfo(
        True,
        "kv_heads x d_head",
        True,
        "keys leaving the k-norm (before rotary)",
        order=50,
        needs="k_norm",
        missing="it has no k-norm",
    ),
    "attn_out_post": KindInfo(
        True,
        "d_model",
        True,
        "sandwich-norm families: the post-attention norm's output, added to the residual",
        order=130,
        needs="attn_post_norm",
        missing="it has no post-attention (sandwich) norm: attn_out is what is added to the residual",
    ),
    "mlp_out_post": KindInfo(
        True,
        "d_model",
        True,
        "sandwich-norm families: the post-MLP norm's output, added to the residual",
        order=230,
        needs="mlp_post_norm",
        missing="it has no post-MLP (sandwich) norm: mlp_out is what is added to the residual",
    ),
    "logits_raw": KindInfo(
        False,
        "vocab",
        False,
        "the bare unembedding of final_norm, before any logit soft-cap or scaling",
        order=_END + 1,
    ),
    "router_logits": KindInfo(
        True,
        "experts",
        True,
        "mixture-of-experts layers: the router's logits per expert, before softmax and top-k",
        order=160,
        needs="moe",
        missing=_MOE,
    ),
    "expert_indices": KindInfo(
        True,
        "experts per token",
        False,
        "mixture-of-experts layers: the experts each token is routed to (int64), in the router's order",
        order=170,
        needs="moe",
        missing=_MOE,
    ),
    "expert_weights": KindInfo(
        True,
        "experts per token",
        False,
        "mixture-of-experts layers: the weights the chosen experts' outputs are multiplied by "
        "(after the family's renormalisation), in the order of expert_indices",
        order=180,
        needs="moe",
        missing=_MOE,
    ),
}
"""The address vocabulary (TransformerLens meanings), in the order the documentation's table lists it."""

ALIASES: dict[str, str] = {
    "embeddings": "embed",
    "z": "attn_z",
    "value": "attn_v",
    "mlp_act": "mlp_post",
    "attn_probs": "attn_pattern",
    "lm_head": "logits_raw",
}
"""The public ``interp-engine`` package's point names that differ from ours, read as our kinds
(its other names -- ``attn_in``, ``mlp_pre``, ``q_norm_out``, ``attn_out_post``, ... -- are ours too,
with the same meaning). ``z`` holds the same values as our ``attn_z`` with the head axis kept
(``[n, heads, d_head]``; the public package flattens it to ``[n, heads * d_head]``)."""


def requirements(kind: str) -> tuple[Need, ...]:
    """Every need of ``kind``, implied ones first (``mlp_pre_linear``: a dense MLP, then a gated one);
    empty for a kind every family has."""
    need = KINDS[kind].needs
    return () if need is None else (*IMPLIED.get(need, ()), need)


def needing(need: Need) -> frozenset[str]:
    """The kinds a family lacking ``need`` cannot serve."""
    return frozenset(kind for kind, info in KINDS.items() if info.needs == need)


def lacking(has: Collection[Need]) -> frozenset[str]:
    """The kinds a family with exactly the needs ``has`` cannot serve."""
    return frozenset(kind for kind, info in KINDS.items() if info.needs is not None and info.needs not in has)


def missing_reason(kind: str) -> str:
    """Why a family may lack ``kind`` (its row's sentence, else a generic one)."""
    info = KINDS.get(kind)
    return info.missing if info is not None and info.missing else "its family has no such point"
