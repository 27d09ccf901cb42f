"""A request's ``interp`` fields on vLLM's routes, read into a :class:`Call` before it reaches the
engine: steering (the body's ``interp``, ``vllm_xargs["interp"]`` or the model name's preset),
feature readouts and the lens, points at a few positions; :class:`Refused` (answered ``400``)
when they cannot be served."""

from __future__ import annotations

import contextvars
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from interp_engine import InterpError, InvalidOption, InvalidSteering, SteeringSpec
from interp_engine.chat import is_span_name

from ._answers import Steps

FIELD = "interp"
"""The request field (and ``vllm_xargs`` entry) that carries a request's steering."""
INTERP_FIELDS = ("steering", "features", "lens", "points", "positions")
"""What a request's ``interp`` object may hold on vLLM's routes."""


class Refused(Exception):
    """A request's ``interp`` fields refused before it reached the engine (answered ``400``)."""

    def __init__(self, error: InterpError, param: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.param = param


class LimitExceeded(InvalidOption):
    """A request asking for more than the server's bound (``valid``: the bound)."""

    def __init__(self, message: str, *, valid: int) -> None:
        super().__init__(message)
        self.valid = valid


@dataclass(frozen=True)
class Call:
    """What a route handler hands to the engine's ``generate`` for one HTTP request."""

    spec: SteeringSpec | None
    field: str
    messages: list[Any] | None = None
    chat_options: Mapping[str, Any] | None = None
    features: tuple[Any, ...] = ()
    lens: Mapping[str, Any] | None = None
    points: tuple[str, ...] = ()
    positions: Any = None
    steps: Steps | None = None


CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("interp_vllm_call", default=None)


def call_of(
    request: Any, presets: Mapping[str, SteeringSpec], base_names: tuple[str, ...], refusal: str | None
) -> Call | None:
    """The request's steering (its ``interp`` field, ``vllm_xargs["interp"]``, or its model
    name's preset), or ``None``; :class:`Refused` when it cannot be served."""
    extra = request.model_extra if isinstance(getattr(request, "model_extra", None), dict) else {}
    given = extra.pop(FIELD, None)
    xargs = getattr(request, "vllm_xargs", None)
    if isinstance(xargs, dict) and FIELD in xargs:
        text = xargs.pop(FIELD)
        if given is not None:
            raise Refused(InvalidSteering("send interp in the body or in vllm_xargs, not both"), "vllm_xargs.interp")
        try:
            given = json.loads(text) if isinstance(text, str) else text
        except ValueError as exc:
            raise Refused(InvalidSteering(f"vllm_xargs.interp is not JSON: {exc}"), "vllm_xargs.interp") from None
    preset = presets.get(getattr(request, "model", None) or "")
    if given is None and preset is None:
        return None
    if refusal is not None:
        raise Refused(InvalidOption(refusal), FIELD)
    spec = preset
    features: tuple[Any, ...] = ()
    lens: dict[str, Any] | None = None
    points: tuple[str, ...] = ()
    positions: Any = None
    if given is not None:
        if not isinstance(given, dict) or set(given) - set(INTERP_FIELDS):
            raise Refused(
                InvalidOption(
                    f"interp is an object with the fields {', '.join(INTERP_FIELDS)}; got {_keys(given)} "
                    "(whole captures: the /interp/v1 routes)"
                ),
                FIELD,
            )
        try:
            asked = SteeringSpec.from_dict(given.get("steering") or [])
        except InterpError as exc:
            raise Refused(exc, f"{FIELD}.steering") from None
        spec = asked if preset is None else SteeringSpec([*preset.writes, *asked.writes])
        features, lens = readouts_asked(given)
        points, positions = points_asked(given)
    if preset is not None:
        request.model = base_names[0]
    if spec is not None and not spec.writes:
        spec = None
    if spec is None and not features and lens is None and not points:
        return None
    steps = None
    if features or lens is not None or points:
        if int(getattr(request, "n", 1) or 1) != 1 or getattr(request, "use_beam_search", False):
            raise Refused(
                InvalidOption("readouts, points and the lens are read for one completion (n=1, no beam search)"),
                FIELD,
            )
        steps = Steps(per_token=bool(features) or lens is not None)
    messages = getattr(request, "messages", None)
    options = None
    if messages is not None:
        options = {
            "add_generation_prompt": bool(getattr(request, "add_generation_prompt", True)),
            **dict(getattr(request, "chat_template_kwargs", None) or {}),
        }
        if getattr(request, "continue_final_message", False) or getattr(request, "chat_template", None):
            options = None  # the model's own template, as vLLM renders it, is the only one spans are read in
    return Call(
        spec,
        f"{FIELD}.steering",
        list(messages) if messages is not None else None,
        options,
        features=features,
        lens=lens,
        points=points,
        positions=positions,
        steps=steps,
    )


def readouts_asked(given: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The ``features`` (readout strings such as ``"features:res:top8"``) and ``lens`` (``{"layers":
    [...], "top_k": k}``) of an ``interp`` object."""
    features = given.get("features") or ()
    if isinstance(features, str) or not isinstance(features, (list, tuple)):
        raise Refused(
            InvalidOption("interp.features is a list of readouts such as 'features:res:top8'"), f"{FIELD}.features"
        )
    lens = given.get("lens")
    if lens is not None and not isinstance(lens, dict):
        raise Refused(InvalidOption("interp.lens is an object: {'layers': [...], 'top_k': k}"), f"{FIELD}.lens")
    if lens is not None and "positions" in lens:
        raise Refused(
            InvalidOption("interp.lens reads the generated tokens here; the prompt's lens: /interp/v1/generate"),
            f"{FIELD}.lens",
        )
    return tuple(features), lens


def points_asked(given: Mapping[str, Any]) -> tuple[tuple[str, ...], Any]:
    """The ``points`` (address strings) and ``positions`` (ints, ``"prompt"`` or a chat span name)
    of an ``interp`` object, checked for shape (what they name is checked against the prompt)."""
    points, positions = given.get("points"), given.get("positions")
    if points is None:
        if positions is not None:
            refused = InvalidOption("interp.positions selects the positions of interp.points")
            raise Refused(refused, f"{FIELD}.positions")
        return (), None
    if not isinstance(points, list) or not points or not all(isinstance(p, str) for p in points):
        raise Refused(
            InvalidOption(
                "interp.points is a non-empty list of addresses such as 'resid_post.1' (feature readouts: "
                "interp.features)"
            ),
            f"{FIELD}.points",
        )
    if positions is None:
        raise Refused(
            InvalidOption(
                "interp.points needs interp.positions, the few positions to read (ints, 'prompt' or a chat span "
                "name); whole captures: /interp/v1/capture_generation"
            ),
            f"{FIELD}.positions",
        )
    if isinstance(positions, str):
        if positions != "prompt" and not is_span_name(positions):
            raise Refused(
                InvalidOption(
                    f"interp.positions is a list of positions (ints from 0), 'prompt' or a chat span name such as "
                    f"'user[-1].last', got {positions!r:.60}"
                ),
                f"{FIELD}.positions",
            )
    elif (
        not isinstance(positions, list)
        or not positions
        or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions)
    ):
        raise Refused(
            InvalidOption(
                "interp.positions is a non-empty list of positions counted from the prompt's first token (ints from "
                "0: the length of a generation is not known before it ends), 'prompt' or a chat span name"
            ),
            f"{FIELD}.positions",
        )
    return tuple(points), positions


def _keys(value: Any) -> str:
    return repr(sorted(value)[:8]) if isinstance(value, dict) else f"a {type(value).__name__}"
