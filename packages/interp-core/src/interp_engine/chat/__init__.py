"""Chat prompts as token ids with spans: which tokens are each message, each reasoning section.

``model.chat_tokens(messages)`` renders ``messages`` through the model's own chat template (the
tokenizer's, so every family's template works) and returns a :class:`ChatTokens`: the ids
``tokenizer.apply_chat_template(messages, tokenize=True)`` gives, plus one :class:`Span` per
message (its content tokens and its whole turn) and one per reasoning section
(``<think>…</think>``). A :class:`ChatTokens` is a sequence of ints, so it goes wherever token ids
go; passed as the prompt, it lets positions be named by span::

    prompt = model.chat_tokens([{"role": "user", "content": "Hi"}])
    Write("resid_post.2", v, positions="user[-1].last")   # the last token of the last user message

Named positions (:func:`parse_position_name`) are ``"<name>[<i>][.<part>]"``: ``name`` a role
(``user``, ``assistant``, ``system``, ``tool``, ...), ``message`` (any role) or ``reasoning``;
``[i]`` which of the matching spans (negative from the end; omitted: all of them); ``.part``
``last``, ``first`` or ``turn`` (the whole turn, template tokens included; omitted: the content
tokens). They are resolved against the request's own spans by :func:`span_positions`.

How spans are found (no template is special-cased): the conversation is rendered as text; each
message's turn ends where the rendering of the conversation up to that message ends (or, where a
template renders history differently, e.g. dropping past reasoning, where that rendering's footer
ends); its content is the last occurrence of the message's text (trimmed, if the template trims)
inside its turn. A message a template folds into the next turn (a system prompt merged into the
first user turn) has no template tokens of its own: its turn is its content. Characters map to
tokens through the tokenizer's offsets (fast tokenizers) or by decoding prefixes (slow ones).
"""

from ._render import (
    build_chat_tokens,
    check_messages,
)
from ._spans import (
    DEFAULT_REASONING_MARKERS,
    GRAMMAR,
    PARTS,
    RESERVED_NAMES,
    ChatTokens,
    PositionName,
    Span,
    SpanKind,
    is_span_name,
    parse_position_name,
    select_positions,
    span_positions,
)

__all__ = [
    "DEFAULT_REASONING_MARKERS",
    "GRAMMAR",
    "PARTS",
    "RESERVED_NAMES",
    "ChatTokens",
    "PositionName",
    "Span",
    "SpanKind",
    "build_chat_tokens",
    "check_messages",
    "is_span_name",
    "parse_position_name",
    "select_positions",
    "span_positions",
]
