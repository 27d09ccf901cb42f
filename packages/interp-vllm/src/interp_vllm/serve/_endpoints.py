"""The ``vllm.endpoint_plugins`` entry point: interp-engine inside ``vllm serve``.

vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it, and that list gates its general
plugins too; both of interp-vllm's entries are named ``interp_vllm``, so one name turns on the
workers' taps and these routes::

    VLLM_PLUGINS=interp_vllm vllm serve MODEL \\
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

- **Taps declared at start** (vllm-static): ``"static": {"points": [...], "writes": [...]}`` (or
  ``"auto"``) in the ``interp`` entry makes vLLM's workers compile those taps, and the SAEs of
  ``saes``, into the model's graph before vLLM compiles it (:func:`interp_vllm._wire.serve_declaration`
  reads the declaration for both sides); the plugin then serves a vllm-static model over the
  same engine, and a request naming an address outside the declaration is ``400
  UndeclaredAddress`` naming it and how to declare more. Its SAEs cannot change at run time
  (``409``).

The taps run on a server that compiles the model (vLLM's default) as on one started with
``--enforce-eager``: on vLLM's CPU platform the residual stream's taps run inside the compiled
graph and steps that tap inside a layer run uncompiled (``interp_vllm.worker._compiled``). A
vLLM without endpoint plugins never loads this module; one whose server lacks what it wraps gets
a warning at start and serves unchanged.

The plugin (:class:`InterpEndpoints`) is cut along what it does: :mod:`._routes` (vLLM's routes
wrapped, the ``/interp`` app, API keys), :mod:`._requests` (a request's ``interp`` fields read
into a call), :mod:`._steering` (the engine's ``generate`` wrapped: checks, steering and reading
in vLLM's generation) and :mod:`._answers` (readouts, lens and points in the answer or its
stream chunks).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from interp_engine import InvalidOption, SteeringSpec, load_model, load_sae

from .. import _compat
from .._wire import SERVE_STATIC_HOW, serve_declaration
from ._requests import Call, call_of
from ._routes import api_keys, authorized, error_body, interp_app, models_route, steered
from ._steering import wrap_generate

logger = logging.getLogger(__name__)

NAME = "interp_vllm"
"""The plugin's name in ``VLLM_PLUGINS`` (the general plugin's too)."""
CONFIG_KEY = "interp"
"""The entry of ``--additional-config`` that configures the plugin."""
CONFIG_FIELDS = ("saes", "presets", "capture_memory_bytes", "points_max_values", "static")
"""The settings of ``--additional-config``'s ``interp`` entry."""
POINTS_MAX_VALUES = 65536
"""Most numbers ``interp.points`` returns in one answer (positions x values per position), unless
``points_max_values`` says otherwise."""
STEERED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


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
                steered(self, route.endpoint),
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
                "/v1/models", models_route(self, models.endpoint), methods=["GET"], name="show_available_models_interp"
            )

        async def interp_app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            from starlette.responses import JSONResponse

            inner = self._interp_app
            if not self._authorized(scope):
                answer = JSONResponse(error_body("a valid API key is required", "Unauthorized", 401), 401)
            elif inner is None:
                answer = JSONResponse(error_body(self.refusal or "not started", "NotFound", 404), 404)
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
        # vllm-static: what the workers compiled in, read as they read it
        declared = serve_declaration(vllm_config.additional_config or {}, _compat.n_layers(model_config))
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
        model: Any
        if declared is None:
            model = VllmModel(model_config.model, options)
            await model.serve_engine(engine)
        else:  # vllm-static: the workers compiled the declared taps and the SAEs in
            model = load_model(
                model_config.model,
                backend="vllm-static",
                static_points=list(declared.points),
                static_writes=list(declared.writes),
                static_write_slots=declared.slots - 1,
                static_sae_top_k=declared.sae_top_k,
                static_sae_dense_max=declared.sae_dense_max,
                **options,
            )
            model.declare_how = SERVE_STATIC_HOW
            for name, entry in declared.saes.items():
                model.attach_sae(name, load_sae(entry.path))
            await model.serve_engine(engine)
        try:
            for name, path in dict(config.get("saes") or {}).items() if declared is None else ():
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
        wrap_generate(self, engine)
        self._interp_app = interp_app(self, model)
        self.refusal = None
        logger.info(
            "interp-engine: serving %s with %d preset(s) and %d SAE(s)%s",
            model_config.model,
            len(self.presets),
            len(model.saes),
            "" if declared is None else f", compiled taps {list(declared.points)}, writes {list(declared.writes)}",
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
        """Whether an ``/interp`` request may pass (:func:`~._routes.authorized`)."""
        return authorized(self.api_keys, scope)

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
    def _call_of(self, request: Any) -> Call | None:
        """The request's steering (its ``interp`` field, ``vllm_xargs["interp"]``, or its model
        name's preset), or ``None``; :class:`~._requests.Refused` when it cannot be served."""
        return call_of(request, self.presets, self.base_names, self.refusal)


def plugin_enabled() -> bool:
    """Whether ``VLLM_PLUGINS`` lets vLLM load this plugin (its default: no endpoint plugin)."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and NAME in [n.strip() for n in names.split(",")]
