"""LoRA adapters per request, and model diffing: a base model and its fine-tunes compared on the
same prompts (:func:`~interp_engine.compare`)."""
