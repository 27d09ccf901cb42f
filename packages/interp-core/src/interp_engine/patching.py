"""Activation patching sweeps: one address kind patched cell by cell (layer x position, or x
head) from one run into another, a metric per cell, batched, on every backend.

```python
from interp_engine import load_model, patching

model = load_model("interp:tiny")
result = patching.sweep(
    model,
    clean="The capital of France is",
    corrupt="The capital of Germany is",
    kind="resid_post",
)                        # Labelled: dims ("layer", "position"), logit(" Paris") - logit(" Berlin") per cell
result.plot()            # a heatmap (interp_engine.plot, the ``plots`` extra)
```

By default a sweep *denoises*: the clean run's activation at one cell is ``set`` into the
corrupt run and the metric is read from the patched corrupt run (TransformerLens's
``get_act_patch_*`` convention). ``direction="noise"`` patches the corrupt activation into the
clean run instead. The metric defaults to the logit difference, at the last position, between
the clean run's top token and the corrupt run's top token (pass ``answer=``/``wrong=`` or any
``metric`` taking logits ``[batch, n, vocab]`` to a scalar).

Each batch of cells is one call with one steering spec per row: one forward on the eager
backend, concurrent requests on vLLM (which batches them).
"""

from .analysis._patching import (
    Direction,
    Metric,
    attribution_patch,
    logit_diff,
    sweep,
)

__all__ = ["Direction", "Metric", "attribution_patch", "logit_diff", "sweep"]
