"""``model.tok``: the public ``interp-engine`` package's tokenizer helper, over our chat rendering.

:class:`Tokenize` renders chats with the model's own template (``apply_chat_template``, raising
``NoChatTemplate`` -- also importable as ``NoChatTemplateError`` -- when there is none), says which
optional template controls the template reads (``accepted_template_kwargs``) and attributes tokens
to messages two ways: :meth:`Tokenize.message_spans` (per token: role, message, section) and
:meth:`Tokenize.message_partition` (one contiguous span per message, covering every token). Both
read the spans of a :class:`~interp_engine.ChatTokens`, which ``model.chat_tokens`` builds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from .._errors import InvalidChat, NoChatTemplate
from ._render import check_messages
from ._spans import ChatTokens

Section = Literal["header", "content", "footer", "scaffold"]


class ChatModel(Protocol):
    """What :class:`Tokenize` reads of a model."""

    def chat_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> ChatTokens: ...

    def _chat_tokenizer(self) -> Any: ...

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor: ...

    def to_string(self, tokens: Any) -> str | list[str]: ...

    def to_str_tokens(self, tokens: Any) -> list[str]: ...


@dataclass(frozen=True)
class TokenSpan:
    """Who owns one token of a rendered chat (:meth:`Tokenize.message_spans`)."""

    position: int
    token_id: int
    token_str: str
    message_index: int | None
    """The message it belongs to (``None``: the template's own tokens outside every message,
    such as a BOS or the generation prompt)."""
    role: str | None
    """The message's role (``"assistant"`` for the generation prompt; ``None`` for scaffold)."""
    channel: str | None
    """A reasoning section's channel (``"reasoning"`` inside ``<think>…</think>``), else ``None``."""
    section: Section
    """``"header"`` (the template's tokens before the content), ``"content"``, ``"footer"``
    (after it), or ``"scaffold"`` (owned by no message)."""


class Tokenize:
    """``model.tok``: tokenization and chat rendering with the model's own tokenizer and template.

    ``to_tokens``, ``to_string`` and ``to_str_tokens`` are the model's. A chat renders the way the
    model was trained to read it, never by an invented format: without a template,
    :meth:`apply_chat_template` raises ``NoChatTemplate`` (``NoChatTemplateError``); ask
    :meth:`has_chat_template` first.
    """

    def __init__(self, model: ChatModel) -> None:
        self.model = model

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer underneath."""
        return self.model._chat_tokenizer()

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        """The model's ``to_tokens``: ids ``[1, n]`` (a list of texts: ``[batch, n_max]``)."""
        return self.model.to_tokens(text)

    def to_string(self, tokens: Any) -> str | list[str]:
        """The model's ``to_string``."""
        return self.model.to_string(tokens)

    def to_str_tokens(self, tokens: Any) -> list[str]:
        """The model's ``to_str_tokens``."""
        return self.model.to_str_tokens(tokens)

    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (so chats can be rendered)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def accepted_template_kwargs(self, names: Iterable[str]) -> set[str]:
        """Which of ``names`` (optional controls such as ``enable_thinking``) the chat template
        reads: those its source mentions (empty without a template)."""
        source = getattr(self.tokenizer, "chat_template", None) or ""
        if not isinstance(source, str):
            return set()
        return {name for name in names if isinstance(name, str) and name in source}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """``messages`` rendered by the model's chat template: the text, or with
        ``tokenize=True`` its ids (a list of ints). ``NoChatTemplate`` when the model has no
        template; ``InvalidChat`` for messages it refuses."""
        listed = check_messages(messages)
        if not self.has_chat_template():
            raise NoChatTemplate(
                "this model's tokenizer has no chat template, so it cannot render chat messages; send raw text "
                "(model.to_tokens(text)), or render with an explicit template: "
                "model.chat_tokens(messages, template=JINJA)"
            )
        for name in ("tokenize", "return_dict", "conversation"):
            if name in template_kwargs:
                raise InvalidChat(f"apply_chat_template() sets {name} itself; it is not a template argument")
        try:
            result = self.tokenizer.apply_chat_template(
                listed,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=tokenize,
                return_dict=False,
                **template_kwargs,
            )
        except Exception as exc:  # jinja2's TemplateError (raise_exception), a template's TypeError, ...
            raise InvalidChat(f"the chat template refused these messages: {exc}") from None
        if not tokenize:
            return str(result)
        raw = result.tolist() if hasattr(result, "tolist") else list(result)
        if raw and isinstance(raw[0], list):  # a batch of one
            raw = raw[0]
        return [int(i) for i in raw]

    def message_partition(
        self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The closed conversation's ids (no generation prompt) and one contiguous ``[start,
        end)`` span per message that together cover every token: message ``i`` runs from its
        turn's first token to the next message's (the first from 0, the last to the end), so
        ``[acts[s:e].mean(0) for s, e in spans]`` pools activations per turn."""
        if not messages:
            return [], []
        chat = self.model.chat_tokens(messages, add_generation_prompt=False, **template_kwargs)
        starts = [0, *(span.turn_start for span in chat.messages[1:])]
        bounds = [*starts, len(chat.ids)]
        for i in range(1, len(bounds)):  # monotone even where a template folds turns together
            bounds[i] = max(bounds[i], bounds[i - 1])
        return list(chat.ids), list(itertools.pairwise(bounds))

    def message_spans(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[TokenSpan]:
        """One :class:`TokenSpan` per token of the rendered chat: each message's header, content
        and footer tokens carry its index and role; the generation prompt is the pending
        assistant turn's header (``message_index`` ``None``); anything else (a BOS) is scaffold."""
        chat = self.model.chat_tokens(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        pieces = self.model.to_str_tokens(list(chat.ids))
        owner: list[tuple[int | None, str | None, Section]] = [(None, None, "scaffold")] * len(chat.ids)
        for span in chat.messages:
            for p in range(span.turn_start, span.turn_end):
                section: Section = "content" if span.start <= p < span.end else "header" if p < span.start else "footer"
                owner[p] = (span.index, span.role, section)
        if chat.generation_start is not None and chat.messages:
            for p in range(chat.messages[-1].turn_end, chat.generation_start):
                if owner[p][2] == "scaffold":
                    owner[p] = (None, "assistant", "header")
        reasoning = {p for span in chat.reasoning for p in range(span.start, span.end)}
        return [
            TokenSpan(p, int(chat.ids[p]), pieces[p], index, role, "reasoning" if p in reasoning else None, section)
            for p, (index, role, section) in enumerate(owner)
        ]
