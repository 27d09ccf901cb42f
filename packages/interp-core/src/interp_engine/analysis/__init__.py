"""Analysis workflows over any backend: patching sweeps, attribution patching, gradients,
metrics, direct logit attribution and weights. The public faces are :mod:`interp_engine.patching`,
:mod:`interp_engine.metrics` and the names exported by :mod:`interp_engine`."""
