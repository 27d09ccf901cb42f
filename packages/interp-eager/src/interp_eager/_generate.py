"""Token choice for generation: greedy by default, sampling when the checked options ask for it.

The options themselves (names, ranges, the ``InvalidOption`` for a bad one) are the core's
:class:`~interp_engine.SamplingOptions`; this module only applies them to logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from interp_engine import BackendError, InvalidSteering, SamplingOptions


def generator_for(options: SamplingOptions, device: torch.device) -> torch.Generator | None:
    """A seeded generator for this request's sampling (``None``: greedy or unseeded)."""
    if options.greedy or options.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(options.seed)
    return gen


def choose(
    options: SamplingOptions,
    logits: torch.Tensor,
    generator: torch.Generator | None,
    *,
    steered: bool = False,
    generated: Sequence[int] = (),
) -> int:
    """The next token from one row of logits ``[vocab]``, after the presence penalty on the tokens
    ``generated`` so far; NaN or ``+inf`` logits are a typed error (``InvalidSteering`` when the
    forward was steered: a write that overflows makes them)."""
    if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
        if steered:
            raise InvalidSteering(
                "the steered forward produced NaN or infinite logits, so no token can be chosen: "
                "a write's scale or vector overflows the model's dtype; use a smaller one"
            )
        raise BackendError("the model produced NaN or infinite logits, so no token can be chosen")
    if options.presence_penalty and generated:
        seen = torch.tensor(sorted(set(generated)), dtype=torch.long, device=logits.device)
        logits = logits.float().index_add(
            0, seen, torch.full(seen.shape, -options.presence_penalty, device=logits.device)
        )
    if options.greedy:
        return int(logits.argmax())
    scores = logits.float() / options.temperature
    if options.top_k:
        kth = torch.topk(scores, min(options.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if options.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) > options.top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token_id, logprob)`` pairs, best first."""
    if n <= 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
