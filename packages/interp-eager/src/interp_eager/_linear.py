"""The frozen-linear replacement model of one prompt, for attribution graphs.

:class:`FrozenForward` first runs the prompt once and records what is to be frozen: each attention's
queries and keys as its attention function receives them (so every attention pattern is fixed) and
each norm's scale (the standard deviation or RMS it divides by, per token) outside the attention
modules; and what the attribution needs: the token embeddings, each layer's MLP input (``mlp_in`` or
``resid_mid``) and output, and the last position's logits.

:meth:`FrozenForward.run` then runs ``n_rows`` copies of the prompt with

- the recorded queries and keys handed to every attention function (patterns frozen),
- every norm computing ``gain * centred(x) / s + bias`` with the recorded ``s`` (scales frozen),
- each MLP's output replaced by a constant (the recorded one unless given) -- gradient never flows
  through an MLP, whose replacement's features are the graph's nodes --,
- a zero tensor that requires grad added to the embeddings and to each MLP output (the probes: the
  gradient with respect to one is the gradient with respect to anything written there),

so the MLP inputs and the logits it returns (before any final soft-cap: the unembedding's output)
are affine functions of what is written at the probes, with their autograd graphs kept. The recorded
run and a run with nothing changed agree to float rounding (``tests/circuits``).

A norm's form is read off the recorded call (layer norm or RMS norm, gain ``weight`` or ``1 +
weight``, with or without bias) and checked against what the module returned; a norm none of these
reproduce is refused with ``UnsupportedOperation`` naming its class, as is a family whose attention
taps cannot hand the function other queries and keys.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from interp_engine import Address, UnsupportedOperation, Write

from ._intercept import AttentionCall, add_attention_tap, attention_owner
from ._plan import Chunk, Plan
from ._tree import is_norm

if TYPE_CHECKING:
    from ._model import EagerModel

_RAW = Address("logits_raw")
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


@dataclass(frozen=True)
class _NormForm:
    centred: bool
    gain: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        p = x - x.mean(-1, keepdim=True) if self.centred else x
        return torch.sqrt(p.pow(2).mean(-1, keepdim=True) + self.eps)

    def frozen(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        p = x - x.mean(-1, keepdim=True) if self.centred else x
        y = p / scale
        if self.gain is not None:
            y = y * self.gain
        if self.bias is not None:
            y = y + self.bias
        return y


def _norm_form(module: nn.Module, x: torch.Tensor, y: torch.Tensor, path: str) -> _NormForm:
    """The form of ``module`` that reproduces ``y`` from ``x`` (float32), or UnsupportedOperation."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = next((float(v) for n in _EPS_NAMES if isinstance(v := getattr(module, n, None), (int, float))), 1e-5)
    x32, y32 = x.detach().float(), y.detach().float()
    gains: list[torch.Tensor | None] = [None]
    if isinstance(weight, torch.Tensor) and weight.shape == x.shape[-1:]:
        w = weight.detach().float()
        gains = [w, 1.0 + w]
    biases: list[torch.Tensor | None] = [None]
    if isinstance(bias, torch.Tensor) and bias.shape == x.shape[-1:]:
        biases = [bias.detach().float(), None]
    first_centred = isinstance(module, nn.LayerNorm) or "layernorm" in type(module).__name__.lower()
    tolerance = 1e-4 * float(y32.abs().max()) + 1e-5
    for centred in (first_centred, not first_centred):
        for gain in gains:
            for b in biases:
                form = _NormForm(centred, gain, b, eps)
                if float((form.frozen(x32, form.scale(x32)) - y32).abs().max()) <= tolerance:
                    return form
    raise UnsupportedOperation(
        f"cannot freeze the norm {path} ({type(module).__name__}): no layer-norm or RMS-norm form "
        "reproduces its output, so the frozen-linear replacement model is not served for this family"
    )


@dataclass
class CleanRun:
    """What the recorded (unchanged) run computed, batch axis dropped, float32 on the model's device."""

    tokens: list[int]
    embed: torch.Tensor
    """``[n, d_model]``: the embeddings entering layer 0."""
    token_embed: torch.Tensor
    """``[n, d_model]``: the token embeddings alone (the input embedding's output; what else
    enters layer 0, such as GPT-2's position embeddings, is a constant of the linear model). The
    whole ``embed`` where the input embedding's output is not ``d_model`` wide."""
    inputs: dict[int, torch.Tensor]
    """Per layer, ``[n, d]`` at the replacement's input kind."""
    mlp_out: dict[int, torch.Tensor]
    """Per layer, ``[n, d_model]``: each MLP's output as added to the residual."""
    logits: torch.Tensor
    """``[vocab]``: the last position's logits, as the model returns them."""
    logits_raw: torch.Tensor
    """``[vocab]``: the same before any final soft-cap (the unembedding's output, linear in the
    residual stream): what a logit node's value and edges are taken of."""


@dataclass
class LinearRun:
    """One frozen-linear forward over ``rows`` copies of the prompt (graphs kept)."""

    inputs: dict[int, torch.Tensor]
    """Per layer, ``[rows, n, d]`` at the input kind, differentiable."""
    logits: torch.Tensor
    """``[rows, vocab]``, the last position's, before any final soft-cap, differentiable."""
    embed_probe: torch.Tensor
    """``[rows, n, d_model]``: zero, requires grad, added to the embeddings."""
    mlp_out_probes: dict[int, torch.Tensor]
    """Per layer, ``[rows, n, d_model]``: zero, requires grad, added to the MLP output."""


class FrozenForward:
    """The frozen-linear replacement model of one prompt on an eager model (module docstring)."""

    def __init__(self, model: EagerModel, token_ids: Sequence[int], input_kind: str) -> None:
        arch = model.arch
        if not arch.attention_probes():
            raise UnsupportedOperation(
                f"attribution graphs freeze attention patterns by handing the attention function the recorded "
                f"queries and keys; this {model.info.architecture} model computes attention inside its own module "
                "where they cannot be replaced"
            )
        if input_kind not in ("mlp_in", "resid_mid"):
            raise UnsupportedOperation(f"the replacement's encoders read mlp_in or resid_mid, not {input_kind}")
        self.model = model
        self.tokens = [int(t) for t in token_ids]
        self.n_layers = model.info.n_layers
        self.input_kind = input_kind
        self._norms = self._find_norms()
        self._forms: dict[str, _NormForm] = {}
        self._scales: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._qk: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.clean = self._record()

    # -- what is frozen --------------------------------------------------------------------------
    def _find_norms(self) -> dict[str, nn.Module]:
        arch = self.model.arch
        inside_attention = set()
        for layer in range(self.n_layers):
            attention = arch.layer_module(layer, arch.family.attn)
            inside_attention |= {id(m) for m in attention.modules()}
        return {
            path: m
            for path, m in self.model.hf_model.named_modules()
            if path and is_norm(m) and id(m) not in inside_attention
        }

    def _attention_owners(self) -> list[tuple[int, nn.Module, str | None]]:
        arch = self.model.arch
        out = []
        for layer in range(self.n_layers):
            site = arch.site(Address("attn_q", layer))
            owner, method = attention_owner(site.module, arch.family.attn_fn)
            out.append((layer, owner, method))
        return out

    @contextlib.contextmanager
    def _frozen(self, record: bool) -> Iterator[None]:
        handles: list[Any] = []
        calls: dict[str, int] = defaultdict(int)
        qk_calls: dict[int, int] = defaultdict(int)

        def norm_hook(path: str) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
                x = args[0] if args else next(iter(kwargs.values()))
                if not isinstance(output, torch.Tensor) or not isinstance(x, torch.Tensor):
                    raise UnsupportedOperation(f"the norm {path} does not map one tensor to one tensor")
                if record:
                    form = _norm_form(module, x, output, path)
                    self._forms[path] = form
                    self._scales[path].append(form.scale(x.detach().float()))
                    return None
                i = calls[path]
                calls[path] += 1
                scale = self._scales[path][i]
                if x.dim() == 2 and scale.dim() == 2 and x.shape[0] != scale.shape[0]:
                    scale = scale.repeat(x.shape[0] // scale.shape[0], 1)  # OPT: [rows * tokens, width]
                return self._forms[path].frozen(x.float(), scale).to(output.dtype)

            return hook

        for path, module in self._norms.items():
            handles.append(module.register_forward_hook(norm_hook(path), with_kwargs=True))

        family = self.model.arch.family
        for layer, owner, method in self._attention_owners():

            def tap(call: AttentionCall, layer: int = layer) -> AttentionCall | None:
                if record:
                    self._qk[layer].append((call.query.detach().clone(), call.key.detach().clone()))
                    return None
                i = qk_calls[layer]
                qk_calls[layer] += 1
                q, k = self._qk[layer][i]
                rows = call.query.shape[0]
                return replace(
                    call,
                    query=q.expand(rows, *q.shape[1:]).to(call.query.dtype),
                    key=k.expand(rows, *k.shape[1:]).to(call.key.dtype),
                )

            handles.append(
                add_attention_tap(owner, tap, method=method, scores_at_softmax=family.attn_scores_at_softmax)
            )
        try:
            yield
        finally:
            for handle in reversed(handles):
                handle.remove()

    @contextlib.contextmanager
    def _no_parameter_grads(self) -> Iterator[None]:
        """The parameters need no gradient (and the forward keeps nothing for them)."""
        params = [p for p in self.model.hf_model.parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in params:
                p.requires_grad_(True)

    # -- the runs ---------------------------------------------------------------------------------
    def _inputs(self) -> list[Address]:
        return [Address(self.input_kind, layer) for layer in range(self.n_layers)]

    def _record(self) -> CleanRun:
        n = len(self.tokens)
        outs = [Address("mlp_out", layer) for layer in range(self.n_layers)]
        points = [Address("embed"), *self._inputs(), *outs, _RAW]
        plan = Plan(self.model.arch, points, [], [n])
        ids = torch.tensor([self.tokens])
        tokens: list[torch.Tensor] = []
        embedding: nn.Module = self.model.hf_model.get_input_embeddings()  # type: ignore[operator]
        handle = embedding.register_forward_hook(lambda m, a, out: tokens.append(out.detach()))
        try:
            with self._no_parameter_grads(), self._frozen(record=True):
                output = self.model._forward(plan, Chunk(1, n, 0), ids, grad=True, last_logits_only=True)
        finally:
            handle.remove()
        values = plan.result()
        embed = values[Address("embed")][0].float()
        token_embed = tokens[0][0].float() if tokens and tokens[0].shape[-1] == embed.shape[-1] else embed
        return CleanRun(
            tokens=self.tokens,
            embed=embed,
            token_embed=token_embed.to(embed.device),
            inputs={a.layer: values[a][0].float() for a in self._inputs() if a.layer is not None},
            mlp_out={a.layer: values[a][0].float() for a in outs if a.layer is not None},
            logits=output.logits[0, -1].detach().float(),
            logits_raw=values[_RAW][0, -1].float(),
        )

    def run(
        self,
        rows: int,
        *,
        mlp_out: Mapping[int, torch.Tensor] | None = None,
        embed: torch.Tensor | None = None,
        grad: bool = True,
        skips: Mapping[int, torch.Tensor] | None = None,
    ) -> LinearRun:
        """``rows`` copies of the prompt through the frozen-linear model, each MLP's output the
        constant ``mlp_out[L]`` (``[n, d_model]``; default the recorded one) and the embeddings
        ``embed`` (default the model's own). ``skips[L]`` (``[d_model, d_in]``, a skip
        transcoder's ``W_skip``): layer ``L``'s MLP output also carries ``(x - x_0) @ W_skip.T``,
        with ``x`` its input in this run and ``x_0`` the recorded one (the skip path is linear, so
        gradient flows through it)."""
        n = len(self.tokens)
        positions = list(range(n))
        writes = []
        for layer in range(self.n_layers):
            value = self.clean.mlp_out[layer] if mlp_out is None or layer not in mlp_out else mlp_out[layer]
            writes.append(Write(Address("mlp_out", layer), value.detach().float().cpu(), "set", positions=positions))
        if embed is not None:
            writes.append(Write(Address("embed"), embed.detach().float().cpu(), "set", positions=positions))
        outs = [Address("mlp_out", layer) for layer in range(self.n_layers)]
        probes = [Address("embed"), *outs] if grad else []
        plan = _LinearPlan(self.model.arch, [*self._inputs(), _RAW], writes, [n] * rows, probes=probes, live=True)
        for layer, w_skip in (skips or {}).items():
            plan.add_skip(layer, Address(self.input_kind, layer), self.clean.inputs[layer], w_skip)
        ids = torch.tensor([self.tokens] * rows)
        with self._no_parameter_grads(), self._frozen(record=False):
            self.model._forward(plan, Chunk(rows, n, 0), ids, grad=grad, last_logits_only=True)
        values = plan.result()
        zeros = torch.zeros(rows, n, self.model.info.d_model)
        return LinearRun(
            inputs={a.layer: values[a] for a in self._inputs() if a.layer is not None},
            logits=values[_RAW][:, -1].float(),
            embed_probe=plan.probed[Address("embed")][0] if grad else zeros,
            mlp_out_probes={a.layer: plan.probed[a][0] for a in outs if a.layer is not None} if grad else {},
        )

    def saved_bytes_per_row(self) -> int:
        """What one row's frozen-linear forward keeps for the backward (measured once, bytes)."""
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run = self.run(1)
        params = {p.untyped_storage().data_ptr() for p in self.model.hf_model.parameters()}
        del run
        return sum(size for ptr, size in seen.items() if ptr not in params)


class _LinearPlan(Plan):
    """A :class:`Plan` that also adds skip transcoders' linear paths to the MLP outputs, after its
    own hooks there (the constant written, the probe added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skips: list[tuple[int, Address, torch.Tensor, torch.Tensor]] = []

    def add_skip(self, layer: int, source: Address, clean: torch.Tensor, w_skip: torch.Tensor) -> None:
        site = self.arch.site(Address("mlp_out", layer))
        if site.scale != 1.0 or site.heads is not None or site.cols is not None:
            raise UnsupportedOperation(f"a skip transcoder at layer {layer} of this family is not served")
        self._skips.append((layer, source, clean, w_skip))

    def hooks(self) -> list[Any]:
        handles = super().hooks()
        for layer, source, clean, w_skip in self._skips:
            module = self.arch.site(Address("mlp_out", layer)).module

            def add(
                module: nn.Module,
                args: tuple[Any, ...],
                output: Any,
                source: Address = source,
                clean: torch.Tensor = clean,
                w_skip: torch.Tensor = w_skip,
            ) -> Any:
                if not isinstance(output, torch.Tensor) or output.dim() != 3:
                    raise UnsupportedOperation(
                        "a skip transcoder's MLP output is not one [batch, tokens, width] tensor"
                    )
                live = self.values[source][-1]
                term = (live.float() - clean.to(live.device)) @ w_skip.to(live.device).T
                return output + term.to(output.dtype)

            handles.append(module.register_forward_hook(add))
        return handles
