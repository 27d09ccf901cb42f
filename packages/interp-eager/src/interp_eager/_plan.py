"""One request's reads and writes, installed as PyTorch hooks for the forwards it runs.

A :class:`Plan` maps each requested address to a *site* (a module and whether its input or
output is read), hooks only those sites, applies the request's writes there, and keeps only
the requested values. Derived points (``resid_mid`` = ``resid_pre`` + ``attn_out``) read their
parts inside the layer and keep only the sum. When every requested value is in hand and
nothing downstream is needed, the forward stops early.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from interp_engine import Address, UnsupportedAddress, Write
from interp_engine.validation import write_positions

from ._families import Family


class StopForward(Exception):
    """Raised from a hook once a capture has everything it asked for."""


@dataclass(frozen=True)
class Site:
    """A hookable tensor: the first input (``pre``) or an output element (``post``) of a module."""

    module: nn.Module
    when: Literal["pre", "post"]
    index: int = 0


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

    def apply(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        shaped = _as_rows(x, chunk)
        rows: list[int] = []
        cols: list[int] = []
        vec_rows: list[int] = []
        end = chunk.offset + chunk.length
        for row, positions in enumerate(self.rows_positions):
            for j, p in enumerate(positions):
                if chunk.offset <= p < end:
                    rows.append(row)
                    cols.append(p - chunk.offset)
                    vec_rows.append(j)
        if not rows:
            return x
        if self.vector is None or self.vector.device != x.device or self.vector.dtype != x.dtype:
            self.vector = self.write.vector.to(device=x.device, dtype=x.dtype)
        vec = self.vector
        scale = self.write.scale
        r = torch.tensor(rows, device=x.device)
        c = torch.tensor(cols, device=x.device)
        current = shaped[r, c]
        if vec.dim() == 2:
            vec = vec[torch.tensor(vec_rows, device=x.device)]
        if self.write.op == "add":
            new = current + scale * vec
        elif self.write.op == "set":
            new = (scale * vec).expand_as(current)
        else:  # ablate
            direction = vec / vec.norm()
            new = current - scale * (current @ direction).unsqueeze(-1) * direction
        out = shaped.clone()
        out[r, c] = new.to(out.dtype)
        return out.view_as(x)


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

    def _record(self, address: Address, value: torch.Tensor) -> None:
        self.values[address].append(_as_rows(value, self.chunk).detach().clone())
        self._pending.discard(address)

    def _finish_site(self) -> None:
        if self.stop_early and not self._pending:
            raise StopForward

    def _handle(self, plan: _SitePlan, value: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        for edit in plan.edits:
            value = edit.apply(value, chunk)
        for layer in plan.stash_resid_pre_for:
            self._stash[layer] = value
        if plan.mid_layer is not None and (plan.mid_edits or plan.mid_reads):
            resid_pre = _as_rows(self._stash[plan.mid_layer], chunk)
            mid = resid_pre + _as_rows(value, chunk)
            for edit in plan.mid_edits:
                mid = edit.apply(mid, chunk)
            if plan.mid_edits:
                value = (mid - resid_pre).view_as(value)
            for address in plan.mid_reads:
                self._record(address, mid)
        for address in plan.reads:
            self._record(address, value)
        return value

    def hooks(self) -> list[Callable[[], Any]]:
        handles = []
        for site, site_plan in self._sites.items():
            handles.append(self._hook(site, site_plan))
        return handles

    def _hook(self, site: Site, site_plan: _SitePlan) -> Any:
        if site.when == "pre":

            def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    value = self._handle(site_plan, args[0])
                    result: Any = ((value, *args[1:]), kwargs) if site_plan.edits else None
                else:
                    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                    value = self._handle(site_plan, kwargs[key])
                    result = (args, {**kwargs, key: value}) if site_plan.edits else None
                self._finish_site()
                return result

            return site.module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            changes = bool(site_plan.edits or site_plan.mid_edits)
            if isinstance(output, torch.Tensor):
                value = self._handle(site_plan, output)
                result: Any = value if changes else None
            else:
                items = list(output)
                if items[site.index] is None:
                    raise UnsupportedAddress(
                        "this attention implementation returned no attention weights",
                        address=site_plan.reads[0] if site_plan.reads else None,
                    )
                items[site.index] = self._handle(site_plan, items[site.index])
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
