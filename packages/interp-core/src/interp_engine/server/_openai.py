"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``, with steering,
captures and the logit lens in an extension field, and ``GET /v1/models``, the served model.

The body is OpenAI's (``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``logprobs``, ``stream``, ``stream_options``; vLLM's ``top_k`` and ``ignore_eos`` too) plus
``interp``, which the OpenAI Python client sends with ``extra_body``::

    client.completions.create(
        model="served", prompt="The capital of France is", max_tokens=8, temperature=0,
        extra_body={"interp": {"steering": {"writes": [...]}, "points": ["resid_post.1"]}},
    )

``interp.steering`` is a steering spec (as everywhere in the API); ``interp.points`` captures
activations (and feature readouts) over prompt + generated tokens, returned under ``interp`` in
the answer (not with ``stream``, ``stop`` or ``logprobs``), only at ``interp.positions`` if given
(listed back in ``interp.positions``: the same request to interp-vllm's plugin in ``vllm serve``
answers the same fields); ``interp.features`` gives each
generated token's feature readouts (in each chunk when streaming), ``interp.lens`` each generated
token's logit lens (``LensRequest.to_json``; in each chunk when streaming). The answer is OpenAI's
``text_completion`` object (``choices[0].text``, ``finish_reason``, ``logprobs``, ``usage``) plus
``interp`` (``prompt_token_ids``, ``token_ids``, and what was captured). A stream is OpenAI's
server-sent events: ``data: <chunk>`` per token, then ``data: [DONE]``.

``/v1/chat/completions`` takes ``messages`` (formatted by the model's chat template), answers
OpenAI's ``chat.completion`` (``choices[0].message``; chunks with ``delta``), and its ``interp``
also holds ``chat``, the prompt's spans; steering positions may name them (``"assistant"``,
``"user[-1].last"``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import anyio
import torch
from fastapi import FastAPI, Request
from pydantic import Field, StrictInt

from .._errors import InvalidOption
from ..addresses._kinds import KINDS
from ..chat import select_positions
from ..protocol._protocol import InterpModel, StreamStep
from ._asgi import EventStream, unless_gone
from ._convert import PromptIn, Served, generation_options
from ._errors import ApiError, blame, limit_exceeded
from ._render import ERRORS, completion_out, json_text, tensor_body
from ._routes import capture_generation_of, results_of
from ._schemas import ChatInput, LensBody, MessageBody, Point, Positions, SteeringBody, StrictBody

MAX_STOPS = 4
"""Most stop strings (OpenAI's limit)."""
MAX_STOP_CHARS = 256
"""Longest stop string."""


class InterpExtension(StrictBody):
    """The ``interp`` extension of a completion request (``extra_body={"interp": {...}}``)."""

    steering: SteeringBody | None = Field(default=None, description="a steering spec applied to this completion")
    points: list[Point] | None = Field(
        default=None,
        description="addresses and feature readouts captured over prompt + generated tokens (not with stream, "
        "stop or logprobs), returned under interp.activations / interp.features",
    )
    positions: Positions | None = Field(
        default=None,
        description="with points: keep only these positions (indices from the prompt's first token, negative from "
        "the end of prompt + generation; 'prompt', 'generated' or a chat span name), listed in interp.positions",
    )
    features: list[Point] | None = Field(
        default=None, description="feature readouts of each generated token (interp.steps, or each stream chunk)"
    )
    lens: LensBody | None = Field(
        default=None,
        description="the logit lens read while generating: each token's top-k per layer (interp.steps, or each "
        "stream chunk's interp.lens); with interp.points, interp.lens over the whole generation",
    )


class StreamOptions(StrictBody):
    include_usage: bool = False


class _OpenAISampling(StrictBody):
    """The sampling options OpenAI's completion and chat completion requests share (with vLLM's
    ``top_k`` and ``ignore_eos``)."""

    temperature: float = Field(default=1.0, ge=0, le=2, description="OpenAI's default 1; 0 is greedy")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0, description="vLLM's extension; 0 is off")
    seed: StrictInt | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None


class CompletionRequest(_OpenAISampling):
    """OpenAI's completion request (one prompt, one choice), plus ``interp``."""

    model: str | None = Field(default=None, description="echoed back; the server serves one model")
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, description="top-n logprobs per generated token")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    echo: Literal[False] = False
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    suffix: None = None
    user: str | None = None
    interp: InterpExtension | None = None


DEFAULT_CHAT_MAX_TOKENS = 16
"""A chat completion's ``max_tokens`` when neither it nor ``max_completion_tokens`` is given."""


class ChatCompletionRequest(ChatInput, _OpenAISampling):
    """OpenAI's chat completion request (one choice): ``messages`` and the sampling options,
    plus ``interp``, and vLLM's chat extensions (``add_generation_prompt``, ``chat_template``,
    ``chat_template_kwargs``, ``top_k``, ``ignore_eos``)."""

    model: str | None = Field(default=None, description="echoed back; the server serves one model")
    messages: list[MessageBody] = Field(  # required here
        min_length=1, description="the conversation, formatted by the model's chat template"
    )
    max_tokens: StrictInt | None = Field(default=None, ge=1, description=f"default {DEFAULT_CHAT_MAX_TOKENS}")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, description="OpenAI's newer name")
    logprobs: bool = Field(default=False, description="the chosen token's logprob per generated token")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, description="with logprobs: the top-n too")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    user: str | None = None
    interp: InterpExtension | None = None


class _Stops:
    """Stop strings over a growing text: what may be sent now (a tail that could begin a stop
    string is held back) and whether a stop string was reached (the text cut before it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, piece: str) -> tuple[str, bool]:
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self.flush(), True
        ready = len(self.text) - self.hold
        if ready <= self.sent:
            return "", False
        out = self.text[self.sent : ready]
        self.sent = ready
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


def _prompt(body: CompletionRequest) -> tuple[str | None, list[int] | None]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400, "InvalidOption", f"one prompt per request, got {len(prompt)} (send them apart)", field="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise ApiError(400, "InvalidTokens", "the prompt is empty", field="prompt")
    return None, list(prompt)


def _stops(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise limit_exceeded("stop", f"{len(stops)} stop strings", MAX_STOPS)
    for i, stop in enumerate(stops):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise ApiError(
                400, "InvalidOption", f"a stop string has 1 to {MAX_STOP_CHARS} characters", field=f"stop[{i}]"
            )
    return stops


def _named_logprobs(model: InterpModel, step: StreamStep) -> tuple[list[str], float | None]:
    """The text of each token ``step.logprobs`` lists, and the logprob of the token chosen (None if
    it is not among them)."""
    names = model.to_str_tokens([t for t, _ in step.logprobs]) if step.logprobs else []
    return names, next((lp for t, lp in step.logprobs if t == step.token_id), None)


class _Logprobs:
    """OpenAI's legacy ``logprobs`` object, token by token."""

    def __init__(self, model: InterpModel) -> None:
        self.model = model
        self.offset = 0

    def of(self, steps: Sequence[StreamStep], pieces: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for step, piece in zip(steps, pieces, strict=True):
            names, chosen = _named_logprobs(self.model, step)
            out["tokens"].append(piece)
            out["token_logprobs"].append(chosen)
            out["top_logprobs"].append(dict(zip(names, (lp for _, lp in step.logprobs), strict=True)))
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
        return out


class _Shape:
    """How an answer is written: OpenAI's ``text_completion`` (``choices[0].text``)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: InterpModel) -> None:
        self.logprobs = _Logprobs(model)

    def choice(self, text: str, steps: Sequence[StreamStep] | None, finish: str) -> dict[str, Any]:
        logprobs = self.logprobs.of(steps, [s.text for s in steps]) if steps is not None else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk_choice(
        self, piece: str, steps: Sequence[StreamStep] | None, finish: str | None, first: bool
    ) -> dict[str, Any]:
        logprobs = self.logprobs.of(steps, [s.text for s in steps]) if steps is not None else None
        return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}


class _ChatShape(_Shape):
    """OpenAI's ``chat.completion``: ``choices[0].message`` (a stream's chunks: ``delta``)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: InterpModel) -> None:
        super().__init__(model)
        self.model = model

    def content(self, steps: Sequence[StreamStep]) -> dict[str, Any]:
        """Chat logprobs: per token its text, logprob and the top ones."""
        out = []
        for step in steps:
            names, chosen = _named_logprobs(self.model, step)
            top = [
                {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8", "surrogatepass"))}
                for name, (_, lp) in zip(names, step.logprobs, strict=True)
            ]
            out.append(
                {
                    "token": step.text,
                    "logprob": chosen,
                    "bytes": list(step.text.encode("utf-8", "surrogatepass")),
                    "top_logprobs": top,
                }
            )
        return {"content": out}

    def choice(self, text: str, steps: Sequence[StreamStep] | None, finish: str) -> dict[str, Any]:
        logprobs = self.content(steps) if steps is not None else None
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def chunk_choice(
        self, piece: str, steps: Sequence[StreamStep] | None, finish: str | None, first: bool
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": piece} if first else {"content": piece}
        logprobs = self.content(steps) if steps is not None else None
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


OWNED_BY = "interp-engine"
"""``owned_by`` of the served model in ``GET /v1/models``."""


def add_models(app: FastAPI, served: Served) -> None:
    """OpenAI's model list, which OpenAI clients and chat front ends read first: the one served
    model under ``served.name``, the name completions report (they accept any ``model``)."""

    def card() -> dict[str, Any]:
        model = served.ready()
        return {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": OWNED_BY,
            "root": served.name,
            "parent": None,
            "max_model_len": model.info.n_ctx,
            "backend": model.backend,
        }

    def adapter_cards() -> list[dict[str, Any]]:
        """A card per registered LoRA adapter (``parent``: the served model), as vLLM lists its
        ``--lora-modules``: completions naming one as ``model`` run under it."""
        base = card()
        return [
            {**base, "id": name, "root": name, "parent": served.name}
            for name in getattr(served.ready(), "adapters", {})
        ]

    @app.get("/v1/models", responses=ERRORS)
    async def list_models() -> dict[str, Any]:
        """OpenAI's model list (``client.models.list()``): the served model, with the time it was
        loaded (``created``), its context length (``max_model_len``, as vLLM's server says it)
        and its backend; then each registered LoRA adapter (``parent``: the served model)."""
        return {"object": "list", "data": [card(), *adapter_cards()]}

    @app.get("/v1/models/{model:path}", responses=ERRORS)
    async def retrieve_model(model: str) -> dict[str, Any]:
        """One model of the list (``client.models.retrieve(id)``); an id not served is ``404 UnknownModel``."""
        adapters = {card["id"]: card for card in adapter_cards()}
        if model in adapters:
            return adapters[model]
        if model != served.name:
            raise ApiError(
                404,
                "UnknownModel",
                f"no model {model!r} is served here; this server serves {served.name!r}",
                field="model",
                valid=[served.name],
            )
        return card()


def add_completions(app: FastAPI, served: Served) -> None:
    @app.post("/v1/completions", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI-compatible completions (the OpenAI client works against it); steering, captures,
        feature readouts and the logit lens go in ``interp`` (the client's ``extra_body``)."""
        model = served.ready()
        text, token_ids = _prompt(body)
        if text is not None:
            ids = await served.tokenize(text, "prompt")
        else:
            ids = token_ids or []
            if len(ids) > served.limits.max_prompt_tokens:
                raise limit_exceeded("prompt", f"the prompt has {len(ids)} tokens", served.limits.max_prompt_tokens)
        n_logprobs = body.logprobs or 0
        return await _complete(
            served,
            request,
            PromptIn(ids, ids, "prompt"),
            body,
            n_logprobs=n_logprobs,
            want_logprobs=body.logprobs is not None,
            max_tokens=body.max_tokens,
            shape=_Shape(model),
        )

    @app.post("/v1/chat/completions", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI-compatible chat completions: ``messages`` formatted by the model's chat template
        (``model.chat_tokens``; vLLM's ``add_generation_prompt``, ``chat_template`` and
        ``chat_template_kwargs`` too), the answer's ``interp.chat`` naming each message's span;
        steering (span-named positions resolve against these messages), captures, readouts and the
        lens in ``interp``."""
        model = served.ready()
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(
                422, "ValidationError", "give max_tokens or max_completion_tokens, not both", field="max_tokens"
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(422, "ValidationError", "top_logprobs needs logprobs: true", field="top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        prompt = await served.prompt(body)
        return await _complete(
            served,
            request,
            prompt,
            body,
            n_logprobs=body.top_logprobs or 0,
            want_logprobs=body.logprobs,
            max_tokens=max_tokens,
            shape=_ChatShape(model),
        )


async def _complete(
    served: Served,
    request: Request,
    prompt: PromptIn,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    n_logprobs: int,
    want_logprobs: bool,
    max_tokens: int,
    shape: _Shape,
) -> Any:
    """A completion of ``prompt`` (either API's): captured whole with ``interp.points``, else
    streamed from the model (and sent as chunks, or collected)."""
    model = served.ready()
    ids, prompt_field = prompt.ids, prompt.field
    extension = body.interp or InterpExtension()
    served.check_generation(max_tokens, n_logprobs)
    stops = _stops(body)
    spec = served.steering(extension.steering)
    lens = served.lens(extension.lens, prompt, max_tokens)
    options: dict[str, Any] = {"temperature": body.temperature}
    for name in ("top_p", "top_k", "seed", "ignore_eos"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.model in getattr(model, "adapters", {}):  # vLLM's convention: model=<adapter name>
        options.update(served.adapter(body.model))
    head = {
        "id": f"{shape.id_prefix}-{uuid.uuid4().hex}",
        "object": shape.object,
        "created": int(time.time()),
        "model": body.model or served.name,
    }
    chat = prompt.chat_head()
    if extension.positions is not None and extension.points is None:
        raise ApiError(
            400, "InvalidOption", "interp.positions selects positions of interp.points", field="interp.positions"
        )
    if extension.points is not None:
        if body.stream or stops or want_logprobs:
            raise ApiError(
                400,
                "InvalidOption",
                "interp.points captures over the whole completion: not with stream, stop or logprobs "
                "(use interp.features for per-token readouts)",
                field="interp.points",
            )
        points, readouts = served.points(extension.points, "interp.points")
        served.check_size(points, len(ids) + max_tokens, "interp.points", readouts)
        if isinstance(extension.positions, str) and extension.positions not in ("all", "prompt", "generated"):
            with blame({InvalidOption: "interp.positions"}):  # a span name checked before generating
                select_positions(extension.positions, prompt.tokens, len(ids), len(ids))
        completion, acts = await capture_generation_of(
            served, model, request, prompt, points, readouts, spec, lens, max_tokens, options, "interp.points"
        )
        served.count_tokens(prompt=len(ids), generated=len(completion.token_ids))
        tensors, features = results_of(acts, points, readouts)
        kept: dict[str, Any] = {}
        if extension.positions is not None:
            n_total = len(ids) + len(completion.token_ids)
            with blame({InvalidOption: "interp.positions"}):
                selected = select_positions(extension.positions, prompt.tokens, len(ids), n_total)
            tensors, features = _at_positions(tensors, points, features, selected)
            kept = {"positions": selected}
        captured = await tensor_body(
            served.tensor_format(request, "json"), "activations", tensors, kept, len(ids), features, steered=spec
        )
        if lens is not None:
            captured["lens"] = await served.lens_result(acts.get(lens), spec)
        n_out = len(completion.token_ids)
        return {
            **head,
            "object": shape.object,
            "choices": [shape.choice(completion.text, None, completion.finish_reason)],
            "usage": _usage(len(ids), n_out),
            "interp": {"prompt_token_ids": ids, **chat, **completion_out(completion), **captured},
        }
    readouts = served.readouts(extension.features, "interp.features") if extension.features else []
    served.check_size([], max_tokens, "interp.features", readouts)
    options = generation_options(options, spec, readouts, lens)
    fields = served.fields(prompt_field, spec, "interp.features", readouts, lens=lens)
    stream, first = await served.open_stream(
        request,
        model,
        prompt.tokens,
        max_tokens=max_tokens,
        n_logprobs=max(n_logprobs, int(want_logprobs)),
        options=options,
        fields=fields,
    )
    served.count_tokens(prompt=len(ids))
    stop_at = _Stops(stops)

    async def run() -> AsyncIterator[tuple[list[StreamStep], str, str | None]]:
        """(steps, text to send, finish reason or None) as the steps arrive."""
        step, n = first, 0
        while step is not None:
            n += 1
            served.count_tokens(generated=1)
            piece, stopped = stop_at.add(step.text)
            if stopped:
                yield [step], piece, "stop"
                return
            last = n >= max_tokens
            following = None if last else await stream.next()
            if following is None:
                piece += stop_at.flush()
                yield [step], piece, "length" if n >= max_tokens else "stop"
                return
            yield [step], piece, None
            step = following
        yield [], stop_at.flush(), "stop"

    if not body.stream:

        async def collect() -> tuple[list[StreamStep], str, str]:
            collected: list[StreamStep] = []
            pieces: list[str] = []
            finish = "stop"
            async for batch, piece, reason in run():
                collected += batch
                pieces.append(piece)
                finish = reason or finish
            return collected, "".join(pieces), finish

        try:
            collected, text_out, finish = await unless_gone(request, collect())
        finally:
            with anyio.CancelScope(shield=True):
                await stream.close()
        choice = shape.choice(text_out, collected if want_logprobs else None, finish)
        extra: dict[str, Any] = {"prompt_token_ids": ids, **chat, "token_ids": [s.token_id for s in collected]}
        if readouts or lens is not None:
            extra["steps"] = [await served.step_out(s) for s in collected]
        if collected and collected[0].prompt_lens is not None:
            extra["prompt_lens"] = (await served.step_out(collected[0], first=True))["prompt_lens"]
        return {**head, "choices": [choice], "usage": _usage(len(ids), len(collected)), "interp": extra}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head["object"] = shape.chunk_object

    async def events() -> AsyncIterator[str]:
        n = 0
        try:
            async for batch, piece, reason in run():
                n += len(batch)
                steps_sent = batch if want_logprobs else None
                chunk: dict[str, Any] = {**head, "choices": [shape.chunk_choice(piece, steps_sent, reason, n <= 1)]}
                if batch:
                    step_out = await served.step_out(batch[0], first=n == 1)
                    chunk["interp"] = {"token_id": step_out["token_id"], "position": step_out["position"]}
                    for key in ("features", "lens", "prompt_lens"):
                        if key in step_out:
                            chunk["interp"][key] = step_out[key]
                    if n == 1:
                        chunk["interp"].update(chat)
                yield _data(chunk)
            if include_usage:
                yield _data({**head, "choices": [], "usage": _usage(len(ids), n)})
        except ApiError as exc:  # the status line is sent: report it in the stream
            yield _data({"error": exc.body()})
        yield "data: [DONE]\n\n"

    return EventStream(events(), stream.close)


def _at_positions(
    tensors: dict[str, Any], points: Sequence[Any], features: dict[str, Any], positions: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The captured values (and readouts) at ``positions`` only: rows, or an attention
    pattern's query axis."""
    rows = torch.tensor(positions, dtype=torch.long)
    kinds = {str(p): p for p in points}
    kept = {
        key: value[:, rows] if KINDS[kinds[key].kind].width == "heads x keys" else value[rows]
        for key, value in tensors.items()
    }
    return kept, {key: readout[rows] for key, readout in features.items()}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _data(chunk: Any) -> str:
    return f"data: {json_text(chunk)}\n\n"


__all__ = ["ChatCompletionRequest", "CompletionRequest", "add_completions"]
