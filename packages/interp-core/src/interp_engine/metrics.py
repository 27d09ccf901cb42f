"""Metrics of a run's logits: the scalar a patching sweep reads per cell, and what
``run_with_gradients`` and attribution patching differentiate.

A metric is any callable from the logits ``[batch, n, vocab]`` (float32) to a scalar tensor. It
may take a second argument: each row's real length (``[batch]``, int64), for batches of prompts of
different lengths, whose shorter rows are right-padded (their logits past the length are zeros
when gradients are taken). The metrics here take it, so ``position=-1`` is each row's own last
token.

```python
from interp_engine import metrics, run_with_gradients

metric = metrics.logit_diff(" Paris", " Rome")          # token ids work too; per-row lists as well
result = run_with_gradients(model, "The capital of France is", ["resid_post.1"], metric)
```
"""

from .analysis._metrics import (
    LogitDiff,
    Metric,
    as_gradient_metric,
    evaluate,
    logit_diff,
    takes_lengths,
    token_id,
)

__all__ = ["LogitDiff", "Metric", "as_gradient_metric", "evaluate", "logit_diff", "takes_lengths", "token_id"]
