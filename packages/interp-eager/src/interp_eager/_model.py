"""The eager backend's model: HF ``transformers`` + PyTorch hooks, behind the async protocol.

Every address kind is read by a hook where the model computes it (see ``_sites``; ``attn_scores``
is rebuilt, with the eager attention's own operations, from the queries, keys and mask its
attention function receives, so ``softmax(attn_scores)`` is ``attn_pattern``); which kinds a
loaded model has -- a gated MLP's ``mlp_pre_linear``, the q/k-norm points, the sandwich norms'
``attn_out_post``/``mlp_out_post``, a mixture of experts' router points -- comes from its
:class:`~interp_eager._families.Family`, resolved from the loaded model's module tree and one
traced forward (:mod:`interp_eager._resolve`; :attr:`EagerModel.family`); asking for one it lacks
raises ``KindNotInFamily``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import nn

from interp_engine import (
    Address,
    CheckedRequest,
    Completion,
    FeatureReadout,
    Features,
    GradientMetric,
    InvalidOption,
    ModelBase,
    ModelInfo,
    Results,
    SamplingOptions,
    SteeringSpec,
    StreamStep,
    UnsupportedAddress,
)
from interp_engine.backend import (
    Adapter,
    CheckedLens,
    LensResult,
    LensTopK,
    RowAdapters,
    RowSpecs,
    TextPieces,
    TokenizerMixin,
    WeightInfo,
    check_weight_request,
    lens_top_k,
    pad_rows,
)

from ._adapters import PeftAdapters
from ._batches import batch_readouts, batch_writes, row_at, to_cpu, zero_padding
from ._compat import default_thread_state
from ._families import Family
from ._generate import choose, generator_for, top_logprobs
from ._plan import Chunk, Plan, check_probe
from ._resolve import resolve
from ._sites import EAGER_KINDS, Architecture
from ._weights import read_weight, weight_info

T = TypeVar("T")

_LOGITS = Address("logits")
_NEEDS_EAGER_ATTENTION = ("attn_pattern", "attn_scores")
"""Kinds read from eager attention (SDPA never forms the weights, and skips Gemma 2's soft-cap)."""


def _ctx_length(config: Any, tokenizer: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else 2**31 - 1


class EagerModel(TokenizerMixin, ModelBase):
    """A HuggingFace causal LM served through the interp-engine async protocol.

    Forwards run on a worker thread (the event loop stays free; a blocking capture may run in the
    calling thread instead, :meth:`capture_batch_blocking`) one at a time, each with only its own
    request's hooks installed, so concurrent calls never see each other's captures or steering.
    Build one with ``load_model(path, backend="eager")`` or :meth:`from_hf`. :meth:`points` lists
    the kinds the loaded model has; :attr:`family` is what its structure resolved to (where each
    point is read).
    """

    backend = "eager"
    supported_points = EAGER_KINDS
    transcoder_clamps = True

    def __init__(self, hf_model: nn.Module, tokenizer: Any, *, family: Family | None = None) -> None:
        self._hf: nn.Module | None = hf_model.eval()
        self.tokenizer = tokenizer
        config: Any = hf_model.config
        self.family = family if family is not None else resolve(hf_model)
        self.arch = Architecture(hf_model, self.family)
        self._kinds = self.arch.served_kinds()
        embed = hf_model.get_input_embeddings()  # type: ignore[operator]
        info = ModelInfo(
            architecture=str(config.model_type),
            n_layers=len(self.arch.layers),
            d_model=int(config.hidden_size),
            d_mlp=self.arch.d_mlp(),
            n_heads=self.arch.n_heads,
            n_kv_heads=self.arch.n_kv_heads,
            vocab_size=int(embed.num_embeddings),
            n_ctx=_ctx_length(config, tokenizer),
            parallel_attn=self.arch.parallel,
            d_head=self.arch.d_head,
            n_experts=self.family.n_experts,
            experts_per_token=self.family.experts_per_token,
        )
        generation_config = getattr(hf_model, "generation_config", None)
        super().__init__(info, eos_ids=ModelBase.eos_ids_of(generation_config, config))
        parameters = inspect.signature(hf_model.forward).parameters
        self._cache_arg = "past_key_values" if "past_key_values" in parameters else "cache"
        self._can_trim_logits = "logits_to_keep" in parameters
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="interp-eager")
        self._weight_info: WeightInfo | None = None
        self._peft = PeftAdapters(hf_model)

    def _model_source(self) -> str | None:
        """The Hugging Face model's own ``name_or_path`` (a model wrapped with :meth:`from_hf`)."""
        name = getattr(self.hf_model.config, "_name_or_path", None)
        return name if isinstance(name, str) and name else None

    @classmethod
    def from_hf(cls, hf_model: nn.Module, tokenizer: Any) -> EagerModel:
        """Wrap an already loaded HF model and tokenizer (no copy is made)."""
        return cls(hf_model, tokenizer)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.info.n_layers} layers, d_model {self.info.d_model}"
        return f"<EagerModel {self.info.architecture} ({state})>"

    # -- state --------------------------------------------------------------------------
    @property
    def hf_model(self) -> nn.Module:
        """The underlying ``transformers`` model (eval mode)."""
        if self._hf is None:
            raise self._closed_error()
        return self._hf

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    async def _run(self, fn: Callable[[], T]) -> T:
        self._check_open()
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._executor, fn)
        except RuntimeError:  # the executor was shut down between the check and the call
            raise self._closed_error() from None
        return await future

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the worker thread, waited for by the calling thread (no event loop)."""
        self._check_open()
        try:
            future = self._executor.submit(fn)
        except RuntimeError:  # the executor was shut down between the check and the call
            raise self._closed_error() from None
        return future.result()

    # -- what the loaded model has ------------------------------------------------------
    def _served_kinds(self) -> dict[str, str]:
        """The family's table, less the optional modules this model lacks."""
        return self._kinds

    def _kind_layers(self, kind: str) -> tuple[int, ...] | None:
        return self.arch.kind_layers(kind)

    def _missing_reason(self, kind: str) -> str:
        return self.arch.missing_reason(kind, super()._missing_reason(kind))

    # -- one forward --------------------------------------------------------------------
    @contextlib.contextmanager
    def _attention_weights(self, needed: bool) -> Iterator[None]:
        """Eager attention for this forward if patterns or scores are read (SDPA never forms the
        weights, and skips soft-capping: the scores are what eager attention's softmax sees)."""
        hf = self.hf_model
        current = getattr(hf.config, "_attn_implementation", "eager")
        if not needed or current == "eager":
            yield
            return
        try:
            hf.set_attn_implementation("eager")  # type: ignore[operator]
            if getattr(hf.config, "_attn_implementation", "eager") != "eager":
                raise RuntimeError(f"{type(hf).__name__} cannot switch its attention implementation at run time")
        except Exception as exc:
            raise UnsupportedAddress(
                f"attention patterns need eager attention and this model could not switch to it "
                f"({exc}); load it with attn_implementation='eager'",
                address="attn_pattern",
            ) from exc
        try:
            yield
        finally:
            hf.set_attn_implementation(current)  # type: ignore[operator]

    def _forward(
        self,
        plan: Plan,
        chunk: Chunk,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        past: Any = None,
        use_cache: bool = False,
        last_logits_only: bool = False,
        grad: bool = False,
        adapters: Sequence[str | None] = (),
    ) -> Any:
        """One forward of ``plan`` over ``input_ids``; ``adapters``: each batch row's adapter
        (``None`` or nothing: the base model)."""
        hf = self.hf_model
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(self.device), "use_cache": use_cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if past is not None:
            kwargs[self._cache_arg] = past
        if last_logits_only and self._can_trim_logits:
            kwargs["logits_to_keep"] = 1
        needs_weights = any(a.kind in _NEEDS_EAGER_ATTENTION for a in plan.wanted)
        output = None
        mode = torch.enable_grad() if grad else torch.inference_mode()
        with (
            self._lock,
            mode,
            self._attention_weights(needs_weights),
            self._peft.rows(adapters),
            plan.installed(chunk),
        ):
            output = hf(**kwargs)
        return output

    # -- capture ------------------------------------------------------------------------
    def _check_request(self, request: CheckedRequest) -> None:
        if request.max_tokens and _LOGITS in request.points.values():
            raise UnsupportedAddress(
                "logits are not captured during generation; use stream(n_logprobs=...) or "
                "decode_residuals on a captured final_norm/resid_post",
                address=_LOGITS,
            )

    def _capture_sync(
        self, requests: list[CheckedRequest]
    ) -> tuple[dict[Address, torch.Tensor], dict[Features, FeatureReadout]]:
        request = requests[0]  # the points are every row's; the writes may differ per row
        addresses = request.addresses
        rows = [r.token_ids for r in requests]
        lengths = [len(r) for r in rows]
        ids, mask = pad_rows(rows, self.pad_id)
        hooked = [a for a in addresses if a.kind != "logits"]
        wants_logits = len(hooked) < len(addresses)
        if request.readouts:
            hooked = list(dict.fromkeys(hooked + request.readout_addresses))
        writes, write_rows, saes = batch_writes(requests)
        plan = Plan(
            self.arch,
            hooked,
            writes,
            lengths,
            stop_early=not wants_logits,
            saes=saes,
            write_rows=write_rows,
        )
        padded = min(lengths) < ids.shape[1]
        output = self._forward(
            plan,
            Chunk(len(rows), ids.shape[1], 0),
            ids,
            attention_mask=mask if padded else None,
            adapters=[r.adapter for r in requests],
        )
        values = plan.result()
        if wants_logits:
            values[_LOGITS] = output.logits
        readouts = batch_readouts(request, values, lengths)
        if not padded:
            return {a: to_cpu(values[a]) for a in addresses}, readouts
        return {a: zero_padding(a, to_cpu(values[a]), lengths) for a in addresses}, readouts

    async def capture(
        self,
        token_ids: Sequence[int],
        points: Iterable[Any],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Results:
        """Activations ``[n_tokens, width]`` at ``points`` (head addresses ``[n_tokens, heads,
        d_head]``, attention patterns and scores ``[heads, q, k]``), under ``adapter`` if given."""
        values = await self.capture_batch([token_ids], points, steering_spec=steering_spec, adapter=adapter)
        return Results({a: t[0] for a, t in values.items()})  # a FeatureReadout indexes like a tensor

    async def capture_batch(
        self,
        rows: Sequence[Sequence[int]],
        points: Iterable[Any],
        *,
        steering_spec: RowSpecs = None,
        adapter: RowAdapters = None,
    ) -> Results:
        """One batched forward over prompts of any lengths: ``[batch, n_max, width]`` (head
        addresses ``[batch, n_max, heads, d_head]``), right-padded with zeros (attention scores:
        ``-inf``); each row equals its solo run. ``steering_spec``: one spec for every row, or a
        list of one spec (or ``None``) per row, still one forward; ``adapter`` likewise (PEFT's
        mixed batch: each row's LoRA applies to its own rows only)."""
        requests = self._check_capture_batch(rows, points, steering_spec, adapter)
        values, readouts = await self._run(lambda: self._capture_sync(requests))
        return requests[0].keyed(values, readouts)

    def capture_batch_blocking(
        self,
        rows: Sequence[Sequence[int]],
        points: Iterable[Any],
        *,
        steering_spec: RowSpecs = None,
        adapter: RowAdapters = None,
    ) -> Results:
        """:meth:`capture_batch` without an event loop, checked and run in the calling thread
        when torch's per-thread state there is what a thread of the model's own has (no autocast,
        no torch-function or dispatch mode: :func:`~interp_eager._compat.default_thread_state`),
        else run on the worker thread while the caller waits; one forward at a time either way."""
        requests = self._check_capture_batch(rows, points, steering_spec, adapter)
        if default_thread_state(self.device):
            values, readouts = self._capture_sync(requests)
        else:
            values, readouts = self._call(lambda: self._capture_sync(requests))
        return requests[0].keyed(values, readouts)

    # -- gradients ----------------------------------------------------------------------
    async def capture_gradients(
        self,
        rows: Sequence[Sequence[int]],
        points: Iterable[Any],
        metric: GradientMetric,
        *,
        steering_spec: RowSpecs = None,
        adapter: RowAdapters = None,
    ) -> tuple[Results, Results, float]:
        """One forward with autograd on over prompts of any lengths (right-padded), one backward
        of ``metric(logits, lengths)``: the activations at ``points``, the metric's gradient with
        respect to each (both ``[batch, n_max, width]``, head addresses ``[batch, n_max, heads,
        d_head]``, zero at padded positions) and the metric's value. The gradient at an address is
        taken by adding a zero tensor that requires grad to its value, after any steering writes:
        at every writable kind, and at ``attn_q``/``attn_k`` where the attention function receives
        them (``_plan.check_probe``). The model's parameters gather no ``.grad``."""
        if not callable(metric):
            raise InvalidOption(f"metric must be a callable of the logits, got {type(metric).__name__}")
        points = [points] if isinstance(points, (str, Address, Features)) else list(points)
        _, readouts = self._split_points(points)
        if readouts:
            raise UnsupportedAddress(
                "gradients are taken at addresses, not feature readouts; take them at the SAE's address "
                "and project onto its encoder",
                address=readouts[0],
            )
        requests = self._check_capture_batch(rows, points, steering_spec, adapter)
        for address in requests[0].addresses:
            check_probe(self.arch, address)
        values, grads, value = await self._run(lambda: self._gradients_sync(requests, metric))
        return requests[0].keyed(values), requests[0].keyed(grads), value

    def _gradients_sync(
        self, requests: list[CheckedRequest], metric: GradientMetric
    ) -> tuple[dict[Address, torch.Tensor], dict[Address, torch.Tensor], float]:
        addresses = requests[0].addresses
        rows = [r.token_ids for r in requests]
        lengths = [len(r) for r in rows]
        ids, mask = pad_rows(rows, self.pad_id)
        writes, write_rows, saes = batch_writes(requests)
        plan = Plan(self.arch, addresses, writes, lengths, saes=saes, write_rows=write_rows, probes=addresses)
        padded = not bool(mask.all())
        output = self._forward(
            plan,
            Chunk(len(rows), ids.shape[1], 0),
            ids,
            attention_mask=mask if padded else None,
            grad=True,
            adapters=[r.adapter for r in requests],
        )
        logits = output.logits
        logits = logits if logits.dtype == torch.float64 else logits.float()  # float32, or a float64 model's
        del output
        n_real = torch.tensor(lengths)
        real = torch.arange(logits.shape[1])[None, :] < n_real[:, None]  # [batch, n_max]
        with torch.enable_grad():  # padded positions' logits are zeros: no gradient flows from them
            logits = torch.where(real[..., None].to(logits.device), logits, 0.0)
            value = metric(logits, n_real)
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
                got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise InvalidOption(f"the metric must return a scalar float tensor computed from the logits, got {got}")
            if not value.requires_grad:
                raise InvalidOption("the metric's value does not depend on the logits it was given: no gradient")
            probes = [(a, delta) for a in addresses for delta in plan.probed[a]]
            grads = torch.autograd.grad(value.reshape(()), [d for _, d in probes], allow_unused=True)
        by_address: dict[Address, list[torch.Tensor]] = {a: [] for a in addresses}
        for (address, delta), grad in zip(probes, grads, strict=True):
            by_address[address].append(torch.zeros_like(delta) if grad is None else grad)
        for address, found in by_address.items():
            if not found:  # pragma: no cover - every site of a full forward runs
                raise UnsupportedAddress(f"the forward never reached {address}", address=address)
        del probes, grads, logits
        values = plan.result()
        out_values = {a: zero_padding(a, to_cpu(values[a]), lengths) for a in addresses}
        out_grads = {a: zero_padding(a, to_cpu(torch.cat(g, dim=1)), lengths) for a, g in by_address.items()}
        return out_values, out_grads, float(value.detach())

    # -- generation ---------------------------------------------------------------------
    async def _decode(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingOptions,
        plan_for: Callable[[int], Plan] | None,
        adapter: str | None = None,
    ) -> AsyncIterator[tuple[int, torch.Tensor, Plan]]:
        """Yield ``(token, logits, plan)`` per generated token; after the last, the plan has
        also seen the last token's forward (so activations cover every generated token)."""
        prompt = list(token_ids)
        plan = plan_for(len(prompt)) if plan_for else Plan(self.arch, [], [], [len(prompt)])
        generator = generator_for(sampling, self.device)
        state: dict[str, Any] = {"past": None}
        wants_raw_logits = any(a.kind == "logits_raw" for a in plan.wanted)  # every token's, not the last one's

        def step(ids: list[int], offset: int) -> torch.Tensor:
            inputs = torch.tensor([ids], dtype=torch.long)
            output = self._forward(
                plan,
                Chunk(1, len(ids), offset),
                inputs,
                past=state["past"],
                use_cache=True,
                last_logits_only=not wants_raw_logits,
                adapters=[adapter],
            )
            state["past"] = output.past_key_values
            logits: torch.Tensor = output.logits[0, -1]
            return logits

        ids, offset = prompt, 0
        chosen: list[int] = []
        for index in range(max_tokens):
            logits = await self._run(lambda ids=ids, offset=offset: step(ids, offset))  # type: ignore[misc]
            token = choose(sampling, logits, generator, steered=plan.steered, generated=chosen)
            chosen.append(token)
            last = index == max_tokens - 1 or self._stops(token, sampling)
            if last and plan.wanted:
                after = offset + len(ids)
                await self._run(lambda token=token, after=after: step([token], after))  # type: ignore[misc]
            yield token, logits, plan
            if last:
                return
            offset += len(ids)
            ids = [token]

    # -- the frozen-linear replacement model (attribution graphs) ---------------------------
    def linearize(self, token_ids: Sequence[int], input_kind: str = "mlp_in") -> Any:
        """The frozen-linear replacement model of one prompt (:class:`~interp_eager._linear.FrozenForward`):
        attention patterns and norm scales fixed at their values on ``token_ids``, each MLP's
        output a constant, gradient probes at the embeddings and the MLP outputs. What
        :func:`interp_engine.circuits.attribution_graph` differentiates."""
        from ._linear import FrozenForward

        checked = self._check_capture_batch([token_ids], [Address(input_kind, 0)], None)
        return FrozenForward(self, checked[0].token_ids, input_kind)

    def _plan_for(self, request: CheckedRequest, points: list[Address] | None = None) -> Callable[[int], Plan]:
        wanted = list(dict.fromkeys((request.addresses if points is None else points) + request.readout_addresses))
        lens = request.lens

        def make(n_prompt: int) -> Plan:
            total = n_prompt + request.max_tokens
            rows_at: dict[Address, frozenset[int]] = {}
            if lens is not None:  # the lens's rows only: its prompt positions, then each token-producing one
                keep = frozenset(lens.prompt_positions) | frozenset(range(n_prompt - 1, total - 1))
                rows_at = dict.fromkeys(lens.addresses, keep)
            return Plan(
                self.arch,
                wanted,
                request.writes,
                [n_prompt],
                n_prompt=[n_prompt],
                total=[total],
                saes=request.saes,
                rows_at=rows_at,
            )

        return make

    async def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
        **sampling: Any,
    ) -> Completion:
        """A completion (greedy unless ``temperature``/``top_k``/``top_p``/``seed`` say otherwise),
        under ``adapter`` if given."""
        completion, _ = await self.capture_generation(
            token_ids, [], max_tokens=max_tokens, steering_spec=steering_spec, adapter=adapter, **sampling
        )
        return completion

    async def _capture_generation(self, request: CheckedRequest) -> tuple[Completion, Results]:
        """A completion and activations ``[n_prompt + n_generated, width]`` (head addresses
        ``[n_prompt + n_generated, heads, d_head]``) over prompt and every generated token; with
        ``lens``, a :class:`LensResult` under that request at its prompt positions and every
        position that produced a generated token."""
        plan_for = self._plan_for(request)
        tokens: list[int] = []
        plan: Plan | None = None
        read: list[LensTopK] = []
        n_prompt = len(request.token_ids)
        async for token, _, used in self._decode(
            request.token_ids, request.max_tokens, request.sampling, plan_for, request.adapter
        ):
            if request.lens is not None:
                prompt_lens, step_lens = await self._read_lens(used, request.lens, n_prompt - 1 + len(tokens), n_prompt)
                if prompt_lens is not None:
                    read += [prompt_lens.at(p) for p in prompt_lens.positions if p != step_lens.position]
                read.append(step_lens)
            tokens.append(token)
            plan = used
        values = plan.result() if plan is not None else {}
        n = n_prompt + len(tokens)
        readouts = {spec: r[0] for spec, r in batch_readouts(request, values, [n]).items()}
        acts = request.keyed({a: to_cpu(values[a])[0] for a in request.addresses}, readouts)
        if request.lens is not None and read:
            acts[request.lens.request] = LensResult.stack(read)
        return self._completion(tokens, request.sampling), acts

    async def _stream(self, request: CheckedRequest) -> AsyncGenerator[StreamStep, None]:
        """Generated tokens one by one with their top-``n_logprobs`` ``(token, logprob)`` pairs,
        the ``features`` readouts and the ``lens`` (:class:`LensTopK`) at the position that
        produced each (the first step also carries the lens at the prompt positions asked)."""
        plan_for = self._plan_for(request, [])
        pieces = TextPieces(self.completion_text)
        count = 0
        n_prompt = len(request.token_ids)
        async for token, logits, plan in self._decode(
            request.token_ids, request.max_tokens, request.sampling, plan_for, request.adapter
        ):
            position = n_prompt - 1 + count
            count += 1
            last = count == request.max_tokens or self._stops(token, request.sampling)
            step_features = {}
            if request.readouts:
                rows = {a: row_at(plan.values[a], position) for a in request.readout_addresses}
                step_features = {spec: r[0] for spec, r in request.read_on_host(rows).items()}
            prompt_lens = step_lens = None
            if request.lens is not None:
                prompt_lens, step_lens = await self._read_lens(plan, request.lens, position, n_prompt)
            yield StreamStep(
                token,
                pieces.add(token, last=last),
                top_logprobs(logits, request.n_logprobs),
                position=position,
                features=step_features,
                lens=step_lens,
                prompt_lens=prompt_lens,
            )

    async def _read_lens(
        self, plan: Plan, lens: CheckedLens, position: int, n_prompt: int
    ) -> tuple[LensResult | None, LensTopK]:
        """The lens at ``position`` (the step's) and, on the first step, at the prompt positions
        asked: the rows the plan kept, every layer's in one unembedding (then released)."""
        prompt = lens.prompt_positions if position == n_prompt - 1 else ()
        positions = sorted({position, *prompt})
        ids, probs = await self._run(lambda: self._lens_sync(plan, lens, positions))
        col = positions.index(position)
        step = LensTopK(position, lens.layers, ids[:, col].clone(), probs[:, col].clone())
        if not prompt:
            return None, step
        cols = [positions.index(p) for p in prompt]
        return LensResult(lens.layers, tuple(prompt), ids[:, cols], probs[:, cols]), step

    def _lens_sync(self, plan: Plan, lens: CheckedLens, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids and probabilities ``[n_layers, n_positions, k]`` of the kept rows (popped)."""
        param = next(self.hf_model.parameters())
        rows = torch.stack(
            [torch.stack([plan.rows[address].pop(p)[0] for p in positions]) for address in lens.addresses]
        )
        with self._lock, torch.inference_mode():
            logits = self.arch.unembed_residuals(rows.to(device=param.device, dtype=param.dtype))
            ids, probs = lens_top_k(logits, lens.top_k)
        return ids.cpu(), probs.cpu()

    # -- adapters (PEFT) -----------------------------------------------------------------
    def _load_adapter(self, adapter: Adapter) -> None:
        """Load the adapter's LoRA weights into the model (PEFT), once no forward is running, and
        place every hook on the LoRA layers (their output includes the adapter's part). A
        request in flight keeps the plan it was built with: its rows name no new adapter, and
        a LoRA layer's base rows equal its base layer's."""
        with self._lock:
            self._peft.load(adapter)
            self.arch = Architecture(self.hf_model, self.family)
            self._weight_info = None

    # -- logit lens ---------------------------------------------------------------------
    async def _decode_residuals(self, residuals: torch.Tensor) -> torch.Tensor:
        """The final norm and unembedding of the served weights; on the last layer's
        ``resid_post`` this is the model's own logits."""
        return await self._run(lambda: self._decode_sync(residuals))

    def _decode_sync(self, acts: torch.Tensor) -> torch.Tensor:
        param = next(self.hf_model.parameters())
        with self._lock, torch.inference_mode():
            logits = self.arch.unembed_residuals(acts.to(device=param.device, dtype=param.dtype))
        return to_cpu(logits)

    # -- weights (interp_engine.weights) -------------------------------------------------
    async def weight_info(self) -> WeightInfo:
        """The weight names this model has, its final norm's kind and how its logits compute."""
        if self._weight_info is None:
            self._weight_info = await self._run(lambda: weight_info(self.hf_model, self.arch, self.info))
        return self._weight_info

    async def weight(self, name: str, layer: int | None = None, *, vocab: Sequence[int] | None = None) -> torch.Tensor:
        """A float32 CPU copy of the HF parameter behind weight ``name`` (``interp_engine.WEIGHT_NAMES``)."""
        name, layer, ids = check_weight_request(await self.weight_info(), self.info, name, layer, vocab)
        return await self._run(lambda: read_weight(self.hf_model, self.arch, self.info, name, layer, ids))

    # -- lifecycle ----------------------------------------------------------------------
    async def warmup(self) -> None:
        """Run one tiny forward so the first real request does not pay for kernel set-up."""
        await self.capture([0], [Address("resid_pre", 0)])

    def _close_resources(self) -> None:
        """Release the weights, after a forward in progress (``shutdown()`` waits off the loop)."""
        with self._lock:
            self._hf = None
        self._executor.shutdown(wait=False)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
