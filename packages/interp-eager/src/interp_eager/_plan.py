"""One request's reads and writes, installed as PyTorch hooks for the forwards it runs.

A :class:`Plan` maps each requested address to a *site* (a module and whether its input or
output is read), hooks only those sites, applies the request's writes there, and keeps only
the requested values. Derived points (``resid_mid`` = ``resid_pre`` + ``attn_out``) read their
parts inside the layer and keep only the sum. When every requested value is in hand and
nothing downstream is needed, the forward stops early.

Head addresses are per-head views of a site tensor (:class:`HeadSlice`): ``attn_z`` of the
output projection's input, ``attn_v`` of the projection that makes the values (so a write
there is what the KV cache stores). Queries and keys (``attn_q``/``attn_k``, read-only) are
read where the attention function receives them, after rotary embeddings and q/k norms: an
*attention tap* (:func:`add_attention_tap`) on the attention module, called by transformers'
attention interface (or by the family's own attention method, GPT-J's ``_attn``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from interp_engine import Address, UnsupportedAddress, Write
from interp_engine.validation import write_positions

from ._families import Family, QkvLayout


class StopForward(Exception):
    """Raised from a hook once a capture has everything it asked for."""


@dataclass(frozen=True)
class HeadSlice:
    """Where per-head values sit in the last axis of a site tensor: ``heads`` groups of
    ``stride`` features (default ``d_head``) from feature ``start``, each head's ``d_head``
    values ``offset`` features into its group."""

    heads: int
    d_head: int
    start: int = 0
    stride: int = 0
    offset: int = 0

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[..., heads, d_head]`` view of ``x`` (writing into it writes into ``x``)."""
        stride = self.stride or self.d_head
        region = x[..., self.start : self.start + self.heads * stride]
        groups = region.view(*region.shape[:-1], self.heads, stride)
        return groups[..., self.offset : self.offset + self.d_head]


_VALUE_SLICES: dict[QkvLayout, Callable[[int, int, int], HeadSlice]] = {
    "v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d),
    "q|k|v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d, start=(heads + kv_heads) * d),
    "per-head q|k|v": lambda heads, kv_heads, d: HeadSlice(kv_heads, d, stride=3 * d, offset=2 * d),
}
"""The values in the output of a family's :attr:`~Family.attn_v`, by its ``qkv_layout``."""


@dataclass(frozen=True)
class Site:
    """A hookable tensor: the first input (``pre``) or an output element (``post``) of a module,
    or the query (``index`` 0) or key (1) that a module's attention function receives
    (``attention``, ``[batch, heads, keys, d_head]``). ``heads`` views the tensor per head."""

    module: nn.Module
    when: Literal["pre", "post", "attention"]
    index: int = 0
    heads: HeadSlice | None = None


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

    def layer_module(self, layer: int, path: str) -> nn.Module:
        module: nn.Module = _get(self.layers[layer], path)
        return module

    def site(self, address: Address) -> Site:
        """Where ``address`` is read and written (not for derived ``resid_mid``)."""
        kind, layer = address.kind, address.layer
        if kind == "embed":
            return Site(self.layers[0], "pre")
        if kind == "final_norm":
            if self.final_norm is not None:
                return Site(self.final_norm, "post")
            return Site(self.unembed, "pre")
        if layer is None:
            raise UnsupportedAddress(f"{address} has no hook site", address=address)
        if kind == "resid_pre":
            return Site(self.layers[layer], "pre")
        if kind == "resid_post":
            return Site(self.layers[layer], "post")
        if kind == "attn_out":
            return Site(self.layer_module(layer, self.family.attn_out_module), "post")
        if kind == "mlp_out":
            return Site(self.layer_module(layer, self.family.mlp_out), "post")
        if kind == "mlp_post":
            return Site(self.layer_module(layer, self.family.mlp_down), "pre")
        if kind == "attn_pattern":
            return Site(self.layer_module(layer, self.family.attn), "post", index=1)
        if kind == "attn_z":
            return Site(self.layer_module(layer, self.family.attn_o), "pre", heads=HeadSlice(self.n_heads, self.d_head))
        if kind == "attn_v":
            values = _VALUE_SLICES[self.family.qkv_layout](self.n_heads, self.n_kv_heads, self.d_head)
            return Site(self.layer_module(layer, self.family.attn_v), "post", heads=values)
        if kind in ("attn_q", "attn_k"):
            return Site(self.layer_module(layer, self.family.attn), "attention", index=int(kind == "attn_k"))
        raise UnsupportedAddress(f"{address} has no hook site in the eager backend", address=address)

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

    write: Write
    rows_positions: list[list[int]]
    """Per batch row, the absolute positions the write touches (in the vector's row order)."""
    vector: torch.Tensor | None = None

    def _vector(self, like: torch.Tensor) -> torch.Tensor:
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
        vector = self._vector(rows)
        if self.write.per_position:
            vector = vector[torch.tensor(vec_rows, device=rows.device)]
        b = torch.tensor(batch, device=rows.device)
        c = torch.tensor(cols, device=rows.device)
        out = rows.clone()
        out[b, c] = self.write.apply(rows[b, c], vector)
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
        writes: Sequence[Write],
        rows_lengths: Sequence[int],
        *,
        n_prompt: Sequence[int] | None = None,
        total: Sequence[int] | None = None,
        stop_early: bool = False,
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
            arch.check_servable(write.address)
            positions = [write_positions(write, n, t) for n, t in zip(prompts, totals, strict=True)]
            edit = _Edit(write, positions)
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
        attn_site = self._sites[self.arch.site(Address("attn_out", layer))]
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
        if site.when == "attention":  # [batch, heads, keys, d_head]; the chunk's tokens are the last keys
            return value[:, :, value.shape[2] - self.chunk.length :].transpose(1, 2)
        rows = _as_rows(value, self.chunk)
        return rows if site.heads is None else site.heads.of(rows)

    def _put(self, site: Site, value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``value`` with its ``_rows`` replaced by ``rows``."""
        if site.heads is None:
            return rows.reshape(value.shape)
        out = value.clone()
        site.heads.of(_as_rows(out, self.chunk)).copy_(rows)
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
        if site.when == "attention":  # read-only: queries and keys are not writable

            def tap(query: torch.Tensor, key: torch.Tensor) -> None:
                self._handle(site, site_plan, key if site.index else query)
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
            if address.kind == "attn_pattern":
                keys = max(c.shape[-1] for c in chunks)
                padded = [torch.nn.functional.pad(c, (0, keys - c.shape[-1])) for c in chunks]
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


# -- attention taps: the queries and keys an attention function receives ----------------------

_TAPS = "_interp_engine_attention_taps"
_PATCHED = "_interp_engine_tapped"
_patch_lock = threading.Lock()
AttentionTap = Callable[[torch.Tensor, torch.Tensor], None]


def _run_taps(module: Any, query: torch.Tensor, key: torch.Tensor) -> None:
    taps = getattr(module, "__dict__", {}).get(_TAPS)
    if taps:
        for tap in tuple(taps):
            tap(query, key)


def _tapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (an attention implementation) calling the taps of the module it runs for
    (a fresh closure per lookup: caching them would keep every function ever looked up alive)."""

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
        _run_taps(module, query, key)
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
    """Call ``tap(query, key)`` each time ``module``'s attention function runs, with the
    ``[batch, heads, keys, d_head]`` tensors it receives (keys include any cached ones, the
    current tokens last). ``method`` names the module's own attention method when the family
    does not use transformers' attention interface (GPT-J's ``_attn``); it is shadowed on the
    instance while taps are installed. Remove with the returned handle's ``remove()``."""
    taps: list[AttentionTap] = module.__dict__.setdefault(_TAPS, [])
    if not taps:
        if method is None:
            _patch_attention_interface()
        else:
            original = getattr(module, method)

            def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> Any:
                _run_taps(module, query, key)
                return original(query, key, value, *a, **kw)

            module.__dict__[method] = call
    taps.append(tap)
    return _TapHandle(module, tap, method)
