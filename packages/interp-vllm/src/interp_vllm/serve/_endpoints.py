"""The ``vllm.endpoint_plugins`` entry point: interp-engine inside ``vllm serve``.

vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it, and that list gates its general
plugins too; both of interp-vllm's entries are named ``interp_vllm``, so one name turns on the
workers' taps and these routes::

    VLLM_PLUGINS=interp_vllm vllm serve MODEL --enforce-eager \\
        --additional-config '{"interp": {"saes": {"res": "path/to/sae"}, "presets": {"MODEL-calm": SPEC}}}'

What the server then has:

- **Steering per request** on ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed
  or not) and ``POST /v1/responses``: ``"interp": {"steering": SPEC}`` in the body (the OpenAI client's
  ``extra_body``), or the same object as a JSON string in ``vllm_xargs["interp"]``. ``SPEC`` is a
  steering spec's JSON (``SteeringSpec.to_json``), with feature writes naming an attached SAE and,
  on chat completions, positions naming chat spans (``"assistant"``, ``"user[-1].last"``) of the
  request's own rendering. It is checked in the API server before the request reaches the engine:
  a bad one is ``400`` with the typed error's name, message and ``valid``.
- **Readouts and the lens** per request on the same routes: ``"interp": {"features": [...], "lens":
  {"layers": [...], "top_k": k}}`` gives each generated token's feature readouts and logit lens
  under ``interp.steps`` in the answer, or in each stream chunk for the tokens it carries.
- **Points at a few positions** on the same routes: ``"interp": {"points": ["resid_post.1"],
  "positions": [0, 5]}`` (positions from the prompt's first token, ``"prompt"``, or on chat
  completions a chat span name) gives the activations at those addresses and positions under
  ``interp.activations`` (by address, ``[n_positions, ...]`` as JSON lists, a form interp serve
  reads as a tensor) with ``interp.positions``, in the answer or, streamed, in the chunk before
  ``[DONE]``. vLLM never runs the last token it samples: positions past the generation's
  last-but-one token are left out. At most ``points_max_values`` numbers (``--additional-config``;
  else a ``400 LimitExceeded`` naming it); whole captures: ``/interp/v1/capture_generation``.
- **Presets**: a model name from ``presets`` is the served model plus that spec, so a client that
  knows nothing of interp-engine gets the steered model; ``GET /v1/models`` lists them.
  ``PUT``/``DELETE /interp/v1/presets/{name}`` change them at run time (the next request sees the
  change) on a server started with ``--api-key``. ``GET /interp/v1/workers``: each worker's
  requests in flight, SAEs held and time spent in the taps. ``PUT /interp/v1/saes/{name}``
  (``{"path": FOLDER}``, read on the server) and ``DELETE`` attach and detach SAEs at run time, on a
  server started with ``--api-key``.
- **``/interp/...``**: the whole of ``interp serve``'s API over the same engine
  (``/interp/v1/capture``, ``/interp/v1/capture_generation``, ``/interp/v1/generate``, ...), with
  its schemas and tensor formats, behind the server's ``--api-key``.
- **LoRA adapters** on a server started with ``--enable-lora``: a request naming a LoRA in
  ``model`` (vLLM's convention) carries ``interp`` fields like any; on the ``/interp`` routes the
  ``adapter`` field names the same LoRAs (``--lora-modules``, and those loaded or unloaded at run
  time through vLLM's ``/v1/load_lora_adapter``), run under vLLM's own ``lora_int_id`` for each;
  ``GET /interp/v1/model`` lists them.

The taps run in vLLM's eager mode: on a server that compiles the model (no ``--enforce-eager``),
requests with ``interp`` fields are refused with a message saying so, and everything else is
served unchanged. A vLLM without endpoint plugins never loads this module; one whose server
lacks what it wraps gets a warning at start and serves unchanged.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import HTTPException, Request

from interp_engine import (
    Address,
    CaptureMemoryExceeded,
    InterpError,
    InvalidOption,
    InvalidSteering,
    LensRequest,
    SteeringSpec,
    load_sae,
)
from interp_engine.chat import build_chat_tokens, is_span_name, select_positions

from .. import _compat
from ..frontend._capture_memory import OPTION as CAPTURE_MEMORY_OPTION
from ..frontend._capture_memory import needed_bytes
from ..frontend._lens_assembly import keyed, with_lens

logger = logging.getLogger(__name__)

NAME = "interp_vllm"
"""The plugin's name in ``VLLM_PLUGINS`` (the general plugin's too)."""
CONFIG_KEY = "interp"
"""The entry of ``--additional-config`` that configures the plugin."""
FIELD = "interp"
"""The request field (and ``vllm_xargs`` entry) that carries a request's steering."""
INTERP_FIELDS = ("steering", "features", "lens", "points", "positions")
"""What a request's ``interp`` object may hold on vLLM's routes."""
CONFIG_FIELDS = ("saes", "presets", "capture_memory_bytes", "points_max_values")
"""The settings of ``--additional-config``'s ``interp`` entry."""
POINTS_MAX_VALUES = 65536
"""Most numbers ``interp.points`` returns in one answer (positions x values per position), unless
``points_max_values`` says otherwise."""
STEERED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class Refused(Exception):
    """A request's ``interp`` fields refused before it reached the engine (answered ``400``)."""

    def __init__(self, error: InterpError, param: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.param = param


class LimitExceeded(InvalidOption):
    """A request asking for more than the server's bound (``valid``: the bound)."""

    def __init__(self, message: str, *, valid: int) -> None:
        super().__init__(message)
        self.valid = valid


class _Steps:
    """Each generated token's readouts and lens, as the engine's outputs come, until the response
    (or its next stream chunk) takes them; and the points asked for, once the generation is done."""

    def __init__(self, per_token: bool) -> None:
        self.per_token = per_token
        self.ready: list[dict[str, Any]] = []
        self.points: dict[str, Any] | None = None
        self.generations = 0

    def take(self) -> list[dict[str, Any]]:
        taken, self.ready = self.ready, []
        return taken

    def chunk(self, last: bool) -> dict[str, Any] | None:
        """The ``interp`` object of a stream chunk: the steps ready (``last``: the chunk before
        ``[DONE]``, with the points too), ``None`` when there is nothing to send."""
        out: dict[str, Any] = {}
        ready = self.take()
        if ready:
            out["steps"] = ready
        if last and self.points is not None:
            out.update(self.points)
        return _finite(out) if out else None

    def whole(self) -> dict[str, Any]:
        """The ``interp`` object of a whole answer."""
        out: dict[str, Any] = {"steps": self.take()} if self.per_token else {}
        if self.points is not None:
            out.update(self.points)
        return dict(_finite(out))


@dataclass(frozen=True)
class _Call:
    """What a route handler hands to the engine's ``generate`` for one HTTP request."""

    spec: SteeringSpec | None
    field: str
    messages: list[Any] | None = None
    chat_options: Mapping[str, Any] | None = None
    features: tuple[Any, ...] = ()
    lens: Mapping[str, Any] | None = None
    points: tuple[str, ...] = ()
    positions: Any = None
    steps: _Steps | None = None


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("interp_vllm_call", default=None)


def plugin() -> InterpEndpoints:
    """The entry point's factory (vLLM calls it with no arguments)."""
    return InterpEndpoints()


class InterpEndpoints:
    """interp-engine's routes and per-request steering on vLLM's OpenAI server."""

    name = NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.model: Any = None
        self.presets: dict[str, SteeringSpec] = {}
        self.base_names: tuple[str, ...] = ()
        self.refusal: str | None = "the interp-engine plugin has not started yet"
        self.api_keys: tuple[str, ...] = ()
        self.points_max_values = POINTS_MAX_VALUES
        self._interp_app: Any = None
        self._presets_lock = threading.Lock()
        self._serving_models: Any = None
        """vLLM's ``OpenAIServingModels``: the LoRA adapters its server serves (``lora_requests``)."""
        self._refused_adapters: dict[str, tuple[str, int]] = {}
        """vLLM's LoRAs the model could not register (logged once each), by name: (path, id)."""

    # -- phase A: routes ----------------------------------------------------------------------
    def attach_router(self, app: Any) -> None:
        from fastapi.routing import APIRoute

        originals = {
            route.path: route
            for route in app.routes
            if isinstance(route, APIRoute) and route.path in STEERED_ROUTES and "POST" in route.methods
        }
        missing = [path for path in STEERED_ROUTES if path not in originals]
        if missing:
            logger.warning("interp-engine: this vLLM server has no %s; no steering there", ", ".join(missing))
        for path, route in originals.items():
            app.add_api_route(
                path,
                self._steered(route.endpoint),
                methods=["POST"],
                dependencies=route.dependencies,
                responses=route.responses,
                name=f"{route.name}_interp",
            )
        models = next(
            (r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/models" and "GET" in r.methods),
            None,
        )
        if models is not None:
            app.add_api_route(
                "/v1/models", self._models(models.endpoint), methods=["GET"], name="show_available_models_interp"
            )

        async def interp_app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            from starlette.responses import JSONResponse

            inner = self._interp_app
            if not self._authorized(scope):
                answer = JSONResponse(_error_body("a valid API key is required", "Unauthorized", 401), 401)
            elif inner is None:
                answer = JSONResponse(_error_body(self.refusal or "not started", "NotFound", 404), 404)
            else:
                self._sync_adapters()
                await inner(scope, receive, send)
                return
            await answer(scope, receive, send)

        app.mount("/interp", interp_app)

    # -- phase B: the engine ------------------------------------------------------------------
    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            self.refusal = "this vLLM server has no engine (a render-only server)"
            return
        try:
            _compat.check_server()
            await self._start(engine_client, args, state)
        except Exception as exc:  # whatever stops the plugin, vLLM serves on without it
            self.refusal = f"interp-engine is off on this server: {exc}"
            logger.warning("interp-engine: %s; the server serves as it would without the plugin", exc)

    async def _start(self, engine: Any, args: Any, state: Any = None) -> None:
        from ..frontend._model import VllmModel

        vllm_config = engine.vllm_config
        model_config = vllm_config.model_config
        config = dict((getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY) or {})
        unknown = sorted(set(config) - set(CONFIG_FIELDS))
        if unknown:
            raise InvalidOption(
                f"unknown {CONFIG_KEY!r} settings in --additional-config: {unknown}; valid: {', '.join(CONFIG_FIELDS)}"
            )
        cap = config.get("points_max_values", POINTS_MAX_VALUES)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise InvalidOption(f"points_max_values is a positive int (numbers per answer), got {cap!r}")
        if not model_config.enforce_eager:
            raise InvalidOption(
                "the taps run in vLLM's eager mode and this server compiles the model; start it with --enforce-eager"
            )
        options: dict[str, Any] = {
            "max_model_len": int(model_config.max_model_len) - 1,
            "trust_remote_code": bool(model_config.trust_remote_code),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "tensor_parallel_size": int(vllm_config.parallel_config.tensor_parallel_size),
            "pipeline_parallel_size": int(vllm_config.parallel_config.pipeline_parallel_size),
        }
        if model_config.tokenizer and model_config.tokenizer != model_config.model:
            options["tokenizer"] = model_config.tokenizer
        if config.get("capture_memory_bytes") is not None:
            options["capture_memory_bytes"] = config["capture_memory_bytes"]
        lora_config = getattr(vllm_config, "lora_config", None)
        if lora_config is not None:  # --enable-lora: the /interp routes serve the server's LoRAs
            options["enable_lora"] = True
            options["max_lora_rank"] = int(lora_config.max_lora_rank)
            options["max_loras"] = int(lora_config.max_loras)
        model = VllmModel(model_config.model, options)
        await model.serve_engine(engine)
        try:
            for name, path in dict(config.get("saes") or {}).items():
                model.attach_sae(str(name), load_sae(str(path)))
            self.base_names = tuple(getattr(args, "served_model_name", None) or [model_config.model])
            self.model = model  # presets are checked against it
            self._serving_models = getattr(state, "openai_serving_models", None)
            self._sync_adapters()
            for name, spec in dict(config.get("presets") or {}).items():
                self.set_preset(str(name), spec)
        except BaseException:
            self.model = None
            await model.shutdown()  # its own resources only: the engine is vLLM's
            raise
        self.api_keys = api_keys(args)
        self.points_max_values = cap
        self._wrap_generate(engine)
        self._interp_app = self._build_interp_app(model)
        self.refusal = None
        logger.info(
            "interp-engine: serving %s with %d preset(s) and %d SAE(s)",
            model_config.model,
            len(self.presets),
            len(model.saes),
        )

    def _sync_adapters(self) -> None:
        """Make the model's adapters the LoRAs vLLM's server serves (``--lora-modules``, and any
        loaded or unloaded at run time through ``/v1/load_lora_adapter``), under vLLM's names and
        ``lora_int_id``s: an ``adapter`` field on the ``/interp`` routes names what ``model=``
        names on vLLM's, and both run the LoRA vLLM holds under that id. Called before each
        ``/interp`` request; a LoRA the model's checks refuse is logged once and left out (a
        request naming it is ``400 UnknownAdapter``)."""
        model = self.model
        requests = getattr(self._serving_models, "lora_requests", None)
        if model is None or not isinstance(requests, Mapping):
            return
        served = {str(name): (str(r.lora_path), int(r.lora_int_id)) for name, r in requests.items()}
        wanted = {name: lora for name, lora in served.items() if self._refused_adapters.get(name) != lora}
        if wanted == model.served_loras():
            return
        for name, problem in model.adopt_loras(wanted).items():
            logger.warning("interp-engine: vLLM's LoRA %r is not served on /interp: %s", name, problem)
            self._refused_adapters[name] = wanted[name]

    def _authorized(self, scope: Any) -> bool:
        """Whether an ``/interp`` request may pass: the server has no API key, or it sends one of
        them as ``Authorization: Bearer KEY`` (vLLM's own check guards only its prefixes)."""
        if not self.api_keys or scope.get("path", "").endswith("/v1/health"):
            return True
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                given = value
        scheme, _, key = given.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(key.encode()).digest()
        return any(hmac.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in self.api_keys)

    def _build_interp_app(self, model: Any) -> Any:
        from interp_engine.server import create_app

        app = create_app(model)
        app.state.served.model = model  # a mounted app's lifespan never runs: the engine is already up
        endpoints = self

        def check_key() -> None:
            if not endpoints.api_keys:
                raise HTTPException(403, "presets and SAEs change at run time only on a server started with --api-key")

        async def keyed_body(request: Request, error: type[InterpError], shape: str) -> Any:
            """The JSON body of a change to the server (one started with a key)."""
            check_key()
            try:
                return json.loads(await request.body())
            except ValueError as exc:
                raise error(f"the body is {shape}: {exc}") from None

        async def put_preset(name: str, request: Request) -> Any:
            spec = await keyed_body(request, InvalidSteering, "a steering spec's JSON")
            endpoints.set_preset(name, spec)
            return {"name": name, "presets": sorted(endpoints.presets)}

        async def delete_preset(name: str) -> Any:
            check_key()
            if not endpoints.drop_preset(name):
                raise HTTPException(404, f"no preset {name!r}; presets: {sorted(endpoints.presets)}")
            return {"name": name, "presets": sorted(endpoints.presets)}

        async def list_presets() -> Any:
            return {name: spec.to_dict() for name, spec in endpoints.presets.items()}

        async def workers() -> Any:
            return {"workers": await model.worker_stats()}

        async def put_sae(name: str, request: Request) -> Any:
            body = await keyed_body(request, InvalidOption, "{'path': FOLDER}")
            if not isinstance(body, dict) or set(body) != {"path"} or not isinstance(body["path"], str):
                raise InvalidOption("the body is {'path': FOLDER}: a folder load_sae reads, on the server")
            if name in model.saes:
                model.detach_sae(name)  # a request in flight keeps the SAE it was checked with
            model.attach_sae(name, load_sae(body["path"]))
            return {"name": name, "saes": sorted(model.saes)}

        async def delete_sae(name: str) -> Any:
            check_key()
            model.detach_sae(name)
            return {"name": name, "saes": sorted(model.saes)}

        app.add_api_route("/v1/presets", list_presets, methods=["GET"])
        app.add_api_route("/v1/workers", workers, methods=["GET"])
        app.add_api_route("/v1/saes/{name}", put_sae, methods=["PUT"])
        app.add_api_route("/v1/saes/{name}", delete_sae, methods=["DELETE"])
        app.add_api_route("/v1/presets/{name}", put_preset, methods=["PUT"])
        app.add_api_route("/v1/presets/{name}", delete_preset, methods=["DELETE"])
        return app

    def set_preset(self, name: str, spec: Any) -> None:
        """Serve ``spec`` (a steering spec or its JSON) under the model name ``name``."""
        if not isinstance(name, str) or not name or name in self.base_names:
            raise InvalidOption(f"a preset's name is a new model name, not {name!r} (served: {list(self.base_names)})")
        parsed = spec if isinstance(spec, SteeringSpec) else SteeringSpec.from_dict(spec)
        if self.model is not None:
            self.model._check_writes(parsed)  # addresses, widths and SAEs, before any request uses it
        with self._presets_lock:
            self.presets = {**self.presets, name: parsed}  # a request holds the mapping it read

    def drop_preset(self, name: str) -> bool:
        """Stop serving the preset ``name`` (``False``: there was none)."""
        with self._presets_lock:
            if name not in self.presets:
                return False
            self.presets = {k: v for k, v in self.presets.items() if k != name}
            return True

    # -- per request ----------------------------------------------------------------------------
    def _steered(self, endpoint: Callable[..., Any]) -> Callable[..., Any]:
        endpoints = self

        async def steered(request: Any, raw_request: Request) -> Any:
            call = None
            try:
                call = endpoints._call_of(request)
            except Refused as exc:
                return _refusal(exc)
            if call is None:
                return await endpoint(request, raw_request)
            token = _CALL.set(call)
            try:
                response = await endpoint(request, raw_request)
            except Refused as exc:
                return _refusal(exc)
            finally:
                _CALL.reset(token)
            return response if call.steps is None else _with_steps(response, call.steps)

        steered.__annotations__ = dict(getattr(endpoint, "__annotations__", {}))
        steered.__annotations__["raw_request"] = Request
        steered.__signature__ = _signature_of(endpoint)  # type: ignore[attr-defined]
        return steered

    def _call_of(self, request: Any) -> _Call | None:
        """The request's steering (its ``interp`` field, ``vllm_xargs["interp"]``, or its model
        name's preset), or ``None``; :class:`Refused` when it cannot be served."""
        extra = request.model_extra if isinstance(getattr(request, "model_extra", None), dict) else {}
        given = extra.pop(FIELD, None)
        xargs = getattr(request, "vllm_xargs", None)
        if isinstance(xargs, dict) and FIELD in xargs:
            text = xargs.pop(FIELD)
            if given is not None:
                raise Refused(
                    InvalidSteering("send interp in the body or in vllm_xargs, not both"), "vllm_xargs.interp"
                )
            try:
                given = json.loads(text) if isinstance(text, str) else text
            except ValueError as exc:
                raise Refused(InvalidSteering(f"vllm_xargs.interp is not JSON: {exc}"), "vllm_xargs.interp") from None
        presets = self.presets
        preset = presets.get(getattr(request, "model", None) or "")
        if given is None and preset is None:
            return None
        if self.refusal is not None:
            raise Refused(InvalidOption(self.refusal), FIELD)
        spec = preset
        features: tuple[Any, ...] = ()
        lens: dict[str, Any] | None = None
        points: tuple[str, ...] = ()
        positions: Any = None
        if given is not None:
            if not isinstance(given, dict) or set(given) - set(INTERP_FIELDS):
                raise Refused(
                    InvalidOption(
                        f"interp is an object with the fields {', '.join(INTERP_FIELDS)}; got {_keys(given)} "
                        "(whole captures: the /interp/v1 routes)"
                    ),
                    FIELD,
                )
            try:
                asked = SteeringSpec.from_dict(given.get("steering") or [])
            except InterpError as exc:
                raise Refused(exc, f"{FIELD}.steering") from None
            spec = asked if preset is None else SteeringSpec([*preset.writes, *asked.writes])
            features, lens = _readouts_asked(given)
            points, positions = _points_asked(given)
        if preset is not None:
            request.model = self.base_names[0]
        if spec is not None and not spec.writes:
            spec = None
        if spec is None and not features and lens is None and not points:
            return None
        steps = None
        if features or lens is not None or points:
            if int(getattr(request, "n", 1) or 1) != 1 or getattr(request, "use_beam_search", False):
                raise Refused(
                    InvalidOption("readouts, points and the lens are read for one completion (n=1, no beam search)"),
                    FIELD,
                )
            steps = _Steps(per_token=bool(features) or lens is not None)
        messages = getattr(request, "messages", None)
        options = None
        if messages is not None:
            options = {
                "add_generation_prompt": bool(getattr(request, "add_generation_prompt", True)),
                **dict(getattr(request, "chat_template_kwargs", None) or {}),
            }
            if getattr(request, "continue_final_message", False) or getattr(request, "chat_template", None):
                options = None  # the model's own template, as vLLM renders it, is the only one spans are read in
        return _Call(
            spec,
            f"{FIELD}.steering",
            list(messages) if messages is not None else None,
            options,
            features=features,
            lens=lens,
            points=points,
            positions=positions,
            steps=steps,
        )

    def _wrap_generate(self, engine: Any) -> None:
        original = engine.generate
        endpoints = self

        def generate(prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            call = _CALL.get()
            if call is None or not hasattr(sampling_params, "extra_args"):
                return original(prompt, sampling_params, request_id, *args, **kwargs)
            prompt, checked, selected = endpoints._check(call, prompt, sampling_params)
            return endpoints._steer(
                original, call.steps, checked, selected, prompt, sampling_params, request_id, args, kwargs
            )

        engine.generate = generate

    def _check(self, call: _Call, prompt: Any, params: Any) -> tuple[Any, Any, list[int]]:
        """The prompt (with a cache salt of its own), the request's checked steering, readouts and
        points, and the positions its points are read at."""
        model = self.model
        ids = _compat.prompt_token_ids(model._engine, prompt)
        if ids is None or not isinstance(prompt, dict):
            raise Refused(InvalidSteering("steering needs a prompt of tokens (not embeddings)"), call.field)
        tokens: Any = list(ids)
        named = call.spec is not None and any(is_span_name(w.positions) for w in call.spec.writes)
        if named or (isinstance(call.positions, str) and call.positions != "prompt"):
            try:
                tokens = self._chat_tokens(call, tokens)
            except Refused as exc:
                if named:
                    raise
                raise Refused(InvalidOption(str(exc.error)), f"{FIELD}.positions") from None
        if call.steps is not None:
            call.steps.generations += 1
            if call.steps.generations > 1:
                raise Refused(InvalidOption("readouts and the lens are read for one prompt per request"), FIELD)
        max_tokens = int(params.max_tokens or 1)
        points = self._addresses(call.points, len(ids), max_tokens)
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
        selected = self._positions(call, tokens, checked, max_tokens) if points else []
        return {**prompt, "cache_salt": f"interp-{secrets.token_hex(8)}"}, checked, selected

    def _addresses(self, points: tuple[str, ...], n: int, max_tokens: int) -> list[Address]:
        """``interp.points`` as addresses, each checked against the model (the entry at fault named)."""
        model = self.model
        out = []
        for i, text in enumerate(points):
            try:
                address = Address.parse(text)
                model._check_generation([0] * n, [address], max_tokens=max_tokens, steering_spec=None, sampling={})
            except InterpError as exc:
                raise Refused(exc, f"{FIELD}.points[{i}]") from None
            out.append(address)
        return out

    def _positions(self, call: _Call, tokens: Any, checked: Any, max_tokens: int) -> list[int]:
        """The positions ``interp.positions`` selects, each one the engine runs (the prompt's and
        every generated token's but the last, which vLLM samples and never runs), and the answer
        within :attr:`points_max_values` and the capture memory."""
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
        model = self.model
        n_total = n + max_tokens
        per_position = sum(needed_bytes([a], n_total, model.info) // (4 * n_total) for a in checked.addresses)
        values = len(selected) * per_position
        if values > self.points_max_values:
            raise Refused(
                LimitExceeded(
                    f"interp.points at these {len(selected)} positions would return {values} numbers; this server "
                    f"returns at most points_max_values={self.points_max_values} in an answer (fewer points or "
                    "positions, or /interp/v1/capture_generation for whole captures)",
                    valid=self.points_max_values,
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

    def _chat_tokens(self, call: _Call, ids: list[int]) -> Any:
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
            tokens = build_chat_tokens(self.model.tokenizer, _plain(call.messages), **call.chat_options)
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

    def _steer(
        self,
        original: Callable[..., Any],
        steps: _Steps | None,
        checked: Any,
        selected: list[int],
        prompt: Any,
        params: Any,
        request_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, None]:
        model = self.model

        async def run() -> AsyncGenerator[Any, None]:
            engine = model._engine
            await model._sync_saes(engine, checked)
            keys = model._use_saes(checked)

            def generate(steered: Any) -> Any:
                return original(prompt, steered, request_id, *args, **kwargs)

            try:
                n_total = len(checked.token_ids) + checked.max_tokens
                async with model.capture_memory.reserved(checked.addresses, n_total, model.info) as regions:
                    outputs = self._generate(generate, params, engine, keys, regions, steps, checked, selected)
                    async for output in outputs:
                        yield output
            finally:
                await model._unuse_saes(engine, keys)

        return run()

    async def _generate(
        self,
        generate: Callable[[Any], Any],
        params: Any,
        engine: Any,
        keys: dict[str, str],
        regions: Any,
        steps: _Steps | None,
        checked: Any,
        selected: list[int],
    ) -> AsyncGenerator[Any, None]:
        """vLLM's generation of one steered or read request, its readouts and lens drained into
        ``steps`` as its tokens come, its points read once it is done."""
        from vllm.sampling_params import RequestOutputKind

        model = self.model
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
                        steps.ready.append(_step(position, found, lens, checked, model.tokenizer))
                        position += 1
                yield output
            if points and steps is not None:
                ran = n + max(generated - 1, 0)  # vLLM never runs the last token it samples
                values, _, _ = await model._fetch(engine, rid, points, ran, (), regions)
                fetched = True
                steps.points = _points_answer(checked, values, [p for p in selected if p < ran])
        finally:
            if holds and not fetched:
                await model._release(engine, rid)

    def _models(self, endpoint: Callable[..., Any]) -> Callable[..., Any]:
        endpoints = self

        async def models(raw_request: Request) -> Any:
            response = await endpoint(raw_request)
            presets = endpoints.presets
            if not presets:
                return response
            from starlette.responses import JSONResponse

            body = json.loads(bytes(response.body))
            data = list(body.get("data") or [])
            base = data[0] if data else {"object": "model", "owned_by": "vllm"}
            for name in presets:
                data.append({**base, "id": name, "root": base.get("id", base.get("root")), "parent": base.get("id")})
            body["data"] = data
            return JSONResponse(body, status_code=response.status_code)

        return models


def api_keys(args: Any) -> tuple[str, ...]:
    """The keys vLLM's server takes: its ``--api-key`` values, else ``VLLM_API_KEY``."""
    given = getattr(args, "api_key", None)
    listed = [given] if isinstance(given, str) else list(given or ())
    if not listed:
        listed = [os.environ.get("VLLM_API_KEY", "")]
    return tuple(key for key in listed if key)


def _readouts_asked(given: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The ``features`` (readout strings such as ``"features:res:top8"``) and ``lens`` (``{"layers":
    [...], "top_k": k}``) of an ``interp`` object."""
    features = given.get("features") or ()
    if isinstance(features, str) or not isinstance(features, (list, tuple)):
        raise Refused(
            InvalidOption("interp.features is a list of readouts such as 'features:res:top8'"), f"{FIELD}.features"
        )
    lens = given.get("lens")
    if lens is not None and not isinstance(lens, dict):
        raise Refused(InvalidOption("interp.lens is an object: {'layers': [...], 'top_k': k}"), f"{FIELD}.lens")
    if lens is not None and "positions" in lens:
        raise Refused(
            InvalidOption("interp.lens reads the generated tokens here; the prompt's lens: /interp/v1/generate"),
            f"{FIELD}.lens",
        )
    return tuple(features), lens


def _points_asked(given: Mapping[str, Any]) -> tuple[tuple[str, ...], Any]:
    """The ``points`` (address strings) and ``positions`` (ints, ``"prompt"`` or a chat span name)
    of an ``interp`` object, checked for shape (what they name is checked against the prompt)."""
    points, positions = given.get("points"), given.get("positions")
    if points is None:
        if positions is not None:
            refused = InvalidOption("interp.positions selects the positions of interp.points")
            raise Refused(refused, f"{FIELD}.positions")
        return (), None
    if not isinstance(points, list) or not points or not all(isinstance(p, str) for p in points):
        raise Refused(
            InvalidOption(
                "interp.points is a non-empty list of addresses such as 'resid_post.1' (feature readouts: "
                "interp.features)"
            ),
            f"{FIELD}.points",
        )
    if positions is None:
        raise Refused(
            InvalidOption(
                "interp.points needs interp.positions, the few positions to read (ints, 'prompt' or a chat span "
                "name); whole captures: /interp/v1/capture_generation"
            ),
            f"{FIELD}.positions",
        )
    if isinstance(positions, str):
        if positions != "prompt" and not is_span_name(positions):
            raise Refused(
                InvalidOption(
                    f"interp.positions is a list of positions (ints from 0), 'prompt' or a chat span name such as "
                    f"'user[-1].last', got {positions!r:.60}"
                ),
                f"{FIELD}.positions",
            )
    elif (
        not isinstance(positions, list)
        or not positions
        or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions)
    ):
        raise Refused(
            InvalidOption(
                "interp.positions is a non-empty list of positions counted from the prompt's first token (ints from "
                "0: the length of a generation is not known before it ends), 'prompt' or a chat span name"
            ),
            f"{FIELD}.positions",
        )
    return tuple(points), positions


def _step(position: int, features: Mapping[Any, Any], lens: Any, checked: Any, tokenizer: Any) -> dict[str, Any]:
    """One generated token's readouts and lens as JSON, in the shapes of ``interp serve``'s stream
    steps: ``position`` is the one that produced it."""
    step: dict[str, Any] = {"position": position}
    if checked.readouts:
        step["features"] = {
            str(spec): {
                "values": readout.values.tolist(),
                "ids": None if readout.ids is None else readout.ids.tolist(),
                "error_norm": None if readout.error_norm is None else float(readout.error_norm),
            }
            for spec, readout in features.items()
        }
    if lens is not None:
        ids, probs = lens
        listed = ids.tolist()
        step["lens"] = {
            "layers": list(checked.lens.layers),
            "ids": listed,
            "probs": probs.tolist(),
            "tokens": [tokenizer.batch_decode([[i] for i in row]) for row in listed],
        }
    return step


def _points_answer(checked: Any, values: Mapping[Address, Any], positions: list[int]) -> dict[str, Any]:
    """``interp.positions`` and ``interp.activations`` (by address as asked: ``[n_positions, ...]``
    as JSON lists; an attention pattern's ``[heads, n_positions, keys]``); a value that
    overflowed float32 is ``null``."""
    rows = torch.tensor(positions, dtype=torch.long)
    out = {}
    for asked, address in checked.points.items():
        value = values[address]
        picked = value[:, rows] if address.info.width == "heads x keys" else value[rows]
        out[str(asked)] = picked.tolist()
    return {"positions": positions, "activations": out}


def _finite(value: Any) -> Any:
    """JSON data (dicts, lists, numbers) with every inf or NaN as ``None`` (JSON has neither)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _with_steps(response: Any, steps: _Steps) -> Any:
    """vLLM's answer with the generated tokens' readouts and lens under ``interp``: in the body, or
    in each stream chunk (the steps of the tokens that chunk carries)."""
    from starlette.responses import JSONResponse, StreamingResponse

    if isinstance(response, StreamingResponse):
        chunks = response.body_iterator

        async def decorated() -> AsyncGenerator[Any, None]:
            async for chunk in chunks:
                text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
                if text.startswith("data: [DONE]"):
                    left = steps.chunk(last=True)
                    if left:
                        yield f"data: {json.dumps({'interp': left})}\n\n"
                elif text.startswith("data: "):
                    ready = steps.chunk(last=False)
                    if ready:
                        body = json.loads(text[len("data: ") :])
                        body["interp"] = ready
                        text = f"data: {json.dumps(body)}\n\n"
                    yield text
                    continue
                yield chunk

        response.body_iterator = decorated()
        return response
    if isinstance(response, JSONResponse) and response.status_code == 200:
        body = json.loads(bytes(response.body))
        body["interp"] = steps.whole()
        return JSONResponse(body, status_code=200)
    return response


def _signature_of(endpoint: Callable[..., Any]) -> Any:
    import inspect

    return inspect.signature(endpoint)


def _plain(messages: list[Any]) -> list[Any]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]


def _keys(value: Any) -> str:
    return repr(sorted(value)[:8]) if isinstance(value, dict) else f"a {type(value).__name__}"


def _error_body(message: str, kind: str, status: int, param: str | None = None, valid: Any = None) -> dict[str, Any]:
    """vLLM's error shape (``{"error": {...}}``), with the typed error's name and ``valid``."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": status}
    if valid is not None:
        error["valid"] = valid
    return {"error": error}


def _refusal(exc: Refused) -> Any:
    from starlette.responses import JSONResponse

    valid = getattr(exc.error, "valid", None)
    if valid is not None and not isinstance(valid, (str, int, float, bool, list, dict)):
        valid = [str(v) for v in valid] if isinstance(valid, (tuple, set, frozenset)) else str(valid)
    return JSONResponse(_error_body(str(exc.error), type(exc.error).__name__, 400, exc.param, valid), 400)


def plugin_enabled() -> bool:
    """Whether ``VLLM_PLUGINS`` lets vLLM load this plugin (its default: no endpoint plugin)."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and NAME in [n.strip() for n in names.split(",")]
