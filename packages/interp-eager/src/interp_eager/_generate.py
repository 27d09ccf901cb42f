"""Token choice for generation: greedy by default, sampling when asked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from interp_engine import InvalidOption


@dataclass(frozen=True)
class Sampling:
    """Decoding parameters (vLLM's names). ``temperature=0`` (the default) is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> Sampling:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidOption(f"unknown generation option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        sampling = cls(**kwargs)
        if not isinstance(sampling.temperature, (int, float)) or sampling.temperature < 0:
            raise InvalidOption(f"temperature must be >= 0, got {sampling.temperature!r}")
        if not isinstance(sampling.top_k, int) or sampling.top_k < 0:
            raise InvalidOption(f"top_k must be an int >= 0 (0 = off), got {sampling.top_k!r}")
        if not isinstance(sampling.top_p, (int, float)) or not 0 < sampling.top_p <= 1:
            raise InvalidOption(f"top_p must be in (0, 1], got {sampling.top_p!r}")
        return sampling

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy or self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The next token from one row of logits ``[vocab]``."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) > self.top_p
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
