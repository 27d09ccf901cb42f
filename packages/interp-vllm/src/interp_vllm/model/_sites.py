"""Where each address kind lives in vLLM's modules, and how tensor parallelism splits it.

One table, read by the dynamic worker (:mod:`..worker._manager`), the static worker
(:mod:`..static._worker`) and the front end (which merges ranks): a new address kind on vLLM is
one :class:`VllmSite` entry (plus its shard rule), not edits in each of them.

A site names a hook:

- ``layer_in`` / ``layer_out``: the decoder layer's input / output residual stream. vLLM's
  layers defer the residual add (they take and return ``(hidden, residual)``), so the value is
  ``hidden + residual`` and a write hands the layer ``(new_stream, 0)`` instead;
- ``input``: argument ``arg`` of a module (by position, or by name when the caller passes it as
  a keyword: vLLM's Llama calls ``self_attn(positions=..., hidden_states=...)``), e.g. the
  attention kernel's ``q, k, v``, the output projection's input, the attention's input;
- ``output``: a module's output (its first element when it returns a tuple, as vLLM's linear
  layers do); ``part`` picks the gate or the up half of a fused ``gate_up_proj`` output;
- ``model_out``: the model's final hidden states (``final_norm``; ``logits_raw`` through the bare
  unembedding, ``logits`` through the served one with its soft-cap and scaling).

``derived`` kinds are computed from other values at the same hook instead of read: ``resid_mid``
is the stashed ``resid_pre`` plus what the layer adds after attention (a write there moves that
by the same amount, so both the MLP and the residual see it, where vLLM forms the sum);
``attn_scores`` are the post-rotary queries times the keys the kernel receives, with the kernel's
scale, soft-cap, causal mask and sliding window, and ``attn_pattern`` their softmax;
``mlp_gate_act`` is the gate half of the fused ``[gate | up]`` output through the family's own
activation module (``activated``); ``expert_indices`` / ``expert_weights`` are vLLM's own routing
function (the fused-MoE runner's router) applied to the router's logits, after any write there.
Per-head kinds are ``[tokens, heads * d_head]`` in vLLM and ``[tokens, heads, d_head]`` to us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from interp_engine import KINDS, Address, Write

from ._families import VllmFamily

Where = Literal["layer_in", "layer_out", "input", "output", "model_out"]
Shard = Literal["last", "heads", "kv_heads"]
Part = Literal["gate", "up"]
HookKey = tuple[Where, str | None, int]
"""``(where, module field, layer)``: addresses with equal keys are served by one hook."""


@dataclass(frozen=True)
class VllmSite:
    """One address kind in vLLM's modules."""

    kind: str
    where: Where
    module: str | None = None
    """The :class:`~interp_vllm.model._families.VllmFamily` field naming the module (``None``: the layer)."""
    arg: int = 0
    """For ``input`` sites: which positional argument."""
    arg_name: str | None = None
    """For ``input`` sites: the argument's name, used when the caller passes it by keyword."""
    part: Part | None = None
    """For the output of a fused ``[gate | up]`` projection: which half (a family whose MLP is
    not gated has one pre-activation, the whole output)."""
    shard: Shard | None = None
    """How tensor parallelism splits the value: ``last`` (columns), ``heads``, ``kv_heads``
    (split, or replicated when there are fewer key/value heads than ranks), ``None`` (whole)."""
    derived: bool = False
    """Computed at the hook from other values (see the module docstring), not read directly."""
    how: Literal["hook", "recompute"] = "hook"
    """How the value is had, as ``points()`` reports it: read at the hook, or recomputed there
    from what the hook sees (the scores from q and k, the gate's activation, the routing from the
    router's logits, the bare unembedding)."""
    static_write: bool = True
    """Whether vllm-static can apply writes here in-graph."""
    added: Literal["attn", "mlp"] | None = None
    """A sublayer's output as the residual receives it: the hooked tensor times the family's
    multiplier of that sublayer's contribution (:func:`added_scale`), where this kind is what is added."""
    activated: bool = False
    """The hooked half passed through the family's gate activation (:func:`gate_activation`): a
    gated MLP's ``act(gate)``, which vLLM's fused ``act(gate) * up`` kernels never hold apart."""
    routed: Literal["ids", "weights"] | None = None
    """Computed by vLLM's routing function from the router's logits at the same hook (the experts
    chosen and their weights); vllm-static taps the logits (:data:`ROUTER_KIND`) and routes on the host."""

    @property
    def per_head(self) -> bool:
        return KINDS[self.kind].per_head


SITES: dict[str, VllmSite] = {
    site.kind: site
    for site in (
        # in the order values are computed at a shared hook
        VllmSite("embed", "layer_in"),
        VllmSite("resid_pre", "layer_in"),
        VllmSite("attn_in", "input", "attn", arg=1, arg_name="hidden_states"),
        VllmSite("q_norm_in", "input", "q_norm", shard="heads"),
        VllmSite("q_norm_out", "output", "q_norm", shard="heads"),
        VllmSite("k_norm_in", "input", "k_norm", shard="kv_heads"),
        VllmSite("k_norm_out", "output", "k_norm", shard="kv_heads"),
        VllmSite("attn_q", "input", "attn_kernel", arg=0, shard="heads", static_write=False),
        VllmSite("attn_k", "input", "attn_kernel", arg=1, shard="kv_heads", static_write=False),
        VllmSite("attn_v", "input", "attn_kernel", arg=2, shard="kv_heads"),
        VllmSite(
            "attn_scores", "input", "attn_kernel", shard="heads", derived=True, how="recompute", static_write=False
        ),
        VllmSite(
            "attn_pattern", "input", "attn_kernel", shard="heads", derived=True, how="recompute", static_write=False
        ),
        VllmSite("attn_z", "input", "attn_o_proj", shard="heads"),
        VllmSite("attn_out", "output", "attn", added="attn"),
        VllmSite("attn_out_post", "output", "attn_post_norm", added="attn"),
        VllmSite("resid_mid", "output", "attn_contrib", derived=True),
        VllmSite("mlp_in", "input", "mlp_in_at", arg=0, arg_name="hidden_states"),
        # mixtures of experts: the router's output, and vLLM's routing function applied to it
        VllmSite("router_logits", "output", "router"),
        VllmSite("expert_indices", "output", "router", derived=True, how="recompute", static_write=False, routed="ids"),
        VllmSite(
            "expert_weights", "output", "router", derived=True, how="recompute", static_write=False, routed="weights"
        ),
        VllmSite("mlp_pre", "output", "mlp_up", shard="last", part="gate"),
        VllmSite("mlp_gate_act", "output", "mlp_up", shard="last", part="gate", how="recompute", activated=True),
        VllmSite("mlp_pre_linear", "output", "mlp_up", shard="last", part="up"),
        VllmSite("mlp_post", "input", "mlp_down", shard="last"),
        VllmSite("mlp_out", "output", "mlp_out_at", added="mlp"),
        VllmSite("mlp_out_post", "output", "mlp_post_norm", added="mlp"),
        VllmSite("resid_post", "layer_out"),
        VllmSite("final_norm", "model_out"),
        VllmSite("logits_raw", "model_out", how="recompute", static_write=False),
        VllmSite("logits", "model_out", static_write=False),
    )
}
"""Every kind the vLLM backends serve (a family may lack some: :meth:`VllmFamily.lacks`)."""

ROUTER_KIND = "router_logits"
"""The kind whose values the routed kinds are computed from."""

POINT_KINDS = tuple(SITES)
WRITE_KINDS = tuple(kind for kind, site in SITES.items() if KINDS[kind].writable)
STATIC_WRITE_KINDS = tuple(kind for kind in WRITE_KINDS if SITES[kind].static_write)


def hook_key(address: Address, family: VllmFamily | None = None) -> HookKey:
    """The hook an address is served at: addresses with equal keys share one hook (``family``
    resolves ``attn_contrib``, the module whose output is added to the residual after attention,
    so that ``resid_mid`` shares its hook with ``attn_out`` or ``attn_out_post``)."""
    site = SITES[address.kind]
    module = site.module
    if module == "attn_contrib":
        module = "attn_post_norm" if family is not None and family.attn_post_norm else "attn"
    return site.where, module, address.layer or 0


def columns(site: VllmSite, family: VllmFamily) -> tuple[int, int] | None:
    """``(index, parts)``: the site's value is part ``index`` of ``parts`` equal column blocks of the
    hooked tensor (the gate or up half of a fused ``gate_up_proj``); ``None``: all of it."""
    if site.part is None or not family.gated:
        return None
    return (0 if site.part == "gate" else 1), 2


def gate_activation(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor) -> torch.Tensor:
    """``act(gate)`` through a fused ``act(x[:d]) * x[d:]`` module (the family's
    :attr:`~interp_vllm.model._families.VllmFamily.mlp_act`): the module applied to ``[gate | 1]``."""
    out: torch.Tensor = act(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    return out


def added_scale(site: VllmSite, family: VllmFamily) -> float:
    """What the hooked tensor is multiplied by to give the site's value (a write hands back
    ``value / scale``): the layer's multiplier of a sublayer's contribution (Granite's residual
    multiplier) at the point that is added to the residual -- the sublayer's output, or its
    post-norm's where the family has one; 1 elsewhere."""
    if site.added is None:
        return 1.0
    post = family.attn_post_norm if site.added == "attn" else family.mlp_post_norm
    if site.kind.endswith("_post") != (post is not None):
        return 1.0
    return family.attn_scale if site.added == "attn" else family.mlp_scale


# -- tensor parallelism --------------------------------------------------------------------------


def owned_heads(rank: int, tp_size: int, total: int) -> list[int]:
    """The global head indices rank ``rank`` holds, in its local order. vLLM splits heads
    evenly; with fewer key/value heads than ranks each rank holds one, replicated."""
    if total >= tp_size:
        per = total // tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * total // tp_size]


def local_write(write: Write, site: VllmSite, rank: int, tp_size: int, total_heads: int, width: int) -> Write | None:
    """This rank's part of ``write`` (``None``: nothing of it lives on this rank).

    Per-head writes keep the heads this rank holds, renumbered locally, with their vector (and
    target) rows; ``last``-sharded writes (``mlp_post``) keep this rank's columns (``width`` of them)."""
    target = write.target
    if site.per_head:
        heads = list(write.heads) if write.heads is not None else list(range(total_heads))
        owned = owned_heads(rank, tp_size, total_heads) if tp_size > 1 else list(range(total_heads))
        pairs = [(owned.index(h), i) for i, h in enumerate(heads) if h in owned]
        if not pairs:
            return None
        picked = [i for _, i in pairs]
        vector = write.vector
        if write.head_rows is not None:
            vector = vector[..., picked, :]
        if target is not None and write.target_head_rows is not None:
            target = target[..., picked, :]
        return replace(write, vector=vector, target=target, heads=tuple(local for local, _ in pairs))
    if site.shard == "last" and write.vector.shape[-1] != width:
        cols = slice(rank * width, (rank + 1) * width)
        return replace(write, vector=write.vector[..., cols], target=None if target is None else target[..., cols])
    return write


def merge_ranks(address: Address, values: list[torch.Tensor], total_heads: int) -> torch.Tensor:
    """One value from every rank's part (``[tokens, ...]`` each)."""
    site = SITES[address.kind]
    if site.shard is None or len(values) == 1:
        return values[0]
    if site.shard == "last":
        return torch.cat(values, dim=-1)
    tp_size = len(values)
    if total_heads < tp_size:  # replicated key/value heads: one copy of each
        return torch.cat([values[h * tp_size // total_heads] for h in range(total_heads)], dim=1)
    return torch.cat(values, dim=1)  # [tokens, heads, ...] split on heads
