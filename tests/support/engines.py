"""Models the test folders share: the session's eager model per family, vLLM engines of a test's
own, the pool of shared vLLM engines, and the check that an engine has nothing left behind."""

from __future__ import annotations

import concurrent.futures
import functools
import pathlib
import time
from collections.abc import Callable
from typing import Any

from interp_testkit import runners
from interp_testkit.suite import KV_CACHE_BYTES, VLLM_ENGINE_ARGS, tiny_model_path, vllm_model_path


@functools.cache
def eager_model(family: str) -> Any:
    """The session's eager model for ``family`` (loaded through the core's ``load_model``)."""
    from interp_engine import load_model

    return load_model(tiny_model_path(family), backend="eager")


def assert_no_leaks(facade: Any) -> None:
    """Every request of a vLLM model (behind a sync facade) is finished in the engine and its
    state gone from every worker, within 10 s."""
    engine = facade.model._engine
    deadline = time.monotonic() + 10
    stats: list[dict[str, int]] = []
    while time.monotonic() < deadline:
        stats = facade.worker_stats()
        if engine.get_num_unfinished_requests() == 0 and all(s["live_requests"] == 0 for s in stats):
            return
        time.sleep(0.2)
    raise AssertionError(f"requests left behind: {engine.get_num_unfinished_requests()} unfinished, {stats}")


def started_engine(path: pathlib.Path, backend: str = "vllm", **engine_args: Any) -> Any:
    """A vLLM engine of its own (outside the session's shared ones, with the suite's KV cache
    size unless ``engine_args`` says otherwise), warmed up, behind its sync facade; shut down
    again if it fails to start."""
    from interp_engine import load_model, sync_model

    facade = sync_model(load_model(path, backend=backend, **{"kv_cache_memory_bytes": KV_CACHE_BYTES, **engine_args}))
    try:
        facade.warmup()
    except BaseException:
        facade.shutdown()
        raise
    return facade


Key = tuple[str, str, tuple[tuple[str, Any], ...]]


class EnginePool:
    """Started vLLM engines, one per (model runner, family, engine arguments), each behind its sync
    facade (the facade's loop owns the engine): ``pool.get(family, **engine_args)`` starts it on
    first use, on the runner this process's environment names (``interp_testkit.runners``), and
    checks that vLLM runs that runner.

    ``release(keep)`` shuts down the engines ``keep(runner, engine_args)`` rejects (a folder's
    tensor-parallel engines when it ends, so they hold no memory while the next folder starts its
    own); a later ``get`` starts such an engine again."""

    def __init__(self) -> None:
        self.started: dict[Key, Any] = {}

    def get(self, family: str, **engine_args: Any) -> Any:
        from interp_engine import load_model, sync_model

        args = {"kv_cache_memory_bytes": KV_CACHE_BYTES, **VLLM_ENGINE_ARGS.get(family, {}), **engine_args}
        runner = runners.current()
        key = (runner, family, tuple(sorted(args.items())))
        if key not in self.started:
            facade = sync_model(load_model(vllm_model_path(family), backend="vllm", **args))
            try:
                facade.warmup()
                runners.check_engine(facade.model, runner)
            except BaseException:
                facade.shutdown()
                raise
            self.started[key] = facade
        return self.started[key]

    def release(self, keep: Callable[[str, dict[str, Any]], bool]) -> None:
        gone = [key for key in self.started if not keep(key[0], dict(key[2]))]
        shutdown_all([self.started.pop(key) for key in gone])

    def close(self) -> None:
        shutdown_all(list(self.started.values()))
        self.started.clear()


def shutdown_all(facades: list[Any]) -> None:
    """Shut ``facades`` down side by side: each waits seconds for its engine core to exit."""
    if not facades:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(facades)) as pool:
        for future in [pool.submit(facade.shutdown) for facade in facades]:
            future.result()
