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
attention interface (or by the family's own attention method, GPT-J's ``_attn``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from interp_engine import KINDS, Address, FeatureWrite, Sae, UnsupportedAddress, Write
from interp_engine.validation import write_positions

from ._families import Family, QkNormLayout, QkvLayout


class StopForward(Exception):
    """Raised from a hook once a capture has everything it asked for."""


@dataclass(frozen=True)
class HeadSlice:
    """Where per-head values sit in a site tensor. ``layout="flat"``: in its last axis,
    ``heads`` groups of ``stride`` features (default ``d_head``) from feature ``start``, each
    head's ``d_head`` values ``offset`` features into its group. ``"tokens x heads"``: the tensor
    is ``[batch, tokens, heads, d_head]`` already; ``"heads x tokens"``: it is ``[batch, heads,
    tokens, d_head]`` (the q/k norms of Qwen3 and of Gemma 3, StableLM, Phi)."""

    heads: int
    d_head: int
    start: int = 0
    stride: int = 0
    offset: int = 0
    layout: QkNormLayout = "flat"

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[batch, tokens, heads, d_head]`` view of ``x`` (writing into it writes into ``x``)."""
        if self.layout == "tokens x heads":
            return x
        if self.layout == "heads x tokens":
            return x.transpose(1, 2)
        stride = self.stride or self.d_head
        region = x[..., self.start : self.start + self.heads * stride]
        groups = region.view(*region.shape[:-1], self.heads, stride)
        return groups[..., self.offset : self.offset + self.d_head]


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


_VALUE_SLICES: dict[QkvLayout, Callable[[int, int, int], HeadSlice]] = {
    "v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d),
    "q|k|v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d, start=(heads + kv_heads) * d),
    "per-head q|k|v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d, stride=3 * d, offset=2 * d),
}
"""The values in the output of a family's :attr:`~Family.attn_v`, by its ``qkv_layout``."""


EAGER_KINDS = tuple(KINDS)
"""Every kind the eager backend knows where to read (:meth:`Architecture.site`)."""

ATTENTION_SCORES = 2
"""The :attr:`Site.index` of an attention site that reads the pre-softmax scores."""


@dataclass(frozen=True)
class Site:
    """A hookable tensor: the first input (``pre``) or an output element (``post``) of a module,
    or, at a module's attention function (``attention``), the query (``index`` 0) or key (1) it
    receives (``[batch, heads, keys, d_head]``) or the scores it computes (2, ``[batch, heads,
    queries, keys]``). ``cols`` selects a block of the tensor's last axis; ``heads`` views the
    tensor (or that block) per head."""

    module: nn.Module
    when: Literal["pre", "post", "attention"]
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
    """A loaded HF model seen through its family adapter: modules by address."""

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
        self.parallel = family.parallel(self.config)
        self.post_norm = family.post_norm(self.config)
        config: Any = self.config
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.d_head = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self._paths = {kind: path for kind, path in self._optional_paths().items() if self._in_every_layer(path)}
        self.sandwich = "attn_out_post" in self._paths
        """Whether a post-attention norm sits between ``attn_out`` and the residual (Gemma 2/3, OLMo 2)."""

    def _optional_paths(self) -> dict[str, str | None]:
        family = self.family
        return {
            "mlp_pre_linear": family.mlp_pre_linear,
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
        """Every kind this loaded model has (the family's table, less the optional modules -- gated
        MLP, q/k norms, sandwich norms -- it lacks), mapped to how it is read: by a hook, or, for
        ``attn_scores``, recomputed from the queries, keys and mask the attention function got."""
        optional = self._optional_paths()
        kinds = {}
        for kind in EAGER_KINDS:
            if kind in optional and kind not in self._paths:
                continue
            if kind == "resid_mid" and self.post_norm:
                continue
            if KINDS[kind].width in ("experts", "experts per token"):  # mixture-of-experts layers only
                continue
            kinds[kind] = "recompute" if kind == "attn_scores" else "hook"
        return kinds

    def layer_module(self, layer: int, path: str) -> nn.Module:
        module: nn.Module = _get(self.layers[layer], path)
        return module

    def _optional(self, address: Address) -> nn.Module:
        path = self._paths.get(address.kind)
        if path is None or address.layer is None:
            raise UnsupportedAddress(f"{address}: this model has no {address.kind}", address=address)
        return self.layer_module(address.layer, path)

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
            return Site(self.layer_module(layer, family.attn), "post")
        if kind == "mlp_in":
            return Site(self.layer_module(layer, family.mlp_in), "pre")
        if kind == "mlp_out":
            return Site(self.layer_module(layer, family.mlp_out), "post")
        if kind == "mlp_pre":
            cols = ColumnSlice(0, 2) if family.gate_up_fused else None
            return Site(self.layer_module(layer, family.mlp_pre), "post", cols=cols)
        if kind == "mlp_pre_linear":
            cols = ColumnSlice(1, 2) if family.gate_up_fused else None
            return Site(self._optional(address), "post", cols=cols)
        if kind == "mlp_post":
            return Site(self.layer_module(layer, family.mlp_down), "pre")
        if kind in ("attn_out_post", "mlp_out_post"):
            return Site(self._optional(address), "post")
        if kind == "attn_pattern":
            return Site(self.layer_module(layer, family.attn), "post", index=1)
        if kind == "attn_z":
            return Site(self.layer_module(layer, family.attn_o), "pre", heads=HeadSlice(self.n_heads, self.d_head))
        if kind == "attn_v":
            values = _VALUE_SLICES[family.qkv_layout](self.n_heads, self.n_kv_heads, self.d_head)
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
        family's logit post-processing (Gemma 2's soft-capping)."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        for module in self.before_unembed:
            x = module(x)
        logits: torch.Tensor = self.unembed(x)
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
    ) -> None:
        self.arch = arch
        self.stop_early = stop_early
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
        for write in writes:
            if write.address is None:  # pragma: no cover - the model binds feature writes
                raise UnsupportedAddress(f"an unbound feature write on {getattr(write, 'sae', '?')!r}")
            arch.check_servable(write.address)
            positions = [write_positions(write, n, t) for n, t in zip(prompts, totals, strict=True)]
            edit = _Edit(write, positions)
            if isinstance(write, FeatureWrite):
                edit.sae = (saes or {})[write.sae]
            if write.address.kind == "resid_mid":
                self._plan_mid(write.address.layer).mid_edits.append(edit)
            else:
                self._sites[arch.site(write.address)].edits.append(edit)
        self.wanted = set(points)
        self._pending: set[Address] = set()

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

    def _record(self, address: Address, rows: torch.Tensor) -> None:
        self.values[address].append(rows.detach().clone())
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
        if site.heads is None and site.cols is None:
            return rows.reshape(value.shape)
        out = value.clone()
        self._view(site, _as_rows(out, self.chunk)).copy_(rows)
        return out

    def _handle(self, site: Site, plan: _SitePlan, value: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        rows = self._rows(site, value)
        edited = rows
        for edit in plan.edits:
            edited = edit.apply(edited, chunk)
        for layer in plan.stash_resid_pre_for:
            self._stash[layer] = edited
        if plan.mid_layer is not None and (plan.mid_edits or plan.mid_reads):
            resid_pre = self._stash[plan.mid_layer]
            mid = resid_pre + edited
            steered = mid
            for edit in plan.mid_edits:
                steered = edit.apply(steered, chunk)
            if steered is not mid:
                edited = steered - resid_pre
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
        if site.when == "attention":  # read-only: queries, keys and scores are not writable
            divisor = self.arch.family.attn_score_divisor

            def tap(call: AttentionCall) -> None:
                if site.index == ATTENTION_SCORES:
                    value = attention_scores(call, divisor=divisor)
                else:
                    value = call.key if site.index else call.query
                self._handle(site, site_plan, value)
                self._finish_site()

            return add_attention_tap(site.module, tap, method=self.arch.family.attn_fn)

        if site.when == "pre":

            def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    value = self._handle(site, site_plan, args[0])
                    result: Any = ((value, *args[1:]), kwargs) if site_plan.edits else None
                else:
                    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                    value = self._handle(site, site_plan, kwargs[key])
                    result = (args, {**kwargs, key: value}) if site_plan.edits else None
                self._finish_site()
                return result

            return site.module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            changes = bool(site_plan.edits or site_plan.mid_edits)
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


AttentionTap = Callable[[AttentionCall], None]


def _mask_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The attention mask among the arguments after ``(query, key, value)``."""
    return args[0] if args else kwargs.get("attention_mask")


def attention_scores(call: AttentionCall, *, divisor: str | None = None) -> torch.Tensor:
    """The pre-softmax scores ``[batch, heads, queries, keys]`` of ``call`` as its softmax sees
    them: ``q @ k^T`` times ``scaling`` (default ``d_head ** -0.5``; with ``divisor``, divided by
    that attribute of the module, in float32, as GPT-J's ``_attn`` does), soft-capped where
    ``softcap`` is given, the mask applied; ``-inf`` where masked. The operations are the eager
    attention's own, in its order, so ``softmax`` of the result is its attention weights."""
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


def _run_taps(module: Any, make_call: Callable[[], AttentionCall]) -> None:
    taps = getattr(module, "__dict__", {}).get(_TAPS)
    if taps:
        call = make_call()
        for tap in tuple(taps):
            tap(call)


def _tapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (an attention implementation) calling the taps of the module it runs for
    (a fresh closure per lookup: caching them would keep every function ever looked up alive)."""

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
        _run_taps(
            module,
            lambda: AttentionCall(module, query, key, _mask_argument(a, kw), kw.get("scaling"), kw.get("softcap")),
        )
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
    def __init__(self, module: nn.Module, tap: AttentionTap, method: str | None) -> None:
        self.module, self.tap, self.method = module, tap, method

    def remove(self) -> None:
        taps: list[AttentionTap] = self.module.__dict__.get(_TAPS, [])
        if self.tap in taps:
            taps.remove(self.tap)
        if not taps:
            self.module.__dict__.pop(_TAPS, None)
            if self.method is not None:
                self.module.__dict__.pop(self.method, None)


def add_attention_tap(module: nn.Module, tap: AttentionTap, *, method: str | None = None) -> _TapHandle:
    """Call ``tap(call)`` each time ``module``'s attention function runs, with an
    :class:`AttentionCall` holding what it received (keys include any cached ones, the current
    tokens last). ``method`` names the module's own attention method, called as
    ``method(query, key, value, attention_mask)``, when the family does not use transformers'
    attention interface (GPT-J's ``_attn``); it is shadowed on the instance while taps are
    installed. Remove with the returned handle's ``remove()``."""
    taps: list[AttentionTap] = module.__dict__.setdefault(_TAPS, [])
    if not taps:
        if method is None:
            _patch_attention_interface()
        else:
            original = getattr(module, method)

            def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
                _run_taps(module, lambda: AttentionCall(module, query, key, _mask_argument(a, kw)))
                return original(query, key, value, *a, **kw)

            module.__dict__[method] = call
    taps.append(tap)
    return _TapHandle(module, tap, method)
