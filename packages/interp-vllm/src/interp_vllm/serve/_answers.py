"""What the ``vllm serve`` plugin adds to vLLM's answers: each generated token's readouts and
lens (:class:`Steps`, one :func:`step` per token) and the points asked for
(:func:`points_answer`), under ``interp`` in the body or in each stream chunk
(:func:`with_steps`)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import torch

from interp_engine import Address


class Steps:
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
        return finite(out) if out else None

    def whole(self) -> dict[str, Any]:
        """The ``interp`` object of a whole answer."""
        out: dict[str, Any] = {"steps": self.take()} if self.per_token else {}
        if self.points is not None:
            out.update(self.points)
        return dict(finite(out))


def step(position: int, features: Mapping[Any, Any], lens: Any, checked: Any, tokenizer: Any) -> dict[str, Any]:
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


def points_answer(checked: Any, values: Mapping[Address, Any], positions: list[int]) -> dict[str, Any]:
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


def finite(value: Any) -> Any:
    """JSON data (dicts, lists, numbers) with every inf or NaN as ``None`` (JSON has neither)."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def with_steps(response: Any, steps: Steps) -> Any:
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
