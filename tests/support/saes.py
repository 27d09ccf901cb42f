"""A random TopK SAE over ``interp:tiny``'s residual stream (the server's and the CLI's tests)."""

from __future__ import annotations

import torch

from interp_engine import Sae

D_MODEL, D_SAE, K = 128, 512, 8


def tiny_sae(seed: int = 0, hook: str = "blocks.1.hook_resid_post") -> Sae:
    """A random TopK SAE over a 128-wide residual stream (interp:tiny's d_model)."""
    gen = torch.Generator().manual_seed(seed)
    w_enc = torch.randn(D_MODEL, D_SAE, generator=gen) * 0.1
    w_dec = torch.randn(D_SAE, D_MODEL, generator=gen) * 0.1
    b_enc = torch.randn(D_SAE, generator=gen) * 0.01
    return Sae("topk", w_enc, b_enc, w_dec, torch.zeros(D_MODEL), hook, k=K)
