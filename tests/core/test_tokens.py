"""Token plumbing shared by the backends: a batch tensor as rows of ids, and rows padded into one
tensor with its attention mask."""

from __future__ import annotations

from typing import Any

import torch

from interp_engine import ChatTokens
from interp_engine._api import token_rows
from interp_engine.backend import TokenizerMixin, pad_rows

NO_MODEL: Any = None  # ids need no tokenizer


def test_a_batch_tensor_is_one_list_of_plain_ints_per_row() -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    rows = token_rows(NO_MODEL, tokens)
    assert rows == [[1, 2, 3], [4, 5, 6]]
    assert all(type(row) is list and all(type(i) is int for i in row) for row in rows)
    assert token_rows(NO_MODEL, torch.tensor([7, 8])) == [[7, 8]]


def test_rows_of_one_length_are_one_tensor_with_every_position_attended() -> None:
    ids, mask = pad_rows([[1, 2, 3], [4, 5, 6]], pad_id=0)
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1]]


def test_shorter_rows_are_right_padded_and_masked() -> None:
    ids, mask = pad_rows([[1, 2, 3], [4]], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_chat_tokens_rows_are_padded_like_id_lists() -> None:
    chat = ChatTokens([5, 6], messages=())
    ids, mask = pad_rows([chat, [7, 8]], pad_id=0)
    assert ids.tolist() == [[5, 6], [7, 8]] and mask.tolist() == [[1, 1], [1, 1]]
    ids, mask = pad_rows([chat, [7, 8, 9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 0], [7, 8, 9]] and mask.tolist() == [[1, 1, 0], [1, 1, 1]]


class _CountingTokenizer:
    """Decodes id ``i`` as ``"<i>"`` (a tokenizer's ``decode``), counting the calls."""

    def __init__(self, mark: str = "") -> None:
        self.mark, self.calls = mark, 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(f"<{self.mark}{i}>" for i in ids)


class _Tokens(TokenizerMixin):
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer


def test_str_tokens_decode_each_id_alone_once_per_tokenizer() -> None:
    tokens = _Tokens(_CountingTokenizer())
    assert tokens.to_str_tokens([3, 1, 3]) == ["<3>", "<1>", "<3>"]
    assert tokens.to_str_tokens(torch.tensor([[1, 2], [3, 3]])) == ["<1>", "<2>", "<3>", "<3>"]
    assert tokens.tokenizer.calls == 3  # 3, 1, then 2: every later id was decoded before
    tokens.tokenizer = _CountingTokenizer("b")  # another tokenizer: its own texts
    assert tokens.to_str_tokens([1, 2]) == ["<b1>", "<b2>"]
    assert tokens.tokenizer.calls == 2


def test_str_tokens_equal_decoding_each_id_on_a_real_tokenizer() -> None:
    from transformers import AutoTokenizer

    from interp_engine import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokens = _Tokens(tokenizer)
    ids = [*range(len(tokenizer)), 5, 5, 0]
    assert tokens.to_str_tokens(ids) == [tokenizer.decode([i]) for i in ids]
    assert tokens.to_str_tokens(torch.tensor(ids)) == [tokenizer.decode([i]) for i in ids]
