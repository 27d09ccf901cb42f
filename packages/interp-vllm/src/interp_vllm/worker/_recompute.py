"""What the worker computes from what vLLM computed: the routing of router logits (vLLM's own
routing function), attention scores and probabilities from the post-rotary queries and keys the
kernel received, and the model-output reads (final norm, bare and served logits)."""

from __future__ import annotations

from typing import Any

import torch

from interp_engine import Address

from .. import _compat
from ..hooks import attr_path, copy_rows
from ..model._sites import SITES
from ._capture import Captures
from ._request_taps import Hook, Slice
from ._state import TapState


class Recompute:
    """The part of the taps that computes values vLLM does not hand over whole: routing,
    attention scores and patterns, and the model's output reads (recorded through ``captures``)."""

    def __init__(self, state: TapState, captures: Captures) -> None:
        self.state = state
        self.captures = captures

    def route(self, layer: int, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert weights, expert indices)`` for router logits at ``layer``: vLLM's own routing
        function (the fused-MoE runner's router: its top-k, scoring and renormalisation)."""
        runner = attr_path(self.state.layers[layer], self.state.family.experts or "")
        weights, ids = runner.router.select_experts(hidden_states=hidden, router_logits=logits)
        return weights, ids

    def record_routing(self, routed: tuple[torch.Tensor, torch.Tensor], members: list[Slice], address: Address) -> None:
        weights, ids = routed
        for sl in members:
            if address in sl.taps.points:
                if SITES[address.kind].routed == "ids":  # the experts' indices, int64
                    value = ids[sl.start : sl.end].to("cpu", torch.int64, copy=True)
                else:
                    value = copy_rows(weights[sl.start : sl.end])
                sl.taps.values[address].append((sl.positions, value))

    def _kernel_geometry(self, layer: int) -> tuple[int, float, float | None, int | None]:
        kernel = attr_path(self.state.layers[layer], self.state.family.attn_kernel)
        head = int(kernel.head_size)
        scale = float(getattr(kernel.impl, "scale", head**-0.5))
        cap = getattr(kernel.impl, "logits_soft_cap", None)
        window = getattr(kernel, "sliding_window", None)
        return head, scale, cap, window

    def attention(self, sl: Slice, address: Address, query: torch.Tensor, key: torch.Tensor) -> None:
        """Record ``attn_scores`` or ``attn_pattern`` of ``sl``'s queries from the post-rotary
        ``query`` and ``key`` rows of this step; earlier steps' keys are kept per request (once
        per step, however many of the two are asked for)."""
        layer = address.layer or 0
        head, scale, cap, window = self._kernel_geometry(layer)
        n = sl.end - sl.start
        q = query.float().reshape(n, -1, head)
        step = int(sl.taps.steps)
        seen = sl.taps.keys.get(layer)
        if seen is None or seen[2] != step:  # this step's keys are not in yet
            k = key.to("cpu", torch.float32, copy=True).reshape(n, -1, head)  # kept across steps: never a view
            if seen is not None and int(sl.positions[0]) > 0:
                key_pos, keys = torch.cat([seen[0], sl.positions]), torch.cat([seen[1], k])
            else:
                key_pos, keys = sl.positions.clone(), k
            sl.taps.keys[layer] = (key_pos, keys, step)
        key_pos, keys, _ = sl.taps.keys[layer]
        keys = keys.to(q.device).repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        q_pos = sl.positions.to(q.device)[:, None]
        k_pos = key_pos.to(q.device)[None, :]
        hidden_keys = k_pos > q_pos
        if window:
            hidden_keys |= k_pos <= q_pos - int(window)
        scores = scores.masked_fill(hidden_keys, float("-inf"))
        if address.kind == "attn_pattern":
            sinks = getattr(attr_path(self.state.layers[layer], self.state.family.attn_kernel).impl, "sinks", None)
            if sinks is None:
                value = scores.softmax(-1)  # [heads, q, keys], keys in position order
            else:  # one more logit per head in the softmax's denominator (gpt-oss), then dropped
                sink = sinks.float().to(scores.device)[:, None, None].expand(-1, scores.shape[1], 1)
                value = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            fill = 0.0
        else:
            value, fill = scores, float("-inf")
        full = torch.full((value.shape[0], value.shape[1], int(key_pos.max()) + 1), fill)
        full[:, :, key_pos] = value.cpu()
        sl.taps.values[address].append((sl.positions, full.permute(1, 0, 2)))

    def read_output(self, output: Any, hook: Hook) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        final, bare, served = Address("final_norm"), Address("logits_raw"), Address("logits")
        if hook.members.get(final):
            self.captures.capture(final, hidden, hook.members[final])
        for sl in hook.members.get(bare, ()):  # every rank joins the gather (a TP collective)
            self.captures.capture(bare, self.unembed(hidden[sl.start : sl.end]), [sl], base=sl.start)
        for sl in hook.members.get(served, ()):  # every rank computes logits (a TP collective)
            logits = self.state.model.compute_logits(hidden[sl.start : sl.end])  # type: ignore[operator]
            self.captures.capture(served, logits, [sl], base=sl.start)

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The bare unembedding of final-norm outputs: what vLLM's logits processor computes
        before its soft-cap and scaling (gathered over ranks, vocabulary padding removed)."""
        processor = getattr(self.state.model, "logits_processor", None)
        head = attr_path(self.state.model, self.state.family.unembed)
        bias = getattr(head, "bias", None)  # a biased unembedding (GPT-J, Phi): part of the bare logits
        logits: torch.Tensor = _compat.bare_logits(
            processor, hidden, head, bias if isinstance(bias, torch.Tensor) else None
        )
        return logits
