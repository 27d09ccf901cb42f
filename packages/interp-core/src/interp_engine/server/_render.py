"""How the server writes its answers: the models' results as JSON (steps, completions, the lens,
chat spans, tensors and feature readouts), the refusal of results holding inf or NaN, server-sent
events, and the error responses each route documents in the OpenAPI schema."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..chat import ChatTokens
from ..protocol._protocol import Completion, StreamStep
from ..results._lens import LensResult, LensTopK
from ..sae._readouts import FeatureReadout
from ..steering._spec import SteeringSpec
from ._errors import ApiError
from ._schemas import ErrorOut
from ._tensors import SAFETENSORS, encode, readout_out, safetensors_response

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut, "description": text}
    for code, text in (
        (400, "the model rejected the input (InvalidAddress, InvalidTokens, InvalidSteering, UnknownSae, ...)"),
        (413, "a ServerLimits bound was exceeded"),
        (422, "the body does not fit the schema"),
        (503, "the model is not loaded or was shut down"),
    )
}
TENSOR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {"content": {SAFETENSORS: {}}, "description": "JSON, or a safetensors Cache file when asked"},
}


def json_text(data: Any) -> str:
    """``data`` as the ASCII JSON of an event stream's ``data:`` line (no ``NaN``)."""
    return json.dumps(data, ensure_ascii=True, allow_nan=False)


def sse_event(name: str, data: Any) -> str:
    """A named server-sent event."""
    return f"event: {name}\ndata: {json_text(data)}\n\n"


def check_finite_steps(steps: Sequence[StreamStep], spec: SteeringSpec | None) -> None:
    """Refuse generated steps holding inf or NaN: first the logprobs and lens of every step,
    then their feature readouts."""
    for step in steps:
        if not all(math.isfinite(lp) for _, lp in step.logprobs):
            raise non_finite("the logprobs of a generated token", spec)
        lenses = [lens.probs for lens in (step.lens, step.prompt_lens) if lens is not None]
        if not all(bool(torch.isfinite(probs).all()) for probs in lenses):
            raise non_finite("the logit lens probabilities", spec)
    for step in steps:
        if step.features:
            check_finite({}, {str(k): v for k, v in step.features.items()}, spec)


def non_finite(what: str, spec: Any, *, decoding: bool = False) -> ApiError:
    """The error for a result holding ``inf`` or ``NaN`` (not JSON), naming the likely cause."""
    if decoding:
        return ApiError(
            400,
            "InvalidActivations",
            f"{what} hold inf or NaN: the activations overflow float32 through the final norm and unembedding",
            field="activations",
        )
    if spec:
        return ApiError(
            400,
            "InvalidSteering",
            f"{what} hold inf or NaN under this request's steering: its writes overflow float32 activations "
            "(use a smaller scale or vector)",
            field="steering",
        )
    return ApiError(500, "BackendError", f"{what} hold inf or NaN (the model overflowed its dtype)")


def step_json(step: StreamStep) -> dict[str, Any]:
    out = {
        "token_id": step.token_id,
        "text": step.text,
        "logprobs": [list(pair) for pair in step.logprobs],
        "position": step.position,
    }
    if step.features:
        out["features"] = {str(spec): readout_out(readout) for spec, readout in step.features.items()}
    return out


def chat_out(chat: ChatTokens) -> dict[str, Any]:
    """What the positions of a chat prompt mean (the answer's ``chat``)."""
    return {
        "messages": [span.to_json() for span in chat.messages],
        "reasoning": [span.to_json() for span in chat.reasoning],
        "generation_start": chat.generation_start,
        "text": chat.text,
    }


def lens_out(lens: LensTopK, to_str_tokens: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    """One step's lens as lists (``[n_layers][k]``), each id's text under ``tokens``."""
    ids = lens.ids.tolist()
    flat = [i for row in ids for i in row]
    return {
        "layers": list(lens.layers),
        "ids": ids,
        "probs": lens.probs.float().tolist(),
        "tokens": nest(to_str_tokens(flat) if flat else [], list(lens.ids.shape)),
    }


def lens_result_out(lens: LensResult, to_str_tokens: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    """The lens at several prompt positions as lists (``[n_layers][n_positions][k]``)."""
    flat = lens.ids.reshape(-1).tolist()
    return {
        "layers": list(lens.layers),
        "positions": list(lens.positions),
        "ids": lens.ids.tolist(),
        "probs": lens.probs.float().tolist(),
        "tokens": nest(to_str_tokens(flat) if flat else [], list(lens.ids.shape)),
    }


def tensor_of(value: torch.Tensor | FeatureReadout) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ApiError(500, "BackendError", f"the backend returned a {type(value).__name__} for an address")
    return value


def readout_of(value: torch.Tensor | FeatureReadout) -> FeatureReadout:
    if not isinstance(value, FeatureReadout):
        raise ApiError(500, "BackendError", f"the backend returned a {type(value).__name__} for a feature readout")
    return value


def completion_out(completion: Completion) -> dict[str, Any]:
    return {"token_ids": list(completion.token_ids), "text": completion.text, "finish_reason": completion.finish_reason}


def finish_reason(n_steps: int, max_tokens: int) -> str:
    # a stream says nothing about why it ended: short of max_tokens means an end-of-sequence token
    return "length" if n_steps >= max_tokens else "stop"


def nest(flat: list[Any], shape: Sequence[int]) -> list[Any]:
    """A flat list reshaped into nested lists of ``shape``."""
    if len(shape) <= 1:
        return flat
    step = math.prod(shape[1:])
    return [nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def check_finite(tensors: Mapping[str, torch.Tensor], readouts: Mapping[str, FeatureReadout], steered: Any) -> None:
    """Refuse results holding inf or NaN, naming the first such point and the likely cause."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise non_finite(f"the activations at {name}", steered)
    for name, readout in readouts.items():
        parts = [readout.values] + ([readout.error_norm] if readout.error_norm is not None else [])
        if not all(bool(torch.isfinite(t).all()) for t in parts):
            raise non_finite(f"the feature readout {name}", steered)


@dataclass(frozen=True)
class TensorFormat:
    """How an answer holding tensors is written: JSON, or with ``safetensors`` a safetensors
    Cache file (``n_layers``, the model's, in its metadata)."""

    safetensors: bool
    n_layers: int | None = None


async def tensor_body(
    format: TensorFormat,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    head: dict[str, Any],
    n_tokens: int,
    readouts: Mapping[str, FeatureReadout] | None = None,
    *,
    steered: Any = None,
) -> Any:
    """The answer holding ``tensors`` (under ``key``) and ``readouts`` (under ``features``) after
    ``head``, in ``format``. Values holding inf or NaN are refused first (:func:`check_finite`).
    Checking and serialising megabytes of values runs on a worker thread, not on the serving loop."""
    await asyncio.to_thread(check_finite, tensors, readouts or {}, steered)
    if format.safetensors:
        return await asyncio.to_thread(safetensors_response, tensors, n_tokens, head, readouts, format.n_layers)
    encoded = await asyncio.to_thread(lambda: {name: encode(t) for name, t in tensors.items()})
    if readouts is None:
        return {**head, key: encoded}
    listed = await asyncio.to_thread(lambda: {name: readout_out(r) for name, r in readouts.items()})
    return {**head, key: encoded, "features": listed}
