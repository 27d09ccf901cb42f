"""Rendering a conversation through a chat template into ids with spans (the public face is
:mod:`interp_engine.chat`)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidChat, NoChatTemplate
from ._spans import DEFAULT_REASONING_MARKERS, ChatTokens, Span


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts with a ``role`` (str) and a ``content`` (str, a list of
    parts, or ``None`` beside ``tool_calls``), else ``InvalidChat``."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidChat(
            "messages are a list of {'role': ..., 'content': ...} dicts, got a " + type(messages).__name__
        )
    if not messages:
        raise InvalidChat("no messages given: a chat needs at least one {'role': ..., 'content': ...}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidChat(
                f"messages[{i}] is a {type(message).__name__}, not a {{'role': ..., 'content': ...}} dict"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidChat(f"messages[{i}] needs a 'role' (a non-empty str such as 'user'), got {role!r:.80}")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise InvalidChat(f"messages[{i}] ({role}) has no 'content' (a str, or a list of parts)")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidChat(
                f"messages[{i}] ({role}): 'content' is a str or a list of parts, got a {type(content).__name__}"
            )
        if isinstance(content, list) and not all(isinstance(p, Mapping) for p in content):
            raise InvalidChat(
                f"messages[{i}] ({role}): content parts are dicts such as {{'type': 'text', 'text': ...}}"
            )
        out.append(dict(message))
    return out


def build_chat_tokens(
    tokenizer: Any,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
    reasoning_markers: Sequence[tuple[str, str]] | None = None,
    **template_kwargs: Any,
) -> ChatTokens:
    """:class:`ChatTokens` of ``messages`` rendered by ``tokenizer``'s chat template (``template``,
    a Jinja string, overrides it); ``template_kwargs`` reach the template (``tools=``,
    ``enable_thinking=``, ...)."""
    listed = check_messages(messages)
    if not isinstance(add_generation_prompt, bool):
        raise InvalidChat(f"add_generation_prompt is True or False, got {add_generation_prompt!r:.80}")
    if template is not None and not isinstance(template, str):
        raise InvalidChat(f"template= is a Jinja chat template (a str), got a {type(template).__name__}")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(
            "this model's tokenizer has no chat template; pass one: chat_tokens(messages, template=JINJA) "
            "(a Jinja string such as the model family's tokenizer_config.json 'chat_template')"
        )
    markers = _check_markers(reasoning_markers)
    for name in ("tokenize", "return_dict", "chat_template", "conversation", "continue_final_message"):
        if name in template_kwargs:
            raise InvalidChat(f"chat_tokens() sets {name} itself; it is not a template argument")

    def render(conversation: list[dict[str, Any]], gen: bool) -> str:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=gen, chat_template=template, **template_kwargs
        )
        if not isinstance(text, str):
            raise InvalidChat(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    try:
        text = render(listed, add_generation_prompt)
        ids = tokenizer.apply_chat_template(
            listed,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            **template_kwargs,
        )
    except InvalidChat:
        raise
    except Exception as exc:  # jinja2's TemplateError (raise_exception), a template's TypeError, ...
        raise InvalidChat(f"the chat template refused these messages: {exc}") from None
    raw = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if raw and isinstance(raw[0], list):  # a batch of one (some tokenizers' tensors)
        raw = raw[0]
    ids = [int(i) for i in raw]

    def prefix(n: int) -> str | None:
        try:
            return render(listed[:n], False)
        except Exception:  # a template may refuse a partial conversation: then that boundary is inferred
            return None

    chars = _locate(listed, text, prefix, markers, getattr(tokenizer, "bos_token", None))
    offsets = _offsets(tokenizer, text, ids)
    to_tokens = _CharToToken(offsets, len(text))
    message_spans = tuple(
        Span(
            "message",
            str(listed[i]["role"]),
            i,
            *to_tokens.range(start, end),
            *to_tokens.range(turn_start, turn_end),
        )
        for i, (start, end, turn_start, turn_end) in enumerate(chars.messages)
    )
    reasoning_spans = tuple(
        Span("reasoning", role, index, *to_tokens.range(start, end), *to_tokens.range(turn_start, turn_end))
        for role, index, start, end, turn_start, turn_end in chars.reasoning
    )
    return ChatTokens(ids, message_spans, reasoning_spans, len(ids) if add_generation_prompt else None, text)


def _check_markers(markers: Any) -> tuple[tuple[str, str], ...]:
    if markers is None:
        return DEFAULT_REASONING_MARKERS
    try:
        pairs = tuple((open_, close) for open_, close in markers)
    except (TypeError, ValueError):
        raise InvalidChat(
            f"reasoning_markers is a list of (start, end) string pairs such as [('<think>', '</think>')], "
            f"got {markers!r:.80}"
        ) from None
    if not all(isinstance(s, str) and s for pair in pairs for s in pair):
        raise InvalidChat(f"reasoning markers are non-empty strings, got {markers!r:.80}")
    return pairs


@dataclass
class _CharSpans:
    messages: list[tuple[int, int, int, int]]
    """Per message: content start, end, turn start, turn end (characters)."""
    reasoning: list[tuple[str, int, int, int, int, int]]
    """Per reasoning section: role, message index, content start, end, turn start, turn end."""


def _texts(message: Mapping[str, Any], markers: Sequence[tuple[str, str]]) -> list[str]:
    """The text pieces of a message's content the template is expected to render, in order
    (an assistant's reasoning written inline is left out: it is a reasoning span)."""
    content = message.get("content")
    if isinstance(content, list):
        return [str(p["text"]) for p in content if isinstance(p.get("text"), str) and p["text"].strip()]
    if not isinstance(content, str) or not content:
        return []
    if message.get("role") == "assistant":
        for open_, close in markers:
            if close in content:
                content = content.split(close)[-1].strip()
            elif content.lstrip().startswith(open_):
                return []
    return [content] if content.strip() else []


def _anchors(message: Mapping[str, Any]) -> list[str]:
    """Text that locates a message without content in the rendering (its tool calls' names)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    names = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str) and name:
            names.append(name)
    return names


def _variants(text: str) -> list[str]:
    """``text`` and the trimmed forms a template may render of it, exact first."""
    out = []
    for form in (text, text.strip(), text.strip("\n"), text.lstrip("\n"), text.rstrip(), text.lstrip()):
        if form and form not in out:
            out.append(form)
    return out


def _rfind(haystack: str, pieces: list[str], lo: int, hi: int) -> tuple[int, int] | None:
    """The character range of ``pieces`` (in order) ending last inside ``haystack[lo:hi]``."""
    end = hi
    start = None
    last_end = None
    for piece in reversed(pieces):
        found = None
        for form in _variants(piece):
            at = haystack.rfind(form, lo, end)
            if at >= 0:
                found = (at, at + len(form))
                break
        if found is None:
            return None
        start = found[0]
        last_end = found[1] if last_end is None else last_end
        end = found[0]
    if start is None or last_end is None:
        return None
    return start, last_end


def _locate(
    messages: list[dict[str, Any]],
    text: str,
    prefix: Any,
    markers: Sequence[tuple[str, str]],
    bos: Any,
) -> _CharSpans:
    cursor = len(bos) if isinstance(bos, str) and bos and text.startswith(bos) else 0
    spans: list[tuple[int, int, int, int]] = []
    for i, message in enumerate(messages):
        pieces = _texts(message, markers)
        anchored = not pieces and bool(_anchors(message))  # located by its tool calls; its content is empty
        span, cursor = _locate_one(text, pieces or _anchors(message), prefix(i + 1), cursor)
        if anchored:
            span = (span[0], span[0], span[2], span[3])
        spans.append(span)
    return _CharSpans(spans, _reasoning(messages, text, spans, markers))


def _locate_one(
    text: str, pieces: list[str], rendered: str | None, cursor: int
) -> tuple[tuple[int, int, int, int], int]:
    """One message's (content start, end, turn start, turn end) and the next turn's start.
    ``rendered``: the conversation rendered up to this message (``None`` if the template refused)."""
    if rendered is not None and text.startswith(rendered) and len(rendered) > cursor:
        # the rendering up to this message is a prefix of the whole: its turn ends there
        turn_end = len(rendered)
        found = _rfind(text, pieces, cursor, turn_end) if pieces else None
        if found is None and pieces:  # rendered in a later turn
            later = _rfind(text, pieces, turn_end, len(text))
            if later is not None:
                return (later[0], later[1], later[0], later[1]), cursor
        start, end = found if found is not None else (turn_end, turn_end)
        return (start, end, cursor, turn_end), turn_end
    footer = None
    if rendered is not None and pieces:  # history rendered differently: the footer this message's turn ends with
        in_prefix = _rfind(rendered, pieces, 0, len(rendered))
        if in_prefix is not None:
            footer = rendered[in_prefix[1] :]
    located = _find_with_footer(text, pieces, cursor, footer) if pieces else None
    if located is None:  # not rendered: an empty span where its turn would start
        return (cursor, cursor, cursor, cursor), cursor
    start, end, matched = located
    if footer is None:  # rendered inside another turn (a system prompt merged into the first user turn)
        return (start, end, start, end), cursor
    return (start, end, cursor, end + matched), end + matched


def _find_with_footer(text: str, pieces: list[str], lo: int, footer: str | None) -> tuple[int, int, int] | None:
    """The first occurrence of ``pieces`` at or after ``lo`` followed by the most of ``footer``:
    ``(start, end, characters of the footer matched)``."""
    best: tuple[int, int, int] | None = None
    first = pieces[0]
    for form in _variants(first):
        at = text.find(form, lo)
        while at >= 0:
            found = _rfind(text, pieces, at, len(text)) if len(pieces) > 1 else (at, at + len(form))
            if found is not None:
                matched = _common_prefix(text, found[1], footer) if footer else 0
                if best is None or matched > best[2]:
                    best = (found[0], found[1], matched)
                if footer is None or matched == len(footer):
                    return best
            at = text.find(form, at + 1)
        if best is not None:
            return best
    return best


def _common_prefix(text: str, at: int, other: str) -> int:
    n = 0
    while n < len(other) and at + n < len(text) and text[at + n] == other[n]:
        n += 1
    return n


def _reasoning(
    messages: list[dict[str, Any]],
    text: str,
    spans: list[tuple[int, int, int, int]],
    markers: Sequence[tuple[str, str]],
) -> list[tuple[str, int, int, int, int, int]]:
    """Reasoning sections: each start marker outside every message's content, to its end marker
    (or the end of the text, for a section the generation prompt opens)."""
    out = []
    contents = [(s, e) for s, e, _, _ in spans if e > s]
    taken: list[tuple[int, int]] = []
    for open_, close in markers:
        at = text.find(open_)
        while at >= 0:
            if any(s <= at < e for s, e in contents + taken):
                at = text.find(open_, at + 1)
                continue
            inner = at + len(open_)
            stop = text.find(close, inner)
            outer_end = len(text) if stop < 0 else stop + len(close)
            inner_end = len(text) if stop < 0 else stop
            body = text[inner:inner_end]
            lead = len(body) - len(body.lstrip())
            trail = len(body) - len(body.rstrip())
            c_start, c_end = (inner + lead, inner_end - trail) if body.strip() else (inner, inner)
            owner = next((i for i, (_, _, ts, te) in enumerate(spans) if ts <= at < te), None)
            if owner is None:  # past every turn: the generation prompt's; else the nearest turn before it
                last_turn = max((te for _, _, _, te in spans), default=0)
                before = [i for i, (_, _, ts, _) in enumerate(spans) if ts <= at]
                owner = len(messages) if at >= last_turn or not before else before[-1]
            role = "assistant" if owner >= len(messages) else str(messages[owner]["role"])
            out.append((role, owner, c_start, c_end, at, outer_end))
            taken.append((at, outer_end))
            at = text.find(open_, outer_end)
    return sorted(out, key=lambda r: r[4])


class _CharToToken:
    """Character ranges of the rendered text to token ranges (tokens overlapping the range)."""

    def __init__(self, offsets: list[tuple[int, int]], n_chars: int) -> None:
        self.starts = [s for s, _ in offsets]
        self.ends = [e for _, e in offsets]
        self.n = len(offsets)
        self.n_chars = n_chars

    def range(self, lo: int, hi: int) -> tuple[int, int]:
        # the first token ending after lo; the first token starting at or after hi
        first = bisect.bisect_right(self.ends, lo)
        if hi <= lo:
            return first, first
        stop = bisect.bisect_left(self.starts, hi)
        return first, max(first, stop)


def _offsets(tokenizer: Any, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's character range in ``text``: from the fast tokenizer's offsets when they
    tokenize ``text`` to ``ids``, else by decoding prefixes of ``ids``. Monotonic."""
    if getattr(tokenizer, "is_fast", False):
        try:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (TypeError, ValueError, NotImplementedError):
            encoded = None
        if encoded is not None and list(encoded["input_ids"]) == ids:
            return _monotonic([(int(s), int(e)) for s, e in encoded["offset_mapping"]])
    decoded = ""
    out: list[tuple[int, int]] = []
    pending: list[int] = []  # tokens that end inside a character: they share its range
    start = 0
    for k in range(len(ids)):
        decoded = str(tokenizer.decode(ids[: k + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        pending.append(k)
        if decoded.endswith("\ufffd") and k + 1 < len(ids):
            continue
        end = len(decoded)
        out += [(start, end)] * len(pending)
        pending, start = [], end
    if decoded != text:
        raise InvalidChat(
            "cannot align this tokenizer's tokens with the rendered chat (decoding the ids does not give the "
            "template's text, and the tokenizer has no offsets): spans cannot be found"
        )
    return _monotonic(out)


def _monotonic(offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Offsets made non-decreasing (the pieces of one character share its range)."""
    out = []
    last_start = last_end = 0
    for start, end in offsets:
        start = max(start, last_start)
        end = max(end, start, last_end)
        out.append((start, end))
        last_start, last_end = start, end
    return out
