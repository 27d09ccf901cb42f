"""Request bodies read as strict JSON: UTF-8, no ``NaN``/``Infinity`` (nor numbers that overflow
to them), bounded nesting, no lone surrogates. What fails is a ``422 ValidationError`` in the
server's error shape, never FastAPI's ``{"detail"}`` nor a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ._errors import ApiError

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects a body may have (the deepest schema needs 6)."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NESTING = re.compile(rb"[\[\]{}]")


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJson(f"the number {text[:40]} is beyond the range of a float")
    return value


def _invalid(message: str) -> ApiError:
    return ApiError(422, "ValidationError", f"body: {message}", field="body")


def _depth(body: bytes) -> int:
    """The deepest nesting of brackets outside strings (an upper bound counting brackets inside
    strings too, which only makes a string-heavy body look deeper: it is checked only when the
    bracket count could exceed the limit)."""
    depth = deepest = 0
    for match in _NESTING.finditer(body):
        if match.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _lone_surrogate(value: Any) -> str | None:
    """The first string (or key) in ``value`` with no UTF-8 form, walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return None


def parse_json(body: bytes) -> Any:
    """A request body as JSON, or a ``422`` naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"not UTF-8 text (an invalid byte at offset {exc.start})") from None
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        raise _invalid(f"nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except _NotJson as exc:
        raise _invalid(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of too many digits
        raise _invalid(f"not valid JSON ({str(exc)[:120]})") from None
    if _SURROGATE_ESCAPE.search(body):
        bad = _lone_surrogate(value)
        if bad is not None:
            raise _invalid("a string holds a lone surrogate (\\ud800-\\udfff unpaired), which is not Unicode text")
    return value


class StrictRequest(Request):
    """A request whose ``json()`` is :func:`parse_json`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictRoute(APIRoute):
    """The app's routes read their bodies with :class:`StrictRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(StrictRequest(request.scope, request.receive))

        return route
