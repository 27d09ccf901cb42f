"""The eager backend's weights: the HF model's own parameters, by TransformerLens name.

``W_E`` is the input embedding's table, ``W_U`` the output embedding's matrix read as
``[d_model, d_vocab]`` (GPT-2's ``Conv1D`` stores ``[in, out]``, ``nn.Linear`` ``[out, in]``),
``W_O`` the resolved output projection's matrix (whose input is ``attn_z``) split by head, and the
final norm's kind, ``eps`` and weight offset are what its module computes (probed, not named).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from interp_engine import ModelInfo, UnsupportedArchitecture
from interp_engine.backend import WEIGHT_NAMES, WeightInfo, probe_norm

from ._sites import Architecture, _maybe


def _unwrapped(module: nn.Module) -> nn.Module:
    """The layer a PEFT LoRA layer wraps (``base_layer``; weights are the base model's), else ``module``."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) and hasattr(module, "lora_A") else module


def _matrix(module: nn.Module) -> torch.Tensor:
    """The ``[in, out]`` matrix of a linear layer (``out = in @ M + bias``)."""
    module = _unwrapped(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UnsupportedArchitecture(f"{type(module).__name__} has no 2-D weight to read as a linear map")
    if hasattr(module, "nf") and not isinstance(module, nn.Linear):  # GPT-2's Conv1D: [in, out]
        return weight
    return weight.T


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(_unwrapped(module), "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _copy(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to("cpu", torch.float32, copy=True)


def weight_info(hf_model: nn.Module, arch: Architecture, info: ModelInfo) -> WeightInfo:
    """What this model serves (:class:`~interp_engine.analysis._weights.WeightInfo`)."""
    param = next(hf_model.parameters())
    embed = hf_model.get_input_embeddings()  # type: ignore[operator]
    names = {"W_E", "W_U", "W_O"}
    if _bias(arch.unembed) is not None:
        names.add("b_U")
    outputs = [arch.layer_module(layer, arch.family.attn_o) for layer in range(len(arch.layers))]
    if all(_bias(o) is not None for o in outputs):
        names.add("b_O")
    norm, eps, offset = "none", 0.0, 0.0
    if arch.final_norm is not None:
        # its own forward, not a call: a concurrent request's hooks on the norm never see the probe
        found = probe_norm(
            arch.final_norm.forward,
            arch.final_norm,
            d_model=info.d_model,
            device=param.device,
            dtype=param.dtype,
            config=hf_model.config,
        )
        if found is None:
            raise UnsupportedArchitecture(
                f"the final norm {type(arch.final_norm).__name__} computes neither a LayerNorm nor an RMSNorm "
                "(with or without a 1 + w weight): its weights cannot be described"
            )
        norm, eps, offset = found.kind, found.eps, found.weight_offset
        if found.weight is not None:
            names.add("ln_final.w")
        if found.bias is not None:
            names.add("ln_final.b")
    config: Any = hf_model.config
    cap = getattr(config, "final_logit_softcapping", None)
    unembed_weight = getattr(arch.unembed, "weight", None)
    return WeightInfo(
        names=tuple(n for n in WEIGHT_NAMES if n in names),
        norm=norm,  # type: ignore[arg-type]
        norm_eps=eps,
        norm_weight_offset=offset,
        tied=unembed_weight is embed.weight,
        logit_scale=float(arch.family.logit_multiplier),
        logit_softcap=float(cap) if cap else None,
        dtype=str(param.dtype).removeprefix("torch."),
        unembed_inputs=tuple(p for p in arch.family.before_unembed if _maybe(hf_model, p) is not None),
        residual_multiplier=float(arch.family.residual_multiplier),
    )


def read_weight(
    hf_model: nn.Module, arch: Architecture, info: ModelInfo, name: str, layer: int | None, vocab: list[int] | None
) -> torch.Tensor:
    """A float32 CPU copy of a checked weight name (``layer`` non-negative for per-layer ones)."""
    with torch.no_grad():
        if name == "W_E":
            table: torch.Tensor = hf_model.get_input_embeddings().weight  # type: ignore[operator]
            return _copy(table if vocab is None else table[vocab])
        if name == "W_U":
            matrix = _matrix(arch.unembed)
            return _copy(matrix if vocab is None else matrix[:, vocab])
        if name == "b_U":
            bias = _bias(arch.unembed)
            if bias is None:  # pragma: no cover - weight_info lists b_U only with a bias
                raise UnsupportedArchitecture("the unembedding has no bias")
            return _copy(bias if vocab is None else bias[vocab])
        if name in ("ln_final.w", "ln_final.b"):
            value = getattr(arch.final_norm, "weight" if name == "ln_final.w" else "bias", None)
            if not isinstance(value, torch.Tensor):  # pragma: no cover - weight_info lists it only when present
                raise UnsupportedArchitecture(f"the final norm has no {name}")
            return _copy(value)
        if layer is None:  # pragma: no cover - checked by check_weight_request
            raise UnsupportedArchitecture(f"{name} needs a layer")
        out = arch.layer_module(layer, arch.family.attn_o)
        if name == "b_O":
            bias = _bias(out)
            if bias is None:  # pragma: no cover - weight_info lists b_O only with a bias
                raise UnsupportedArchitecture(f"the output projection of layer {layer} has no bias")
            return _copy(bias)
        matrix = _matrix(out)
        width = info.n_heads * info.d_head
        if matrix.shape != (width, info.d_model):
            raise UnsupportedArchitecture(
                f"the output projection of layer {layer} maps {matrix.shape[0]} features to {matrix.shape[1]}, "
                f"not {info.n_heads} heads x {info.d_head} to d_model {info.d_model}"
            )
        return _copy(matrix.reshape(info.n_heads, info.d_head, info.d_model))
