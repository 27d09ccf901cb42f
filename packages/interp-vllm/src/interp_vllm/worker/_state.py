"""The state every part of a model runner's taps shares: the model, where its parts live, this
worker's ranks, and the state of the requests in flight.

The structure comes from the site table's family (:func:`~..model._resolve.resolve`); this worker's
place in vLLM's tensor- and pipeline-parallel groups decides which heads, columns and layers its
hooks see. Requests' states live in ``requests`` until the front end fetches or releases them;
``failed`` holds the error of a request whose taps raised here (reported at its fetch, while the
engine and the rest of the batch go on).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch
from torch import nn

from interp_engine import Address, BackendError, IncompatibleDependency, Sae

from .._transport import HostCopier, SlabWriter
from ..hooks import attr_path, owned_layers, pp_position, tp_position
from ..model._families import VllmFamily
from ..model._resolve import resolve
from ..model._sites import SITES, HookKey, VllmSite, hook_key
from ._request_taps import RequestTaps, Slice
from ._runner import RunnerSeam, Step
from ._seam import seam_of, seams

logger = logging.getLogger("interp_vllm.worker._manager")


class TapState:
    """The model runner's model and family, this worker's ranks, the requests' states, and what
    every part records into (``failed``, ``timing``, the slab writer). One per :class:`TapManager
    <._manager.TapManager>`, handed to each of its parts."""

    def __init__(self, runner: Any) -> None:
        seam = seam_of(runner)
        if seam is None:
            raise IncompatibleDependency(
                f"interp-vllm does not wrap vLLM's model runner {type(runner).__qualname__} "
                f"(it wraps {', '.join(s.name for s in seams())})"
            )
        seam.check(runner)
        self.seam: RunnerSeam = seam
        self.runner = runner
        self.model: nn.Module = runner.get_model()
        self.family: VllmFamily = resolve(self.model, runner.model_config.hf_config)
        self.layers = attr_path(self.model, self.family.layers)
        self.rank, self.tp_size = tp_position()
        # under pipeline parallelism this stage holds some layers (and the last stage the final
        # norm and the unembedding): hooks go only where the layer lives, reads come from there
        self.pp_rank, self.pp_size = pp_position()
        self.owned = owned_layers(self.layers)
        self.last_stage = self.pp_rank == self.pp_size - 1
        if not self.owned:
            raise BackendError(f"pipeline stage {self.pp_rank} of {self.pp_size} holds none of the model's layers")
        config = runner.model_config.hf_config
        self.n_heads = int(config.num_attention_heads)
        # the config's count where it names one (key/value heads replicated over more ranks than
        # there are heads), else the kernels' (Falcon's multi-query attention: num_kv_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.family.n_kv_heads)
        self.d_head = int(attr_path(self.layers[self.owned[0]], self.family.attn_kernel).head_size)
        self.requests: dict[str, RequestTaps] = {}
        # the secrets of the front ends that pinged this worker: only their payloads are served
        self.issuers: set[str] = set()
        self.step_tokens = 0  # rows of the flattened batch in the current step
        # ids already fetched or released: a step scheduled before an abort landed must not
        # bring their state back
        self.retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        # where the worker's time goes (nanoseconds), reported by stats(): the whole of each
        # forward call with taps, the forward alone (in it: the hooks, hook_ns; their copies of
        # captured rows into the requests' buffers, copy_ns; SAE readouts and feature clamps,
        # sae_ns; the lens, lens_ns), and answering fetches; the requests vLLM preempted; and the
        # steps whose forward ran uncompiled for hooks inside the model (uncompiled_steps)
        self.timing = {
            "steps": 0,
            "step_ns": 0,
            "forward_ns": 0,
            "sae_ns": 0,
            "lens_ns": 0,
            "fetch_ns": 0,
            "fetches": 0,
            "hook_ns": 0,
            "copy_ns": 0,
            "preempted": 0,
            "uncompiled_steps": 0,
        }
        # requests whose taps raised in this worker: the error, reported at their fetch (the
        # hook gave the forward its values back unchanged, so the engine and the rest of the
        # batch go on)
        self.failed: dict[str, str] = {}
        # SAEs and probes the front end attached, on the model's device (interp_attach)
        self.saes: dict[str, Sae] = {}
        # captured rows go into the front end's slab (pinned staging and a side stream on a GPU)
        param = next(self.model.parameters(), None)
        self.copier = HostCopier(param.device if param is not None else torch.device("cpu"))
        self.writer = SlabWriter(self.copier)
        self.step_positions = torch.zeros(0, dtype=torch.long)  # every row's absolute position, this step
        self._hook_keys: dict[Address, HookKey | None] = {}  # the hook of each address here (None: not here)

    def total_heads(self, site: VllmSite) -> int:
        return self.n_kv_heads if site.shard == "kv_heads" else self.n_heads

    def owns(self, address: Address) -> bool:
        """Whether ``address`` is computed on this pipeline stage (the model's output kinds on
        the last stage, the others where their layer lives; ``embed`` with layer 0)."""
        if SITES[address.kind].where == "model_out":
            return self.last_stage
        return (address.layer or 0) in self.owned

    def module(self, key: HookKey) -> nn.Module:
        """The module a hook attaches to."""
        _, attr, layer = key
        block: nn.Module = self.layers[layer]
        if attr is None:
            return block
        module: nn.Module = attr_path(block, getattr(self.family, attr))
        return module

    def gate_act(self, layer: int) -> nn.Module:
        """The gate activation module of ``layer``'s MLP (:attr:`VllmFamily.mlp_act`)."""
        return self.module(("output", "mlp_act", layer))

    def hook_key(self, address: Address) -> HookKey | None:
        """The hook serving ``address`` on this worker (``None``: another pipeline stage's)."""
        try:
            return self._hook_keys[address]
        except KeyError:
            key = hook_key(address, self.family) if self.owns(address) else None
            self._hook_keys[address] = key
            return key

    def forward(self) -> Step:
        """Where the forward runs inside a step: its output is what the step is sent."""
        began = time.perf_counter_ns()
        try:
            return (yield)
        finally:
            self.timing["forward_ns"] += time.perf_counter_ns() - began

    def fail(self, slices: list[Slice], exc: Exception) -> None:
        for sl in slices:
            self.failed.setdefault(sl.taps.rid, f"a tap failed in vLLM's worker: {type(exc).__name__}: {exc}")
        logger.warning("interp-engine: a tap failed for %d request(s): %s", len(slices), exc, exc_info=True)
