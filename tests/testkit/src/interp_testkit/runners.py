"""Test-only: which of vLLM's model runners an engine the test kit starts runs on.

vLLM picks its runner from ``VLLM_USE_V2_MODEL_RUNNER`` (and, left unset, from whether Triton
works: on this CPU build it does not, so V1). The test suite runs the vLLM backends on both:

- ``"v1"``: ``VLLM_USE_V2_MODEL_RUNNER=0``;
- ``"v2"``: ``VLLM_USE_V2_MODEL_RUNNER=1``, its Triton kernels in Triton's interpreter
  (``TRITON_INTERPRET=1``), and the stand-in Triton CPU backend of :mod:`.v2_harness` put on
  ``PYTHONPATH`` so every process vLLM starts loads it before vLLM (see that module).

:func:`engine_env` is the environment of an engine on a runner; :func:`using` sets it in this
process while an engine starts (vLLM's processes take the environment of the moment they are
started, and its front end reads the variable while the engine is built).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

RUNNERS = ("v1", "v2")

HARNESS = pathlib.Path(__file__).resolve().parent / "v2_harness"
"""The folder whose ``sitecustomize.py`` stands in for a Triton CPU backend."""

RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


def engine_env(runner: str) -> dict[str, str]:
    """The environment variables of an engine on ``runner`` (added to the current environment)."""
    if runner == "v1":
        return {RUNNER_VARIABLE: "0"}
    if runner == "v2":
        path = os.environ.get("PYTHONPATH", "")
        entries = [str(HARNESS), *(p for p in path.split(os.pathsep) if p and p != str(HARNESS))]
        return {
            RUNNER_VARIABLE: "1",
            "TRITON_INTERPRET": "1",
            "INTERP_V2_HARNESS": "1",
            "PYTHONPATH": os.pathsep.join(entries),
        }
    raise ValueError(f"unknown model runner {runner!r}: one of {', '.join(RUNNERS)}")


def is_v2(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether ``environ`` (this process's by default) starts engines on the V2 harness."""
    environ = os.environ if environ is None else environ
    return environ.get("INTERP_V2_HARNESS") == "1"


def current() -> str:
    """The runner an engine started now runs on: what ``VLLM_USE_V2_MODEL_RUNNER`` says, else
    vLLM's own choice on this machine (V1: this CPU build finds no Triton backend)."""
    value = os.environ.get(RUNNER_VARIABLE, "").strip().lower()
    return "v2" if value in ("1", "true") or (not value and is_v2()) else "v1"


def check_engine(model: Any, runner: str) -> None:
    """That a started vLLM model's workers run ``runner`` (the V2 harness falls back to V1
    silently where it does not take)."""
    found = getattr(model, "model_runner", None)
    if found != runner:
        raise AssertionError(f"the engine was started for vLLM's {runner} model runner but its workers run {found}")


TRITON_FLAGS = ("vllm.config.vllm",)
"""Where vLLM's front end reads ``HAS_TRITON`` before it starts an engine: its config's check
that V2 has Triton (only there: modules that decide how to build their kernels by the same flag
keep it, since this process runs no kernel and has no stand-in Triton backend)."""


@contextlib.contextmanager
def _front_end_sees_triton() -> Iterator[None]:
    """vLLM's front end in this process takes Triton for present inside the block. It computed
    ``HAS_TRITON`` when it was first imported, without the stand-in (that runs only in the
    engines' processes, from :data:`HARNESS`); it runs no kernel, it only checks the flag."""
    import importlib

    modules = [importlib.import_module(name) for name in TRITON_FLAGS]
    saved = [getattr(module, "HAS_TRITON") for module in modules]  # noqa: B009
    try:
        for module in modules:
            setattr(module, "HAS_TRITON", True)  # noqa: B010
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            setattr(module, "HAS_TRITON", value)  # noqa: B010


@contextlib.contextmanager
def using(runner: str) -> Iterator[None]:
    """This process's environment is :func:`engine_env` of ``runner`` inside the block, then as
    it was (and for ``"v2"``, vLLM's front end here takes Triton for present)."""
    changes = engine_env(runner)
    if runner == "v1":  # what a V2 block leaves nothing of
        changes = {**changes, "TRITON_INTERPRET": "", "INTERP_V2_HARNESS": ""}
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        with _front_end_sees_triton() if runner == "v2" else contextlib.nullcontext():
            yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


__all__ = ["HARNESS", "RUNNERS", "RUNNER_VARIABLE", "check_engine", "current", "engine_env", "is_v2", "using"]
