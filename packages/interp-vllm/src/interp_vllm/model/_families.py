"""Where one vLLM model keeps the parts interp-engine reads and writes: the result of resolving
its module tree (:func:`interp_vllm.model._resolve.resolve`).

vLLM reimplements most architectures (and serves others through its Transformers modeling
backend, with HF's modules), so these paths name vLLM's modules, not HF's: the decoder-layer
list, how a layer is called (which argument carries the hidden states, whether it defers the
residual add into the next norm, returning ``(hidden, residual)``), the attention block, the
attention kernel module that receives post-rotary queries and keys, the q/k norms where the
model has them, the MLP, the projection whose output holds the pre-activation (fused
``[gate | up]`` on gated MLPs), the down-projection, the post-sublayer (sandwich) norms, the
final norm, and for a mixture of experts the router and vLLM's fused-MoE runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from interp_engine.backend import KINDS, Need, lacking, requirements


def _needs(kind: str) -> tuple[Need, ...]:
    return requirements(kind) if kind in KINDS else ()


@dataclass(frozen=True)
class VllmFamily:
    """Module paths (relative to the model, ``layers`` and ``final_norm``; else to a decoder
    layer) and wiring of one resolved vLLM model."""

    name: str
    """vLLM's model class."""
    layers: str
    final_norm: str
    deferred_residual: bool = True
    """Layers take and return ``(hidden, residual)``: the stream is ``hidden + residual``."""
    hidden_arg: tuple[int, str] = (1, "hidden_states")
    """``(position, name)`` of the layer forward's hidden-states argument."""
    residual_arg: tuple[int, str] | None = (2, "residual")
    """``(position, name)`` of the deferred residual argument (``None``: not deferred)."""
    attn: str = "self_attn"
    attn_kernel: str = "self_attn.attn"
    """The ``Attention`` module called with post-rotary q, k and v."""
    attn_o_proj: str = "self_attn.o_proj"
    """The attention's output projection: its input is every head's output (``attn_z``)."""
    mlp: str = "mlp"
    """The MLP module ("": the layer holds the MLP's projections itself, as OPT's)."""
    mlp_in_at: str = "mlp"
    """The module whose input is ``mlp_in`` (the MLP, or its up projection when it has no module)."""
    mlp_out_at: str = "mlp"
    """The module whose output is ``mlp_out`` (the MLP, or its down projection)."""
    mlp_up: str | None = "mlp.gate_up_proj"
    """The projection whose output holds the MLP's pre-activation (``mlp_pre``)."""
    gated: bool = True
    """Whether :attr:`mlp_up`'s output is ``[gate | up]`` (per rank, under tensor parallelism):
    ``mlp_pre`` is its first half and ``mlp_pre_linear`` its second."""
    mlp_act: str | None = "mlp.act_fn"
    """A gated MLP's activation module, turning ``[gate | up]`` into ``act(gate) * up`` (its
    gate activation is ``mlp_gate_act``); ``None``: not gated, or none the resolver could check."""
    mlp_down: str | None = "mlp.down_proj"
    d_mlp: int = 0
    """The dense MLP's hidden width: the whole (unsharded) input of the first dense layer's
    :attr:`mlp_down` (0: no dense MLP)."""
    q_norm: str | None = None
    """The q-norm, where the model has one."""
    k_norm: str | None = None
    unembed: str = "lm_head"
    """The unembedding module the logits processor projects with (tied: the embedding)."""
    attn_post_norm: str | None = None
    """The post-attention (sandwich) norm, where the model has one: its output is ``attn_out_post``."""
    mlp_post_norm: str | None = None
    parallel: bool = False
    """The MLP reads the layer's input, not the residual after attention (GPT-NeoX, GPT-J, Phi)."""
    attn_scale: float = 1.0
    """What the layer multiplies the attention's contribution by before adding it (Granite)."""
    mlp_scale: float = 1.0
    """What the layer multiplies the MLP's contribution by before adding it (Granite)."""
    dense_mlp: bool = True
    """Whether (some) layers have a dense MLP (up and down projections)."""
    router: str | None = None
    """Mixtures of experts: the router (gate linear) whose output is ``router_logits``."""
    experts: str | None = None
    """Mixtures of experts: vLLM's fused-MoE runner (its ``router`` selects the experts)."""
    moe_layers: tuple[int, ...] = ()
    """The layers with a mixture of experts when only some have one (empty: all, or none)."""
    n_experts: int = 0
    experts_per_token: int = 0
    n_heads: int = 0
    """Query heads (the attention kernel's, times the tensor-parallel ranks)."""
    n_kv_heads: int = 0
    """Key/value heads (the kernel's, times the ranks; on one rank, exact whatever the config calls them)."""
    sinks: bool = False
    """The attention normalises over a learned sink logit per head besides the keys (gpt-oss):
    the pattern's rows sum to less than 1 and there are no scores over the keys alone."""
    batched: bool = False
    """The modules see ``[1, tokens, ...]`` (vLLM's Transformers modeling backend runs HF's
    modules on a batch of one); the attention kernel sees ``[tokens, ...]`` either way."""

    @property
    def attn_contrib(self) -> str:
        """The module whose output the layer adds to the residual after attention."""
        return self.attn_post_norm or self.attn

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (not self.moe_layers or layer in self.moe_layers)

    def has(self) -> frozenset[Need]:
        """What this model's layers have, of what some kinds need (:data:`interp_engine.backend.Need`)."""
        has: set[Need] = {"attn_pre_norm", "mlp_pre_norm", "resid_mid"}
        if self.dense_mlp:
            has.add("dense_mlp")
            if self.gated:
                has.add("gated_mlp")
                if self.mlp_act is not None:
                    has.add("gate_activation")
        if self.is_moe:
            has.add("moe")
        if self.q_norm is not None:
            has.add("q_norm")
        if self.k_norm is not None:
            has.add("k_norm")
        if self.attn_post_norm is not None:
            has.add("attn_post_norm")
        if self.mlp_post_norm is not None:
            has.add("mlp_post_norm")
        if not self.sinks:
            has.add("key_softmax")
        return frozenset(has)

    def lacks(self) -> frozenset[str]:
        """The address kinds this model does not have."""
        return lacking(self.has())

    def missing_reason(self, kind: str) -> str | None:
        """Why this model lacks ``kind``, where the core's generic reason would mislead."""
        if self.is_moe and not self.dense_mlp and "dense_mlp" in _needs(kind):
            return (
                "its MLPs are mixtures of experts: there is no single MLP hidden (read router_logits, "
                "expert_indices, expert_weights, or mlp_out, the whole block's output)"
            )
        if self.gated and self.mlp_act is None and "gate_activation" in _needs(kind):
            return "its gated MLP applies its activation in no module whose gate activation could be read alone"
        if self.sinks and "key_softmax" in _needs(kind):
            return (
                "its attention also normalises over a sink logit per head: there are no scores over the "
                "keys alone (attn_pattern is served, its rows summing to 1 minus the sink's share)"
            )
        return None

    def layer_lacks(self, kind: str, layer: int) -> str | None:
        """Why ``kind`` does not exist at ``layer`` (``None``: it does), for models whose layers
        differ (dense and mixture-of-experts layers mixed)."""
        moe = self.is_moe_layer(layer)
        needs = _needs(kind)
        if moe and "dense_mlp" in needs:
            return (
                f"layer {layer} is a mixture of experts: there is no single MLP hidden "
                "(read router_logits, expert_indices, expert_weights or mlp_out)"
            )
        if not moe and "moe" in needs:
            return f"layer {layer} has a dense MLP, not a mixture of experts"
        return None
