"""Sampling defaults from the checkpoint: what its ``generation_config.json`` recommends
(:class:`RecommendedSampling`) and what a call that leaves a knob unset runs with
(:class:`SamplingSettings`, :func:`resolve_sampling`).

These decide the sampling of the public ``interp-engine`` package's generation methods
(``generate_text``, ``generate_stream``, ``capture_generation_stream``): a knob passed is used as
passed, a knob left ``None`` takes the checkpoint's value, and one neither states is neutral
(temperature 1, no top-k or top-p filtering, no presence penalty); ``do_sample: false`` in the file
recommends greedy decoding (temperature 0). ``generate``, ``stream`` and ``capture_generation``
keep their own rule: greedy unless sampling options are passed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidOption
from ..steering._values import finite_float, short_repr

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class RecommendedSampling:
    """The sampling a checkpoint's ``generation_config.json`` states (``None``: not stated, or
    stated as off -- ``top_k`` 0, ``top_p`` 1). ``do_sample`` ``False`` recommends greedy decoding."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None
    source: str | None = None
    """Where it was read (the file's path, or ``"generation_config"`` for a loaded model's own);
    ``None``: the checkpoint has none."""

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any], source: str | None) -> RecommendedSampling:
        """The recommendation in a generation config's fields (unknown fields ignored)."""
        temperature = finite_float(config.get("temperature"))
        top_k = config.get("top_k")
        top_p = finite_float(config.get("top_p"))
        do_sample = config.get("do_sample")
        return cls(
            temperature=temperature,
            top_k=top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None,
            top_p=top_p if top_p is not None and 0 < top_p < 1 else None,
            do_sample=do_sample if isinstance(do_sample, bool) else None,
            source=source,
        )

    @classmethod
    def read(cls, folder: str | os.PathLike[str] | None) -> RecommendedSampling:
        """The recommendation in ``folder/generation_config.json`` (empty when there is none)."""
        if folder is None:
            return cls()
        path = os.path.join(os.fspath(folder), GENERATION_CONFIG)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return cls()
        return cls.from_mapping(data, path) if isinstance(data, dict) else cls()

    @property
    def is_empty(self) -> bool:
        """No knob is stated."""
        return (self.temperature, self.top_k, self.top_p, self.do_sample) == (None, None, None, None)


@dataclass(frozen=True)
class SamplingSettings:
    """What a generation runs with, every knob decided (``top_k``/``top_p`` ``None``: no
    filtering; ``temperature`` 0: greedy; ``presence_penalty`` 0: none)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    presence_penalty: float

    def options(self) -> dict[str, Any]:
        """These settings as the sampling keyword arguments of ``generate``, ``stream`` and
        ``capture_generation`` (vLLM's names; only what differs from greedy decoding's defaults)."""
        out: dict[str, Any] = {"temperature": self.temperature}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        return out

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
        }


def resolve_sampling(
    recommended: RecommendedSampling,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    presence_penalty: float | None = None,
) -> SamplingSettings:
    """Every knob decided: the caller's value, else the checkpoint's, else the neutral one.
    ``top_k=0`` and ``top_p=1.0`` turn a recommended filter off."""
    if temperature is None:
        greedy = recommended.do_sample is False
        temperature = 0.0 if greedy else (1.0 if recommended.temperature is None else recommended.temperature)
    number = finite_float(temperature)
    if number is None or number < 0:
        raise InvalidOption(f"temperature must be a number >= 0 (0 = greedy), got {short_repr(temperature)}")
    if top_k is None:
        top_k = recommended.top_k
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidOption(f"top_k must be an int >= 0 (0 = off), got {short_repr(top_k)}")
    if top_p is None:
        top_p = recommended.top_p
    else:
        p = finite_float(top_p)
        if p is None or not 0 < p <= 1:
            raise InvalidOption(f"top_p must be in (0, 1], got {short_repr(top_p)}")
        top_p = p
    penalty = 0.0 if presence_penalty is None else finite_float(presence_penalty)
    if penalty is None:
        raise InvalidOption(f"presence_penalty must be a finite number, got {short_repr(presence_penalty)}")
    return SamplingSettings(
        temperature=number,
        top_k=None if top_k is None or top_k == 0 else int(top_k),
        top_p=None if top_p is None or top_p >= 1.0 else float(top_p),
        presence_penalty=penalty,
    )
