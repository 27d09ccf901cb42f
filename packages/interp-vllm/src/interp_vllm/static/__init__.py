"""The ``vllm-static`` backend: taps and writes declared before the engine is built and compiled
into vLLM's graphs.

Its front-end side is :mod:`._model` (``StaticVllmModel``, built on the front end's
``VllmModel``); its worker side is :mod:`._worker` (``StaticTapManager``, built on the worker's
``TapManager``: the per-step host work), what it compiles into the graph (:mod:`._compiled`:
``CompiledTaps``), the hooks that traces (:mod:`._hooks`) and the SAEs and
transcoders compiled in (:mod:`._saes`); both sides use the tensor-only
taps and write tables of :mod:`._taps`. The front-end side never imports the worker side, nor
the worker side the front end.
"""
