"""Test-only: vLLM's V2 model runner on a CPU without a Triton CPU backend.

Python imports this module at start-up in every process whose ``PYTHONPATH`` names this folder
(:func:`interp_testkit.runners.engine_env` puts it there, for the engines the test kit starts on
the V2 runner). It does nothing unless ``INTERP_V2_HARNESS=1``.

vLLM's CPU build runs the V2 runner (``vllm/v1/worker/cpu/model_runner.py``) only where
``vllm.triton_utils.importing`` finds a Triton backend named ``"cpu"``; the kernels V2 launches
then run in Triton's interpreter (``TRITON_INTERPRET=1``), which executes them on CPU tensors.
This adds a stand-in ``"cpu"`` entry to ``triton.backends.backends`` before that module runs and
takes it out again right after: left in, torch's Inductor would take it for a real Triton driver
and fail to compile anything.

A test harness: the interpreter makes each step slower. On CUDA, V2 is vLLM's default.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

TARGET = "vllm.triton_utils.importing"


def _stand_in() -> Any:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class _InterpreterDriver(DriverBase):  # type: ignore[misc]
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> Any:
            raise RuntimeError("Triton's interpreter stands in for a CPU backend: nothing is compiled")

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            raise RuntimeError("no benchmarker under Triton's interpreter")

    backends["cpu"] = Backend(compiler=BaseBackend, driver=_InterpreterDriver)
    _no_overflow_checks()
    _members_found_once()
    _nested_calls_reuse_the_patch()
    _dtypes_looked_up_once()
    return backends


def _no_overflow_checks() -> None:
    """The interpreter as compiled Triton runs: no integer-overflow checks on ``+ - *``.

    Compiled Triton emits those checks only under ``debug`` (its device asserts are dropped
    otherwise); the interpreter's options turn them on, which adds an int64 cast, two comparisons
    and an assert to every integer operation of every kernel: about a third of a V2 step's time in
    the interpreter, measured here, for checks vLLM's kernels never get on a GPU."""
    import dataclasses

    from triton.runtime import interpreter

    # the one builder every interpreted launch uses, made when that module is imported
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of :data:`TARGET` so the stand-in leaves once that module has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            backends = _stand_in()
            try:
                original(module)
            finally:
                backends.pop("cpu", None)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("INTERP_V2_HARNESS") == "1" and TARGET not in sys.modules:
    sys.meta_path.insert(0, _Finder())


def _members_found_once() -> None:
    """Each interpreted launch patches every builtin of ``triton.language`` and its submodules,
    then restores them; finding those builtins (``inspect.getmembers`` over each module) is a fifth
    of a V2 step here. The modules' builtins do not change between launches: they are found once
    per module and the same patches applied. Left as Triton has it where its interpreter differs."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return
    found: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}

    def _patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        known = found.get(id(pkg))
        if known is None or known[0] is not pkg:
            members = [(n, m) for n, m in inspect.getmembers(pkg) if interpreter.tl.core.is_builtin(m)]
            known = found[id(pkg)] = (pkg, members)
        for name, member in known[1]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


def _nested_calls_reuse_the_patch() -> None:
    """A ``@triton.jit`` function called from inside a kernel patches ``triton.language`` again
    (and never restores it: the launch around it does), with the same interpreted builtins the
    launch already put there. Within a launch whose patch covers the called function's modules,
    the call reuses it: about a sixth of a V2 step here. Left as Triton has it where its
    interpreter differs."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or scope_class is None or executor is None:
        return
    if list(inspect.signature(original).parameters) != ["fn"]:
        return
    lang = (interpreter.tl, interpreter.tl.core)
    # per launch in progress: the modules its own patch covers (None until it has patched)
    launches: list[frozenset[int] | None] = []

    def modules(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang)

    def _patch_lang(fn: Any) -> Any:
        if launches:
            covered = launches[-1]
            if covered is None:  # the launch's own patch, restored by the launch
                launches[-1] = modules(fn)
            elif modules(fn) <= covered:
                return scope_class()  # nothing to restore: the launch's patch stays in place
        return original(fn)

    launch = executor.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__


def _dtypes_looked_up_once() -> None:
    """The interpreter maps a Triton type to its numpy dtype by building a table of 19 entries at
    each of the ~1,000 lookups of a V2 step; the table is the same each time. Left as Triton has
    it where its interpreter differs."""
    import inspect

    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or list(inspect.signature(original).parameters) != ["tt_dtype"]:
        return
    pointer, block = interpreter.tl.pointer_type, interpreter.tl.block_type
    address = np.dtype(np.uint64)
    table: dict[Any, Any] = {}

    def _get_np_dtype(tt_dtype: Any) -> Any:
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return address
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = _get_np_dtype
