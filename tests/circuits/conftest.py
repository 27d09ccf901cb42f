"""Fixtures of the circuits tests: interp:tiny on eager, random per-layer and cross-layer
transcoders of its shape (``support.circuits``), one graph of each."""

from __future__ import annotations

from typing import Any

import pytest

from interp_engine import load_model, sync_model
from interp_engine.circuits import CrossLayerTranscoder, TranscoderSet, attribution_graph

from ..support.circuits import PROMPT, random_clt, random_plt


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
