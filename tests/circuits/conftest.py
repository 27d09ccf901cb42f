"""Fixtures of the circuits tests: interp:tiny on eager, random per-layer and cross-layer
transcoders of its shape (the properties tested hold for any weights), one graph of each."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import Sae, load_model, sync_model
from interp_engine.circuits import CrossLayerTranscoder, TranscoderSet, attribution_graph

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


@pytest.fixture(scope="package")
def tiny() -> Any:
    return sync_model(load_model("interp:tiny", backend="eager"))


@pytest.fixture(scope="package")
def plt() -> TranscoderSet:
    return random_plt()


@pytest.fixture(scope="package")
def clt() -> CrossLayerTranscoder:
    return random_clt()


@pytest.fixture(scope="package")
def partial() -> TranscoderSet:
    """JumpReLU transcoders reading ``resid_mid`` on layers 1 and 3 only (0 and 2 keep their MLPs)."""
    full = random_plt(seed=7, jumprelu=True, kind="resid_mid")
    return TranscoderSet([full[1], full[3]])


@pytest.fixture(scope="package")
def partial_graph(tiny: Any, partial: TranscoderSet) -> Any:
    return attribution_graph(tiny, PROMPT, partial, batch_size=16)


@pytest.fixture(scope="package")
def skip() -> TranscoderSet:
    """Skip transcoders (``x @ W_skip.T`` added to the reconstruction) on every layer."""
    return random_plt(seed=9, skip=True)


@pytest.fixture(scope="package")
def skip_graph(tiny: Any, skip: TranscoderSet) -> Any:
    return attribution_graph(tiny, PROMPT, skip, batch_size=16)


@pytest.fixture(scope="package")
def plt_graph(tiny: Any, plt: TranscoderSet) -> Any:
    return attribution_graph(tiny, PROMPT, plt, batch_size=24)


@pytest.fixture(scope="package")
def clt_graph(tiny: Any, clt: CrossLayerTranscoder) -> Any:
    return attribution_graph(tiny, PROMPT, clt, batch_size=24)
