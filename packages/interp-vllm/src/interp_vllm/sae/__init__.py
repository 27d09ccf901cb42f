"""SAEs and transcoders as batched tensor work inside vLLM's workers: the encoder, reconstruction
error and feature clamp the dynamic worker runs and vllm-static compiles in (:mod:`._math`), and
a transcoder's clamp read at its input and written at its output (:mod:`._transcoders`).

It imports nothing of the front end, the worker or the backends built on them.
"""
