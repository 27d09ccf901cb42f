"""interp-vllm: interp-engine inside vLLM (backends ``vllm`` and ``vllm-static``).

Use it through the core: ``interp_engine.load_model(path, backend="vllm", **engine_args)``, or
``backend="vllm-static", static_points=[...], static_writes=[...]`` for taps compiled into
vLLM's graphs.
Importing this package does not import vLLM; the model-runner patches (all of them in
``interp_vllm._compat``) load in vLLM's own processes through the ``vllm.general_plugins`` entry
point. ``interp_vllm.hooks`` holds the hook primitives both backends' workers build on.
"""

from ._families import VllmFamily

__all__ = ["VllmFamily"]
