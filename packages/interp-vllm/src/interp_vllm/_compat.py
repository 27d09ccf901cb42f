"""Every use interp-vllm makes of another project's private API, in one place.

vLLM moves its internals every few releases (0.33 makes the V2 model runner its default), and
Inductor's scheduler is private to torch. What this package patches or reads of them is here,
each :class:`Patch` with the versions it is written for and the shape it expects of its target
(:meth:`Patch.check` raises :class:`IncompatibleDependency`, naming both versions, when the target
moved), so a new vLLM or torch breaks this file with a clear error, not a worker deep inside:

- :data:`INDUCTOR_MUTATION_ORDER` -- torch's ``SchedulerNode._compute_attrs`` (Inductor), replaced
  for torch releases without the upstream fix (:func:`keep_inductor_mutation_order`);
- :data:`MODEL_FORWARD`, :data:`UPDATE_STATES`, :data:`LOAD_MODEL`, :data:`CPU_LOAD_MODEL` --
  vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which the CPU
  runner subclasses), wrapped by :func:`patch_runner`;
- :data:`WORKER_METHODS` -- methods added to vLLM's ``WorkerBase`` for ``collective_rpc``
  (:func:`add_worker_methods`);
- the runner's batch state read each step (:func:`batch_request_ids`, :func:`batch_starts`,
  :func:`request_params`) and the pipeline buffers allocated after load (:func:`pipeline_buffers`);
- :data:`RUNNER_ENV` -- the environment that makes vLLM pick the V1 runner the patches reach
  (the V2 runner, ``vllm/v1/worker/gpu/model_runner.py``, has none of these methods).

``tests/vllm/test_vllm_compat.py`` checks every shape against the installed versions and fails once a
patch is no longer needed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from interp_engine import IncompatibleDependency

logger = logging.getLogger(__name__)

PATCHED = "_interp_engine_patched"
"""Set on ``GPUModelRunner`` once :func:`patch_runner` wrapped it (the workers report it)."""

VLLM_VERSIONS = ((0, 32), (0, 34))
"""The vLLM releases the runner patches are written for: ``>=0.32,<0.34``."""

RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""Where vLLM would pick its V2 model runner, pin the V1 runner the patches wrap."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _spell(bounds: tuple[tuple[int, ...], tuple[int, ...] | None]) -> str:
    low, high = bounds
    text = ">=" + ".".join(map(str, low))
    return text if high is None else text + ",<" + ".".join(map(str, high))


def _installed(package: str) -> str:
    if package == "torch":
        import torch

        return str(torch.__version__)
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@dataclass(frozen=True)
class Patch:
    """One patched (or extended) attribute of another project.

    ``target`` is ``"module:Class.attribute"``; ``versions`` the ``(lowest, first excluded)``
    releases of ``package`` it is written for (``None``: no upper bound known); ``parameters``
    the names the target's signature must have (``None``: the attribute must not exist yet, for
    a method this package adds); ``optional`` where a missing class is not an error (the CPU
    runner on a CUDA build)."""

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
        """Whether ``version`` (the installed one by default) is one the patch is written for."""
        found = release(version or _installed(self.package))
        low, high = self.versions
        return found >= low and (high is None or found < high)

    def owner(self) -> Any:
        """The class holding the target (``None`` for a missing optional one)."""
        module_name, _, path = self.target.partition(":")
        cls_name = path.rpartition(".")[0]
        try:
            module = __import__(module_name, fromlist=[cls_name])
            return getattr(module, cls_name)
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
        attr = self.target.rpartition(".")[2]
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


# -- vLLM's V1 model runner -----------------------------------------------------------------------

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

MODEL_FORWARD = Patch(
    "vllm",
    f"{_RUNNER}._model_forward",
    VLLM_VERSIONS,
    "each forward runs with the taps of the requests in its step, read from its positions",
    parameters=("self", "input_ids", "positions"),
)
UPDATE_STATES = Patch(
    "vllm",
    f"{_RUNNER}._update_states",
    VLLM_VERSIONS,
    "the taps learn which requests vLLM finished or aborted",
    parameters=("self", "scheduler_output"),
)
LOAD_MODEL = Patch(
    "vllm",
    f"{_RUNNER}.load_model",
    VLLM_VERSIONS,
    "vllm-static installs its taps before vLLM compiles the model",
)
CPU_LOAD_MODEL = Patch(
    "vllm",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
    VLLM_VERSIONS,
    "the CPU runner overrides load_model without calling the GPU runner's",
    optional=True,
)
RUNNER_PATCHES = (MODEL_FORWARD, UPDATE_STATES, LOAD_MODEL, CPU_LOAD_MODEL)


def patch_runner(
    forward: Callable[[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
    finished: Callable[[Any, Any], None],
    after_load: Callable[[Any], None],
) -> None:
    """Wrap the V1 runner (idempotent): ``forward(runner, original, args, kwargs)`` runs each
    ``_model_forward``, ``finished(runner, req_ids)`` hears of requests vLLM finished before the
    runner drops them, ``after_load(runner)`` runs right after the model is loaded (GPU and CPU
    runner). Checks every target first: nothing is patched if one moved."""
    runner = MODEL_FORWARD.owner()
    if getattr(runner, PATCHED, False):
        return
    for patch in RUNNER_PATCHES:
        patch.check()
    if not MODEL_FORWARD.in_range():
        logger.warning(
            "interp-engine: the model runner is patched for %s; the installed vllm is %s (its shape matches)",
            MODEL_FORWARD.spelled,
            _installed("vllm"),
        )
    original_forward = runner._model_forward

    @functools.wraps(original_forward)  # the shape checks see vLLM's signature through the wrapper
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, lambda *a, **k: original_forward(self, *a, **k), args, kwargs)

    original_update = runner._update_states

    @functools.wraps(original_update)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        done = getattr(scheduler_output, "finished_req_ids", None)
        if done:
            finished(self, done)
        return original_update(self, scheduler_output)

    runner._model_forward = _model_forward
    runner._update_states = _update_states
    for owner in dict.fromkeys(o for o in (LOAD_MODEL.check(), CPU_LOAD_MODEL.check()) if o is not None):
        _wrap_load_model(owner, after_load)
    setattr(runner, PATCHED, True)


def _wrap_load_model(runner_class: Any, after_load: Callable[[Any], None]) -> None:
    original = runner_class.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after_load(self)
        return result

    runner_class.load_model = load_model


def runner_is_patched(runner: Any) -> bool:
    """Whether this runner's class carries the wrappers of :func:`patch_runner`."""
    return bool(getattr(type(runner), PATCHED, False))


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


# -- the runner's state, read by the taps -------------------------------------------------------

RUNNER_STATE = ("input_batch", "query_start_loc", "requests", "max_num_tokens", "model_config", "vllm_config")
"""The attributes of a V1 runner instance the taps read."""


def check_runner(runner: Any) -> None:
    """That a loaded runner has the state the taps read each step."""
    missing = [name for name in RUNNER_STATE if not hasattr(runner, name)]
    if missing:
        raise MODEL_FORWARD._error(f"{type(runner).__qualname__} has no {', '.join(missing)}")


def batch_request_ids(runner: Any) -> list[str]:
    """vLLM's ids of the requests in this step, in the order of the flattened batch (the order
    changes between steps: never the scheduler's)."""
    batch = runner.input_batch
    return list(batch.req_ids[: int(batch.num_reqs)])


def batch_starts(runner: Any, num_reqs: int) -> list[int]:
    """Each request's first row in the step's flattened batch, and the number of rows."""
    starts: list[int] = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
    return starts


def request_params(runner: Any, req_id: str) -> Any:
    """The ``SamplingParams`` of a live vLLM request (``None`` for an unknown one)."""
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def additional_config(runner: Any) -> dict[str, Any]:
    """The engine's ``additional_config`` (empty if it is not a dict)."""
    extra = getattr(runner.vllm_config, "additional_config", None)
    return extra if isinstance(extra, dict) else {}


def pipeline_buffers(runner: Any) -> None:
    """Allocate the buffers a pipeline stage after the first receives the previous stage's
    hidden states in. vLLM allocates them in its warm-up forward, which its CPU worker skips
    for an uncompiled model (``enforce_eager``): the first step would then fail."""
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


__all__ = [
    "CPU_LOAD_MODEL",
    "INDUCTOR_MUTATION_ORDER",
    "LOAD_MODEL",
    "MODEL_FORWARD",
    "RUNNER_ENV",
    "RUNNER_PATCHES",
    "UPDATE_STATES",
    "WORKER_METHODS",
    "IncompatibleDependency",
    "Patch",
    "add_worker_methods",
    "additional_config",
    "batch_request_ids",
    "batch_starts",
    "check_runner",
    "inductor_has_upstream_fix",
    "keep_inductor_mutation_order",
    "patch_runner",
    "pipeline_buffers",
    "request_params",
    "runner_is_patched",
]


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
