"""LoRA adapters per request: a PEFT adapter folder read and checked against a model before any
compute. Model diffing over adapters is :func:`interp_engine.compare` (``analysis/_compare.py``)."""
