"""Where each address kind lives in an HF model, for the eager backend: one row per kind.

:data:`SITES` maps each kind to the module it is read at, relative to a decoder layer (a
:class:`~interp_eager._families.Family` field naming it) or to the model, and how: the module's
first input (``pre``) or an output element (``post``), what its attention function receives
(``attention``: :mod:`interp_eager._intercept`), the logits its router computes (``router``), or
the forward's own result (``result``: ``logits``); a per-head view of the tensor
(:class:`HeadSlice`) or one half of a fused ``[gate | up]`` projection (:class:`ColumnSlice`).
``resid_mid`` is ``derived``: the hook plan adds ``resid_pre`` to what the attention sublayer
adds (:meth:`Architecture.residual_after_attention`).

What a loaded model serves follows from the rows and the core's kind rows (each kind's needs,
:func:`interp_engine.backend.requirements`): a kind is served where the model has every need
(:data:`FEATURES` tells, from the resolved family and the loaded modules), refused with the
need's reason otherwise, and, for a need only some layers have (mixture-of-experts and dense
layers mixed), served on those layers and refused on the others. A new kind on the eager backend
is one :class:`EagerSite` row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from interp_engine import KINDS, Address, KindNotInFamily, UnsupportedAddress
from interp_engine.backend import Need, requirements

from ._families import Family, QkNormLayout, QkvLayout
from ._tree import linear_io


@dataclass(frozen=True)
class HeadSlice:
    """Where per-head values sit in a site tensor. ``layout="flat"``: in its last axis,
    ``heads`` groups of ``stride`` features (default ``d_head``) from feature ``start``, each
    head's ``d_head`` values ``offset`` features into its group. ``"tokens x heads"``: the tensor
    is ``[batch, tokens, heads, d_head]`` already; ``"heads x tokens"``: it is ``[batch, heads,
    tokens, d_head]`` (the q/k norms of Qwen3 and of Gemma 3, StableLM, Phi). With ``groups > 1``
    (flat): the last axis holds ``groups`` blocks of ``stride`` features, each holding
    ``heads / groups`` consecutive heads ``offset`` features into it (CodeGen's model-parallel
    ``qkv_proj``)."""

    heads: int
    d_head: int
    start: int = 0
    stride: int = 0
    offset: int = 0
    layout: QkNormLayout = "flat"
    groups: int = 1

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., groups, heads / groups, d_head]`` view of ``x`` (``groups > 1``)."""
        per = self.heads // self.groups
        region = x[..., self.start : self.start + self.groups * self.stride]
        blocks = region.view(*region.shape[:-1], self.groups, self.stride)
        heads = blocks[..., self.offset : self.offset + per * self.d_head]
        return heads.view(*heads.shape[:-1], per, self.d_head)

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[batch, tokens, heads, d_head]`` view of ``x`` (writing into it writes into ``x``,
        except for ``groups > 1``, whose heads are no view: write with :meth:`put`)."""
        if self.layout == "tokens x heads":
            return x
        if self.layout == "heads x tokens":
            return x.transpose(1, 2)
        if self.groups > 1:
            return self._grouped(x).flatten(-3, -2)
        stride = self.stride or self.d_head
        region = x[..., self.start : self.start + self.heads * stride]
        groups = region.view(*region.shape[:-1], self.heads, stride)
        return groups[..., self.offset : self.offset + self.d_head]

    def put(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (``[batch, tokens, heads, d_head]``) into ``x`` where :meth:`of` reads."""
        if self.layout == "flat" and self.groups > 1:
            per = self.heads // self.groups
            self._grouped(x).copy_(values.reshape(*values.shape[:-2], self.groups, per, self.d_head))
        else:
            self.of(x).copy_(values)


@dataclass(frozen=True)
class ColumnSlice:
    """Part ``part`` of ``parts`` equal blocks of a site tensor's last axis (Phi-3's fused
    ``gate_up_proj`` output: ``mlp_pre`` is part 0 of 2, ``mlp_pre_linear`` part 1)."""

    part: int
    parts: int

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """The view of ``x``'s block (writing into it writes into ``x``)."""
        width = x.shape[-1] // self.parts
        return x[..., self.part * width : (self.part + 1) * width]


VALUE_SLICES: dict[QkvLayout, Callable[[int, int, int, int], HeadSlice]] = {
    "v": lambda heads, kv_heads, d, groups: HeadSlice(kv_heads, d),
    "q|k|v": lambda heads, kv_heads, d, groups: HeadSlice(kv_heads, d, start=(heads + kv_heads) * d),
    "per-head q|k|v": lambda heads, kv_heads, d, groups: HeadSlice(kv_heads, d, stride=3 * d, offset=2 * d),
    "per-group q|k|v": lambda heads, kv_heads, d, groups: HeadSlice(
        kv_heads, d, stride=(heads // kv_heads + 2) * d, offset=(heads // kv_heads + 1) * d
    ),
    "grouped q|v|k": lambda heads, kv_heads, d, groups: HeadSlice(
        kv_heads, d, stride=3 * kv_heads * d // groups, offset=kv_heads * d // groups, groups=groups
    ),
}
"""The values in the output of a family's :attr:`~Family.attn_v`, by its ``qkv_layout`` (called
with the query heads, the key/value heads, ``d_head`` and the layout's groups)."""


ATTENTION_SCORES = 2
"""The :attr:`Site.index` of an attention site that reads the pre-softmax scores."""

When = Literal["pre", "post", "attention", "router"]


@dataclass(frozen=True)
class Site:
    """A hookable tensor: the first input (``pre``) or an output element (``post``) of a module,
    or, at a module's attention function (``attention``), the query (``index`` 0) or key (1) it
    receives (``[batch, heads, keys, d_head]``) or the scores it computes (2, ``[batch, heads,
    queries, keys]``); or, at a router (``router``), the logits its first linear layer with
    ``index`` outputs computes. A ``pre`` site with ``index > 0`` reads that positional argument
    (the experts module's chosen experts and weights). ``cols`` selects a block of the tensor's
    last axis; ``heads`` views the tensor (or that block) per head."""

    module: nn.Module
    when: When
    index: int = 0
    heads: HeadSlice | None = None
    cols: ColumnSlice | None = None
    scale: float = 1.0
    """What the tensor is multiplied by to give the value (a write hands back ``value / scale``):
    the residual multiplier at a sublayer's output."""


View = Literal["heads", "q norm", "k norm", "values"]


@dataclass(frozen=True)
class EagerSite:
    """One address kind in an HF model."""

    kind: str
    when: When | Literal["result", "derived"]
    """How the value is read (:class:`Site`), or ``result``: the forward's own output (not hooked),
    ``derived``: computed by the hook plan from other points."""
    at: tuple[str, ...] = ()
    """Where: the first :class:`~interp_eager._families.Family` field naming a module that is set
    (relative to a decoder layer; ``"layer"``: the layer itself); for a model-level kind,
    ``"first_layer"``, ``"final_norm"`` or ``"unembed"``."""
    else_input_of: str | None = None
    """A model-level kind whose module the model may lack: read the input of this one then (no
    final norm: ``final_norm`` is the unembedding's input)."""
    index: int | str = 0
    """:attr:`Site.index`, or the Family field holding it."""
    view: View | None = None
    """Per head: ``heads``, the query heads side by side in the last axis (the output projection's
    input); ``q norm``/``k norm``, the query/key heads of the tensors a q/k norm sees, in the
    family's q/k-norm layout; ``values``, the values in the output of the projection that makes
    them, in the family's q/k/v layout."""
    part: int | None = None
    """Which half of a fused ``[gate | up]`` projection's output (where the family has one)."""
    how: Literal["hook", "recompute"] = "hook"
    """As :meth:`Architecture.served_kinds` reports it."""
    added: bool = False
    """A sublayer's output as added to the residual: the module's output times the family's
    :attr:`~interp_eager._families.Family.residual_multiplier`."""
    no_gradient: str | None = None
    """Why no gradient is taken here (a kind no write reaches)."""


SITES: dict[str, EagerSite] = {
    row.kind: row
    for row in (
        EagerSite("embed", "pre", ("first_layer",)),
        EagerSite("resid_pre", "pre", ("layer",)),
        EagerSite("attn_in", "pre", ("attn",)),
        EagerSite("q_norm_in", "pre", ("q_norm",), view="q norm"),
        EagerSite("q_norm_out", "post", ("q_norm",), view="q norm"),
        EagerSite("k_norm_in", "pre", ("k_norm",), view="k norm"),
        EagerSite("k_norm_out", "post", ("k_norm",), view="k norm"),
        EagerSite("attn_q", "attention", ("attn",), index=0),
        EagerSite("attn_k", "attention", ("attn",), index=1),
        EagerSite("attn_v", "post", ("attn_v",), view="values"),
        EagerSite(
            "attn_scores",
            "attention",
            ("attn",),
            index=ATTENTION_SCORES,
            how="recompute",
            no_gradient="it is recomputed from the queries and keys; take it at attn_q/attn_k",
        ),
        EagerSite(
            "attn_pattern",
            "post",
            ("attn",),
            index=1,
            no_gradient="the model never passes it on as one tensor (attention kernels fuse it); take it at "
            "attn_q/attn_k",
        ),
        EagerSite("attn_z", "pre", ("attn_sub_norm", "attn_o"), view="heads"),
        EagerSite("attn_out", "post", ("attn_out_at", "attn"), added=True),
        EagerSite("attn_out_post", "post", ("attn_post_norm",)),
        EagerSite("resid_mid", "derived"),
        EagerSite("mlp_in", "pre", ("mlp_in",)),
        EagerSite("router_logits", "router", ("router",), index="n_experts"),
        EagerSite("expert_indices", "pre", ("experts",), index="expert_index_arg", no_gradient="it holds integers"),
        EagerSite(
            "expert_weights",
            "pre",
            ("experts",),
            index="expert_weight_arg",
            no_gradient="it is read from the experts' arguments; take it at router_logits",
        ),
        EagerSite("mlp_pre", "post", ("mlp_pre",), part=0),
        EagerSite("mlp_gate_act", "post", ("mlp_act",), no_gradient="it is read only; take it at mlp_pre"),
        EagerSite("mlp_pre_linear", "post", ("mlp_pre_linear",), part=1),
        EagerSite("mlp_post", "pre", ("mlp_sub_norm", "mlp_down")),
        EagerSite("mlp_out", "post", ("mlp_out",), added=True),
        EagerSite("mlp_out_post", "post", ("mlp_post_norm",)),
        EagerSite("resid_post", "post", ("layer",)),
        EagerSite("final_norm", "post", ("final_norm",), else_input_of="unembed"),
        EagerSite("logits_raw", "post", ("unembed",)),
        EagerSite("logits", "result", no_gradient="the metric's own input: differentiate the metric"),
    )
}
"""Every kind the eager backend reads, in forward order (:meth:`Architecture.site`)."""

EAGER_KINDS = tuple(k for k in KINDS if k in SITES)
"""Every kind the eager backend knows where to read."""

_MODEL_ANCHORS = ("first_layer", "final_norm", "unembed")

_ATTENTION_QK = (
    "this model computes attention inside its own module, where its queries and keys cannot be "
    "replaced; take it at attn_in, attn_v or attn_z"
)
"""Why ``attn_q``/``attn_k`` take no gradient where the attention taps run after attention."""


@dataclass(frozen=True)
class FeatureCheck:
    """How the eager backend tells whether a loaded model has a :data:`~interp_engine.backend.Need`."""

    has: Callable[[Architecture, str | None], bool]
    """Given the model and the module path the kind's row names (``None``: none)."""
    reason: str | None = None
    """Why a model lacking it lacks the kind; ``None``: the core's reason for the kind, naming the
    module the family's table names where the loaded model lacks it."""
    layers: Callable[[Architecture], frozenset[int]] | None = None
    """The layers that have it, for a feature only some layers of a model may have."""
    layer_refusal: str = ""
    """Why a layer without it has no such point (``{layer}``: its index)."""
    module: bool = False
    """Whether the feature is the row's module being in every layer (read through it then)."""


FEATURES: dict[Need, FeatureCheck] = {
    "attn_pre_norm": FeatureCheck(lambda arch, path: True),
    "mlp_pre_norm": FeatureCheck(lambda arch, path: True),
    "q_norm": FeatureCheck(lambda arch, path: arch.in_every_layer(path), module=True),
    "k_norm": FeatureCheck(lambda arch, path: arch.in_every_layer(path), module=True),
    "attn_post_norm": FeatureCheck(lambda arch, path: arch.in_every_layer(path), module=True),
    "mlp_post_norm": FeatureCheck(lambda arch, path: arch.in_every_layer(path), module=True),
    "resid_mid": FeatureCheck(
        lambda arch, path: not arch.post_norm,
        "it normalises the residual after each block (post-LN); read attn_out or resid_post",
    ),
    "key_softmax": FeatureCheck(
        lambda arch, path: not arch.family.attention_sinks,
        "its attention also normalises over a learned sink logit per head, so no scores over the "
        "keys alone are what its softmax sees; read attn_pattern",
    ),
    "moe": FeatureCheck(
        lambda arch, path: bool(arch.moe_layers),
        "it is not a mixture of experts",
        layers=lambda arch: arch.moe_layers,
        layer_refusal="layer {layer} of this model has a dense MLP, not a mixture of experts",
    ),
    "dense_mlp": FeatureCheck(
        lambda arch, path: bool(arch.dense_layers),
        "every layer's MLP is a mixture of experts: there is no single MLP hidden; "
        "read mlp_in, mlp_out or the router points",
        layers=lambda arch: arch.dense_layers,
        layer_refusal="layer {layer} of this model is a mixture of experts, so there is no single MLP "
        "hidden; read mlp_in, mlp_out or router_logits/expert_indices/expert_weights there",
    ),
    "gated_mlp": FeatureCheck(lambda arch, path: arch.family.mlp_pre_linear is not None),
    "gate_activation": FeatureCheck(
        lambda arch, path: path is not None or arch.family.mlp_pre_linear is None,
        "its gated MLP applies the gate's activation inside a function, with no module of its own to read",
    ),
}
"""How the eager backend checks each need of the core's kind rows (a kind's
:func:`~interp_engine.backend.requirements`; every family has the pre-norms it reads ``attn_in``
and ``mlp_in`` after)."""


def _needs(kind: str) -> list[FeatureCheck]:
    return [FEATURES[need] for need in requirements(kind)] if kind in KINDS else []


class Architecture:
    """A loaded HF model seen through its resolved family: modules by address."""

    family: Family
    post_norm: bool
    moe_layers: frozenset[int]
    """The mixture-of-experts layers (their MLP is a router and experts)."""
    dense_layers: frozenset[int]

    def __init__(self, hf_model: nn.Module, family: Family) -> None:
        self.family = family
        self.config = hf_model.config
        self.layers: nn.ModuleList = _get(hf_model, family.layers)
        self.final_norm: nn.Module | None = _get(hf_model, family.final_norm) if family.final_norm else None
        unembed = hf_model.get_output_embeddings()  # type: ignore[operator]
        if unembed is None:
            raise UnsupportedAddress("this model has no output embedding (unembedding)", address="logits")
        self.unembed: nn.Module = unembed
        self.before_unembed = [m for m in (_maybe(hf_model, p) for p in family.before_unembed) if m is not None]
        self.parallel = family.parallel
        self.post_norm = family.post_norm
        config: Any = self.config
        self.n_heads = family.n_heads or int(config.num_attention_heads)
        self.n_kv_heads = family.n_kv_heads or int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.d_head = family.d_head or int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.moe_layers = frozenset(
            i for i, layer in enumerate(self.layers) if family.router and _maybe(layer, family.router) is not None
        )
        self.dense_layers = frozenset(range(len(self.layers))) - self.moe_layers
        self._paths = {
            kind: path
            for kind, path in self._optional_paths().items()
            if all(check.has(self, path) for check in _needs(kind))
        }
        self.sandwich = "attn_out_post" in self._paths
        """Whether a post-attention norm sits between ``attn_out`` and the residual (Gemma 2/3, OLMo 2)."""
        self._site_of: dict[Address, Site] = {}

    def path(self, kind: str) -> str | None:
        """The module path :data:`SITES` names for ``kind`` in this family (``None``: none is set)."""
        row = SITES[kind]
        if row.at and row.at[0] in ("layer", *_MODEL_ANCHORS):
            return row.at[0]
        return next((p for p in (getattr(self.family, f) for f in row.at) if p is not None), None)

    def _optional_paths(self) -> dict[str, str | None]:
        """The kinds read at a module some models of the family lack, with the family's path for it."""
        return {kind: self.path(kind) for kind in SITES if any(check.module for check in _needs(kind))}

    def missing_module(self, kind: str) -> str | None:
        """The module the family's table names for ``kind`` when this model lacks it (StableLM or
        Phi without ``qk_layernorm``, Gemma 2's ``q_norm``), else ``None``."""
        path = self._optional_paths().get(kind)
        return path if path is not None and kind not in self._paths else None

    def in_every_layer(self, path: str | None) -> bool:
        return path is not None and all(_maybe(layer, path) is not None for layer in self.layers)

    def served_kinds(self) -> dict[str, str]:
        """Every kind this loaded model has (every kind of :data:`SITES` whose needs it meets: a gated
        MLP, q/k norms, sandwich norms, a mixture of experts' router, ...), mapped to how it is read:
        by a hook, or, for ``attn_scores``, recomputed from the queries, keys and mask the attention
        function got. A kind some layers lack (``mlp_pre`` on a mixture-of-experts layer of a model
        whose other layers are dense) is served and refused on those layers."""
        return {
            kind: SITES[kind].how
            for kind in EAGER_KINDS
            if all(check.has(self, self.path(kind)) for check in _needs(kind))
        }

    def missing_reason(self, kind: str, default: str) -> str:
        """Why this model lacks ``kind``: the reason of the first feature it needs that the model
        lacks, or ``default`` (the core's reason for the kind), naming the module the family's
        table names where the loaded model lacks it."""
        path = self.path(kind)
        for check in _needs(kind):
            if not check.has(self, path) and check.reason is not None:
                return check.reason
        module = self.missing_module(kind)
        return f"{default}: its layers have no {module} module" if module else default

    def kind_layers(self, kind: str) -> tuple[int, ...] | None:
        """The layers ``kind`` exists at when not every layer (``None``: every layer)."""
        if not (self.moe_layers and self.dense_layers):  # every layer alike
            return None
        per_layer = [check.layers(self) for check in _needs(kind) if check.layers is not None]
        if not per_layer:
            return None
        return tuple(sorted(frozenset.intersection(*per_layer)))

    def layer_module(self, layer: int, path: str) -> nn.Module:
        module: nn.Module = _get(self.layers[layer], path)
        return module

    def _module(self, address: Address) -> nn.Module:
        """The module of a per-layer ``address`` (its kind's needs met on its layer)."""
        kind, layer = address.kind, address.layer
        if layer is None:  # pragma: no cover - site() checked it
            raise UnsupportedAddress(f"{address} has no hook site", address=address)
        needs = _needs(kind)
        if any(check.module for check in needs):
            path = self._paths.get(kind)
            if path is None:
                raise UnsupportedAddress(f"{address}: this model has no {kind}", address=address)
            return self.layer_module(layer, path)
        path = self.path(kind)
        index = layer % len(self.layers)
        for check in needs:
            if check.layers is not None and (index not in check.layers(self) or path is None):
                raise KindNotInFamily(f"{address}: {check.layer_refusal.format(layer=index)}", address=address)
        if path == "layer":
            return self.layers[layer]
        if path is None:  # pragma: no cover - every row names a module every family sets
            raise UnsupportedAddress(f"{address} has no hook site in the eager backend", address=address)
        return self.layer_module(layer, path)

    def _model_module(self, anchor: str) -> nn.Module | None:
        if anchor == "first_layer":
            return self.layers[0]
        return self.final_norm if anchor == "final_norm" else self.unembed

    def _view(self, view: View | None) -> HeadSlice | None:
        family = self.family
        if view is None:
            return None
        if view == "values":
            return VALUE_SLICES[family.qkv_layout](self.n_heads, self.n_kv_heads, self.d_head, family.qkv_groups)
        if view == "heads":
            return HeadSlice(self.n_heads, self.d_head)
        heads = self.n_heads if view == "q norm" else self.n_kv_heads
        return HeadSlice(heads, self.d_head, layout=family.qk_norm_layout)

    def site(self, address: Address) -> Site:
        """Where ``address`` is read and written (not for derived ``resid_mid``), from its :data:`SITES` row;
        kept per address, as the modules it names are the loaded model's own (like :attr:`layers`)."""
        found = self._site_of.get(address)
        if found is None:
            found = self._site_of[address] = self._find_site(address)
        return found

    def _find_site(self, address: Address) -> Site:
        row = SITES.get(address.kind)
        if row is None or row.when in ("result", "derived"):
            raise UnsupportedAddress(f"{address} has no hook site in the eager backend", address=address)
        when = cast(When, row.when)
        if row.at[0] in _MODEL_ANCHORS:
            module = self._model_module(row.at[0])
            if module is None and row.else_input_of is not None:
                module, when = self._model_module(row.else_input_of), "pre"
            if module is None:  # pragma: no cover - only the final norm is ever absent
                raise UnsupportedAddress(f"{address} has no hook site", address=address)
            return Site(module, when)
        if address.layer is None:
            raise UnsupportedAddress(f"{address} has no hook site", address=address)
        module = self._module(address)
        index = row.index if isinstance(row.index, int) else int(getattr(self.family, row.index))
        heads = self._view(row.view)
        cols = ColumnSlice(row.part, 2) if row.part is not None and self.family.gate_up_fused else None
        scale = self.family.residual_multiplier if row.added else 1.0
        return Site(module, when, index=index, heads=heads, cols=cols, scale=scale)

    def d_mlp(self) -> int:
        """The width of ``mlp_post``, the one rule for ``d_mlp`` on this backend: the input width of a
        dense layer's down projection; on a model whose every layer is a mixture of experts (no
        ``mlp_post``), one expert's hidden, from the config."""
        if self.dense_layers and self.family.mlp_down is not None:
            io = linear_io(self.layer_module(min(self.dense_layers), self.family.mlp_down))
            if io is None:
                raise UnsupportedAddress("cannot read the MLP width of this model", address="mlp_post")
            return io[0]
        config: Any = self.config
        for name in ("moe_intermediate_size", "intermediate_size", "ffn_dim"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return int(config.hidden_size) * 4

    def residual_after_attention(self, layer: int) -> Address:
        """The point whose value the attention sublayer adds to the residual (``resid_mid`` is
        ``resid_pre`` plus it): ``attn_out_post`` on sandwich-norm families, else ``attn_out``."""
        return Address("attn_out_post" if self.sandwich else "attn_out", layer)

    def check_servable(self, address: Address) -> None:
        if address.kind == "resid_mid" and self.post_norm:
            raise UnsupportedAddress(
                f"{address}: this model normalises the residual after each block "
                "(post-LN), so there is no resid_mid; read attn_out or resid_post",
                address=address,
                valid=("resid_pre", "attn_out", "mlp_out", "resid_post"),
            )

    def unembed_residuals(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, anything between it and the unembedding, the unembedding, and the
        model's logit post-processing (a constant logit scale, Gemma 2's soft-capping)."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        for module in self.before_unembed:
            x = module(x)
        logits: torch.Tensor = self.unembed(x)
        if self.family.logit_multiplier != 1.0:
            logits = logits * self.family.logit_multiplier
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- gradient probes -----------------------------------------------------------------------
    def attention_probes(self) -> bool:
        """Whether the attention taps run before the attention function and can hand it other
        queries and keys (transformers' attention interface, a family's own method read before it
        runs), so ``attn_q``/``attn_k`` take gradient probes."""
        family = self.family
        if family.attn_fn is None:
            return True
        return family.attn_fn.rsplit(".", 1)[-1] != "forward" and not family.attn_scores_at_softmax

    def probe_kinds(self) -> list[str]:
        """The kinds this model serves where a gradient can be taken: every writable kind, and the
        attention function's queries and keys where :meth:`attention_probes` says so."""
        queries = self.attention_probes()
        return [
            k
            for k in self.served_kinds()
            if KINDS[k].writable or (queries and SITES[k].when == "attention" and SITES[k].no_gradient is None)
        ]

    def no_gradient(self, kind: str) -> str:
        """Why no gradient is taken at ``kind`` on this model."""
        row = SITES.get(kind)
        if row is not None and row.when == "attention" and row.no_gradient is None:
            return _ATTENTION_QK
        return row.no_gradient if row is not None and row.no_gradient else "it is not served here"


def _get(root: nn.Module, path: str) -> Any:
    module: Any = root
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _maybe(root: nn.Module, path: str) -> nn.Module | None:
    try:
        found = _get(root, path)
    except AttributeError:
        return None
    return found if isinstance(found, nn.Module) else None
