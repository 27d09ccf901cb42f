"""The HTTP server's app factory: :func:`create_app` builds a FastAPI app over any backend's async
model, loading it (or taking it) in the app's lifespan, and installs the middleware (the guard's
bounds, metrics), the error handlers that give every failure one JSON shape, and the routes.

The app only awaits the model's protocol methods, so it serves ``eager``, ``vllm`` and
``vllm-static`` models alike; on vLLM, concurrent requests are batched by the engine. SAEs
attached to the model (``load_model(..., saes=...)``, ``interp serve --sae NAME=PATH``) give
feature readouts in ``points`` and ``features``, and feature writes in steering specs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .._errors import InterpError, InvalidOption
from .._plugins import load_model
from ..protocol._protocol import InterpModel
from ._convert import Served
from ._errors import ApiError, ClientGone, SafeJSONResponse, elide, field_path, from_interp
from ._guard import ERROR_SCOPE_KEY, Guard, check_api_key
from ._json import StrictRoute
from ._limits import ServerLimits
from ._metrics import Metrics, MetricsMiddleware
from ._openai import add_completions, add_models
from ._routes import add_routes

logger = logging.getLogger("interp_engine.server")


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
    served = Served(limits or ServerLimits(), trust_request_chat_template)
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
            served.created = int(time.time())
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
        version=__version__,
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
    add_routes(app, served)
    add_completions(app, served)
    add_models(app, served)
    return app


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
