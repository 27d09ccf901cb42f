"""Resolve a loaded HF causal LM into a :class:`~interp_eager._families.Family` from its structure.

Nothing here is keyed by ``model_type`` except :data:`~interp_eager._families.FAMILY_DATA` (what
structure cannot tell). Resolution has two passes:

*Static* (:func:`~interp_eager._tree.resolve_static`, also run on a weightless ``meta`` copy
before weights load, :func:`resolve_config`): the decoder layers, each layer's attention, MLP
(or router and experts) and norms, the final norm, from the module tree.

*Traced* (:func:`resolve`): one forward over a few tokens with hooks on every module
(:mod:`interp_eager._trace`) records what each receives and returns, and one resolver per part
decides what names cannot:

- the attention (:mod:`interp_eager._resolve_attention`): where its attention function is read,
  its heads, its output projection, where its values are made;
- the MLP and router (:mod:`interp_eager._resolve_mlp`): gate and linear branch, down projection,
  sub-norm; a mixture of experts' router logits and the experts' arguments;
- the norms (:mod:`interp_eager._resolve_norms`): q/k norms and sub-norms, sandwich norms and
  post-norm blocks, parallel blocks, and the residual identity;
- the logits (:mod:`interp_eager._resolve_logits`): the final norm, a projection between it and the
  unembedding, a constant logit scale.

Whatever cannot be placed is an ``UnsupportedArchitecture`` naming the module and the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from interp_engine import UnsupportedArchitecture

from ._families import FAMILY_DATA, Family
from ._resolve_attention import resolve_attention, trace_model
from ._resolve_logits import resolve_logits
from ._resolve_mlp import resolve_mlp
from ._resolve_norms import resolve_attention_norms, resolve_residual
from ._tree import refuse, resolve_static


def resolve(model: nn.Module) -> Family:
    """The :class:`Family` of a loaded HF causal LM, from its structure and one traced forward."""
    was_training = model.training
    model.eval()  # the traced forwards run without dropout
    try:
        return _resolve(model)
    except UnsupportedArchitecture:
        raise
    except Exception as exc:  # a config or module this resolver does not understand: say what broke
        raise refuse(model, f"resolving it failed ({type(exc).__name__}: {exc})") from exc
    finally:
        model.train(was_training)


def _resolve(model: nn.Module) -> Family:
    static = resolve_static(model)
    config: Any = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    traced = trace_model(model, static)
    attention = resolve_attention(traced)
    norms = resolve_attention_norms(traced, attention)
    mlp = resolve_mlp(traced, attention.output)
    residual = resolve_residual(traced, attention.output, mlp.fields["mlp_in"], mlp.output)
    return Family(
        name=model_type,
        model_types=(model_type,),
        layers=static.layers,
        attn=static.attn,
        attn_score_divisor=FAMILY_DATA.get(model_type, {}).get("attn_score_divisor"),
        **attention.fields,
        **norms,
        **mlp.fields,
        **residual,
        **resolve_logits(traced),
    )


def resolve_config(config: Any, trust_remote_code: bool = False) -> None:
    """Check, before any weights load, that the module tree of ``config``'s model resolves (built on the
    ``meta`` device: no memory, no forward). The traced checks run once the weights are loaded."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, trust_remote_code=trust_remote_code
            )
    except (ValueError, KeyError) as exc:  # no causal LM class for this config
        raise UnsupportedArchitecture(
            f"the eager backend cannot serve model_type {getattr(config, 'model_type', None)!r}: "
            f"transformers has no causal LM for it ({exc})"
        ) from exc
    except Exception:  # a model that cannot be built weightless: the load itself will tell
        return
    resolve_static(model)
