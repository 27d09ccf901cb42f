"""Prometheus metrics at ``GET /metrics``, in the text exposition format (written here: no
dependency). Names follow Prometheus's conventions, prefixed ``interp_``:

- ``interp_requests_total{endpoint, status}`` and ``interp_request_errors_total{endpoint, error}``
  (``error`` the error type of the body: ``LayerOutOfRange``, ``LimitExceeded``, ``Unauthorized``...);
- ``interp_request_duration_seconds{endpoint}``, a histogram of the time to the end of the response
  (a stream's whole length);
- ``interp_requests_in_flight`` (requests being served), ``interp_requests_queued`` (waiting for a
  slot), ``interp_slots_in_use`` and ``interp_slots_total`` (requests on the model);
- ``interp_prompt_tokens_total`` and ``interp_generation_tokens_total`` (tokens run by the model).

``endpoint`` is a route's path (``/v1/capture``; a route with a path parameter, its template:
``/v1/models/{model:path}``); a path the app does not serve counts as ``other``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._guard import ERROR_SCOPE_KEY

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the latency histogram's buckets."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """The counters, gauges and histograms of one app."""

    def __init__(self, paths: Callable[[], Collection[str]]) -> None:
        self._paths = paths
        self.requests: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.errors: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.buckets: defaultdict[str, list[int]] = defaultdict(lambda: [0] * len(BUCKETS))
        self.latency_sum: defaultdict[str, float] = defaultdict(float)
        self.latency_count: defaultdict[str, int] = defaultdict(int)
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def endpoint(self, path: str) -> str:
        return path if path in self._paths() else "other"

    def observe(self, endpoint: str, status: int, error: str | None, seconds: float) -> None:
        self.requests[endpoint, str(status)] += 1
        if error is not None:
            self.errors[endpoint, error] += 1
        counts = self.buckets[endpoint]
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self.latency_sum[endpoint] += seconds
        self.latency_count[endpoint] += 1

    def count_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated

    def render(self, *, queued: int, slots_in_use: int, slots_total: int) -> str:
        out: list[str] = []

        def family(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        family("interp_requests_total", "counter", "HTTP requests answered, by endpoint and status code.")
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(f'interp_requests_total{{endpoint="{_label(endpoint)}",status="{status}"}} {n}')
        family("interp_request_errors_total", "counter", "Error responses, by endpoint and error type.")
        for (endpoint, error), n in sorted(self.errors.items()):
            out.append(f'interp_request_errors_total{{endpoint="{_label(endpoint)}",error="{_label(error)}"}} {n}')
        family("interp_request_duration_seconds", "histogram", "Time from a request's start to its response's end.")
        for endpoint in sorted(self.latency_count):
            label = f'endpoint="{_label(endpoint)}"'
            for bound, n in zip(BUCKETS, self.buckets[endpoint], strict=True):
                out.append(f'interp_request_duration_seconds_bucket{{{label},le="{bound}"}} {n}')
            count = self.latency_count[endpoint]
            out.append(f'interp_request_duration_seconds_bucket{{{label},le="+Inf"}} {count}')
            out.append(f"interp_request_duration_seconds_sum{{{label}}} {self.latency_sum[endpoint]:.6f}")
            out.append(f"interp_request_duration_seconds_count{{{label}}} {count}")
        gauges = (
            ("interp_requests_in_flight", "Requests being served now.", self.in_flight),
            ("interp_requests_queued", "Requests waiting for a slot on the model.", queued),
            ("interp_slots_in_use", "Requests running on the model now.", slots_in_use),
            ("interp_slots_total", "Requests the model may run at once (max_concurrent_requests).", slots_total),
        )
        for name, text, value in gauges:
            family(name, "gauge", text)
            out.append(f"{name} {value}")
        family("interp_prompt_tokens_total", "counter", "Prompt tokens run by the model.")
        out.append(f"interp_prompt_tokens_total {self.prompt_tokens}")
        family("interp_generation_tokens_total", "counter", "Tokens generated by the model.")
        out.append(f"interp_generation_tokens_total {self.generation_tokens}")
        return "\n".join(out) + "\n"


class MetricsMiddleware:
    """ASGI middleware (outermost): counts each HTTP request, its status, error type and time."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        self.metrics.in_flight += 1

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.in_flight -= 1
            error: Any = scope.get(ERROR_SCOPE_KEY)
            if error is None and status >= 400:
                error = "InternalError" if status >= 500 else f"HTTP{status}"
            route = getattr(scope.get("route"), "path", None)
            endpoint = self.metrics.endpoint(str(route or scope.get("path", "")))
            self.metrics.observe(endpoint, status, error, time.perf_counter() - start)
