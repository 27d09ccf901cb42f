"""Harvest replicas on a Ray cluster (``harvest(..., replicas=N)``): ``N`` actors, each loading
the model itself (any backend; a vLLM replica may itself be tensor- or pipeline-parallel within
the resources it is given), and each harvesting the shards the driver sends it: shard ``k``
goes to replica ``k mod N``. A replica writes its shards into the shared output folder
(atomically, as a one-process harvest does) and returns each one's manifest entry and top
contexts; the driver (:func:`interp_engine.harvest.harvest`) reads and packs the corpus, merges
the manifest and the top contexts in shard order, and resumes where any replica stopped.

``ray`` is imported here only, when a harvest asks for replicas.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import InvalidOption
from .._plugins import load_model
from .._sync import sync_model
from ._manifest import model_identity
from ._work import ShardJob, make_plan, run_job

IN_FLIGHT = 2
"""Shards sent to one replica and not yet done: one running, one waiting (the driver holds only
their token ids)."""


class Replica:
    """One harvest replica (a Ray actor): the model loaded in the actor's process."""

    def __init__(self, index: int, model: str, backend: str | None, options: Mapping[str, Any]) -> None:
        self.index = index
        self.facade: Any = None
        self.failed: BaseException | None = None
        try:
            self.facade = sync_model(load_model(model, backend=backend, **options))
        except Exception as exc:  # raised by prepare: a method's error reaches the driver as itself
            self.failed = exc

    def prepare(self, addresses: list[Any], saes: Any, top_k: int, dtype: str) -> dict[str, Any]:
        """Attach the SAEs and probe the addresses; what the driver needs of the model."""
        if self.failed is not None:
            raise self.failed
        plan = make_plan(self.facade, addresses, saes, top_k, dtype)
        inner = self.facade.model
        tok = getattr(inner, "tok", None)
        return {
            "plan": plan,
            "n_ctx": inner.info.n_ctx,
            "tokenizer": getattr(tok, "tokenizer", None) if tok is not None else None,
            "identity": model_identity(inner),
            "backend": inner.backend,
            "node": os.uname().nodename,
        }

    def run(self, job: ShardJob) -> dict[str, Any]:
        return run_job(self.facade, job, replica=self.index)

    def str_tokens(self, ids: list[int]) -> list[str]:
        return [self.facade.model.to_str_tokens([t])[0] for t in ids]

    def shutdown(self) -> None:
        if self.facade is not None:
            self.facade.shutdown()


class RayReplicas:
    """``n`` :class:`Replica` actors on the Ray cluster at ``address`` (``None``: ``RAY_ADDRESS``,
    else the cluster this process already joined, else a new local one, shut down by
    :meth:`close`), each with ``resources`` (Ray's actor options: ``num_cpus``, ``num_gpus``,
    ``resources``, ...)."""

    def __init__(
        self,
        n: int,
        model: str,
        backend: str | None,
        options: Mapping[str, Any],
        *,
        address: str | None,
        resources: Mapping[str, Any],
    ) -> None:
        try:
            import ray
        except ModuleNotFoundError:
            raise InvalidOption(
                "replicas= runs the harvest on a Ray cluster and ray is not installed: pip install 'interp-core[ray]'"
            ) from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            local = address is None and not os.environ.get("RAY_ADDRESS")
            extra: dict[str, Any] = {"include_dashboard": False} if local else {}
            ray.init(address=address, log_to_driver=False, **extra)
            self._started = True
        try:
            actor = ray.remote(Replica).options(**{"num_cpus": 1, **resources})
        except (TypeError, ValueError) as exc:
            self.close()
            raise InvalidOption(f"replica_resources are Ray actor options (num_cpus=, num_gpus=, ...): {exc}") from None
        self.actors: list[Any] = [actor.remote(i, model, backend, dict(options)) for i in range(n)]
        self.in_flight: dict[Any, int] = {}
        self.tokens = [0] * n

    def _get(self, refs: Any) -> Any:
        """``ray.get``, the replica's own exception raised as itself (a typed error stays typed)."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    def prepare(self, addresses: Iterable[Any], saes: Any, top_k: int, dtype: str) -> dict[str, Any]:
        """Every replica loads the model and attaches the SAEs (in parallel); replica 0's answer."""
        listed = list(addresses)
        answers = self._get([a.prepare.remote(listed, saes, top_k, dtype) for a in self.actors])
        first: dict[str, Any] = answers[0]
        return first

    def submit(self, job: ShardJob) -> list[dict[str, Any]]:
        """Send ``job`` to replica ``index mod n``, first waiting while that replica has
        :data:`IN_FLIGHT` shards; the entries of the shards done meanwhile."""
        replica = job.index % len(self.actors)
        done: list[dict[str, Any]] = []
        while sum(1 for r in self.in_flight.values() if r == replica) >= IN_FLIGHT:
            done += self._wait()
        self.in_flight[self.actors[replica].run.remote(job)] = replica
        return done

    def _wait(self) -> list[dict[str, Any]]:
        ready, _ = self._ray.wait(list(self.in_flight), num_returns=1)
        out = []
        for ref in ready:
            replica = self.in_flight.pop(ref)
            entry: dict[str, Any] = self._get(ref)
            self.tokens[replica] += entry["tokens"]
            out.append(entry)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The entries of every shard still running, as they finish."""
        done: list[dict[str, Any]] = []
        while self.in_flight:
            done += self._wait()
        return done

    def str_tokens(self, ids: list[int]) -> list[str]:
        out: list[str] = self._get(self.actors[0].str_tokens.remote(ids))
        return out

    def close(self) -> None:
        """Shut the replicas' models down and end the actors (and the local cluster this started)."""
        ray = self._ray
        for ref in getattr(self, "in_flight", {}):  # an error or an interrupt: the shards queued are not run
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        try:
            for actor in getattr(self, "actors", []):
                with contextlib.suppress(Exception):  # an actor that failed to start or died: ended below
                    ray.get(actor.shutdown.remote(), timeout=120)
                ray.kill(actor)
        finally:
            if self._started:
                ray.shutdown()
