"""interp-vllm's patches of other projects' private APIs (``interp_vllm._compat``), against the
installed torch and vLLM: every patched target still has the shape its patch expects, a target
that moved is a typed error naming the versions, and a patch that is no longer needed fails here.

No engine: these read the classes themselves.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

from interp_vllm import _compat
from interp_vllm._compat import IncompatibleDependency, Patch


def test_the_inductor_patch_is_still_needed() -> None:
    """Once the pinned torch re-applies a node's mutation renames when it re-derives its reads
    (pytorch#185873), ``keep_inductor_mutation_order`` is dead weight: remove it and its Patch."""
    assert not _compat.inductor_has_upstream_fix(), (
        f"torch {torch.__version__}'s SchedulerNode._compute_attrs applies mutation_renames itself: "
        "drop _compat.INDUCTOR_MUTATION_ORDER and keep_inductor_mutation_order"
    )


def test_the_inductor_gate_covers_the_installed_torch() -> None:
    """The installed torch lacks the fix (above), so the version gate must apply the patch to it."""
    assert _compat.INDUCTOR_MUTATION_ORDER.in_range(), (
        f"torch {torch.__version__} lacks the upstream fix but is outside {_compat.INDUCTOR_MUTATION_ORDER.spelled}"
    )
    assert _compat.INDUCTOR_MUTATION_ORDER.check() is not None


def test_keep_inductor_mutation_order_wraps_torchs_own_once() -> None:
    from torch._inductor.scheduler import SchedulerNode

    before = SchedulerNode.__dict__["_compute_attrs"]
    try:
        assert _compat.keep_inductor_mutation_order()
        patched = SchedulerNode.__dict__["_compute_attrs"]
        assert _compat.keep_inductor_mutation_order()  # idempotent: not wrapped twice
        assert SchedulerNode.__dict__["_compute_attrs"] is patched
        original = getattr(patched, "__wrapped__", None)
        assert original is not None and "mutation_renames" not in inspect.getsource(original)
        assert not _compat.inductor_has_upstream_fix()  # it looks through our wrapper
    finally:
        SchedulerNode._compute_attrs = before  # type: ignore[method-assign]


def test_the_inductor_patch_renames_the_reads_it_re_derives() -> None:
    """The wrapper re-applies the node's renames after torch's own ``_compute_attrs`` ran (and
    leaves a node without renames as torch left it)."""
    from torch._inductor.scheduler import SchedulerNode

    before = SchedulerNode.__dict__["_compute_attrs"]
    calls: list[Any] = []

    def compute(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append("compute")

    class ReadWrites:
        def __init__(self, renamed: dict[str, str] | None = None) -> None:
            self.renamed = renamed

        def rename(self, renames: dict[str, str]) -> ReadWrites:
            return ReadWrites(renames)

    class Node:
        def __init__(self, renames: dict[str, str]) -> None:
            self.mutation_renames = renames
            self.read_writes = ReadWrites()

        def set_read_writes(self, value: ReadWrites) -> None:
            self.read_writes = value

    try:
        SchedulerNode._compute_attrs = compute  # type: ignore[method-assign]
        assert _compat.keep_inductor_mutation_order()
        renamed, plain = Node({"buf1": "buf0"}), Node({})
        SchedulerNode._compute_attrs(renamed)  # type: ignore[arg-type]
        SchedulerNode._compute_attrs(plain)  # type: ignore[arg-type]
        assert calls == ["compute", "compute"]
        assert renamed.read_writes.renamed == {"buf1": "buf0"}
        assert plain.read_writes.renamed is None
    finally:
        SchedulerNode._compute_attrs = before  # type: ignore[method-assign]


@pytest.mark.parametrize("patch", [*_compat.RUNNER_PATCHES, _compat.WORKER_METHODS], ids=lambda p: p.target)
def test_every_vllm_target_has_the_shape_its_patch_expects(patch: Patch) -> None:
    assert patch.in_range(), f"vllm {_compat._installed('vllm')} is outside {patch.spelled}"
    owner = patch.check()
    assert owner is not None or patch.optional


def test_the_runner_state_the_taps_read_is_set_by_the_v1_runner() -> None:
    """The attributes ``check_runner`` asks of a runner instance are assigned in vLLM's V1 runner
    (read from its source: building one needs a whole engine)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner)
    for name in _compat.RUNNER_STATE:
        assert f"self.{name} =" in source or f"self.{name}:" in source, name


def test_a_moved_target_is_a_typed_error_naming_the_versions() -> None:
    installed = _compat._installed("vllm")
    renamed = dataclasses.replace(_compat.MODEL_FORWARD, parameters=("self", "no_such_argument"))
    with pytest.raises(IncompatibleDependency, match=r"vllm>=0\.32,<0\.34") as caught:
        renamed.check()
    assert installed in str(caught.value) and "no_such_argument" in str(caught.value)
    gone = dataclasses.replace(_compat.MODEL_FORWARD, target="vllm.v1.worker.gpu_model_runner:NoSuchRunner.x")
    with pytest.raises(IncompatibleDependency, match="NoSuchRunner does not exist"):
        gone.check()
    inherited = dataclasses.replace(
        _compat.UPDATE_STATES, target="vllm.v1.worker.cpu_model_runner:CPUModelRunner._update_states"
    )
    with pytest.raises(IncompatibleDependency, match="not defined on the class itself"):
        inherited.check()
    missing_optional = dataclasses.replace(_compat.CPU_LOAD_MODEL, target="vllm.no_such_module:Runner.load_model")
    assert missing_optional.check() is None
    clash = dataclasses.replace(_compat.WORKER_METHODS, target="vllm.v1.worker.worker_base:WorkerBase.load_model")
    with pytest.raises(IncompatibleDependency, match="already exists"):
        clash.check()


def test_patch_runner_patches_nothing_when_a_target_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # an engine started earlier in this process loaded the plugin, which patched the runner
    monkeypatch.delattr(GPUModelRunner, _compat.PATCHED, raising=False)
    before = dict(vars(GPUModelRunner))
    broken = dataclasses.replace(_compat.UPDATE_STATES, parameters=("self", "no_such_argument"))
    monkeypatch.setattr(_compat, "RUNNER_PATCHES", (_compat.MODEL_FORWARD, broken))
    with pytest.raises(IncompatibleDependency):
        _compat.patch_runner(lambda *a: None, lambda *a: None, lambda *a: None)
    assert dict(vars(GPUModelRunner)) == before


def test_versions_compare_by_release() -> None:
    assert _compat.release("2.13.0+cpu") == (2, 13, 0)
    assert _compat.release("0.32.0rc1") == (0, 32, 0)
    patch = _compat.INDUCTOR_MUTATION_ORDER
    assert patch.in_range("2.13.0+cpu") and not patch.in_range("2.14.0")
    assert _compat.MODEL_FORWARD.in_range("0.33.1") and not _compat.MODEL_FORWARD.in_range("0.34.0")


def test_the_engine_pins_the_runner_the_patches_reach() -> None:
    """vLLM 0.33 makes the V2 model runner its default; the patches wrap the V1 runner, which the
    engine's environment defaults select."""
    from interp_vllm.frontend._engine import ENV_DEFAULTS

    assert ENV_DEFAULTS["VLLM_USE_V2_MODEL_RUNNER"] == "0" == _compat.RUNNER_ENV["VLLM_USE_V2_MODEL_RUNNER"]


def test_register_is_idempotent_and_its_targets_keep_their_shape() -> None:
    """vLLM loads the plugin in every process, perhaps more than once: a second ``register()``
    patches nothing twice, and the checks see vLLM's signatures through the wrappers."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    from interp_vllm import _vllm_entry
    from interp_vllm._wire import RPC_NAMES

    _vllm_entry.register()
    forward = GPUModelRunner.__dict__["_model_forward"]
    _vllm_entry.register()
    assert GPUModelRunner.__dict__["_model_forward"] is forward
    assert getattr(GPUModelRunner, _compat.PATCHED)
    for patch in _compat.RUNNER_PATCHES:
        patch.check()
    assert set(_vllm_entry.WORKER_RPCS) == set(RPC_NAMES)
    for name, function in _vllm_entry.WORKER_RPCS.items():
        assert getattr(WorkerBase, name) is function


def test_vllm_processes_skip_the_final_collection_and_write_nothing_after_it() -> None:
    """In a process vLLM started (named like its engine core or workers), ``register()`` arranges
    for the interpreter's final collection to be skipped at exit (it takes seconds over an
    engine's heap): everything written before is flushed, the heap is frozen, and the leak report
    nanobind's extensions print after it never reaches stderr."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import atexit, gc, multiprocessing, sys
        multiprocessing.current_process().name = sys.argv[1]
        # registered first, so it runs last (after the skip, where there is one)
        atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
        from interp_vllm import _vllm_entry
        _vllm_entry.register()
        _vllm_entry.register()
        print("skipping", _vllm_entry._SKIPPING)
        print("before the exit", file=sys.stderr)
        """
    )
    for name, skipping in (("VllmWorker-0", True), ("EngineCore", True), ("MainProcess", False)):
        out = subprocess.run([sys.executable, "-c", script, name], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:2] == [f"skipping {[True] if skipping else []}", f"frozen {skipping}"]
        assert out.stderr.strip().endswith("before the exit"), out.stderr


def test_the_skip_freezes_the_heap_and_closes_stderr() -> None:
    import subprocess
    import sys

    script = (
        "import gc, sys\n"
        "from interp_vllm import _vllm_entry\n"
        "print('out', flush=False)\n"
        "print('err', file=sys.stderr)\n"
        "_vllm_entry._skip_final_collection()\n"
        "print('frozen', gc.get_freeze_count() > 0)\n"
        "print('gone', file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert out.stdout.split() == ["out", "frozen", "True"]
    assert out.stderr.split() == ["err"]
