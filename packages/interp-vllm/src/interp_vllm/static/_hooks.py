"""The hooks vllm-static installs, as closures of pure tensor work traced into the compiled graph.

Each hook runs, at each address it serves, that address's :class:`~._taps.StaticWrites` table,
then its SAEs (:class:`~._saes.StaticSae`, each reading what the previous one left, and
those that clamp applying the step's clamps), then its :class:`~._taps.StaticTap`
(:func:`chain`). The modules they call are registered on the hooked module by
:class:`~._compiled.CompiledTaps`, which builds the hooks here and installs them; a
:data:`Stage` names one address's modules by attribute.

vLLM's deferred residual is handled in-graph: a write on ``resid_pre``/``resid_post`` gives
``(where(steered, new_stream, hidden), where(steered, 0, residual))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..hooks import arg_value, attr_path, set_arg
from ..model._sites import gate_activation
from ._taps import StaticTap

Stage = tuple[str | None, tuple[str, ...], tuple[str, ...], str | None]
"""One address at a hook: the attribute names of its write table, of its SAEs (and of those
among them that clamp) and of its tap (``None`` / empty where it has none)."""
Names = list[Stage]


def tap_of(module: nn.Module, name: str) -> StaticTap:
    tap: StaticTap = getattr(module, name)
    return tap


def chain(module: nn.Module, names: Names, x: torch.Tensor) -> torch.Tensor:
    """Apply each address's writes, encode it with its SAEs (which may clamp), then copy it
    into its tap (in-graph)."""
    for write, saes, _, tap in names:
        if write is not None:
            x = getattr(module, write)(x)
        for sae in saes:
            x = getattr(module, sae)(x)
        if tap is not None:
            getattr(module, tap)(x)
    return x


def chain_rows(module: nn.Module, names: Names, x: torch.Tensor, batched: bool) -> torch.Tensor:
    """:func:`chain` on ``[tokens, ...]`` rows: a batched ``[1, tokens, ...]`` value (HF's modules
    under vLLM's Transformers modeling backend) is unbatched for it and batched again."""
    if batched:
        return chain(module, names, x[0]).unsqueeze(0)
    return chain(module, names, x)


def any_writes(names: Names) -> bool:
    """Whether anything at these addresses may change the value (a write table or a clamp)."""
    return any(write is not None or clamps for write, _, clamps, _ in names)


def steered(module: nn.Module, names: Names, n: Any) -> torch.Tensor:
    """``[n, 1]``: tokens any write or clamp at this hook touches this step (in-graph)."""
    masks = [getattr(module, write).steered(n) for write, _, _, _ in names if write is not None]
    masks += [getattr(module, sae).steered(n) for _, _, clamps, _ in names for sae in clamps]
    mask: torch.Tensor = masks[0]
    for other in masks[1:]:
        mask = mask | other
    return mask


def layer_in_hook(
    names: Names,
    *,
    hidden_at: tuple[int, str],
    residual_at: tuple[int, str] | None,
    stash_at: str | None,
    batched: bool,
) -> Callable[..., Any]:
    """A decoder layer's forward pre-hook: the stream it is given (``hidden + residual`` where
    the layer defers the residual add) through ``names``; ``stash_at``: the child whose
    ``interp_stash`` tap keeps the result (``resid_mid`` is formed from it)."""
    writes = any_writes(names)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = arg_value(args, kwargs, *hidden_at)
        residual = arg_value(args, kwargs, *residual_at) if residual_at is not None else None
        stream = hidden if residual is None else hidden + residual
        new = chain_rows(module, names, stream, batched)
        if stash_at is not None:
            tap_of(attr_path(module, stash_at), "interp_stash")(new[0] if batched else new)
        if not writes:
            return None
        if residual is None or residual_at is None:
            return set_arg(args, kwargs, *hidden_at, new)
        mask = steered(module, names, new.shape[0])
        args, kwargs = set_arg(args, kwargs, *hidden_at, torch.where(mask, new, hidden))
        return set_arg(args, kwargs, *residual_at, torch.where(mask, 0.0, residual))

    return hook


def layer_out_hook(names: Names, *, deferred: bool, batched: bool) -> Callable[..., Any]:
    """A decoder layer's forward hook: the stream it returns (``hidden + residual`` where it
    defers the residual add) through ``names``."""
    writes = any_writes(names)

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple) and not deferred:  # (stream, ...)
            new = chain_rows(module, names, output[0], batched)
            return (new, *output[1:]) if writes else None
        if isinstance(output, tuple):
            hidden, residual = output[0], output[1]
            stream = hidden if residual is None else hidden + residual
            new = chain(module, names, stream)
            if not writes:
                return None
            if residual is None:
                return (new, *output[1:])
            mask = steered(module, names, new.shape[0])
            return (torch.where(mask, new, hidden), torch.where(mask, 0.0, residual), *output[2:])
        new = chain_rows(module, names, output, batched)
        return new if writes else None

    return hook


def input_hook(steps: list[tuple[tuple[int, str], Names]], *, qk: bool, batched: bool) -> Callable[..., Any]:
    """A module's forward pre-hook: each argument of ``steps`` (``(position, name)``) through its
    names, in order; ``qk``: the attention kernel's query and key copied into its ``interp_q`` /
    ``interp_k`` taps (``attn_scores`` and ``attn_pattern`` are computed from them on the host)."""
    writes = any(any_writes(names) for _, names in steps)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for (index, name), names in steps:
            args, kwargs = set_arg(
                args, kwargs, index, name, chain_rows(module, names, arg_value(args, kwargs, index, name), batched)
            )
        if qk:
            tap_of(module, "interp_q")(arg_value(args, kwargs, 0, "query"))
            tap_of(module, "interp_k")(arg_value(args, kwargs, 1, "key"))
        return (args, kwargs) if writes else None

    return hook


def output_hook(
    parts: dict[tuple[tuple[int, int] | None, float], Names],
    activated: Names,
    act: nn.Module | None,
    mid_names: Names,
    *,
    scale: float,
    batched: bool,
) -> Callable[..., Any]:
    """A module's forward hook: each part of its output through its names (``parts``, keyed by
    ``(column block, scale)``: the gate / up halves of a fused projection, a sublayer's output as
    added to the residual); ``activated``: read only, ``act(gate)`` after any write at the gate;
    ``mid_names``: the ``resid_mid`` formed from the layer's stashed input plus ``scale`` times
    this output, written back as the output that gives it."""
    out_writes = any(any_writes(names) for names in parts.values())
    mid_writes = any_writes(mid_names)

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        value = output[0] if isinstance(output, tuple) else output
        if batched:  # [1, tokens, ...]: work on the rows
            value = value[0]
        new = value
        for (cols, factor), names in parts.items():
            if cols is None and factor != 1.0:  # read and written as added; handed back unscaled
                added = chain(module, names, new * factor)
                if any_writes(names):
                    new = added / factor
                continue
            if cols is None:
                new = chain(module, names, new)
                continue
            index, count = cols
            pieces = list(new.split(new.shape[-1] // count, dim=-1))
            pieces[index] = chain(module, names, pieces[index])
            if any_writes(names):
                new = torch.cat(pieces, dim=-1)
        if act is not None:
            gate = new.split(new.shape[-1] // 2, dim=-1)[0]
            chain(module, activated, gate_activation(act, gate))
        if mid_names:
            n = new.shape[0]
            before = tap_of(module, "interp_stash").buffer[:n].to(new.dtype)
            mid = before + scale * new.reshape(n, -1)
            moved = chain(module, mid_names, mid)
            if mid_writes:
                mask = steered(module, mid_names, n)
                added = (moved - before) / scale if scale != 1.0 else moved - before
                new = torch.where(mask, added, new.reshape(n, -1)).reshape(value.shape)
        if not (out_writes or mid_writes):
            return None
        if batched:
            new = new.unsqueeze(0)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    return hook
