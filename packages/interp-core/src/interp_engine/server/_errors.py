"""How errors become HTTP responses: one JSON shape, ``{"error", "message", "field", "valid"}``.

- request bodies that do not fit the schema (pydantic): ``422``, ``error: "ValidationError"``;
- the core's typed input errors (``InvalidAddress``, ``InvalidTokens``, ``InvalidSteering``,
  ``InvalidActivations``, ``InvalidOption``, and for SAEs ``UnknownSae`` -- no SAE attached under
  that name, ``valid`` the attached ones -- ``InvalidFeatures`` and ``UnsupportedSae``): ``400``,
  ``error`` is the type's name (an unknown SAE is a 400 like an unknown address, not a 404);
- a :class:`ServerLimits` bound exceeded: ``413``, ``error: "LimitExceeded"``;
- ``ModelClosed`` or a model not loaded yet: ``503``; ``BackendError`` and anything else: ``500``
  (no traceback is sent; the server logs it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from .._errors import (
    InterpError,
    InvalidActivations,
    InvalidAddress,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    ModelClosed,
    UnknownSae,
    UnsupportedArchitecture,
    UnsupportedSae,
)

_CLIENT_ERRORS = (
    InvalidAddress,
    InvalidTokens,
    InvalidSteering,
    InvalidActivations,
    InvalidOption,
    UnsupportedArchitecture,
    UnknownSae,
    InvalidFeatures,
    UnsupportedSae,
)


class ApiError(HTTPException):
    """An error response with the server's JSON body. It is an ``HTTPException`` so that it
    passes through FastAPI's body parsing (the body-size limit raises it while reading)."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None, valid: Any = None) -> None:
        super().__init__(status_code=status, detail=message)
        self.error = error
        self.message = message
        self.field = field
        self.valid = valid

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        if self.valid is not None:
            out["valid"] = self.valid
        return out

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


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


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "steering", "writes", 0, "op")`` -> ``"steering.writes[0].op"`` (the tags of
    the schema's unions, ``"<feature_write>"``, are left out)."""
    out = ""
    for part in loc:
        if (part == "body" and not out) or (isinstance(part, str) and part.startswith("<")):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
