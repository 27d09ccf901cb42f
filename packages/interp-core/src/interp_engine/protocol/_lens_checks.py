"""The checks of a logit-lens request: its layers inside the model and served as ``resid_post``,
its ``top_k`` inside the vocabulary, its prompt positions resolved against the prompt.
:class:`~interp_engine.protocol._base.ModelBase` runs them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from .._errors import InvalidOption, InvalidSteering
from ..addresses._address import Address
from ..results._lens import LensRequest
from ._checks import requested_points
from ._protocol import ModelInfo
from ._requests import CheckedLens


def check_lens(
    lens: Any,
    tokens: Any,
    n_prompt: int,
    info: ModelInfo,
    supported_points: Collection[str],
    check_served: Callable[[Iterable[Address]], None],
) -> CheckedLens | None:
    """``lens`` checked: a :class:`LensRequest` (or its JSON object), its layers inside the
    model and served as ``resid_post`` (``check_served`` raises for a kind the model lacks), its
    prompt positions resolved against the prompt (chat span names against ``tokens``' spans)."""
    if lens is None:
        return None
    if isinstance(lens, Mapping):
        lens = LensRequest.from_json(lens)
    if not isinstance(lens, LensRequest):
        raise InvalidOption(f"lens must be a LensRequest (layers, top_k), got {type(lens).__name__}")
    n_layers = info.n_layers
    bad = [layer for layer in lens.layers if not -n_layers <= layer < n_layers]
    if bad:
        raise InvalidOption(
            f"lens layer {bad[0]} is outside this {n_layers}-layer model (valid: {-n_layers}..{n_layers - 1})"
        )
    layers = tuple(layer % n_layers for layer in lens.layers)
    if len(set(layers)) != len(layers):
        raise InvalidOption(
            f"lens layers {list(lens.layers)} name one layer twice (negative layers count from the end)"
        )
    if lens.top_k > info.vocab_size:
        raise InvalidOption(f"lens top_k {lens.top_k} is more than the vocabulary ({info.vocab_size})")
    addresses = [Address("resid_post", layer) for layer in layers]
    requested_points(addresses, info, supported_points)
    check_served(addresses)
    return CheckedLens(lens, layers, lens.top_k, lens_prompt_positions(lens, tokens, n_prompt))


def lens_prompt_positions(lens: LensRequest, tokens: Any, n_prompt: int) -> tuple[int, ...]:
    """A lens's prompt positions, absolute and ascending."""
    positions = lens.positions
    if positions is None:
        return ()
    if positions == "prompt":
        return tuple(range(n_prompt))
    if isinstance(positions, str):  # a chat span name, resolved against the prompt's spans
        from ..chat._spans import span_positions

        try:
            found = span_positions(positions, tokens, n_prompt)
        except InvalidSteering as exc:
            raise InvalidOption(f"lens positions: {exc}") from None
        return tuple(sorted(set(found)))
    out = set()
    for index in positions:
        absolute = index + n_prompt if index < 0 else index
        if not 0 <= absolute < n_prompt:
            raise InvalidOption(
                f"lens position {index} is outside the {n_prompt}-token prompt (valid: {-n_prompt}..{n_prompt - 1})"
            )
        out.add(absolute)
    return tuple(sorted(out))
