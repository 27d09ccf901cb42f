"""The vllm-static engines this folder's modules share, started on first use and shut down when
the folder's last test ends (a compiled engine start is about a minute on 2 cores).

``static_engines[name]``: the llama engine (``static_points=[...]`` at load, 4 steering slots,
chunked prefill over 64-token steps, and the SAEs and transcoders of ``support.static`` compiled
in), qwen2 (``"auto"`` bound by ``configure_static`` before warm-up) and gpt2 (``"auto"`` never
bound: the default set). One engine serves every module whose declaration it covers: the llama
engine's taps are test_vllm_static's, test_vllm_static_sae's and test_vllm_static_circuits'
together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from interp_engine import load_model, sync_model
from interp_testkit import runners
from interp_testkit.suite import KV_CACHE_BYTES, VLLM_ENGINE_ARGS, vllm_model_path

from ..support.engines import shutdown_all
from ..support.static import (
    DENSE_MAX,
    JUMP,
    MID_TC,
    POINTS,
    PROBE,
    RELU,
    SAE_POINTS,
    TOP_K,
    TOPK,
    WRITES,
    saes,
    transcoders,
)


def _llama() -> Any:
    attached = saes()
    model = load_model(
        vllm_model_path("llama"),
        backend="vllm-static",
        static_points=[*POINTS, *(p for p in SAE_POINTS if p not in POINTS)],
        static_writes=WRITES,
        static_write_slots=4,
        static_sae_top_k=TOP_K,
        static_sae_dense_max=DENSE_MAX,
        saes={name: attached[name] for name in (TOPK, RELU, JUMP)},
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        **VLLM_ENGINE_ARGS["llama"],
    )
    model.attach_sae(PROBE, attached[PROBE])  # before the build: compiled in too
    plt, mid = transcoders()
    plt.attach(model)
    model.attach_sae(MID_TC, mid)
    return model


def _qwen2() -> Any:
    model = load_model(
        vllm_model_path("qwen2"), backend="vllm-static", static_points="auto", kv_cache_memory_bytes=KV_CACHE_BYTES
    )
    model.configure_static(POINTS, static_writes=WRITES)
    return model


def _gpt2() -> Any:
    return load_model(vllm_model_path("gpt2"), backend="vllm-static", kv_cache_memory_bytes=KV_CACHE_BYTES)


DECLARED: dict[str, Callable[[], Any]] = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}


class StaticEngines:
    """``engines[name]``: the started engine of :data:`DECLARED` ``name``, behind its sync facade,
    on the model runner ``runner``."""

    def __init__(self, runner: str) -> None:
        self.runner = runner
        self.started: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.started:
            facade = sync_model(DECLARED[name]())
            try:
                facade.warmup()
                runners.check_engine(facade.model, self.runner)
            except BaseException:
                facade.shutdown()
                raise
            self.started[name] = facade
        return self.started[name]

    def values(self) -> list[Any]:
        """Every declared engine, started (the ones not yet started start now)."""
        return [self[name] for name in DECLARED]


@pytest.fixture(scope="package")
def static_engines(vllm_runner: str) -> Iterator[StaticEngines]:
    """The folder's engines on the session's runner (shut down when the folder ends, or when the
    session moves to the other runner)."""
    engines = StaticEngines(vllm_runner)
    yield engines
    shutdown_all(list(engines.started.values()))


@pytest.fixture(autouse=True)
def _on_each_runner(vllm_runner: str) -> str:
    """Every test of this folder runs on each model runner the session runs (``vllm_runner``)."""
    return vllm_runner
