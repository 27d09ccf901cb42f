"""interp-vllm: interp-engine inside vLLM (backends ``vllm`` and ``vllm-static``).

Use it through the core: ``interp_engine.load_model(path, backend="vllm", **engine_args)``, or
``backend="vllm-static", static_points=[...], static_writes=[...]`` for taps compiled into
vLLM's graphs.
Importing this package does not import vLLM; the model-runner patches (all of them in
``interp_vllm._compat``) load in vLLM's own processes through the ``vllm.general_plugins`` entry
point. ``interp_vllm.hooks`` holds the hook primitives both backends' workers build on.

The public surface is ``interp_vllm``, ``interp_vllm.VllmFamily`` and ``interp_vllm.hooks``;
every other module is private (its name starts with ``_``, inside subpackages as at the top),
laid out by subsystem, as vLLM lays out its own:

- ``frontend/`` -- the caller's process: the model facade, the engine and its client, capture
  memory, lens assembly, SAE sync;
- ``worker/`` -- vLLM's workers: the tap manager and its parts inside the model runner;
- ``static/`` -- ``vllm-static``: its front-end side on ``frontend/``, its worker side on
  ``worker/``;
- ``serve/`` -- the ``vllm serve`` endpoint plugin, on ``frontend/``;
- ``model/``, ``sae/`` and ``_transport`` -- what both sides use: the model's structure and site
  table, SAE and transcoder math, the shared-memory transport of captured values;
- ``_wire`` -- the protocol between the front end and the workers (the only module both import
  besides the shared layer and ``_compat``); ``_compat`` -- every use of another project's
  private API; ``_plugin`` and ``_vllm_entry`` -- the ``interp_engine.backends`` and
  ``vllm.general_plugins`` entry points.

``lint-imports`` (the repository's ``[tool.importlinter]``) checks that layering.
"""

from .model._families import VllmFamily

__all__ = ["VllmFamily"]
