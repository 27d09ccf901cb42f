"""The public ``interp-engine`` package's free names that ours lacked: :func:`capture`,
:func:`steer`, :func:`vllm_installed`, and :func:`decode_residuals` with its ``softcap``. Each is one
screen, delegating to the model or to the free functions of :mod:`interp_engine._api`."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ._api import Tokens, run_with_cache
from ._errors import InvalidOption, InvalidSteering, UnsupportedOperation
from ._sync import SyncModel, sync_model
from .addresses._address import Address, as_address
from .analysis._weights import WeightAccess
from .protocol._protocol import InterpModel, Points, RowAdapters
from .results._cache import Cache
from .steering._block import Block, SteerMask, mask_positions, open_block
from .steering._ops import SteerSpec
from .steering._spec import RowSpecs, SteeringSpec, one_spec
from .steering._values import as_index, finite_float, short_repr


def capture(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    points: Points,
    *,
    steering_spec: RowSpecs = None,
    attention_mask: Any = None,
    position_ids: Any = None,
    adapter: RowAdapters = None,
    positions: Any = None,
    detach: bool = True,
) -> Cache:
    """:func:`run_with_cache` under the public ``interp-engine`` package's name: activations at
    ``points`` as a :class:`Cache` ``[batch, pos, width]`` (``capture(model, model.to_tokens("Hello"),
    [Address("resid_post", 1)])``), a padded batch with its ``attention_mask`` included.
    ``detach=False`` (gradients through the forward) is :func:`run_with_gradients`'s here."""
    if detach is not True:
        raise UnsupportedOperation(
            "capture(detach=False) would keep the autograd graph; here activations are always detached copies: "
            "use run_with_gradients(model, tokens, points, metric) for gradients with respect to activations"
        )
    return run_with_cache(
        model,
        tokens,
        points,
        steering_spec=steering_spec,
        positions=positions,
        adapter=adapter,
        attention_mask=attention_mask,
        position_ids=position_ids,
    )


@contextlib.contextmanager
def steer(
    model: InterpModel | SyncModel,
    spec: SteeringSpec | SteerSpec | Sequence[SteeringSpec | SteerSpec],
    *,
    position_mask: Sequence[int] | SteerMask | None = None,
    generated: bool = True,
    prompt_token_ids: Sequence[int] | None = None,
) -> Iterator[None]:
    """Steer every request on ``model`` made inside the block: captures, generations and streams,
    from the async methods or the sync functions, on every backend.

    ``spec`` is a :class:`SteeringSpec` or a list of them (applied in order); the public
    package's :class:`SteerSpec` (one op at one layer) is taken too, alone or in the list. The block follows
    the code inside it (its context, which the sync facade carries to its loop), so a request made
    elsewhere -- another task, another thread, a request vLLM batches with these -- is untouched.
    A request's own ``steering_spec`` applies after the block's writes; blocks nest, outermost first.

    ``position_mask``: prompt positions left unsteered (negative ones count back from the end of
    each prompt), or ``SteerMask.SPECIAL_TOKENS`` (each prompt's special tokens).
    ``generated=False``: the generated tokens are left unsteered (the prompt only).
    ``prompt_token_ids`` is accepted for code written for the public package, which needs it on
    eager to tell the prompt from generated rows; here each request's own prompt says so, and the
    ids are only checked to be ids."""
    inner = model.model if isinstance(model, SyncModel) else model
    combined = _block_spec(spec)
    if not isinstance(generated, bool):
        raise InvalidSteering(f"generated is True or False, got {short_repr(generated)}")
    if prompt_token_ids is not None:
        ids = prompt_token_ids.reshape(-1).tolist() if isinstance(prompt_token_ids, torch.Tensor) else prompt_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or any(as_index(t) is None for t in ids):
            raise InvalidSteering(f"prompt_token_ids are token ids (ints), got {short_repr(prompt_token_ids)}")
    with open_block(Block(inner, combined, mask_positions(position_mask), generated)):
        yield


def _block_spec(spec: Any) -> SteeringSpec:
    if isinstance(spec, SteeringSpec):
        return spec
    if isinstance(spec, (list, tuple)):
        for i, item in enumerate(spec):
            if not isinstance(item, (SteeringSpec, SteerSpec)):
                raise InvalidSteering(
                    f"steer() takes a SteeringSpec, a SteerSpec or a list of them (applied in order); item {i} is "
                    f"a {type(item).__name__} (writes go in SteeringSpec([...]))"
                )
    combined = one_spec(spec)
    if combined is None:
        raise InvalidSteering("steer() needs a SteeringSpec (or a list of them), got None")
    return combined


def vllm_installed() -> bool:
    """Whether the ``vllm`` package is importable here (found without importing it). The vllm
    backends also need ``interp-vllm``: :func:`installed_backends` lists what can load."""
    return importlib.util.find_spec("vllm") is not None


_MODELS_OWN = object()
"""``decode_residuals``' ``softcap`` when not given: the model's own logits."""


def decode_residuals(
    model: InterpModel | SyncModel,
    acts: torch.Tensor | Mapping[Address | str, torch.Tensor],
    *,
    softcap: Any = _MODELS_OWN,
) -> torch.Tensor | dict[Address, torch.Tensor]:
    """The logit lens: residual-stream vectors ``[..., d_model]`` through the model's final norm
    and unembedding, as logits ``[..., vocab]`` (float32, CPU), delegating to the model's
    ``decode_residuals``: the model's own logits (a family's final soft-cap included). A mapping
    (a capture result, or a :class:`Cache` of residual kinds) is decoded value by value into a
    dict keyed by :class:`Address`; every value is checked first.

    ``softcap`` (the public ``interp-engine`` package's keyword): ``c`` caps the logits at
    ``c * tanh(logits / c)``, ``None`` asks for them uncapped. On a model whose unembedding
    caps its logits itself (Gemma 2) only its own cap can be asked for; anything else raises
    ``UnsupportedOperation`` naming it.

    ``decode_residuals(model, cache.stack("resid_post", include_embed=True))`` decodes the
    embedding and every layer at once: ``[1 + n_layers, batch, pos, vocab]``."""
    facade = sync_model(model)
    cap = None if softcap is _MODELS_OWN else _softcap(facade, softcap)
    if isinstance(acts, Mapping):
        keyed = {as_address(key): value for key, value in acts.items()}
        decoded = facade.decode_residuals(keyed)
        if cap is None or not isinstance(decoded, dict):
            return decoded
        return {key: cap * torch.tanh(value / cap) for key, value in decoded.items()}
    logits = facade.decode_residuals(acts)
    if cap is None or not isinstance(logits, torch.Tensor):
        return logits
    return cap * torch.tanh(logits / cap)


def _softcap(facade: SyncModel, softcap: Any) -> float | None:
    """The cap ``decode_residuals`` applies on top of the model's logits (``None``: none), for
    ``softcap=`` given; ``UnsupportedOperation`` where the model caps its logits itself with
    another value, since its unembedding never returns them uncapped."""
    number = finite_float(softcap)
    if softcap is not None and (number is None or number <= 0):
        raise InvalidOption(f"softcap is a number > 0 (or None: no cap), got {short_repr(softcap)}")
    own = None
    if isinstance(facade.model, WeightAccess):
        own = facade.run(facade.model.weight_info).logit_softcap
    if own is None:
        return None if softcap is None else float(softcap)
    if softcap is not None and float(softcap) == own:
        return None  # the model's logits are capped at exactly that already
    raise UnsupportedOperation(
        f"this model's unembedding caps its logits itself (c * tanh(logits / c), c = {own}), so decode_residuals "
        f"returns them capped and cannot give softcap={softcap!r}; leave softcap out (or pass softcap={own}) for "
        "the model's own logits"
    )
