"""The ``vllm serve`` plugin's HTTP side: vLLM's routes wrapped so a request's ``interp`` fields
are read before its handler runs (:func:`steered`) and presets are listed as models
(:func:`models_route`); the ``/interp`` app, interp serve's API over the same engine with the
routes that change presets and SAEs at run time (:func:`interp_app`), behind the server's API
keys (:func:`api_keys`, :func:`authorized`); errors in vLLM's shape (:func:`error_body`)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from fastapi import HTTPException, Request

from interp_engine import InterpError, InvalidOption, InvalidSteering, StaticConfigError, SteeringSpec, load_sae

from ._answers import with_steps
from ._requests import CALL, Call, Refused


class Plugin(Protocol):
    """What the routes use of the plugin: its API keys, its presets and how it reads a request's
    ``interp`` fields."""

    api_keys: tuple[str, ...]
    presets: dict[str, SteeringSpec]

    def set_preset(self, name: str, spec: Any) -> None: ...

    def drop_preset(self, name: str) -> bool: ...

    def _call_of(self, request: Any) -> Call | None: ...


def steered(endpoints: Plugin, endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's route handler ``endpoint``, with the request's ``interp`` fields read first and its
    answer carrying what they asked for."""

    async def steered(request: Any, raw_request: Request) -> Any:
        call = None
        try:
            call = endpoints._call_of(request)
        except Refused as exc:
            return refusal(exc)
        if call is None:
            return await endpoint(request, raw_request)
        token = CALL.set(call)
        try:
            response = await endpoint(request, raw_request)
        except Refused as exc:
            return refusal(exc)
        finally:
            CALL.reset(token)
        return response if call.steps is None else with_steps(response, call.steps)

    steered.__annotations__ = dict(getattr(endpoint, "__annotations__", {}))
    steered.__annotations__["raw_request"] = Request
    steered.__signature__ = _signature_of(endpoint)  # type: ignore[attr-defined]
    return steered


def models_route(endpoints: Plugin, endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``GET /v1/models`` handler ``endpoint``, with the presets listed as models."""

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


def interp_app(endpoints: Plugin, model: Any) -> Any:
    """interp serve's app over ``model``, with the preset and SAE routes of this server."""
    from interp_engine.server import create_app

    app = create_app(model)
    app.state.served.model = model  # a mounted app's lifespan never runs: the engine is already up

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
        sae = load_sae(body["path"])
        with compiled_in():
            if name in model.saes:
                model.detach_sae(name)  # a request in flight keeps the SAE it was checked with
            model.attach_sae(name, sae)
        return {"name": name, "saes": sorted(model.saes)}

    async def delete_sae(name: str) -> Any:
        check_key()
        with compiled_in():
            model.detach_sae(name)
        return {"name": name, "saes": sorted(model.saes)}

    app.add_api_route("/v1/presets", list_presets, methods=["GET"])
    app.add_api_route("/v1/workers", workers, methods=["GET"])
    app.add_api_route("/v1/saes/{name}", put_sae, methods=["PUT"])
    app.add_api_route("/v1/saes/{name}", delete_sae, methods=["DELETE"])
    app.add_api_route("/v1/presets/{name}", put_preset, methods=["PUT"])
    app.add_api_route("/v1/presets/{name}", delete_preset, methods=["DELETE"])
    return app


@contextlib.contextmanager
def compiled_in() -> Iterator[None]:
    """A server whose SAEs are compiled into its graph (``interp.static``) answers ``409`` to a
    change of them, with the reason."""
    try:
        yield
    except StaticConfigError as exc:
        raise HTTPException(409, str(exc)) from None


def api_keys(args: Any) -> tuple[str, ...]:
    """The keys vLLM's server takes: its ``--api-key`` values, else ``VLLM_API_KEY``."""
    given = getattr(args, "api_key", None)
    listed = [given] if isinstance(given, str) else list(given or ())
    if not listed:
        listed = [os.environ.get("VLLM_API_KEY", "")]
    return tuple(key for key in listed if key)


def authorized(keys: tuple[str, ...], scope: Any) -> bool:
    """Whether an ``/interp`` request may pass: the server has no API key, or it sends one of
    them as ``Authorization: Bearer KEY`` (vLLM's own check guards only its prefixes)."""
    if not keys or scope.get("path", "").endswith("/v1/health"):
        return True
    given = b""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            given = value
    scheme, _, key = given.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(key.encode()).digest()
    return any(hmac.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


def _signature_of(endpoint: Callable[..., Any]) -> Any:
    import inspect

    return inspect.signature(endpoint)


def error_body(message: str, kind: str, status: int, param: str | None = None, valid: Any = None) -> dict[str, Any]:
    """vLLM's error shape (``{"error": {...}}``), with the typed error's name and ``valid``."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": status}
    if valid is not None:
        error["valid"] = valid
    return {"error": error}


def refusal(exc: Refused) -> Any:
    from starlette.responses import JSONResponse

    valid = getattr(exc.error, "valid", None)
    if valid is not None and not isinstance(valid, (str, int, float, bool, list, dict)):
        valid = [str(v) for v in valid] if isinstance(valid, (tuple, set, frozenset)) else str(valid)
    return JSONResponse(error_body(str(exc.error), type(exc.error).__name__, 400, exc.param, valid), 400)
