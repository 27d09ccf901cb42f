"""Steering and reading inside vLLM's own generation: the engine's ``generate`` is wrapped
(:func:`wrap_generate`) so a request whose route handler set a :class:`~._requests.Call` is
checked against the model (:func:`check`: its steering, readouts, lens and points, the positions
they are read at, a cache salt of its own) and generated with its payload in
``SamplingParams.extra_args`` (:func:`steer`), its readouts and lens drained as its tokens come
and its points read once it is done; every other request goes through untouched."""

from __future__ import annotations

import copy
import secrets
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from interp_engine import (
    Address,
    CaptureMemoryExceeded,
    InterpError,
    InvalidOption,
    InvalidSteering,
    LensRequest,
)
from interp_engine.chat import build_chat_tokens, is_span_name, select_positions

from .. import _compat
from ..frontend._capture_memory import OPTION as CAPTURE_MEMORY_OPTION
from ..frontend._capture_memory import needed_bytes
from ..frontend._lens_assembly import keyed, with_lens
from ._answers import Steps, points_answer, step
from ._requests import CALL, FIELD, Call, LimitExceeded, Refused


class Served(Protocol):
    """What steering reads of the plugin at each request: the model it serves and its bound on the
    numbers an answer's points hold."""

    model: Any
    points_max_values: int


def wrap_generate(endpoints: Served, engine: Any) -> None:
    """Route ``engine.generate`` through the steering of the call its route handler set."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate(prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            call = CALL.get()
            if call is None or not hasattr(sampling_params, "extra_args"):
                return original(prompt, sampling_params, request_id, *args, **kwargs)
            prompt, checked, selected = check(endpoints, call, prompt, sampling_params)
            return steer(
                endpoints.model,
                original,
                call.steps,
                checked,
                selected,
                prompt,
                sampling_params,
                request_id,
                args,
                kwargs,
            )

        return generate

    _compat.wrap_engine_generate(engine, wrap)


def check(endpoints: Served, call: Call, prompt: Any, params: Any) -> tuple[Any, Any, list[int]]:
    """The prompt (with a cache salt of its own), the request's checked steering, readouts and
    points, and the positions its points are read at."""
    model = endpoints.model
    ids = _compat.prompt_token_ids(model._engine, prompt)
    if ids is None or not isinstance(prompt, dict):
        raise Refused(InvalidSteering("steering needs a prompt of tokens (not embeddings)"), call.field)
    tokens: Any = list(ids)
    named = call.spec is not None and any(is_span_name(w.positions) for w in call.spec.writes)
    if named or (isinstance(call.positions, str) and call.positions != "prompt"):
        try:
            tokens = _chat_tokens(model, call, tokens)
        except Refused as exc:
            if named:
                raise
            raise Refused(InvalidOption(str(exc.error)), f"{FIELD}.positions") from None
    if call.steps is not None:
        call.steps.generations += 1
        if call.steps.generations > 1:
            raise Refused(InvalidOption("readouts and the lens are read for one prompt per request"), FIELD)
    max_tokens = int(params.max_tokens or 1)
    points = _addresses(model, call.points, len(ids), max_tokens)
    try:
        lens = None if call.lens is None else LensRequest(**call.lens)
        checked = model._check_generation(
            tokens,
            [*model._stream_readouts(call.features), *points],
            max_tokens=max_tokens,
            steering_spec=call.spec,
            sampling={},
            lens=lens,
        )
    except InterpError as exc:
        raise Refused(exc, FIELD if call.spec is None else call.field) from None
    except TypeError as exc:  # a lens object with fields LensRequest does not take
        fields = InvalidOption(f"interp.lens takes layers and top_k: {exc}")
        raise Refused(fields, f"{FIELD}.lens") from None
    selected = _positions(endpoints, call, tokens, checked, max_tokens) if points else []
    return {**prompt, "cache_salt": f"interp-{secrets.token_hex(8)}"}, checked, selected


def _addresses(model: Any, points: tuple[str, ...], n: int, max_tokens: int) -> list[Address]:
    """``interp.points`` as addresses, each checked against the model (the entry at fault named)."""
    out = []
    for i, text in enumerate(points):
        try:
            address = Address.parse(text)
            model._check_generation([0] * n, [address], max_tokens=max_tokens, steering_spec=None, sampling={})
        except InterpError as exc:
            raise Refused(exc, f"{FIELD}.points[{i}]") from None
        out.append(address)
    return out


def _positions(endpoints: Served, call: Call, tokens: Any, checked: Any, max_tokens: int) -> list[int]:
    """The positions ``interp.positions`` selects, each one the engine runs (the prompt's and
    every generated token's but the last, which vLLM samples and never runs), and the answer
    within :attr:`Served.points_max_values` and the capture memory."""
    n = len(checked.token_ids)
    runs = n + max_tokens - 1
    field = f"{FIELD}.positions"
    if isinstance(call.positions, list):
        past = [p for p in call.positions if p >= runs]
        if past:
            raise Refused(
                InvalidOption(
                    f"position {past[0]} is past the last one this request runs: positions 0..{runs - 1} (the "
                    f"prompt's {n} tokens, then each generated token but the last, which the model never runs)"
                ),
                field,
            )
    try:
        selected = select_positions(call.positions, tokens, n, runs)
    except InterpError as exc:
        raise Refused(exc, field) from None
    model = endpoints.model
    n_total = n + max_tokens
    per_position = sum(needed_bytes([a], n_total, model.info) // (4 * n_total) for a in checked.addresses)
    values = len(selected) * per_position
    if values > endpoints.points_max_values:
        raise Refused(
            LimitExceeded(
                f"interp.points at these {len(selected)} positions would return {values} numbers; this server "
                f"returns at most points_max_values={endpoints.points_max_values} in an answer (fewer points or "
                "positions, or /interp/v1/capture_generation for whole captures)",
                valid=endpoints.points_max_values,
            ),
            f"{FIELD}.points",
        )
    needed = needed_bytes(checked.addresses, n_total, model.info)
    if needed > model.capture_memory.limit:
        error = CaptureMemoryExceeded(
            f"interp.points holds {needed} bytes while the request runs and the capture memory cap is "
            f"{model.capture_memory.limit} bytes (fewer points or a smaller max_tokens)",
            needed=needed,
            limit=model.capture_memory.limit,
            option=CAPTURE_MEMORY_OPTION,
        )
        raise Refused(error, f"{FIELD}.points")
    return selected


def _chat_tokens(model: Any, call: Call, ids: list[int]) -> Any:
    if call.messages is None:
        raise Refused(
            InvalidSteering("positions that name chat spans need /v1/chat/completions (messages)"), call.field
        )
    if call.chat_options is None:
        raise Refused(
            InvalidSteering(
                "chat span names are read in the model's own chat template; this request sets chat_template "
                "or continue_final_message: give absolute positions"
            ),
            call.field,
        )
    try:
        tokens = build_chat_tokens(model.tokenizer, _plain(call.messages), **call.chat_options)
    except InterpError as exc:
        raise Refused(exc, call.field) from None
    if list(tokens) != ids:
        raise Refused(
            InvalidSteering(
                "chat span names could not be read in this prompt: vLLM rendered it differently from the "
                "model's chat template over these messages (tools or multimodal parts?); give absolute positions"
            ),
            call.field,
        )
    return tokens


def steer(
    model: Any,
    original: Callable[..., Any],
    steps: Steps | None,
    checked: Any,
    selected: list[int],
    prompt: Any,
    params: Any,
    request_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> AsyncGenerator[Any, None]:
    """vLLM's generation of a checked request (``original``: the engine's own ``generate``), with
    its SAEs held in the workers and its capture memory reserved while it runs."""

    async def run() -> AsyncGenerator[Any, None]:
        engine = model._engine
        await model._sync_saes(engine, checked)
        keys = model._use_saes(checked)

        def generate(steered: Any) -> Any:
            return original(prompt, steered, request_id, *args, **kwargs)

        try:
            n_total = len(checked.token_ids) + checked.max_tokens
            async with model.capture_memory.reserved(checked.addresses, n_total, model.info) as regions:
                outputs = _generate(model, generate, params, engine, keys, regions, steps, checked, selected)
                async for output in outputs:
                    yield output
        finally:
            await model._unuse_saes(engine, keys)

    return run()


async def _generate(
    model: Any,
    generate: Callable[[Any], Any],
    params: Any,
    engine: Any,
    keys: dict[str, str],
    regions: Any,
    steps: Steps | None,
    checked: Any,
    selected: list[int],
) -> AsyncGenerator[Any, None]:
    """vLLM's generation of one steered or read request, its readouts and lens drained into
    ``steps`` as its tokens come, its points read once it is done."""
    from vllm.sampling_params import RequestOutputKind

    points = checked.addresses
    drains = bool(checked.readouts or checked.lens)
    holds = drains or bool(points)
    rid = f"interp-{uuid.uuid4().hex}"
    delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
    n = len(checked.token_ids)
    payload = model._payload(
        rid, points, checked.writes, n, n + checked.max_tokens, checked.readouts, stream=drains, regions=regions
    )
    payload = keyed(with_lens(payload, checked.lens), keys)
    steered = copy.copy(params)
    steered.extra_args = {**(params.extra_args or {}), **payload.extra_args()}
    position, generated = n - 1, 0
    pending: dict[int, dict[Any, Any]] = {}
    lens_pending: dict[int, tuple[Any, Any]] = {}
    fetched = False
    try:
        async for output in generate(steered):
            count = len(output.outputs[0].token_ids) if holds and output.outputs else 0
            new = count if delta else count - generated
            generated += max(new, 0)
            if new > 0 and drains and steps is not None:
                await model._drain(engine, rid, pending, lens_pending)
                for _ in range(new):
                    found = pending.pop(position, {})
                    lens = lens_pending.pop(position, None)
                    steps.ready.append(step(position, found, lens, checked, model.tokenizer))
                    position += 1
            yield output
        if points and steps is not None:
            ran = n + max(generated - 1, 0)  # vLLM never runs the last token it samples
            values, _, _ = await model._fetch(engine, rid, points, ran, (), regions)
            fetched = True
            steps.points = points_answer(checked, values, [p for p in selected if p < ran])
    finally:
        if holds and not fetched:
            await model._release(engine, rid)


def _plain(messages: list[Any]) -> list[Any]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]
