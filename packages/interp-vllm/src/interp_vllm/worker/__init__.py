"""The worker side: what runs inside vLLM's model runner, in vLLM's worker processes.

:class:`~._manager.TapManager` (:mod:`._manager`) runs each step's taps; it is composed of one
shared state, the model and the requests' states (:mod:`._state`), and parts over it: the hooks
(:mod:`._hooks`), captured rows (:mod:`._capture`), SAEs and transcoders (:mod:`._saes`), what
is computed from vLLM's values (:mod:`._recompute`), the logit lens (:mod:`._lens`) and what
leaves the worker (:mod:`._fetch`). A request's taps and its rows in a step are
:mod:`._request_taps`; the weights a worker sends are read in :mod:`._weights`; the runner seam
is :mod:`._runner` (:mod:`._runner_v1`, :mod:`._runner_v2`, :mod:`._seam`); per-request taps
inside breakable CUDA graphs are :mod:`._islands`.

It talks to the front end only through :mod:`interp_vllm._wire`; it never imports
:mod:`interp_vllm.frontend`. The ``vllm.general_plugins`` entry point that installs it is
:mod:`interp_vllm._vllm_entry`.
"""
