"""One request's reads and writes, installed as PyTorch hooks for the forwards it runs.

A :class:`Plan` maps each requested address to a *site* (:meth:`Architecture.site
<interp_eager._sites.Architecture.site>`: a module and whether its input or output is read),
hooks only those sites, applies the request's writes there, and keeps only the requested values.
Derived points (``resid_mid`` = ``resid_pre`` + what the attention sublayer adds to the residual:
``attn_out``, or ``attn_out_post`` on sandwich-norm families) read their parts inside the layer
and keep only the sum. When every requested value is in hand and nothing downstream is needed,
the forward stops early.

Head addresses are per-head views of a site tensor (:class:`~interp_eager._sites.HeadSlice`);
queries, keys and scores are read by an attention tap, router logits by a router tap
(:mod:`interp_eager._intercept`), which hand the plan the tensor and take back what it returns.

For gradients (``EagerModel.capture_gradients``), a plan takes *probes*: at each, after the
writes, a zero tensor that requires grad is added to the value the model carries on (``x +
delta``, in :attr:`Plan.probed`), so the gradient with respect to ``delta`` is the gradient with
respect to the value. That works wherever a write does, and at ``attn_q``/``attn_k`` where the
attention tap runs before the attention function
(:meth:`~interp_eager._sites.Architecture.attention_probes`); elsewhere :func:`check_probe` refuses.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from interp_engine import Address, FeatureWrite, Sae, UnsupportedAddress, Write
from interp_engine.backend import write_positions

from ._intercept import AttentionCall, add_attention_tap, add_router_tap, attention_owner, attention_scores
from ._sites import ATTENTION_SCORES, Architecture, Site


class StopForward(Exception):
    """Raised from a hook once a capture has everything it asked for."""


@dataclass
class Chunk:
    """The shape of the forward being run: ``batch`` rows of ``length`` tokens from ``offset``."""

    batch: int
    length: int
    offset: int


def check_probe(arch: Architecture, address: Address) -> None:
    """``UnsupportedAddress`` unless a gradient can be taken at ``address``
    (:meth:`~interp_eager._sites.Architecture.probe_kinds`)."""
    valid = arch.probe_kinds()
    if address.kind in valid:
        return
    why = arch.no_gradient(address.kind)
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
    source: Callable[[], torch.Tensor] | None = None
    """A transcoder feature write's input rows this chunk (``[batch, length, d_in]``)."""

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
            source = None if self.source is None else self.source()[b, c]
            out[b, c] = self.write.apply(rows[b, c], self.sae, source=source)
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
    sources: list[Address] = field(default_factory=list)
    """Transcoder inputs kept for the feature writes at their outputs (this chunk's rows)."""
    mid_sources: list[Address] = field(default_factory=list)

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
        live: bool = False,
    ) -> None:
        """``write_rows``: per write, the batch rows it applies to (``None``: every row), for a
        batch whose rows carry different steering specs. ``probes``: addresses where a zero
        tensor requiring grad is added to the value (after the writes), for a forward run with
        autograd on: the gradient of anything computed downstream with respect to a probe
        (:attr:`probed`) is its gradient with respect to the value there. ``rows_at``: addresses
        read only at some absolute positions (the logit lens during generation): each forward
        keeps just those rows, in :attr:`rows` (they join :attr:`values` only if also in
        ``points``), and they do not count as wanted (no extra forward for them). ``live``: the
        values read keep their autograd graph (the frozen-linear forward of ``_linear``
        differentiates them)."""
        self.arch = arch
        self.live = live
        self.stop_early = stop_early
        self.steered = bool(writes)
        """Whether this request writes anywhere (its values may then be what the writes made)."""
        self.chunk = Chunk(batch=len(rows_lengths), length=max(rows_lengths), offset=0)
        self.values: dict[Address, list[torch.Tensor]] = defaultdict(list)
        self._stash: dict[int, torch.Tensor] = {}
        self._kept: dict[Address, torch.Tensor] = {}
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
                if edit.sae.is_transcoder:
                    edit.source = self._source(edit.sae.address.resolve(len(arch.layers)))
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

    def _source(self, address: Address) -> Callable[[], torch.Tensor]:
        """Keep ``address``'s rows each chunk (a transcoder's input), and how to get them."""
        self.arch.check_servable(address)
        if address.kind == "resid_mid":
            site_plan = self._plan_mid(address.layer)
            if address not in site_plan.mid_sources:
                site_plan.mid_sources.append(address)
        else:
            site_plan = self._sites[self.arch.site(address)]
            if address not in site_plan.sources:
                site_plan.sources.append(address)

        def rows() -> torch.Tensor:
            if address not in self._kept:
                raise UnsupportedAddress(
                    f"the forward reached the transcoder's output before {address}", address=address
                )
            return self._kept[address]

        return rows

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
        if address in self.wanted and self.live:
            self.values[address].append(rows)
        elif address in self.wanted:  # contiguous, as a concatenation of the chunks would be
            self.values[address].append(rows.detach().clone(memory_format=torch.contiguous_format))
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
        if site.scale != 1.0:  # the value as added to the residual
            rows = rows * site.scale
        edited = rows
        for edit in plan.edits:
            edited = edit.apply(edited, chunk)
        for address in plan.probes:
            edited = self._probe(address, edited)
        for layer in plan.stash_resid_pre_for:
            self._stash[layer] = edited
        if plan.mid_layer is not None and (plan.mid_edits or plan.mid_reads or plan.mid_probes or plan.mid_sources):
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
            for address in plan.mid_sources:
                self._kept[address] = steered
        for address in plan.sources:
            self._kept[address] = edited
        for address in plan.reads:
            self._record(address, edited)
        if edited is rows:
            return value
        return self._put(site, value, edited / site.scale if site.scale != 1.0 else edited)

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
            changes = site_plan.changes

            def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    value = self._handle(site, site_plan, args[0])
                    result: Any = ((value, *args[1:]), kwargs) if changes else None
                else:
                    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                    value = self._handle(site, site_plan, kwargs[key])
                    result = (args, {**kwargs, key: value}) if changes else None
                self._finish_site()
                return result

            return site.module.register_forward_pre_hook(pre, with_kwargs=True)

        changes = site_plan.changes

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
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
            if len(chunks) == 1:  # one forward: its copy is the value (no second copy)
                out[address] = chunks[0]
            elif address.info.width == "heads x keys":  # [batch, heads, queries, keys]: later chunks see more keys
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
