"""Metrics of a run's logits (the public face is :mod:`interp_engine.metrics`)."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import InvalidOption, InvalidTokens
from ..protocol._protocol import GradientMetric
from ..steering._values import short_repr

Metric = Callable[..., Any]
"""``metric(logits)`` or ``metric(logits, lengths)`` to a scalar (a one-element tensor or a float)."""

TokenLike = int | str

__all__ = ["LogitDiff", "Metric", "as_gradient_metric", "evaluate", "logit_diff", "takes_lengths", "token_id"]


class LogitDiff:
    """``logits[row, position, answer] - logits[row, position, wrong]`` averaged over the rows
    (build it with :func:`logit_diff`). ``answer``/``wrong``: one token id for every row or one
    per row; a negative ``position`` counts back from each row's own end when lengths are given
    (else from the padded end)."""

    def __init__(self, answer: int | Sequence[int], wrong: int | Sequence[int], position: int = -1) -> None:
        self.answer = _ids(answer, "answer")
        self.wrong = _ids(wrong, "wrong")
        if isinstance(position, bool) or not isinstance(position, int):
            raise InvalidOption(f"position must be an int (negative counts from the end), got {short_repr(position)}")
        self.position = position
        self.__name__ = f"logit_diff({_show(answer)}, {_show(wrong)}, position={position})"

    def __repr__(self) -> str:
        return self.__name__

    def __call__(self, logits: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if logits.dim() != 3:
            raise InvalidOption(f"logit_diff takes logits [batch, n, vocab], got shape {list(logits.shape)}")
        batch, n, vocab = logits.shape
        ends = torch.full((batch,), n) if lengths is None else torch.as_tensor(lengths).reshape(-1).cpu()
        if ends.numel() != batch:
            raise InvalidOption(f"{ends.numel()} lengths for {batch} rows of logits")
        at = ends + self.position if self.position < 0 else torch.full((batch,), self.position)
        if bool(((at < 0) | (at >= ends)).any()):
            raise InvalidOption(f"position {self.position} is outside a row of lengths {ends.tolist()}")
        answer = self._per_row(self.answer, batch, vocab, "answer")
        wrong = self._per_row(self.wrong, batch, vocab, "wrong")
        rows = torch.arange(batch)
        picked = logits[rows.to(logits.device), at.to(logits.device)]  # [batch, vocab]
        diff = picked.gather(1, answer.to(logits.device)[:, None]) - picked.gather(1, wrong.to(logits.device)[:, None])
        return diff.mean()

    @staticmethod
    def _per_row(ids: list[int], batch: int, vocab: int, what: str) -> torch.Tensor:
        if len(ids) == 1:
            ids = ids * batch
        if len(ids) != batch:
            raise InvalidOption(f"{len(ids)} {what} ids for {batch} rows; give one id or one per row")
        for i in ids:
            if not 0 <= i < vocab:
                raise InvalidTokens(f"{what} id {i} is outside the vocabulary [0, {vocab})")
        return torch.tensor(ids, dtype=torch.long)


def logit_diff(
    answer: TokenLike | Sequence[TokenLike],
    wrong: TokenLike | Sequence[TokenLike],
    position: int = -1,
    *,
    model: Any = None,
) -> LogitDiff:
    """The logit difference ``answer - wrong`` at ``position`` (default each row's last token),
    averaged over the batch. ``answer``/``wrong`` are token ids (one for every row, or a list of
    one per row); with ``model=``, one-token texts (``" Paris"``) too, and ids are checked
    against its vocabulary."""
    if model is not None:
        answer, wrong = _resolve(model, answer, "answer"), _resolve(model, wrong, "wrong")
    return LogitDiff(answer, wrong, position)  # type: ignore[arg-type]  # texts need model=: _ids refuses them


def _resolve(model: Any, value: Any, what: str) -> Any:
    if isinstance(value, (str, int)):
        return token_id(model, value, what)
    if isinstance(value, Sequence):
        return [token_id(model, v, what) for v in value]
    return value


def token_id(model: Any, value: Any, what: str = "token") -> int:
    """``value`` as one token id of ``model``: an id in its vocabulary (an int, a numpy integer or a
    0-d tensor), or a text that is exactly one token (``" Paris"``, no special tokens added)."""
    if isinstance(value, str):
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise InvalidTokens(f"this model has no tokenizer to read {what}={value!r}; give a token id")
        ids = list(tokenizer(value, add_special_tokens=False)["input_ids"])
        if len(ids) != 1:
            raise InvalidTokens(f"{what}={value!r} is {len(ids)} tokens; give one token (a text or an id)")
        return int(ids[0])
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTokens(f"{what} must be a token id or a one-token text, got {short_repr(value)}")
    vocab_size = int(model.info.vocab_size)
    if not 0 <= int(value) < vocab_size:
        raise InvalidTokens(f"{what}={value} is outside the vocabulary [0, {vocab_size})")
    return int(value)


def _ids(value: Any, what: str) -> list[int]:
    items = [value] if isinstance(value, int) else list(value) if isinstance(value, Sequence) else None
    if (
        items is None
        or not items
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items)
        or isinstance(value, (str, bytes, bool))
    ):
        raise InvalidTokens(
            f"{what} must be a token id or a list of one per row, got {short_repr(value)} "
            "(texts: logit_diff(..., model=model))"
        )
    return [int(i) for i in items]


def _show(value: int | Sequence[int]) -> str:
    return str(value) if isinstance(value, int) else str(list(value))


def takes_lengths(metric: Metric) -> bool:
    """Whether ``metric`` takes the rows' lengths as its second positional argument: it has a
    second required positional parameter, one named ``lengths``, or ``*args``."""
    try:
        signature = inspect.signature(metric)
    except (TypeError, ValueError):  # a builtin without a signature: logits only
        return False
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        return True
    if len(positional) < 2:
        return False
    second = positional[1]
    return second.name == "lengths" or second.default is inspect.Parameter.empty


def evaluate(metric: Metric, logits: torch.Tensor, lengths: torch.Tensor | None = None) -> Any:
    """``metric(logits, lengths)`` if it takes the lengths (and they are given), else ``metric(logits)``."""
    if not callable(metric):
        raise InvalidOption(f"metric must be a callable of the logits, got {type(metric).__name__}")
    if lengths is not None and takes_lengths(metric):
        return metric(logits, lengths)
    return metric(logits)


def as_gradient_metric(metric: Metric) -> GradientMetric:
    """``metric`` as a backend's ``capture_gradients`` calls it: ``(logits, lengths)`` to a tensor."""
    if not callable(metric):
        raise InvalidOption(f"metric must be a callable of the logits, got {type(metric).__name__}")
    if takes_lengths(metric):
        return metric

    def logits_only(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = metric(logits)
        return value

    logits_only.__name__ = getattr(metric, "__name__", "metric")
    return logits_only
