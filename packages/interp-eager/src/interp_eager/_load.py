"""Loading an HF causal LM and its tokenizer for the eager backend: the options it takes, the
dtype names, and the attention implementation a family needs to be read."""

from __future__ import annotations

import os
from typing import Any

import torch

from interp_engine import InvalidOption, ModelLoadError

from ._model import EagerModel
from ._resolve import resolve, resolve_config

LOAD_OPTIONS = ("attn_implementation", "device", "dtype", "revision", "tokenizer", "trust_remote_code")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


def _dtype(value: Any) -> torch.dtype | str:
    if isinstance(value, torch.dtype) or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise InvalidOption(f"unknown dtype {value!r}; use a torch.dtype, 'auto' or one of {', '.join(_DTYPES)}")


def load(name_or_path: str, options: dict[str, Any]) -> EagerModel:
    """Load an HF causal LM and its tokenizer by hub id or local path."""
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        raise InvalidOption(
            f"the eager backend does not take {', '.join(unknown)}; valid options: {', '.join(LOAD_OPTIONS)}"
        )
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    trust = bool(options.get("trust_remote_code", False))
    revision = options.get("revision")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust, revision=revision)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read a model config from {name_or_path!r}: {exc}") from exc
    resolve_config(config, trust)  # an unresolvable module tree fails before any weights load
    kwargs: dict[str, Any] = {"dtype": _dtype(options.get("dtype", "float32")), "revision": revision}
    if options.get("attn_implementation"):
        kwargs["attn_implementation"] = options["attn_implementation"]
    elif getattr(config, "attn_logit_softcapping", None) or not _can_switch_attention(config):
        # SDPA kernels skip attention-logit soft-capping (Gemma 2): only eager computes the model;
        # a model that cannot switch to eager attention at run time (Falcon) loads with it, so that
        # its patterns and scores can be read.
        kwargs["attn_implementation"] = "eager"
    try:
        hf_model: Any = AutoModelForCausalLM.from_pretrained(name_or_path, trust_remote_code=trust, **kwargs)
        family = resolve(hf_model)  # the traced checks, before the tokenizer loads
        tokenizer_source = options.get("tokenizer") or name_or_path
        tokenizer = (
            AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust, revision=revision)
            if isinstance(tokenizer_source, (str, os.PathLike))
            else tokenizer_source
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load the model or tokenizer from {name_or_path!r}: {exc}") from exc
    device = options.get("device")
    if device is not None:
        try:
            hf_model.to(device=torch.device(device))
        except (RuntimeError, AssertionError) as exc:
            raise InvalidOption(f"cannot place the model on device {device!r}: {exc}") from exc
    return EagerModel(hf_model, tokenizer, family=family)


def _can_switch_attention(config: Any) -> bool:
    """Whether transformers can switch ``config``'s causal LM to eager attention at run time."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        return bool(cls._can_set_attn_implementation())
    except Exception:  # a remote-code or unmapped config: the load itself will tell
        return True
