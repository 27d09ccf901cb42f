"""One request's reads and writes, installed as PyTorch hooks for the forwards it runs.

A :class:`Plan` maps each requested address to a *site* (a module and whether its input or
output is read), hooks only those sites, applies the request's writes there, and keeps only
the requested values. Derived points (``resid_mid`` = ``resid_pre`` + what the attention
sublayer adds to the residual: ``attn_out``, or ``attn_out_post`` on sandwich-norm families)
read their parts inside the layer and keep only the sum. When every requested value is in hand
and nothing downstream is needed, the forward stops early.

Most points are a module's first input or output: ``attn_in``/``mlp_in`` the attention's and
the MLP's inputs, ``mlp_pre``/``mlp_pre_linear`` the outputs of the MLP's input projections (a
:class:`ColumnSlice` of a fused ``[gate | up]`` projection), ``q_norm_*``/``k_norm_*`` the
inputs and outputs of the q/k norms, ``attn_out_post``/``mlp_out_post`` the sandwich norms'
outputs, ``logits_raw`` the unembedding's output. Which of them a loaded model has is
:meth:`Architecture.served_kinds`.

Head addresses are per-head views of a site tensor (:class:`HeadSlice`): ``attn_z`` of the
output projection's input, ``attn_v`` of the projection that makes the values (so a write
there is what the KV cache stores), the q/k-norm points of the tensors those norms see.
Queries and keys (``attn_q``/``attn_k``, read-only) and the pre-softmax scores
(``attn_scores``, read-only, computed from them with the call's scaling, soft-cap and mask) are
read where the attention function receives them, after rotary embeddings and q/k norms: an
*attention tap* (:func:`add_attention_tap`) on the attention module, called by transformers'
attention interface (or by the family's own attention method, GPT-J's ``_attn``, or, for an
attention module computing attention in its own forward -- Bloom, Falcon, MPT, XGLM -- from the
operands of its ``q @ k^T`` product and what its softmax receives, ALiBi biases included).

On a mixture-of-experts layer, ``router_logits`` are read (and written) by a *router tap*
(:func:`add_router_tap`): while the router runs, the first linear map to ``n_experts`` outputs it
computes is handed to the plan, and the router routes from what the plan returns, so a write
reroutes; ``expert_indices``/``expert_weights`` are the experts module's positional arguments.

For gradients (``EagerModel.capture_gradients``), a plan takes *probes*: at each, after the
writes, a zero tensor that requires grad is added to the value the model carries on (``x +
delta``, in :attr:`Plan.probed`), so the gradient with respect to ``delta`` is the gradient with
respect to the value. That works wherever a write does, and at ``attn_q``/``attn_k`` where the
attention tap runs before the attention function (:func:`attention_probes`); elsewhere
:func:`check_probe` refuses.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from interp_engine import KINDS, Address, FeatureWrite, KindNotInFamily, Sae, UnsupportedAddress, Write
from interp_engine.backend import write_positions

from ._families import Family, QkNormLayout, QkvLayout


class StopForward(Exception):
    """Raised from a hook once a capture has everything it asked for."""


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


EAGER_KINDS = tuple(KINDS)
"""Every kind the eager backend knows where to read (:meth:`Architecture.site`)."""

_MOE_KINDS = frozenset({"router_logits", "expert_indices", "expert_weights"})
_DENSE_MLP_KINDS = frozenset({"mlp_pre", "mlp_pre_linear", "mlp_post"})

ATTENTION_SCORES = 2
"""The :attr:`Site.index` of an attention site that reads the pre-softmax scores."""


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
    when: Literal["pre", "post", "attention", "router"]
    index: int = 0
    heads: HeadSlice | None = None
    cols: ColumnSlice | None = None


@dataclass
class Chunk:
    """The shape of the forward being run: ``batch`` rows of ``length`` tokens from ``offset``."""

    batch: int
    length: int
    offset: int


class Architecture:
    """A loaded HF model seen through its resolved family: modules by address."""

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
        self._paths = {kind: path for kind, path in self._optional_paths().items() if self._in_every_layer(path)}
        self.sandwich = "attn_out_post" in self._paths
        """Whether a post-attention norm sits between ``attn_out`` and the residual (Gemma 2/3, OLMo 2)."""
        self.moe_layers = frozenset(
            i for i, layer in enumerate(self.layers) if family.router and _maybe(layer, family.router) is not None
        )
        """The mixture-of-experts layers (their MLP is a router and experts)."""
        self.dense_layers = frozenset(range(len(self.layers))) - self.moe_layers

    def _optional_paths(self) -> dict[str, str | None]:
        family = self.family
        return {
            "q_norm_in": family.q_norm,
            "q_norm_out": family.q_norm,
            "k_norm_in": family.k_norm,
            "k_norm_out": family.k_norm,
            "attn_out_post": family.attn_post_norm,
            "mlp_out_post": family.mlp_post_norm,
        }

    def missing_module(self, kind: str) -> str | None:
        """The module the family's table names for ``kind`` when this model lacks it (StableLM or
        Phi without ``qk_layernorm``, Gemma 2's ``q_norm``), else ``None``."""
        path = self._optional_paths().get(kind)
        return path if path is not None and kind not in self._paths else None

    def _in_every_layer(self, path: str | None) -> bool:
        return path is not None and all(_maybe(layer, path) is not None for layer in self.layers)

    def served_kinds(self) -> dict[str, str]:
        """Every kind this loaded model has (the resolved family, less the optional modules -- gated
        MLP, q/k norms, sandwich norms, a mixture of experts' router -- it lacks), mapped to how it is
        read: by a hook, or, for ``attn_scores``, recomputed from the queries, keys and mask the
        attention function got. A kind some layers lack (``mlp_pre`` on a mixture-of-experts layer of
        a model whose other layers are dense) is served and refused on those layers."""
        optional = self._optional_paths()
        family = self.family
        kinds = {}
        for kind in EAGER_KINDS:
            if kind in optional and kind not in self._paths:
                continue
            if kind == "resid_mid" and self.post_norm:
                continue
            if kind in _MOE_KINDS and not self.moe_layers:
                continue
            if kind in _DENSE_MLP_KINDS and not self.dense_layers:
                continue
            if kind == "mlp_pre_linear" and family.mlp_pre_linear is None:
                continue
            if kind == "attn_scores" and family.attention_sinks:
                continue
            kinds[kind] = "recompute" if kind == "attn_scores" else "hook"
        return kinds

    def missing_reason(self, kind: str) -> str | None:
        """Why this model lacks ``kind`` when structure says so, else ``None``."""
        if kind == "attn_scores" and self.family.attention_sinks:
            return (
                "its attention also normalises over a learned sink logit per head, so no scores over the "
                "keys alone are what its softmax sees; read attn_pattern"
            )
        if kind in _MOE_KINDS and not self.moe_layers:
            return "it is not a mixture of experts"
        if kind in _DENSE_MLP_KINDS and not self.dense_layers:
            return (
                "every layer's MLP is a mixture of experts: there is no single MLP hidden; "
                "read mlp_in, mlp_out or the router points"
            )
        return None

    def layer_module(self, layer: int, path: str) -> nn.Module:
        module: nn.Module = _get(self.layers[layer], path)
        return module

    def _optional(self, address: Address) -> nn.Module:
        path = self._paths.get(address.kind)
        if path is None or address.layer is None:
            raise UnsupportedAddress(f"{address}: this model has no {address.kind}", address=address)
        return self.layer_module(address.layer, path)

    def _layer_kind(self, address: Address, path: str | None) -> nn.Module:
        """The module of a kind only some layers have (dense-MLP or router points)."""
        layer = address.layer if address.layer is not None else 0
        index = layer % len(self.layers)
        if address.kind in _MOE_KINDS:
            if index not in self.moe_layers or path is None:
                raise KindNotInFamily(
                    f"{address}: layer {index} of this model has a dense MLP, not a mixture of experts",
                    address=address,
                )
        elif index in self.moe_layers or path is None:
            raise KindNotInFamily(
                f"{address}: layer {index} of this model is a mixture of experts, so there is no single MLP "
                "hidden; read mlp_in, mlp_out or router_logits/expert_indices/expert_weights there",
                address=address,
            )
        return self.layer_module(layer, path)

    def site(self, address: Address) -> Site:
        """Where ``address`` is read and written (not for derived ``resid_mid``)."""
        kind, layer = address.kind, address.layer
        family = self.family
        if kind == "embed":
            return Site(self.layers[0], "pre")
        if kind == "final_norm":
            if self.final_norm is not None:
                return Site(self.final_norm, "post")
            return Site(self.unembed, "pre")
        if kind == "logits_raw":
            return Site(self.unembed, "post")
        if layer is None:
            raise UnsupportedAddress(f"{address} has no hook site", address=address)
        if kind == "resid_pre":
            return Site(self.layers[layer], "pre")
        if kind == "resid_post":
            return Site(self.layers[layer], "post")
        if kind == "attn_in":
            return Site(self.layer_module(layer, family.attn), "pre")
        if kind == "attn_out":
            return Site(self.layer_module(layer, family.attn_out_at or family.attn), "post")
        if kind == "mlp_in":
            return Site(self.layer_module(layer, family.mlp_in), "pre")
        if kind == "mlp_out":
            return Site(self.layer_module(layer, family.mlp_out), "post")
        if kind == "mlp_pre":
            cols = ColumnSlice(0, 2) if family.gate_up_fused else None
            return Site(self._layer_kind(address, family.mlp_pre), "post", cols=cols)
        if kind == "mlp_pre_linear":
            cols = ColumnSlice(1, 2) if family.gate_up_fused else None
            return Site(self._layer_kind(address, family.mlp_pre_linear), "post", cols=cols)
        if kind == "mlp_post":
            return Site(self._layer_kind(address, family.mlp_sub_norm or family.mlp_down), "pre")
        if kind == "router_logits":
            return Site(self._layer_kind(address, family.router), "router", index=family.n_experts)
        if kind == "expert_indices":
            return Site(self._layer_kind(address, family.experts), "pre", index=family.expert_index_arg)
        if kind == "expert_weights":
            return Site(self._layer_kind(address, family.experts), "pre", index=family.expert_weight_arg)
        if kind in ("attn_out_post", "mlp_out_post"):
            return Site(self._optional(address), "post")
        if kind == "attn_pattern":
            return Site(self.layer_module(layer, family.attn), "post", index=1)
        if kind == "attn_z":
            z = family.attn_sub_norm or family.attn_o
            return Site(self.layer_module(layer, z), "pre", heads=HeadSlice(self.n_heads, self.d_head))
        if kind == "attn_v":
            values = VALUE_SLICES[family.qkv_layout](self.n_heads, self.n_kv_heads, self.d_head, family.qkv_groups)
            return Site(self.layer_module(layer, family.attn_v), "post", heads=values)
        if kind in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
            heads = self.n_heads if kind.startswith("q") else self.n_kv_heads
            view = HeadSlice(heads, self.d_head, layout=family.qk_norm_layout)
            return Site(self._optional(address), "pre" if kind.endswith("_in") else "post", heads=view)
        if kind in ("attn_q", "attn_k", "attn_scores"):
            index = {"attn_q": 0, "attn_k": 1, "attn_scores": ATTENTION_SCORES}[kind]
            return Site(self.layer_module(layer, family.attn), "attention", index=index)
        raise UnsupportedAddress(f"{address} has no hook site in the eager backend", address=address)

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


# -- gradient probes ---------------------------------------------------------------------------

_NO_GRADIENT = {
    "attn_pattern": "the model never passes it on as one tensor (attention kernels fuse it); take it at attn_q/attn_k",
    "attn_scores": "it is recomputed from the queries and keys; take it at attn_q/attn_k",
    "logits": "the metric's own input: differentiate the metric",
    "logits_raw": "the metric's own input: differentiate the metric",
    "expert_indices": "it holds integers",
    "expert_weights": "it is read from the experts' arguments; take it at router_logits",
}


def attention_probes(arch: Architecture) -> bool:
    """Whether ``arch``'s attention taps run before its attention function and can hand it
    other queries and keys (transformers' attention interface, a family's own method read before
    it runs), so ``attn_q``/``attn_k`` take gradient probes."""
    family = arch.family
    if family.attn_fn is None:
        return True
    return family.attn_fn.rsplit(".", 1)[-1] != "forward" and not family.attn_scores_at_softmax


def probe_kinds(arch: Architecture) -> list[str]:
    """The kinds this model serves where a gradient can be taken: every writable kind, and
    ``attn_q``/``attn_k`` where :func:`attention_probes` says so."""
    queries = attention_probes(arch)
    return [k for k in arch.served_kinds() if KINDS[k].writable or (queries and k in ("attn_q", "attn_k"))]


def check_probe(arch: Architecture, address: Address) -> None:
    """``UnsupportedAddress`` unless a gradient can be taken at ``address`` (:func:`probe_kinds`)."""
    valid = probe_kinds(arch)
    if address.kind in valid:
        return
    if address.kind in ("attn_q", "attn_k"):
        why = (
            "this model computes attention inside its own module, where its queries and keys cannot be "
            "replaced; take it at attn_in, attn_v or attn_z"
        )
    else:
        why = _NO_GRADIENT.get(address.kind, "it is not served here")
    raise UnsupportedAddress(
        f"no gradient at {address}: {why}; gradients are taken at {', '.join(valid)}", address=address, valid=valid
    )


# -- reading and writing one tensor -----------------------------------------------------------


def _as_rows(x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """``[batch, length, width]`` view of a site tensor (OPT flattens to ``[batch*length, w]``)."""
    if x.dim() == 2:
        return x.view(chunk.batch, chunk.length, x.shape[-1])
    return x


@dataclass
class _Edit:
    """A write, resolved for the request: which (row, position) it touches, and its values."""

    write: Write | FeatureWrite
    rows_positions: list[list[int]]
    """Per batch row, the absolute positions the write touches (in the vector's row order)."""
    vector: torch.Tensor | None = None
    sae: Sae | None = None
    """A feature write's SAE."""

    def _vector(self, like: torch.Tensor, target: bool = False) -> torch.Tensor:
        """The write's vector (or its target) on ``like``'s device and dtype (the vector cached)."""
        if not isinstance(self.write, Write):
            raise UnsupportedAddress(f"a feature write has no vector: {self.write!r}")
        if target and self.write.target is not None:
            return self.write.target.to(device=like.device, dtype=like.dtype)
        if self.vector is None or self.vector.device != like.device or self.vector.dtype != like.dtype:
            self.vector = self.write.vector.to(device=like.device, dtype=like.dtype)
        return self.vector

    def apply(self, rows: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """``rows`` (``[batch, length, ...]``) with the write applied where it touches this chunk:
        a new tensor, or ``rows`` itself when the chunk holds none of its positions."""
        batch: list[int] = []
        cols: list[int] = []
        vec_rows: list[int] = []
        end = chunk.offset + chunk.length
        for row, positions in enumerate(self.rows_positions):
            for j, p in enumerate(positions):
                if chunk.offset <= p < end:
                    batch.append(row)
                    cols.append(p - chunk.offset)
                    vec_rows.append(j)
        if not batch:
            return rows
        b = torch.tensor(batch, device=rows.device)
        c = torch.tensor(cols, device=rows.device)
        if isinstance(self.write, FeatureWrite):
            if self.sae is None:  # pragma: no cover - the plan binds every feature write's SAE
                raise UnsupportedAddress(f"no SAE for the feature write on {self.write.sae!r}")
            out = rows.clone()
            out[b, c] = self.write.apply(rows[b, c], self.sae)
            return out
        picked = torch.tensor(vec_rows, device=rows.device)
        vector = self._vector(rows)
        if self.write.per_position:
            vector = vector[picked]
        target = None
        if self.write.target is not None:
            target = self._vector(rows, target=True)
            if self.write.target_per_position:
                target = target[picked]
        out = rows.clone()
        out[b, c] = self.write.apply(rows[b, c], vector, target)
        return out


@dataclass
class _SitePlan:
    edits: list[_Edit] = field(default_factory=list)
    reads: list[Address] = field(default_factory=list)
    mid_edits: list[_Edit] = field(default_factory=list)
    mid_reads: list[Address] = field(default_factory=list)
    stash_resid_pre_for: list[int] = field(default_factory=list)
    mid_layer: int | None = None
    probes: list[Address] = field(default_factory=list)
    mid_probes: list[Address] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        """Whether the site hands the model anything other than what it computed."""
        return bool(self.edits or self.mid_edits or self.probes or self.mid_probes)


class Plan:
    """The hooks of one request. Use as ``with plan.installed(): model(...)`` per forward."""

    def __init__(
        self,
        arch: Architecture,
        points: Sequence[Address],
        writes: Sequence[Write | FeatureWrite],
        rows_lengths: Sequence[int],
        *,
        n_prompt: Sequence[int] | None = None,
        total: Sequence[int] | None = None,
        stop_early: bool = False,
        saes: Mapping[str, Sae] | None = None,
        write_rows: Sequence[frozenset[int] | None] | None = None,
        probes: Sequence[Address] = (),
        rows_at: Mapping[Address, Container[int]] | None = None,
    ) -> None:
        """``write_rows``: per write, the batch rows it applies to (``None``: every row), for a
        batch whose rows carry different steering specs. ``probes``: addresses where a zero
        tensor requiring grad is added to the value (after the writes), for a forward run with
        autograd on: the gradient of anything computed downstream with respect to a probe
        (:attr:`probed`) is its gradient with respect to the value there. ``rows_at``: addresses
        read only at some absolute positions (the logit lens during generation): each forward
        keeps just those rows, in :attr:`rows` (they join :attr:`values` only if also in
        ``points``), and they do not count as wanted (no extra forward for them)."""
        self.arch = arch
        self.stop_early = stop_early
        self.steered = bool(writes)
        """Whether this request writes anywhere (its values may then be what the writes made)."""
        self.chunk = Chunk(batch=len(rows_lengths), length=max(rows_lengths), offset=0)
        self.values: dict[Address, list[torch.Tensor]] = defaultdict(list)
        self._stash: dict[int, torch.Tensor] = {}
        self._sites: dict[Site, _SitePlan] = defaultdict(_SitePlan)
        prompts = list(n_prompt or rows_lengths)
        totals = list(total or rows_lengths)

        for point in points:
            arch.check_servable(point)
            if point.kind == "resid_mid":
                self._plan_mid(point.layer).mid_reads.append(point)
            else:
                self._sites[arch.site(point)].reads.append(point)
        for i, write in enumerate(writes):
            if write.address is None:  # pragma: no cover - the model binds feature writes
                raise UnsupportedAddress(f"an unbound feature write on {getattr(write, 'sae', '?')!r}")
            arch.check_servable(write.address)
            only = None if write_rows is None else write_rows[i]
            positions = [
                write_positions(write, n, t) if only is None or row in only else []
                for row, (n, t) in enumerate(zip(prompts, totals, strict=True))
            ]
            edit = _Edit(write, positions)
            if isinstance(write, FeatureWrite):
                edit.sae = (saes or {})[write.sae]
            if write.address.kind == "resid_mid":
                self._plan_mid(write.address.layer).mid_edits.append(edit)
            else:
                self._sites[arch.site(write.address)].edits.append(edit)
        for point in probes:
            check_probe(arch, point)
            if point.kind == "resid_mid":
                self._plan_mid(point.layer).mid_probes.append(point)
            else:
                self._sites[arch.site(point)].probes.append(point)
        self.probed: dict[Address, list[torch.Tensor]] = defaultdict(list)
        """Each probe's zero tensors (one per forward run), ``[batch, length, ...]`` as read."""
        self.wanted = set(points)
        self._pending: set[Address] = set()
        self._rows_at = dict(rows_at or {})
        self.rows: dict[Address, dict[int, torch.Tensor]] = defaultdict(dict)
        """Per ``rows_at`` address: position -> its row ``[batch, ...]`` (as recorded; pop when used)."""
        for point in self._rows_at:
            if point in self.wanted:
                continue  # recorded densely already
            if point.kind == "resid_mid":
                self._plan_mid(point.layer).mid_reads.append(point)
            else:
                self._sites[arch.site(point)].reads.append(point)

    def _plan_mid(self, layer: int | None) -> _SitePlan:
        if layer is None:  # pragma: no cover - resid_mid is per layer by construction
            raise UnsupportedAddress("resid_mid needs a layer", address="resid_mid")
        self._sites[self.arch.site(Address("resid_pre", layer))].stash_resid_pre_for.append(layer)
        attn_site = self._sites[self.arch.site(self.arch.residual_after_attention(layer))]
        attn_site.mid_layer = layer
        return attn_site

    # -- per forward ----------------------------------------------------------------------
    def installed(self, chunk: Chunk) -> _Installed:
        self.chunk = chunk
        self._pending = set(self.wanted)
        return _Installed(self)

    def _probe(self, address: Address, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` plus a new zero tensor requiring grad (kept in :attr:`probed`)."""
        delta = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device, requires_grad=True)
        self.probed[address].append(delta)
        return rows + delta

    def _record(self, address: Address, rows: torch.Tensor) -> None:
        if address in self.wanted:
            self.values[address].append(rows.detach().clone())
        keep = self._rows_at.get(address)
        if keep is not None:
            offset = self.chunk.offset
            for i in range(rows.shape[1]):
                if offset + i in keep:
                    self.rows[address][offset + i] = rows[:, i].detach().clone()
        self._pending.discard(address)

    def _finish_site(self) -> None:
        if self.stop_early and not self._pending:
            raise StopForward

    def _rows(self, site: Site, value: torch.Tensor) -> torch.Tensor:
        """The ``[batch, length, ...]`` values of this chunk at ``site`` (a view of ``value``)."""
        if site.when == "attention":
            if site.index == ATTENTION_SCORES:  # [batch, heads, queries, keys]: the queries are the chunk's
                return value
            # [batch, heads, keys, d_head]; the chunk's tokens are the last keys
            return value[:, :, value.shape[2] - self.chunk.length :].transpose(1, 2)
        return self._view(site, _as_rows(value, self.chunk))

    @staticmethod
    def _view(site: Site, rows: torch.Tensor) -> torch.Tensor:
        if site.cols is not None:
            rows = site.cols.of(rows)
        return rows if site.heads is None else site.heads.of(rows)

    def _put(self, site: Site, value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``value`` with its ``_rows`` replaced by ``rows``."""
        if site.when == "attention":  # [batch, heads, keys, d_head]: the chunk's tokens are the last keys
            earlier = value[:, :, : value.shape[2] - self.chunk.length]
            return torch.cat([earlier, rows.transpose(1, 2)], dim=2)
        if site.heads is None and site.cols is None:
            return rows.reshape(value.shape)
        out = value.clone()
        target = _as_rows(out, self.chunk)
        if site.cols is not None:
            target = site.cols.of(target)
        if site.heads is None:
            target.copy_(rows)
        else:
            site.heads.put(target, rows)
        return out

    def _handle(self, site: Site, plan: _SitePlan, value: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        rows = self._rows(site, value)
        edited = rows
        for edit in plan.edits:
            edited = edit.apply(edited, chunk)
        for address in plan.probes:
            edited = self._probe(address, edited)
        for layer in plan.stash_resid_pre_for:
            self._stash[layer] = edited
        if plan.mid_layer is not None and (plan.mid_edits or plan.mid_reads or plan.mid_probes):
            resid_pre = self._stash[plan.mid_layer]
            mid = resid_pre + edited
            steered = mid
            for edit in plan.mid_edits:
                steered = edit.apply(steered, chunk)
            if steered is not mid:
                edited = steered - resid_pre
            for address in plan.mid_probes:  # resid_mid + delta is what attn_out + delta adds
                steered = self._probe(address, steered)
                edited = edited + self.probed[address][-1]
            for address in plan.mid_reads:
                self._record(address, steered)
        for address in plan.reads:
            self._record(address, edited)
        return value if edited is rows else self._put(site, value, edited)

    def hooks(self) -> list[Any]:
        handles = []
        for site, site_plan in self._sites.items():
            handles.append(self._hook(site, site_plan))
        return handles

    def _hook(self, site: Site, site_plan: _SitePlan) -> Any:
        if site.when == "attention":  # not writable; queries and keys take gradient probes
            divisor = self.arch.family.attn_score_divisor
            repeat = self.arch.family.kv_repeat

            def tap(call: AttentionCall) -> AttentionCall | None:
                if site.index == ATTENTION_SCORES:
                    value = attention_scores(call, divisor=divisor)
                else:
                    value = call.key[:, ::repeat] if site.index else call.query
                handed = self._handle(site, site_plan, value)
                self._finish_site()
                if handed is value:
                    return None
                if site.index:  # keys the function receives repeated per query head: each copy
                    return replace(call, key=handed.repeat_interleave(repeat, dim=1))
                return replace(call, query=handed)

            family = self.arch.family
            owner, method = attention_owner(site.module, family.attn_fn)
            return add_attention_tap(owner, tap, method=method, scores_at_softmax=family.attn_scores_at_softmax)

        if site.when == "router":

            def logits(value: torch.Tensor) -> torch.Tensor:
                edited = self._handle(site, site_plan, value)
                self._finish_site()
                return edited

            return add_router_tap(site.module, site.index, logits)

        if site.when == "pre" and site.index:  # a later positional argument: read-only

            def arg(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                if len(args) <= site.index:
                    raise UnsupportedAddress(
                        f"{type(module).__name__} was not called with argument {site.index} positionally",
                        address=site_plan.reads[0] if site_plan.reads else None,
                    )
                self._handle(site, site_plan, args[site.index])
                self._finish_site()

            return site.module.register_forward_pre_hook(arg, with_kwargs=True)

        if site.when == "pre":

            def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    value = self._handle(site, site_plan, args[0])
                    result: Any = ((value, *args[1:]), kwargs) if site_plan.changes else None
                else:
                    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                    value = self._handle(site, site_plan, kwargs[key])
                    result = (args, {**kwargs, key: value}) if site_plan.changes else None
                self._finish_site()
                return result

            return site.module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            changes = site_plan.changes
            if isinstance(output, torch.Tensor):
                value = self._handle(site, site_plan, output)
                result: Any = value if changes else None
            else:
                items = list(output)
                if items[site.index] is None:
                    raise UnsupportedAddress(
                        "this attention implementation returned no attention weights",
                        address=site_plan.reads[0] if site_plan.reads else None,
                    )
                items[site.index] = self._handle(site, site_plan, items[site.index])
                result = type(output)(items) if changes else None
            self._finish_site()
            return result

        return site.module.register_forward_hook(post)

    def result(self) -> dict[Address, torch.Tensor]:
        """Every requested value, concatenated over the forwards run, ``[batch, pos, ...]``."""
        out: dict[Address, torch.Tensor] = {}
        for address, chunks in self.values.items():
            if address.info.width == "heads x keys":  # [batch, heads, queries, keys]: later chunks see more keys
                keys = max(c.shape[-1] for c in chunks)
                fill = float("-inf") if address.kind == "attn_scores" else 0.0  # keys not yet made: masked
                padded = [torch.nn.functional.pad(c, (0, keys - c.shape[-1]), value=fill) for c in chunks]
                out[address] = torch.cat(padded, dim=2)
            else:
                out[address] = torch.cat(chunks, dim=1)
        return out


class _Installed:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.handles: list[Any] = []

    def __enter__(self) -> Plan:
        self.handles = self.plan.hooks()
        return self.plan

    def __exit__(self, *exc: object) -> bool:
        for handle in self.handles:
            handle.remove()
        return exc[0] is StopForward


# -- attention taps: what an attention function receives -----------------------------------------

_TAPS = "_interp_engine_attention_taps"
_PATCHED = "_interp_engine_tapped"
_patch_lock = threading.Lock()


@dataclass(frozen=True)
class AttentionCall:
    """One call of a module's attention function, as received: queries ``[batch, heads, queries,
    d_head]``, keys ``[batch, kv_heads, keys, d_head]`` (cached ones included, the current tokens
    last), the mask (``None``: causal; bool: ``True`` where attended; float: added to the scores),
    and the ``scaling`` and ``softcap`` arguments when given."""

    module: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None = None
    softcap: float | None = None
    value: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    """What the method's softmax received (an own attention method read at its softmax: GPT-Neo)."""
    """Per-head learned sink logits the softmax also normalises over (gpt-oss's ``s_aux``)."""


AttentionTap = Callable[[AttentionCall], AttentionCall | None]
"""Called with what an attention function received. Where taps run before the function
(transformers' attention interface; a family's own method whose scores are not read at its
softmax), a returned call's query and key are what the function then receives (a gradient
probe's ``x + delta``); elsewhere the return value is ignored."""


def _mask_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The attention mask among the arguments after ``(query, key, value)``."""
    return args[0] if args else kwargs.get("attention_mask")


def attention_scores(call: AttentionCall, *, divisor: str | None = None) -> torch.Tensor:
    """The pre-softmax scores ``[batch, heads, queries, keys]`` of ``call`` as its softmax sees
    them: ``q @ k^T`` times ``scaling`` (default ``d_head ** -0.5``; with ``divisor``, divided by
    that attribute of the module, in float32, as GPT-J's ``_attn`` does), soft-capped where
    ``softcap`` is given, the mask applied; ``-inf`` where masked. The operations are the eager
    attention's own, in its order, so ``softmax`` of the result is its attention weights."""
    if call.scores is not None:  # read at the method's softmax: masked entries hold (about) the dtype's minimum
        scores = call.scores
        return scores.masked_fill(scores <= torch.finfo(scores.dtype).min / _MASKED, float("-inf"))
    query, key = call.query, call.key
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    if divisor is not None:
        scores = torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))
        scores = scores / getattr(call.module, divisor)
    else:
        scaling = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    mask = call.attention_mask
    n_queries, n_keys = scores.shape[-2:]
    if mask is None:  # SDPA's causal mask: the queries are the last tokens
        position = torch.arange(n_queries, device=scores.device) + (n_keys - n_queries)
        visible = torch.arange(n_keys, device=scores.device) <= position[:, None]
        return scores.masked_fill(~visible, float("-inf"))
    mask = mask[..., :n_keys]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return (scores + mask).masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))


_MASKED = 64
"""Scores read at a softmax at or below the dtype's minimum over this are masked (``-inf``): a
mask adds (or fills) the minimum, and some families scale it afterwards (CodeGen divides the
masked scores by ``sqrt(d_head)``)."""


def _run_taps(module: Any, make_call: Callable[[], AttentionCall]) -> AttentionCall | None:
    """Run ``module``'s taps; the call as the last tap left it (``None`` without taps)."""
    taps = getattr(module, "__dict__", {}).get(_TAPS)
    if not taps:
        return None
    call = make_call()
    for tap in tuple(taps):
        call = tap(call) or call
    return call


def _tapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (an attention implementation) calling the taps of the module it runs for
    (a fresh closure per lookup: caching them would keep every function ever looked up alive)."""

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
        call = _run_taps(
            module,
            lambda: AttentionCall(
                module, query, key, _mask_argument(a, kw), kw.get("scaling"), kw.get("softcap"), value, kw.get("s_aux")
            ),
        )
        if call is not None:
            query, key = call.query, call.key
        return function(module, query, key, value, *a, **kw)

    return attention


def _patch_attention_interface() -> None:
    """Make transformers' ``ALL_ATTENTION_FUNCTIONS.get_interface`` hand out tapped functions
    (once per process). Modules without taps run the original function unchanged; the
    implementation (eager, SDPA, ...) and its masks are the model's own."""
    from transformers import modeling_utils

    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    with _patch_lock:
        if getattr(interface, _PATCHED, False):
            return
        original = interface.get_interface

        def get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
            return _tapped(original(attn_implementation, default))

        setattr(interface, "get_interface", get_interface)  # noqa: B010 - an instance attribute, on purpose
        setattr(interface, _PATCHED, True)


class _TapHandle:
    def __init__(self, module: nn.Module, tap: AttentionTap, method: str | None, prior: Any = None) -> None:
        self.module, self.tap, self.method, self.prior = module, tap, method, prior

    def remove(self) -> None:
        taps: list[AttentionTap] = self.module.__dict__.get(_TAPS, [])
        if self.tap in taps:
            taps.remove(self.tap)
        if not taps:
            self.module.__dict__.pop(_TAPS, None)
            if self.method is not None:
                self.module.__dict__.pop(self.method, None)
                if self.prior is not None:  # a forward set on the instance before (accelerate's hooks)
                    self.module.__dict__[self.method] = self.prior


def attention_owner(attention: nn.Module, attn_fn: str | None) -> tuple[nn.Module, str | None]:
    """The module that owns a family's own attention method and the method's name: ``attn_fn`` is
    relative to the attention module (``"_attn"``; GPT-Neo's ``"attention._attn"``)."""
    if attn_fn is None or "." not in attn_fn:
        return attention, attn_fn
    path, method = attn_fn.rsplit(".", 1)
    owner: nn.Module = _get(attention, path)
    return owner, method


class _SoftmaxInput(TorchFunctionMode):
    """While an attention method runs: keep what its first softmax receives (the masked scores)."""

    _SOFTMAX = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax})

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.scores is None and func in self._SOFTMAX and args and isinstance(args[0], torch.Tensor):
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


_PRODUCTS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
    | {torch.baddbmm, torch.Tensor.baddbmm}
)


def _operands(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The two multiplied operands of a product call (``baddbmm``'s ``batch1``, ``batch2``)."""
    if func in (torch.baddbmm, torch.Tensor.baddbmm):
        rest = list(args[1:])
        first = kwargs.get("batch1", rest.pop(0) if rest else None)
        second = kwargs.get("batch2", rest.pop(0) if rest else None)
        return first, second
    return (args[0] if args else kwargs.get("input")), (args[1] if len(args) > 1 else kwargs.get("other"))


class _AttentionProducts(TorchFunctionMode):
    """While an attention module's own forward runs: the operands of the ``q @ k^T`` product whose
    result its first softmax normalises, what that softmax receives, and the operand the softmax's
    output multiplies (the values); or the query, key and value ``scaled_dot_product_attention``
    receives."""

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qk: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scores: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and self.qk is None:
            given = [*args[:3], *(kwargs[n] for n in ("query", "key", "value") if n in kwargs)]
            query, key, value = given[:3]
            self.qk = (query.detach(), key.detach().transpose(-1, -2))
            self.value = value.detach()
        elif func in _PRODUCTS:
            first, second = _operands(func, args, kwargs)
            if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
                if self.scores is None:
                    self.last = (first.detach(), second.detach())
                elif self.value is None:
                    self.value = second.detach()
        elif func in _SoftmaxInput._SOFTMAX and self.scores is None and args and isinstance(args[0], torch.Tensor):
            self.scores = args[0].detach().clone()
            self.qk = self.last
        return func(*args, **kwargs)

    def call(self, module: nn.Module, hidden: Any) -> AttentionCall | None:
        """The :class:`AttentionCall` seen (``[batch, heads, tokens, ...]``), ``None`` if none was."""
        if self.qk is None or self.value is None or not isinstance(hidden, torch.Tensor):
            return None
        batch = int(hidden.shape[0])
        q, k_t = self.qk

        def split(x: torch.Tensor) -> torch.Tensor:  # [..., n, w] -> [batch, heads, n, w]
            return x.reshape(batch, -1, *x.shape[-2:])

        scores = None if self.scores is None else split(self.scores)
        return AttentionCall(
            module, split(q), split(k_t.transpose(-1, -2)), None, value=split(self.value), scores=scores
        )


def add_attention_tap(
    module: nn.Module, tap: AttentionTap, *, method: str | None = None, scores_at_softmax: bool = False
) -> _TapHandle:
    """Call ``tap(call)`` each time ``module``'s attention function runs, with an
    :class:`AttentionCall` holding what it received (keys include any cached ones, the current
    tokens last). ``method`` names the module's own attention method, called as
    ``method(query, key, value, attention_mask)``, when the family does not use transformers'
    attention interface (GPT-J's and GPT-Neo's ``_attn``); it is shadowed on the instance while
    taps are installed, and, with ``scores_at_softmax``, the call also carries what the method's
    softmax received. ``method="forward"``: the module computes attention in its own forward
    (Bloom, Falcon, MPT, XGLM), shadowed on the instance to run under :class:`_AttentionProducts`;
    the call carries the operands of its ``q @ k^T`` product, what its softmax received and the
    values its output multiplies, split per head by the batch size of the module's input. Remove
    with the returned handle's ``remove()``."""
    taps: list[AttentionTap] = module.__dict__.setdefault(_TAPS, [])
    prior = None
    if not taps:
        if method is None:
            _patch_attention_interface()
        elif method == "forward":  # the module's own attention computation: read at its products
            prior = module.__dict__.get("forward")
            original_forward = module.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                with _AttentionProducts() as seen:
                    result = original_forward(*args, **kwargs)
                hidden = args[0] if args else kwargs.get("hidden_states")
                call = seen.call(module, hidden)
                if call is not None:
                    _run_taps(module, lambda: call)
                return result

            module.__dict__["forward"] = forward
        else:
            original = getattr(module, method)

            def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
                if not scores_at_softmax:
                    tapped = _run_taps(
                        module, lambda: AttentionCall(module, query, key, _mask_argument(a, kw), value=value)
                    )
                    if tapped is not None:
                        query, key = tapped.query, tapped.key
                    return original(query, key, value, *a, **kw)
                with _SoftmaxInput() as seen:
                    result = original(query, key, value, *a, **kw)
                mask = _mask_argument(a, kw)
                _run_taps(module, lambda: AttentionCall(module, query, key, mask, value=value, scores=seen.scores))
                return result

            module.__dict__[method] = call
    taps.append(tap)
    return _TapHandle(module, tap, method, prior)


# -- router taps: a mixture of experts' logits, where the router computes them --------------------


class _RouterLogits(TorchFunctionMode):
    """While a router runs: hand the output of its first linear map to ``n_experts`` columns (its
    logits) to ``handle``, and let the router route from what ``handle`` returns."""

    _LINEAR = frozenset({torch.nn.functional.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.addmm})

    def __init__(self, n_experts: int, handle: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.handle = handle
        self.done = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            not self.done
            and func in self._LINEAR
            and isinstance(result, torch.Tensor)
            and result.is_floating_point()
            and result.shape[-1] == self.n_experts
        ):
            self.done = True
            result = self.handle(result)
        return result


class _RouterHandle:
    def __init__(self, module: nn.Module, prior: Any) -> None:
        self.module, self.prior = module, prior

    def remove(self) -> None:
        if self.prior is None:
            self.module.__dict__.pop("forward", None)
        else:  # a forward set on the instance before (accelerate's hooks): put it back
            self.module.__dict__["forward"] = self.prior


def add_router_tap(module: nn.Module, n_experts: int, handle: Callable[[torch.Tensor], torch.Tensor]) -> _RouterHandle:
    """Call ``handle(logits)`` with the router logits ``module`` (a mixture of experts' router)
    computes in each forward -- the first linear map to ``n_experts`` outputs it runs -- and route
    from the tensor it returns (so a write there reroutes). The module's ``forward`` is shadowed on
    the instance until the returned handle's ``remove()``."""
    prior = module.__dict__.get("forward")
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _RouterLogits(n_experts, handle):
            return original(*args, **kwargs)

    module.__dict__["forward"] = forward
    return _RouterHandle(module, prior)
