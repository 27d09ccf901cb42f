"""The HTTP server: a FastAPI app over any backend's async model (the seed's lifespan pattern).

The app only awaits the model's protocol methods, so it serves ``eager``, ``vllm`` and
``vllm-static`` models alike; on vLLM, concurrent requests are batched by the engine. SAEs
attached to the model (``load_model(..., saes=...)``, ``interp serve --sae NAME=PATH``) give
feature readouts in ``points`` and ``features``, and feature writes in steering specs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._errors import (
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    NoChatTemplate,
    UnknownSae,
    UnsupportedAddress,
)
from .._plugins import load_model
from ..addresses._address import Address
from ..addresses._kinds import KINDS
from ..chat._spans import ChatTokens, span_positions
from ..protocol._base import ModelBase
from ..protocol._checks import check_spec, value_shape
from ..protocol._protocol import Completion, InterpModel, StaticTaps, StreamStep
from ..results._lens import LensRequest, LensResult, LensTopK
from ..sae._readouts import FeatureReadout, Features, check_readout
from ..steering._spec import AnyWrite, FeatureWrite, SteeringSpec, Write
from ..tokens import check_text
from ._asgi import ClientGone, EventStream, Slots, unless_gone
from ._errors import ApiError, SafeJSONResponse, blame, elide, field_path, from_interp, limit_exceeded
from ._guard import API_KEY_ENV, ERROR_SCOPE_KEY, LOOPBACK_HOSTS, Guard, check_api_key, is_loopback, uvicorn_config
from ._json import StrictRoute
from ._limits import ServerLimits
from ._metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from ._schemas import (
    AttentionRequest,
    AttentionResponse,
    CaptureGenerationRequest,
    CaptureGenerationResponse,
    CaptureRequest,
    CaptureResponse,
    DecodeRequest,
    DecodeResponse,
    EncodedTensor,
    ErrorOut,
    FeaturesBody,
    FeatureWriteBody,
    GenerateRequest,
    GenerateResponse,
    LensBody,
    SteeringBody,
    TokenizeRequest,
    TokenizeResponse,
)
from ._tensors import SAFETENSORS, decode, encode, readout_out, safetensors_response

logger = logging.getLogger("interp_engine.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut, "description": text}
    for code, text in (
        (400, "the model rejected the input (InvalidAddress, InvalidTokens, InvalidSteering, UnknownSae, ...)"),
        (413, "a ServerLimits bound was exceeded"),
        (422, "the body does not fit the schema"),
        (503, "the model is not loaded or was shut down"),
    )
}
_TENSOR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {"content": {SAFETENSORS: {}}, "description": "JSON, or a safetensors Cache file when asked"},
}


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=True, allow_nan=False)}\n\n"


_ADDRESS_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_LAYER = re.compile(r"-?[0-9]{1,9}")


def _strict_address(text: str, field: str) -> Address:
    """``Address.parse`` of a request's address string, refusing what ``int()`` reads loosely
    (``resid_post.\u0663``, ``resid_post.1_0``, ``resid_post. 3``): ASCII only, a layer in at most
    nine decimal digits."""
    last = text.rsplit(".", 1)[-1] if "." in text else ""
    if not _ADDRESS_CHARS.fullmatch(text) or ((last[:1].isdigit() or last[:1] == "-") and not _LAYER.fullmatch(last)):
        raise ApiError(
            400,
            "InvalidAddress",
            f"{text!r} is not an address: 'kind' or 'kind.layer' (ASCII, the layer in decimal digits), "
            "or a TransformerLens hook name",
            field=field,
        )
    return Address.parse(text)


def _check_finite_steps(steps: Sequence[StreamStep], spec: SteeringSpec | None) -> None:
    for step in steps:
        if not all(math.isfinite(lp) for _, lp in step.logprobs):
            raise _non_finite("the logprobs of a generated token", spec)
        lenses = [lens.probs for lens in (step.lens, step.prompt_lens) if lens is not None]
        if not all(bool(torch.isfinite(probs).all()) for probs in lenses):
            raise _non_finite("the logit lens probabilities", spec)


def _non_finite(what: str, spec: Any, *, decoding: bool = False) -> ApiError:
    """The error for a result holding ``inf`` or ``NaN`` (not JSON), naming the likely cause."""
    if decoding:
        return ApiError(
            400,
            "InvalidActivations",
            f"{what} hold inf or NaN: the activations overflow float32 through the final norm and unembedding",
            field="activations",
        )
    if spec:
        return ApiError(
            400,
            "InvalidSteering",
            f"{what} hold inf or NaN under this request's steering: its writes overflow float32 activations "
            "(use a smaller scale or vector)",
            field="steering",
        )
    return ApiError(500, "BackendError", f"{what} hold inf or NaN (the model overflowed its dtype)")


def _step_out(step: StreamStep) -> dict[str, Any]:
    out = {
        "token_id": step.token_id,
        "text": step.text,
        "logprobs": [list(pair) for pair in step.logprobs],
        "position": step.position,
    }
    if step.features:
        out["features"] = {str(spec): readout_out(readout) for spec, readout in step.features.items()}
    return out


def _chat_out(chat: ChatTokens) -> dict[str, Any]:
    """What the positions of a chat prompt mean (the answer's ``chat``)."""
    return {
        "messages": [span.to_json() for span in chat.messages],
        "reasoning": [span.to_json() for span in chat.reasoning],
        "generation_start": chat.generation_start,
        "text": chat.text,
    }


def _lens_out(lens: LensTopK, to_str_tokens: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    """One step's lens as lists (``[n_layers][k]``), each id's text under ``tokens``."""
    ids = lens.ids.tolist()
    flat = [i for row in ids for i in row]
    return {
        "layers": list(lens.layers),
        "ids": ids,
        "probs": lens.probs.float().tolist(),
        "tokens": _nest(to_str_tokens(flat) if flat else [], list(lens.ids.shape)),
    }


def _lens_result_out(lens: LensResult, to_str_tokens: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    """The lens at several prompt positions as lists (``[n_layers][n_positions][k]``)."""
    flat = lens.ids.reshape(-1).tolist()
    return {
        "layers": list(lens.layers),
        "positions": list(lens.positions),
        "ids": lens.ids.tolist(),
        "probs": lens.probs.float().tolist(),
        "tokens": _nest(to_str_tokens(flat) if flat else [], list(lens.ids.shape)),
    }


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "template",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""``chat_template_kwargs`` names the server refuses: they are options of the tokenizer call or
of the request itself, not variables of the template."""
_TEMPLATE_KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


_PROMPT_FIELDS = {"token_ids": "token_ids, text and messages", "text": "text and messages"}


@dataclass(frozen=True)
class _PromptIn:
    """A request's prompt: ``tokens`` go to the model (the ids, or the :class:`ChatTokens` so
    that span-named positions resolve against it), ``ids`` to the answer; ``field`` is the
    request field it came from."""

    tokens: Sequence[int]
    ids: list[int]
    field: str
    chat: ChatTokens | None = None

    def head(self) -> dict[str, Any]:
        """``token_ids`` (and with messages ``chat``) of the answer."""
        out: dict[str, Any] = {"token_ids": self.ids}
        if self.chat is not None:
            out["chat"] = _chat_out(self.chat)
        return out


def _tensor_of(value: torch.Tensor | FeatureReadout) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ApiError(500, "BackendError", f"the backend returned a {type(value).__name__} for an address")
    return value


def _readout_of(value: torch.Tensor | FeatureReadout) -> FeatureReadout:
    if not isinstance(value, FeatureReadout):
        raise ApiError(500, "BackendError", f"the backend returned a {type(value).__name__} for a feature readout")
    return value


def _completion_out(completion: Completion) -> dict[str, Any]:
    return {"token_ids": list(completion.token_ids), "text": completion.text, "finish_reason": completion.finish_reason}


def _finish_reason(n_steps: int, max_tokens: int) -> str:
    # a stream says nothing about why it ended: short of max_tokens means an end-of-sequence token
    return "length" if n_steps >= max_tokens else "stop"


def _nest(flat: list[Any], shape: Sequence[int]) -> list[Any]:
    """A flat list reshaped into nested lists of ``shape``."""
    if len(shape) <= 1:
        return flat
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def generation_options(
    options: dict[str, Any], spec: SteeringSpec | None, readouts: list[Features], lens: LensRequest | None
) -> dict[str, Any]:
    """A generation's keyword arguments: the sampling ``options`` plus what was asked for."""
    if spec is not None:
        options["steering_spec"] = spec
    if readouts:
        options["features"] = readouts
    if lens is not None:
        options["lens"] = lens
    return options


class _Served:
    """The app's state: the model once the lifespan has loaded it, the limits, the request slots."""

    def __init__(self, limits: ServerLimits, trust_request_chat_template: bool = False) -> None:
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self.model: InterpModel | None = None
        self.name = ""
        self.slots = Slots(limits.max_concurrent_requests, limits.queue_timeout_s)
        self.metrics = Metrics(frozenset)  # create_app gives it the app's paths
        # tokenizing runs here, one text at a time, off the event loop (HF tokenizers are not
        # safe to call from several threads at once)
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp-tokenize")

    def stream_closer(self, steps: Any) -> Callable[[], Awaitable[None]]:
        """``close()`` for a model stream that holds a request slot: closes the stream (the backend
        aborts its request) and frees the slot, once, however often it is called."""
        closed = False

        async def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            try:
                aclose = getattr(steps, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.slots.release()

        return close

    def count_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        self.metrics.count_tokens(prompt, generated)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, fn, *args)

    def check_text(self, text: str, field: str) -> None:
        """A text's length before it is tokenized, and that it is Unicode (no lone surrogate)."""
        if len(text) > self.limits.max_text_chars:
            raise limit_exceeded(field, f"the text has {len(text)} characters", self.limits.max_text_chars)
        with blame({InvalidTokens: field}):
            check_text(text)

    async def tokenize(self, text: str, field: str) -> list[int]:
        """The ids of ``text`` (its length checked first; tokenized off the event loop)."""
        model = self.ready()
        self.check_text(text, field)
        with blame({InvalidTokens: field}):
            ids: list[int] = (await self.off_loop(model.to_tokens, text))[0].tolist()
        if len(ids) > self.limits.max_prompt_tokens:
            raise limit_exceeded(field, f"the prompt has {len(ids)} tokens", self.limits.max_prompt_tokens)
        return ids

    def ready(self) -> InterpModel:
        if self.model is None:
            raise ApiError(503, "ModelNotReady", "the model is not loaded (the server is starting or stopping)")
        return self.model

    # -- request parts ------------------------------------------------------------------------
    async def prompt(self, body: Any) -> _PromptIn:
        """The prompt: its ids and the field they came from (``token_ids``, ``text`` or
        ``messages``, formatted by the chat template)."""
        self.ready()
        given = [name for name in ("token_ids", "text", "messages") if getattr(body, name, None) is not None]
        if len(given) != 1:
            which = f"got {' and '.join(given)}" if given else "got none"
            field = "token_ids" if hasattr(body, "token_ids") else "text"
            raise ApiError(
                422, "ValidationError", f"give exactly one of {_PROMPT_FIELDS[field]} ({which})", field=field
            )
        chat_only = sorted({"add_generation_prompt", "chat_template", "chat_template_kwargs"} & body.model_fields_set)
        if chat_only and body.messages is None:
            raise ApiError(
                422, "ValidationError", f"{chat_only[0]} applies to a prompt given as messages", field=chat_only[0]
            )
        if body.messages is not None:
            chat = await self.chat(body)
            return _PromptIn(chat, list(chat.ids), "messages", chat)
        token_ids = getattr(body, "token_ids", None)
        if token_ids is not None:
            ids = list(token_ids)
            if len(ids) > self.limits.max_prompt_tokens:
                raise limit_exceeded("token_ids", f"the prompt has {len(ids)} tokens", self.limits.max_prompt_tokens)
            return _PromptIn(ids, ids, "token_ids")
        ids = await self.tokenize(body.text, "text")
        return _PromptIn(ids, ids, "text")

    async def chat(self, body: Any) -> ChatTokens:
        """The chat tokens of ``body.messages`` (``model.chat_tokens``, run off the event loop),
        the messages, characters and tokens bounded; every failure of the template is a 400."""
        model = self.ready()
        messages = body.messages
        if not messages:
            raise ApiError(400, "InvalidChat", "messages is empty; give at least one {role, content}", field="messages")
        if len(messages) > self.limits.max_messages:
            raise limit_exceeded("messages", f"{len(messages)} messages", self.limits.max_messages)
        kwargs = dict(body.chat_template_kwargs or {})
        for key in kwargs:
            if not _TEMPLATE_KWARG.fullmatch(key) or key in _RESERVED_TEMPLATE_KWARGS:
                raise ApiError(
                    400,
                    "InvalidOption",
                    f"chat_template_kwargs: {key!r} is not a template variable the server passes (a name of "
                    "letters, digits and _, none of the request's own options)",
                    field=f"chat_template_kwargs.{key}",
                    valid=sorted(_RESERVED_TEMPLATE_KWARGS),
                )
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise ApiError(
                400,
                "InvalidOption",
                "this server does not run chat templates sent in requests (a template is code it cannot bound); "
                "use the model's own, or start the server with --trust-request-chat-template "
                "(create_app/run(trust_request_chat_template=True)) if its clients are trusted",
                field="chat_template",
            )
        chars = sum(len(m.content) + len(m.reasoning_content or "") for m in messages)
        chars += len(body.chat_template or "")
        if kwargs:
            chars += len(json.dumps(kwargs))
        if chars > self.limits.max_text_chars:
            raise limit_exceeded("messages", f"the messages have {chars} characters", self.limits.max_text_chars)
        make = getattr(model, "chat_tokens", None)
        if not callable(make):
            raise ApiError(
                400,
                "UnsupportedOperation",
                f"the {model.backend} model served has no chat_tokens; send token_ids or text",
                field="messages",
            )
        listed = [m.to_dict() for m in messages]

        def render() -> Any:
            return make(listed, add_generation_prompt=body.add_generation_prompt, template=body.chat_template, **kwargs)

        try:
            chat = await self.off_loop(render)
        except NoChatTemplate as exc:
            raise from_interp(exc, "chat_template") from exc
        except InterpError as exc:
            raise from_interp(exc, "chat_template" if body.chat_template is not None else "messages") from exc
        except Exception as exc:  # the template is the client's input (messages or chat_template): its failure too
            logger.warning("a chat template failed", exc_info=exc)
            raise ApiError(
                400,
                "InvalidChat",
                f"the chat template failed on these messages ({type(exc).__name__}: {str(exc)[:300]})",
                field="chat_template" if body.chat_template is not None else "messages",
            ) from exc
        if len(chat) > self.limits.max_prompt_tokens:
            raise limit_exceeded("messages", f"the prompt has {len(chat)} tokens", self.limits.max_prompt_tokens)
        result: ChatTokens = chat
        return result

    def lens(self, body: LensBody | None, prompt: _PromptIn, max_tokens: int) -> LensRequest | None:
        """The lens a generation reads, bounded: layers, ``top_k``, and the token strings it names
        (positions read x layers x top_k) within ``max_top_tokens``."""
        if body is None:
            return None
        model = self.ready()
        if not _takes_lens(model):
            raise ApiError(
                400,
                "UnsupportedOperation",
                f"the {model.backend} backend served does not read the logit lens while generating",
                field="lens",
            )
        if len(body.layers) > self.limits.max_lens_layers:
            raise limit_exceeded("lens.layers", f"{len(body.layers)} lens layers", self.limits.max_lens_layers)
        if body.top_k > self.limits.max_lens_top_k:
            raise limit_exceeded("lens.top_k", f"lens.top_k is {body.top_k}", self.limits.max_lens_top_k)
        try:
            request = LensRequest.from_json(body.to_dict())
        except InterpError as exc:
            raise from_interp(exc, "lens") from exc
        n_layers = self.ready().info.n_layers
        bad = [layer for layer in request.layers if not -n_layers <= layer < n_layers]
        if bad:
            raise ApiError(
                400,
                "LayerOutOfRange",
                f"lens layer {bad[0]} is outside this {n_layers}-layer model (valid: {-n_layers}..{n_layers - 1})",
                field="lens.layers",
                valid=f"{-n_layers}..{n_layers - 1}",
            )
        n_read = max_tokens + self.lens_prompt_positions(request, prompt)
        names = n_read * len(request.layers) * request.top_k
        if names > self.limits.max_top_tokens:
            message = (
                f"the lens would name {names} tokens ({n_read} positions x {len(request.layers)} layers x "
                f"top_k {request.top_k})"
            )
            raise limit_exceeded("lens", message, self.limits.max_top_tokens)
        return request

    def lens_prompt_positions(self, request: LensRequest, prompt: _PromptIn) -> int:
        """How many prompt positions ``request`` reads (a span name resolved against the chat)."""
        positions = request.positions
        if positions is None:
            return 0
        if isinstance(positions, tuple):
            return len(positions)
        if positions == "prompt":
            return len(prompt.ids)
        try:
            return len(span_positions(positions, prompt.tokens, len(prompt.ids)))
        except InterpError as exc:
            raise from_interp(exc, "lens.positions") from exc

    async def lens_result(self, result: Any, spec: SteeringSpec | None) -> dict[str, Any]:
        """A capture's :class:`LensResult` as JSON (finite, each id's text decoded off the loop)."""
        if not isinstance(result, LensResult):
            raise ApiError(500, "BackendError", f"the backend returned a {type(result).__name__} for the lens")
        if not bool(torch.isfinite(result.probs).all()):
            raise _non_finite("the logit lens probabilities", spec)
        out: dict[str, Any] = await self.off_loop(_lens_result_out, result, self.ready().to_str_tokens)
        return out

    async def step_out(self, step: StreamStep, first: bool = False) -> dict[str, Any]:
        """A step as JSON; its lens with each id's text (decoded off the event loop), and on the
        first step the prompt's lens."""
        out = _step_out(step)
        model = self.ready()
        if step.lens is not None:
            out["lens"] = await self.off_loop(_lens_out, step.lens, model.to_str_tokens)
        if first and step.prompt_lens is not None:
            out["prompt_lens"] = await self.off_loop(_lens_result_out, step.prompt_lens, model.to_str_tokens)
        return out

    def points(
        self, items: Sequence[str | Address | FeaturesBody], field: str = "points"
    ) -> tuple[list[Address], list[Features]]:
        """The addresses and the feature readouts (string form or object) among ``items``, each
        checked against the model (the field at fault named by index)."""
        model = self.ready()
        if len(items) > self.limits.max_points:
            raise limit_exceeded(field, f"{len(items)} points requested", self.limits.max_points)
        addresses: list[Address] = []
        readouts: list[Features] = []
        for i, item in enumerate(items):
            if isinstance(item, FeaturesBody) or (isinstance(item, str) and Features.is_form(item)):
                readouts.append(self.readout(item, f"{field}[{i}]"))
                continue
            try:
                address = item if isinstance(item, Address) else _strict_address(item, f"{field}[{i}]")
                resolved = address.resolve(model.info.n_layers)
                if isinstance(model, ModelBase):  # a kind this model's family lacks: KindNotInFamily
                    model._check_served([resolved])
            except InvalidAddress as exc:
                raise from_interp(exc, f"{field}[{i}]") from exc
            addresses.append(address)
        return addresses, list(dict.fromkeys(readouts))

    def readout(self, item: str | FeaturesBody, field: str) -> Features:
        """One feature readout, its SAE attached and its feature ids in range."""
        model = self.ready()
        try:
            spec = Features.from_dict(item.to_dict()) if isinstance(item, FeaturesBody) else Features.parse(item)
            if isinstance(model, ModelBase):
                check_readout(spec, model._sae(spec.sae))
        except InterpError as exc:
            raise from_interp(exc, field) from exc
        return spec

    def readouts(self, items: Sequence[str | FeaturesBody], field: str) -> list[Features]:
        """Feature readouts only (``generate``'s ``features``)."""
        if len(items) > self.limits.max_points:
            raise limit_exceeded(field, f"{len(items)} readouts requested", self.limits.max_points)
        return list(dict.fromkeys(self.readout(item, f"{field}[{i}]") for i, item in enumerate(items)))

    def readout_values(self, spec: Features) -> int:
        """Numbers one token's readout holds (values, ids, error norm); a dense readout of an SAE
        this server cannot see counts as nothing (the backend still bounds it by its width)."""
        model = self.ready()
        sae = model.saes.get(spec.sae) if isinstance(model, ModelBase) else None
        width = spec.width(sae.d_sae) if sae is not None else (spec.top_k or len(spec.ids or ()))
        return width * (1 if spec.dense else 2) + 1

    def values_per_position(self, address: Address, n_keys: int) -> int:
        info = self.ready().info
        size = math.prod(value_shape(address, info))
        return size * n_keys if KINDS[address.kind].width == "heads x keys" else size

    def check_size(
        self, points: Sequence[Address], n_positions: int, field: str, readouts: Sequence[Features] = ()
    ) -> None:
        """Refuse, before any compute, a result over ``max_activation_values``."""
        total = sum(n_positions * self.values_per_position(a, n_positions) for a in dict.fromkeys(points))
        total += sum(n_positions * self.readout_values(r) for r in readouts)
        if total > self.limits.max_activation_values:
            raise limit_exceeded(
                field,
                f"the result would hold {total} values ({n_positions} positions)",
                self.limits.max_activation_values,
            )

    def check_generation(self, max_tokens: int, n_logprobs: int = 0) -> None:
        if max_tokens > self.limits.max_new_tokens:
            raise limit_exceeded("max_tokens", f"max_tokens is {max_tokens}", self.limits.max_new_tokens)
        if n_logprobs > self.limits.max_n_logprobs:
            raise limit_exceeded("n_logprobs", f"n_logprobs is {n_logprobs}", self.limits.max_n_logprobs)

    def steering(self, body: SteeringBody | None) -> SteeringSpec | None:
        """The spec of a request, each write checked against the model (field named per write)."""
        if body is None or not body.writes:
            return None
        info = self.ready().info
        if len(body.writes) > self.limits.max_writes:
            raise limit_exceeded("steering.writes", f"{len(body.writes)} writes", self.limits.max_writes)
        writes: list[AnyWrite] = []
        for i, item in enumerate(body.writes):
            field = f"steering.writes[{i}]"
            if isinstance(item, FeatureWriteBody):
                writes.append(self.feature_write(item, field))
                continue
            try:
                address = _strict_address(item.address, f"{field}.address")
                resolved = address.resolve(info.n_layers)
                if not address.info.writable:
                    raise InvalidSteering(f"cannot write at {address}: {address.kind} is read-only")
                model = self.ready()
                if isinstance(model, ModelBase):
                    model._check_served([resolved])
            except InterpError as exc:
                raise from_interp(exc, f"{field}.address") from exc
            vector: Any = item.vector
            if isinstance(vector, EncodedTensor):
                vector = decode(vector, f"{field}.vector", self.limits.max_activation_values)
            target: Any = item.target
            if isinstance(target, EncodedTensor):
                target = decode(target, f"{field}.target", self.limits.max_activation_values)
            try:
                write = Write(
                    address,
                    vector,
                    op=item.op,
                    scale=item.scale,
                    positions=item.positions,
                    heads=item.heads,
                    target=target,
                    lo=item.lo,
                    hi=item.hi,
                    max_fraction=item.max_fraction,
                )
            except InterpError as exc:
                raise from_interp(exc, field) from exc
            try:
                check_spec(SteeringSpec([write]), info)
            except InterpError as exc:
                blamed = "target" if str(exc).startswith("the target") else "vector"
                raise from_interp(exc, f"{field}.{blamed}") from exc
            writes.append(write)
        return SteeringSpec(writes)

    def feature_write(self, item: FeatureWriteBody, field: str) -> FeatureWrite:
        """A write by feature, its SAE attached and its feature in range (the model places it
        at the SAE's address when the request runs)."""
        try:
            write = FeatureWrite(item.sae, item.feature, item.op, item.value, item.positions)
        except InterpError as exc:
            raise from_interp(exc, field) from exc
        model = self.ready()
        if isinstance(model, ModelBase):
            try:
                model._resolve_feature_writes([write])
            except UnknownSae as exc:
                raise from_interp(exc, f"{field}.sae") from exc
            except InterpError as exc:
                raise from_interp(exc, field) from exc
        return write

    def fields(
        self,
        prompt_field: str,
        spec: SteeringSpec | None,
        points_field: str = "points",
        readouts: Sequence[Features] = (),
        *,
        lens: LensRequest | None = None,
    ) -> Any:
        """``blame`` for a model call: which request field each of the core's errors points at."""
        n_layers = self.ready().info.n_layers
        lens_layers = frozenset(layer % n_layers for layer in lens.layers) if lens is not None else frozenset()
        return _Blame(prompt_field, spec, points_field, readouts, lens_layers)

    def wants_safetensors(self, request: Request, format: str) -> bool:
        return format == "safetensors" or SAFETENSORS in request.headers.get("accept", "")


class _Blame:
    """Context manager mapping the core's errors raised by a model call to the request field."""

    def __init__(
        self,
        prompt_field: str,
        spec: SteeringSpec | None,
        points_field: str,
        readouts: Sequence[Features],
        lens_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.lens_layers = lens_layers
        self.prompt_field = prompt_field
        self.steered = bool(spec)
        self.written = {w.address for w in spec if isinstance(w, Write)} if spec else set()
        self.points_field = points_field
        self.read = {r.sae for r in readouts}

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        expected = (InterpError, ApiError, ClientGone, StopAsyncIteration, StopIteration)
        if self.steered and isinstance(exc, Exception) and not isinstance(exc, expected):
            # an untyped failure of a steered forward pass: the writes made it fail (inf/NaN into a
            # sampler, ...); the same request unsteered would have run
            logger.warning("a steered request failed", exc_info=exc)
            raise ApiError(
                400,
                "InvalidSteering",
                f"the forward pass failed under this request's steering ({type(exc).__name__}: {str(exc)[:200]}); "
                "its writes may overflow float32 activations",
                field="steering",
            ) from exc
        if not isinstance(exc, InterpError):
            return
        field: str | None = None
        if isinstance(exc, InvalidAddress):  # one the backend cannot serve: a write's, a point, the lens's
            written = isinstance(exc, UnsupportedAddress) and exc.address in self.written
            address = exc.address
            lensed = isinstance(address, Address) and address.kind == "resid_post" and address.layer in self.lens_layers
            field = "steering" if written else "lens" if lensed else self.points_field
        elif isinstance(exc, InvalidTokens):
            field = self.prompt_field
        elif isinstance(exc, InvalidSteering):
            field = "steering"
        elif isinstance(exc, InvalidActivations):
            field = "activations"
        elif isinstance(exc, UnknownSae):  # a readout's SAE, or a feature write's
            field = self.points_field if exc.name in self.read else "steering"
        elif isinstance(exc, InvalidFeatures):
            field = self.points_field if self.read else "steering"
        elif isinstance(exc, InvalidOption) and self.lens_layers and str(exc).startswith("lens"):
            field = "lens"
        raise from_interp(exc, field) from exc


def create_app(
    model_or_path: InterpModel | str | os.PathLike[str],
    *,
    backend: str | None = None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    trusted_hosts: Collection[str] | None = None,
    trust_request_chat_template: bool = False,
    **load_options: Any,
) -> FastAPI:
    """The HTTP API over one model, as a FastAPI app.

    Given a path (or hub id), the app's lifespan loads the model with
    ``load_model(path, backend=backend, **load_options)`` on the serving loop, warms it up there
    and shuts it down when the server stops: the server owns it. Given a model object, the app
    warms it up on the serving loop and serves it, but does not shut it down: its owner does
    (``shutdown()`` is callable from any loop or thread).

    ``api_key``: every request but ``GET /v1/health`` must send ``Authorization: Bearer <key>``
    (``401 Unauthorized`` otherwise; compared in constant time). ``trusted_hosts``: the ``Host``
    names the app answers to (``400 UntrustedHost`` otherwise), e.g. ``LOOPBACK_HOSTS`` for an app
    bound to loopback, so a browser page cannot reach it by DNS rebinding (``run`` does that);
    default ``None``: any. Run it with uvicorn through :func:`uvicorn_config` to get the
    connection bounds of ``limits`` too.

    ``trust_request_chat_template``: run the Jinja chat templates requests send
    (``chat_template``). Off by default: a template is code, and Jinja's sandbox bounds neither
    its time nor its memory (a nested loop holds the tokenizer thread, ``'x' * 10**10`` takes
    10 GB), so only a server whose clients are trusted should turn it on; without it such a
    request is ``400 InvalidOption`` and messages use the model's own template.
    """
    if api_key is not None:
        check_api_key(api_key)
    served = _Served(limits or ServerLimits(), trust_request_chat_template)
    given: InterpModel | None = None
    path: str | None = None
    if isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        served.name = path
    else:
        if load_options or backend is not None:
            raise InvalidOption(
                "backend= and load options apply when the server loads the model from a path; "
                f"got a model object and {sorted(load_options) + (['backend'] if backend else [])}"
            )
        given = model_or_path
        served.name = f"{type(given).__name__} ({given.backend})"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model = given if given is not None else load_model(path or "", backend=backend, **load_options)
        try:
            await model.warmup()  # on the serving loop, not a throwaway one
            served.model = model
            logger.info("serving %s on the %s backend", served.name, model.backend)
            yield
        finally:
            served.model = None
            if given is None:
                await model.shutdown()
                logger.info("model shut down")

    app = FastAPI(
        title="interp-engine",
        description="Capture activations, logit lens, attention and steering over HTTP.",
        version=_version(),
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.router.route_class = StrictRoute
    app.state.served = served
    paths: frozenset[str] = frozenset()

    def known_paths() -> frozenset[str]:
        nonlocal paths
        if not paths:
            paths = frozenset(getattr(route, "path", "") for route in app.routes)
        return paths

    served.metrics = Metrics(known_paths)
    # the last added runs first: metrics see every answer, the guard's too
    app.add_middleware(Guard, limits=served.limits, api_key=api_key, trusted_hosts=trusted_hosts)
    app.add_middleware(MetricsMiddleware, metrics=served.metrics)
    _add_error_handlers(app)
    _add_routes(app, served)
    from ._openai import add_completions

    add_completions(app, served)
    return app


def _version() -> str:
    from .. import __version__

    return __version__


_HTTP_ERRORS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    408: "RequestTimeout",
    411: "LengthRequired",
    413: "LimitExceeded",
    415: "UnsupportedMediaType",
    422: "ValidationError",
    429: "TooManyRequests",
    503: "Overloaded",
}
MAX_ERRORS = 20
"""Most schema errors one 422 body lists (a 4-million-item list of strings has as many)."""


def _add_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        request.scope[ERROR_SCOPE_KEY] = error.error
        return error.response()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The framework's own 4xx (no such path, a method the path lacks, a body it could not
        parse) in the server's error shape."""
        name = _HTTP_ERRORS.get(exc.status_code, f"HTTP{exc.status_code}")
        return answer(request, ApiError(exc.status_code, name, str(exc.detail), headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        raw = exc.errors()
        errors = [
            {
                "field": elide(field_path(e.get("loc", ())), 200),
                "message": elide(str(e.get("msg", "")), 300),
                "type": str(e.get("type", "")),
            }
            for e in raw[:MAX_ERRORS]
        ]
        first = errors[0] if errors else {"field": "body", "message": "invalid request"}
        request.scope[ERROR_SCOPE_KEY] = "ValidationError"
        body = {
            "error": "ValidationError",
            "message": elide(f"{first['field']}: {first['message']}"),
            "field": first["field"],
            "errors": errors + ([{"message": f"...and {len(raw) - MAX_ERRORS} more"}] if len(raw) > MAX_ERRORS else []),
        }
        return SafeJSONResponse(body, status_code=422)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        request.scope[ERROR_SCOPE_KEY] = "ClientGone"
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(InterpError)
    async def interp_error(request: Request, exc: InterpError) -> JSONResponse:
        return answer(request, from_interp(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=exc)
        request.scope[ERROR_SCOPE_KEY] = "InternalError"
        body = {"error": "InternalError", "message": f"the server failed: {type(exc).__name__}"}
        return SafeJSONResponse(body, status_code=500)


async def _tensor_body(
    request: Request,
    served: _Served,
    format: str,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    head: dict[str, Any],
    n_tokens: int,
    readouts: Mapping[str, FeatureReadout] | None = None,
    *,
    steered: Any = None,
) -> Any:
    # checking and serialising megabytes of values runs on a worker thread, not on the serving loop
    await asyncio.to_thread(_check_finite, tensors, readouts or {}, steered)
    if served.wants_safetensors(request, format):
        n_layers = served.model.info.n_layers if served.model is not None else None
        return await asyncio.to_thread(safetensors_response, tensors, n_tokens, head, readouts, n_layers)
    encoded = await asyncio.to_thread(lambda: {name: encode(t) for name, t in tensors.items()})
    if readouts is None:
        return {**head, key: encoded}
    listed = await asyncio.to_thread(lambda: {name: readout_out(r) for name, r in readouts.items()})
    return {**head, key: encoded, "features": listed}


def _takes_lens(model: InterpModel) -> bool:
    """Whether the model's ``stream`` and ``capture_generation`` take ``lens=`` (a third-party
    backend written before the lens may not)."""
    for method in (model.stream, model.capture_generation):
        try:
            parameters = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):
            return False
        if not any(p.name == "lens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return False
    return True


def _has_chat_template(model: InterpModel) -> bool:
    """Whether ``messages`` work without a ``chat_template``: the model's tokenizer has one."""
    if not isinstance(model, ModelBase):
        return False
    try:
        return bool(getattr(model._chat_tokenizer(), "chat_template", None))
    except InterpError:
        return False


def _saes_out(model: InterpModel) -> list[dict[str, Any]]:
    """The SAEs and probes attached to ``model``, as ``GET /v1/model`` lists them. On vllm-static
    every one was attached before the engine was built (attaching later is refused), so each is
    compiled into its graph."""
    if not isinstance(model, ModelBase):
        return []
    out = []
    for name, sae in model.saes.items():
        entry: dict[str, Any] = {
            "name": name,
            "architecture": sae.architecture,
            "address": str(sae.address),
            "address_out": str(sae.address_out),
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
        }
        if isinstance(model, StaticTaps):
            entry["compiled"] = True
        out.append(entry)
    return out


def _add_routes(app: FastAPI, served: _Served) -> None:
    @app.get("/v1/health", responses=_ERRORS)
    async def health() -> dict[str, Any]:
        """``{"status": "ok"}`` once the model is loaded and warmed up (503 before, and once its
        engine died or it was shut down: ``EngineDead``, ``ModelClosed``), with the number of
        requests running on the model."""
        model = served.ready()
        if isinstance(model, ModelBase) and model.dead is not None:
            raise ApiError(503, "EngineDead", f"the {model.backend} engine died ({model.dead}); restart the server")
        if isinstance(model, ModelBase) and model.closed:
            raise ApiError(503, "ModelClosed", "the model was shut down; restart the server")
        return {"status": "ok", "backend": model.backend, "in_flight": served.slots.in_flight}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format): requests and errors by endpoint and error
        type, latency histograms, requests in flight and queued, slots in use, tokens run."""
        text = served.metrics.render(
            queued=served.slots.queued, slots_in_use=served.slots.in_flight, slots_total=served.slots.n
        )
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/model", responses=_ERRORS)
    async def model_info() -> dict[str, Any]:
        """The model's shapes, the kinds it serves (its family's, on its backend) over its layers,
        the server's limits, the SAEs attached (``saes``: ``name``, ``architecture``,
        ``address``, ``address_out``, ``d_in``, ``d_sae``; on vllm-static ``compiled``), and
        ``chat``: whether the model has a chat template (``template``) and whether requests may
        send one (``request_templates``)."""
        model = served.ready()
        info = model.info
        listed = getattr(model, "points", None)  # ModelBase.points(): the kinds its family has
        points = listed() if callable(listed) else None
        served_kinds = dict(KINDS) if points is None else {k: KINDS[k] for k in points}  # forward order
        kinds = []
        for kind, meta in served_kinds.items():
            shape = value_shape(Address(kind, 0) if meta.per_layer else Address(kind), info)
            size: Any = "n_heads x n_keys" if meta.width == "heads x keys" else math.prod(shape)
            kinds.append(
                {
                    "kind": kind,
                    "per_layer": meta.per_layer,
                    "width": meta.width,
                    "size": size,
                    "writable": points[kind].writable if points is not None else meta.writable,
                    "how": points[kind].how if points is not None else "hook",
                    "meaning": meta.meaning,
                }
            )
        addresses = [
            f"{kind}.{layer}" if meta.per_layer else kind
            for kind, meta in served_kinds.items()
            for layer in (range(info.n_layers) if meta.per_layer else [None])
        ]
        out: dict[str, Any] = {
            "model": served.name,
            "backend": model.backend,
            "info": asdict(info),
            "layers": list(range(info.n_layers)),
            "kinds": kinds,
            "addresses": addresses,
            "limits": asdict(served.limits),
        }
        if isinstance(model, StaticTaps):  # vllm-static: the declared taps
            out["static_points"] = [str(a) for a in model.static_points]
            out["static_writes"] = [str(a) for a in model.static_writes]
        out["saes"] = _saes_out(model)
        out["chat"] = {"template": _has_chat_template(model), "request_templates": served.trust_request_chat_template}
        return out

    @app.post("/v1/tokenize", response_model=TokenizeResponse, response_model_exclude_unset=True, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a text (``model.to_tokens``), or of messages (``model.chat_tokens``, with
        their spans under ``chat``), and one string per token."""
        model = served.ready()
        prompt = await served.prompt(body)
        return {**prompt.head(), "str_tokens": await served.off_loop(model.to_str_tokens, prompt.ids)}

    @app.post(
        "/v1/capture", response_model=CaptureResponse, response_model_exclude_unset=True, responses=_TENSOR_RESPONSES
    )
    async def capture(body: CaptureRequest, request: Request) -> Any:
        """Activations ``[n_tokens, width]`` at ``points`` over the prompt (``model.capture``), and
        the feature readouts among ``points`` under ``features`` (``[n_tokens, k]`` each)."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        points, readouts = served.points(body.points)
        served.check_size(points, len(ids), "points", readouts)
        spec = served.steering(body.steering)
        async with served.slots:
            with served.fields(prompt.field, spec, readouts=readouts):
                work = model.capture(prompt.tokens, [*points, *readouts], steering_spec=spec)
                acts = await unless_gone(request, work)
        tensors = {str(p): _tensor_of(acts[p]) for p in points}
        features = {str(r): _readout_of(acts[r]) for r in readouts}
        served.count_tokens(prompt=len(ids))
        return await _tensor_body(
            request, served, body.format, "activations", tensors, prompt.head(), len(ids), features, steered=spec
        )

    @app.post(
        "/v1/attention",
        response_model=AttentionResponse,
        response_model_exclude_unset=True,
        responses=_TENSOR_RESPONSES,
    )
    async def attention(body: AttentionRequest, request: Request) -> Any:
        """Attention patterns ``[heads, q, k]`` of ``layers`` (``model.capture_attention``)."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        points, _ = served.points([Address("attn_pattern", layer) for layer in body.layers], "layers")
        served.check_size(points, len(ids), "layers")
        async with served.slots:
            spec = served.steering(body.steering)
            with served.fields(prompt.field, spec, "layers"):
                call = (
                    model.capture_attention(prompt.tokens, list(body.layers), steering_spec=spec)
                    if spec is not None
                    else model.capture_attention(prompt.tokens, list(body.layers))
                )
                acts = await unless_gone(request, call)
        tensors = {str(p): _tensor_of(acts[p]) for p in points}
        served.count_tokens(prompt=len(ids))
        return await _tensor_body(
            request, served, body.format, "patterns", tensors, prompt.head(), len(ids), steered=spec
        )

    @app.post(
        "/v1/capture_generation",
        response_model=CaptureGenerationResponse,
        response_model_exclude_unset=True,
        responses=_TENSOR_RESPONSES,
    )
    async def capture_generation(body: CaptureGenerationRequest, request: Request) -> Any:
        """A completion and activations (and feature readouts) over prompt + generated tokens
        (``model.capture_generation``)."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        served.check_generation(body.max_tokens)
        points, readouts = served.points(body.points)
        served.check_size(points, len(ids) + body.max_tokens, "points", readouts)
        spec = served.steering(body.steering)
        lens = served.lens(body.lens, prompt, body.max_tokens)
        options = body.sampling()
        if lens is not None:
            options["lens"] = lens
        async with served.slots:
            with served.fields(prompt.field, spec, readouts=readouts, lens=lens):
                work = model.capture_generation(
                    prompt.tokens, [*points, *readouts], max_tokens=body.max_tokens, steering_spec=spec, **options
                )
                completion, acts = await unless_gone(request, work)
        tensors = {str(p): _tensor_of(acts[p]) for p in points}
        features = {str(r): _readout_of(acts[r]) for r in readouts}
        head = {**prompt.head(), "completion": _completion_out(completion)}
        if lens is not None:
            head["lens"] = await served.lens_result(acts.get(lens), spec)
        n_positions = len(ids) + len(completion.token_ids)
        served.count_tokens(prompt=len(ids), generated=len(completion.token_ids))
        return await _tensor_body(
            request, served, body.format, "activations", tensors, head, n_positions, features, steered=spec
        )

    @app.post(
        "/v1/generate",
        response_model=GenerateResponse,
        response_model_exclude_none=True,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}},
    )
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """A completion; with ``stream: true``, server-sent events: one ``token`` event per
        generated token (``{"token_id", "text", "logprobs", "position"}``, and ``features``, each
        readout of ``features`` at ``position``), then ``done`` (the completion) or ``error``.
        Closing the connection aborts the generation. Without ``stream``, ``n_logprobs``,
        ``features`` or ``lens`` give the same steps under ``steps``. With ``messages``, ``chat``
        names the prompt's spans (in the first event when streaming); with ``lens``, each step
        carries ``lens`` and ``lens.positions`` gives ``prompt_lens``."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        served.check_generation(body.max_tokens, body.n_logprobs)
        readouts = served.readouts(body.features, "features") if body.features else []
        served.check_size([], body.max_tokens, "features", readouts)
        spec = served.steering(body.steering)
        lens = served.lens(body.lens, prompt, body.max_tokens)
        options = generation_options(body.sampling(), spec, readouts, lens)
        fields = served.fields(prompt.field, spec, "features", readouts, lens=lens)
        if body.stream:
            return await _stream(served, model, prompt, body, options, fields)
        async with served.slots:
            with fields:
                if body.n_logprobs == 0 and not readouts and lens is None:
                    work = model.generate(prompt.tokens, max_tokens=body.max_tokens, **options)
                    completion = await unless_gone(request, work)
                    served.count_tokens(prompt=len(ids), generated=len(completion.token_ids))
                    return {**_completion_out(completion), **_chat_head(prompt)}
                steps = model.stream(prompt.tokens, max_tokens=body.max_tokens, n_logprobs=body.n_logprobs, **options)
                collected = await unless_gone(request, _collect(steps))
        served.count_tokens(prompt=len(ids), generated=len(collected))
        _check_finite_steps(collected, spec)
        _check_finite_features(collected, spec)
        out: dict[str, Any] = {
            "token_ids": [s.token_id for s in collected],
            "text": "".join(s.text for s in collected),
            "finish_reason": _finish_reason(len(collected), body.max_tokens),
            "steps": [await served.step_out(s) for s in collected],
            **_chat_head(prompt),
        }
        first = collected[0] if collected else None
        if first is not None and first.prompt_lens is not None:
            out["prompt_lens"] = await served.off_loop(_lens_result_out, first.prompt_lens, model.to_str_tokens)
        return out

    @app.post("/v1/decode_residuals", response_model=DecodeResponse, responses=_ERRORS)
    async def decode_residuals(body: DecodeRequest, request: Request) -> Any:
        """The logit lens: final norm + unembedding of residual vectors ``[..., d_model]``, with
        the top-k tokens of each (and the full logits when ``return_logits``)."""
        model = served.ready()
        info = model.info
        limit = served.limits.max_activation_values
        acts = decode(body.activations, "activations", limit)
        n_vectors = acts.numel() // max(acts.shape[-1], 1) if acts.dim() else 1
        k = min(body.top_k, info.vocab_size)
        out_values = n_vectors * (k + (info.vocab_size if body.return_logits else 0))
        if out_values > limit:
            raise limit_exceeded("activations", f"the result would hold {out_values} values", limit)
        if n_vectors * k > served.limits.max_top_tokens:
            message = f"the answer would name {n_vectors * k} top tokens ({n_vectors} vectors x top_k {k})"
            raise limit_exceeded("top_k", message, served.limits.max_top_tokens)
        async with served.slots:
            with blame({InvalidActivations: "activations"}):
                logits = await unless_gone(request, model.decode_residuals(acts))
        if not isinstance(logits, torch.Tensor):  # a tensor in gives a tensor out
            raise ApiError(500, "BackendError", "decode_residuals returned no tensor")

        def answer() -> dict[str, Any]:
            values = logits.float()
            if not bool(torch.isfinite(values).all()):
                raise _non_finite("the logits", None, decoding=True)
            top = torch.topk(values, k, dim=-1)
            logprobs = torch.log_softmax(values, dim=-1).gather(-1, top.indices)
            shape = list(top.indices.shape)
            flat_ids = top.indices.reshape(-1).tolist()
            return {
                "shape": list(values.shape),
                "top": {
                    "token_ids": top.indices.tolist(),
                    "tokens": _nest(model.to_str_tokens(flat_ids) if flat_ids else [], shape),
                    "logits": top.values.tolist(),
                    "logprobs": logprobs.tolist(),
                },
                "logits": encode(values) if body.return_logits else None,
            }

        return await served.off_loop(answer)


def _check_finite(tensors: Mapping[str, torch.Tensor], readouts: Mapping[str, FeatureReadout], steered: Any) -> None:
    """Refuse results holding inf or NaN, naming the first such point and the likely cause."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _non_finite(f"the activations at {name}", steered)
    for name, readout in readouts.items():
        parts = [readout.values] + ([readout.error_norm] if readout.error_norm is not None else [])
        if not all(bool(torch.isfinite(t).all()) for t in parts):
            raise _non_finite(f"the feature readout {name}", steered)


def _check_finite_features(steps: Sequence[StreamStep], spec: Any) -> None:
    for step in steps:
        if step.features:
            _check_finite({}, {str(k): v for k, v in step.features.items()}, spec)


def _chat_head(prompt: _PromptIn) -> dict[str, Any]:
    """``{"chat": ...}`` of a prompt given as messages, else nothing."""
    return {"chat": _chat_out(prompt.chat)} if prompt.chat is not None else {}


async def _collect(steps: AsyncIterator[StreamStep]) -> list[StreamStep]:
    """Every step of a stream, closing it however the collection ends."""
    try:
        return [step async for step in steps]
    finally:
        aclose = getattr(steps, "aclose", None)
        if aclose is not None:
            await aclose()


async def _stream(
    served: _Served,
    model: InterpModel,
    prompt: _PromptIn,
    body: GenerateRequest,
    options: dict[str, Any],
    fields: Any,
) -> Response:
    """Start the model's stream and pull its first step before answering, so that bad input is
    still a 4xx; then send the steps as server-sent events (the first one with the prompt's
    ``chat`` spans and ``prompt_lens`` when there are)."""
    ids = prompt.ids
    await served.slots.acquire()
    steps = model.stream(prompt.tokens, max_tokens=body.max_tokens, n_logprobs=body.n_logprobs, **options)
    close = served.stream_closer(steps)

    spec = options.get("steering_spec")
    try:
        with fields:
            first: StreamStep | None = await anext(steps)
        if first is not None:
            _check_finite_steps([first], spec)
            _check_finite_features([first], spec)
    except StopAsyncIteration:
        first = None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close()
        raise
    served.count_tokens(prompt=len(ids))

    async def events() -> AsyncIterator[str]:
        step, kept = first, []
        try:
            while step is not None:
                kept.append(step)
                served.count_tokens(generated=1)
                out = await served.step_out(step, first=len(kept) == 1)
                if len(kept) == 1:
                    out.update(_chat_head(prompt))
                yield _event("token", out)
                try:
                    with fields:
                        step = await anext(steps)
                    _check_finite_steps([step], spec)
                    _check_finite_features([step], spec)
                except StopAsyncIteration:
                    step = None
            done = {
                "token_ids": [s.token_id for s in kept],
                "text": "".join(s.text for s in kept),
                "finish_reason": _finish_reason(len(kept), body.max_tokens),
            }
            yield _event("done", done)
        except ApiError as exc:  # the status line is sent: report it in the stream
            yield _event("error", exc.body())

    return EventStream(events(), close)


def run(
    model_or_path: InterpModel | str | os.PathLike[str],
    *,
    backend: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    insecure_no_auth: bool = False,
    trusted_hosts: Collection[str] | None = None,
    trust_request_chat_template: bool = False,
    **load_options: Any,
) -> None:
    """Serve the model with uvicorn until SIGINT or SIGTERM, then return: in-flight requests get
    ``GRACEFUL_SHUTDOWN_S`` seconds to finish, streams still open are cancelled (their engine
    requests aborted) and the lifespan shuts the model down.

    ``api_key`` (default: the ``INTERP_API_KEY`` environment variable) is required of every
    request but ``GET /v1/health``, as ``Authorization: Bearer <key>``. Binds to loopback unless
    ``host`` says otherwise; a non-loopback ``host`` without a key is refused (``InvalidOption``)
    unless ``insecure_no_auth=True``. ``trusted_hosts`` (default: the loopback names on a
    loopback bind, any otherwise) are the ``Host`` names answered. ``trust_request_chat_template``:
    see :func:`create_app`."""
    import uvicorn

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(host) and not insecure_no_auth:
        raise InvalidOption(
            f"refusing to serve {host!r} (not loopback) without an API key: give one (--api-key-file FILE, "
            f"${API_KEY_ENV}, run(api_key=...)) or say --insecure-no-auth / insecure_no_auth=True"
        )
    if trusted_hosts is None and is_loopback(host):
        trusted_hosts = LOOPBACK_HOSTS
    app = create_app(
        model_or_path,
        backend=backend,
        limits=limits,
        api_key=api_key,
        trusted_hosts=trusted_hosts,
        trust_request_chat_template=trust_request_chat_template,
        **load_options,
    )
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    if threading.current_thread() is not threading.main_thread():
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        return
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it
    # found; with the default one the process would die by the signal after a clean shutdown.
    # Ours ends run() instead, so the caller exits normally (as on SIGINT).
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.run()
    except (_Stopped, KeyboardInterrupt):  # uvicorn raises the signal again once shut down
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Stopped(Exception):
    """SIGTERM was received: ``run`` returns."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped


GRACEFUL_SHUTDOWN_S = 10
"""Seconds ``run`` lets open requests (streams) finish on shutdown before cancelling them."""
