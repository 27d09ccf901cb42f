"""The MLP resolver: on a dense layer, the MLP's input projections (which is the gate and which the
linear branch of a gated MLP, a fused ``[gate | up]`` projection), its down projection and a
sub-norm before it; on a mixture-of-experts layer, the router and the experts' arguments.

- negating one input projection's output (or half of a fused one) and seeing the MLP's hidden
  flip sign tells the linear (``up``) branch of a gated MLP from the gate;
- the module whose input is the gate branch (and whose output is not) applies the gate's activation;
- a norm whose output is the down projection's input is a sub-norm (BitNet's ``ffn_sub_norm``):
  ``mlp_post`` is what it receives;
- an MLP whose output is its down projection's plus the residual (Bloom, MPT) has ``mlp_out`` at
  the down projection;
- a router tap (the first linear map to ``n_experts`` outputs inside the router) must see the
  logits the router returns; the experts' index and weight arguments are read where they are called.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._intercept import add_router_tap
from ._trace import Record, Traced, close, run, same
from ._tree import Mlp, is_norm, refuse


@dataclass
class MlpParts:
    """What the MLP resolver found: :class:`~interp_eager._families.Family` fields, and the MLP's
    output (``mlp_out``) in the traced forward."""

    fields: dict[str, Any]
    output: torch.Tensor | None


def resolve_mlp(traced: Traced, attn_output: torch.Tensor | None) -> MlpParts:
    model, mlps, record = traced.model, traced.static.mlps, traced.record
    # the MLP of each kind (dense, MoE): one representative layer each
    dense_index = next((i for i, m in enumerate(mlps) if m.router is None), None)
    moe_index = next((i for i, m in enumerate(mlps) if m.router is not None), None)
    rep = mlps[dense_index if dense_index is not None else moe_index or 0]
    mlp_in, mlp_out = rep.mlp_in, rep.mlp_out
    for m in mlps:
        if (m.mlp_in, m.mlp_out) != (mlp_in, mlp_out):
            raise refuse(model, f"its layers keep their MLPs at different places ({m.mlp_in}, {mlp_in})")
    fields: dict[str, Any] = {
        **{
            name: None
            for name in ("mlp_pre", "mlp_pre_linear", "mlp_act", "mlp_down", "mlp_sub_norm", "router", "experts")
        },
        **{name: 0 for name in ("expert_index_arg", "expert_weight_arg", "n_experts", "experts_per_token")},
    }
    if dense_index is not None:
        fields.update(_dense(traced, dense_index))
    if moe_index is not None:
        fields.update(_routed(traced, moe_index))

    # an MLP that adds the residual to its own output (Bloom's, MPT's): mlp_out is its down projection's
    mlp_output = traced.output(mlp_out)
    mlp_down = fields["mlp_down"]
    if moe_index is None and mlp_down is not None and mlp_output is not None:
        down_out = traced.output(mlp_down)
        resid_pre = record.inputs[traced.at("")]
        if (
            down_out is not None
            and attn_output is not None
            and down_out.shape == mlp_output.shape
            and not same(down_out, mlp_output)
            and close(down_out + resid_pre + attn_output, mlp_output)
        ):
            mlp_out, mlp_output = mlp_down, down_out
    return MlpParts({"mlp_in": mlp_in, "mlp_out": mlp_out, **fields}, mlp_output)


def _dense(traced: Traced, index: int) -> dict[str, Any]:
    """A dense layer's MLP: its input projections (gate, linear branch), down projection, sub-norm."""
    model, record = traced.model, traced.record
    dense = traced.static.mlps[index]
    layer = traced.layers[index]
    prefix = traced.at("", index)
    mlp_pre = mlp_pre_linear = mlp_sub_norm = None
    fused = False
    down_in = traced.input(dense.down, index) if dense.down else None
    block = layer.get_submodule(dense.block) if dense.block else layer
    for name, norm in block.named_modules(prefix=dense.block):
        # a norm between the nonlinearity and the down projection (BitNet's ffn_sub_norm)
        if name and is_norm(norm) and same(traced.output(name, index), down_in):
            mlp_sub_norm = name
    if dense.fused:
        fused = True
        mlp_pre = mlp_pre_linear = dense.inputs[0]
        if _linear_branch(model, layer, dense, record, prefix) != 1:
            raise refuse(model, f"the second half of {dense.inputs[0]} is not the linear branch of its MLP")
    elif len(dense.inputs) == 2:
        up = _linear_branch(model, layer, dense, record, prefix)
        if up is None:
            raise refuse(model, f"could not tell the gate from the linear branch of the MLP {dense.block}")
        mlp_pre_linear = dense.inputs[up]
        mlp_pre = dense.inputs[1 - up]
    else:
        mlp_pre = dense.inputs[0]
    return {
        "mlp_pre": mlp_pre,
        "mlp_pre_linear": mlp_pre_linear,
        "mlp_act": _gate_activation(traced, index, dense, mlp_pre, fused) if mlp_pre and mlp_pre_linear else None,
        "gate_up_fused": fused,
        "mlp_down": dense.down,
        "mlp_sub_norm": mlp_sub_norm,
    }


def _gate_activation(traced: Traced, index: int, dense: Mlp, mlp_pre: str, fused: bool) -> str | None:
    """The module a gated MLP applies its activation with: the one whose input is the gate
    branch (the first half of a fused projection's output) and whose output differs from it."""
    gate = traced.output(mlp_pre, index)
    if gate is None:
        return None
    if fused:
        gate = gate[..., : gate.shape[-1] // 2]
    layer = traced.layers[index]
    block = layer.get_submodule(dense.block) if dense.block else layer
    for name in (n for n, _ in block.named_modules(prefix=dense.block)):
        if not name or name in dense.inputs or name == dense.down:
            continue
        out = traced.output(name, index)
        if (
            same(traced.input(name, index), gate)
            and out is not None
            and out.shape == gate.shape
            and not same(out, gate)
        ):
            return str(name)
    return None


def _routed(traced: Traced, index: int) -> dict[str, Any]:
    """A mixture-of-experts layer: its router (checked to be tapped where it computes the logits it
    returns), experts, and the experts' index and weight arguments."""
    model = traced.model
    moe = traced.static.mlps[index]
    router, experts, n_experts = moe.router, moe.experts, moe.n_experts
    args = traced.record.args.get(traced.at(experts or "", index), [])
    ints = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()]
    floats = [
        i
        for i, a in enumerate(args)
        if i and isinstance(a, torch.Tensor) and a.is_floating_point() and ints and a.shape == args[ints[0]].shape
    ]
    if len(ints) != 1 or len(floats) != 1:
        raise refuse(model, f"could not read the chosen experts and their weights where {experts} is called")
    index_arg, weight_arg = ints[0], floats[0]

    tapped: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []

    def keep(logits: torch.Tensor) -> torch.Tensor:
        tapped.append(logits.detach().clone())
        return logits

    def outputs(module: nn.Module, args: Any, output: Any) -> None:
        items = output if isinstance(output, (tuple, list)) else (output,)
        returned.extend(t.detach() for t in items if isinstance(t, torch.Tensor))

    module = traced.layers[index].get_submodule(router or "")
    with contextlib.ExitStack() as stack:
        stack.callback(add_router_tap(module, n_experts, keep).remove)
        stack.callback(module.register_forward_hook(outputs).remove)
        run(model, traced.ids)
    if not (len(tapped) == 1 and any(same(tapped[0], t) for t in returned)):
        raise refuse(model, f"could not find where its router {router} computes the logits it returns")
    return {
        "router": router,
        "experts": experts,
        "expert_index_arg": index_arg,
        "expert_weight_arg": weight_arg,
        "n_experts": n_experts,
        "experts_per_token": int(args[index_arg].shape[-1]),
    }


def _linear_branch(model: nn.Module, layer: nn.Module, mlp: Mlp, record: Record, prefix: str) -> int | None:
    """Which input projection (or, fused, which half) is the linear branch of a gated MLP: the one
    whose negation flips the sign of the hidden the down projection reads."""
    block = layer.get_submodule(mlp.block)
    x = record.inputs.get(f"{prefix}.{mlp.block}")
    hidden = record.inputs.get(f"{prefix}.{mlp.down}")
    if x is None or hidden is None or mlp.down is None:
        return None
    down = layer.get_submodule(mlp.down)
    found = []
    for option in range(2):
        target = layer.get_submodule(mlp.inputs[0 if mlp.fused else option])

        def negate(module: nn.Module, args: Any, out: torch.Tensor, option: int = option) -> torch.Tensor:
            if not mlp.fused:
                return -out
            half = out.shape[-1] // 2
            out = out.clone()
            out[..., option * half : (option + 1) * half] *= -1
            return out

        seen: dict[str, torch.Tensor] = {}

        def read(module: nn.Module, args: tuple[Any, ...], seen: dict[str, torch.Tensor] = seen) -> None:
            seen["h"] = args[0].detach().clone()

        handles = [target.register_forward_hook(negate), down.register_forward_pre_hook(read)]
        try:
            with torch.no_grad():
                block(x)
        finally:
            for handle in handles:
                handle.remove()
        if "h" in seen and close(seen["h"], -hidden) and not close(seen["h"], hidden):
            found.append(option)
    return found[0] if len(found) == 1 else None
