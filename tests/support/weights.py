"""Where each family's weights live in its HF model: the names the weight tests read by hand."""

from __future__ import annotations

from typing import Any

import torch

from interp_testkit.suite import hf_for, vllm_model_path


def _module(hf: Any, path: str) -> Any:
    module = hf
    for part in path.split("."):
        module = getattr(module, part)
    return module


def hf_parameters(family: str, layer: int) -> dict[str, torch.Tensor]:
    hf = hf_for(vllm_model_path(family))
    names = HF_NAMES[family]
    config = hf.config
    heads, d_model = int(config.num_attention_heads), int(config.hidden_size)
    o = _module(hf, names["o"].format(layer))
    matrix = o.weight if names.get("conv1d") else o.weight.T
    norm = _module(hf, names["norm"])
    out = {
        "W_E": _module(hf, names["embed"]).weight,
        "W_U": _module(hf, names["unembed"]).weight.T,
        "W_O": matrix.reshape(heads, -1, d_model),
        "ln_final.w": norm.weight,
    }
    if o.bias is not None:
        out["b_O"] = o.bias
    if getattr(norm, "bias", None) is not None:
        out["ln_final.b"] = norm.bias
    return {name: value.detach() for name, value in out.items()}


HF_NAMES: dict[str, dict[str, Any]] = {
    # embed, unembed, output projection (per layer), whether it is a Conv1D ([in, out]), final norm
    "gpt2": {
        "embed": "transformer.wte",
        "unembed": "lm_head",
        "o": "transformer.h.{}.attn.c_proj",
        "conv1d": True,
        "norm": "transformer.ln_f",
        "kind": "layernorm",
        "tied": True,
    },
    "llama": {
        "embed": "model.embed_tokens",
        "unembed": "lm_head",
        "o": "model.layers.{}.self_attn.o_proj",
        "norm": "model.norm",
        "kind": "rmsnorm",
    },
    "gpt_neox": {
        "embed": "gpt_neox.embed_in",
        "unembed": "lm_head",
        "o": "gpt_neox.layers.{}.attention.dense",
        "norm": "gpt_neox.final_layer_norm",
        "kind": "layernorm",
    },
    "phi3": {
        "embed": "model.embed_tokens",
        "unembed": "lm_head",
        "o": "model.layers.{}.self_attn.o_proj",
        "norm": "model.norm",
        "kind": "rmsnorm",
    },
    "falcon": {
        "embed": "transformer.word_embeddings",
        "unembed": "lm_head",
        "o": "transformer.h.{}.self_attention.dense",
        "norm": "transformer.ln_f",
        "kind": "layernorm",
        "tied": True,
    },
    "gemma2": {
        "embed": "model.embed_tokens",
        "unembed": "lm_head",
        "o": "model.layers.{}.self_attn.o_proj",
        "norm": "model.norm",
        "kind": "rmsnorm",
        "offset": 1.0,
        "tied": True,
        "softcap": 30.0,
    },
    "phi": {
        "embed": "model.embed_tokens",
        "unembed": "lm_head",
        "o": "model.layers.{}.self_attn.dense",
        "norm": "model.final_layernorm",
        "kind": "layernorm",
    },
    "cohere": {
        "embed": "model.embed_tokens",
        "unembed": "lm_head",
        "o": "model.layers.{}.self_attn.o_proj",
        "norm": "model.norm",
        "kind": "layernorm",
        "tied": True,
        "scale": 0.0625,
    },
}
