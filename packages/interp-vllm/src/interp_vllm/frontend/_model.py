"""The vllm backend's model: what a request carries to vLLM's workers and what comes back.

:class:`VllmModel` is the engine client (:mod:`._engine`) with the workers' SAEs kept in step
(:mod:`._sae_sync`). It validates each request, sends its points and steering spec to the workers
as plain data in ``SamplingParams.extra_args`` (:class:`~.._wire.RequestPayload`), lets vLLM
schedule and batch it with everything else in flight, and afterwards fetches what the workers
captured for it (:class:`~._client.Workers`), joined over tensor-parallel ranks and pipeline
stages; streams drain their readouts and lens step by step (:mod:`._lens_assembly`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Awaitable, Iterable, Mapping, Sequence
from typing import Any

import torch

from interp_engine import (
    Address,
    BackendError,
    CheckedRequest,
    Completion,
    FeatureReadout,
    Features,
    FeatureWrite,
    InvalidFeatures,
    InvalidSteering,
    ModelClosed,
    Results,
    SamplingOptions,
    SteeringSpec,
    StreamStep,
    UnsupportedOperation,
    Write,
)
from interp_engine.backend import LensResult, LensTopK, TextPieces

from .._transport import Region
from .._wire import Fetched, FetchedWire, LensChunk, RequestPayload
from ..model._sites import SITES, merge_ranks
from ._client import Workers
from ._engine import is_engine_dead
from ._lens_assembly import keyed, lens_at_prompt, lens_of, lens_result, readouts_of, with_lens
from ._sae_sync import SaeSync


class VllmModel(SaeSync):
    """A model served by vLLM with interp-engine taps in its model runner.

    The engine is built on the first ``warmup()`` or request, on the running event loop, and
    belongs to that loop: awaiting the model from another loop raises ``ForeignEventLoop``.
    """

    transcoder_clamps = True
    """A transcoder's feature clamps are served: the worker keeps the clamped requests' rows at the
    transcoder's input address and writes the change at its output address in the same step."""

    def _check_request(self, request: CheckedRequest) -> None:
        self._check_tp_saes(request)
        self._check_lens_stages(request)
        self._check_transcoder_clamps(request)

    def _check_transcoder_clamps(self, request: CheckedRequest) -> None:
        """A transcoder clamp reads the feature at the transcoder's input and writes at its output
        in one forward: the input must come first (and, under pipeline parallelism, live on the
        same stage as the output)."""
        order = {kind: i for i, kind in enumerate(SITES)}
        for write in request.writes:
            if not isinstance(write, FeatureWrite) or write.address is None:
                continue
            sae = request.saes[write.sae]
            if not sae.is_transcoder:
                continue
            source = sae.address.resolve(self.info.n_layers)
            out = write.address
            if (source.layer or 0, order[source.kind]) >= (out.layer or 0, order[out.kind]):
                raise InvalidFeatures(
                    f"a {write.op} of transcoder {write.sae!r} reads the feature at {source} and writes at {out}, "
                    f"but the forward computes {out} first; a transcoder clamp needs its input address before its "
                    "output address (mlp_in.L or resid_mid.L -> mlp_out.L)"
                )
            if len(self._stages) > 1 and not any(
                source.layer in layers and out.layer in layers for layers, _ in self._stages
            ):
                raise InvalidFeatures(
                    f"a {write.op} of transcoder {write.sae!r} reads {source} and writes {out}, which live on "
                    f"different pipeline stages (pipeline_parallel_size={self.pp_size}); a transcoder clamp is "
                    "served where both are on one stage (a transcoder of one layer's MLP), or under "
                    "tensor_parallel_size instead"
                )

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
        regions: Mapping[Address, Region] | None = None,
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
        points = tuple(points)
        return RequestPayload(
            rid,
            points,
            tuple(writes),
            n_prompt,
            n_total,
            readouts=tuple(readouts),
            stream=stream,
            buffers=dict(regions or {}),
            issuer=self._issuer,
        )

    async def _decoded(self, answers: Awaitable[list[FetchedWire]], what: str) -> list[Fetched]:
        """Every rank's answer for one request, decoded, each rank's own error raised: a closed
        model, a dead engine or a failed fetch as the typed error that says so."""
        try:
            every = [Fetched.decode(answer) for answer in await answers]
        except Exception as exc:
            if self._closed:
                raise ModelClosed("the model was shut down while this call was in flight") from exc
            if is_engine_dead(exc):
                raise self._engine_died(f"{type(exc).__name__}: {exc}") from exc
            raise BackendError(f"the workers could not return this request's {what}: {exc}") from exc
        for rank in every:
            rank.raise_error()
        return every

    async def _fetch(
        self,
        engine: Any,
        rid: str,
        points: Iterable[Address],
        n: int,
        readouts: Iterable[Features] = (),
        regions: Mapping[Address, Region] | None = None,
    ) -> tuple[dict[Address, torch.Tensor], dict[Features, FeatureReadout], LensChunk | None]:
        """The request's values at ``points`` over its first ``n`` positions (out of its slab
        regions, or as the workers returned them), its readouts, and its logit lens as the
        workers computed it (``None``: it read none)."""
        every = await self._decoded(self._fetch_blobs(engine, rid), "values")
        values: dict[Address, torch.Tensor] = {}
        for address in points:
            ranks = [every[i] for i in self._owners(address)]  # the stage that computes it, by TP rank
            region = (regions or {}).get(address)
            if region is not None and all(address not in rank.values for rank in ranks):
                values[address] = self._from_slab(address, region, ranks, n)
                continue
            if any(address not in rank.values for rank in ranks):
                raise BackendError(
                    f"the taps for {address} did not fire for this request (is the interp-vllm "
                    "plugin active in every worker?)"
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
        computed = readouts_of(every)
        for spec in readouts:
            if spec not in computed:
                raise BackendError(f"the readout {spec} did not fire for this request")
            positions, readout = computed[spec]
            if positions.shape[0] < n or not torch.equal(positions[:n], torch.arange(n)):
                raise BackendError(f"the readout {spec} saw {positions.shape[0]} of the {n} positions of this request")
            found[spec] = readout[:n]
        return values, found, lens_of(every)

    def _from_slab(self, address: Address, region: Region, ranks: list[Fetched], n: int) -> torch.Tensor:
        """``address``'s first ``n`` positions, copied out of its slab region: every rank that
        writes it (each its heads or columns; a replicated value, rank 0) wrote them all."""
        writers = ranks if SITES[address.kind].shard is not None else ranks[:1]
        seen = min((rank.written.get(address, 0) for rank in writers), default=0)
        if any(address not in rank.written for rank in writers):
            raise BackendError(
                f"the taps for {address} did not fire for this request (is the interp-vllm "
                "plugin active in every worker?)"
            )
        if seen < n:
            raise BackendError(f"the taps for {address} saw {seen} of the {n} positions of this request")
        slab = self.capture_memory.slab
        if slab is None:  # pragma: no cover - regions come from the slab
            raise BackendError("a slab region without a slab")
        return slab.read(region, n)

    async def capture(
        self,
        token_ids: Sequence[int],
        points: Iterable[Any],
        *,
        steering_spec: SteeringSpec | None = None,
        adapter: str | None = None,
    ) -> Results:
        """Activations ``[n_tokens, width]`` (attention ``[heads, q, k]``, computed from the
        post-rotary queries and keys vLLM's kernels receive) over the prompt, under ``adapter``
        (vLLM's LoRA) if given."""
        request = self._check_capture(token_ids, points, steering_spec, adapter)
        ids, writes, resolved = request.token_ids, request.writes, request.addresses
        engine = await self._ready()
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        try:
            rid = f"interp-{uuid.uuid4().hex}"
            fetched = False
            async with self.capture_memory.reserved(resolved, len(ids), self.info) as regions:
                payload = self._payload(rid, resolved, writes, len(ids), len(ids), request.readouts, regions=regions)
                params = self._sampling(1, SamplingOptions(), extra_args=keyed(payload, keys).extra_args())
                try:
                    async for _ in self._outputs(engine, ids, params, rid, rid, request.adapter):
                        pass
                    values, readouts, _ = await self._fetch(engine, rid, resolved, len(ids), request.readouts, regions)
                    fetched = True
                finally:
                    if not fetched:
                        await self._release(engine, rid)
        finally:
            await self._unuse_saes(engine, keys)
        return request.keyed(values, readouts)

    async def _capture_generation(self, request: CheckedRequest) -> tuple[Completion, Results]:
        """A completion and activations ``[n_prompt + n_generated, width]`` (with ``lens``, a
        :class:`LensResult` under the request, computed in the workers).

        vLLM never runs the forward of the last token it samples, so the request asks for one
        token more than it returns and is aborted as soon as that token exists."""
        engine = await self._ready()
        self._check_lens_stages(request)
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        try:
            return await self._run_capture_generation(engine, request, keys)
        finally:
            await self._unuse_saes(engine, keys)

    async def _run_capture_generation(
        self, engine: Any, request: CheckedRequest, keys: dict[str, str]
    ) -> tuple[Completion, Results]:
        ids, writes, resolved, max_tokens = request.token_ids, request.writes, request.addresses, request.max_tokens
        rid = f"interp-{uuid.uuid4().hex}"
        n = len(ids)
        captures = bool(resolved or request.readouts or request.lens)
        limit = min(max_tokens + 1, self.info.n_ctx + 1 - n)
        from vllm.sampling_params import RequestOutputKind

        async with self.capture_memory.reserved(resolved, n + max_tokens + 1, self.info) as regions:
            payload = self._payload(rid, resolved, writes, n, n + max_tokens + 1, request.readouts, regions=regions)
            params = self._sampling(
                limit,
                dataclasses.replace(request.sampling, ignore_eos=True),  # the stop is found here
                extra_args=keyed(with_lens(payload, request.lens), keys).extra_args(),
                output_kind=RequestOutputKind.DELTA,
            )
            tokens, keep, values, readouts, lens = await self._generate_and_fetch(
                engine, request, rid, params, captures, max_tokens, regions
            )
        results = request.keyed(values, readouts)
        if request.lens is not None:
            results[request.lens.request] = lens_result(request.lens, lens, n, keep)
        return self._completion(tokens[:keep], request.sampling), results

    async def _generate_and_fetch(
        self,
        engine: Any,
        request: CheckedRequest,
        rid: str,
        params: Any,
        captures: bool,
        max_tokens: int,
        regions: Mapping[Address, Region],
    ) -> tuple[list[int], int, dict[Address, torch.Tensor], dict[Features, FeatureReadout], LensChunk | None]:
        """Run a capturing generation to its stop, then fetch what it captured."""
        ids, resolved, n = request.token_ids, request.addresses, len(request.token_ids)
        tokens: list[int] = []
        keep = max_tokens
        fetched = False
        try:
            async for output in self._outputs(engine, ids, params, rid, rid, request.adapter):
                tokens.extend(output.outputs[0].token_ids)
                keep = self._stop_index(tokens, max_tokens, request.sampling)
                if len(tokens) > keep or output.finished:
                    break
            keep = min(keep, len(tokens))
            values, readouts, lens = (
                await self._fetch(engine, rid, resolved, n + keep, request.readouts, regions)
                if captures
                else ({}, {}, None)
            )
            fetched = True
        finally:
            if not captures:
                await self._done(engine, rid)
            elif not fetched:
                await self._release(engine, rid)
        return tokens, keep, values, readouts, lens

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
        request = self._check_generation(
            token_ids, [], max_tokens=max_tokens, steering_spec=steering_spec, sampling=sampling, adapter=adapter
        )
        kept = [step.token_id async for step in self._stream(request, whole=True)]
        return self._completion(kept, request.sampling)

    async def _collect_steps(self, request: CheckedRequest) -> list[StreamStep]:
        """:meth:`_stream`'s steps from one answer of vLLM's at the end of the generation, and
        one fetch of the readouts and the lens from the workers."""
        return [step async for step in self._stream(request, whole=True)]

    async def _stream(self, request: CheckedRequest, whole: bool = False) -> AsyncGenerator[StreamStep, None]:
        """Generated tokens one by one, with the top-``n_logprobs`` pairs from vLLM's sampler, the
        ``features`` readouts and the ``lens`` at the position that produced each (computed in the
        workers, drained step by step: only the readouts and the lens's top-k leave them).
        ``whole``: vLLM answers once, when the generation ends (its ``FINAL_ONLY`` outputs), and
        the readouts and the lens are drained once then."""
        engine = await self._ready()
        self._check_lens_stages(request)
        await self._sync_saes(engine, request)
        keys = self._use_saes(request)
        steps = self._stream_steps(engine, request, keys, whole)
        try:
            async for step in steps:
                yield step
        finally:
            try:
                await steps.aclose()  # a caller that stops early: abort and release the request now
            finally:
                await self._unuse_saes(engine, keys)

    async def _stream_steps(
        self, engine: Any, request: CheckedRequest, keys: dict[str, str], whole: bool = False
    ) -> AsyncGenerator[StreamStep, None]:
        ids, writes, max_tokens, n_logprobs = request.token_ids, request.writes, request.max_tokens, request.n_logprobs
        readouts, lens = request.readouts, request.lens
        drains = bool(readouts or lens)
        from vllm.sampling_params import RequestOutputKind

        rid = f"interp-{uuid.uuid4().hex}"
        extra: dict[str, Any] = {"output_kind": RequestOutputKind.FINAL_ONLY if whole else RequestOutputKind.DELTA}
        if n_logprobs:
            extra["logprobs"] = n_logprobs
        if writes or drains:
            payload = self._payload(rid, [], writes, len(ids), len(ids) + max_tokens, readouts, stream=True)
            extra["extra_args"] = keyed(with_lens(payload, lens), keys).extra_args()
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
            async for output in self._outputs(engine, ids, params, rid, salt, request.adapter):
                choice = output.outputs[0]
                if drains and choice.token_ids:
                    await self._drain(engine, rid, pending, lens_pending)
                if lens is not None and lens.prompt_positions and choice.token_ids and position == len(ids) - 1:
                    prompt_lens = lens_at_prompt(lens, lens_pending, len(ids))
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
        future: asyncio.Future[list[FetchedWire]] = asyncio.get_running_loop().create_future()
        self._drain_queue.append((rid, future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.ensure_future(self._batches(Workers(engine).drain_many, self._drain_queue))
        every = await self._decoded(future, "readouts")
        for spec, (positions, readout) in readouts_of(every).items():
            for row, p in enumerate(positions.tolist()):
                pending.setdefault(int(p), {})[spec] = readout[row]
        lens = lens_of(every)
        if lens is not None:
            positions, ids, probs = lens
            for row, p in enumerate(positions.tolist()):
                lens_pending[int(p)] = (ids[row], probs[row])
