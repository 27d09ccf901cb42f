"""The bounds a server enforces on every request (plain data; no web framework imported)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    """What one request (and one connection) may ask of the server. Exceeding a size bound is a
    ``413 LimitExceeded`` naming the field; the time bounds end in ``408 RequestTimeout`` (a
    request that does not arrive in time, then the connection is closed) or ``503 Overloaded``
    with ``Retry-After`` (no free slot in time, too many connections).

    Sizes are checked before any compute: a capture's result size is known from the prompt
    length, the points and the model's widths, so an oversized request never reaches the model;
    a text's length is checked before it is tokenized (and tokenizing runs off the event loop).
    The connection bounds (``max_connections``, ``header_timeout_s``, ``max_header_bytes``,
    ``keep_alive_s``) apply where uvicorn runs with :func:`~interp_engine.server.uvicorn_config`
    (``run`` and ``interp serve`` do).
    """

    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (Content-Length, or bytes actually received when chunked)."""
    max_prompt_tokens: int = 8192
    """Longest prompt (token ids given, or the tokenized text)."""
    max_new_tokens: int = 1024
    """Largest ``max_tokens`` of a generation."""
    max_points: int = 64
    """Most addresses in one capture (attention: most layers)."""
    max_activation_values: int = 16 * 1024 * 1024
    """Most float32 values one response may carry (64 MiB raw; a third more as base64)."""
    max_n_logprobs: int = 20
    """Most top-n logprobs per generated token."""
    max_writes: int = 64
    """Most writes in one steering spec."""
    max_messages: int = 256
    """Most chat messages in one prompt (their contents, with a ``chat_template`` override, count
    toward ``max_text_chars`` together)."""
    max_lens_layers: int = 64
    """Most layers one generation's ``lens`` reads."""
    max_lens_top_k: int = 20
    """Largest ``lens.top_k`` (tokens per layer and position)."""
    max_concurrent_requests: int = 256
    """Requests running on the model at once; later ones wait for a free slot (a stream holds
    its slot until it ends or its client goes away), at most ``queue_timeout_s``."""
    queue_timeout_s: float = 30.0
    """Longest wait for a free slot; then ``503 Overloaded`` with ``Retry-After``."""
    max_text_chars: int = 128 * 1024
    """Longest ``text`` (prompt or ``/v1/tokenize``), in characters, checked before tokenizing."""
    max_top_tokens: int = 64 * 1024
    """Most token strings one ``/v1/decode_residuals`` answer names (vectors x ``top_k``), and one
    generation's lens (positions read x layers x ``top_k``)."""
    max_connections: int = 512
    """Open connections at once; a connection beyond it gets ``503`` and is closed."""
    header_timeout_s: float = 10.0
    """Time for a request's line and headers to arrive, from the connection's start or the end of
    the previous response (then ``408`` and the connection is closed)."""
    max_header_bytes: int = 64 * 1024
    """Most bytes of a request's line and headers (then ``431`` and the connection is closed)."""
    body_timeout_s: float = 30.0
    """Time for a request's whole body to arrive, from the end of its headers (then ``408``)."""
    max_buffered_bytes: int = 256 * 1024 * 1024
    """Most bytes of request bodies still arriving, over every connection at once: a body that
    would pass it is ``503 Overloaded`` (slow partial bodies cannot hold the server's memory)."""
    keep_alive_s: float = 5.0
    """How long an idle keep-alive connection stays open between requests."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"ServerLimits.{f.name} must be a positive number of seconds, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerLimits.{f.name} must be a positive int, got {value!r}")
