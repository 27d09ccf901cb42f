"""From request bodies to the model's arguments: the prompt (ids, text or chat messages), the
points and feature readouts, the steering spec and the lens, each checked against the served
model and the :class:`ServerLimits` before any compute, with the request field at fault named.

:class:`Served` is the app's state (the model once loaded, the limits, the request slots, the
tokenizer's thread) and does this conversion; routes call its methods.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from fastapi import Request

from .._errors import (
    InterpError,
    InvalidAddress,
    InvalidSteering,
    InvalidTokens,
    NoChatTemplate,
    UnknownAdapter,
    UnknownSae,
)
from ..addresses._address import Address
from ..addresses._kinds import KINDS
from ..chat import ChatTokens, span_positions
from ..protocol._base import ModelBase
from ..protocol._checks import check_spec, value_shape
from ..protocol._protocol import InterpModel, StreamStep
from ..results._lens import LensRequest, LensResult
from ..sae._readouts import Features, check_readout
from ..steering._spec import AnyWrite, FeatureWrite, SteeringSpec, Write
from ..tokens import check_text
from ._asgi import ModelStream, Slots, unless_gone
from ._errors import ApiError, FieldBlame, blame, from_interp, limit_exceeded
from ._limits import ServerLimits
from ._metrics import Metrics
from ._render import TensorFormat, chat_out, lens_out, lens_result_out, non_finite, step_json
from ._schemas import EncodedTensor, FeaturesBody, FeatureWriteBody, LensBody, SteeringBody
from ._tensors import SAFETENSORS, decode

logger = logging.getLogger("interp_engine.server")

_ADDRESS_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_LAYER = re.compile(r"-?[0-9]{1,9}")


def strict_address(text: str, field: str) -> Address:
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
class PromptIn:
    """A request's prompt: ``tokens`` go to the model (the ids, or the :class:`ChatTokens` so
    that span-named positions resolve against it), ``ids`` to the answer; ``field`` is the
    request field it came from."""

    tokens: Sequence[int]
    ids: list[int]
    field: str
    chat: ChatTokens | None = None

    def head(self) -> dict[str, Any]:
        """``token_ids`` (and with messages ``chat``) of the answer."""
        return {"token_ids": self.ids, **self.chat_head()}

    def chat_head(self) -> dict[str, Any]:
        """``{"chat": ...}`` of a prompt given as messages, else nothing."""
        return {"chat": chat_out(self.chat)} if self.chat is not None else {}


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


class Served:
    """The app's state: the model once the lifespan has loaded it, the limits, the request slots."""

    def __init__(self, limits: ServerLimits, trust_request_chat_template: bool = False) -> None:
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self.model: InterpModel | None = None
        self.name = ""
        self.created = 0  # when the model was warmed up and served (Unix seconds)
        self.slots = Slots(limits.max_concurrent_requests, limits.queue_timeout_s)
        self.metrics = Metrics(frozenset)  # create_app gives it the app's paths
        # tokenizing runs here, one text at a time, off the event loop (HF tokenizers are not
        # safe to call from several threads at once)
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp-tokenize")

    async def open_stream(
        self,
        request: Request | None,
        model: InterpModel,
        tokens: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int,
        options: dict[str, Any],
        fields: Any,
    ) -> tuple[ModelStream, StreamStep | None]:
        """Take a request slot, start the model's stream and pull its first step (None: the
        stream is empty), so that bad input still answers 4xx before any event is sent; the
        stream is closed if that fails. With ``request``, the first step is cancelled if its
        client goes away."""
        await self.slots.acquire()
        steps = model.stream(tokens, max_tokens=max_tokens, n_logprobs=n_logprobs, **options)
        stream = ModelStream(steps, self.slots, fields, options.get("steering_spec"))
        try:
            first = await (stream.next() if request is None else unless_gone(request, stream.next()))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.close()
            raise
        return stream, first

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
    async def prompt(self, body: Any) -> PromptIn:
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
            return PromptIn(chat, list(chat.ids), "messages", chat)
        token_ids = getattr(body, "token_ids", None)
        if token_ids is not None:
            ids = list(token_ids)
            if len(ids) > self.limits.max_prompt_tokens:
                raise limit_exceeded("token_ids", f"the prompt has {len(ids)} tokens", self.limits.max_prompt_tokens)
            return PromptIn(ids, ids, "token_ids")
        ids = await self.tokenize(body.text, "text")
        return PromptIn(ids, ids, "text")

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

    def lens(self, body: LensBody | None, prompt: PromptIn, max_tokens: int) -> LensRequest | None:
        """The lens a generation reads, bounded: layers, ``top_k``, and the token strings it names
        (positions read x layers x top_k) within ``max_top_tokens``."""
        if body is None:
            return None
        model = self.ready()
        if not takes_lens(model):
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

    def lens_prompt_positions(self, request: LensRequest, prompt: PromptIn) -> int:
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
            raise non_finite("the logit lens probabilities", spec)
        out: dict[str, Any] = await self.off_loop(lens_result_out, result, self.ready().to_str_tokens)
        return out

    async def step_out(self, step: StreamStep, first: bool = False) -> dict[str, Any]:
        """A step as JSON; its lens with each id's text (decoded off the event loop), and on the
        first step the prompt's lens."""
        out = step_json(step)
        model = self.ready()
        if step.lens is not None:
            out["lens"] = await self.off_loop(lens_out, step.lens, model.to_str_tokens)
        if first and step.prompt_lens is not None:
            out["prompt_lens"] = await self.off_loop(lens_result_out, step.prompt_lens, model.to_str_tokens)
        return out

    async def steps_out(self, steps: Sequence[StreamStep]) -> list[dict[str, Any]]:
        """Every step as JSON (as :meth:`step_out`, without the prompt's lens), the lenses' ids
        decoded in one call off the event loop."""
        model = self.ready()
        outs = [step_json(step) for step in steps]
        lensed = [(out, step.lens) for out, step in zip(outs, steps, strict=True) if step.lens is not None]
        if lensed:

            def render() -> list[dict[str, Any]]:
                return [lens_out(lens, model.to_str_tokens) for _, lens in lensed]

            for (out, _), rendered in zip(lensed, await self.off_loop(render), strict=True):
                out["lens"] = rendered
        return outs

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
                address = item if isinstance(item, Address) else strict_address(item, f"{field}[{i}]")
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

    def adapter(self, name: str | None) -> dict[str, Any]:
        """The keyword a request's ``adapter`` field gives the model's call: nothing for the base
        model, else a name the server registered (never a folder: a client names no path on the
        server's disk). ``UnknownAdapter`` (400, field ``adapter``) lists the registered ones."""
        if name is None:
            return {}
        registered = sorted(getattr(self.ready(), "adapters", {}))
        if name not in registered:
            raise from_interp(
                UnknownAdapter(
                    f"no adapter is registered as {name!r}; registered: {', '.join(registered) or 'none'} "
                    "(interp serve --adapter NAME=PATH registers one; null is the base model)",
                    name=name,
                    valid=registered,
                ),
                "adapter",
            )
        return {"adapter": name}

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
                address = strict_address(item.address, f"{field}.address")
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
        return FieldBlame(prompt_field, spec, points_field, readouts, lens_layers)

    def tensor_format(self, request: Request, format: str) -> TensorFormat:
        """How to write a result holding tensors: as ``format`` says, or safetensors when the
        request's ``Accept`` asks for it."""
        safetensors = format == "safetensors" or SAFETENSORS in request.headers.get("accept", "")
        return TensorFormat(safetensors, self.model.info.n_layers if self.model is not None else None)


def takes_lens(model: InterpModel) -> bool:
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
