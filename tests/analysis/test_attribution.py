"""Attribution patching (``attribution_patch``) against real activation patching on ``interp:tiny``.

Real patching is done by hand here: per cell, a ``set`` write of the source run's activation (or
a point between the two runs' activations) into the patched run, through ``run_with_cache`` with
one steering spec per row. Two checks: the estimate is the first-order term of real patching
(exact to O(h^2) when a fraction ``h`` of the difference is patched, float64), and on a real
prompt pair it correlates with real patching of the whole difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    InvalidOption,
    InvalidTokens,
    Labelled,
    SteeringSpec,
    UnknownKind,
    UnsupportedOperation,
    Write,
    attribution_patch,
    load_model,
    metrics,
    run_with_cache,
    tiny_model_path,
)

CLEAN = "The capital of France is the city of"
CORRUPT = "The capital of Italy is the city of"


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("interp:tiny", backend="eager")


@pytest.fixture(scope="module")
def tiny64() -> Any:
    return load_model(tiny_model_path(), backend="eager", dtype="float64")


def _cells(result: Labelled) -> list[tuple[int, int | None, int | None]]:
    """``(layer, position or None, head or None)`` per entry of ``result``, in its order."""
    positions = [int(label.split()[0]) for label in result.coords["position"]] if "position" in result.dims else [None]
    heads = result.coords["head"] if "head" in result.dims else [None]
    return [(layer, p, h) for layer in result.coords["layer"] for p in positions for h in heads]


def _patched(
    model: Any,
    kind: str,
    result: Labelled,
    metric: Any,
    fractions: list[float],
    *,
    source: str = CLEAN,
    target: str = CORRUPT,
    together: list[int] | None = None,
) -> dict[tuple[float, int, int | None, int | None], float]:
    """Real patching by hand: the metric of ``target`` with each cell ``set`` to ``a_target + h *
    (a_source - a_target)`` (``h = 1``: the source's activation), per cell and fraction. A cell
    without a position patches the positions ``together`` (default all) at once."""
    layers = result.coords["layer"]
    acts = run_with_cache(model, [source, target], [Address(kind, layer) for layer in layers])
    n = acts[Address(kind, layers[0])].shape[1]
    specs, keys = [], []
    for h in fractions:
        for layer, p, head in _cells(result):
            src, tgt = acts[Address(kind, layer)][0], acts[Address(kind, layer)][1]
            value = tgt + h * (src - tgt)
            positions = (together or list(range(n))) if p is None else [p]
            if head is None:
                write = Write(Address(kind, layer), value[positions], op="set", positions=positions)
            else:
                write = Write(
                    Address(kind, layer), value[positions][:, [head]], op="set", positions=positions, heads=[head]
                )
            specs.append(SteeringSpec([write]))
            keys.append((h, layer, p, head))
    logits = run_with_cache(model, [target] * len(specs), ["logits"], steering_spec=specs)["logits"]
    return {key: float(metric(logits[i : i + 1])) for i, key in enumerate(keys)}


def _estimate(result: Labelled, layer: int, p: int | None, head: int | None) -> float:
    where: dict[str, Any] = {"layer": layer}
    if p is not None:
        where["position"] = next(label for label in result.coords["position"] if int(label.split()[0]) == p)
    if head is not None:
        where["head"] = head
    value = result.at(**where)
    assert isinstance(value, float)
    return value


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("resid_pre", {}),
        ("mlp_out", {}),
        ("attn_z", {"heads": True, "by_position": True}),
        ("attn_v", {"heads": True}),  # every position at once, per key/value head
    ],
)
def test_the_estimate_is_the_first_order_term_of_real_patching(tiny64: Any, kind: str, options: dict[str, Any]) -> None:
    """Patching a fraction ``h`` of the difference changes the metric by ``h * estimate + O(h^2)``:
    the central difference ``(m(h) - m(-h)) / 2h`` equals the estimate to O(h^2). Measured (float64
    model, values returned as float32): at most 4.4e-5 at h = 0.01 for estimates up to 1.2, and
    6-8x more at h = 0.03 (second order: 9x); below h = 0.003 float32 rounding dominates."""
    metric = metrics.logit_diff(" Paris", " Rome", model=tiny64)
    result = attribution_patch(tiny64, CLEAN, CORRUPT, kind, metric=metric, **options)
    scale = max(1.0, float(result.values.abs().max()))
    real = _patched(tiny64, kind, result, metric, [0.01, -0.01, 0.03, -0.03])
    errors = {}
    for h in (0.01, 0.03):
        errors[h] = max(
            abs((real[(h, *cell)] - real[(-h, *cell)]) / (2 * h) - _estimate(result, *cell)) for cell in _cells(result)
        )
    assert errors[0.01] <= 1e-4 * scale, errors
    assert errors[0.03] >= 4 * errors[0.01], errors  # the remainder is second order
    assert float(result.values.abs().max()) > 0.1  # not trivially zero


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


PAIRS = {  # clean country, corrupt country, their capitals (one token each)
    "France/Italy": ("France", "Italy", " Paris", " Rome"),
    "France/Spain": ("France", "Spain", " Paris", " Madrid"),
    "Egypt/Canada": ("Egypt", "Canada", " Cairo", " Ottawa"),
}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("resid_post", {}),
        ("mlp_out", {}),
        ("attn_out", {}),
        ("attn_z", {"heads": True, "by_position": True}),
        ("attn_z", {"heads": True}),
    ],
)
def test_the_estimate_correlates_with_real_patching(tiny: Any, pair: str, kind: str, options: dict[str, Any]) -> None:
    """Denoising "The capital of {clean} is" -> "... {corrupt} is" (metric: the two capitals' logit
    difference): each cell's clean activation ``set`` into the corrupt run, by hand, against the
    estimate, at the positions from the first difference on (before it both are 0).

    Pearson correlations measured (deterministic on CPU), resid_post / mlp_out / attn_out / attn_z
    per (layer, position, head) / per (layer, head): France/Italy 0.99 / 0.87 / 0.97 / 0.99 / 0.99,
    France/Spain 0.99 / 0.93 / 0.98 / 0.99 / 0.99, Egypt/Canada 0.99 / 0.96 / 1.00 / 1.00 / 1.00.
    The estimate is first order and misses where one early cell flips the whole answer
    nonlinearly: France/Germany 0.38 / 0.55 / -0.68 / -0.73 / -0.73 (layer 0's attn_v head 0: real
    +16.8, estimate -5.0, the slope there; docs/guides/research.md's caveat), Japan/China 0.43 / 0.93 / 0.43 /
    0.27 / 0.28. The bound is asserted on the three pairs above."""
    country, other, answer, wrong = PAIRS[pair]
    clean, corrupt = f"The capital of {country} is", f"The capital of {other} is"
    metric = metrics.logit_diff(answer, wrong, model=tiny)
    after = list(range(3, len(tiny.to_str_tokens(clean))))  # from the first difference on
    result = attribution_patch(tiny, clean, corrupt, kind, metric=metric, positions=after, **options)
    assert result.meta["clean"] > 0 > result.meta["corrupt"]
    real = _patched(tiny, kind, result, metric, [1.0], source=clean, target=corrupt, together=after)
    baseline = result.meta["corrupt"]
    effects = torch.tensor([real[(1.0, *cell)] - baseline for cell in _cells(result)])
    estimates = torch.tensor([_estimate(result, *cell) for cell in _cells(result)])
    assert _corr(effects, estimates) > 0.8
    # the largest real effect has the estimate's sign
    top = int(effects.abs().argmax())
    assert effects[top] * estimates[top] > 0


def test_layout_meta_and_options(tiny: Any) -> None:
    metric = metrics.logit_diff(" Paris", " Rome", model=tiny)
    result = attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric)
    n = len(tiny.to_str_tokens(CLEAN))
    assert result.dims == ("layer", "position") and result.shape == (tiny.info.n_layers, n)
    assert result.coords["layer"] == list(range(tiny.info.n_layers))
    assert result.coords["position"][0] == "0 'The'"
    assert result.coords["position"][3] == "3 ' France'/' Italy'"
    logits = run_with_cache(tiny, [CLEAN, CORRUPT], ["logits"])["logits"]
    assert result.meta["clean"] == pytest.approx(float(metric(logits[0:1])), abs=1e-4)
    assert result.meta["corrupt"] == pytest.approx(float(metric(logits[1:2])), abs=1e-4)
    assert result.meta["direction"] == "denoise" and result.meta["method"] == "attribution"
    # positions before the first difference cannot matter
    assert not bool(result.values[:, :3].any())

    # selections, all positions at once (the sum), normalisation
    some = attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, layers=[-1, 1], positions=[3, -1])
    assert some.coords["layer"] == [tiny.info.n_layers - 1, 1] and some.shape == (2, 2)
    assert torch.allclose(some.values, result.values[[tiny.info.n_layers - 1, 1]][:, [3, n - 1]])
    summed = attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, by_position=False)
    assert summed.dims == ("layer",) and torch.allclose(summed.values, result.values.sum(1), atol=1e-5)
    normed = attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, normalize=True)
    span = result.meta["clean"] - result.meta["corrupt"]
    assert torch.allclose(normed.values, result.values / span, atol=1e-6)

    # heads: per (layer, head) by default, the positions summed
    heads = attribution_patch(tiny, CLEAN, CORRUPT, "attn_z", metric=metric, heads=True)
    by_cell = attribution_patch(tiny, CLEAN, CORRUPT, "attn_z", metric=metric, heads=[0, 2], by_position=True)
    assert heads.dims == ("layer", "head") and heads.shape == (tiny.info.n_layers, tiny.info.n_heads)
    assert by_cell.dims == ("layer", "position", "head") and by_cell.coords["head"] == [0, 2]
    assert torch.allclose(by_cell.values.sum(1), heads.values[:, [0, 2]], atol=1e-5)
    # attn_z without heads: the heads summed too (the whole attn_z patched per position)
    flat = attribution_patch(tiny, CLEAN, CORRUPT, "attn_z", metric=metric)
    assert torch.allclose(flat.values.sum(1), heads.values.sum(1), atol=1e-5)

    # a kind without layers
    embed = attribution_patch(tiny, CLEAN, CORRUPT, "embed", metric=metric)
    assert embed.dims == ("position",) and embed.shape == (n,)

    # the noising direction: the gradient on the clean run, the corrupt activation patched in
    noise = attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, direction="noise")
    real = _patched(tiny, "resid_post", noise, metric, [1.0], source=CORRUPT, target=CLEAN)
    effects = torch.tensor([real[(1.0, *c)] - noise.meta["clean"] for c in _cells(noise)])
    assert _corr(effects, noise.values.flatten()) > 0.85


def test_the_default_metric_is_the_sweeps(tiny: Any) -> None:
    """No metric: the logit difference between the clean and corrupt runs' top tokens at the last
    position (or ``answer``/``wrong``), as ``patching.sweep``'s default."""
    paris, rome = (metrics.token_id(tiny, t) for t in (" Paris", " Rome"))
    given = attribution_patch(tiny, CLEAN, CORRUPT, "mlp_out", answer=" Paris", wrong=" Rome")
    by_hand = attribution_patch(tiny, CLEAN, CORRUPT, "mlp_out", metric=metrics.logit_diff(paris, rome))
    assert torch.equal(given.values, by_hand.values)
    with pytest.raises(InvalidOption, match="top tokens, but both are"):  # both runs end on ' Turkey'
        attribution_patch(tiny, CLEAN, CORRUPT, "mlp_out")
    clean, corrupt = "The capital of France is", "The capital of Germany is"
    logits = run_with_cache(tiny, [clean, corrupt], ["logits"])["logits"]
    top_clean, top_corrupt = int(logits[0, -1].argmax()), int(logits[1, -1].argmax())
    assert top_clean != top_corrupt
    for direction in ("denoise", "noise"):
        default = attribution_patch(tiny, clean, corrupt, "mlp_out", direction=direction)
        assert default.meta["metric"] == f"logit_diff({top_clean}, {top_corrupt}, position=-1)"
        assert default.meta["clean"] > 0 > default.meta["corrupt"]


def test_refusals(tiny: Any) -> None:
    metric = metrics.logit_diff(" Paris", " Rome", model=tiny)
    with pytest.raises(InvalidTokens, match="same length"):
        attribution_patch(tiny, CLEAN, "The capital of Italy is", "resid_post", metric=metric)
    with pytest.raises(UnknownKind):
        attribution_patch(tiny, CLEAN, CORRUPT, "resid", metric=metric)
    with pytest.raises(InvalidOption, match="no head axis"):
        attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, heads=True)
    with pytest.raises(InvalidOption, match="has no layers"):
        attribution_patch(tiny, CLEAN, CORRUPT, "embed", metric=metric, layers=[0])
    with pytest.raises(InvalidOption, match="outside"):
        attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, positions=[99])
    with pytest.raises(InvalidOption, match="leave them out"):
        attribution_patch(tiny, CLEAN, CORRUPT, "resid_post", metric=metric, answer=" Paris")
    with pytest.raises(UnsupportedOperation, match="backend='eager'"):
        attribution_patch(load_model("toy", backend="toy"), [5, 6, 7], [5, 6, 8], "resid_post", metric=metric)
