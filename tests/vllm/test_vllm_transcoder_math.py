"""The workers' transcoder clamp arithmetic without an engine: the dynamic worker's batched clamp
(``TranscoderMath.clamp_output``) and the compiled graph's two steps (``StaticTranscoder`` at the
input address, ``StaticTranscoderOut`` at the output address) equal the core's
``FeatureWrite.apply(..., source=...)`` -- what the eager backend applies -- for every transcoder
architecture and input normalisation the workers serve; tokens without a clamp are untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import FeatureWrite, Sae
from interp_vllm.sae._math import SaeLayout
from interp_vllm.sae._transcoders import TranscoderMath
from interp_vllm.static._saes import StaticTranscoder, StaticTranscoderOut

D_IN, D_OUT, D_SAE, ROWS = 48, 40, 96, 50
SAME = 1e-5

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "transcoder": ("transcoder", {}),
    "jumprelu": ("jumprelu_transcoder", {}),
    "skip": ("skip_transcoder", {}),
    "average": ("transcoder", {"normalize_activations": "expected_average_only_in", "norm_scaling_factor": 0.6}),
    "layer-norm": ("jumprelu_transcoder", {"normalize_activations": "layer_norm"}),
}


def make(arch: str, extra: dict[str, Any]) -> Sae:
    gen = torch.Generator().manual_seed(3)
    kwargs = dict(extra)
    if arch.startswith("jumprelu"):
        kwargs["threshold"] = torch.rand(D_SAE, generator=gen) * 0.3
    if "skip" in arch:
        kwargs["W_skip"] = torch.randn(D_OUT, D_IN, generator=gen) * 0.1
    return Sae(
        arch,
        torch.randn(D_IN, D_SAE, generator=gen) / D_IN**0.5,
        torch.randn(D_SAE, generator=gen) * 0.3,
        torch.randn(D_SAE, D_OUT, generator=gen) / D_OUT**0.5,
        torch.randn(D_OUT, generator=gen) * 0.05,
        "mlp_in.1",
        hook_name_out="mlp_out.1",
        **kwargs,
    )


def core(sae: Sae, out: torch.Tensor, source: torch.Tensor, features: list[int], values: list[float]) -> torch.Tensor:
    """Each row through the core's ``FeatureWrite.apply`` with its own feature and value."""
    rows = [
        FeatureWrite("t", f, "clamp", v).apply(out[r : r + 1], sae, source=source[r : r + 1])[0]
        for r, (f, v) in enumerate(zip(features, values, strict=True))
    ]
    return torch.stack(rows)


def scale(x: torch.Tensor) -> float:
    return float(x.abs().max())


@pytest.mark.parametrize("case", CASES)
def test_worker_clamps_equal_the_core(case: str) -> None:
    sae = make(*CASES[case])
    gen = torch.Generator().manual_seed(4)
    source, out = torch.randn(ROWS, D_IN, generator=gen) * 2, torch.randn(ROWS, D_OUT, generator=gen)
    f = sae.encode(source)
    # per row: a feature that fires there (clamped up or ablated) or one that does not (clamped on)
    features = [int(f[r].argmax()) if r % 3 else int(f[r].argmin()) for r in range(ROWS)]
    values = [0.0 if r % 4 == 1 else 2.5 - 0.1 * r for r in range(ROWS)]
    want = core(sae, out, source, features, values)
    assert scale(want - out) > 0.1
    feature = torch.tensor(features)[:, None]
    value = torch.tensor(values)[:, None]

    got = TranscoderMath(sae, "cpu").clamp_output(out, source, feature, value)
    assert scale(got - want) <= SAME * scale(want)

    compiled = StaticTranscoder(sae, SaeLayout.of(sae, 8, 128), ROWS + 6, clamps=True, device="cpu")
    step = StaticTranscoderOut(compiled)
    on = torch.tensor([r % 5 != 2 for r in range(ROWS)])
    compiled.set_clamps((on, feature[:, 0], value[:, 0]))
    assert compiled(source) is source  # the input address is read, never written
    result = step(out)
    assert scale(result[on] - want[on]) <= SAME * scale(want)
    assert torch.equal(result[~on], out[~on])
    assert torch.equal(step.steered(ROWS)[:, 0], on)
    compiled.set_clamps(None)  # a step without clamps: every token as it was
    compiled(source)
    assert torch.equal(step(out), out)


def test_only_transcoders_take_the_transcoder_steps() -> None:
    sae = Sae(
        "standard",
        torch.randn(D_IN, D_SAE),
        torch.zeros(D_SAE),
        torch.randn(D_SAE, D_IN),
        torch.zeros(D_IN),
        "resid_post.1",
    )
    with pytest.raises(ValueError, match="not a transcoder"):
        TranscoderMath(sae, "cpu")
    with pytest.raises(ValueError, match="not a transcoder"):
        StaticTranscoder(sae, SaeLayout.of(sae, 8, 128), 4, clamps=True, device="cpu")
    transcoder = make(*CASES["transcoder"])
    without = StaticTranscoder(transcoder, SaeLayout.of(transcoder, 8, 128), 4, clamps=False, device="cpu")
    with pytest.raises(ValueError, match="without clamps"):
        StaticTranscoderOut(without)
