"""The ``vllm.endpoint_plugins`` entry point: interp-engine's routes and per-request steering,
feature readouts and the logit lens inside ``vllm serve`` (loaded only when ``VLLM_PLUGINS``
names ``interp_vllm``). It builds on the front end's model and never imports the worker side.
"""
