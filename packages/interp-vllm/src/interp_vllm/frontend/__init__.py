"""The front end: what runs in the caller's process.

The model facade (:mod:`._model`: ``VllmModel``, the ``vllm`` backend), the engine it starts and
talks to (:mod:`._engine`, :mod:`._client`: the workers' RPCs), the budget of captured values in
flight (:mod:`._capture_memory`), the logit lens and readouts put together from the workers'
chunks (:mod:`._lens_assembly`), attached SAEs kept in step with the workers (:mod:`._sae_sync`),
the weights joined from the workers' shards (:mod:`._weights`), and the guard against a script
that starts an engine without ``if __name__ == "__main__":`` (:mod:`._spawn`).

It talks to the workers only through :mod:`interp_vllm._wire`; it never imports
:mod:`interp_vllm.worker`.
"""
