"""``interp_engine.plot``: each function draws with the Agg backend, and the figure it returns has
the labels, ticks, colorbar and markers it promises (read from the Figure object); the CLI's
demo and attention command draw with them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import matplotlib
import pytest
import torch

from interp_engine import FeatureReadout, InvalidActivations, Labelled, load_model, run_with_cache, sync_model
from interp_engine import plot as plots
from interp_engine.cli import _demo, _views

from ..support.cli import interp, is_png

matplotlib.use("Agg")

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    m = load_model("interp:tiny", backend="eager")
    yield m
    sync_model(m).shutdown()


def colorbars(fig: Any) -> list[Any]:
    """The colorbar axes of ``fig`` (an Axes matplotlib made for a colorbar)."""
    return [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def tick_texts(labels: list[Any]) -> list[str]:
    return [t.get_text() for t in labels]


def test_token_label_keeps_spaces_visible() -> None:
    assert plots.token_label(" Paris") == "\u2423Paris"
    assert plots.token_label("Paris") == "Paris"
    assert plots.token_label("a ") == "a\u2423"
    assert plots.token_label("  ") == "\u2423\u2423"
    assert plots.token_label("\n") == "\u21b5"
    assert plots.token_label("\x00x") == "\\x00x"
    assert plots.token_label("") == "''"
    assert plots.token_label(" a very long token indeed", 8) == "\u2423a very\u2026"


def test_logit_lens(model: Any) -> None:
    n = model.info.n_layers
    cache = run_with_cache(model, TEXT, ["embed", *[f"resid_post.{layer}" for layer in range(n)]])
    stack = cache.stack("resid_post", include_embed=True)
    logits = sync_model(model).decode_residuals(stack)[:, 0]
    tokens = model.to_str_tokens(TEXT)
    layers = cache.stack_labels("resid_post", include_embed=True)
    fig = plots.logit_lens(logits, tokens=tokens, layers=layers, decode=model.to_str_tokens)
    ax = fig.axes[0]
    assert tick_texts(ax.get_xticklabels()) == ["The", "\u2423capital", "\u2423of", "\u2423France", "\u2423is"]
    assert tick_texts(ax.get_yticklabels()) == layers
    assert all(t.get_fontsize() >= 8 for t in ax.get_xticklabels() + ax.get_yticklabels())
    (bar,) = colorbars(fig)
    assert bar.get_ylabel() == "probability of the top-1 token"
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    top = logits.softmax(-1).argmax(-1)
    assert cells[(n, 4)] == plots.token_label(model.to_str_tokens([int(top[n, 4])])[0], 9) == "\u2423Paris"
    image = ax.get_images()[0].get_array()
    torch.testing.assert_close(torch.as_tensor(image.data), logits.softmax(-1).max(-1).values)
    paris = model.to_tokens(" Paris")[0, -1].item()
    fig = plots.logit_lens(logits, tokens=tokens, layers=layers, target=int(paris))
    assert colorbars(fig)[0].get_ylabel() == f"probability of token {paris}"
    assert not fig.axes[0].texts  # no decode: no token names in the cells
    fig.canvas.draw()  # renders with Agg


def test_attention_has_token_labels_on_both_axes_and_a_colorbar(model: Any) -> None:
    pattern = run_with_cache(model, TEXT, "attn_pattern.1")["attn_pattern.1"][0]
    tokens = model.to_str_tokens(TEXT)
    fig = plots.attention(pattern, tokens=tokens, title="layer 1")
    heads = [ax for ax in fig.axes if ax not in colorbars(fig)]
    assert len(heads) == model.info.n_heads and len(colorbars(fig)) == 1
    assert colorbars(fig)[0].get_ylabel() == "attention probability"
    for head, ax in enumerate(heads):
        assert ax.get_title() == f"head {head}"
        assert (
            tick_texts(ax.get_xticklabels())
            == tick_texts(ax.get_yticklabels())
            == [plots.token_label(t, 12) for t in tokens]
        )
        assert all(t.get_fontsize() >= 8 for t in ax.get_xticklabels())
        assert ax.get_xlabel() == "key"
    assert heads[0].get_ylabel() == "query"
    assert fig._suptitle is not None and fig._suptitle.get_text() == "layer 1"
    one = plots.attention(pattern, tokens=tokens, heads=[2])
    assert [ax.get_title() for ax in one.axes if ax not in colorbars(one)] == ["head 2"]
    with pytest.raises(InvalidActivations, match="3 tokens for a pattern over 5"):
        plots.attention(pattern, tokens=tokens[:3])
    fig.canvas.draw()


def test_induction_has_ticks_a_colorbar_and_the_repeat_marked(model: Any) -> None:
    block = torch.randint(100, model.info.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    pattern = run_with_cache(model, [block + block], "attn_pattern.1")["attn_pattern.1"][0]
    fig = plots.induction(pattern, repeat_start=12)
    heads = [ax for ax in fig.axes if ax not in colorbars(fig)]
    assert len(heads) == model.info.n_heads and len(colorbars(fig)) == 1
    queries = torch.arange(12, 24)
    for head, ax in enumerate(heads):
        assert len(ax.get_xticks()) >= 4 and len(ax.get_yticks()) >= 4
        assert tick_texts(ax.get_xticklabels())[:2] == ["0", "2"]
        edges = [line for line in ax.lines if line.get_linestyle() == "--"]  # where the repeat starts
        assert any(list(line.get_xdata()) == [11.5, 11.5] for line in edges)
        assert any(list(line.get_ydata()) == [11.5, 11.5] for line in edges)
        stripe = next(line for line in ax.lines if line.get_linestyle() == ":")
        assert list(stripe.get_xdata()) == (queries - 11).tolist() and list(stripe.get_ydata()) == queries.tolist()
        score = float(pattern[head, queries, queries - 11].mean())
        assert ax.get_title() == f"head {head}: induction {score:.2f}"
    legend = heads[0].get_legend()
    assert legend is not None and "repeat starts (12)" in tick_texts(legend.get_texts())
    with pytest.raises(InvalidActivations, match="does not fit"):
        plots.induction(pattern, repeat_start=20, length=12)
    fig.canvas.draw()


def test_patching_heatmap_is_diverging_centred_at_zero() -> None:
    values = torch.tensor([[0.5, -2.0, 0.0], [1.0, 0.25, -0.5]])
    fig = plots.patching(values, rows=[0, 1], cols=["0 'The'", "1 ' capital'", "2 ' of'"], row_label="layer")
    ax = fig.axes[0]
    image = ax.get_images()[0]
    assert image.get_cmap().name == "RdBu"
    norm = image.norm
    assert norm.vmin == -2.0 and norm.vmax == 2.0 and float(norm(0.0)) == 0.5
    assert tick_texts(ax.get_yticklabels()) == ["0", "1"]
    assert tick_texts(ax.get_xticklabels()) == ["0 'The'", "1 ' capital'", "2 ' of'"]
    assert ax.get_ylabel() == "layer"
    assert len(colorbars(fig)) == 1
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{v:.2f}" for v in values.flatten().tolist())
    sweep = Labelled(
        values,
        ("layer", "position"),
        {"layer": [2, 3], "position": ["0 'a'", "1 'b'", "2 'c'"]},
        {"kind": "resid_post", "direction": "denoise", "metric": "logit_diff", "normalized": False},
    )
    fig = plots.patching(sweep)
    ax = fig.axes[0]
    assert (ax.get_ylabel(), ax.get_xlabel()) == ("layer", "position")
    assert tick_texts(ax.get_yticklabels()) == ["2", "3"]
    assert colorbars(fig)[0].get_ylabel() == "logit_diff"
    assert "resid_post" in ax.get_title()
    cube = Labelled(
        torch.zeros(2, 2, 2), ("layer", "position", "head"), {"layer": [0, 1], "position": [0, 1], "head": [0, 1]}
    )
    with pytest.raises(InvalidActivations, match=r"\.at\(head=\.\.\.\)"):
        plots.patching(cube)
    fig.canvas.draw()


def test_dla_bars() -> None:
    names = ["embed", "attn_out.0", "mlp_out.0", "attn_out.1"]
    values = torch.tensor([0.5, -1.5, 2.0, 0.1])
    fig = plots.dla(values, labels=names)
    ax = fig.axes[0]
    bars = ax.patches
    assert [round(b.get_width(), 4) for b in bars] == [0.5, -1.5, 2.0, 0.1]
    assert tick_texts(ax.get_yticklabels()) == names
    blue, red = matplotlib.colors.to_rgba("#2166ac"), matplotlib.colors.to_rgba("#b2182b")
    assert [b.get_facecolor() for b in bars] == [blue, red, blue, blue]
    assert ax.get_xlabel() == "contribution to the logit difference"
    assert [t.get_text() for t in ax.texts] == ["0.50", "-1.50", "2.00", "0.10"]
    top = plots.dla(Labelled(values, ("component",), {"component": names}), top=2)
    assert tick_texts(top.axes[0].get_yticklabels()) == ["attn_out.0", "mlp_out.0"]
    fig.canvas.draw()


def test_features_heatmap() -> None:
    ids = torch.tensor([[3, 7, -1], [7, 5, 3]])
    values = torch.tensor([[2.0, 1.0, 0.0], [4.0, 0.5, 0.25]])
    fig = plots.features(FeatureReadout(values, ids), tokens=["The", " cat"], names={7: "animal"})
    ax = fig.axes[0]
    assert tick_texts(ax.get_yticklabels()) == ["The", "\u2423cat"]
    assert tick_texts(ax.get_xticklabels()) == ["3", "7 (animal)", "5"]
    grid = torch.as_tensor(ax.get_images()[0].get_array().data)
    assert grid.tolist() == [[2.0, 1.0, 0.0], [0.25, 4.0, 0.5]]
    assert len(colorbars(fig)) == 1


def test_every_function_draws_on_a_given_axes() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert plots.dla(torch.tensor([1.0, -1.0]), ax=left) is fig
    assert plots.patching(torch.ones(2, 2), ax=right) is fig
    sub = Figure().subfigures(1, 2)[0]
    ax = sub.add_subplot()
    assert plots.attention(torch.eye(3), ax=ax) is sub.figure
    with pytest.raises(InvalidActivations, match="ax= takes one head"):
        plots.attention(torch.ones(2, 3, 3), ax=Figure().add_subplot())


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'interp-core\[plots\]'"):
        plots.dla(torch.ones(2))


# -- the CLI draws with them --------------------------------------------------------------------------


def capture_figures(monkeypatch: pytest.MonkeyPatch, module: Any) -> dict[str, Any]:
    drawn: dict[str, Any] = {}
    original = module.save_figure

    def save(fig: Any, out_dir: str, name: str) -> Any:
        drawn[name] = fig
        return original(fig, out_dir, name)

    monkeypatch.setattr(module, "save_figure", save)
    return drawn


def test_the_demo_writes_its_plots_with_these_functions(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch, model: Any
) -> None:
    drawn = capture_figures(monkeypatch, _demo)
    monkeypatch.setattr(_views, "save_figure", _demo.save_figure)  # the lens plot is saved from _views
    args = ["demo", "--out", str(tmp_path), "--max-tokens", "1", "--induction-length", "8"]
    status, _, err = interp(capsys, *args)
    assert status == 0, err
    for name in ("lens.png", "induction.png", "features.png"):
        assert is_png(tmp_path / name), name
        assert name in drawn and colorbars(drawn[name]), name
    lens = drawn["lens.png"].axes[0]
    assert "\u2423France" in tick_texts(lens.get_xticklabels())
    induction = [ax for ax in drawn["induction.png"].axes if ax not in colorbars(drawn["induction.png"])]
    assert len(induction[0].get_xticks()) >= 4
    start = len(model.to_tokens("")[0]) + 8  # after any BOS, the second copy of the 8 random tokens
    assert any(list(line.get_xdata()) == [start - 0.5] * 2 for line in induction[0].lines)
    assert induction[0].get_title().startswith("head 0: induction ")


def test_the_attention_command_has_readable_labels_and_a_colorbar(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = capture_figures(monkeypatch, _views)
    status, _, err = interp(capsys, "attention", "interp:tiny", TEXT, "--layer", "1", "--out", str(tmp_path))
    assert status == 0, err
    fig = drawn["attention_L1.png"]
    assert is_png(tmp_path / "attention_L1.png") and len(colorbars(fig)) == 1
    head = fig.axes[0]
    assert tick_texts(head.get_yticklabels())[1] == "\u2423capital"
    assert min(t.get_fontsize() for t in head.get_xticklabels()) >= 8
