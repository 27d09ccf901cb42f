"""The vllm backend's model: vLLM's V1 ``AsyncLLM`` serving requests that carry taps.

The front end (this module, in the caller's process) validates each request, sends its points
and steering spec to the workers as plain data in ``SamplingParams.extra_args``, lets vLLM
schedule and batch it with everything else in flight, and afterwards fetches what the workers
captured for it with ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import gc
import itertools
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import Any, ClassVar

import torch

from interp_engine import (
    Address,
    BackendError,
    CheckedRequest,
    Completion,
    FeatureReadout,
    Features,
    FeatureWrite,
    ForeignEventLoop,
    InvalidFeatures,
    InvalidOption,
    InvalidSteering,
    InvalidTokens,
    KindNotInFamily,
    ModelBase,
    ModelClosed,
    ModelInfo,
    ModelLoadError,
    Results,
    Sae,
    SamplingOptions,
    SteeringSpec,
    StreamStep,
    UnsupportedArchitecture,
    UnsupportedOperation,
    Write,
)
from interp_engine.backend import (
    CheckedLens,
    LensRequest,
    LensResult,
    LensTopK,
    TextPieces,
    TokenizerMixin,
    WeightInfo,
    check_weight_request,
)

from ._resolve import resolve_without_weights
from ._sites import SITES, merge_ranks
from ._weights import merge_info, merge_weight
from ._wire import Fetched, LensChunk, RequestPayload, pack, unpack

FRONT_END_OPTIONS = ("tokenizer_path",)

CPU_ENV_DEFAULTS = {
    # measured on a 2-core machine: 1 GiB of KV cache starts reliably; without thread binding
    # the worker is ~1.4x faster in steady state than vLLM's default pinning
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
ENV_DEFAULTS = {
    # the taps live in the V1 model runner; pin it where vLLM would pick the V2 runner
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
ENGINE_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
}
CPU_ENGINE_DEFAULTS: dict[str, Any] = {"gpu_memory_utilization": 0.3}


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; say so before starting."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise UnsupportedArchitecture(
            f"vLLM's CPU attention kernels support head sizes {sizes}; this model's is {head}. "
            "Use the eager backend for it on this machine."
        )


def _engine_fields() -> dict[str, Any]:
    """``AsyncEngineArgs`` field names and their defaults."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f.default for f in dataclasses.fields(AsyncEngineArgs)}


def _generation_config(name_or_path: str, trust: bool) -> Any:
    """The checkpoint's generation config (its end-of-sequence ids), or ``None`` if it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(name_or_path, trust_remote_code=trust)
    except (OSError, ValueError):
        return None


_HOW = {"attn_scores": "recompute", "attn_pattern": "recompute", "logits_raw": "recompute"}


class VllmModel(TokenizerMixin, ModelBase):
    """A model served by vLLM with interp-engine taps in its model runner.

    The engine is built on the first ``warmup()`` or request, on the running event loop, and
    belongs to that loop: awaiting the model from another loop raises ``ForeignEventLoop``.
    """

    backend = "vllm"
    engine_defaults: ClassVar[dict[str, Any]] = ENGINE_DEFAULTS

    def __init__(self, name_or_path: str, options: dict[str, Any]) -> None:
        from transformers import AutoConfig, AutoTokenizer

        options = dict(options)
        fields = _engine_fields()
        known = set(fields) | set(FRONT_END_OPTIONS)
        unknown = sorted(set(options) - known - {"model"})
        if unknown:
            raise InvalidOption(
                f"the vllm backend does not take {', '.join(unknown)}: options are vLLM engine "
                f"arguments (AsyncEngineArgs fields such as max_model_len, tensor_parallel_size, "
                f"dtype, enforce_eager)"
            )
        self.path = name_or_path
        trust = bool(options.get("trust_remote_code", False))
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust)
            tokenizer_path = options.pop("tokenizer_path", None) or options.get("tokenizer") or name_or_path
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read a model config and tokenizer from {name_or_path!r}: {exc}") from exc
        self.config = config
        self._cpu = _is_cpu_platform()
        if self._cpu:
            _check_cpu_head_size(config)
        defaults = dict(self.engine_defaults)
        if self._cpu:
            defaults.update(CPU_ENGINE_DEFAULTS)
        self.engine_kwargs: dict[str, Any] = {**defaults, **options}
        n_heads = int(config.num_attention_heads)
        d_model = int(config.hidden_size)
        d_mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d_model
        model_max = getattr(config, "max_position_embeddings", None)
        max_len = self.engine_kwargs.get("max_model_len") or model_max
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1 or (model_max and max_len > model_max)):
            raise InvalidOption(
                f"max_model_len must be a positive int no larger than the model's {model_max} positions, "
                f"got {max_len!r}"
            )
        # where vLLM's model keeps each address: its module tree, built on the meta device
        self.family = resolve_without_weights(name_or_path, {**self.engine_defaults, **options})
        info = ModelInfo(
            architecture=str(config.model_type),
            n_layers=int(config.num_hidden_layers),
            d_model=d_model,
            d_mlp=int(d_mlp),
            n_heads=n_heads,
            n_kv_heads=int(getattr(config, "num_key_value_heads", None) or self.family.n_kv_heads or n_heads),
            vocab_size=int(config.vocab_size),
            n_ctx=int(max_len or 2**31 - 1),
            parallel_attn=self.family.parallel,
            d_head=int(getattr(config, "head_dim", None) or d_model // n_heads),
            n_experts=self.family.n_experts,
            experts_per_token=self.family.experts_per_token,
        )
        super().__init__(info, eos_ids=ModelBase.eos_ids_of(_generation_config(name_or_path, trust), config))
        max_logprobs = self.engine_kwargs.get("max_logprobs", fields.get("max_logprobs"))  # -1: the vocabulary
        self._logprobs_limit: int = info.vocab_size
        if isinstance(max_logprobs, int) and not isinstance(max_logprobs, bool) and max_logprobs >= 0:
            self._logprobs_limit = min(max_logprobs, info.vocab_size)
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._building: asyncio.Future[Any] | None = None
        self.tp_size = 1
        self.pp_size = 1
        # per pipeline stage (in order): the layers it holds and its workers' indices in
        # collective_rpc's answers, by tensor-parallel rank (one stage without pipeline parallelism)
        self._stages: list[tuple[frozenset[int], list[int]]] = []
        # fetches wait here and go to the workers together: one engine-core round trip for
        # every request that finished while the previous batch was on its way
        self._fetch_queue: list[tuple[str, asyncio.Future[list[dict[str, Any]]]]] = []
        self._fetch_task: asyncio.Task[None] | None = None
        # streaming readouts are drained the same way, one round trip for every waiting stream
        self._drain_queue: list[tuple[str, asyncio.Future[list[dict[str, Any]]]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        # the SAEs the workers hold, by key: each attachment is sent once, under a key of its own
        # ("name#n"), before the first request that names it; a request carries its names' keys
        self._worker_saes: dict[str, tuple[str, Sae]] = {}
        self._sae_serial = itertools.count()
        # how many requests in flight use each key: a key whose SAE is no longer attached is
        # dropped from the workers once none does
        self._key_users: collections.Counter[str] = collections.Counter()
        self._sae_lock: asyncio.Lock | None = None
        self._weight_info: WeightInfo | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._engine is not None else "not started"
        return f"<VllmModel {self.info.architecture} {self.path!r} ({state})>"

    # -- the engine ------------------------------------------------------------------------
    async def _ready(self) -> Any:
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._loop is not None and loop is not self._loop:
            raise ForeignEventLoop(
                "this vLLM model belongs to the event loop that built its engine; awaiting it "
                "from another loop would hang. Build it on the loop that serves requests (e.g. a "
                "FastAPI lifespan) or use sync_model(model) everywhere."
            )
        if self._engine is not None:
            return self._engine
        if self._building is None:
            self._loop = loop
            self._building = loop.create_task(self._build())
        try:
            return await asyncio.shield(self._building)
        except BaseException:
            if self._building.done() and self._engine is None:
                self._building, self._loop = None, None
            raise

    async def _build(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        for name, value in {**ENV_DEFAULTS, **(CPU_ENV_DEFAULTS if self._cpu else {})}.items():
            os.environ.setdefault(name, value)
        # vLLM must be able to sample one token after the prompt, so a prompt of exactly n_ctx
        # tokens needs max_model_len = n_ctx + 1. No position >= n_ctx is ever computed: the
        # front end checks every request against n_ctx.
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        kwargs = {**self._engine_args(), "max_model_len": self.info.n_ctx + 1}
        try:
            args = AsyncEngineArgs(model=self.path, **kwargs)
            engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        except (TypeError, ValueError) as exc:
            raise InvalidOption(f"vLLM rejected the engine arguments: {exc}") from exc
        except Exception as exc:
            raise BackendError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        try:
            pings = await engine.collective_rpc("interp_ping")
        except Exception as exc:
            engine.shutdown()
            raise BackendError(
                f"the interp-vllm plugin is not loaded in vLLM's workers ({exc}); is interp-vllm "
                "installed in the environment the workers run in, and not excluded by VLLM_PLUGINS?"
            ) from exc
        problem = self._check_workers(pings)
        if problem is not None:
            engine.shutdown()
            raise BackendError(problem)
        self.tp_size = int(pings[0].get("tp_size", 1))
        self.pp_size = int(pings[0].get("pp_size", 1))
        self._stages = _stages(pings)
        self._engine = engine
        if self._closed:  # shut down while starting
            engine.shutdown()
            raise ModelClosed("this model was shut down while its engine was starting")
        return engine

    def _engine_args(self) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` fields this model's engine is built with."""
        return dict(self.engine_kwargs)

    def _check_workers(self, pings: list[dict[str, Any]]) -> str | None:
        """Why the started workers cannot serve this model (``None``: they can)."""
        if not all(p.get("patched") for p in pings):
            runners = sorted({str(p.get("runner")) for p in pings})
            seen = sorted({str(p.get("v2_runner_env")) for p in pings if not p.get("patched")})
            return (
                f"vLLM is serving with a model runner the taps do not support ({', '.join(runners)}); "
                "interp-vllm needs the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0; those workers saw "
                f"VLLM_USE_V2_MODEL_RUNNER={'/'.join(seen)}: on a Ray cluster a node's own value wins)"
            )
        expected = sorted(self.family.lacks())
        for ping in pings:
            if ping.get("unsupported"):
                return f"vLLM's workers cannot place this model's addresses: {ping['unsupported']}"
            if "lacks" in ping and list(ping["lacks"]) != expected:
                return (
                    f"vLLM's workers resolved this model's structure differently from the front end "
                    f"(lacking {ping['lacks']}, not {expected})"
                )
        return None

    async def warmup(self) -> None:
        """Build the engine now, on this loop (20-60 s on a CPU), and run one tiny request."""
        await self.generate([0], max_tokens=1)

    # -- what this model serves ---------------------------------------------------------------
    def _served_kinds(self) -> dict[str, str]:
        """The site table's kinds this family has; the attention scores and probabilities and
        the bare unembedding are recomputed exactly from what vLLM computed (the post-rotary
        queries and keys its kernel received; the final norm's output and the unembedding)."""
        lacks = self.family.lacks()
        return {kind: _HOW.get(kind, "hook") for kind in SITES if kind not in lacks and kind in self.supported_points}

    def _missing_reason(self, kind: str) -> str:
        return self.family.missing_reason(kind) or super()._missing_reason(kind)

    def _kind_layers(self, kind: str) -> tuple[int, ...] | None:
        layers = [layer for layer in range(self.info.n_layers) if self.family.layer_lacks(kind, layer) is None]
        return None if len(layers) == self.info.n_layers else tuple(layers)

    def _check_served(self, addresses: Iterable[Address]) -> None:
        addresses = list(addresses)
        super()._check_served(addresses)
        for address in addresses:  # layers that differ: dense and mixture-of-experts layers mixed
            why = None if address.layer is None else self.family.layer_lacks(address.kind, address.layer)
            if why is not None:
                raise KindNotInFamily(f"{address}: {why}", address=address, valid=tuple(self._served_kinds()))

    # -- requests ----------------------------------------------------------------------------
    def _max_logprobs(self) -> int:
        return self._logprobs_limit  # the engine's max_logprobs: vLLM refuses more

    def _sampling(self, max_tokens: int, sampling: SamplingOptions, **extra: Any) -> Any:
        """vLLM's ``SamplingParams`` for options the core has checked."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError

        values = {"temperature": 0.0, **sampling.given()}
        try:
            return SamplingParams(max_tokens=max_tokens, **values, **extra)
        except (TypeError, ValueError, VLLMClientError) as exc:
            raise InvalidOption(f"invalid sampling parameters: {exc}") from exc

    async def _sync_saes(self, engine: Any, request: CheckedRequest) -> None:
        """Send the workers the SAEs ``request`` names that they do not hold yet: each attachment
        once, under a key of its own, so a name re-attached to another SAE never changes what a
        request already sent (and perhaps still queued in vLLM) reads."""
        self._check_tp_saes(request)
        await self._drop_stale_saes(engine)
        if all(self._sae_key(name, sae) is not None for name, sae in request.saes.items()):
            return
        async with self._lock_saes():
            for name, sae in request.saes.items():
                if self._sae_key(name, sae) is not None:
                    continue
                key = f"{name}#{next(self._sae_serial)}"
                try:
                    await engine.collective_rpc("interp_attach", args=(key, sae.to_bytes()))
                except Exception as exc:
                    raise BackendError(f"the workers could not load SAE {name!r}: {exc}") from exc
                self._worker_saes[key] = (name, sae)

    def _lock_saes(self) -> asyncio.Lock:
        if self._sae_lock is None:
            self._sae_lock = asyncio.Lock()
        return self._sae_lock

    def _sae_key(self, name: str, sae: Sae) -> str | None:
        """The key the workers hold this attachment under, if they hold it."""
        for key, (held_name, held) in self._worker_saes.items():
            if held_name == name and held is sae:
                return key
        return None

    def _use_saes(self, request: CheckedRequest) -> dict[str, str]:
        """The keys of the SAEs ``request`` names (sent by :meth:`_sync_saes` just before, with no
        await in between), counted as in use until :meth:`_unuse_saes`."""
        keys = {}
        for name, sae in request.saes.items():
            key = self._sae_key(name, sae)
            if key is not None:  # a backend that holds SAEs by name (vllm-static) has no keys
                keys[name] = key
                self._key_users[key] += 1
        return keys

    async def _unuse_saes(self, engine: Any, keys: dict[str, str]) -> None:
        for key in keys.values():
            self._key_users[key] -= 1
            if self._key_users[key] <= 0:
                del self._key_users[key]
        if keys:
            await self._drop_stale_saes(engine)

    async def _drop_stale_saes(self, engine: Any) -> None:
        """Free the workers' copies of SAEs that were detached (or re-attached under their name to
        another SAE) once no request in flight uses them."""

        def stale() -> list[str]:
            return [
                key
                for key, (name, sae) in self._worker_saes.items()
                if self._saes.get(name) is not sae and not self._key_users.get(key)
            ]

        if self._closed or not stale():
            return
        async with self._lock_saes():
            for key in stale():
                del self._worker_saes[key]  # first: a request from now on sends its SAE again
                with contextlib.suppress(Exception):  # the engine is going away
                    await engine.collective_rpc("interp_detach", args=(key,))

    def _check_request(self, request: CheckedRequest) -> None:
        self._check_tp_saes(request)
        self._check_lens_stages(request)

    def _check_lens_stages(self, request: CheckedRequest) -> None:
        """Under pipeline parallelism the lens is computed on the last stage, which holds the
        final norm and the unembedding: a lens layer another stage holds is refused (its rows
        would have to leave the engine densely to reach the last stage)."""
        if request.lens is None or len(self._stages) <= 1:
            return
        last = self._stages[-1][0]
        elsewhere = [layer for layer in request.lens.layers if layer not in last]
        if elsewhere:
            raise UnsupportedOperation(
                f"the logit lens at layer(s) {elsewhere} is not served under pipeline parallelism "
                f"(pipeline_parallel_size={self.pp_size}): the final norm and the unembedding live on the last "
                f"stage, which holds layers {sorted(last)}; read the lens there, or serve the model with "
                "tensor_parallel_size instead of pipeline_parallel_size (the lens runs under tensor parallelism)"
            )

    def _check_tp_saes(self, request: CheckedRequest) -> None:
        """SAEs at values tensor parallelism splits across ranks are not served (readouts and
        feature writes need whole rows)."""
        if self.tp_size <= 1:
            return
        for name, sae in request.saes.items():
            if SITES[sae.address.kind].shard is not None:
                raise InvalidFeatures(
                    f"SAE {name!r} reads {sae.address}, which tensor parallelism splits across ranks "
                    f"(tensor_parallel_size={self.tp_size}); SAEs are served at whole-row addresses "
                    "under TP (resid_*, attn_out, mlp_out, attn_in, mlp_in)"
                )

    def _payload(
        self,
        rid: str,
        points: Iterable[Address],
        writes: list[Write | FeatureWrite],
        n_prompt: int,
        n_total: int,
        readouts: Iterable[Features] = (),
        *,
        stream: bool = False,
    ) -> RequestPayload:
        from interp_engine.backend import ELEMENTWISE_OPS, WHOLE_ROW_OPS

        split = [
            w
            for w in writes
            if isinstance(w, Write) and w.op in WHOLE_ROW_OPS and SITES[w.address.kind].shard == "last"
        ]
        if self.tp_size > 1 and split:
            raise InvalidSteering(
                f"{split[0].op} at {split[0].address} is not available under tensor parallelism (its values "
                f"are split across ranks, and {split[0].op} needs a projection or a norm over all of them); "
                f"use {' or '.join(ELEMENTWISE_OPS)} there (ops that need the whole vector: {', '.join(WHOLE_ROW_OPS)})"
            )
        return RequestPayload(
            rid, tuple(points), tuple(writes), n_prompt, n_total, readouts=tuple(readouts), stream=stream
        )

    async def _outputs(
        self, engine: Any, ids: list[int], params: Any, rid: str, salt: str | None
    ) -> AsyncIterator[Any]:
        """The request's outputs; aborts it in vLLM if the caller stops early or is cancelled."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt  # no prefix-cache sharing: every prompt token is computed
        from vllm.exceptions import VLLMClientError

        finished = False
        try:
            async for output in engine.generate(prompt, params, rid):
                finished = output.finished
                yield output
        except VLLMClientError as exc:
            raise InvalidTokens(f"vLLM rejected the request: {exc}") from exc
        except Exception as exc:
            if self._closed:
                raise ModelClosed("the model was shut down while this call was in flight") from exc
            if _is_engine_dead(exc):  # its engine core process is gone: every later call says so at once
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            if not finished and not self._closed and self._dead is None:
                await engine.abort(rid)

    async def _fetch_blobs(self, engine: Any, rid: str) -> list[dict[str, Any]]:
        """One request's packed values from every rank, fetched together with whatever other
        requests are waiting (a cancelled caller's values are dropped in the worker all the same)."""
        future: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._fetch_queue.append((rid, future))
        if self._fetch_task is None or self._fetch_task.done():
            self._fetch_task = asyncio.ensure_future(self._batches(engine, "interp_fetch_many", self._fetch_queue))
        return await future

    async def _batches(
        self, engine: Any, method: str, queue: list[tuple[str, asyncio.Future[list[dict[str, Any]]]]]
    ) -> None:
        """Answer every waiter in ``queue`` (drained in place) with ``method`` over their ids:
        one engine-core round trip for all requests waiting while the previous one was out."""
        while queue:
            batch = list(queue)
            queue.clear()
            try:
                ranks = await engine.collective_rpc(method, args=([rid for rid, _ in batch],))
            except BaseException as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc if isinstance(exc, Exception) else ModelClosed(str(exc)))
                if not isinstance(exc, Exception):
                    raise
                continue
            for i, (_, future) in enumerate(batch):
                if not future.done():
                    future.set_result([rank[i] for rank in ranks])

    async def _done(self, engine: Any, rid: str) -> None:
        """The request finished or was aborted in vLLM and captured nothing: the workers forget
        it on their own when vLLM tells them (before any later request is admitted)."""

    def _owners(self, address: Address) -> list[int]:
        """The workers (indices in ``collective_rpc``'s answers, by tensor-parallel rank) of the
        pipeline stage that computes ``address``: the last stage for the model's output (the final
        norm and the unembedding live there), else the stage holding its layer."""
        if not self._stages:  # pragma: no cover - only before the engine is built
            raise BackendError("the engine is not running")
        if SITES[address.kind].where == "model_out":
            return self._stages[-1][1]
        layer = address.layer or 0
        for layers, workers in self._stages:
            if layer in layers:
                return workers
        held = [sorted(stage[0]) for stage in self._stages]
        raise BackendError(f"no pipeline stage holds layer {layer} (the stages hold {held})")

    async def _fetch(
        self, engine: Any, rid: str, points: Iterable[Address], n: int, readouts: Iterable[Features] = ()
    ) -> tuple[dict[Address, torch.Tensor], dict[Features, FeatureReadout], LensChunk | None]:
        """The request's values at ``points`` over its first ``n`` positions, its readouts, and
        its logit lens as the workers computed it (``None``: it read none)."""
        try:
            blobs = await self._fetch_blobs(engine, rid)
        except Exception as exc:
            if self._closed:
                raise ModelClosed("the model was shut down while this call was in flight") from exc
            if _is_engine_dead(exc):
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise BackendError(f"the workers could not return this request's values: {exc}") from exc
        every = [Fetched.decode(blob) for blob in blobs]
        for rank in every:
            rank.raise_error()
        values: dict[Address, torch.Tensor] = {}
        for address in points:
            ranks = [every[i] for i in self._owners(address)]  # the stage that computes it, by TP rank
            if any(address not in rank.values for rank in ranks):
                raise BackendError(
                    f"the taps for {address} did not fire for this request (is the interp-vllm "
                    "plugin active in every worker, with the V1 model runner?)"
                )
            positions = ranks[0].values[address][0]
            if positions.shape[0] < n or not torch.equal(positions[:n], torch.arange(n)):
                raise BackendError(
                    f"the taps for {address} saw {positions.shape[0]} of the {n} positions of this request"
                )
            site = SITES[address.kind]
            total = self.info.n_kv_heads if site.shard == "kv_heads" else self.info.n_heads
            value = merge_ranks(address, [rank.values[address][1] for rank in ranks], total)[:n]
            if address.info.width == "heads x keys":  # [q, heads, k] -> [heads, q, k]
                value = value[:, :, :n].permute(1, 0, 2).contiguous()
            values[address] = value
        found = {}
        computed = _readouts_of(every)
        for spec in readouts:
            if spec not in computed:
                raise BackendError(f"the readout {spec} did not fire for this request")
            positions, readout = computed[spec]
            if positions.shape[0] < n or not torch.equal(positions[:n], torch.arange(n)):
                raise BackendError(f"the readout {spec} saw {positions.shape[0]} of the {n} positions of this request")
            found[spec] = readout[:n]
        return values, found, _lens_of(every)

    async def _release(self, engine: Any, rid: str) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):  # the engine is going away; nothing left to free
                await engine.collective_rpc("interp_release", args=(rid,))

    async def capture(
        self, token_ids: Sequence[int], points: Iterable[Any], *, steering_spec: SteeringSpec | None = None
    ) -> Results:
        """Activations ``[n_tokens, width]`` (attention ``[heads, q, k]``, computed from the
        post-rotary queries and keys vLLM's kernels receive) over the prompt."""
        request = self._check_capture(token_ids, points, steering_spec)
        ids, writes, resolved = request.token_ids, request.writes, request.addresses
        engine = await self._ready()
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        try:
            rid = f"interp-{uuid.uuid4().hex}"
            payload = self._payload(rid, resolved, writes, len(ids), len(ids), request.readouts)
            params = self._sampling(1, SamplingOptions(), extra_args=_keyed(payload, keys).extra_args())
            fetched = False
            try:
                async for _ in self._outputs(engine, ids, params, rid, rid):
                    pass
                values, readouts, _ = await self._fetch(engine, rid, resolved, len(ids), request.readouts)
                fetched = True
            finally:
                if not fetched:
                    await self._release(engine, rid)
        finally:
            await self._unuse_saes(engine, keys)
        return request.keyed(values, readouts)

    async def capture_generation(
        self,
        token_ids: Sequence[int],
        points: Iterable[Any],
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
        lens: LensRequest | None = None,
        **sampling: Any,
    ) -> tuple[Completion, Results]:
        """A completion and activations ``[n_prompt + n_generated, width]`` (with ``lens``, a
        :class:`LensResult` under the request, computed in the workers).

        vLLM never runs the forward of the last token it samples, so the request asks for one
        token more than it returns and is aborted as soon as that token exists."""
        request = self._check_generation(
            token_ids, points, max_tokens=max_tokens, steering_spec=steering_spec, sampling=sampling, lens=lens
        )
        engine = await self._ready()
        self._check_lens_stages(request)
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        try:
            return await self._capture_generation(engine, request, keys)
        finally:
            await self._unuse_saes(engine, keys)

    async def _capture_generation(
        self, engine: Any, request: CheckedRequest, keys: dict[str, str]
    ) -> tuple[Completion, Results]:
        ids, writes, resolved, max_tokens = request.token_ids, request.writes, request.addresses, request.max_tokens
        rid = f"interp-{uuid.uuid4().hex}"
        n = len(ids)
        captures = bool(resolved or request.readouts or request.lens)
        limit = min(max_tokens + 1, self.info.n_ctx + 1 - n)
        from vllm.sampling_params import RequestOutputKind

        payload = _with_lens(
            self._payload(rid, resolved, writes, n, n + max_tokens + 1, request.readouts), request.lens
        )
        params = self._sampling(
            limit,
            dataclasses.replace(request.sampling, ignore_eos=True),  # the stop is found here
            extra_args=_keyed(payload, keys).extra_args(),
            output_kind=RequestOutputKind.DELTA,
        )
        tokens: list[int] = []
        keep = max_tokens
        fetched = False
        try:
            async for output in self._outputs(engine, ids, params, rid, rid):
                tokens.extend(output.outputs[0].token_ids)
                keep = self._stop_index(tokens, max_tokens, request.sampling)
                if len(tokens) > keep or output.finished:
                    break
            keep = min(keep, len(tokens))
            values, readouts, lens = (
                await self._fetch(engine, rid, resolved, n + keep, request.readouts) if captures else ({}, {}, None)
            )
            fetched = True
        finally:
            if not captures:
                await self._done(engine, rid)
            elif not fetched:
                await self._release(engine, rid)
        results = request.keyed(values, readouts)
        if request.lens is not None:
            results[request.lens.request] = _lens_result(request.lens, lens, n, keep)
        return self._completion(tokens[:keep], request.sampling), results

    async def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
        **sampling: Any,
    ) -> Completion:
        """A completion (greedy unless ``temperature``/``top_k``/``top_p``/``seed`` say otherwise)."""
        request = self._check_generation(
            token_ids, [], max_tokens=max_tokens, steering_spec=steering_spec, sampling=sampling
        )
        kept = [step.token_id async for step in self._steps(request)]
        return self._completion(kept, request.sampling)

    async def stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
        features: Iterable[Any] = (),
        lens: LensRequest | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamStep]:
        """Generated tokens one by one, with the top-``n_logprobs`` pairs from vLLM's sampler, the
        ``features`` readouts and the ``lens`` at the position that produced each (computed in the
        workers, drained step by step: only the readouts and the lens's top-k leave them)."""
        request = self._check_generation(
            token_ids,
            self._stream_readouts(features),
            max_tokens=max_tokens,
            steering_spec=steering_spec,
            sampling=sampling,
            n_logprobs=n_logprobs,
            lens=lens,
        )
        async for step in self._steps(request):
            yield step

    async def _steps(self, request: CheckedRequest) -> AsyncIterator[StreamStep]:
        engine = await self._ready()
        self._check_lens_stages(request)
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        steps = self._stream_steps(engine, request, keys)
        try:
            async for step in steps:
                yield step
        finally:
            try:
                await steps.aclose()  # a caller that stops early: abort and release the request now
            finally:
                await self._unuse_saes(engine, keys)

    async def _stream_steps(
        self, engine: Any, request: CheckedRequest, keys: dict[str, str]
    ) -> AsyncGenerator[StreamStep, None]:
        ids, writes, max_tokens, n_logprobs = request.token_ids, request.writes, request.max_tokens, request.n_logprobs
        readouts, lens = request.readouts, request.lens
        drains = bool(readouts or lens)
        from vllm.sampling_params import RequestOutputKind

        rid = f"interp-{uuid.uuid4().hex}"
        extra: dict[str, Any] = {"output_kind": RequestOutputKind.DELTA}
        if n_logprobs:
            extra["logprobs"] = n_logprobs
        if writes or drains:
            payload = self._payload(rid, [], writes, len(ids), len(ids) + max_tokens, readouts, stream=True)
            extra["extra_args"] = _keyed(_with_lens(payload, lens), keys).extra_args()
        params = self._sampling(max_tokens, request.sampling, **extra)
        pieces = TextPieces(self.completion_text)
        # a steered or read request neither reuses cached KV (its taps must run on every prompt
        # token) nor leaves its steered KV behind for others: a unique salt keeps it out of the
        # cache (a lens reads the prompt's last position, always computed, and any asked before it)
        salt = rid if writes or readouts or (lens is not None and lens.prompt_positions) else None
        position = len(ids) - 1  # the forward that produces the first token runs at the prompt's last
        pending: dict[int, dict[Features, FeatureReadout]] = {}
        lens_pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        prompt_lens: LensResult | None = None
        try:
            async for output in self._outputs(engine, ids, params, rid, salt):
                choice = output.outputs[0]
                if drains and choice.token_ids:
                    await self._drain(engine, rid, pending, lens_pending)
                if lens is not None and lens.prompt_positions and choice.token_ids and position == len(ids) - 1:
                    prompt_lens = _prompt_lens(lens, lens_pending, len(ids))
                for i, token in enumerate(choice.token_ids):
                    last = output.finished and i == len(choice.token_ids) - 1
                    top: list[tuple[int, float]] = []
                    if n_logprobs and choice.logprobs:
                        ranked = sorted(choice.logprobs[i].items(), key=lambda kv: -kv[1].logprob)
                        top = [(int(t), float(lp.logprob)) for t, lp in ranked[:n_logprobs]]
                    step_features = pending.pop(position, {}) if readouts else {}
                    if readouts and len(step_features) != len(readouts):
                        raise BackendError(f"the readouts of position {position} did not come back from the workers")
                    step_lens = None
                    if lens is not None:
                        if position not in lens_pending:
                            raise BackendError(f"the lens of position {position} did not come back from the workers")
                        step_ids, step_probs = lens_pending.pop(position)
                        step_lens = LensTopK(position, lens.layers, step_ids, step_probs)
                    yield StreamStep(
                        int(token),
                        pieces.add(int(token), last=last),
                        top,
                        position=position,
                        features=step_features,
                        lens=step_lens,
                        prompt_lens=prompt_lens,
                    )
                    prompt_lens = None  # the first step only
                    position += 1
        finally:
            if drains:
                await self._release(engine, rid)
            elif writes:
                await self._done(engine, rid)

    async def _drain(
        self,
        engine: Any,
        rid: str,
        pending: dict[int, dict[Features, FeatureReadout]],
        lens_pending: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Add a streaming request's readouts so far to ``pending`` and its lens to
        ``lens_pending`` (``(ids [n_layers, k], probs [n_layers, k])``), by position."""
        future: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._drain_queue.append((rid, future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.ensure_future(self._batches(engine, "interp_drain_many", self._drain_queue))
        try:
            blobs = await future
        except Exception as exc:
            if self._closed:
                raise ModelClosed("the model was shut down while this call was in flight") from exc
            if _is_engine_dead(exc):
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise BackendError(f"the workers could not return this request's readouts: {exc}") from exc
        every = [Fetched.decode(blob) for blob in blobs]
        for rank in every:
            rank.raise_error()
        for spec, (positions, readout) in _readouts_of(every).items():
            for row, p in enumerate(positions.tolist()):
                pending.setdefault(int(p), {})[spec] = readout[row]
        lens = _lens_of(every)
        if lens is not None:
            positions, ids, probs = lens
            for row, p in enumerate(positions.tolist()):
                lens_pending[int(p)] = (ids[row], probs[row])

    async def worker_stats(self) -> list[dict[str, int]]:
        """Per-worker counters: live requests (for leak checks) and vLLM's and Dynamo's
        compilation counters (constant after warm-up when requests never recompile)."""
        engine = await self._ready()
        stats: list[dict[str, int]] = await engine.collective_rpc("interp_stats")
        return stats

    # -- logit lens ------------------------------------------------------------------------
    async def _decode_residuals(self, residuals: torch.Tensor) -> torch.Tensor:
        """Final norm + unembedding with the served weights, in the workers; on the last layer's
        ``resid_post`` this is the model's own logits."""
        engine = await self._ready()
        flat = residuals.detach().to("cpu", torch.float32).reshape(-1, self.info.d_model).contiguous()
        blobs = await engine.collective_rpc("interp_decode", args=(pack({"residuals": flat}),))
        logits: torch.Tensor = unpack(blobs[self._owners(Address("final_norm"))[0]])["logits"]
        return logits.reshape(*residuals.shape[:-1], logits.shape[-1])

    # -- weights (interp_engine.weights) ---------------------------------------------------------
    async def weight_info(self) -> WeightInfo:
        """The weight names this model has, its final norm's kind and how its logits compute,
        as the workers serve them."""
        if self._weight_info is None:
            answers = await self._weight_rpc("interp_weight_info")
            self._weight_info = merge_info(
                answers, self._stages[0][1], self._stages[-1][1], self.config, self.family.attn_scale
            )
        return self._weight_info

    async def weight(self, name: str, layer: int | None = None, *, vocab: Sequence[int] | None = None) -> torch.Tensor:
        """A float32 CPU copy of served weight ``name`` (``interp_engine.WEIGHT_NAMES``), joined from
        the tensor-parallel shards of the pipeline stage that holds it."""
        name, layer, ids = check_weight_request(await self.weight_info(), self.info, name, layer, vocab)
        blobs = await self._weight_rpc("interp_weight", name, layer, ids)
        if name == "W_E":
            owners = self._stages[0][1]
        elif name in ("W_O", "b_O"):
            owners = self._owners(Address("resid_post", layer))  # the stage holding the layer
        else:  # the unembedding and the final norm: the last stage
            owners = self._stages[-1][1]
        return merge_weight(name, [unpack(blobs[i]) for i in owners], self.info, ids)

    async def _weight_rpc(self, method: str, *args: Any) -> list[Any]:
        engine = await self._ready()
        try:
            answers: list[Any] = await engine.collective_rpc(method, args=args)
        except Exception as exc:
            if _is_engine_dead(exc):
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise BackendError(f"the workers could not read the weights: {type(exc).__name__}: {exc}") from exc
        return answers

    # -- lifecycle ---------------------------------------------------------------------------
    def _probe_engine(self) -> None:
        """vLLM's own flag: its engine core process died (or its output handler stopped)."""
        engine = self._engine
        if engine is not None and not self._closed and bool(getattr(engine, "errored", False)):
            self._engine_died("EngineDeadError: the vLLM engine core is not running")

    def _close_resources(self) -> None:
        """Stop the engine and reap its processes (once, on the first ``shutdown()``)."""
        engine, self._engine = self._engine, None
        building = self._building
        if building is not None and building.done() and not building.cancelled() and building.exception() is None:
            # the finished build task's result is the engine: it would keep the AsyncLLM alive
            # until interpreter teardown, whose AsyncLLM.__del__ then fails on vLLM's cleared
            # module globals ("TypeError: 'NoneType' object is not callable")
            self._building = None
        if engine is not None:
            _fail_in_flight(engine, self._loop)
            _stop_output_handler(engine, self._loop)
            processes = _engine_processes(engine)
            engine.shutdown()
            for process in processes:  # vLLM kills a slow engine core but does not reap it
                process.join(timeout=10)
            del engine
            gc.collect()  # let AsyncLLM.__del__ run now, not during interpreter teardown


def _stages(pings: list[dict[str, Any]]) -> list[tuple[frozenset[int], list[int]]]:
    """Per pipeline stage, in order: the layers it holds and the indices of its workers in
    ``collective_rpc``'s answers, ordered by tensor-parallel rank (vLLM's global rank is
    ``pp_rank * tp_size + tp_rank``, but the answers' order is the executor's: Ray's may differ)."""
    workers: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    layers: dict[int, frozenset[int]] = {}
    for index, ping in enumerate(pings):
        stage = int(ping.get("pp_rank", 0))
        workers[stage].append((int(ping.get("rank", 0)), index))
        layers[stage] = frozenset(int(layer) for layer in ping.get("layers") or ())
    return [(layers[stage], [index for _, index in sorted(workers[stage])]) for stage in sorted(workers)]


def _readouts_of(ranks: list[Fetched]) -> dict[Features, tuple[torch.Tensor, FeatureReadout]]:
    """Every readout the workers computed (each by tensor-parallel rank 0 of the pipeline stage
    holding its SAE's address)."""
    found: dict[Features, tuple[torch.Tensor, FeatureReadout]] = {}
    for rank in ranks:
        for spec, value in rank.readouts.items():
            found.setdefault(spec, value)
    return found


def _lens_of(ranks: list[Fetched]) -> LensChunk | None:
    """The lens the workers computed (tensor-parallel rank 0 of the last pipeline stage)."""
    for rank in ranks:
        if rank.lens is not None:
            return rank.lens
    return None


def _with_lens(payload: RequestPayload, lens: CheckedLens | None) -> RequestPayload:
    """``payload`` asking the workers for ``lens``."""
    if lens is None:
        return payload
    return dataclasses.replace(
        payload, lens_layers=lens.layers, lens_top_k=lens.top_k, lens_positions=lens.prompt_positions
    )


def _prompt_lens(lens: CheckedLens, pending: dict[int, tuple[torch.Tensor, torch.Tensor]], n_prompt: int) -> LensResult:
    """The lens at the prompt positions asked, out of ``pending`` (those before the prompt's last
    are taken out; the last one also produced the first token and stays for its step)."""
    last = n_prompt - 1
    missing = [p for p in lens.prompt_positions if p not in pending]
    if missing:
        raise BackendError(f"the lens of prompt positions {missing[:8]} did not come back from the workers")
    steps = []
    for p in lens.prompt_positions:
        ids, probs = pending[p] if p == last else pending.pop(p)
        steps.append(LensTopK(p, lens.layers, ids, probs))
    return LensResult.stack(steps)


def _lens_result(lens: CheckedLens, chunk: LensChunk | None, n_prompt: int, n_generated: int) -> LensResult:
    """The lens of a generation: at the prompt positions asked and at every position that
    produced one of the ``n_generated`` tokens kept."""
    wanted = sorted({*lens.prompt_positions, *range(n_prompt - 1, n_prompt - 1 + n_generated)})
    if not wanted:  # nothing generated and no prompt positions asked
        empty = torch.zeros(len(lens.layers), 0, lens.top_k)
        return LensResult(lens.layers, (), empty.long(), empty)
    if chunk is None:
        raise BackendError("the lens did not come back from the workers")
    positions, ids, probs = chunk
    at = {int(p): row for row, p in enumerate(positions.tolist())}
    missing = [p for p in wanted if p not in at]
    if missing:
        raise BackendError(f"the lens of positions {missing[:8]} did not come back from the workers")
    rows = torch.tensor([at[p] for p in wanted], dtype=torch.long)
    return LensResult(
        lens.layers,
        tuple(wanted),
        ids[rows].transpose(0, 1).contiguous(),
        probs[rows].transpose(0, 1).contiguous(),
    )


def _keyed(payload: RequestPayload, keys: dict[str, str]) -> RequestPayload:
    """``payload`` naming the keys its SAEs are held under in the workers."""
    return dataclasses.replace(payload, sae_keys=keys) if keys else payload


def _is_engine_dead(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's report that its engine core died."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def _engine_processes(engine: Any) -> list[Any]:
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def _fail_in_flight(engine: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    """Wake every request still waiting for output with an error, so calls in flight during
    shutdown raise ModelClosed instead of waiting for output that will never come."""
    from vllm.v1.engine.exceptions import EngineDeadError

    processor = getattr(engine, "output_processor", None)
    if processor is None or loop is None or loop.is_closed():
        return
    error = EngineDeadError("the model was shut down")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        processor.propagate_error(error)
    else:
        loop.call_soon_threadsafe(processor.propagate_error, error)


def _stop_output_handler(engine: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    """Cancel AsyncLLM's output handler before its engine core goes away, so it does not
    report the engine it was reading from as dead."""
    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done() or loop is None or loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        handler.cancel()
    else:
        loop.call_soon_threadsafe(handler.cancel)
