"""The front end's calls into vLLM's workers: one typed method per RPC of :mod:`.._wire`.

Each method calls ``collective_rpc`` on the engine (looked up at every call, so a wrapper set on
the engine sees it) and answers one value per worker, in ``collective_rpc``'s order, decoded into
the wire's types. Errors are vLLM's, untranslated: the caller knows what failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _wire as wire
from .._wire import FetchedWire, Ping, WeightsHeld, WorkerStats


class Workers:
    """Every worker of one engine (``AsyncLLM``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def _call(self, name: str, *args: Any) -> list[Any]:
        answers: list[Any] = await self.engine.collective_rpc(name, args=args)
        return answers

    async def ping(self, probe: str | None = None, issuer: str | None = None) -> list[Ping]:
        """Every worker's :class:`Ping`; ``probe``: a file whose visibility each one reports;
        ``issuer``: the front end's secret, which its requests' payloads carry."""
        return [wire.from_wire(Ping, answer) for answer in await self._call(wire.PING, probe, issuer)]

    async def fetch_many(self, rids: Sequence[str]) -> list[list[FetchedWire]]:
        """Per worker, per request in ``rids``: its values (the workers forget them;
        ``Fetched.decode`` makes tensors of them)."""
        answers = await self._call(wire.FETCH_MANY, list(rids))
        return [wire.from_wire(list[FetchedWire], answer) for answer in answers]

    async def drain_many(self, rids: Sequence[str]) -> list[list[FetchedWire]]:
        """Per worker, per streaming request in ``rids``: its readouts and lens so far."""
        answers = await self._call(wire.DRAIN_MANY, list(rids))
        return [wire.from_wire(list[FetchedWire], answer) for answer in answers]

    async def attach(self, key: str, blob: bytes) -> None:
        await self._call(wire.ATTACH, key, blob)

    async def detach(self, key: str) -> None:
        await self._call(wire.DETACH, key)

    async def release(self, rid: str) -> None:
        await self._call(wire.RELEASE, rid)

    async def decode(self, residuals: torch.Tensor) -> list[torch.Tensor | None]:
        """Per worker: the served final norm and logits of ``residuals`` ``[n, d_model]``
        (``None`` from a pipeline stage before the last)."""
        answers = await self._call(wire.DECODE, wire.pack_residuals(residuals))
        return [wire.unpack_logits(answer) for answer in answers]

    async def weight_info(self) -> list[WeightsHeld]:
        return [wire.from_wire(WeightsHeld, answer) for answer in await self._call(wire.WEIGHT_INFO)]

    async def weight(self, name: str, layer: int | None, vocab: list[int] | None) -> list[dict[str, torch.Tensor]]:
        """Per worker: its shard of a checked weight (empty where its stage does not hold it)."""
        return [wire.unpack(answer) for answer in await self._call(wire.WEIGHT, name, layer, vocab)]

    async def stats(self) -> list[WorkerStats]:
        return [wire.from_wire(WorkerStats, answer) for answer in await self._call(wire.STATS)]
