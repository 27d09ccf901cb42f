"""The sync free functions: one screen each, delegating to the model through its facade."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ._errors import InvalidAddress, InvalidOption, InvalidTokens
from ._padded import repad, unpad
from ._sync import SyncModel, sync_model
from .addresses._address import Address, as_address, is_point_tuple
from .chat._spans import ChatTokens, select_positions
from .protocol._base import ModelBase
from .protocol._protocol import BatchCapture, Completion, InterpModel, Points, Results, RowAdapters, StreamStep
from .results._attention import AttentionCache
from .results._cache import Cache, keep_positions
from .results._lens import LensRequest, LensResult
from .sae._readouts import FeatureReadout, Features, as_features, stack_readouts
from .steering._spec import RowSpecs, SteeringSpec, row_specs

Tokens = str | Sequence[str] | torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


Row = list[int] | ChatTokens
"""One prompt's ids: a list, or a :class:`ChatTokens` kept whole (its spans name positions)."""


def token_rows(model: InterpModel, tokens: Tokens) -> list[Row]:
    """Normalise any token input into one list of ids per prompt.

    Accepts a text, a list of texts (each tokenized alone), ids ``[n]`` or ``[batch, n]`` as a
    tensor, a list of ids, or a list of id lists (rows may differ in length). A
    :class:`ChatTokens` (or a list of them, mixed with id lists or not) stays intact, so the
    model resolves positions named by chat span against it.
    """
    if isinstance(tokens, ChatTokens):
        return [tokens]
    if isinstance(tokens, str):
        return [model.to_tokens(tokens)[0].tolist()]
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 1:
            return [tokens.tolist()]
        if tokens.dim() == 2:
            rows: list[Row] = tokens.tolist()  # one copy off the device, not one per row
            return rows
        raise InvalidTokens(f"token ids are [n] or [batch, n], got a tensor of shape {list(tokens.shape)}")
    items: list[Any] = list(tokens)
    if not items:
        raise InvalidTokens("no tokens given: pass a text, a list of token ids or a [batch, n] tensor")
    if all(isinstance(t, str) for t in items):
        return [model.to_tokens(t)[0].tolist() for t in items]
    if all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]
    if all(isinstance(t, (list, tuple, torch.Tensor, ChatTokens)) for t in items):
        return [row if isinstance(row, ChatTokens) else [int(i) for i in row] for row in items]
    raise InvalidTokens("tokens must be a text, a list of texts, a list of ids or a list of id lists")


def model_points(model: InterpModel, points: Points | Features) -> list[Address | Features]:
    """Normalise the points of a free function: one point (an ``Address``, its string, a
    :class:`Features` or its string) or a list of them; each address resolved against the model
    (a negative layer counts from the end), readouts parsed, repeats dropped.

    ``"resid_post.-1"`` and ``"resid_post.3"`` are one point on a 4-layer model: the cache holds
    it once, under the absolute layer."""
    if (
        isinstance(points, (str, Address, Features))
        or is_point_tuple(points)
        or (isinstance(points, Mapping) and "sae" in points)
    ):
        items: list[Any] = [points]
    else:
        try:
            items = list(points)
        except TypeError:
            raise InvalidAddress(
                "points are one address (an Address or a string such as 'resid_post.0'), one feature readout, "
                f"or a list of them; got {type(points).__name__}",
                address=points,
            ) from None
    out: list[Address | Features] = []
    n_layers = model.info.n_layers
    for point in items:
        if isinstance(point, Address):
            out.append(point.resolve(n_layers))
        elif Features.is_form(point) or isinstance(point, Mapping):
            out.append(as_features(point))
        else:
            out.append(as_address(point).resolve(n_layers))
    return list(dict.fromkeys(out))


def pad_rows(rows: Sequence[Results], lengths: Sequence[int]) -> Results:
    """Stack per-prompt activations into batched tensors, right-padding with zeros (attention
    scores with ``-inf``, as masked; readout ids with ``-1``)."""
    longest = max(lengths)
    out = Results()
    for address in rows[0]:
        if isinstance(address, Features):
            out[address] = stack_readouts([_readout(row[address]) for row in rows], lengths)
            continue
        if not isinstance(address, Address):
            raise TypeError(f"{address} is not an activation to pad (a capture returns activations and readouts)")
        padded = []
        for row in rows:
            value = row[address]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{address} came back as {type(value).__name__}, not a tensor")
            pad: tuple[int, ...]
            fill = 0.0
            if address.info.width == "heads x keys":  # [heads, q, k]; scores are -inf where masked
                pad = (0, longest - value.shape[2], 0, longest - value.shape[1])
                fill = float("-inf") if address.kind == "attn_scores" else 0.0
            else:  # [n, width], or [n, heads, d_head] at head addresses
                pad = (0, 0) * (value.dim() - 1) + (0, longest - value.shape[0])
            padded.append(torch.nn.functional.pad(value, pad, value=fill))
        out[address] = torch.stack(padded)
    return out


def _readout(value: torch.Tensor | FeatureReadout) -> FeatureReadout:
    if not isinstance(value, FeatureReadout):
        raise TypeError(f"a feature readout came back as {type(value).__name__}")
    return value


def adapter_kwargs(adapter: Any) -> dict[str, Any]:
    """``{"adapter": adapter}``, or nothing for the base model (so a backend written before
    adapters is still called as it was)."""
    return {} if adapter is None else {"adapter": adapter}


def row_adapters(adapter: RowAdapters, n_rows: int) -> list[Any]:
    """``adapter`` as one per row (a single one, or ``None``, is every row's); the model checks each."""
    if adapter is None or isinstance(adapter, str) or not isinstance(adapter, Sequence):
        return [adapter] * n_rows
    return list(adapter)


async def capture_rows(
    model: InterpModel,
    rows: Sequence[Sequence[int]],
    points: Points,
    steering_spec: RowSpecs,
    adapter: RowAdapters = None,
) -> Results:
    """Batched activations for several prompts: the model's own batch path if it has one,
    else one ``capture`` per prompt, gathered concurrently (vLLM batches them) and padded.
    ``steering_spec``: one spec for every row, or a list of one spec (or ``None``) per row;
    ``adapter`` likewise."""
    points = model_points(model, points)
    if isinstance(model, BatchCapture):
        return await model.capture_batch(rows, points, steering_spec=steering_spec, **adapter_kwargs(adapter))
    per_row = await _capture_each_row(model, rows, points, steering_spec, adapter)
    return pad_rows(per_row, [len(r) for r in rows])


async def _capture_each_row(
    model: InterpModel,
    rows: Sequence[Sequence[int]],
    points: Sequence[Address | Features],
    steering_spec: RowSpecs = None,
    adapter: RowAdapters = None,
) -> list[Results]:
    """One ``capture`` per row at ``points`` (resolved), gathered concurrently (vLLM batches
    them), each row's values unpadded."""
    specs = row_specs(steering_spec, len(rows))
    adapters = row_adapters(adapter, len(rows))
    if len(adapters) != len(rows):
        from ._errors import InvalidAdapter

        raise InvalidAdapter(f"adapter lists {len(adapters)} adapters but the batch has {len(rows)} rows")
    return list(
        await asyncio.gather(
            *(
                model.capture(r, points, steering_spec=spec, **adapter_kwargs(a))
                for r, spec, a in zip(rows, specs, adapters, strict=True)
            )
        )
    )


def unstack_rows(values: Results, lengths: Sequence[int]) -> list[Results]:
    """Batched, right-padded values as one :class:`Results` per row of ``lengths`` tokens, each
    value a view of its row's real positions (``[n, ...]``; attention ``[heads, n, n]``)."""
    out = []
    for i, n in enumerate(lengths):
        row = Results()
        for point, value in values.items():
            if isinstance(point, Address) and point.info.width == "heads x keys":
                row[point] = value[i, :, :n, :n]
            else:
                row[point] = value[i, :n]
        out.append(row)
    return out


async def capture_each(
    model: InterpModel, rows: Sequence[Sequence[int]], points: Sequence[Address | Features]
) -> list[Results]:
    """Each row's values at ``points`` (resolved), unpadded (:func:`rows_with_cache`)."""
    if isinstance(model, BatchCapture):
        return unstack_rows(await model.capture_batch(rows, points), [len(r) for r in rows])
    return await _capture_each_row(model, rows, points)


def rows_with_cache(model: InterpModel | SyncModel, rows: Sequence[Sequence[int]], points: Points) -> list[Results]:
    """Each row's activations at ``points`` without padding: per row, values ``[n, ...]`` and
    readouts ``[n, k]``, the rows :func:`run_with_cache` pads and stacks, for a caller that puts
    each row somewhere of its own (a harvest's shards). A model that captures a batch in one
    forward gives views of its batched values' rows; the others give each row's own capture,
    the rows run concurrently (vLLM batches them), as they came (on the vllm backends, views of
    the shared memory the workers wrote into)."""
    facade = _facade(model)
    resolved = model_points(facade.model, points)
    blocking = facade.blocking
    if blocking is not None:
        batched = facade.call(lambda: blocking.capture_batch_blocking(rows, resolved))
        return unstack_rows(batched, [len(r) for r in rows])
    return facade.run(lambda: capture_each(facade.model, rows, resolved))


def _facade(model: InterpModel | SyncModel) -> SyncModel:
    return sync_model(model)


def _lengths(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor([len(r) for r in rows])


def _chats(rows: Sequence[Sequence[int]]) -> list[ChatTokens | None] | None:
    """Each row's ChatTokens (``None`` for plain ids), or ``None`` when no row is a chat."""
    chats = [r if isinstance(r, ChatTokens) else None for r in rows]
    return chats if any(c is not None for c in chats) else None


def chat_tokens(
    model: InterpModel | SyncModel,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
    **template_kwargs: Any,
) -> ChatTokens:
    """``model.chat_tokens(messages, ...)``: the chat rendered by the model's own template as a
    :class:`ChatTokens` (ids with message and reasoning spans), to pass wherever ids go."""
    return _facade(model).chat_tokens(
        messages, add_generation_prompt=add_generation_prompt, template=template, **template_kwargs
    )


def run_with_cache(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    points: Points,
    *,
    steering_spec: RowSpecs = None,
    positions: Any = None,
    adapter: RowAdapters = None,
    attention_mask: Any = None,
    position_ids: Any = None,
) -> Cache:
    """Activations at ``points`` for one prompt or a batch, as a :class:`Cache` ``[batch, pos, width]``.

    ``attention_mask`` (``[batch, seq]``, 1 at real tokens) takes a padded batch ``tokens``
    (left or right padded): each row runs as its real tokens alone, counting positions from 0 at
    its first real token (:func:`position_ids_from_mask`; ``position_ids`` may be given only if it
    equals that), and the values come back in the padded layout, zeros (attention scores
    ``-inf``) at masked positions; ``lengths`` is then ``None``.

    ``steering_spec`` is one :class:`SteeringSpec` for every row, or a list of one spec (or
    ``None``) per row: each row then equals its own run under its own spec (one forward on
    eager; concurrent requests, batched by vLLM, on the vllm backends).

    ``adapter`` runs the rows under a LoRA adapter (a name ``model.load_adapter`` registered, an
    adapter folder, or ``"interp:tiny-lora"``; ``None``: the base model), or a list of one per row:
    each row then equals its own run under its own adapter.

    ``positions`` keeps only those positions of each row: a chat span name (``"user[-1].last"``,
    resolved against each row's :class:`ChatTokens`), ``"all"`` or indices (negative ones count
    back from each row's end); values are then ``[batch, n_kept, ...]`` and ``cache.positions``
    holds the absolute positions kept. Prompts given as :class:`ChatTokens` are ``cache.chat``."""
    facade = _facade(model)
    if attention_mask is not None:
        if positions is not None:
            raise InvalidOption("positions= selects positions of unpadded rows; with attention_mask, index the result")
        real, where, width = unpad(tokens, attention_mask, position_ids)
        unpadded = run_with_cache(facade, real, points, steering_spec=steering_spec, adapter=adapter)
        values = repad(dict(unpadded.items()), where, width)
        return Cache(values, n_layers=facade.model.info.n_layers)
    if position_ids is not None:
        raise InvalidTokens(
            "position_ids goes with attention_mask (a padded batch); unpadded rows count positions from 0 already"
        )
    rows = token_rows(facade.model, tokens)
    resolved = model_points(facade.model, points)
    selected = None
    if positions is not None:  # checked before any compute
        selected = [select_positions(positions, row, len(row), len(row)) for row in rows]
    blocking = facade.blocking
    if blocking is not None:  # no trip through the facade's loop
        values = facade.call(
            lambda: blocking.capture_batch_blocking(
                rows, resolved, steering_spec=steering_spec, **adapter_kwargs(adapter)
            )
        )
    else:
        values = facade.run(lambda: capture_rows(facade.model, rows, resolved, steering_spec, adapter))
    n_layers = facade.model.info.n_layers
    if selected is None:
        return Cache(values, lengths=_lengths(rows), n_layers=n_layers, chat=_chats(rows))
    kept, absolute = keep_positions(values, selected)
    lengths = torch.tensor([len(p) for p in selected])
    return Cache(kept, lengths=lengths, n_layers=n_layers, chat=_chats(rows), positions=absolute)


def capture_attention(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    layers: int | Iterable[int],
    *,
    steering_spec: RowSpecs = None,
    adapter: RowAdapters = None,
) -> Cache:
    """Attention probabilities of ``layers`` (one layer or a list; negative ones count from
    the end) as a :class:`Cache` of ``[batch, heads, q, k]``, under ``steering_spec`` if given:
    the pattern of head 1.0 with head 0.0 zero-ablated is ``capture_attention(model, tokens, [1],
    steering_spec=SteeringSpec([Write("attn_z.0", torch.zeros(d_head), op="set", heads=[0])]))``.

    For one prompt, ``cache[L]`` (an int layer) is the public ``interp-engine`` package's
    ``{"scores", "probs", "value"}`` for layer ``L``, without the batch axis (where the model
    serves ``attn_scores`` and ``attn_v``)."""
    listed = [layers] if isinstance(layers, int) else list(layers)
    facade = _facade(model)
    points = [Address("attn_pattern", layer) for layer in listed]
    extras: list[Address] = facade.model._attention_extras(listed) if isinstance(facade.model, ModelBase) else []
    cache = run_with_cache(facade, tokens, points + extras, steering_spec=steering_spec, adapter=adapter)
    values = {a: v for a, v in cache.items() if isinstance(a, Address) and isinstance(v, torch.Tensor)}
    return AttentionCache(values, lengths=cache.lengths, n_layers=cache.n_layers, chat=cache.chat)


def _one_prompt(model: InterpModel, tokens: Tokens, what: str) -> Row:
    rows = token_rows(model, tokens)
    if len(rows) != 1:
        raise InvalidTokens(
            f"{what} takes one prompt, got {len(rows)}; call it once per prompt "
            f"(or asyncio.gather the model's async method)"
        )
    return rows[0]


def capture_generation(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    points: Points,
    *,
    max_tokens: int,
    steering_spec: SteeringSpec | None = None,
    lens: LensRequest | None = None,
    positions: Any = None,
    adapter: str | None = None,
    **sampling: Any,
) -> tuple[Completion, Cache]:
    """Generate from one prompt and return the completion with activations over prompt +
    generated tokens as a :class:`Cache` ``[1, pos, width]``; with ``lens=LensRequest(...)``,
    the logit lens read during the generation is ``cache.lens`` (a :class:`LensResult`).
    ``points`` may be empty (``[]``) to read the lens alone. ``positions`` keeps only those
    positions, as for :func:`run_with_cache` (``"generated"``: the generated tokens; chat span
    names select prompt tokens; indices count back from the end of prompt + generation).
    ``adapter``: the LoRA adapter to generate under, as for :func:`run_with_cache` (one prompt: one adapter)."""
    facade = _facade(model)
    row = _one_prompt(facade.model, tokens, "capture_generation")
    resolved = model_points(facade.model, points)
    if isinstance(positions, str) and positions not in ("all", "prompt", "generated"):
        select_positions(positions, row, len(row), len(row))  # a span name checked before generating
    extra: dict[str, Any] = {"lens": lens} if lens is not None else {}
    extra.update(adapter_kwargs(adapter))
    completion, acts = facade.capture_generation(
        row, resolved, max_tokens=max_tokens, steering_spec=steering_spec, **extra, **sampling
    )
    n = len(row) + len(completion.token_ids)
    read = next((v for k, v in acts.items() if isinstance(k, LensRequest) and isinstance(v, LensResult)), None)
    batched = {a: _batched(t) for a, t in acts.items() if not isinstance(a, LensRequest)}
    n_layers = facade.model.info.n_layers
    chat = _chats([row])
    if positions is None:
        return completion, Cache(batched, lengths=torch.tensor([n]), n_layers=n_layers, lens=read, chat=chat)
    selected = select_positions(positions, row, len(row), n)
    kept, absolute = keep_positions(batched, [selected])
    cache = Cache(
        kept, lengths=torch.tensor([len(selected)]), n_layers=n_layers, lens=read, chat=chat, positions=absolute
    )
    return completion, cache


def _batched(value: torch.Tensor | FeatureReadout) -> torch.Tensor | FeatureReadout:
    if isinstance(value, FeatureReadout):
        return FeatureReadout(
            value.values.unsqueeze(0),
            None if value.ids is None else value.ids.unsqueeze(0),
            None if value.error_norm is None else value.error_norm.unsqueeze(0),
        )
    return value.unsqueeze(0)


def generate_stream(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    *,
    max_tokens: int,
    n_logprobs: int = 0,
    steering_spec: SteeringSpec | None = None,
    features: Iterable[Any] | Features | str = (),
    lens: LensRequest | None = None,
    adapter: str | None = None,
    **sampling: Any,
) -> Iterator[StreamStep]:
    """Generated steps of one prompt, each with its top-``n_logprobs`` (token, logprob) pairs
    and, with ``features=[Features(...)]`` (or one readout), those readouts at the position that
    produced it; with ``lens=LensRequest(...)``, the logit lens there (``step.lens``, and the
    first step's ``prompt_lens`` at the prompt positions asked); ``adapter``: the LoRA adapter to
    generate under (``None``: the base model)."""
    facade = _facade(model)
    row = _one_prompt(facade.model, tokens, "generate_stream")
    readouts = model_points(facade.model, features)
    extra: dict[str, Any] = {"features": readouts} if readouts else {}
    if lens is not None:
        extra["lens"] = lens
    extra.update(adapter_kwargs(adapter))
    return facade.stream(
        row, max_tokens=max_tokens, n_logprobs=n_logprobs, steering_spec=steering_spec, **extra, **sampling
    )
