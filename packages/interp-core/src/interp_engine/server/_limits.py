"""The bounds a server enforces on every request (plain data; no web framework imported)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server. Exceeding any bound is a ``413`` naming the field.

    Sizes are checked before any compute: a capture's result size is known from the prompt
    length, the points and the model's widths, so an oversized request never reaches the model.
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
    max_concurrent_requests: int = 256
    """Requests running on the model at once; later ones wait for a free slot (a stream holds
    its slot until it ends or its client goes away)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerLimits.{f.name} must be a positive int, got {value!r}")
