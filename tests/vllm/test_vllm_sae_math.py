"""The workers' SAE arithmetic without an engine: a feature clamp that computes only what the
clamped features need (``SaeMath.clamp_rows``) equals the clamp of a whole encode and the core's
``FeatureWrite``, for every architecture, normalisation and rescaling the workers serve."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import FeatureWrite, Sae
from interp_vllm.sae import _math as sae_math
from interp_vllm.sae._math import SaeMath

D_IN, D_SAE, ROWS = 48, 192, 300

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "standard": ("standard", {}),
    "standard-b_dec-in": ("standard", {"apply_b_dec_to_input": True}),
    "jumprelu": ("jumprelu", {}),
    "topk-rescaled": ("topk", {"k": 12, "rescale_acts_by_decoder_norm": True}),
    "topk": ("topk", {"k": 12}),
    "topk-norm-rescale": ("topk", {"k": 12, "normalize_activations": "constant_norm_rescale"}),
    "standard-layer-norm": ("standard", {"normalize_activations": "layer_norm"}),
    "standard-average": ("standard", {"normalize_activations": "expected_average_only_in", "norm_scaling_factor": 0.7}),
}


def make(arch: str, extra: dict[str, Any], seed: int = 0) -> Sae:
    gen = torch.Generator().manual_seed(seed)
    kwargs = dict(extra)
    if arch == "jumprelu":
        kwargs["threshold"] = torch.rand(D_SAE, generator=gen) * 0.3
    return Sae(
        arch,
        torch.randn(D_IN, D_SAE, generator=gen) / D_IN**0.5,
        torch.randn(D_SAE, generator=gen) * 0.3,
        torch.randn(D_SAE, D_IN, generator=gen) / D_IN**0.5,
        torch.randn(D_IN, generator=gen) * 0.05,
        "blocks.1.hook_resid_post",
        **kwargs,
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("value", [0.0, 3.0])
def test_a_clamp_of_the_needed_features_equals_a_whole_encodes(case: str, value: float) -> None:
    arch, extra = CASES[case]
    sae = make(arch, extra)
    math = SaeMath(sae, "cpu")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, D_IN, generator=gen) * 2
    # a few distinct features, one per row; a feature that fires on most rows among them
    whole = math.encode(x, 0, dense=math.k is None)
    busy = int(((whole.features if whole.features is not None else whole.pre.relu()) > 0).sum(0).argmax())
    feature = torch.tensor([busy, 3, 77, busy, D_SAE - 1])[torch.arange(ROWS) % 5].unsqueeze(-1)
    target = torch.full((ROWS, 1), value)
    expected = math.clamp(whole, feature, target)
    actual = math.clamp_rows(x, feature, target)
    assert actual.shape == (ROWS, D_IN) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    changed = (actual - x).abs().amax(-1) > 1e-6
    assert bool(changed.any()), "the clamp changed no row: the test would not see a wrong current value"
    # and the core's own clamp, one row at a time per feature
    for f in (busy, 77):
        rows = (feature.squeeze(-1) == f).nonzero().flatten()
        core = FeatureWrite("s", f, "clamp", value).apply(x[rows], sae)
        torch.testing.assert_close(actual[rows], core.float(), rtol=1e-4, atol=1e-4)


def test_a_topk_clamp_encodes_only_the_rows_that_need_it(monkeypatch: pytest.MonkeyPatch) -> None:
    sae = make("topk", {"k": 12})
    math = SaeMath(sae, "cpu")
    assert math.sample == 24  # D_SAE / 8, at least 2 k
    x = torch.randn(ROWS, D_IN, generator=torch.Generator().manual_seed(2))
    encoded: list[int] = []
    whole = math._pre

    def counting(sae_in: torch.Tensor) -> Any:
        encoded.append(sae_in.shape[0])
        return whole(sae_in)

    monkeypatch.setattr(math, "_pre", counting)
    monkeypatch.setattr(sae_math, "READ_BLOCK_BYTES", 8 * 4 * D_SAE)  # blocks of 16 rows (the least)
    feature = torch.full((ROWS, 1), 5)
    math.clamp_rows(x, feature, torch.full((ROWS, 1), 2.0))
    pre = x @ sae.W_enc[:, 5] + sae.b_enc[5]
    positive = pre > 0
    # the rows whose pre-activation fewer than k + 1 of the first 24 features exceed, computed here
    sampled = x @ sae.W_enc[:, :24] + sae.b_enc[:24]
    survivors = int((positive & ((sampled > pre.unsqueeze(-1)).sum(-1) <= 12)).sum())
    assert 16 < survivors < int(positive.sum()) < ROWS
    assert sum(encoded) == survivors and max(encoded) == 16


@pytest.mark.parametrize("case", ["topk", "topk-rescaled"])
def test_a_topk_clamp_finds_the_rows_where_its_feature_is_among_the_top_k(case: str) -> None:
    arch, extra = CASES[case]
    sae = make(arch, extra)
    math = SaeMath(sae, "cpu")
    gen = torch.Generator().manual_seed(4)
    # rows leaning towards feature 5's encoder column by varying amounts: among the top k on some
    direction = sae.W_enc[:, 5] / sae.W_enc[:, 5].norm()
    x = torch.randn(ROWS, D_IN, generator=gen) + torch.linspace(-1, 6, ROWS).unsqueeze(-1) * direction
    whole = math.encode(x, 0)
    member = (whole.ids == 5).any(-1)
    assert 10 < int(member.sum()) < ROWS - 10
    feature = torch.full((ROWS, 1), 5)
    target = torch.full((ROWS, 1), 3.0)
    torch.testing.assert_close(
        math.clamp_rows(x, feature, target), math.clamp(whole, feature, target), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("case", ["topk", "jumprelu", "standard-layer-norm"])
def test_readouts_encoded_a_block_at_a_time_equal_one_encode(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    arch, extra = CASES[case]
    math = SaeMath(make(arch, extra), "cpu")
    x = torch.randn(ROWS, D_IN, generator=torch.Generator().manual_seed(3))
    whole = math.encode(x, 16, dense=True)
    monkeypatch.setattr(sae_math, "READ_BLOCK_BYTES", 64 * 4 * D_SAE)  # blocks of 64 rows: 5 of them
    top, ids, error, features = math.read(x, 16, dense=True)
    kept = math.kept(16)
    assert top.shape == (ROWS, kept) and ids.shape == (ROWS, kept)
    torch.testing.assert_close(top, whole.top[:, :kept], rtol=1e-6, atol=1e-6)
    assert torch.equal(ids, whole.ids[:, :kept])
    assert error is not None and features is not None
    torch.testing.assert_close(error, math.error(whole), rtol=1e-6, atol=1e-6)
    assert whole.features is not None
    torch.testing.assert_close(features, whole.features, rtol=1e-6, atol=1e-6)
    top_one, _, _, none = math.read(x[:1], 16)
    assert top_one.shape == (1, kept) and none is None
