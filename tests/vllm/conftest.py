"""Fixtures of the vllm backend's tests: the session's shared engines with the readout SAEs
attached, and the TP=1/TP=2 llama pair. The session's tensor-parallel engines are shut down when
this folder ends (two workers each: they would hold that memory while later folders start their
own engines); the single-worker ones stay for the folders that compare against them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ..support.engines import EnginePool
from ..support.readouts import PREFIX, attach_all, eager_twin, saes_for


@pytest.fixture(scope="package", autouse=True)
def _release_tensor_parallel_engines(engine_pool: EnginePool) -> Iterator[None]:
    yield
    engine_pool.release(keep=lambda runner, args: args.get("tensor_parallel_size", 1) == 1)


@pytest.fixture(autouse=True)
def _on_each_runner(vllm_runner: str) -> str:
    """Every test of this folder runs on each model runner the session runs (``vllm_runner``)."""
    return vllm_runner


@pytest.fixture(scope="module")
def attached(vllm_engines: Any) -> Iterator[Any]:
    """``get(family, **engine_args)``: the shared engine with the readout SAEs (``support.readouts``)
    attached (and the eager twin too); detached again when the module ends."""
    used: list[Any] = []

    def get(family: str, **engine_args: Any) -> Any:
        facade = vllm_engines(family, **engine_args)
        saes = saes_for(family)
        attach_all(facade, saes)
        attach_all(eager_twin(family), saes)
        used.append(facade)
        return facade

    yield get
    for facade in {id(f): f for f in used}.values():
        for name in list(facade.saes):
            if name.startswith(PREFIX):
                facade.detach_sae(name)


@pytest.fixture(scope="module")
def tp(vllm_engines: Any) -> tuple[Any, Any]:
    """The session's TP=1 and TP=2 llama engines (never shut down here)."""
    one = vllm_engines("llama")
    two = vllm_engines("llama", tensor_parallel_size=2)
    assert one.model.tp_size == 1
    assert two.model.tp_size == 2, "the engine did not start two tensor-parallel workers"
    return one, two
