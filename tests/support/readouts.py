"""Random SAEs scaled to a model's activations, the readout SAEs of the vllm tests (one per
architecture and kind of address, attached to the shared engines by ``tests/vllm``'s ``attached``),
and feature readouts compared."""

from __future__ import annotations

import functools
from typing import Any

import torch

from interp_engine import FeatureReadout, Features, Sae, load_model, sync_model
from interp_engine.addresses._address import as_address
from interp_testkit.suite import PROMPT, rel_diff, vllm_model_path

TOL = 1e-4  # across backends, tensor parallelism and batching (float32 summation order)
SAME = 1e-5  # a readout against the host's read of the very activations the request captured
D_SAE = 64
PREFIX = "tvsae"  # the readout SAEs' attachment names

# name -> (architecture, address, extra constructor arguments)
SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    f"{PREFIX}-res": ("standard", "blocks.1.hook_resid_post", {"apply_b_dec_to_input": True}),
    f"{PREFIX}-mlp": ("jumprelu", "blocks.0.hook_mlp_out", {}),
    f"{PREFIX}-attn": ("topk", "blocks.2.hook_attn_out", {}),
    f"{PREFIX}-z": ("standard", "blocks.1.attn.hook_z", {"reshape_activations": "hook_z"}),
}
RES, MLP, ATTN, HOOK_Z = SPECS


def make_sae(arch: str, address: str, sample: torch.Tensor, *, seed: int, **extra: Any) -> Sae:
    """A random ``arch`` SAE at ``address`` scaled to ``sample`` (``[n, d_in]`` or heads):
    pre-activations about N(0, 1), decoder rows about a quarter of an activation's norm."""
    rows = sample.flatten(1).float()
    d_in = rows.shape[-1]
    norm = float(rows.norm(dim=-1).mean())
    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = dict(extra)
    if arch == "jumprelu":
        kwargs["threshold"] = torch.rand(D_SAE, generator=gen) * 0.4 + 0.1
    if arch == "topk":
        kwargs["k"] = 8
    return Sae(
        arch,
        torch.randn(d_in, D_SAE, generator=gen) / norm,
        torch.randn(D_SAE, generator=gen) * 0.1,
        torch.randn(D_SAE, d_in, generator=gen) * norm / (4 * d_in**0.5),
        torch.randn(d_in, generator=gen) * 0.05 * norm / d_in**0.5,
        address,
        **kwargs,
    )


def assert_same_readout(actual: FeatureReadout, expected: FeatureReadout, tol: float = SAME, what: str = "") -> None:
    """Equal ids, values and error norms within ``tol`` of the values' scale."""
    assert actual.values.shape == expected.values.shape, what
    assert actual.values.dtype == torch.float32, what
    assert rel_diff(actual.values, expected.values) <= tol, what
    if expected.ids is None:
        assert actual.ids is None, what
    else:
        assert actual.ids is not None and actual.ids.dtype == torch.int64, what
        assert torch.equal(actual.ids, expected.ids), what
    if expected.error_norm is None:
        assert actual.error_norm is None, what
    else:
        assert actual.error_norm is not None, what
        assert rel_diff(actual.error_norm, expected.error_norm) <= tol, what


def assert_close_readout(actual: FeatureReadout, expected: FeatureReadout, tol: float = TOL, what: str = "") -> None:
    """:func:`assert_same_readout` for activations that differ by float rounding (another backend,
    TP, another batch): a top-k may order two near-equal features either way (or swap the last
    one with the first left out), nothing else."""
    assert actual.values.shape == expected.values.shape, what
    assert rel_diff(actual.values, expected.values) <= tol, what
    if expected.error_norm is not None:
        assert actual.error_norm is not None and rel_diff(actual.error_norm, expected.error_norm) <= tol, what
    if expected.ids is None:
        assert actual.ids is None, what
        return
    assert actual.ids is not None
    scale = float(expected.values.abs().max().clamp_min(1e-6))
    values = expected.values
    k = values.shape[-1]
    for token, slot in (actual.ids != expected.ids).nonzero().tolist():
        near = [values[token, j] for j in (slot - 1, slot + 1) if 0 <= j < k]
        tie = any(abs(float(values[token, slot] - v)) <= tol * scale for v in near)
        assert tie or slot == k - 1, f"{what}: token {token} slot {slot}: ids differ without a near-tie"
    assert int((actual.ids != expected.ids).sum()) <= 2, what


@functools.cache
def saes_for(family: str) -> dict[str, Sae]:
    """The readout SAEs for ``family``'s vLLM checkpoint (scaled from an eager capture)."""
    eager = eager_twin(family)
    ids = eager.to_tokens(PROMPT)[0].tolist()
    out = {}
    for seed, (name, (arch, hook, extra)) in enumerate(SPECS.items()):
        address = as_address(hook)
        sample = eager.capture(ids, [address])[address]
        out[name] = make_sae(arch, hook, sample, seed=seed, **extra)
    return out


@functools.cache
def eager_twin(family: str) -> Any:
    """The eager backend on the vLLM engine's checkpoint (SAEs attached by :func:`attached`)."""
    return sync_model(load_model(vllm_model_path(family), backend="eager"))


def attach_all(model: Any, saes: dict[str, Sae]) -> None:
    for name, sae in saes.items():
        if model.saes.get(name) is not sae:
            if name in model.saes:
                model.detach_sae(name)
            model.attach_sae(name, sae)


def readouts_for(name: str) -> list[Features]:
    return [
        Features(name, 8),
        Features(name, ids=[0, 5, 17, D_SAE - 1]),
        Features(name, dense=True),
        Features(name, 8, dtype="float16"),
    ]


def busiest_feature(facade: Any, ids: list[int], name: str) -> int:
    """A feature of ``name`` that fires on most tokens of ``ids`` (so a clamp changes its value)."""
    dense = facade.capture(ids, [Features(name, dense=True)])[Features(name, dense=True)].values
    return int((dense > 0).sum(0).argmax())
