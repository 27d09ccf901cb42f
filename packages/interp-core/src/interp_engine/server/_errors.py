"""How errors become HTTP responses: one JSON shape, ``{"error", "message", "field", "valid"}``.

- request bodies that do not fit the schema (pydantic): ``422``, ``error: "ValidationError"``;
- the core's typed input errors (``InvalidAddress``, ``InvalidTokens``, ``InvalidSteering``,
  ``InvalidActivations``, ``InvalidOption``, ``UnsupportedOperation``, ``InvalidChat`` (and its
  ``NoChatTemplate``: bad messages, a template that raises, a model without one), and for SAEs ``UnknownSae``
  -- no SAE attached under that name, ``valid`` the attached ones -- ``InvalidFeatures`` and
  ``UnsupportedSae``): ``400``,
  ``error`` is the type's name (an unknown SAE is a 400 like an unknown address, not a 404);
- a :class:`ServerLimits` bound exceeded: ``413``, ``error: "LimitExceeded"``; a request whose
  captured values exceed the backend's capture memory cap: ``413``, ``error: "CaptureMemoryExceeded"``;
- ``ModelClosed`` or a model not loaded yet: ``503``; ``BackendError`` and anything else: ``500``
  (no traceback is sent; the server logs it).

Every body is bounded: a message, a field path or a ``valid`` entry longer than a few hundred
characters is elided in the middle (an 8 MB address gives a short error, not an 8 MB one), and
bodies are written as ASCII JSON with no ``NaN`` (a lone surrogate echoed back cannot break them).

The errors a model call raises name the request field at fault (:class:`FieldBlame`); a client
that closed its connection is :class:`ClientGone` (logged as ``499``, nothing is sent).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from .._errors import (
    CaptureMemoryExceeded,
    InterpError,
    InvalidActivations,
    InvalidAdapter,
    InvalidAddress,
    InvalidChat,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    ModelClosed,
    UnknownAdapter,
    UnknownSae,
    UnsupportedAddress,
    UnsupportedArchitecture,
    UnsupportedOperation,
    UnsupportedSae,
)
from ..addresses._address import Address
from ..sae._readouts import Features
from ..steering._spec import SteeringSpec, Write

logger = logging.getLogger("interp_engine.server")

_CLIENT_ERRORS = (
    InvalidAdapter,
    UnknownAdapter,
    InvalidAddress,
    InvalidTokens,
    InvalidSteering,
    InvalidActivations,
    InvalidOption,
    InvalidChat,
    UnsupportedArchitecture,
    UnknownSae,
    InvalidFeatures,
    UnsupportedSae,
    UnsupportedOperation,
)


MAX_TEXT = 400
"""Longest message, field or ``valid`` entry an error body carries (longer ones are elided)."""
MAX_VALID = 100
"""Most ``valid`` entries an error body lists."""


def elide(text: str, limit: int = MAX_TEXT) -> str:
    """``text``, its middle replaced by ``...(N characters)...`` when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 20)
    return f"{text[: keep * 3 // 4]}...({len(text)} characters)...{text[-(keep // 4) :]}"


def bounded(value: Any) -> Any:
    """A JSON value with every string elided and lists cut at :data:`MAX_VALID` entries."""
    if isinstance(value, str):
        return elide(value)
    if isinstance(value, (list, tuple)):
        items = [bounded(v) for v in list(value)[:MAX_VALID]]
        return [*items, f"...({len(value) - MAX_VALID} more)"] if len(value) > MAX_VALID else items
    if isinstance(value, dict):
        return {elide(str(k), 100): bounded(v) for k, v in list(value.items())[:MAX_VALID]}
    if value is None or isinstance(value, (bool, int)):
        return value if not isinstance(value, int) or abs(value) < 2**63 else elide(str(value), 60)
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return elide(str(value))


class SafeJSONResponse(JSONResponse):
    """JSON as ASCII (a lone surrogate is written as its escape, not an encoding error), and never
    ``NaN`` or ``Infinity`` (not JSON: the server checks results before and refuses them)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ApiError(HTTPException):
    """An error response with the server's JSON body. It is an ``HTTPException`` so that it
    passes through FastAPI's body parsing (the body-size limit raises it while reading)."""

    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        *,
        field: str | None = None,
        valid: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = elide(message)
        super().__init__(status_code=status, detail=message, headers=dict(headers) if headers else None)
        self.error = error
        self.message = message
        self.field = None if field is None else elide(field, 200)
        self.valid = None if valid is None else bounded(valid)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        if self.valid is not None:
            out["valid"] = self.valid
        return out

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def limit_exceeded(field: str, message: str, limit: int) -> ApiError:
    return ApiError(413, "LimitExceeded", f"{message} (the server's limit is {limit})", field=field, valid=limit)


def _json_valid(valid: Any) -> Any:
    if valid is None or (isinstance(valid, (str, Sequence)) and len(valid) == 0):
        return None
    if isinstance(valid, str):
        return valid
    if isinstance(valid, Sequence):
        return [str(v) for v in valid]
    return str(valid)


def status_of(exc: InterpError) -> int:
    if isinstance(exc, _CLIENT_ERRORS):
        return 400
    if isinstance(exc, CaptureMemoryExceeded):  # one request's values larger than the whole cap
        return 413
    if isinstance(exc, ModelClosed):
        return 503
    return 500


def from_interp(exc: InterpError, field: str | None = None) -> ApiError:
    """The response for one of the core's errors, naming ``field`` when the caller knows it."""
    status = status_of(exc)
    return ApiError(
        status,
        type(exc).__name__,
        str(exc),
        field=field if status == 400 else None,
        valid=_json_valid(getattr(exc, "valid", None)),
    )


@contextmanager
def blame(fields: Mapping[type[InterpError], str]) -> Iterator[None]:
    """Turn the core's errors raised inside into :class:`ApiError`, naming the request field
    the first matching type in ``fields`` points at."""
    try:
        yield
    except InterpError as exc:
        field = next((name for cls, name in fields.items() if isinstance(exc, cls)), None)
        raise from_interp(exc, field) from exc


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class FieldBlame:
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


_MODEL_LABELS = frozenset({"EncodedTensor", "FeaturesBody", "WriteBody", "FeatureWriteBody", "StreamOptions"})


def _is_union_label(part: str) -> bool:
    """A part of pydantic's error location that names a union member, not a field."""
    return part.startswith("<") or "[" in part or part in _MODEL_LABELS or part.startswith("function-")


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "steering", "writes", 0, "op")`` -> ``"steering.writes[0].op"`` (the tags of
    the schema's unions, ``"<feature_write>"``, are left out)."""
    out = ""
    for part in loc:
        if (part == "body" and not out) or (isinstance(part, str) and _is_union_label(part)):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
