"""Steering blocks: a spec that every request on one model picks up while a ``with steer(...)``
block is open (:func:`interp_engine.steer`).

The open blocks live in a context variable, so they follow the code that opened them -- into the
coroutines it awaits and into the sync facade's background loop, which runs each call in a copy of
the caller's context -- and never reach a request made elsewhere (another task, another thread):
under vLLM's batching a neighbour's request is untouched. A model's request checks add the open
blocks' writes (outermost first) before the request's own ``steering_spec``, restricted to the
positions each block allows (:func:`block_writes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._errors import InvalidSteering
from ._spec import AnyWrite, SteeringSpec, resolve_named_positions
from ._values import as_index, short_repr


class SteerMask(enum.Enum):
    """Named prompt positions a ``steer(..., position_mask=...)`` block leaves unsteered,
    resolved against each request's prompt.

    ``SPECIAL_TOKENS``: the positions of the tokenizer's special tokens (BOS, EOS, chat markers
    such as ``<|im_start|>``), so only content tokens are steered."""

    SPECIAL_TOKENS = "special_tokens"


@dataclass(frozen=True)
class Block:
    """One open ``steer(...)`` block: its model, spec and the positions it leaves alone."""

    model: object
    spec: SteeringSpec
    position_mask: tuple[int, ...] | SteerMask = ()
    """Prompt positions left unsteered (negative ones count back from the end of the prompt), or
    a :class:`SteerMask` naming them."""
    generated: bool = True
    """Whether generated tokens are steered (``False``: the prompt only)."""


_OPEN: contextvars.ContextVar[tuple[Block, ...]] = contextvars.ContextVar("interp_engine_steer", default=())


def mask_positions(position_mask: Any) -> tuple[int, ...] | SteerMask:
    """``position_mask`` (``None``, prompt positions or a :class:`SteerMask`), checked."""
    if position_mask is None:
        return ()
    if isinstance(position_mask, SteerMask):
        return position_mask
    if isinstance(position_mask, (str, bytes)) or not isinstance(position_mask, Sequence):
        raise InvalidSteering(
            f"position_mask is a list of prompt positions to leave unsteered (or SteerMask.SPECIAL_TOKENS), "
            f"got {short_repr(position_mask)}"
        )
    out = []
    for item in position_mask:
        index = as_index(item)
        if index is None:
            raise InvalidSteering(f"position_mask holds prompt positions (ints), got {short_repr(item)}")
        out.append(index)
    return tuple(out)


@contextlib.contextmanager
def open_block(block: Block) -> Iterator[None]:
    """Open ``block`` for the code inside the ``with`` (and what it awaits or hands the sync
    facade); closed on the way out, exceptions included."""
    token = _OPEN.set((*_OPEN.get(), block))
    try:
        yield
    finally:
        _OPEN.reset(token)


def open_blocks(model: object) -> tuple[Block, ...]:
    """The blocks open for ``model`` here, outermost first."""
    return tuple(b for b in _OPEN.get() if b.model is model)


def with_blocks(
    model: object,
    spec: SteeringSpec | None,
    tokens: Any,
    ids: Sequence[int],
    max_tokens: int,
    special_ids: Callable[[], frozenset[int]],
) -> SteeringSpec | None:
    """``spec`` preceded by the writes of the blocks open for ``model`` (:func:`block_writes`
    against this request's prompt: ``tokens`` as given, ``ids`` checked; ``special_ids`` gives
    the tokenizer's special tokens for ``SteerMask.SPECIAL_TOKENS``); ``spec`` itself when none
    is open."""
    blocks = open_blocks(model)
    if not blocks:
        return spec
    writes: list[AnyWrite] = []
    for block in blocks:
        if isinstance(block.position_mask, SteerMask):
            special = special_ids()
            masked: tuple[int, ...] = tuple(p for p, token in enumerate(ids) if token in special)
        else:
            masked = block.position_mask
        writes += block_writes(block.spec, masked, block.generated, tokens, len(ids), max_tokens)
    return SteeringSpec([*writes, *(spec.writes if spec is not None else ())])


def block_writes(
    spec: SteeringSpec, mask: Sequence[int], generated: bool, tokens: Any, n_prompt: int, max_tokens: int
) -> list[AnyWrite]:
    """A block's writes for one request (a prompt of ``n_prompt`` tokens, ``max_tokens``
    generated): chat span names resolved against ``tokens``, then each write limited to the
    positions the block allows -- the prompt without the positions of ``mask``, and the generated
    tokens unless ``generated`` is false. A write left with no position is dropped."""
    resolved = resolve_named_positions(spec, tokens, n_prompt)
    writes = resolved.writes if resolved is not None else ()
    masked = {p if p >= 0 else n_prompt + p for p in mask}
    if not masked and generated:
        return list(writes)
    out: list[AnyWrite] = []
    for write in writes:
        if write.per_position or write.target_per_position:
            raise InvalidSteering(
                f"{write!r} holds one row per position, which steer(position_mask=..., generated=False) cannot "
                "thin out; give the write explicit positions instead"
            )
        prompt, writes_generated = _selected(write.positions, n_prompt)
        kept = tuple(p for p in prompt if p not in masked)
        if kept == tuple(range(n_prompt)) and write.positions in ("all", "prompt"):
            prompt_part: Any = "prompt"
        else:
            prompt_part = kept
        if prompt_part:
            out.append(replace(write, positions=prompt_part))
        if writes_generated and generated and max_tokens > 0:
            out.append(replace(write, positions="generated"))
    return out


def _selected(positions: Any, n_prompt: int) -> tuple[tuple[int, ...], bool]:
    """The prompt positions a write's (resolved) ``positions`` select, and whether it writes the
    generated tokens."""
    if positions == "all":
        return tuple(range(n_prompt)), True
    if positions == "prompt":
        return tuple(range(n_prompt)), False
    if positions == "generated":
        return (), True
    absolute = [p if p >= 0 else n_prompt + p for p in positions]
    generated = any(p >= n_prompt for p in absolute)
    if generated:
        raise InvalidSteering(
            f"positions {list(positions)!r} reach past the prompt, which steer(position_mask=..., generated=False) "
            "cannot thin out; use positions='generated' for the generated tokens"
        )
    return tuple(absolute), False
