"""vLLM's Ray executor on vLLM's CPU build, for the tests only (a ``vllm.platform_plugins`` entry point).

vLLM's CPU platform does not take part in Ray placement: its ``ray_device_key`` is empty, so
``distributed_executor_backend="ray"`` fails with "current platform cpu does not support ray"
(vllm-project/vllm#21602). A real multi-node deployment runs vLLM's CUDA build, whose platform
places one worker per ``GPU`` in a Ray placement group. To run that same executor on a machine
without GPUs, the tests start a local Ray cluster on loopback that declares logical GPUs
(``ray start --num-gpus N``: Ray only counts them) and set :data:`ENV` in the environment of the
cluster and the engine; this plugin then activates a CPU platform that places its workers on
those logical GPUs, as the CUDA platform does. Without :data:`ENV` it activates nothing, so
vLLM picks its own platform everywhere else.

Platform plugins are resolved in every vLLM process before it first uses the platform, the Ray
worker actors included (which call the platform before vLLM's general plugins load in them).
"""

from __future__ import annotations

import os

ENV = "INTERP_TESTKIT_RAY_CPU"
"""Set to ``1`` to activate the platform (in the Ray cluster's environment and the engine's)."""


def platform() -> str | None:
    """The entry point: the platform's qualified name when :data:`ENV` is set, else ``None``."""
    if os.environ.get(ENV) != "1":
        return None
    return "interp_testkit._ray_cpu_platform.RayCpuPlatform"
