"""The ``vllm`` backend's engine client: vLLM's ``AsyncLLM`` built on first use, on the event
loop that awaits it, and every call into it.

:class:`EngineClient` reads the model's config (its :class:`~interp_engine.ModelInfo`, checked
against what the workers resolve), starts the engine, pings its workers (:class:`~._client.Workers`)
and maps them to pipeline stages, submits requests and aborts them when their caller stops,
batches fetches into one engine-core round trip, reads weights and stats, and shuts down and reaps
the engine's processes. What a request carries and what it gets back is :mod:`._model`'s.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import gc
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from interp_engine import (
    Address,
    BackendError,
    ForeignEventLoop,
    InterpError,
    InvalidAdapter,
    InvalidOption,
    InvalidTokens,
    KindNotInFamily,
    ModelBase,
    ModelClosed,
    ModelInfo,
    ModelLoadError,
    SamplingOptions,
)
from interp_engine.backend import Adapter, TokenizerMixin, WeightInfo, check_weight_request

from .. import _compat, _transport
from .._transport import Slab
from .._wire import FetchedWire, Ping
from ..model._resolve import resolve_without_weights
from ..model._sites import SITES
from . import _spawn
from ._capture_memory import CaptureMemory, default_limit
from ._client import Workers
from ._engine_config import (
    CAPTURE_TRANSPORTS,
    CPU_ENGINE_DEFAULTS,
    CPU_ENV_DEFAULTS,
    ENGINE_DEFAULTS,
    FRONT_END_OPTIONS,
    _check_cpu_head_size,
    _config_d_mlp,
    _engine_fields,
    _generation_config,
    _is_cpu_platform,
)
from ._weights import merge_info, merge_weight

_T = TypeVar("_T")


class EngineClient(TokenizerMixin, ModelBase):
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
        # told to the workers at the ping and carried by every payload: the workers serve only
        # payloads of a front end that pinged them
        self._issuer = secrets.token_hex(16)
        self._transport = options.pop("capture_transport", "auto")
        if self._transport not in CAPTURE_TRANSPORTS:
            raise InvalidOption(
                f"capture_transport must be one of {', '.join(CAPTURE_TRANSPORTS)}, got {self._transport!r}"
            )
        memory = options.pop("capture_memory_bytes", None)
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 1):
            raise InvalidOption(f"capture_memory_bytes must be a positive int (bytes), got {memory!r}")
        self._buffer_root = _transport.directory() if self._transport != "rpc" else None
        self.capture_memory = CaptureMemory(memory or default_limit(self._buffer_root))
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
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                del defaults["kv_cache_memory_bytes"]
        self.engine_kwargs: dict[str, Any] = {**defaults, **options}
        n_heads = int(config.num_attention_heads)
        d_model = int(config.hidden_size)
        model_max = getattr(config, "max_position_embeddings", None)
        max_len = self.engine_kwargs.get("max_model_len") or model_max
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1 or (model_max and max_len > model_max)):
            raise InvalidOption(
                f"max_model_len must be a positive int no larger than the model's {model_max} positions, "
                f"got {max_len!r}"
            )
        # where vLLM's model keeps each address: its module tree, built on the meta device
        self.family = resolve_without_weights(name_or_path, {**self.engine_defaults, **options})
        d_mlp = self.family.d_mlp or _config_d_mlp(config, d_model)
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
        self._owns_engine = True  # False: an engine started elsewhere (serve_engine), left running
        self._loop: asyncio.AbstractEventLoop | None = None
        self._building: asyncio.Future[Any] | None = None
        self.tp_size = 1
        self.pp_size = 1
        self.model_runner: str | None = None
        """Which of vLLM's model runners the workers run (``"v1"`` or ``"v2"``), once started."""
        # per pipeline stage (in order): the layers it holds and its workers' indices in
        # collective_rpc's answers, by tensor-parallel rank (one stage without pipeline parallelism)
        self._stages: list[tuple[frozenset[int], list[int]]] = []
        # fetches wait here and go to the workers together: one engine-core round trip for
        # every request that finished while the previous batch was on its way
        self._fetch_queue: list[tuple[str, asyncio.Future[list[FetchedWire]]]] = []
        self._fetch_task: asyncio.Task[None] | None = None
        # streaming readouts are drained the same way, one round trip for every waiting stream
        self._drain_queue: list[tuple[str, asyncio.Future[list[FetchedWire]]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self._weight_info: WeightInfo | None = None
        self._lora_ids: dict[str, int] = {}
        """vLLM's ``lora_int_id`` of each registered adapter (its name: ``lora_name``)."""
        self._vllm_loras: dict[str, tuple[str, int]] = {}
        """The adapters taken from a vLLM server's own LoRAs (:meth:`adopt_loras`): (folder, id)."""
        self._adopting: int | None = None
        """While :meth:`adopt_loras` registers one: the ``lora_int_id`` vLLM's server gave it."""

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

        _spawn.check_not_bootstrapping()  # a spawned child importing an unguarded script starts nothing
        _spawn.clear()
        for name, value in (CPU_ENV_DEFAULTS if self._cpu else {}).items():
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
            if _spawn.child_reported():
                raise _spawn.error(in_child=False) from exc
            raise BackendError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        try:
            await self._adopt(engine)
        except BaseException:
            engine.shutdown()
            raise
        if self._closed:  # shut down while starting
            self._engine = None
            engine.shutdown()
            raise ModelClosed("this model was shut down while its engine was starting")
        return engine

    async def serve_engine(self, engine: Any) -> None:
        """Serve through ``engine``, a vLLM ``AsyncLLM`` started elsewhere (``vllm serve``'s), on
        the running loop, instead of starting one. The engine stays its starter's: this model's
        ``shutdown()`` closes only what the model holds. Raises :class:`BackendError` when the
        engine's workers cannot serve the taps (no interp-vllm plugin in them, another model
        runner), leaving the engine serving as before."""
        self._check_open()
        if self._engine is not None or self._building is not None:
            raise InvalidOption("this model already has an engine")
        loop = asyncio.get_running_loop()
        self._owns_engine = False
        self._loop = loop
        self._building = loop.create_task(self._adopt(engine))
        try:
            await self._building
        except BaseException:
            self._building, self._loop, self._engine = None, None, None
            raise

    async def _adopt(self, engine: Any) -> None:
        """Make a running engine this model's: ping its workers (telling them this front end's
        secret), check they can serve the model, and set up the capture slab where they all see
        it. Raises :class:`BackendError` (the engine is left running) when they cannot."""
        prefix = None if self._buffer_root is None else _transport.new_prefix(self._buffer_root)
        if self._buffer_root is not None:  # what front ends killed by a signal left behind
            _transport.sweep_orphans(self._buffer_root)
        probe = None if prefix is None else _transport.make_probe(prefix)
        try:
            pings = await Workers(engine).ping(probe, self._issuer)
        except Exception as exc:
            raise BackendError(
                f"the interp-vllm plugin is not loaded in vLLM's workers ({exc}); is interp-vllm "
                "installed in the environment the workers run in, and not excluded by VLLM_PLUGINS?"
            ) from exc
        finally:
            if probe is not None:
                _transport.sweep(prefix or "")
        problem = self._check_workers(pings)
        if problem is None and self._transport == "shared_memory" and not all(p.sees_probe for p in pings):
            problem = (
                f"capture_transport='shared_memory', but not every vLLM worker sees {self._buffer_root} "
                "(workers on another machine): use capture_transport='auto' or 'rpc'"
            )
        if problem is not None:
            raise BackendError(problem)
        if prefix is not None and all(p.sees_probe for p in pings):
            self.capture_memory.slab = Slab(prefix, held=_transport.hold(prefix))
            atexit.register(_transport.sweep, prefix)
        self.tp_size = pings[0].tp_size
        self.pp_size = pings[0].pp_size
        self.model_runner = pings[0].seam
        self._stages = _stages(pings)
        self._engine = engine

    def _engine_args(self) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` fields this model's engine is built with."""
        return dict(self.engine_kwargs)

    def _check_workers(self, pings: list[Ping]) -> str | None:
        """Why the started workers cannot serve this model (``None``: they can)."""
        for ping in pings:
            if ping.incompatible:
                return ping.incompatible
        if not all(p.patched for p in pings):
            runners = sorted({p.runner for p in pings if not p.patched})
            return (
                f"vLLM is serving with a model runner the taps do not wrap ({', '.join(runners)}); "
                "interp-vllm wraps vLLM's V1 and V2 model runners (vllm>=0.32,<0.35)"
            )
        seams = sorted({str(p.seam) for p in pings})
        if len(seams) > 1:
            seen = sorted({f"{p.seam} (VLLM_USE_V2_MODEL_RUNNER={p.v2_runner_env})" for p in pings})
            return (
                f"vLLM's workers run different model runners: {', '.join(seen)}; set VLLM_USE_V2_MODEL_RUNNER "
                "the same way on every node (on a Ray cluster a node's own value wins)"
            )
        expected = sorted(self.family.lacks())
        for ping in pings:
            if ping.unsupported:
                return f"vLLM's workers cannot place this model's addresses: {ping.unsupported}"
            if ping.lacks is not None and list(ping.lacks) != expected:
                return (
                    f"vLLM's workers resolved this model's structure differently from the front end "
                    f"(lacking {list(ping.lacks)}, not {expected})"
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
        return {kind: SITES[kind].how for kind in SITES if kind not in lacks and kind in self.supported_points}

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

    # -- adapters (vLLM's LoRA) -------------------------------------------------------------
    def _max_adapter_rank(self) -> int | None:
        rank = self.engine_kwargs.get("max_lora_rank", _engine_fields().get("max_lora_rank"))
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else None

    def _load_adapter(self, adapter: Adapter) -> None:
        """Register the adapter with this front end: vLLM loads it into its workers' LoRA slots on
        the first request naming it (``LoRARequest``), and keeps up to ``max_loras`` of them per
        batch, each request's rows under its own."""
        if not self.engine_kwargs.get("enable_lora"):
            raise InvalidAdapter(
                f"this vllm model serves no adapters: load it with enable_lora=True (and max_lora_rank >= "
                f"{adapter.rank}, max_loras for how many may share a batch) to serve {adapter.name!r}",
                name=adapter.name,
            )
        if self._adopting is not None:
            self._lora_ids[adapter.name] = self._adopting
        else:
            self._lora_ids[adapter.name] = max(self._lora_ids.values(), default=0) + 1

    def served_loras(self) -> dict[str, tuple[str, int]]:
        """The adapters :meth:`adopt_loras` registered: name -> (folder, vLLM's ``lora_int_id``)."""
        return dict(self._vllm_loras)

    def adopt_loras(self, served: Mapping[str, tuple[str, int]]) -> dict[str, str]:
        """Serve the LoRAs of the vLLM server whose engine this model adopted (``serve_engine``):
        ``served`` maps each name to (its folder, the ``lora_int_id`` the server gave it). Each is
        registered under that name and id (checked like any adapter), so a request here runs the
        very LoRA vLLM's own routes run under that name; those adopted before and no longer in
        ``served`` (or now another folder or id) are dropped. Returns the ones refused, by name,
        with the reason (a name registered otherwise, another model's widths, a rank over
        ``max_lora_rank``)."""
        for name, lora in list(self._vllm_loras.items()):
            if served.get(name) != lora:
                del self._vllm_loras[name]
                self._lora_ids.pop(name, None)
                self._adapters.pop(name, None)
        refused: dict[str, str] = {}
        for name, (path, lora_id) in served.items():
            if name in self._vllm_loras:
                continue
            self._adopting = lora_id
            try:
                self.load_adapter(name, path)
            except InterpError as exc:
                refused[name] = str(exc)
                continue
            finally:
                self._adopting = None
            self._vllm_loras[name] = (path, lora_id)
        return refused

    def _lora_request(self, adapter: str | None) -> Any:
        """vLLM's ``LoRARequest`` for a registered adapter (``None``: the base model)."""
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter, self._lora_ids[adapter], self.adapters[adapter].path)

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

    async def _outputs(
        self, engine: Any, ids: list[int], params: Any, rid: str, salt: str | None, adapter: str | None = None
    ) -> AsyncIterator[Any]:
        """The request's outputs (under the registered ``adapter``, ``None``: the base model);
        aborts it in vLLM if the caller stops early or is cancelled."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt  # no prefix-cache sharing: every prompt token is computed
        from vllm.exceptions import VLLMClientError

        finished = False
        try:
            lora = self._lora_request(adapter)
            async for output in engine.generate(
                prompt, params, rid, **({} if lora is None else {"lora_request": lora})
            ):
                finished = output.finished
                yield output
        except VLLMClientError as exc:
            raise InvalidTokens(f"vLLM rejected the request: {exc}") from exc
        except Exception as exc:
            if self._closed:
                raise ModelClosed("the model was shut down while this call was in flight") from exc
            if is_engine_dead(exc):  # its engine core process is gone: every later call says so at once
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            if not finished and not self._closed and self._dead is None:
                await engine.abort(rid)

    async def _fetch_blobs(self, engine: Any, rid: str) -> list[FetchedWire]:
        """One request's values from every rank, fetched together with whatever other
        requests are waiting (a cancelled caller's values are dropped in the worker all the same)."""
        future: asyncio.Future[list[FetchedWire]] = asyncio.get_running_loop().create_future()
        self._fetch_queue.append((rid, future))
        if self._fetch_task is None or self._fetch_task.done():
            self._fetch_task = asyncio.ensure_future(self._batches(Workers(engine).fetch_many, self._fetch_queue))
        return await future

    async def _batches(
        self,
        method: Callable[[list[str]], Awaitable[list[list[FetchedWire]]]],
        queue: list[tuple[str, asyncio.Future[list[FetchedWire]]]],
    ) -> None:
        """Answer every waiter in ``queue`` (drained in place) with ``method`` over their ids:
        one engine-core round trip for all requests waiting while the previous one was out."""
        while queue:
            batch = list(queue)
            queue.clear()
            try:
                ranks = await method([rid for rid, _ in batch])
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

    async def _release(self, engine: Any, rid: str) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):  # the engine is going away; nothing left to free
                await Workers(engine).release(rid)

    async def worker_stats(self) -> list[dict[str, int]]:
        """Per-worker counters: live requests (for leak checks) and vLLM's and Dynamo's
        compilation counters (constant after warm-up when requests never recompile)."""
        engine = await self._ready()
        return await Workers(engine).stats()

    # -- logit lens ------------------------------------------------------------------------
    async def _decode_residuals(self, residuals: torch.Tensor) -> torch.Tensor:
        """Final norm + unembedding with the served weights, in the workers; on the last layer's
        ``resid_post`` this is the model's own logits."""
        engine = await self._ready()
        flat = residuals.detach().to("cpu", torch.float32).reshape(-1, self.info.d_model).contiguous()
        answers = await Workers(engine).decode(flat)
        logits = answers[self._owners(Address("final_norm"))[0]]
        if logits is None:
            raise BackendError("the last pipeline stage sent no logits")
        return logits.reshape(*residuals.shape[:-1], logits.shape[-1])

    # -- weights (interp_engine.weights) ---------------------------------------------------------
    async def weight_info(self) -> WeightInfo:
        """The weight names this model has, its final norm's kind and how its logits compute,
        as the workers serve them."""
        if self._weight_info is None:
            answers = await self._weight_rpc(lambda workers: workers.weight_info())
            self._weight_info = merge_info(
                answers, self._stages[0][1], self._stages[-1][1], self.config, self.family.attn_scale
            )
        return self._weight_info

    async def weight(self, name: str, layer: int | None = None, *, vocab: Sequence[int] | None = None) -> torch.Tensor:
        """A float32 CPU copy of served weight ``name`` (``interp_engine.WEIGHT_NAMES``), joined from
        the tensor-parallel shards of the pipeline stage that holds it."""
        name, layer, ids = check_weight_request(await self.weight_info(), self.info, name, layer, vocab)
        parts = await self._weight_rpc(lambda workers: workers.weight(name, layer, ids))
        if name == "W_E":
            owners = self._stages[0][1]
        elif name in ("W_O", "b_O"):
            owners = self._owners(Address("resid_post", layer))  # the stage holding the layer
        else:  # the unembedding and the final norm: the last stage
            owners = self._stages[-1][1]
        return merge_weight(name, [parts[i] for i in owners], self.info, ids)

    async def _weight_rpc(self, call: Callable[[Workers], Awaitable[_T]]) -> _T:
        engine = await self._ready()
        try:
            answers = await call(Workers(engine))
        except Exception as exc:
            if is_engine_dead(exc):
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
        if engine is not None and self._owns_engine:
            _fail_in_flight(engine, self._loop)
            _stop_output_handler(engine, self._loop)
            processes = _compat.engine_processes(engine)
            engine.shutdown()
            for process in processes:  # vLLM kills a slow engine core but does not reap it
                process.join(timeout=10)
            del engine
            gc.collect()  # let AsyncLLM.__del__ run now, not during interpreter teardown
        if self.capture_memory.slab is not None:  # the slab's segments go back to the system
            self.capture_memory.slab.close()


def _stages(pings: list[Ping]) -> list[tuple[frozenset[int], list[int]]]:
    """Per pipeline stage, in order: the layers it holds and the indices of its workers in
    ``collective_rpc``'s answers, ordered by tensor-parallel rank (vLLM's global rank is
    ``pp_rank * tp_size + tp_rank``, but the answers' order is the executor's: Ray's may differ)."""
    workers: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    layers: dict[int, frozenset[int]] = {}
    for index, ping in enumerate(pings):
        workers[ping.pp_rank].append((ping.rank, index))
        layers[ping.pp_rank] = frozenset(ping.layers)
    return [(layers[stage], [index for _, index in sorted(workers[stage])]) for stage in sorted(workers)]


def is_engine_dead(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's report that its engine core died."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


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
