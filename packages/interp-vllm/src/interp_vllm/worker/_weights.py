"""The vllm backends' weights, read from the served model in its workers (the front end joins
them: :mod:`..frontend._weights`).

Each worker answers for what its pipeline stage holds and sends its tensor-parallel shard:

- ``W_E`` (the first stage's input embedding), ``W_U`` and ``b_U`` (the last stage's unembedding)
  are vocabulary-parallel: a rank holds the ids ``[org_vocab_start_index, org_vocab_end_index)``
  of its ``shard_indices`` (its padding rows are dropped), sent with their positions in the answer;
- ``W_O`` of a layer (the stage holding it) is the row-parallel output projection: a rank holds the
  input columns of its heads (``weight [d_model, heads_here * d_head]``), joined by rank order;
  ``b_O`` is not split (rank 0's is the one added);
- the final norm (last stage) is replicated; its kind, ``eps`` and weight offset are probed from
  the module (:func:`interp_engine._weights.probe_norm`), as on eager.

What a stage holds crosses the process boundary as a ``_wire.WeightsHeld``, the weights as
safetensors bytes (``_wire.pack``), float32.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from interp_engine import BackendError
from interp_engine.backend import norm_parameters, probe_norm

from .._wire import FinalNorm, WeightsHeld
from ..hooks import attr_path, copy_rows


def _vocab_size(state: Any) -> int:
    config = state.runner.model_config.hf_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def input_embedding(state: Any) -> Any:
    """This stage's input embedding (vocabulary-parallel, the model's vocabulary size, not the
    ``ParallelLMHead``), or ``None`` on a stage that has none."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    vocab = _vocab_size(state)
    for _, module in state.model.named_modules():
        if (
            isinstance(module, VocabParallelEmbedding)
            and not isinstance(module, ParallelLMHead)
            and int(module.org_vocab_size) == vocab
        ):
            return module
    return None


def _unembedding(state: Any) -> Any:
    return attr_path(state.model, state.family.unembed) if state.last_stage and state.family.unembed else None


def _output_projection(state: Any, layer: int) -> Any:
    return attr_path(state.layers[layer], state.family.attn_o_proj)


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def worker_info(state: Any) -> WeightsHeld:
    """What this worker's stage holds of the weights (``interp_weight_info``'s answer; ``state``: the
    taps' :class:`~._state.TapState`)."""
    param = next(state.model.parameters())
    held = WeightsHeld(
        pp_rank=state.pp_rank,
        rank=state.rank,
        dtype=str(param.dtype).removeprefix("torch."),
        embed=input_embedding(state) is not None,
        o_bias=all(_bias(_output_projection(state, layer)) is not None for layer in state.owned),
    )
    unembed = _unembedding(state)
    if unembed is None:
        return held
    embed = input_embedding(state)
    processor = getattr(state.model, "logits_processor", None)
    scale = getattr(processor, "scale", 1.0)
    cap = getattr(processor, "soft_cap", None)
    held = msgspec.structs.replace(
        held,
        tied=None if embed is None else getattr(unembed, "weight", None) is getattr(embed, "weight", None),
        unembed_bias=_bias(unembed) is not None,
        logit_scale=float(scale) if isinstance(scale, (int, float)) else 1.0,
        softcap=float(cap) if isinstance(cap, (int, float)) and cap else None,
    )
    norm = attr_path(state.model, state.family.final_norm)
    found = probe_norm(  # its own forward, not a call: the taps' hooks on the norm never see the probe
        norm.forward,
        norm,
        d_model=int(state.runner.model_config.get_hidden_size()),
        device=param.device,
        dtype=param.dtype,
        config=state.runner.model_config.hf_config,
    )
    if found is None:
        return msgspec.structs.replace(
            held,
            norm_error=(
                f"the final norm {type(norm).__name__} computes neither a LayerNorm nor an RMSNorm (with or "
                "without a 1 + w weight): its weights cannot be described"
            ),
        )
    return msgspec.structs.replace(
        held,
        norm=FinalNorm(
            kind=found.kind,
            eps=float(found.eps),
            offset=float(found.weight_offset),
            weight=found.weight is not None,
            bias=found.bias is not None,
        ),
    )


def worker_weight(state: Any, name: str, layer: int | None, vocab: list[int] | None) -> dict[str, torch.Tensor]:
    """This worker's part of a checked weight (empty where its stage does not hold it)."""
    with torch.no_grad():
        if name == "W_E":
            embed = input_embedding(state)
            return {} if embed is None else _vocab_rows(embed, embed.weight, vocab)
        if name in ("W_U", "b_U"):
            unembed = _unembedding(state)
            if unembed is None:
                return {}
            table = unembed.weight if name == "W_U" else _bias(unembed)
            if not isinstance(table, torch.Tensor):
                raise BackendError(f"the unembedding {type(unembed).__name__} has no {name}")
            return _vocab_rows(unembed, table, vocab)
        if name in ("ln_final.w", "ln_final.b"):
            if not state.last_stage:
                return {}
            weight, bias = norm_parameters(attr_path(state.model, state.family.final_norm))
            value = weight if name == "ln_final.w" else bias
            if value is None:
                raise BackendError(f"the final norm has no {name}")
            return {"values": copy_rows(value)}
        if layer is None or layer not in state.owned:
            return {}
        projection = _output_projection(state, layer)
        if name == "b_O":
            bias = _bias(projection)
            if bias is None:
                raise BackendError(f"the output projection of layer {layer} has no bias")
            return {"values": copy_rows(bias)}
        matrix = linear_matrix(projection)  # [this rank's heads * d_head, d_model]
        return {"values": copy_rows(matrix.reshape(-1, state.d_head, matrix.shape[1]))}


def linear_matrix(module: Any) -> torch.Tensor:
    """The ``[in, out]`` matrix of this rank's part of a vLLM linear layer (``out = in @ M``,
    without bias). Its ``weight`` is ``[out, in]``; vLLM's CPU build repacks linear weights for its
    GEMM kernels and drops ``weight`` (an empty tensor), and then the map is read by applying the
    layer's own kernel (``quant_method.apply``, no all-reduce, no bias) to the identity: each
    output is one weight times 1.0, exact."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0:
        return weight.T
    method = getattr(module, "quant_method", None)
    width = getattr(module, "input_size_per_partition", None)
    if method is None or not isinstance(width, int):
        raise BackendError(f"cannot read the weights of {type(module).__name__}: no weight and no kernel to apply")
    dtype = getattr(module, "params_dtype", None) or torch.float32
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    identity = torch.eye(width, dtype=dtype, device=device)
    matrix: torch.Tensor = method.apply(module, identity)
    return matrix


def _vocab_rows(module: Any, table: torch.Tensor, vocab: list[int] | None) -> dict[str, torch.Tensor]:
    """The rows of a vocabulary-parallel ``table`` this rank holds, with their positions in the
    answer (the ids themselves for the whole table; else indices into ``vocab``)."""
    shard = module.shard_indices
    start, end = int(shard.org_vocab_start_index), int(shard.org_vocab_end_index)
    if vocab is None:
        positions = torch.arange(start, end)
        local = torch.arange(0, end - start)
    else:
        held = [(i, v - start) for i, v in enumerate(vocab) if start <= v < end]
        positions = torch.tensor([i for i, _ in held], dtype=torch.long)
        local = torch.tensor([j for _, j in held], dtype=torch.long)
    return {"positions": positions, "values": copy_rows(table[local.to(table.device)])}
