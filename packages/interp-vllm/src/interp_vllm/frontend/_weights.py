"""The vllm backends' weights, joined in the front end from what each worker sent
(:mod:`..worker._weights` says what a worker sends): the vocabulary-parallel ``W_E``, ``W_U``
and ``b_U`` put together from each rank's rows and their positions, ``W_O`` from each rank's
heads in rank order, the replicated ones taken from one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from interp_engine import BackendError, ModelInfo, UnsupportedArchitecture
from interp_engine.backend import WEIGHT_NAMES, WeightInfo

from .._wire import WeightsHeld

_VOCAB_WEIGHTS = ("W_E", "W_U", "b_U")


def merge_info(
    answers: Sequence[WeightsHeld],
    first: Sequence[int],
    last: Sequence[int],
    config: Any,
    residual_multiplier: float = 1.0,
) -> WeightInfo:
    """One :class:`WeightInfo` from the workers' answers (``first``/``last``: the indices of the
    first and last pipeline stages' workers; ``residual_multiplier``: the family's multiplier of the
    attention's contribution, :attr:`~interp_vllm.model._families.VllmFamily.attn_scale`)."""
    head = answers[last[0]]
    if head.norm_error:
        raise UnsupportedArchitecture(head.norm_error)
    norm = head.norm
    if norm is None:
        raise BackendError("the last pipeline stage did not describe its final norm")
    names = {"W_U", "W_O"}
    if answers[first[0]].embed:
        names.add("W_E")
    if head.unembed_bias:
        names.add("b_U")
    if all(a.o_bias for a in answers):
        names.add("b_O")
    if norm.weight:
        names.add("ln_final.w")
    if norm.bias:
        names.add("ln_final.b")
    tied = head.tied
    if tied is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        tied = bool(getattr(text, "tie_word_embeddings", False))
    return WeightInfo(
        names=tuple(n for n in WEIGHT_NAMES if n in names),
        norm=norm.kind,
        norm_eps=float(norm.eps),
        norm_weight_offset=float(norm.offset),
        tied=bool(tied),
        logit_scale=float(head.logit_scale),
        logit_softcap=head.softcap,
        dtype=head.dtype,
        residual_multiplier=float(residual_multiplier),
    )


def merge_weight(
    name: str, parts: Sequence[dict[str, torch.Tensor]], info: ModelInfo, vocab: list[int] | None
) -> torch.Tensor:
    """The full weight from the owning stage's parts, ordered by tensor-parallel rank."""
    if not parts or any(not part for part in parts):
        raise BackendError(f"a worker of the stage that should hold {name} sent nothing for it")
    if name in _VOCAB_WEIGHTS:
        n = info.vocab_size if vocab is None else len(vocab)
        first = parts[0]["values"]
        out = torch.zeros(n, *first.shape[1:], dtype=torch.float32)
        seen = torch.zeros(n, dtype=torch.bool)
        for part in parts:
            out[part["positions"]] = part["values"]
            seen[part["positions"]] = True
        if not bool(seen.all()):
            raise BackendError(f"the workers' shards of {name} cover {int(seen.sum())} of {n} vocabulary entries")
        return out.T.contiguous() if name == "W_U" else out
    if name == "W_O":
        value = torch.cat([part["values"] for part in parts])
        if value.shape != (info.n_heads, info.d_head, info.d_model):
            raise BackendError(
                f"the workers' output projections join to {list(value.shape)}, not "
                f"[{info.n_heads}, {info.d_head}, {info.d_model}]"
            )
        return value
    return parts[0]["values"]  # replicated (b_O: rank 0's is the one added; the final norm)
