"""Chat prompts as token ids with spans (the public face is :mod:`interp_engine.chat`)."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from .._errors import InvalidChat, InvalidOption, InvalidSteering, NoChatTemplate

SpanKind = Literal["message", "reasoning"]
PARTS = ("last", "first", "turn")
RESERVED_NAMES = ("all", "prompt", "generated")
"""Position names that are not chat spans (their meaning is the same with or without a chat)."""
DEFAULT_REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("<thinking>", "</thinking>"))
"""The reasoning markers looked for by default (``chat_tokens(..., reasoning_markers=...)`` overrides)."""

GRAMMAR = "'<name>[<i>][.<part>]' (name: a role, 'message' or 'reasoning'; i: an int; part: last, first or turn)"
_NAME = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_\-]*)(?:\[(?P<index>-?\d+)\])?(?:\.(?P<part>[A-Za-z_]+))?$")


@dataclass(frozen=True)
class PositionName:
    """A parsed named position: ``name[index].part``."""

    name: str
    index: int | None = None
    part: str | None = None


def parse_position_name(text: str) -> PositionName:
    """``text`` parsed by the named-positions grammar, or ``InvalidSteering`` naming it."""
    match = _NAME.match(text) if isinstance(text, str) else None
    if match is not None and match.group("name") in PARTS:  # "last" alone: a part without a span
        raise InvalidSteering(
            f"positions {text!r} is not a position name: {match.group('name')!r} is a part of a span; name the "
            f"span first ('user[-1].{match.group('name')}'), or use 'all', 'prompt', 'generated' or indices "
            f"([-1] is the last token) ({GRAMMAR})"
        )
    if match is None or text in RESERVED_NAMES:
        raise InvalidSteering(
            f"positions {text!r} is not a position name: use 'all', 'prompt', 'generated', a list of indices, "
            f"or a chat span {GRAMMAR}, e.g. 'user[-1].last', 'assistant', 'reasoning[0]', 'system.turn'"
        )
    part = match.group("part")
    if part is not None and part not in PARTS:
        raise InvalidSteering(f"positions {text!r}: unknown part {part!r}; parts are {', '.join(PARTS)} ({GRAMMAR})")
    index = match.group("index")
    return PositionName(match.group("name"), None if index is None else int(index), part)


def is_span_name(value: Any) -> bool:
    """Whether ``value`` is a named position that names chat spans (not ``all``/``prompt``/``generated``)."""
    return isinstance(value, str) and value not in RESERVED_NAMES


@dataclass(frozen=True)
class Span:
    """Where one message (or one reasoning section) sits in a chat's tokens.

    ``start:end`` are its content tokens (end exclusive; the template's own tokens excluded);
    ``turn_start:turn_end`` the whole turn, the template's header and footer tokens included (for
    a reasoning section: its markers included). ``role`` and ``index`` are the message's as given
    (``"assistant"`` even where the template writes ``model``); a reasoning section carries the
    role and index of the message it is in (``index == len(messages)`` for one the generation
    prompt opens)."""

    kind: SpanKind
    role: str
    index: int
    start: int
    end: int
    turn_start: int
    turn_end: int

    @property
    def last(self) -> int:
        """The last content token (the turn's last token when the content is empty)."""
        return self.end - 1 if self.end > self.start else self.turn_end - 1

    def positions(self, part: str | None = None) -> list[int]:
        """The token positions of ``part``: ``None`` the content, ``"turn"`` the whole turn,
        ``"first"`` / ``"last"`` the first / last content token."""
        if part is None:
            return list(range(self.start, self.end))
        if part == "turn":
            return list(range(self.turn_start, self.turn_end))
        if part == "first":
            return [self.start] if self.end > self.start else []
        if part == "last":
            return [self.end - 1] if self.end > self.start else []
        raise InvalidSteering(f"unknown span part {part!r}; parts are {', '.join(PARTS)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "role": self.role,
            "index": self.index,
            "start": self.start,
            "end": self.end,
            "turn_start": self.turn_start,
            "turn_end": self.turn_end,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Span:
        try:
            kind = data["kind"]
            if kind not in ("message", "reasoning"):
                raise InvalidChat(f"a span's kind is 'message' or 'reasoning', got {kind!r}")
            numbers = [data[k] for k in ("index", "start", "end", "turn_start", "turn_end")]
            if not isinstance(data["role"], str) or not all(type(n) is int and n >= 0 for n in numbers):
                raise InvalidChat(f"a span has a role (str) and indices >= 0, got {data!r:.200}")
            return cls(kind, data["role"], *numbers)
        except (KeyError, TypeError):
            raise InvalidChat(
                f"a span is an object with kind, role, index, start, end, turn_start, turn_end; got {data!r:.200}"
            ) from None


@dataclass(frozen=True, eq=False)
class ChatTokens(Sequence[int]):
    """The token ids of a rendered chat, with the span of each message and reasoning section.

    A ``Sequence[int]`` of the ids, accepted wherever token ids are; as a prompt it lets positions
    be named by span (``"user[-1].last"``: see the module docstring). ``ids`` equal
    ``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=...)``."""

    ids: list[int]
    messages: tuple[Span, ...]
    """One span per input message, in order."""
    reasoning: tuple[Span, ...] = ()
    """The reasoning sections (``<think>…</think>``), in order."""
    generation_start: int | None = None
    """Where generated tokens start (``len(ids)``) when the prompt ends with a generation prompt."""
    text: str = ""
    """The rendered template."""

    # -- the sequence of ids ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):  # the ids alone: equal to apply_chat_template's list
            return self.ids == list(other)
        if not isinstance(other, ChatTokens):
            return NotImplemented
        return (self.ids, self.messages, self.reasoning, self.generation_start, self.text) == (
            other.ids,
            other.messages,
            other.reasoning,
            other.generation_start,
            other.text,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        roles = ", ".join(f"{s.role}[{s.start}:{s.end}]" for s in self.messages)
        extra = f", reasoning={len(self.reasoning)}" if self.reasoning else ""
        return f"ChatTokens(<{len(self.ids)} ids>, messages=[{roles}]{extra}, generation_start={self.generation_start})"

    @property
    def token_ids(self) -> list[int]:
        """The ids (``ids``; named like ``Completion.token_ids``)."""
        return self.ids

    # -- spans --------------------------------------------------------------------------------
    @property
    def spans(self) -> tuple[Span, ...]:
        """Every span: the messages', then the reasoning sections'."""
        return self.messages + self.reasoning

    def positions(self, name: str) -> list[int]:
        """The token positions a named position selects here (``"user[-1].last"``), ascending."""
        return span_positions(name, self, len(self.ids))

    def tensor(self) -> torch.Tensor:
        """The ids as a ``LongTensor [1, n]``."""
        return torch.tensor([self.ids], dtype=torch.long)

    def describe(self) -> str:
        """The spans there are, named as positions name them (for error messages)."""
        return _describe(self)

    # -- plain data ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain data (JSON-ready); :meth:`from_json` reads it back."""
        return {
            "ids": list(self.ids),
            "messages": [s.to_json() for s in self.messages],
            "reasoning": [s.to_json() for s in self.reasoning],
            "generation_start": self.generation_start,
            "text": self.text,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> ChatTokens:
        """Read what :meth:`to_json` wrote (a dict or its JSON text)."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise InvalidChat(f"chat tokens are not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(data, Mapping) or "ids" not in data or "messages" not in data:
            raise InvalidChat(f"chat tokens are an object with 'ids' and 'messages', got {data!r:.200}")
        ids = data["ids"]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise InvalidChat("chat tokens' 'ids' must be a list of ints")
        start = data.get("generation_start")
        if start is not None and type(start) is not int:
            raise InvalidChat(f"generation_start is an int or null, got {start!r:.80}")
        spans = [Span.from_json(s) for s in data["messages"]], [Span.from_json(s) for s in data.get("reasoning", [])]
        bad = [s for s in spans[0] + spans[1] if max(s.end, s.turn_end) > len(ids)]
        if bad:
            raise InvalidChat(f"a span ends past the {len(ids)} ids: {bad[0]}")
        text = data.get("text", "")
        return cls(list(ids), tuple(spans[0]), tuple(spans[1]), start, text if isinstance(text, str) else "")


# -- resolving named positions -------------------------------------------------------------------
def span_positions(name: str, tokens: Any, n_prompt: int) -> list[int]:
    """The absolute prompt positions ``name`` (a chat span name, :func:`parse_position_name`)
    selects in ``tokens`` (a :class:`ChatTokens`), ascending; ``InvalidSteering`` when ``tokens``
    has no spans, the name is not a span name, or it selects nothing (the message lists the
    spans there are)."""
    parsed = parse_position_name(name)
    if not isinstance(tokens, ChatTokens):
        raise InvalidSteering(
            f"positions {name!r} name a chat span; pass model.chat_tokens(messages) as the prompt "
            "(plain token ids have no spans)"
        )
    if len(tokens) != n_prompt:
        raise InvalidSteering(f"positions {name!r}: the chat has {len(tokens)} tokens but the prompt {n_prompt}")
    if parsed.name == "reasoning":
        matching = list(tokens.reasoning)
    elif parsed.name == "message":
        matching = list(tokens.messages)
    else:
        matching = [s for s in tokens.messages if s.role == parsed.name]
    if parsed.index is not None:
        if not -len(matching) <= parsed.index < len(matching):
            raise InvalidSteering(
                f"positions {name!r}: there {'is' if len(matching) == 1 else 'are'} {len(matching)} "
                f"{parsed.name!r} span(s) in this chat; it has {_describe(tokens)}"
            )
        matching = [matching[parsed.index]]
    found = sorted({p for span in matching for p in span.positions(parsed.part)})
    if not found:
        raise InvalidSteering(f"positions {name!r} select no token of this chat; it has {_describe(tokens)}")
    return found


def select_positions(positions: Any, tokens: Any, n_prompt: int, n_total: int) -> list[int]:
    """The absolute positions ``positions`` keeps in a sequence of ``n_total`` tokens whose first
    ``n_prompt`` are the prompt ``tokens``: ``"all"``, ``"prompt"``, ``"generated"``, a chat span
    name (ascending) or indices (in the order given; negative ones count back from the end of the
    sequence). ``InvalidOption`` for a selection that does not fit."""
    if isinstance(positions, str):
        if positions == "all":
            return list(range(n_total))
        if positions == "prompt":
            return list(range(min(n_prompt, n_total)))
        if positions == "generated":
            if n_total <= n_prompt:
                raise InvalidOption("positions 'generated': this sequence has no generated tokens")
            return list(range(n_prompt, n_total))
        try:
            return span_positions(positions, tokens, n_prompt)
        except InvalidSteering as exc:
            raise InvalidOption(f"positions: {exc}") from None
    if isinstance(positions, torch.Tensor):
        positions = positions.reshape(-1).tolist() if positions.dim() <= 1 else positions.tolist()
    if isinstance(positions, int) and not isinstance(positions, bool):
        positions = [positions]
    if isinstance(positions, (bytes, Mapping)) or not isinstance(positions, Sequence) or not positions:
        raise InvalidOption(
            f"positions are 'all', 'prompt', 'generated', a chat span name ('user[-1].last') or a non-empty list "
            f"of ints, got {positions!r:.80}"
        )
    out = []
    for index in positions:
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidOption(f"positions are ints, got {index!r:.40} in {positions!r:.80}")
        absolute = index + n_total if index < 0 else index
        if not 0 <= absolute < n_total:
            raise InvalidOption(
                f"position {index} is outside this {n_total}-token sequence (valid: {-n_total}..{n_total - 1})"
            )
        out.append(absolute)
    if len(set(out)) != len(out):
        raise InvalidOption(f"positions {list(positions)!r:.80} name one position twice")
    return out


def _describe(tokens: ChatTokens) -> str:
    roles: dict[str, int] = {}
    parts = []
    for span in tokens.messages:
        i = roles.get(span.role, 0)
        roles[span.role] = i + 1
        parts.append(f"{span.role}[{i}] (tokens {span.start}:{span.end})")
    parts += [f"reasoning[{i}] (tokens {s.start}:{s.end})" for i, s in enumerate(tokens.reasoning)]
    return ", ".join(parts) or "no spans"


# -- building ChatTokens -------------------------------------------------------------------------
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
