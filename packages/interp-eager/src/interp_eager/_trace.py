"""The traced pass of resolution: one forward over a few tokens with hooks on every module,
recording what each receives and returns and what each layer's attention function receives, and
the comparisons the resolvers make on the recorded tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._intercept import AttentionCall, add_attention_tap, attention_owner
from ._tree import Static, refuse

_TRACE_LENGTHS = (7, 11, 13, 17)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
            if item is not None:
                break
    return None


@dataclass
class Record:
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    args: dict[str, list[Any]] = field(default_factory=dict)
    attention: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sinks: bool = False
    logits: torch.Tensor | None = None


@contextlib.contextmanager
def recording(
    model: nn.Module,
    record: Record,
    attn_modules: list[nn.Module],
    attn_fn: str | None,
    edits: dict[str, Callable[[Any], Any]] | None = None,
) -> Iterator[None]:
    handles: list[Any] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            value = args[0] if args else kwargs.get("hidden_states", _first_tensor(list(kwargs.values())))
            if isinstance(value, torch.Tensor):
                record.inputs[name] = value.detach().clone()
            record.args[name] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]

        return hook

    def post(name: str) -> Callable[..., Any]:
        edit = (edits or {}).get(name)

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if edit is not None:
                output = edit(output)
            value = _first_tensor(output)
            if value is not None:
                record.outputs[name] = value.detach().clone()
            return output if edit is not None else None

        return hook

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name)))
        for index, module in enumerate(attn_modules):

            def tap(call: AttentionCall, index: int = index) -> None:
                if call.value is not None and index not in record.attention:
                    record.attention[index] = (call.query.detach(), call.key.detach(), call.value.detach())
                    record.sinks = record.sinks or call.sinks is not None

            owner, method = attention_owner(module, attn_fn)
            handles.append(add_attention_tap(owner, tap, method=method))
        yield
    finally:
        for handle in handles:
            handle.remove()


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1), b.reshape(-1)))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the tensors' dtype (a few ulps; 1e-4 relative in float32)."""
    if a.numel() != b.numel():
        return False
    eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0 for t in (a, b))
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    scale = float(b.abs().max().clamp_min(1e-6))
    return float((a - b).abs().max()) <= max(1e-4, 8 * eps) * scale


def run(model: nn.Module, ids: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False)


def trace_ids(model: nn.Module, avoid: set[int]) -> torch.Tensor:
    length = next(n for n in _TRACE_LENGTHS if n not in avoid)
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=generator)
    device = next(model.parameters()).device
    return ids.to(device)


def trace(model: nn.Module, ids: torch.Tensor, attn_modules: list[nn.Module], attn_fn: str | None) -> Record:
    """One forward over ``ids`` recording every module's input and output and what each layer's
    attention function receives."""
    record = Record()
    try:
        with recording(model, record, attn_modules, attn_fn):
            record.logits = run(model, ids).logits
    except Exception as exc:  # any failure of the trace is a refusal naming it
        raise refuse(model, f"a traced forward failed ({type(exc).__name__}: {exc})") from exc
    return record


@dataclass
class Traced:
    """A model, its module tree and what one traced forward recorded: what the resolvers read."""

    model: nn.Module
    static: Static
    layers: nn.ModuleList
    ids: torch.Tensor
    record: Record
    attn_fn: str | None
    """How the attention function was tapped (:attr:`~interp_eager._families.Family.attn_fn`)."""
    scores_at_softmax: bool

    def at(self, path: str, layer: int = 0) -> str:
        """The model-level name of ``path`` in layer ``layer`` (``""``: the layer)."""
        prefix = f"{self.static.layers}.{layer}"
        return f"{prefix}.{path}" if path else prefix

    def input(self, path: str, layer: int = 0) -> torch.Tensor | None:
        return self.record.inputs.get(self.at(path, layer))

    def output(self, path: str, layer: int = 0) -> torch.Tensor | None:
        return self.record.outputs.get(self.at(path, layer))


def config_numbers(config: Any) -> list[float]:
    """The config's numbers other than 0 and 1 (a constant the model applies is one of them)."""
    try:
        items = config.to_dict().values()
    except (AttributeError, TypeError, ValueError):
        return []
    return [float(v) for v in items if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1)]
