"""Input checks every backend shares, so each one rejects bad input the same way, before compute.

Backend authors call these at the top of each request; they raise the core's typed errors.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Collection, Iterable, Mapping, Sequence, Set
from typing import Any

import torch

from .._errors import ContextTooLong, InvalidActivations, InvalidSteering, InvalidTokens, UnsupportedAddress
from ..addresses._address import Address, AddressLike, as_address, is_point_tuple
from ..addresses._kinds import KINDS
from ..steering._spec import AnyWrite, FeatureWrite, SteeringSpec, Write
from ._protocol import ModelInfo


def check_token_ids(token_ids: Any, info: ModelInfo, *, extra: int = 0) -> list[int]:
    """A validated list of ids: non-empty, in ``[0, vocab)``, and with ``extra`` more tokens
    (to be generated) still inside the context window."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidTokens(f"token ids are one sequence [n], got shape {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)):
        raise InvalidTokens("expected token ids, got a string; use model.to_tokens(text)[0].tolist()")
    if isinstance(token_ids, (Set, Mapping)):
        raise InvalidTokens(f"token ids are an ordered sequence of ints, got a {type(token_ids).__name__}")
    if hasattr(token_ids, "tolist") and hasattr(token_ids, "ndim"):  # a numpy array
        if token_ids.ndim != 1:
            raise InvalidTokens(f"token ids are one sequence [n], got an array of shape {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    try:
        listed = list(token_ids)
    except TypeError:
        raise InvalidTokens(f"token ids must be a list of ints, got {type(token_ids).__name__}") from None
    if not listed:
        raise InvalidTokens("the token list is empty; a request needs at least one token")
    if set(map(type, listed)) == {int}:  # plain ints (what tolist() gives): the type test at C speed
        ids = listed
    else:  # other integral types (numpy's) become ints; bools and non-integers are refused
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in listed):
            raise InvalidTokens("token ids must all be ints")
        ids = [int(t) for t in listed]
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        raise InvalidTokens(f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size}) ({len(bad)} such ids)")
    if len(ids) + extra > info.n_ctx:
        more = f" plus {extra} to generate" if extra else ""
        raise ContextTooLong(f"{len(ids)} prompt tokens{more} exceed the model's context of {info.n_ctx} tokens")
    return ids


def check_max_tokens(max_tokens: Any) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidTokens(f"max_tokens must be a positive int, got {max_tokens!r}")
    return max_tokens


def requested_points(
    points: Iterable[AddressLike], info: ModelInfo, supported: Collection[str] = tuple(KINDS)
) -> dict[Address, Address]:
    """Each requested address (as the caller spelled it, strings parsed) mapped to its resolved
    form (negative layers made absolute), checked against the model. Results are keyed by the
    requested addresses, so ``acts[Address("resid_post", -1)]`` finds what was asked for. A kind
    outside ``supported`` raises ``UnsupportedAddress``."""
    if isinstance(points, (str, Address)) or is_point_tuple(points):
        points = [points]
    mapping: dict[Address, Address] = {}
    for point in points:
        requested = as_address(point)
        address = requested.resolve(info.n_layers)
        if address.kind not in supported:
            raise UnsupportedAddress(
                f"{address} cannot be served here; supported kinds: {', '.join(supported)}",
                address=address,
                valid=tuple(supported),
            )
        mapping[requested] = address
    if not mapping:
        raise UnsupportedAddress(
            "no capture points given: pass at least one address (an Address or a string such as 'resid_post.0')",
            address=None,
            valid=tuple(supported),
        )
    return mapping


def resolve_points(
    points: Iterable[AddressLike], info: ModelInfo, supported: Collection[str] = tuple(KINDS)
) -> list[Address]:
    """The resolved addresses of :func:`requested_points`, in request order, without repeats."""
    return list(dict.fromkeys(requested_points(points, info, supported).values()))


def width_of(address: Address, info: ModelInfo) -> int:
    """The activation width per row at an address: ``d_head`` at head addresses (per head)."""
    width = address.info.width
    if address.info.per_head:
        return info.d_head
    widths = {
        "d_mlp": info.d_mlp,
        "vocab": info.vocab_size,
        "experts": info.n_experts,
        "experts per token": info.experts_per_token,
    }
    return widths.get(width, info.d_model)


def heads_of(address: Address, info: ModelInfo) -> int:
    """How many heads a head address has (query heads, or key/value heads)."""
    return info.n_kv_heads if address.info.width == "kv_heads x d_head" else info.n_heads


def value_shape(address: Address, info: ModelInfo) -> tuple[int, ...]:
    """The shape of one token's value at ``address`` (attention patterns: ``(heads,)`` + keys)."""
    if address.info.per_head:
        return (heads_of(address, info), info.d_head)
    if address.info.width == "heads x keys":
        return (info.n_heads,)
    return (width_of(address, info),)


def check_spec(spec: SteeringSpec | None, info: ModelInfo, writable: Collection[str] | None = None) -> list[AnyWrite]:
    """The spec's writes with resolved addresses, each width checked against the model (a
    :class:`FeatureWrite` must already be bound to its SAE's address: the model does that)."""
    if spec is None:
        return []
    if not isinstance(spec, SteeringSpec):
        raise InvalidSteering(f"steering_spec must be a SteeringSpec, got {type(spec).__name__}")
    writes: list[AnyWrite] = []
    for item in spec.writes:
        if isinstance(item, FeatureWrite):
            if item.address is None:
                raise InvalidSteering(f"the feature write on {item.sae!r} is not bound to an address by a model")
            bound = _writable(item.address.resolve(info.n_layers), writable)
            writes.append(item.bound(bound))
            continue
        write = item
        address = _writable(write.address.resolve(info.n_layers), writable)
        expected = width_of(address, info)
        per = " per head" if address.info.per_head else ""
        tensors = [("vector", write.vector, write.head_rows)]
        if write.target is not None:
            tensors.append(("target", write.target, write.target_head_rows))
        for name, tensor, _ in tensors:
            if tensor.shape[-1] != expected:
                raise InvalidSteering(
                    f"the {name} for {address} has width {tensor.shape[-1]}, but {address.kind} is {expected} "
                    f"wide{per} in this model"
                )
        if address.info.per_head:
            for name, _, rows in tensors:
                _check_heads(write, address, info, name, rows)
        writes.append(dataclasses.replace(write, address=address))
    return writes


def _writable(address: Address, writable: Collection[str] | None) -> Address:
    """``address``, or ``UnsupportedAddress`` if its kind is not among ``writable``."""
    if writable is not None and address.kind not in writable:
        raise UnsupportedAddress(
            f"cannot write at {address} here; writable kinds: {', '.join(writable)}",
            address=address,
            valid=tuple(writable),
        )
    return address


def _check_heads(write: Write, address: Address, info: ModelInfo, name: str, rows: int | None) -> None:
    n_heads = heads_of(address, info)
    bad = [h for h in write.heads or () if h >= n_heads]
    if bad:
        raise InvalidSteering(
            f"head {bad[0]} of the write at {address} is out of range: {address.kind} has {n_heads} heads "
            f"in this model (0..{n_heads - 1})"
        )
    selected = len(write.heads) if write.heads is not None else n_heads
    if rows is not None and rows != selected:
        raise InvalidSteering(
            f"the {name} for {address} has {rows} head rows but the write selects {selected} heads "
            f"({'heads=' + str(list(write.heads)) if write.heads is not None else 'every head'}); "
            "give [d_head], [n_heads_selected, d_head] or [n_positions, n_heads_selected, d_head]"
        )


def write_positions(write: AnyWrite, n_prompt: int, n_total: int) -> list[int]:
    """The sequence indices ``write`` touches in a sequence of ``n_total`` tokens whose first
    ``n_prompt`` are the prompt (explicit negative indices count back from the prompt's end)."""
    if write.positions == "all":
        return list(range(n_total))
    if write.positions == "prompt":
        return list(range(min(n_prompt, n_total)))
    if write.positions == "generated":
        return list(range(n_prompt, n_total))
    if isinstance(write.positions, str):  # a chat span name: the model resolves it before a backend sees it
        raise InvalidSteering(
            f"positions {write.positions!r} name a chat span, resolved against the prompt's ChatTokens by the "
            "model's request checks; pass model.chat_tokens(messages) as the prompt"
        )
    out = []
    for index in write.positions:
        absolute = index + n_prompt if index < 0 else index
        if absolute < 0:
            raise InvalidSteering(f"position {index} is before the start of a {n_prompt}-token prompt")
        out.append(absolute)
    return out


def check_write_shapes(writes: Sequence[AnyWrite], n_prompt: int, n_total: int) -> None:
    """Check explicit positions fit the sequence and per-position tensors have one row per
    selected position, before any compute."""
    for write in writes:
        positions = write_positions(write, n_prompt, n_total)
        late = [p for p in positions if p >= n_total]
        if late:
            raise InvalidSteering(
                f"position {late[0]} of the write at {write.address} is beyond the {n_total}-token sequence"
            )
        if isinstance(write, FeatureWrite):
            continue
        if write.per_position and write.vector.shape[0] != len(positions):
            raise InvalidSteering(
                f"the {write.op} tensor for {write.address} has {write.vector.shape[0]} rows but "
                f"selects {len(positions)} positions ({write.positions!r}); give one row per "
                "position or a single [width] vector"
            )
        if write.target is not None and write.target_per_position and write.target.shape[0] != len(positions):
            raise InvalidSteering(
                f"the {write.op} target for {write.address} has {write.target.shape[0]} rows but the write "
                f"selects {len(positions)} positions ({write.positions!r}); give one row per position or a "
                "single [width] target"
            )


def check_residuals(acts: Any, info: ModelInfo) -> torch.Tensor:
    """A tensor of residual-stream vectors ``[..., d_model]`` to decode, or ``InvalidActivations``."""
    if not isinstance(acts, torch.Tensor):
        raise InvalidActivations(f"decode_residuals takes a tensor [..., d_model], got {type(acts).__name__}")
    if acts.layout != torch.strided or acts.device.type == "meta":
        raise InvalidActivations(
            f"decode_residuals takes a dense tensor with data, got a {acts.layout} tensor on {acts.device}"
        )
    if acts.is_complex() or acts.dtype == torch.bool:
        raise InvalidActivations(f"decode_residuals takes real-valued activations, got dtype {acts.dtype}")
    if acts.dim() == 0 or acts.shape[-1] != info.d_model:
        raise InvalidActivations(
            f"decode_residuals takes residual-stream vectors of width {info.d_model}, got shape {list(acts.shape)}"
        )
    if acts.is_floating_point() and not bool(torch.isfinite(acts).all()):
        raise InvalidActivations("the activations to decode contain NaN or infinite values")
    return acts
