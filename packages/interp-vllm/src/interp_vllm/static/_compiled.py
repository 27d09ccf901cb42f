"""The part of vllm-static's worker that lives in the compiled graph: taps and writes installed
before vLLM compiles the model.

Installed right after the model runner loads the model (before ``warming_up_model()`` traces
and compiles it, and before CUDA graphs are captured), so the taps are part of the compiled
graph. They are placed by the same site table as the dynamic backend's (:mod:`..model._sites`), one
hook per site, and every hook is pure tensor work on buffers registered on the hooked modules
(the hooks are built in :mod:`._hooks`):

- a capture point copies its rows into a :class:`StaticTap` buffer every step;
- a write point runs a :class:`StaticWrites` table whose per-token index (per token and head,
  at a head address) the host fills before each step (slot 0 for tokens of unsteered requests:
  bit-identical);
- ``attn_scores`` and ``attn_pattern`` tap the post-rotary queries and keys; ``final_norm``,
  ``logits_raw`` and ``logits`` are read from the forward's output, as in the dynamic backend;
- ``mlp_pre`` / ``mlp_pre_linear`` are the gate / up half of the fused ``gate_up_proj`` output: a
  write there rebuilds the output from the written half and the other one;
- an SAE compiled in (``saes`` in the config: a folder per name, written by the front end) is a
  :class:`~._saes.StaticSae` at its address: it encodes every row of every step and keeps the
  top features, the error norm and (small dictionaries) every feature in buffers, and applies
  the step's per-token feature clamps. At one address the order is: the write table, the SAEs
  (each reads what the previous one left, then clamps), the capture tap;
- a transcoder compiled in is a :class:`~._saes.StaticTranscoder` at its input address
  (readouts as above; for the clamped tokens it computes the change ``(v - f_i) d_i``) and a
  :class:`~._saes.StaticTranscoderOut` among the SAEs at its output address, which adds
  that change there (the MLP's error term kept).

Invariant: :func:`.._compat.keep_inductor_mutation_order` runs in the worker before vLLM compiles
the model (here, when the :class:`CompiledTaps` are built). The hooks read tensors that opaque ops
wrote in place (on CPU every vLLM linear is ``onednn_mm(out, ...)`` into a preallocated buffer;
the ``resid_mid`` stash is our own buffer); without it torch 2.13's Inductor may schedule such a
read before the write, silently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch import nn

from interp_engine import Address, Sae, load_sae

from .. import _compat
from .._wire import StaticDeclaration
from ..hooks import arg_slot, attr_path, forward_pre_hook
from ..model._sites import ROUTER_KIND, SITES, HookKey, VllmSite, added_scale, columns, hook_key, owned_heads
from ..sae._math import SaeLayout
from ..worker._state import TapState
from ._hooks import Names, Stage, input_hook, layer_in_hook, layer_out_hook, output_hook
from ._saes import StaticSae, StaticTranscoder, StaticTranscoderOut
from ._taps import StaticTap, StaticWrites


class CompiledTaps:
    """The taps, write tables and SAEs of a vllm-static engine, registered on the model's modules
    (as submodules, so their buffers are part of the traced graph) with the hooks that use them,
    all installed when this is built. The host reads and fills them per step
    (:class:`~._worker.StaticTapManager`)."""

    def __init__(self, state: TapState, config: StaticDeclaration) -> None:
        self.state = state
        runner = state.runner
        self.points, self.write_addresses = config.addresses()
        # expert indices and weights are routed on the host from the router's logits: tap those
        routed = [Address(ROUTER_KIND, a.layer) for a in self.points if SITES[a.kind].routed is not None]
        self.points += [a for a in dict.fromkeys(routed) if a not in self.points]
        self.slots = config.slots
        self.max_tokens = int(runner.max_num_tokens)
        param = next(self.state.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.d_model = int(runner.model_config.hf_config.hidden_size)
        self.taps: dict[Address, StaticTap] = {}
        self.tables: dict[Address, StaticWrites] = {}
        self.qk: dict[int, tuple[StaticTap, StaticTap]] = {}
        # SAEs compiled in: loaded from the folders the front end wrote, one StaticSae each
        self.sae_top_k = config.sae_top_k
        self.sae_dense_max = config.sae_dense_max
        self.sae_modules: dict[str, StaticSae] = {}
        self.sae_names: dict[Address, list[str]] = defaultdict(list)
        n_layers = len(self.state.layers)
        # transcoders also get a step at their output address, where their clamps are added
        self.sae_outs: dict[Address, list[str]] = defaultdict(list)
        for name, entry in config.saes.items():
            sae = load_sae(entry.path).to(device=self.device)
            self.state.saes[name] = sae
            self.sae_names[sae.address.resolve(n_layers)].append(name)
            if self._transcoder_clamps(sae):
                self.sae_outs[sae.address_out.resolve(n_layers)].append(name)
        _compat.keep_inductor_mutation_order()  # before warm-up compiles the graph with the hooks in it
        self._install()

    # -- installation (before compilation) ------------------------------------------------
    def _install(self) -> None:
        hooks: dict[HookKey, list[Address]] = defaultdict(list)
        for address in dict.fromkeys([*self.points, *self.write_addresses, *self.sae_names, *self.sae_outs]):
            if SITES[address.kind].where == "model_out" or SITES[address.kind].routed is not None:
                continue
            if not self.state.owns(address):  # a layer of another pipeline stage
                continue
            hooks[hook_key(address, self.state.family)].append(address)
            if address.kind == "resid_mid":  # its resid_pre is stashed at the layer's input
                hooks[("layer_in", None, address.layer or 0)]
        order = {kind: i for i, kind in enumerate(SITES)}
        for key in sorted(hooks, key=lambda k: (k[2], min((order[a.kind] for a in hooks[k]), default=0))):
            addresses = sorted(hooks[key], key=lambda a: order[a.kind])
            where, attr, layer = key
            module = self.state.module(key)
            if where == "layer_in":
                module.register_forward_pre_hook(self._layer_in_hook(module, layer, addresses), with_kwargs=True)
            elif where == "layer_out":
                module.register_forward_hook(self._layer_out_hook(module, addresses))
            elif where == "input" and attr == "attn_kernel":  # called as kernel.forward(...) by some models
                forward_pre_hook(module, self._input_hook(module, layer, addresses))
            elif where == "input":
                hook = self._input_hook(module, layer, addresses, self.state.family.batched)
                module.register_forward_pre_hook(hook, with_kwargs=True)
            else:
                module.register_forward_hook(self._output_hook(module, layer, addresses, self.state.family.batched))

    def _new_tap(self, module: nn.Module, name: str, width: int) -> StaticTap:
        tap = StaticTap(self.max_tokens, width, dtype=self.dtype, device=self.device)
        setattr(module, name, tap)  # a submodule: its buffer is part of the traced model
        return tap

    def _local_heads(self, site: VllmSite) -> int:
        return (
            len(owned_heads(self.state.rank, self.state.tp_size, self.state.total_heads(site)))
            if self.state.tp_size > 1
            else (self.state.total_heads(site))
        )

    def _width(self, module: nn.Module, site: VllmSite) -> int:
        """Values per token at a site on this rank."""
        if site.per_head:
            return self._local_heads(site) * self.state.d_head
        if site.kind == ROUTER_KIND:
            return self.state.family.n_experts
        if site.shard == "last" and site.where == "input":  # mlp_post: the down projection's (sharded) input
            return int(getattr(module, "input_size_per_partition", 0) or getattr(module, "weight").shape[1])  # noqa: B009
        if site.shard == "last":  # mlp_pre(_linear): (a half of) the up projection's (sharded) output
            width = int(getattr(module, "output_size_per_partition", 0) or getattr(module, "weight").shape[0])  # noqa: B009
            cols = columns(site, self.state.family)
            return width // cols[1] if cols is not None else width
        return self.d_model

    def _names(self, module: nn.Module, address: Address) -> Stage:
        """Register the table, SAEs and tap of ``address`` on ``module``; their attribute names."""
        site = SITES[address.kind]
        width = self._width(module, site)
        write = tap = None
        saes: list[str] = []
        clamps: list[str] = []
        for name in self.sae_names.get(address, ()):
            attr = f"interp_sae_{len(self.sae_modules)}"  # SAE names may hold '.', not valid here
            module_ = self._sae_module(name, site)
            setattr(module, attr, module_)
            saes.append(attr)
            if module_.clamps and not isinstance(module_, StaticTranscoder):  # a transcoder writes elsewhere
                clamps.append(attr)
        for name in self.sae_outs.get(address, ()):  # a transcoder's clamps, added at its output
            transcoder = self._sae_module(name, SITES[self.state.saes[name].address.kind])
            if not isinstance(transcoder, StaticTranscoder):  # pragma: no cover - sae_outs holds transcoders
                raise TypeError(f"{name!r} is not a compiled-in transcoder")
            attr = f"interp_tco_{len(saes)}_{address.kind}"
            setattr(module, attr, StaticTranscoderOut(transcoder))
            saes.append(attr)
            clamps.append(attr)
        if address in self.write_addresses:
            write = f"interp_w_{address.kind}"
            if site.per_head:  # one row per (token, head), d_head wide
                rows = self.max_tokens * self._local_heads(site)
                table = StaticWrites(self.slots, self.state.d_head, rows, dtype=self.dtype, device=self.device)
            else:
                table = StaticWrites(
                    self.slots,
                    width,
                    self.max_tokens,
                    dtype=self.dtype,
                    device=self.device,
                    bans=address.kind == ROUTER_KIND,  # an expert ablated by a -inf logit
                )
            setattr(module, write, table)
            self.tables[address] = table
        if address in self.points:
            tap = f"interp_t_{address.kind}"
            self.taps[address] = self._new_tap(module, tap, width)
        return write, tuple(saes), tuple(clamps), tap

    def _transcoder_clamps(self, sae: Sae) -> bool:
        """Whether compiled-in transcoder ``sae`` clamps in-graph: its output address takes writes
        in the graph, whole rows, on this pipeline stage with its input."""
        if not (sae.is_transcoder and sae.has_decoder):
            return False
        n_layers = len(self.state.layers)
        source, out = sae.address.resolve(n_layers), sae.address_out.resolve(n_layers)
        site = SITES[out.kind]
        return site.static_write and site.shard is None and self.state.owns(source) and self.state.owns(out)

    def _sae_module(self, name: str, site: VllmSite) -> StaticSae:
        """The compiled-in module of SAE ``name`` at ``site`` (its input address), built once: a
        :class:`~._saes.StaticTranscoder` for a transcoder (its clamps added at its output
        address), else a :class:`~._saes.StaticSae` (clamping in place where the site takes
        in-graph writes of whole rows)."""
        held = self.sae_modules.get(name)
        if held is not None:
            return held
        sae = self.state.saes[name]
        layout = SaeLayout.of(sae, self.sae_top_k, self.sae_dense_max)
        module: StaticSae
        if sae.is_transcoder and sae.has_decoder:
            clamping = self._transcoder_clamps(sae)
            module = StaticTranscoder(sae, layout, self.max_tokens, clamps=clamping, device=self.device, onednn=True)
        else:
            clamping = sae.has_decoder and site.static_write and site.shard is None
            module = StaticSae(sae, layout, self.max_tokens, clamps=clamping, device=self.device, onednn=True)
        self.sae_modules[name] = module
        return module

    # -- the hooks: tensor work only, traced into the compiled graph ------------------------
    def _layer_in_hook(self, block: nn.Module, layer: int, addresses: list[Address]) -> Callable[..., Any]:
        names = [self._names(block, a) for a in addresses]
        attn_path = self.state.family.attn_contrib  # resid_mid is formed at this module's output
        mid = Address("resid_mid", layer)
        stash = mid in self.points or mid in self.write_addresses
        if stash:
            self._new_tap(attr_path(block, attn_path), "interp_stash", self.d_model)
        return layer_in_hook(
            names,
            hidden_at=self.state.family.hidden_arg,
            residual_at=self.state.family.residual_arg,
            stash_at=attn_path if stash else None,
            batched=self.state.family.batched,
        )

    def _layer_out_hook(self, block: nn.Module, addresses: list[Address]) -> Callable[..., Any]:
        names = [self._names(block, a) for a in addresses]
        return layer_out_hook(names, deferred=self.state.family.deferred_residual, batched=self.state.family.batched)

    def _input_hook(
        self, module: nn.Module, layer: int, addresses: list[Address], batched: bool = False
    ) -> Callable[..., Any]:
        steps: list[tuple[tuple[int, str], Names]] = []  # ((position, name) of the argument, names) in order
        qk = False
        for address in addresses:
            site = SITES[address.kind]
            if site.derived:  # attn_scores / attn_pattern: computed on the host from q and k
                if layer not in self.qk:
                    q = self._new_tap(module, "interp_q", int(getattr(module, "num_heads")) * self.state.d_head)  # noqa: B009
                    k = self._new_tap(module, "interp_k", int(getattr(module, "num_kv_heads")) * self.state.d_head)  # noqa: B009
                    self.qk[layer] = (q, k)
                qk = True
            else:
                steps.append((arg_slot(module, site), [self._names(module, address)]))
        return input_hook(steps, qk=qk, batched=batched)

    def _output_hook(
        self, module: nn.Module, layer: int, addresses: list[Address], batched: bool = False
    ) -> Callable[..., Any]:
        # (column block, scale) -> names: the gate / up halves; a sublayer's output as added to the residual
        parts: dict[tuple[tuple[int, int] | None, float], Names] = {}
        activated: Names = []  # mlp_gate_act: read only, act(gate) after any write at mlp_pre
        for a in addresses:
            site = SITES[a.kind]
            if site.activated:
                activated.append(self._names(module, a))
            elif not site.derived:
                key = (columns(site, self.state.family), added_scale(site, self.state.family))
                parts.setdefault(key, []).append(self._names(module, a))
        act = self.state.gate_act(layer) if activated else None
        mid_names = [self._names(module, a) for a in addresses if SITES[a.kind].derived]  # resid_mid
        # scale: what the layer multiplies attention's contribution by
        return output_hook(parts, activated, act, mid_names, scale=self.state.family.attn_scale, batched=batched)
