"""The static pass of resolution: a model's module tree, read without a forward (works on a
weightless ``meta`` copy, before weights load).

- the decoder layers: the shallowest ``nn.ModuleList`` of blocks of one class holding an attention;
- in each layer, the attention (the submodule named or classed ``attn``/``attention``), its linear
  layers (a 2-D weight: ``nn.Linear``, GPT-2's ``Conv1D``, ...) and its norms (classes named
  ``*Norm*``); the MLP: the other submodule holding a linear layer back to ``d_model`` (or, with no
  such container, the layer's own linear layers, as OPT's ``fc1``/``fc2``); a mixture of experts:
  an MLP holding a router (a ``[n_experts, d_model]`` weight) and an experts module (parameters
  with a leading ``n_experts`` axis, or a list of ``n_experts`` MLPs);
- the final norm: a norm-classed child of the module that holds the layers.

Whatever cannot be placed is an ``UnsupportedArchitecture`` naming the module and the model
(:func:`refuse`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from interp_engine import UnsupportedArchitecture

from ._families import verified_model_types

_ATTN_NAME = re.compile(r"attn|attention", re.IGNORECASE)
_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)
_Q_NAME = re.compile(r"^(q|query)(_|$)|^q[a-z]*norm", re.IGNORECASE)
_K_NAME = re.compile(r"^(k|key)(_|$)|^k[a-z]*norm", re.IGNORECASE)


def _where(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (model_type {getattr(config, 'model_type', '?')!r})"


def refuse(model: nn.Module, what: str) -> UnsupportedArchitecture:
    verified = ", ".join(verified_model_types())
    return UnsupportedArchitecture(
        f"the eager backend cannot serve {_where(model)}: {what}. "
        f"(It resolves architectures from their module tree; model types verified on it: {verified}.)"
    )


# -- static: the module tree ------------------------------------------------------------------


def linear_io(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer (a module with a 2-D ``weight``), else ``None``."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return None
    if not isinstance(module, nn.Linear) and _NORM_CLASS.search(type(module).__name__):
        return None
    if hasattr(module, "nf") and not isinstance(module, nn.Linear):  # GPT-2's Conv1D: weight [in, out]
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def is_norm(module: nn.Module) -> bool:
    """A normalisation module: torch's norms, or a class named ``*Norm*`` that is no linear layer
    (Cohere's per-head q/k ``LayerNorm`` keeps a ``[heads, d_head]`` weight)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    return bool(_NORM_CLASS.search(type(module).__name__)) and not isinstance(module, (nn.Linear, nn.Embedding))


def _n_layers(config: Any) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


def _find_attention(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The shallowest submodule of ``layer`` named or classed like an attention, holding linear layers."""
    frontier = list(_children(layer))
    while frontier:
        found = [
            (name, m)
            for name, m in frontier
            if (_ATTN_NAME.search(name.rsplit(".", 1)[-1]) or _ATTN_NAME.search(type(m).__name__))
            and any(linear_io(sub) for sub in m.modules())
        ]
        if found:
            return found[0]
        frontier = [(f"{name}.{n}", c) for name, m in frontier for n, c in m.named_children()]
    return None


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    expected = _n_layers(model.config)
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        if expected is not None and len(module) != expected:
            continue
        if _find_attention(module[0]) is not None:
            return name, module
    raise refuse(
        model,
        f"no nn.ModuleList of {expected or 'N'} decoder layers of one class, each holding an attention module",
    )


@dataclass
class Mlp:
    """One layer's MLP, paths relative to the layer."""

    block: str  # the module whose input is mlp_in and output mlp_out ("" for a flat layer: see in_/out)
    mlp_in: str
    mlp_out: str
    inputs: list[str] = field(default_factory=list)  # dense: the input projections
    down: str | None = None
    fused: bool = False  # one input projection holding [gate | up]
    router: str | None = None
    experts: str | None = None
    n_experts: int = 0


def _linears(root: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> list[tuple[str, tuple[int, int]]]:
    out = []
    for name, m in root.named_modules(prefix=prefix):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        io = linear_io(m)
        if io is not None:
            out.append((name, io))
    return out


def _find_router(block: nn.Module, prefix: str, d_model: int) -> tuple[str, str, int] | None:
    """``(router, experts, n_experts)`` inside an MoE block: a ``[n_experts, d_model]`` weight's owner,
    and a module whose parameters have a leading ``n_experts`` axis (or a list of ``n_experts`` modules)."""
    for rname, router in block.named_modules(prefix=prefix):
        weight = getattr(router, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or int(weight.shape[1]) != d_model:
            continue
        n = int(weight.shape[0])
        if n < 2:
            continue
        for ename, experts in block.named_modules(prefix=prefix):
            if experts is router or not ename:
                continue
            params = list(experts.parameters(recurse=False))
            stacked = any(p.dim() == 3 for p in params) and all(p.dim() >= 2 and int(p.shape[0]) == n for p in params)
            listed = isinstance(experts, nn.ModuleList) and len(experts) == n
            if stacked or listed:
                return rname, ename, n
    return None


def _find_mlp(model: nn.Module, layer: nn.Module, attn: str, d_model: int) -> Mlp:
    where = type(layer).__name__
    candidates = []
    flat = []
    for name, child in _children(layer):
        if name == attn or attn.startswith(name + ".") or is_norm(child):
            continue
        io = linear_io(child)
        if io is not None:
            flat.append((name, io))
            continue
        if any(io[1] == d_model for _, io in _linears(child, name)) or _find_router(child, name, d_model):
            candidates.append((name, child))
    if len(candidates) > 1:
        names = ", ".join(n for n, _ in candidates)
        raise refuse(model, f"{where} has more than one MLP-like module ({names})")
    if not candidates:
        flat_ins = [n for n, io in flat if io[0] == d_model]
        flat_downs = [n for n, io in flat if io[1] == d_model]
        if len(flat_downs) != 1 or not flat_ins:
            raise refuse(model, f"could not find the MLP of {where} (no module with a projection back to d_model)")
        return Mlp("", flat_ins[0], flat_downs[0], inputs=flat_ins, down=flat_downs[0])
    name, block = candidates[0]
    routed = _find_router(block, name, d_model)
    if routed is not None:
        router, experts, n = routed
        return Mlp(name, name, name, router=router, experts=experts, n_experts=n)
    linears = _linears(block, name)
    downs = [(n, io) for n, io in linears if io[1] == d_model]
    if len(downs) != 1:
        raise refuse(model, f"the MLP {name} of {where} has {len(downs)} projections back to d_model, not one")
    down, (hidden, _) = downs[0]
    ins = [(n, io) for n, io in linears if io[0] == d_model and n != down]
    if len(ins) == 1 and ins[0][1][1] == 2 * hidden:
        return Mlp(name, name, name, inputs=[ins[0][0]], down=down, fused=True)
    ins = [(n, io) for n, io in ins if io[1] == hidden]
    if len(ins) not in (1, 2):
        raise refuse(model, f"could not place the input projections of the MLP {name} of {where}")
    return Mlp(name, name, name, inputs=[n for n, _ in ins], down=down)


def _outer_norms(root: nn.Module) -> list[str]:
    """Norm modules under ``root``, not those inside another norm (StableLM's per-head norms)."""
    found: list[str] = []
    for name, m in root.named_modules():
        if name and is_norm(m) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


@dataclass
class Static:
    layers: str
    attn: str
    attn_linears: list[tuple[str, tuple[int, int]]]
    attn_norms: list[str]
    layer_norms: list[str]  # norm-classed modules of the layer outside attention and MLP
    mlps: list[Mlp]  # per layer
    final_norm: str | None
    d_model: int


def resolve_static(model: nn.Module) -> Static:
    """The module-tree pass (works on a ``meta``-device model: no forward)."""
    config: Any = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(model, "it is an encoder-decoder model; the eager backend serves decoder-only causal LMs")
    layers_path, layers = _find_layers(model)
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if embed is None or getattr(embed, "weight", None) is None:
        raise refuse(model, "it has no input embedding")
    d_model = int(getattr(config, "hidden_size", None) or embed.weight.shape[1])  # the residual width
    if model.get_output_embeddings() is None:  # type: ignore[operator]
        raise refuse(model, "it has no output embedding (unembedding)")
    found = _find_attention(layers[0])
    if found is None:  # pragma: no cover - _find_layers checked it
        raise refuse(model, f"no attention module in {type(layers[0]).__name__}")
    attn_path, attn = found
    mlps = []
    for index, layer in enumerate(layers):
        here = _find_attention(layer)
        if here is None or here[0] != attn_path:
            raise refuse(model, f"layer {index} has no attention module at {attn_path}")
        mlps.append(_find_mlp(model, layer, attn_path, d_model))
    mlp_paths = {p for m in mlps for p in (m.block, m.mlp_in, m.mlp_out) if p}
    layer_norms = [
        name
        for name in _outer_norms(layers[0])
        if not (name == attn_path or name.startswith(attn_path + "."))
        and not any(name == p or name.startswith(p + ".") for p in mlp_paths)
    ]
    attn_norms = [f"{attn_path}.{n}" for n in _outer_norms(attn)]
    # the final norm: a norm-classed child of the module holding the layers
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    parent = model.get_submodule(parent_path) if parent_path else model
    finals = [n for n, m in _children(parent, parent_path) if is_norm(m)]
    return Static(
        layers=layers_path,
        attn=attn_path,
        attn_linears=_linears(attn, attn_path),
        attn_norms=attn_norms,
        layer_norms=layer_norms,
        mlps=mlps,
        final_norm=finals[-1] if finals else None,
        d_model=d_model,
    )
