"""Tokenizer plumbing shared by backends that serve a HuggingFace tokenizer.

Duck-typed on the tokenizer (``__call__``, ``decode``, ``pad_token_id``, ``eos_token_id``), so
the core still imports no ``transformers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._errors import InvalidTokens


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into ``(ids [batch, n_max], attention mask [batch, n_max])``."""
    lengths = [len(r) for r in rows]
    longest = max(lengths)
    if min(lengths) == longest:  # nothing to pad: every row in one conversion
        ids = torch.tensor([list(row) for row in rows], dtype=torch.long)
        return ids, torch.ones_like(ids)
    ids = torch.full((len(rows), longest), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def check_text(text: Any) -> str:
    """``text`` if it is a string a tokenizer can read, else ``InvalidTokens`` (a lone surrogate,
    e.g. ``"\\ud800"``, is not Unicode text: it has no UTF-8 form)."""
    if not isinstance(text, str):
        raise InvalidTokens(f"a text to tokenize is a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTokens(
            f"the text is not valid Unicode: a lone surrogate {text[exc.start]!r} at index {exc.start}"
        ) from None
    return text


_MAX_TOKEN_STRINGS = 1 << 20
"""More ids than any vocabulary has: a cache past it holds ids no tokenizer knows, and starts over."""


class TokenizerMixin:
    """``to_tokens`` / ``to_string`` / ``to_str_tokens`` over ``self.tokenizer``."""

    tokenizer: Any
    _token_strings: tuple[Any, dict[int, str]] | None = None
    """``(tokenizer, {id: its text})``: what :meth:`to_str_tokens` decoded with that tokenizer."""

    @property
    def pad_id(self) -> int:
        """The pad token, else end-of-sequence, else 0 (padding is always masked or cut)."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        return int(pad or 0)

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        """Ids ``[1, n]`` of a text (the tokenizer's own special tokens, e.g. BOS, included);
        a list of texts gives ``[batch, n_max]``, right-padded with the pad token."""
        texts = [text] if isinstance(text, str) else list(text)
        for item in texts:
            check_text(item)
        rows = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        return pad_rows(rows, self.pad_id)[0]

    def to_string(self, tokens: Any) -> str | list[str]:
        """The text of ids (a 2-D tensor gives one string per row)."""
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            return [str(self.tokenizer.decode(row.tolist())) for row in tokens]
        if isinstance(tokens, int):
            tokens = [tokens]
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return str(self.tokenizer.decode(ids))

    def to_str_tokens(self, tokens: Any) -> list[str]:
        """One string per token, of a text or of ids. Each id is decoded alone, once per
        tokenizer (a served lens names layers x top-k ids per generated token, most seen before)."""
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)[0]
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        ids = [int(t) for t in tokens]
        tokenizer = self.tokenizer
        cached = self._token_strings
        if cached is None or cached[0] is not tokenizer or len(cached[1]) > _MAX_TOKEN_STRINGS:
            cached = self._token_strings = (tokenizer, {})
        strings = cached[1]
        for i in ids:
            if i not in strings:
                strings[i] = str(tokenizer.decode([i]))
        return [strings[i] for i in ids]

    def completion_text(self, tokens: Sequence[int]) -> str:
        """The text of generated ids, special tokens skipped (as vLLM reports it)."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def _chat_tokenizer(self) -> Any:
        """The tokenizer ``chat_tokens`` renders chats with (``ModelBase``'s hook)."""
        return self.tokenizer


class TextPieces:
    """Incremental detokenization for streams: each new token's piece of the text, holding back
    a piece that ends inside a multi-byte character until the character is complete."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._text = ""

    def add(self, token: int, *, last: bool) -> str:
        self._tokens.append(token)
        full = str(self._decode(self._tokens))
        if not last and full.endswith("\ufffd"):
            return ""
        piece = full[len(self._text) :] if full.startswith(self._text) else full
        self._text = full
        return piece
