"""Chat token spans and positions named by them (the public face is :mod:`interp_engine.chat`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from .._errors import InvalidChat, InvalidOption, InvalidSteering

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
