"""What a backend receives: a request after the checks (:class:`CheckedRequest`), the sampling
options it carries and the lens it reads (:class:`CheckedLens`)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import (
    InvalidOption,
)
from ..addresses._address import Address
from ..results._lens import LensRequest
from ..sae._readouts import FeatureReadout, Features, read_features
from ..sae._sae import Sae
from ..steering._spec import AnyWrite
from ..steering._values import finite_float, short_repr
from ._protocol import Results

SAMPLING_OPTIONS = ("ignore_eos", "presence_penalty", "seed", "temperature", "top_k", "top_p")
"""The generation options every built-in backend takes (vLLM's names)."""


MIN_TEMPERATURE = 0.01
"""The smallest temperature sampling uses: a temperature in ``(0, 0.01)`` is raised to it (vLLM's
own rule), since logits divided by less overflow float32 and sampling from them is undefined."""
SEED_RANGE = (0, 2**64 - 1)
"""The seeds a generation takes (a 64-bit generator seed; ``None``: unseeded)."""


@dataclass(frozen=True)
class SamplingOptions:
    """How each generated token is chosen, in vLLM's names. The defaults are greedy decoding that
    stops at an end-of-sequence token."""

    temperature: float = 0.0
    """``0``: greedy (the default)."""
    top_k: int = 0
    """Keep the ``k`` most likely tokens; ``0``: off."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``p``; ``1``: off."""
    seed: int | None = None
    """Seed of this request's sampling (``None``: unseeded)."""
    ignore_eos: bool = False
    """``True``: generate exactly ``max_tokens``, past any end-of-sequence token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the generation has produced so far, before the
    temperature and before a greedy argmax (vLLM's rule); ``0``: none. From -2 to 2."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], allowed: Collection[str] = SAMPLING_OPTIONS) -> SamplingOptions:
        """Checked options from a call's ``**sampling``; a name outside ``allowed`` (a subset of
        :data:`SAMPLING_OPTIONS`) or a bad value raises ``InvalidOption`` (never silently dropped)."""
        allowed = set(allowed) & set(SAMPLING_OPTIONS)
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise InvalidOption(
                f"unknown generation option(s) {', '.join(unknown)}; valid: {', '.join(sorted(allowed)) or '(none)'}"
            )
        options = cls(**kwargs)
        temperature = finite_float(options.temperature)
        if temperature is None or temperature < 0:
            raise InvalidOption(
                f"temperature must be a number >= 0 (0 = greedy), got {short_repr(options.temperature)}"
            )
        top_k = options.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
            raise InvalidOption(f"top_k must be an int >= 0 (0 = off), got {short_repr(top_k)}")
        top_p = finite_float(options.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise InvalidOption(f"top_p must be in (0, 1], got {short_repr(options.top_p)}")
        seed = options.seed
        if seed is not None and (
            isinstance(seed, bool)
            or not isinstance(seed, numbers.Integral)
            or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]
        ):
            raise InvalidOption(f"seed must be an int from 0 to 2**64 - 1, or None; got {short_repr(seed)}")
        penalty = finite_float(options.presence_penalty)
        if penalty is None or not -2 <= penalty <= 2:
            raise InvalidOption(
                f"presence_penalty must be a number from -2 to 2 (0 = none), got {short_repr(options.presence_penalty)}"
            )
        if not isinstance(options.ignore_eos, bool):
            raise InvalidOption(f"ignore_eos must be True or False, got {short_repr(options.ignore_eos)}")
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        return dataclasses.replace(
            options,
            temperature=temperature,
            top_k=int(top_k),
            top_p=top_p,
            seed=None if seed is None else int(seed),
            presence_penalty=penalty,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def given(self) -> dict[str, Any]:
        """The options that differ from the defaults (what the caller asked for)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class CheckedLens:
    """A :class:`LensRequest` checked against the model and the prompt: what a backend reads."""

    request: LensRequest
    """As the caller gave it (results are keyed by it)."""
    layers: tuple[int, ...]
    """The ``resid_post`` layers, absolute, in the order asked."""
    top_k: int
    prompt_positions: tuple[int, ...] = ()
    """Prompt positions (absolute, ascending) read once the prompt is processed, besides every
    position that produces a generated token (``n_prompt - 1`` onwards)."""

    @property
    def addresses(self) -> list[Address]:
        return [Address("resid_post", layer) for layer in self.layers]


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed the checks: what a backend runs."""

    token_ids: list[int]
    """The prompt, validated against the vocabulary and the context window."""
    points: dict[Address, Address]
    """Each address as the caller spelled it (strings parsed) → its resolved form."""
    writes: list[AnyWrite]
    """The steering spec's writes, addresses resolved, widths and shapes checked; a feature
    write's ``add`` is already a plain :class:`Write` (its decoder direction), a ``clamp`` or
    ``ablate`` a :class:`FeatureWrite` bound to its SAE's address."""
    max_tokens: int = 0
    """Tokens to generate (``0``: a capture over the prompt only)."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    n_logprobs: int = 0
    readouts: tuple[Features, ...] = ()
    """The feature readouts asked for (each names an attached SAE), in request order."""
    saes: Mapping[str, Sae] = field(default_factory=dict)
    """The attached SAEs this request's readouts and feature writes use, by name."""
    lens: CheckedLens | None = None
    """The logit lens to read while generating (``stream(lens=...)``, ``capture_generation(lens=...)``)."""
    adapter: str | None = None
    """The name of the registered adapter this request runs under (``model.adapters[name]``;
    ``None``: the base model)."""

    @property
    def addresses(self) -> list[Address]:
        """The resolved addresses to read, in request order, without repeats."""
        return list(dict.fromkeys(self.points.values()))

    @property
    def readout_addresses(self) -> list[Address]:
        """The addresses the readouts' SAEs read, in request order, without repeats."""
        return list(dict.fromkeys(self.saes[r.sae].address for r in self.readouts))

    def keyed(
        self, values: Mapping[Address, torch.Tensor], readouts: Mapping[Features, FeatureReadout] | None = None
    ) -> Results:
        """``values`` (keyed by resolved address) keyed by the addresses as requested, with the
        readouts keyed by their :class:`Features`."""
        out = Results({requested: values[address] for requested, address in self.points.items()})
        for spec in self.readouts:
            if readouts is None or spec not in readouts:
                raise KeyError(f"the backend returned no readout for {spec}")
            out[spec] = readouts[spec]
        return out

    def read_on_host(self, values: Mapping[Address, torch.Tensor]) -> dict[Features, FeatureReadout]:
        """Each readout computed from captured activations (``[n, width]`` at its SAE's
        address): how an in-process backend serves readouts."""
        out = {}
        for spec in self.readouts:
            sae = self.saes[spec.sae]
            out[spec] = read_features(sae, values[sae.address], spec).to("cpu")
        return out
