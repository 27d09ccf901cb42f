"""SAEs and transcoders as batched tensor work inside vLLM's workers: the encoder, reconstruction
error and feature clamp both workers run (:mod:`._math`), the transcoders' (:mod:`._transcoders`),
and their compiled-in modules for vllm-static.

It imports nothing of the front end, the worker or the backends built on them.
"""
