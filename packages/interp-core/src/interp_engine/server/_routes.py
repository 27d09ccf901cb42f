"""The routes of the server's own API under ``/v1/`` (health, metrics, the model's description,
tokenize, capture, attention, capture_generation, generate, decode_residuals): each converts its
body through :class:`Served`, awaits the model's protocol method, and renders the result."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.types import DecoratedCallable

from .._errors import InterpError, InvalidActivations
from ..addresses._address import Address
from ..addresses._kinds import KINDS
from ..protocol._base import ModelBase
from ..protocol._checks import value_shape
from ..protocol._protocol import Completion, InterpModel, StaticTaps, StreamStep
from ..results._lens import LensRequest
from ..sae._readouts import FeatureReadout, Features
from ..steering._spec import SteeringSpec
from ._asgi import EventStream, unless_gone
from ._convert import PromptIn, Served, generation_options
from ._errors import ApiError, blame, limit_exceeded
from ._metrics import CONTENT_TYPE
from ._render import (
    ERRORS,
    TENSOR_RESPONSES,
    check_finite_steps,
    completion_out,
    finish_reason,
    lens_result_out,
    nest,
    non_finite,
    readout_of,
    sse_event,
    tensor_body,
    tensor_of,
)
from ._schemas import (
    AttentionRequest,
    AttentionResponse,
    CaptureGenerationRequest,
    CaptureGenerationResponse,
    CaptureRequest,
    CaptureResponse,
    DecodeRequest,
    DecodeResponse,
    GenerateRequest,
    GenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from ._tensors import decode, encode


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


def add_routes(app: FastAPI, served: Served) -> None:
    def tensor_route(path: str, response_model: Any) -> Callable[[DecoratedCallable], DecoratedCallable]:
        """A route answering tensors: JSON of its ``response_model``, or a safetensors file."""
        return app.post(
            path, response_model=response_model, response_model_exclude_unset=True, responses=TENSOR_RESPONSES
        )

    @app.get("/v1/health", responses=ERRORS)
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

    @app.get("/v1/model", responses=ERRORS)
    async def model_info() -> dict[str, Any]:
        """The model's shapes, the kinds it serves (its family's, on its backend) over its layers,
        the server's limits, the SAEs attached (``saes``: ``name``, ``architecture``,
        ``address``, ``address_out``, ``d_in``, ``d_sae``; on vllm-static ``compiled``), the LoRA
        adapters registered (``adapters``: ``name``, ``rank``, ``targets``, ``layers``; requests
        name one in their ``adapter`` field), and
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
        out["adapters"] = [
            {"name": name, "rank": a.rank, "targets": list(a.targets), "layers": list(a.layers)}
            for name, a in getattr(model, "adapters", {}).items()
        ]
        out["chat"] = {"template": _has_chat_template(model), "request_templates": served.trust_request_chat_template}
        return out

    @app.post("/v1/tokenize", response_model=TokenizeResponse, response_model_exclude_unset=True, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a text (``model.to_tokens``), or of messages (``model.chat_tokens``, with
        their spans under ``chat``), and one string per token."""
        model = served.ready()
        prompt = await served.prompt(body)
        return {**prompt.head(), "str_tokens": await served.off_loop(model.to_str_tokens, prompt.ids)}

    @tensor_route("/v1/capture", CaptureResponse)
    async def capture(body: CaptureRequest, request: Request) -> Any:
        """Activations ``[n_tokens, width]`` at ``points`` over the prompt (``model.capture``), and
        the feature readouts among ``points`` under ``features`` (``[n_tokens, k]`` each)."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        points, readouts = served.points(body.points)
        served.check_size(points, len(ids), "points", readouts)
        spec = served.steering(body.steering)
        adapter = served.adapter(body.adapter)
        async with served.slots:
            with served.fields(prompt.field, spec, readouts=readouts):
                work = model.capture(prompt.tokens, [*points, *readouts], steering_spec=spec, **adapter)
                acts = await unless_gone(request, work)
        tensors, features = results_of(acts, points, readouts)
        served.count_tokens(prompt=len(ids))
        return await tensor_body(
            served.tensor_format(request, body.format),
            "activations",
            tensors,
            prompt.head(),
            len(ids),
            features,
            steered=spec,
        )

    @tensor_route("/v1/attention", AttentionResponse)
    async def attention(body: AttentionRequest, request: Request) -> Any:
        """Attention patterns ``[heads, q, k]`` of ``layers`` (``model.capture_attention``)."""
        model = served.ready()
        prompt = await served.prompt(body)
        ids = prompt.ids
        points, _ = served.points([Address("attn_pattern", layer) for layer in body.layers], "layers")
        served.check_size(points, len(ids), "layers")
        adapter = served.adapter(body.adapter)
        async with served.slots:
            spec = served.steering(body.steering)
            with served.fields(prompt.field, spec, "layers"):
                extra = {**adapter, **({} if spec is None else {"steering_spec": spec})}
                call = model.capture_attention(prompt.tokens, list(body.layers), **extra)
                acts = await unless_gone(request, call)
        tensors = {str(p): tensor_of(acts[p]) for p in points}
        served.count_tokens(prompt=len(ids))
        return await tensor_body(
            served.tensor_format(request, body.format), "patterns", tensors, prompt.head(), len(ids), steered=spec
        )

    @tensor_route("/v1/capture_generation", CaptureGenerationResponse)
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
        options = {**body.sampling(), **served.adapter(body.adapter)}
        completion, acts = await capture_generation_of(
            served, model, request, prompt, points, readouts, spec, lens, body.max_tokens, options
        )
        tensors, features = results_of(acts, points, readouts)
        head = {**prompt.head(), "completion": completion_out(completion)}
        if lens is not None:
            head["lens"] = await served.lens_result(acts.get(lens), spec)
        n_positions = len(ids) + len(completion.token_ids)
        served.count_tokens(prompt=len(ids), generated=len(completion.token_ids))
        return await tensor_body(
            served.tensor_format(request, body.format),
            "activations",
            tensors,
            head,
            n_positions,
            features,
            steered=spec,
        )

    @app.post(
        "/v1/generate",
        response_model=GenerateResponse,
        response_model_exclude_none=True,
        responses={**ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}},
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
        options = generation_options({**body.sampling(), **served.adapter(body.adapter)}, spec, readouts, lens)
        fields = served.fields(prompt.field, spec, "features", readouts, lens=lens)
        if body.stream:
            return await _stream(served, model, prompt, body, options, fields)
        async with served.slots:
            with fields:
                if body.n_logprobs == 0 and not readouts and lens is None:
                    work = model.generate(prompt.tokens, max_tokens=body.max_tokens, **options)
                    completion = await unless_gone(request, work)
                    served.count_tokens(prompt=len(ids), generated=len(completion.token_ids))
                    return {**completion_out(completion), **prompt.chat_head()}
                collected = await unless_gone(request, _steps(model, prompt.tokens, body, options))
        served.count_tokens(prompt=len(ids), generated=len(collected))
        check_finite_steps(collected, spec)
        out: dict[str, Any] = {
            "token_ids": [s.token_id for s in collected],
            "text": "".join(s.text for s in collected),
            "finish_reason": finish_reason(len(collected), body.max_tokens),
            "steps": await served.steps_out(collected),
            **prompt.chat_head(),
        }
        first = collected[0] if collected else None
        if first is not None and first.prompt_lens is not None:
            out["prompt_lens"] = await served.off_loop(lens_result_out, first.prompt_lens, model.to_str_tokens)
        return out

    @app.post("/v1/decode_residuals", response_model=DecodeResponse, responses=ERRORS)
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
                raise non_finite("the logits", None, decoding=True)
            top = torch.topk(values, k, dim=-1)
            logprobs = torch.log_softmax(values, dim=-1).gather(-1, top.indices)
            shape = list(top.indices.shape)
            flat_ids = top.indices.reshape(-1).tolist()
            return {
                "shape": list(values.shape),
                "top": {
                    "token_ids": top.indices.tolist(),
                    "tokens": nest(model.to_str_tokens(flat_ids) if flat_ids else [], shape),
                    "logits": top.values.tolist(),
                    "logprobs": logprobs.tolist(),
                },
                "logits": encode(values) if body.return_logits else None,
            }

        return await served.off_loop(answer)


def results_of(
    acts: Mapping[Any, Any], points: Sequence[Address], readouts: Sequence[Features]
) -> tuple[dict[str, torch.Tensor], dict[str, FeatureReadout]]:
    """The activations at ``points`` and the ``readouts`` of a capture, keyed by their string form."""
    return {str(p): tensor_of(acts[p]) for p in points}, {str(r): readout_of(acts[r]) for r in readouts}


async def capture_generation_of(
    served: Served,
    model: InterpModel,
    request: Request,
    prompt: PromptIn,
    points: Sequence[Address],
    readouts: Sequence[Features],
    spec: SteeringSpec | None,
    lens: LensRequest | None,
    max_tokens: int,
    options: dict[str, Any],
    points_field: str = "points",
) -> tuple[Completion, Any]:
    """``model.capture_generation`` of ``prompt`` in a request slot (the lens, if any, among
    ``options``), its errors naming the request's fields: the completion and what it captured."""
    if lens is not None:
        options["lens"] = lens
    async with served.slots:
        with served.fields(prompt.field, spec, points_field, readouts, lens=lens):
            work = model.capture_generation(
                prompt.tokens, [*points, *readouts], max_tokens=max_tokens, steering_spec=spec, **options
            )
            return await unless_gone(request, work)


async def _steps(model: InterpModel, tokens: Any, body: GenerateRequest, options: dict[str, Any]) -> list[StreamStep]:
    """Every step of the generation ``body`` asks for, at once: the model's ``collect_steps``
    (one piece where its backend can), or its ``stream`` collected."""
    if isinstance(model, ModelBase):
        return await model.collect_steps(tokens, max_tokens=body.max_tokens, n_logprobs=body.n_logprobs, **options)
    steps = model.stream(tokens, max_tokens=body.max_tokens, n_logprobs=body.n_logprobs, **options)
    return await _collect(steps)


async def _collect(steps: AsyncIterator[StreamStep]) -> list[StreamStep]:
    """Every step of a stream, closing it however the collection ends."""
    try:
        return [step async for step in steps]
    finally:
        aclose = getattr(steps, "aclose", None)
        if aclose is not None:
            await aclose()


async def _stream(
    served: Served,
    model: InterpModel,
    prompt: PromptIn,
    body: GenerateRequest,
    options: dict[str, Any],
    fields: Any,
) -> Response:
    """Start the model's stream and pull its first step before answering, so that bad input is
    still a 4xx; then send the steps as server-sent events (the first one with the prompt's
    ``chat`` spans and ``prompt_lens`` when there are)."""
    ids = prompt.ids
    stream, first = await served.open_stream(
        None,
        model,
        prompt.tokens,
        max_tokens=body.max_tokens,
        n_logprobs=body.n_logprobs,
        options=options,
        fields=fields,
    )
    served.count_tokens(prompt=len(ids))

    async def events() -> AsyncIterator[str]:
        step, kept = first, []
        try:
            while step is not None:
                kept.append(step)
                served.count_tokens(generated=1)
                out = await served.step_out(step, first=len(kept) == 1)
                if len(kept) == 1:
                    out.update(prompt.chat_head())
                yield sse_event("token", out)
                step = await stream.next()
            done = {
                "token_ids": [s.token_id for s in kept],
                "text": "".join(s.text for s in kept),
                "finish_reason": finish_reason(len(kept), body.max_tokens),
            }
            yield sse_event("done", done)
        except ApiError as exc:  # the status line is sent: report it in the stream
            yield sse_event("error", exc.body())

    return EventStream(events(), stream.close)
