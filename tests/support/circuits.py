"""Random per-layer and cross-layer transcoders of ``interp:tiny``'s shape, for the circuits tests
(the properties they test hold for any weights)."""

from __future__ import annotations

import torch

from interp_engine import Sae
from interp_engine.circuits import CrossLayerTranscoder, TranscoderSet

PROMPT = "The capital of France is"
D_MODEL, N_LAYERS = 128, 4


def random_plt(
    d_sae: int = 96, *, seed: int = 0, jumprelu: bool = False, kind: str = "mlp_in", skip: bool = False
) -> TranscoderSet:
    g = torch.Generator().manual_seed(seed)
    saes = []
    for layer in range(N_LAYERS):
        W_enc = torch.randn(D_MODEL, d_sae, generator=g) * 0.15
        b_enc = torch.randn(d_sae, generator=g) * 0.2 - 0.3
        W_dec = torch.randn(d_sae, D_MODEL, generator=g) * 0.1
        b_dec = torch.randn(D_MODEL, generator=g) * 0.02
        threshold = torch.rand(d_sae, generator=g) * 0.1 if jumprelu else None
        W_skip = torch.randn(D_MODEL, D_MODEL, generator=g) * 0.05 if skip else None
        arch = ("jumprelu_" if jumprelu else "") + ("skip_transcoder" if skip else "transcoder")
        saes.append(
            Sae(
                arch,
                W_enc,
                b_enc,
                W_dec,
                b_dec,
                f"{kind}.{layer}",
                threshold=threshold,
                W_skip=W_skip,
                hook_name_out=f"mlp_out.{layer}",
            )
        )
    return TranscoderSet(saes)


def random_clt(d_sae: int = 64, *, seed: int = 1, jumprelu: bool = True) -> CrossLayerTranscoder:
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(N_LAYERS, D_MODEL, d_sae, generator=g) * 0.15
    b_enc = torch.randn(N_LAYERS, d_sae, generator=g) * 0.2 - 0.3
    W_dec = [torch.randn(d_sae, N_LAYERS - i, D_MODEL, generator=g) * 0.08 for i in range(N_LAYERS)]
    b_dec = torch.randn(N_LAYERS, D_MODEL, generator=g) * 0.02
    threshold = torch.rand(N_LAYERS, d_sae, generator=g) * 0.1 if jumprelu else None
    return CrossLayerTranscoder(W_enc, b_enc, W_dec, b_dec, threshold, input_kind="resid_mid")
