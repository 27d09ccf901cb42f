"""Resolve where a vLLM model keeps what interp-engine reads and writes, from its module tree.

No hand list of architectures: :func:`resolve` looks at the model vLLM built (natively, or
through its Transformers modeling backend, which keeps HF's modules and swaps in vLLM's linear
layers and attention) and finds, by class and by data flow:

- the decoder-layer list (the ``ModuleList`` of ``num_hidden_layers`` blocks holding vLLM's
  attention kernels) and the final norm (the norm beside it);
- in a layer, traced with every child as a leaf (``torch.fx``, as vLLM's Transformers backend
  traces modules): the argument that carries the hidden states, whether the layer defers the
  residual add (takes and returns ``(hidden, residual)``), the attention child (the one holding
  vLLM's ``Attention`` kernel), the MLP child, the norms applied to their outputs before the
  residual add (sandwich / post norms: Gemma 2/3, OLMo 2), whether the MLP reads the attention's
  result (sequential) or the layer input (parallel residual: GPT-NeoX, GPT-J, Falcon, Phi), and the
  constant each sublayer's output is scaled by before the add (Granite's residual multiplier:
  ``attn_out``/``mlp_out`` are read after it, as added);
- in the attention child: the kernel, the output projection (the ``RowParallelLinear``: its input
  is every head's output), the q/k norms;
- in the MLP child: the down projection (``RowParallelLinear``) and the up projection
  (``MergedColumnParallelLinear`` of ``[gate | up]``: gated; ``ColumnParallelLinear``: not); or,
  for a mixture of experts, vLLM's fused-MoE runner and the router (the gate linear whose output
  has one logit per expert).

What structure cannot tell is data in :data:`FAMILY_DATA`. A module the resolver cannot place
raises ``UnsupportedArchitecture`` naming it. The front end resolves a model before any engine
starts (:func:`resolve_without_weights`), on the module tree :mod:`._meta_model` builds without
weights.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from interp_engine import UnsupportedArchitecture

from ._families import VllmFamily
from ._meta_model import built_without_weights
from ._sites import gate_activation

FAMILY_DATA: dict[str, dict[str, Any]] = {}
"""Per vLLM model class name: :class:`VllmFamily` fields structure cannot tell (none needed by
the families resolved so far: soft-caps, scales and windows are read from vLLM's own modules)."""

_POSITION_ARGS = frozenset({"positions", "position_ids", "position_embeddings", "attention_mask", "residual"})


def _classes() -> dict[str, Any]:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return {
        "kernel": AttentionLayerBase,
        "moe": MoERunnerInterface,
        "linear": LinearBase,
        "column": ColumnParallelLinear,
        "merged": MergedColumnParallelLinear,
        "qkv": QKVParallelLinear,
        "row": RowParallelLinear,
        "embedding": VocabParallelEmbedding,
    }


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer (vLLM's ``RMSNorm``/``LayerNorm``/``GemmaRMSNorm``, ``nn.LayerNorm``,
    the Transformers backend's norms): a module whose class name says so and that has no
    parameterised children."""
    name = type(module).__name__
    if "Norm" not in name or "Gated" in name:
        return False
    return all(next(child.parameters(), None) is None for child in module.children())


def _is_passthrough(module: nn.Module) -> bool:
    """Modules that leave a value as it is at inference (dropout, identity)."""
    return isinstance(module, (nn.Dropout, nn.Identity)) and next(module.parameters(), None) is None


def _subtree_has(module: nn.Module, cls: Any) -> bool:
    return any(isinstance(m, cls) for m in module.modules())


def _paths(module: nn.Module, cls: Any) -> list[str]:
    return [name for name, m in module.named_modules() if name and isinstance(m, cls)]


def _unsupported(model: nn.Module, what: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"the vllm backend cannot resolve vLLM's {type(model).__name__}: {what}. "
        "Use the eager backend for this model, or report the architecture."
    )


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


@dataclass
class _Layer:
    """What the trace of one decoder layer says."""

    hidden_arg: tuple[int, str]
    residual_arg: tuple[int, str] | None
    attn: str
    mlp: str
    """The MLP module ("": the layer holds its projections itself)."""
    mlp_in_at: str
    mlp_out_at: str
    attn_post_norm: str | None
    mlp_post_norm: str | None
    parallel: bool
    attn_scale: float
    mlp_scale: float


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder" and not str(n.target).startswith("*")]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _consumers(node: fx.Node, layer: nn.Module) -> Iterator[tuple[fx.Node, float]]:
    """The nodes ``node``'s value (its element 0 when it is a tuple) reaches through getitem 0,
    pass-through modules and multiplications by a constant, with the constant's product."""
    stack: list[tuple[fx.Node, float]] = [(node, 1.0)]
    while stack:
        current, scale = stack.pop()
        for user in current.users:
            if user.op == "call_function" and user.target is operator.getitem:
                if user.args[1] == 0:
                    stack.append((user, scale))
                continue
            if user.op == "call_module" and _is_passthrough(_get(layer, str(user.target))):
                stack.append((user, scale))
                continue
            if user.op == "call_function" and user.target in (operator.mul, operator.truediv):
                other = user.args[1] if user.args[0] is current else user.args[0]
                if isinstance(other, (int, float)):
                    factor = float(other) if user.target is operator.mul else 1.0 / float(other)
                    stack.append((user, scale * factor))
                    continue
            yield user, scale


def _trace_layer(model: nn.Module, layer: nn.Module, classes: dict[str, Any]) -> _Layer:
    from vllm.model_executor.models.transformers.fx_utils import trace

    graph = trace(layer)
    name = type(layer).__name__
    if graph is None:
        raise _unsupported(model, f"its decoder layer {name} could not be traced")
    children = dict(layer.named_children())
    calls = [n for n in graph.nodes if n.op == "call_module" and str(n.target) in children]
    attn_nodes = [n for n in calls if _subtree_has(children[str(n.target)], classes["kernel"])]
    if len(attn_nodes) != 1:
        raise _unsupported(model, f"{name} calls {len(attn_nodes)} modules holding an attention kernel, not one")
    attn_node = attn_nodes[0]
    mlp_nodes = [
        n
        for n in calls
        if n is not attn_node
        and not is_norm(children[str(n.target)])
        and (
            _subtree_has(children[str(n.target)], classes["linear"])
            or _subtree_has(children[str(n.target)], classes["moe"])
        )
    ]
    inline = (  # the layer holds the MLP's two projections itself (OPT's fc1, fc2)
        len(mlp_nodes) == 2
        and isinstance(children[str(mlp_nodes[0].target)], classes["column"])
        and isinstance(children[str(mlp_nodes[1].target)], classes["row"])
    )
    if len(mlp_nodes) != 1 and not inline:
        found = ", ".join(str(n.target) for n in mlp_nodes) or "none"
        raise _unsupported(model, f"{name} has no single MLP module beside its attention (found: {found})")
    mlp_node, mlp_exit = mlp_nodes[0], mlp_nodes[-1]
    placeholders = _placeholders(graph)
    names = [str(p.target) for p in placeholders]
    feeding = _ancestors(attn_node)
    hidden = [p for p in placeholders if p in feeding and str(p.target) not in _POSITION_ARGS]
    if "hidden_states" in names:
        hidden_name = "hidden_states"
    elif hidden:
        hidden_name = str(hidden[0].target)
    else:
        raise _unsupported(model, f"no argument of {name}.forward carries the hidden states into its attention")
    # a layer defers the residual add when it reads the residual it is given (Llama's add-norm);
    # one that overwrites it unread (Cohere, EXAONE 4: ``residual = hidden_states``) returns the
    # whole stream as its first output, like a layer without the argument
    residual_arg = None
    if "residual" in names and placeholders[names.index("residual")].users:
        residual_arg = (names.index("residual"), "residual")

    def post_norm(node: fx.Node) -> tuple[str | None, float]:
        for user, scale in _consumers(node, layer):
            if user.op == "call_module" and is_norm(children.get(str(user.target), nn.Module())):
                tensors = [a for a in user.args if isinstance(a, fx.Node)] + [
                    v for v in user.kwargs.values() if isinstance(v, fx.Node)
                ]
                if len(tensors) == 1:  # a norm of the sublayer's output alone (an add-norm takes the residual too)
                    return str(user.target), scale
            elif user.op == "call_function" and user.target in (operator.add, operator.iadd):
                return None, scale
        return None, 1.0

    def scale_after(norm: str) -> float:  # the scale after a post-norm, if any
        post = next(n for n in graph.nodes if n.op == "call_module" and str(n.target) == norm)
        return next((s for u, s in _consumers(post, layer) if u.op == "call_function"), 1.0)

    attn_post, attn_scale = post_norm(attn_node)
    mlp_post, mlp_scale = post_norm(mlp_exit)
    if attn_post is not None:
        attn_scale = scale_after(attn_post)
    if mlp_post is not None:
        mlp_scale = scale_after(mlp_post)
    return _Layer(
        hidden_arg=(names.index(hidden_name), hidden_name),
        residual_arg=residual_arg,
        attn=str(attn_node.target),
        mlp="" if inline else str(mlp_node.target),
        mlp_in_at=str(mlp_node.target),
        mlp_out_at=str(mlp_exit.target),
        attn_post_norm=attn_post,
        mlp_post_norm=mlp_post,
        parallel=attn_node not in _ancestors(mlp_node),
        attn_scale=attn_scale,
        mlp_scale=mlp_scale,
    )


def _attention(model: nn.Module, attn: nn.Module, prefix: str, classes: dict[str, Any]) -> dict[str, Any]:
    kernels = _paths(attn, classes["kernel"])
    if len(kernels) != 1:
        raise _unsupported(model, f"{type(attn).__name__} holds {len(kernels)} attention kernels, not one")
    out = [n for n, m in attn.named_children() if isinstance(m, classes["row"])]
    if len(out) != 1:
        raise _unsupported(model, f"{type(attn).__name__} has no single output projection (RowParallelLinear)")
    fields: dict[str, Any] = {"attn_kernel": f"{prefix}.{kernels[0]}", "attn_o_proj": f"{prefix}.{out[0]}"}
    for name, module in attn.named_children():
        if not is_norm(module):
            continue
        role = {"q": "q_norm", "k": "k_norm"}.get(name[:1])
        if role is None or role in fields:
            raise _unsupported(model, f"cannot tell what the norm {type(attn).__name__}.{name} normalises")
        fields[role] = f"{prefix}.{name}"
    return fields


def _mlp(model: nn.Module, mlp: nn.Module, prefix: str, classes: dict[str, Any], n_experts: int) -> dict[str, Any]:
    runners = _paths(mlp, classes["moe"])
    if runners:
        if len(runners) != 1:
            raise _unsupported(model, f"{type(mlp).__name__} holds {len(runners)} fused-MoE runners")
        runner = _get(mlp, runners[0])
        gates = [
            n
            for n, m in mlp.named_children()
            if isinstance(m, classes["linear"]) and int(getattr(m, "output_size", -1)) == n_experts
        ]
        gate_path = _join(prefix, gates[0]) if len(gates) == 1 else None
        if gate_path is None and isinstance(getattr(runner, "gate", None), nn.Module):
            gate_path = _join(prefix, f"{runners[0]}.gate")  # the runner applies the router itself
        if gate_path is None:
            raise _unsupported(model, f"{type(mlp).__name__} has no router (a gate linear with {n_experts} outputs)")
        return {"router": gate_path, "experts": _join(prefix, runners[0]), "moe": True}
    down = [n for n, m in mlp.named_children() if isinstance(m, classes["row"])]
    ups = [n for n, m in mlp.named_children() if isinstance(m, classes["column"]) and not isinstance(m, classes["qkv"])]
    if len(down) != 1 or len(ups) != 1:
        raise _unsupported(
            model,
            f"{type(mlp).__name__} is not one up projection (ColumnParallelLinear, or a merged [gate | up]) "
            f"and one down projection (RowParallelLinear): found up {ups}, down {down}",
        )
    up, down_in = _get(mlp, ups[0]), int(getattr(_get(mlp, down[0]), "input_size", 0) or 0)
    # [gate | up]: a merged projection of two, or one projection twice as wide as the down one takes (GLM)
    gated = (isinstance(up, classes["merged"]) and len(getattr(up, "output_sizes", ())) == 2) or (
        down_in > 0 and int(getattr(up, "output_size", 0) or 0) == 2 * down_in
    )
    act = _gate_activation(mlp, (ups[0], down[0]), classes) if gated else None
    return {
        "mlp_up": _join(prefix, ups[0]),
        "mlp_down": _join(prefix, down[0]),
        "gated": gated,
        "mlp_act": _join(prefix, act) if act is not None else None,
    }


def _gate_activation(mlp: nn.Module, projections: tuple[str, str], classes: dict[str, Any]) -> str | None:
    """The child of a gated MLP that turns ``[gate | up]`` into ``act(gate) * up`` (vLLM's
    ``SiluAndMul``, ``GeluAndMul``, ...), checked on a probe to be one that ``act([gate | 1])``
    turns into ``act(gate)`` (:func:`interp_vllm.model._sites.gate_activation`); ``None``: no such child."""
    gate, up = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0))
    for name, child in mlp.named_children():
        if name in projections or isinstance(child, classes["linear"]) or any(True for _ in child.parameters()):
            continue
        # the op's own torch implementation, on the host: the same answer in the front end (whose
        # model has no weights) and in a worker on any device
        native = getattr(child, "forward_native", child)
        try:
            with torch.no_grad():
                fused = native(torch.cat([gate, up], dim=-1))
                alone = gate_activation(native, gate)
        except Exception:  # not an activation of [gate | up]
            continue
        if isinstance(fused, torch.Tensor) and fused.shape == gate.shape and torch.allclose(fused, alone * up):
            return name
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _layer_list(model: nn.Module, n_layers: int, classes: dict[str, Any]) -> tuple[str, nn.ModuleList]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers and _subtree_has(module, classes["kernel"]):
            return name, module
    raise _unsupported(model, f"found no list of {n_layers} decoder layers holding vLLM attention kernels")


def _missing_here(module: nn.Module) -> bool:
    """A placeholder for a module that lives on another pipeline-parallel stage."""
    return type(module).__name__ in ("PPMissingLayer", "StageMissingLayer")


def _final_norm(model: nn.Module, layers_path: str) -> str:
    parent_path = layers_path.rpartition(".")[0]
    parent = _get(model, parent_path) if parent_path else model
    children = [n for n, _ in parent.named_children()]
    after_layers = children[children.index(layers_path.rpartition(".")[2]) + 1 :]
    norms = [n for n, m in parent.named_children() if is_norm(m)]
    if len(norms) > 1:  # one normalises the embeddings (BLOOM): the final one is declared after the layers
        norms = [n for n in norms if n in after_layers]
    if not norms:  # pipeline parallelism: the final norm lives on the last stage, a placeholder here
        norms = [n for n in after_layers if _missing_here(getattr(parent, n))]
    if len(norms) != 1:
        raise _unsupported(model, f"{type(parent).__name__} has no single final norm beside its layers ({norms})")
    return f"{parent_path}.{norms[0]}" if parent_path else norms[0]


def _unembed(model: nn.Module, classes: dict[str, Any]) -> str:
    head = getattr(model, "lm_head", None)
    if isinstance(head, classes["embedding"]) or (head is not None and _missing_here(head)):
        return "lm_head"
    embeddings = _paths(model, classes["embedding"])
    if embeddings:
        return embeddings[0]  # tied: the logits processor projects with the input embedding
    missing = [n for n, m in model.named_modules() if n and _missing_here(m) and "embed" in n]
    if missing:  # pipeline parallelism: a stage without the (tied) embedding never unembeds
        return str(missing[0])
    raise _unsupported(model, "found no (vocab-parallel) embedding to unembed with")


def _first_count(config: Any, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` that ``config`` sets to a positive int (0: none)."""
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def n_experts_of(config: Any) -> tuple[int, int]:
    """``(experts, experts per token)`` from an HF config (``(0, 0)``: a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = _first_count(text, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))
    per_token = _first_count(text, ("num_experts_per_tok", "moe_top_k", "moe_k", "top_k"))
    ffn = getattr(text, "ffn_config", None)  # DBRX
    if not experts and ffn is not None:
        experts = int(getattr(ffn, "moe_num_experts", 0) or 0)
        per_token = int(getattr(ffn, "moe_top_k", 0) or 0)
    return experts, per_token


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # no tensor-parallel group
        return 1


def _runs_hf_modules(model: nn.Module) -> bool:
    """Whether vLLM serves the model through its Transformers modeling backend (HF's modules,
    called on a batch of one)."""
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:  # pragma: no cover - a vLLM without the backend
        return False
    return isinstance(model, Base)


@contextlib.contextmanager
def _without_lora(model: nn.Module) -> Iterator[None]:
    """During the block, each of vLLM's LoRA layers (``enable_lora``: it wraps the linear layer it
    adapts, as ``base_layer``) is swapped back for that layer, so the model resolves by its own
    classes; the paths found name the LoRA layers again afterwards, whose outputs include each
    request's adapter."""
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:  # pragma: no cover - a vLLM without LoRA
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            base = getattr(child, "base_layer", None)
            if isinstance(child, BaseLayerWithLoRA) and isinstance(base, nn.Module):
                setattr(parent, name, base)
                swapped.append((parent, name, child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def resolve(model: nn.Module, config: Any) -> VllmFamily:
    """The :class:`VllmFamily` of a model vLLM built (weights loaded or on the meta device; under
    ``enable_lora``, resolved as the model without its LoRA layers)."""
    with _without_lora(model):
        return _resolve(model, config)


def _resolve(model: nn.Module, config: Any) -> VllmFamily:
    classes = _classes()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = int(text.num_hidden_layers)
    layers_path, layers = _layer_list(model, n_layers, classes)
    real = [(i, layer) for i, layer in enumerate(layers) if _subtree_has(layer, classes["kernel"])]
    n_experts, per_token = n_experts_of(config)
    first = real[0][1]
    # under pipeline parallelism a stage holds some layers (vLLM puts a PPMissingLayer in place of
    # the others); only the last stage, which holds the last layer, has the final norm and the
    # unembedding
    last_stage = real[-1][0] == n_layers - 1
    traced = _trace_layer(model, first, classes)
    fields: dict[str, Any] = {}
    fields.update(_attention(model, _get(first, traced.attn), traced.attn, classes))
    moe_layers: list[int] = []
    dense: dict[str, Any] | None = None
    moe: dict[str, Any] | None = None
    for index, layer in real:
        mlp = _get(layer, traced.mlp) if traced.mlp else layer
        found = _mlp(model, mlp, traced.mlp, classes, n_experts)
        if found.get("moe"):
            moe_layers.append(index)
            moe = moe or found
        else:
            dense = dense or found
    if dense is not None:
        fields.update(dense)
    else:  # every layer a mixture of experts: no dense projections
        fields.update(mlp_up=None, mlp_down=None)
    if moe is not None:
        fields.update(router=moe["router"], experts=moe["experts"])
    kernel = _get(first, fields["attn_kernel"])
    ranks = _tp_size()
    if dense is not None and fields.get("mlp_down"):
        layer = next(layer for index, layer in real if index not in moe_layers)
        with contextlib.suppress(AttributeError):  # no such module: the config's width serves
            fields["d_mlp"] = _input_width(_get(layer, fields["mlp_down"]), ranks)
    fields["sinks"] = getattr(getattr(kernel, "impl", None), "sinks", None) is not None
    family = VllmFamily(
        name=type(model).__name__,
        n_heads=int(kernel.num_heads) * ranks,
        n_kv_heads=int(kernel.num_kv_heads) * ranks,
        layers=layers_path,
        final_norm=_final_norm(model, layers_path) if last_stage else "",
        deferred_residual=traced.residual_arg is not None,
        hidden_arg=traced.hidden_arg,
        residual_arg=traced.residual_arg,
        attn=traced.attn,
        mlp=traced.mlp,
        mlp_in_at=traced.mlp_in_at,
        mlp_out_at=traced.mlp_out_at,
        unembed=_unembed(model, classes) if last_stage else "",
        attn_post_norm=traced.attn_post_norm,
        mlp_post_norm=traced.mlp_post_norm,
        parallel=traced.parallel,
        attn_scale=traced.attn_scale,
        mlp_scale=traced.mlp_scale,
        dense_mlp=dense is not None,
        moe_layers=tuple(moe_layers) if len(moe_layers) < len(real) else (),
        n_experts=n_experts if moe is not None else 0,
        experts_per_token=per_token if moe is not None else 0,
        batched=_runs_hf_modules(model),
        **fields,
    )
    data = FAMILY_DATA.get(type(model).__name__)
    return replace(family, **data) if data else family


def _input_width(module: Any, ranks: int) -> int:
    """The whole input width of a (row-parallel) linear layer: vLLM's ``input_size``, a plain
    ``nn.Linear``'s ``in_features``, else its weight's columns on every rank."""
    for name in ("input_size", "in_features"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1]) * ranks
    return 0


def resolve_without_weights(path: str, engine_options: dict[str, Any]) -> VllmFamily:
    """Build vLLM's model for ``path`` on the meta device (no weights, no memory) in this process
    and resolve it: what the front end knows before any engine starts. A single-rank process
    group is set up for the build and torn down after."""
    with built_without_weights(path, engine_options) as (model, hf_config):
        if engine_options.get("enable_lora"):
            _check_lora(model)
        return resolve(model, hf_config)


def _check_lora(model: nn.Module) -> None:
    """``UnsupportedArchitecture`` unless vLLM serves LoRA adapters on ``model``'s class."""
    from vllm.model_executor.models.interfaces import supports_lora

    if not supports_lora(model):
        raise UnsupportedArchitecture(
            f"vLLM serves no LoRA adapters on {type(model).__name__} (enable_lora=True): load it without "
            "enable_lora, or serve its adapters on the eager backend (PEFT)"
        )
