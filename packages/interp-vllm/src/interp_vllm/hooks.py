"""Hook primitives for vLLM's modules, shared by the ``vllm`` and ``vllm-static`` workers.

What the two workers' hooks have in common: walking a dotted module path, reading and replacing
a hooked call's argument (by position or name, as vLLM's callers pass it either way), a pre-hook
that also runs when a caller calls ``module.forward(...)`` directly, the flat ``[tokens, width]``
view of a value and a column block of it, a CPU copy of rows, and where this worker sits in
vLLM's tensor- and pipeline-parallel groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .model._sites import VllmSite


def attr_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def arg_value(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def arg_slot(module: nn.Module, site: VllmSite) -> tuple[int, str]:
    """``(position, name)`` of an ``input`` site's argument in ``module.forward``: by the site's
    ``arg_name`` where the signature has it (callers may pass it either way), else ``arg``."""
    key = (type(module).__qualname__, type(module).__module__, site)
    if key not in _ARG_SLOTS:  # once per module class: the dynamic worker builds its hooks every step
        _ARG_SLOTS[key] = _arg_slot_of(type(module), site)
    return _ARG_SLOTS[key]


_ARG_SLOTS: dict[tuple[str, str, VllmSite], tuple[int, str]] = {}


def _arg_slot_of(cls: type[nn.Module], site: VllmSite) -> tuple[int, str]:
    if site.arg_name is not None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            params = []
        names = [p.name for p in params]
        if site.arg_name in names:
            return names.index(site.arg_name), site.arg_name
        if len(params) == 1:  # a single-argument forward, whatever its name
            return 0, names[0]
    return site.arg, site.arg_name or f"arg{site.arg}"


class ForwardHook:
    """A pre-hook run by the module's ``forward`` itself (see :func:`forward_pre_hook`)."""

    def __init__(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            changed = hook(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            return inner(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous


def forward_pre_hook(module: nn.Module, hook: Callable[..., Any]) -> ForwardHook:
    """``hook(module, args, kwargs)`` before every call of ``module``'s forward, returning
    ``(args, kwargs)`` to change them (or ``None``). Unlike ``register_forward_pre_hook`` it also
    runs when the caller calls ``module.forward(...)`` directly, as vLLM's Transformers modeling
    backend calls its attention kernels."""
    return ForwardHook(module, hook)


def flat(value: torch.Tensor) -> torch.Tensor:
    """``[tokens, everything else]`` (a view when ``value`` is contiguous: writes go through)."""
    return value.reshape(value.shape[0], -1)


def part_of(value: torch.Tensor, cols: tuple[int, int] | None) -> torch.Tensor:
    """Column block ``cols = (index, parts)`` of ``[tokens, width]`` (a view), or all of it."""
    if cols is None:
        return value
    index, parts = cols
    width = value.shape[-1] // parts
    return value[:, index * width : (index + 1) * width]


def set_arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if len(args) > index:
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def copy_rows(value: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy that never aliases the runner's reused buffers."""
    return value.detach().to("cpu", torch.float32, copy=True)


def tp_position() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # not initialised (tests) or not distributed
        return 0, 1


def pp_position() -> tuple[int, int]:
    """This worker's pipeline-parallel stage and the number of stages."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # not initialised (tests) or not distributed
        return 0, 1


def owned_layers(layers: Any) -> tuple[int, ...]:
    """The layers this pipeline stage holds: vLLM puts a ``PPMissingLayer`` where a layer lives
    on another stage (every layer without pipeline parallelism)."""
    try:
        from vllm.model_executor.models.utils import PPMissingLayer
    except ImportError:  # pragma: no cover - a vLLM without it has no pipeline parallelism
        return tuple(range(len(layers)))
    return tuple(i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer))


__all__ = [
    "ForwardHook",
    "arg_slot",
    "arg_value",
    "attr_path",
    "copy_rows",
    "flat",
    "forward_pre_hook",
    "owned_layers",
    "part_of",
    "pp_position",
    "set_arg",
    "tp_position",
]
