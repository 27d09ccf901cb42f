"""Residual decomposition and direct logit attribution, on every backend (captures + weights).

```python
from interp_engine import load_model, logit_attribution

model = load_model("interp:tiny")
dla = logit_attribution(model, "The capital of France is", " Paris", " Berlin", heads=True)
dla.top(5)          # the components that push " Paris" over " Berlin" most (either sign)
```

The residual stream leaving the last layer is a sum of what each part of the model wrote into it:
``embed`` (``resid_pre.0``: token and position embeddings and any embedding scale), then per layer
``attn_out.L`` and ``mlp_out.L`` (on families with sandwich norms -- Gemma 2/3, OLMo 2 -- what
they add is ``attn_out_post.L``/``mlp_out_post.L``, and those are the components). With
``heads=True`` each ``attn_out.L`` is split into ``LxHh`` (head ``h``'s ``attn_z`` times its rows
of ``W_O``) and ``b_O.L`` (the output projection's bias), each times the model's residual
multiplier where it has one (Granite: ``attn_out`` is what is added to the residual, the output
projection's output times ``residual_multiplier``). That the components add up to the
captured residual is checked on every call; where they do not (a post-norm block), the call
refuses with ``UnsupportedArchitecture`` instead of returning a wrong split.

The attribution follows TransformerLens's ``logit_attrs``: the final norm is not linear, so its
denominator is computed once from the whole residual and applied to every component
(LayerNorm also centres each component, which is linear), times the norm's weight; each
component's contribution is then its dot product with ``W_U[:, answer] - W_U[:, wrong]``, times
the model's logit scale. The norm's bias and the unembedding's bias are components of their own
(``final_norm.bias``, ``b_U``). The contributions sum to the model's own logit difference (to
float rounding). On a model with a final logit soft-cap (Gemma 2), logits are ``c * tanh(l / c)``,
which no sum of parts passes through: the attribution is of the logit difference *before* the cap
(``meta["softcap"]`` says so, ``meta["logit_diff"]`` is that difference, computed from the
model's own uncapped logits ``logits_raw``).

A batch (several prompts) gives one row per prompt (dims ``("row", "component")``); average with
``result.values.mean(0)``. One prompt gives dims ``("component",)``. The position is each row's
last real token unless ``position=`` says otherwise (negative: from each row's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._api import Tokens, run_with_cache, token_rows
from .._errors import InvalidOption, InvalidTokens, UnsupportedArchitecture, UnsupportedOperation
from .._sync import SyncModel, sync_model
from ..adapters._adapter import Adapter, refuse_adapted_unembedding
from ..addresses._address import Address
from ..protocol._base import ModelBase
from ..protocol._protocol import InterpModel
from ..results._cache import Cache
from ..results._labelled import Labelled
from ..steering._values import short_repr
from ._metrics import token_id
from ._weights import FinalNorm, Weights

__all__ = ["accumulated_resid", "decompose_resid", "logit_attribution"]

NormMode = Literal["own", "final", "none"]


@dataclass
class _Split:
    """The residual leaving the last layer at one position per row, and its components."""

    names: list[str]
    components: torch.Tensor  # [rows, k, d_model], float64
    residual: torch.Tensor  # [rows, d_model], float64: the captured resid_post of the last layer
    positions: list[int]
    cache: Cache
    weights: Weights
    error: float  # max |sum of components - residual| relative to max |residual|


def _tolerance(dtype: str) -> float:
    """How far (relative to the residual's scale) a sum of captured parts may be from the captured
    whole before the split is called wrong: float32 rounding is ~1e-6, a structural mismatch O(1)."""
    return 1e-3 if dtype in ("float32", "float64") else 3e-2


def _served(model: InterpModel) -> set[str]:
    return set(model.points()) if isinstance(model, ModelBase) else set()


def _positions(position: Any, lengths: list[int]) -> list[int]:
    if isinstance(position, bool) or not isinstance(position, int):
        raise InvalidOption(f"position must be an int (negative: from each row's end), got {short_repr(position)}")
    out = []
    for row, length in enumerate(lengths):
        p = position + length if position < 0 else position
        if not 0 <= p < length:
            raise InvalidOption(f"position {position} is outside row {row}, which has {length} tokens")
        out.append(p)
    return out


def _at(cache: Cache, address: Address | str, positions: list[int]) -> torch.Tensor:
    """``cache[address]`` at one position per row, ``[rows, ...]`` in float64."""
    value = cache[address]
    return torch.stack([value[row, p] for row, p in enumerate(positions)]).double()


def _split(
    weights: Weights,
    tokens: Tokens,
    *,
    heads: bool,
    position: int,
    extra: Sequence[str] = (),
    adapter: str | None = None,
) -> _Split:
    facade = weights.facade
    inner = facade.model
    n = inner.info.n_layers
    served = _served(inner)
    attn_kind = "attn_out_post" if "attn_out_post" in served else "attn_out"
    mlp_kind = "mlp_out_post" if "mlp_out_post" in served else "mlp_out"
    if heads and attn_kind == "attn_out_post":
        raise UnsupportedOperation(
            f"a per-head split is impossible on {inner.info.architecture}: a norm sits between the attention's "
            "output and the residual (attn_out_post, a sandwich norm), and a norm of a sum of heads is not the "
            "sum of their norms; decompose without heads=True (attn_out_post.L is then one component per layer)"
        )
    points = ["resid_pre.0", f"resid_post.{n - 1}"]
    for layer in range(n):
        if heads:
            points += [f"attn_z.{layer}", f"attn_out.{layer}"]
        else:
            points.append(f"{attn_kind}.{layer}")
        points.append(f"{mlp_kind}.{layer}")
    rows = token_rows(inner, tokens)
    positions = _positions(position, [len(r) for r in rows])  # checked before any compute
    held = _adapter(inner, adapter)
    cache = run_with_cache(facade, rows, [*points, *extra], adapter=adapter)
    names = ["embed"]
    parts = [_at(cache, "resid_pre.0", positions)]
    tolerance = _tolerance(weights.layout.dtype)
    multiplier = weights.layout.residual_multiplier  # what the residual receives of each sublayer's output
    for layer in range(n):
        if heads:
            z = _at(cache, f"attn_z.{layer}", positions)  # [rows, heads, d_head]
            w_o = weights.W_O(layer).double() * multiplier  # [heads, d_head, d_model], as added
            per_head = torch.einsum("rhd,hdm->rhm", z, w_o)
            names += [f"L{layer}H{h}" for h in range(per_head.shape[1])]
            parts += list(per_head.unbind(1))
            total = per_head.sum(1)
            b_o = weights.b_O(layer)
            if b_o is not None:
                names.append(f"b_O.{layer}")
                parts.append((b_o.double() * multiplier).expand_as(total))
                total = total + b_o.double() * multiplier
            whole = _at(cache, f"attn_out.{layer}", positions)
            error = _relative(total, whole)
            if error > tolerance and held is not None:
                raise UnsupportedOperation(
                    f"under adapter {adapter!r} (a LoRA on {', '.join(held.targets)}) the heads' attn_z.{layer} times "
                    f"the base model's W_O plus b_O is not attn_out.{layer} (off by {error:.2g} of its scale): a LoRA "
                    "on the attention's output projection adds a part of attn_out that no head's rows of W_O hold; "
                    "decompose without heads=True, or merge the adapter into the weights (PEFT's merge_and_unload) "
                    "and load that model"
                )
            if error > tolerance:
                raise UnsupportedOperation(
                    f"on {inner.info.architecture} the heads' attn_z.{layer} times W_O plus b_O is not "
                    f"attn_out.{layer} (off by {error:.2g} of its scale): something between the heads and the output "
                    "projection (a sub-norm) or after it makes the per-head split wrong; decompose without heads=True"
                )
        else:
            names.append(f"{attn_kind}.{layer}")
            parts.append(_at(cache, f"{attn_kind}.{layer}", positions))
        names.append(f"{mlp_kind}.{layer}")
        parts.append(_at(cache, f"{mlp_kind}.{layer}", positions))
    components = torch.stack(parts, dim=1)
    residual = _at(cache, f"resid_post.{n - 1}", positions)
    error = _relative(components.sum(1), residual)
    if error > tolerance:
        raise UnsupportedArchitecture(
            f"on {inner.info.architecture} the residual leaving the last layer is not the sum of embed, "
            f"{attn_kind} and {mlp_kind} (off by {error:.2g} of its scale): its blocks do more than add to the "
            "residual stream (a post-norm block or a residual multiplier), so it has no additive decomposition"
        )
    return _Split(names, components, residual, positions, cache, weights, error)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max().clamp_min(1e-12))
    return float((actual - expected).abs().max()) / scale


def _d_model_labels(d_model: int) -> list[int]:
    return list(range(d_model))


def decompose_resid(
    model: InterpModel | SyncModel, tokens: Tokens, *, heads: bool = False, position: int = -1
) -> Labelled:
    """The residual leaving the last layer (``resid_post`` of the last layer, before the final norm)
    at ``position``, split into what wrote it: dims ``("component", "d_model")`` for one prompt,
    ``("row", "component", "d_model")`` for several. Components: ``embed``, then per layer
    ``attn_out.L`` (``heads=True``: ``LxHh`` per head and ``b_O.L``) and ``mlp_out.L``
    (``attn_out_post.L``/``mlp_out_post.L`` on sandwich-norm families, which refuse ``heads``).
    They sum to the captured residual; ``meta["residual_error"]`` is how closely (relative)."""
    split = _split(Weights(model), tokens, heads=heads, position=position)
    return _labelled(
        split.components.float(),
        ("component", "d_model"),
        {"component": split.names, "d_model": _d_model_labels(split.components.shape[-1])},
        {"position": _one(split.positions), "residual_error": split.error, "heads": heads},
    )


def logit_attribution(
    model: InterpModel | SyncModel,
    tokens: Tokens,
    answer: int | str | Sequence[int | str],
    wrong: int | str | Sequence[int | str] | None = None,
    *,
    heads: bool = False,
    position: int = -1,
    adapter: str | None = None,
) -> Labelled:
    """Direct logit attribution: each component's contribution (see :func:`decompose_resid`) to
    ``logit[answer] - logit[wrong]`` at ``position`` (without ``wrong``: to ``logit[answer]``),
    through the final norm as TransformerLens applies it (module docstring), plus the constant
    components ``final_norm.bias`` and ``b_U`` where the model has them. Dims ``("component",)``
    for one prompt, ``("row", "component")`` for several; the values of a row sum to the model's
    logit difference there (``meta["logit_diff"]``; before the soft-cap on Gemma 2,
    ``meta["softcap"]``). ``answer``/``wrong``: token ids or one-token texts, or one per row.
    ``adapter``: the components of the model under that LoRA adapter (one that leaves the
    unembedding as it is: the weights read are the base model's)."""
    facade = sync_model(model)
    inner = facade.model
    n_rows = len(token_rows(inner, tokens))
    answers = _per_row(inner, answer, n_rows, "answer")
    wrongs = None if wrong is None else _per_row(inner, wrong, n_rows, "wrong")
    weights = Weights(facade)
    layout = weights.layout
    if layout.unembed_inputs:
        raise UnsupportedArchitecture(
            f"on {inner.info.architecture} {', '.join(layout.unembed_inputs)} sits between the final norm and the "
            "unembedding, so W_U does not read the final norm's output: direct logit attribution is not served"
        )
    if layout.logit_softcap is not None and layout.logit_scale != 1.0:
        raise UnsupportedOperation(
            "this model both soft-caps and scales its logits; the order differs between backends, so the "
            "pre-cap logit difference is not defined here"
        )
    extra = ["logits_raw"] if layout.logit_softcap is not None else ["logits"]
    refuse_adapted_unembedding(_adapter(inner, adapter), "direct logit attribution")  # before any compute
    split = _split(weights, tokens, heads=heads, position=position, extra=extra, adapter=adapter)
    ids = sorted(set(answers) | set(wrongs or []))
    column = {token: i for i, token in enumerate(ids)}
    w_u = weights.get("W_U", vocab=ids).double()  # [d_model, len(ids)]
    b_u = weights.get("b_U", vocab=ids).double() if "b_U" in weights.names else None
    rows = range(len(answers))
    directions = torch.stack(
        [_difference(w_u, column, answers[r], None if wrongs is None else wrongs[r]) for r in rows]
    )
    norm = _double(weights.final_norm)
    normalised = norm.normalise(split.components, like=split.residual.unsqueeze(1))
    if norm.scale is not None:
        normalised = normalised * norm.scale
    scale = layout.logit_scale
    values = torch.einsum("rkd,rd->rk", normalised, directions) * scale
    names = list(split.names)
    constants = []
    if norm.bias is not None:
        names.append("final_norm.bias")
        constants.append((directions @ norm.bias) * scale)
    if b_u is not None:
        names.append("b_U")
        biases = [
            _difference(b_u.unsqueeze(0), column, answers[r], None if wrongs is None else wrongs[r]) for r in rows
        ]
        constants.append(torch.cat(biases) * scale)
    if constants:
        values = torch.cat([values, torch.stack(constants, dim=1)], dim=1)
    reference = _reference(split, answers, wrongs, scale if layout.logit_softcap is not None else 1.0)
    meta = {
        "answer": _one(answers),
        "wrong": _one(wrongs) if wrongs is not None else None,
        "position": _one(split.positions),
        "logit_diff": _one(reference),
        "softcap": layout.logit_softcap,
        "norm": layout.norm,
        "residual_error": split.error,
        "heads": heads,
    }
    return _labelled(values.float(), ("component",), {"component": names}, meta)


def _adapter(model: InterpModel, adapter: str | None) -> Adapter | None:
    """The adapter a call names, checked and registered as the call itself would (a folder on
    first use), so that what it adapts is known before any compute."""
    if adapter is None:
        return None
    check = getattr(model, "_check_adapter", None)
    name = check(adapter) if check is not None else adapter
    return getattr(model, "adapters", {}).get(name)


def _difference(columns: torch.Tensor, column: dict[int, int], answer: int, wrong: int | None) -> torch.Tensor:
    """``columns[:, answer] - columns[:, wrong]`` (``wrong`` ``None``: the answer's column)."""
    out = columns[:, column[answer]]
    return out if wrong is None else out - columns[:, column[wrong]]


def _reference(split: _Split, answers: list[int], wrongs: list[int] | None, scale: float) -> list[float]:
    """The model's own logit difference per row (before the soft-cap where there is one:
    ``logits_raw`` times the logit scale)."""
    kind = "logits" if Address("logits") in split.cache else "logits_raw"
    logits = _at(split.cache, kind, split.positions) * scale
    out = []
    for row, answer in enumerate(answers):
        value = logits[row, answer] - (logits[row, wrongs[row]] if wrongs is not None else 0.0)
        out.append(float(value))
    return out


def _double(norm: FinalNorm) -> FinalNorm:
    return FinalNorm(
        norm.kind,
        norm.eps,
        None if norm.weight is None else norm.weight.double(),
        None if norm.bias is None else norm.bias.double(),
        norm.weight_offset,
    )


def accumulated_resid(
    model: InterpModel | SyncModel, tokens: Tokens, *, position: int = -1, norm: NormMode = "own"
) -> Labelled:
    """The residual stream after each layer at ``position`` (``embed``, then ``resid_post.L``), dims
    ``("layer", "d_model")`` (several prompts: ``("row", "layer", "d_model")``), with the final norm
    applied as ``norm`` says: ``"own"`` (default) normalises each by its own scale, the full
    final norm, as the logit lens does (``stack @ weights(model).W_U`` gives each layer's lens
    logits, less ``b_U``); ``"final"`` divides each by the scale of the last layer's residual (and
    centres it for a LayerNorm) and multiplies by the norm's weight, without its bias, as
    TransformerLens's ``apply_ln`` does, so the layers' differences are the decomposition's sums;
    ``"none"`` leaves them raw."""
    if norm not in ("own", "final", "none"):
        raise InvalidOption(f"norm must be 'own', 'final' or 'none', got {short_repr(norm)}")
    facade = sync_model(model)
    inner = facade.model
    n = inner.info.n_layers
    rows = token_rows(inner, tokens)
    positions = _positions(position, [len(r) for r in rows])
    points = ["resid_pre.0", *(f"resid_post.{layer}" for layer in range(n))]
    cache = run_with_cache(facade, rows, points)
    stack = torch.stack([_at(cache, p, positions) for p in points], dim=1)  # [rows, n + 1, d_model]
    if norm != "none":
        final = _double(Weights(facade).final_norm)
        if norm == "own":
            stack = final(stack)
        else:
            stack = final.normalise(stack, like=stack[:, -1:])
            if final.scale is not None:
                stack = stack * final.scale
    labels = ["embed", *(f"resid_post.{layer}" for layer in range(n))]
    return _labelled(
        stack.float(),
        ("layer", "d_model"),
        {"layer": labels, "d_model": _d_model_labels(stack.shape[-1])},
        {"position": _one(positions), "norm": norm},
    )


def _per_row(model: InterpModel, value: Any, n_rows: int, what: str) -> list[int]:
    """One token id per row from an id or one-token text (shared by every row) or a list of them."""
    if isinstance(value, (str, int, torch.Tensor)) and not (isinstance(value, torch.Tensor) and value.dim() > 0):
        return [token_id(model, value, what)] * n_rows
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence):
        raise InvalidTokens(f"{what} must be a token id, a one-token text or one per row, got {short_repr(value)}")
    items = list(value)
    if len(items) != n_rows:
        raise InvalidTokens(f"{what} gives {len(items)} tokens for {n_rows} rows; give one, or one per row")
    return [token_id(model, item, what) for item in items]


def _one(values: Sequence[Any]) -> Any:
    """A per-row list as is, or its only value for one row."""
    return values[0] if len(values) == 1 else list(values)


def _labelled(values: torch.Tensor, dims: tuple[str, ...], coords: dict[str, Any], meta: dict[str, Any]) -> Labelled:
    """``values`` ``[rows, ...]`` labelled; the row axis kept only for several rows."""
    if values.shape[0] == 1:
        return Labelled(values[0], dims, coords, meta)
    return Labelled(values, ("row", *dims), {"row": list(range(values.shape[0])), **coords}, meta)
