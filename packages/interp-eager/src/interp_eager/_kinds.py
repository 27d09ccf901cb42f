"""What each address kind needs of a model family, whatever the backend: the kind facts the eager
backend reads (one place, so that they can join the core's per-kind rows).

A kind listed in :data:`NEEDS` is served only by a model that has every feature it names; the
eager backend tells whether a loaded model has each feature (:data:`interp_eager._sites.FEATURES`)
and, where one is missing, why. A kind not listed is served by every model.
"""

from __future__ import annotations

from typing import Literal

Feature = Literal[
    "q_norm", "k_norm", "sandwich_norms", "mid_residual", "sink_free_attention", "moe", "dense_mlp", "gated_mlp"
]
"""A part or property of a family some kinds need: a q-norm, a k-norm, a norm after each sublayer
(sandwich norms), a residual between attention and MLP (no post-norm block), attention whose
softmax is over the keys alone (no learned sinks), mixture-of-experts layers, dense-MLP layers,
a gated MLP."""

NEEDS: dict[str, tuple[Feature, ...]] = {
    "q_norm_in": ("q_norm",),
    "q_norm_out": ("q_norm",),
    "k_norm_in": ("k_norm",),
    "k_norm_out": ("k_norm",),
    "attn_scores": ("sink_free_attention",),
    "attn_out_post": ("sandwich_norms",),
    "resid_mid": ("mid_residual",),
    "router_logits": ("moe",),
    "expert_indices": ("moe",),
    "expert_weights": ("moe",),
    "mlp_pre": ("dense_mlp",),
    "mlp_pre_linear": ("dense_mlp", "gated_mlp"),
    "mlp_post": ("dense_mlp",),
    "mlp_out_post": ("sandwich_norms",),
}
"""The features each kind needs, in the order a missing one is reported."""
