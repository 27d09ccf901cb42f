"""Interception: where the eager backend reads what no module hook sees.

*Attention taps* (:func:`add_attention_tap`) hand a plan what a layer's attention function
receives -- queries, keys (cached ones included), values, mask, scaling and soft-cap -- after
rotary embeddings and q/k norms. Transformers' attention interface calls them (its
``get_interface`` hands out tapped functions: :func:`interp_eager._compat.tap_attention_interface`);
a family's own attention method (GPT-J's ``_attn``) is shadowed on the instance; an attention
module computing attention in its own forward (Bloom, Falcon, MPT, XGLM) runs under a torch
function mode that keeps the operands of its ``q @ k^T`` product, what its softmax receives (ALiBi
biases included) and the values the softmax's output multiplies. :func:`attention_scores` rebuilds
the pre-softmax scores from a call with the eager attention's own operations.

*Router taps* (:func:`add_router_tap`) hand a plan the logits a mixture of experts' router
computes -- the first linear map to ``n_experts`` outputs it runs -- and let the router route from
what the plan returns, so a write there reroutes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._compat import tap_attention_interface

# -- attention taps: what an attention function receives -----------------------------------------

_TAPS = "_interp_engine_attention_taps"


@dataclass(frozen=True)
class AttentionCall:
    """One call of a module's attention function, as received: queries ``[batch, heads, queries,
    d_head]``, keys ``[batch, kv_heads, keys, d_head]`` (cached ones included, the current tokens
    last), the mask (``None``: causal; bool: ``True`` where attended; float: added to the scores),
    and the ``scaling`` and ``softcap`` arguments when given."""

    module: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None = None
    softcap: float | None = None
    value: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    """Per-head learned sink logits the softmax also normalises over (gpt-oss's ``s_aux``)."""
    scores: torch.Tensor | None = None
    """What the method's softmax received (an own attention method read at its softmax: GPT-Neo)."""


AttentionTap = Callable[[AttentionCall], AttentionCall | None]
"""Called with what an attention function received. Where taps run before the function
(transformers' attention interface; a family's own method whose scores are not read at its
softmax), a returned call's query and key are what the function then receives (a gradient
probe's ``x + delta``); elsewhere the return value is ignored."""


def _mask_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The attention mask among the arguments after ``(query, key, value)``."""
    return args[0] if args else kwargs.get("attention_mask")


def attention_scores(call: AttentionCall, *, divisor: str | None = None) -> torch.Tensor:
    """The pre-softmax scores ``[batch, heads, queries, keys]`` of ``call`` as its softmax sees
    them: ``q @ k^T`` times ``scaling`` (default ``d_head ** -0.5``; with ``divisor``, divided by
    that attribute of the module, in float32, as GPT-J's ``_attn`` does), soft-capped where
    ``softcap`` is given, the mask applied; ``-inf`` where masked. The operations are the eager
    attention's own, in its order, so ``softmax`` of the result is its attention weights."""
    if call.scores is not None:  # read at the method's softmax: masked entries hold (about) the dtype's minimum
        scores = call.scores
        return scores.masked_fill(scores <= torch.finfo(scores.dtype).min / _MASKED, float("-inf"))
    query, key = call.query, call.key
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    if divisor is not None:
        scores = torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))
        scores = scores / getattr(call.module, divisor)
    else:
        scaling = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    mask = call.attention_mask
    n_queries, n_keys = scores.shape[-2:]
    if mask is None:  # SDPA's causal mask: the queries are the last tokens
        position = torch.arange(n_queries, device=scores.device) + (n_keys - n_queries)
        visible = torch.arange(n_keys, device=scores.device) <= position[:, None]
        return scores.masked_fill(~visible, float("-inf"))
    mask = mask[..., :n_keys]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return (scores + mask).masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))


_MASKED = 64
"""Scores read at a softmax at or below the dtype's minimum over this are masked (``-inf``): a
mask adds (or fills) the minimum, and some families scale it afterwards (CodeGen divides the
masked scores by ``sqrt(d_head)``)."""


def _run_taps(module: Any, make_call: Callable[[], AttentionCall]) -> AttentionCall | None:
    """Run ``module``'s taps; the call as the last tap left it (``None`` without taps)."""
    taps = getattr(module, "__dict__", {}).get(_TAPS)
    if not taps:
        return None
    call = make_call()
    for tap in tuple(taps):
        call = tap(call) or call
    return call


_interface_taps = 0
"""How many modules have taps that transformers' attention interface calls; while none has, a
lookup hands out the attention function itself (every other model in the process runs as if
unpatched)."""
_count_lock = threading.Lock()


def _count_interface_taps(change: int) -> None:
    global _interface_taps
    with _count_lock:
        _interface_taps += change


def _tapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (an attention implementation) calling the taps of the module it runs for
    (a fresh closure per lookup: caching them would keep every function ever looked up alive);
    ``function`` itself while no module has such taps (they are installed before the forward
    whose lookups should see them)."""
    if not _interface_taps:
        return function

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
        call = _run_taps(
            module,
            lambda: AttentionCall(
                module, query, key, _mask_argument(a, kw), kw.get("scaling"), kw.get("softcap"), value, kw.get("s_aux")
            ),
        )
        if call is not None:
            query, key = call.query, call.key
        return function(module, query, key, value, *a, **kw)

    return attention


class _TapHandle:
    def __init__(self, module: nn.Module, tap: AttentionTap, method: str | None, prior: Any = None) -> None:
        self.module, self.tap, self.method, self.prior = module, tap, method, prior

    def remove(self) -> None:
        taps: list[AttentionTap] = self.module.__dict__.get(_TAPS, [])
        if self.tap in taps:
            taps.remove(self.tap)
            if not taps and self.method is None:
                _count_interface_taps(-1)
        if not taps:
            self.module.__dict__.pop(_TAPS, None)
            if self.method is not None:
                self.module.__dict__.pop(self.method, None)
                if self.prior is not None:  # a forward set on the instance before (accelerate's hooks)
                    self.module.__dict__[self.method] = self.prior


def attention_owner(attention: nn.Module, attn_fn: str | None) -> tuple[nn.Module, str | None]:
    """The module that owns a family's own attention method and the method's name: ``attn_fn`` is
    relative to the attention module (``"_attn"``; GPT-Neo's ``"attention._attn"``)."""
    if attn_fn is None or "." not in attn_fn:
        return attention, attn_fn
    path, method = attn_fn.rsplit(".", 1)
    owner = attention.get_submodule(path)
    return owner, method


class _SoftmaxInput(TorchFunctionMode):
    """While an attention method runs: keep what its first softmax receives (the masked scores)."""

    _SOFTMAX = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax})

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.scores is None and func in self._SOFTMAX and args and isinstance(args[0], torch.Tensor):
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


_PRODUCTS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
    | {torch.baddbmm, torch.Tensor.baddbmm}
)


def _operands(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The two multiplied operands of a product call (``baddbmm``'s ``batch1``, ``batch2``)."""
    if func in (torch.baddbmm, torch.Tensor.baddbmm):
        rest = list(args[1:])
        first = kwargs.get("batch1", rest.pop(0) if rest else None)
        second = kwargs.get("batch2", rest.pop(0) if rest else None)
        return first, second
    return (args[0] if args else kwargs.get("input")), (args[1] if len(args) > 1 else kwargs.get("other"))


class _AttentionProducts(TorchFunctionMode):
    """While an attention module's own forward runs: the operands of the ``q @ k^T`` product whose
    result its first softmax normalises, what that softmax receives, and the operand the softmax's
    output multiplies (the values); or the query, key and value ``scaled_dot_product_attention``
    receives."""

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qk: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scores: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and self.qk is None:
            given = [*args[:3], *(kwargs[n] for n in ("query", "key", "value") if n in kwargs)]
            query, key, value = given[:3]
            self.qk = (query.detach(), key.detach().transpose(-1, -2))
            self.value = value.detach()
        elif func in _PRODUCTS:
            first, second = _operands(func, args, kwargs)
            if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
                if self.scores is None:
                    self.last = (first.detach(), second.detach())
                elif self.value is None:
                    self.value = second.detach()
        elif func in _SoftmaxInput._SOFTMAX and self.scores is None and args and isinstance(args[0], torch.Tensor):
            self.scores = args[0].detach().clone()
            self.qk = self.last
        return func(*args, **kwargs)

    def call(self, module: nn.Module, hidden: Any) -> AttentionCall | None:
        """The :class:`AttentionCall` seen (``[batch, heads, tokens, ...]``), ``None`` if none was."""
        if self.qk is None or self.value is None or not isinstance(hidden, torch.Tensor):
            return None
        batch = int(hidden.shape[0])
        q, k_t = self.qk

        def split(x: torch.Tensor) -> torch.Tensor:  # [..., n, w] -> [batch, heads, n, w]
            return x.reshape(batch, -1, *x.shape[-2:])

        scores = None if self.scores is None else split(self.scores)
        return AttentionCall(
            module, split(q), split(k_t.transpose(-1, -2)), None, value=split(self.value), scores=scores
        )


def add_attention_tap(
    module: nn.Module, tap: AttentionTap, *, method: str | None = None, scores_at_softmax: bool = False
) -> _TapHandle:
    """Call ``tap(call)`` each time ``module``'s attention function runs, with an
    :class:`AttentionCall` holding what it received (keys include any cached ones, the current
    tokens last). ``method`` names the module's own attention method, called as
    ``method(query, key, value, attention_mask)``, when the family does not use transformers'
    attention interface (GPT-J's and GPT-Neo's ``_attn``); it is shadowed on the instance while
    taps are installed, and, with ``scores_at_softmax``, the call also carries what the method's
    softmax received. ``method="forward"``: the module computes attention in its own forward
    (Bloom, Falcon, MPT, XGLM), shadowed on the instance to run under :class:`_AttentionProducts`;
    the call carries the operands of its ``q @ k^T`` product, what its softmax received and the
    values its output multiplies, split per head by the batch size of the module's input. Remove
    with the returned handle's ``remove()``."""
    taps: list[AttentionTap] = module.__dict__.setdefault(_TAPS, [])
    prior = None
    if not taps:
        if method is None:
            tap_attention_interface(_tapped)
            _count_interface_taps(1)
        elif method == "forward":  # the module's own attention computation: read at its products
            prior = module.__dict__.get("forward")
            original_forward = module.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                with _AttentionProducts() as seen:
                    result = original_forward(*args, **kwargs)
                hidden = args[0] if args else kwargs.get("hidden_states")
                call = seen.call(module, hidden)
                if call is not None:
                    _run_taps(module, lambda: call)
                return result

            module.__dict__["forward"] = forward
        else:
            original = getattr(module, method)

            def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
                if not scores_at_softmax:
                    tapped = _run_taps(
                        module, lambda: AttentionCall(module, query, key, _mask_argument(a, kw), value=value)
                    )
                    if tapped is not None:
                        query, key = tapped.query, tapped.key
                    return original(query, key, value, *a, **kw)
                with _SoftmaxInput() as seen:
                    result = original(query, key, value, *a, **kw)
                mask = _mask_argument(a, kw)
                _run_taps(module, lambda: AttentionCall(module, query, key, mask, value=value, scores=seen.scores))
                return result

            module.__dict__[method] = call
    taps.append(tap)
    return _TapHandle(module, tap, method, prior)


# -- router taps: a mixture of experts' logits, where the router computes them --------------------


class _RouterLogits(TorchFunctionMode):
    """While a router runs: hand the output of its first linear map to ``n_experts`` columns (its
    logits) to ``handle``, and let the router route from what ``handle`` returns."""

    _LINEAR = frozenset({torch.nn.functional.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.addmm})

    def __init__(self, n_experts: int, handle: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.handle = handle
        self.done = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            not self.done
            and func in self._LINEAR
            and isinstance(result, torch.Tensor)
            and result.is_floating_point()
            and result.shape[-1] == self.n_experts
        ):
            self.done = True
            result = self.handle(result)
        return result


class _RouterHandle:
    def __init__(self, module: nn.Module, prior: Any) -> None:
        self.module, self.prior = module, prior

    def remove(self) -> None:
        if self.prior is None:
            self.module.__dict__.pop("forward", None)
        else:  # a forward set on the instance before (accelerate's hooks): put it back
            self.module.__dict__["forward"] = self.prior


def add_router_tap(module: nn.Module, n_experts: int, handle: Callable[[torch.Tensor], torch.Tensor]) -> _RouterHandle:
    """Call ``handle(logits)`` with the router logits ``module`` (a mixture of experts' router)
    computes in each forward -- the first linear map to ``n_experts`` outputs it runs -- and route
    from the tensor it returns (so a write there reroutes). The module's ``forward`` is shadowed on
    the instance until the returned handle's ``remove()``."""
    prior = module.__dict__.get("forward")
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _RouterLogits(n_experts, handle):
            return original(*args, **kwargs)

    module.__dict__["forward"] = forward
    return _RouterHandle(module, prior)
