"""SAEs in the ``vllm`` backend's workers, kept in step with the front end's attachments.

Each attachment is sent to the workers once (``interp_attach``), under a key of its own
(``"name#n"``), before the first request that names it; a request carries its names' keys, so a
name re-attached to another SAE never changes what a request already sent (perhaps still queued
in vLLM) reads. A key whose SAE is no longer attached is dropped from the workers once no request
in flight uses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from typing import Any

from interp_engine import (
    BackendError,
    CheckedRequest,
    InvalidFeatures,
    Sae,
)

from ..model._sites import SITES
from ._client import Workers
from ._engine import EngineClient


class SaeSync(EngineClient):
    """An engine client that keeps the workers' SAEs in step with the attached ones."""

    def __init__(self, name_or_path: str, options: dict[str, Any]) -> None:
        super().__init__(name_or_path, options)
        # the SAEs the workers hold, by key: each attachment is sent once, under a key of its own
        # ("name#n"), before the first request that names it; a request carries its names' keys
        self._worker_saes: dict[str, tuple[str, Sae]] = {}
        self._sae_serial = itertools.count()
        # how many requests in flight use each key: a key whose SAE is no longer attached is
        # dropped from the workers once none does
        self._key_users: collections.Counter[str] = collections.Counter()
        self._sae_lock: asyncio.Lock | None = None

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
                    await Workers(engine).attach(key, sae.to_bytes())
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
                    await Workers(engine).detach(key)

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
