"""Random per-layer and cross-layer transcoders of ``interp:tiny``'s shape, for the circuits tests
(the properties they test hold for any weights)."""

from __future__ import annotations

from typing import Any

import torch

from interp_engine import Address, Sae
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


def scaled_plt(
    model: Any, *, kind: str = "mlp_in", prefix: str = "tc", seed: int = 0, d_sae: int = 64, jumprelu: bool = False
) -> TranscoderSet:
    """Random transcoders on every layer of ``model`` (an eager model behind its sync facade),
    scaled to its activations on :data:`PROMPT`: pre-activations about N(0, 1) with about a third
    of the features on, decoder rows about a quarter of an MLP output's norm. Named
    ``{prefix}.L`` when attached."""
    info = model.model.info
    ids = model.to_tokens(PROMPT)[0].tolist()
    points = [Address(k, layer) for layer in range(info.n_layers) for k in (kind, "mlp_out")]
    acts = model.capture(ids, points)
    g = torch.Generator().manual_seed(seed)
    saes = []
    for layer in range(info.n_layers):
        x, y = acts[Address(kind, layer)].float(), acts[Address("mlp_out", layer)].float()
        d_in, d_out = x.shape[-1], y.shape[-1]
        saes.append(
            Sae(
                ("jumprelu_" if jumprelu else "") + "transcoder",
                torch.randn(d_in, d_sae, generator=g) / float(x.norm(dim=-1).mean()),
                torch.randn(d_sae, generator=g) * 0.1 - 0.4,
                torch.randn(d_sae, d_out, generator=g) * float(y.norm(dim=-1).mean()) / (4 * d_out**0.5),
                torch.randn(d_out, generator=g) * 0.02,
                f"{kind}.{layer}",
                threshold=torch.rand(d_sae, generator=g) * 0.2 if jumprelu else None,
                hook_name_out=f"mlp_out.{layer}",
            )
        )
    return TranscoderSet(saes, names={layer: f"{prefix}.{layer}" for layer in range(info.n_layers)})
