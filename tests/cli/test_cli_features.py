"""``interp features`` (an SAE's top features per token) and the demo's SAE sections, on the
shipped model and SAE with the eager backend. Feature ids come from the shipped ``features.json``
(by name), never from the test; what the demo reports is recomputed here."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shutil
import sys
from typing import Any

import pytest
import torch

from interp_engine import (
    Address,
    Features,
    FeatureWrite,
    SteeringSpec,
    Write,
    load_model,
    load_sae,
    shipped_saes,
    sync_model,
)
from interp_engine.cli import _common, main
from interp_engine.cli._common import show_token
from interp_testkit.suite import tiny_model_path

from ..support.cli import PNG, interp, is_png, our_lines

MODEL = "interp:tiny"
SAE = "interp:tiny-sae"
PROMPT = "The capital of France is"
CONTRAST = "The capital of Germany is"


def named(category: str) -> int:
    """The feature the shipped SAE's features.json names ``category``."""
    report = json.loads((shipped_saes()[SAE] / "features.json").read_text(encoding="utf-8"))
    (feature,) = [f["feature"] for f in report["features"] if f["category"] == category]
    return int(feature)


@pytest.fixture(scope="module")
def sync() -> Any:
    """interp:tiny on eager with the shipped SAE attached as ``ref`` (the oracle side)."""
    model = sync_model(load_model(MODEL, backend="eager", saes={"ref": SAE}))
    yield model
    model.shutdown()


ROW = re.compile(r"^(?P<pos>\d+)\s+(?P<token>'.*?')\s+(?P<error>\S+)\s+(?P<features>.*)$")


def rows_of(out: str) -> dict[int, re.Match[str]]:
    """The table rows of ``interp features`` (or the demo's section 6) by position: the
    groups pos, token, error and features."""
    matches = [ROW.match(line) for line in out.splitlines()]
    return {int(m["pos"]): m for m in matches if m}


def next_token(sync: Any, ids: list[int], spec: SteeringSpec | None = None) -> torch.Tensor:
    return sync.capture(ids, ["logits"], steering_spec=spec)[Address("logits")][-1].float().softmax(-1)


# -- interp features ---------------------------------------------------------------------------------


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = interp(capsys, "features", "--help")
    assert status == 0 and "usage: interp features" in out
    for option in ("--sae", "--top-k", "--json", "--plot", "--backend", "example:"):
        assert option in out


def test_the_country_feature_is_listed_on_france(capsys: pytest.CaptureFixture[str], sync: Any) -> None:
    country = named("country")
    status, out, err = interp(capsys, "features", MODEL, PROMPT, "--sae", SAE)
    assert status == 0, err
    tokens = sync.to_str_tokens(sync.to_tokens(PROMPT)[0].tolist())
    rows = rows_of(out)
    assert [row["token"] for _, row in sorted(rows.items())] == [show_token(t) for t in tokens]
    france = tokens.index(" France")
    label = f"{country} (country):"
    assert rows[france]["features"].startswith(label), rows[france][0]  # the strongest there
    assert all(label not in row["features"] for position, row in rows.items() if position != france)
    # its value is the SAE's encoding of the captured activation
    x = sync.capture(sync.to_tokens(PROMPT)[0].tolist(), [load_sae(SAE).address])[load_sae(SAE).address]
    value = float(load_sae(SAE).encode(x[france])[country])
    assert rows[france]["features"].startswith(f"{label}{value:.2f}  ")
    assert "names from its features.json" in out


def test_json_equals_a_capture(capsys: pytest.CaptureFixture[str], sync: Any) -> None:
    status, out, err = interp(capsys, "features", MODEL, PROMPT, "--sae", SAE, "--top-k", "5", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["sae"]["address"] == "resid_post.2" and data["sae"]["d_sae"] == 1024
    assert data["readout"] == f"features:{data['sae']['name']}:top5"
    ids = sync.to_tokens(PROMPT)[0].tolist()
    spec = Features("ref", top_k=5)
    want = sync.capture(ids, [spec])[spec]
    assert [t["token_id"] for t in data["tokens"]] == ids
    assert [t["token"] for t in data["tokens"]] == sync.to_str_tokens(ids)
    country = named("country")
    for position, token in enumerate(data["tokens"]):
        fired = want.ids[position] >= 0
        assert [f["id"] for f in token["features"]] == want.ids[position][fired].tolist()
        got = torch.tensor([f["value"] for f in token["features"]])
        torch.testing.assert_close(got, want.values[position][fired], rtol=0, atol=1e-5)
        assert token["error_norm"] == pytest.approx(float(want.error_norm[position]), abs=1e-4)
        for feature in token["features"]:
            assert feature["name"] == ("country" if feature["id"] == country else None)
    france = sync.to_str_tokens(ids).index(" France")
    assert data["tokens"][france]["features"][0] == {
        "id": country,
        "value": pytest.approx(float(want.values[france, 0])),
        "name": "country",
    }


def test_a_folder_and_its_features_json(capsys: pytest.CaptureFixture[str], sync: Any, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "my sae"  # a space: the attached name is made valid
    load_sae(SAE).save(folder)
    status, out, err = interp(capsys, "features", MODEL, "Hello", "--sae", str(folder), "--top-k", "2")
    assert status == 0, err
    assert "names from" not in out and "(" not in rows_of(out)[0]["features"]
    spec = Features("ref", top_k=2)
    first = int(sync.capture(sync.to_tokens("Hello")[0].tolist(), [spec])[spec].ids[0, 0])
    (folder / "features.json").write_text(json.dumps({"features": [{"feature": first, "name": "greeting"}]}))
    status, out, err = interp(capsys, "features", MODEL, "Hello", "--sae", str(folder / "cfg.json"), "--top-k", "2")
    assert status == 0, err
    assert rows_of(out)[0]["features"].startswith(f"{first} (greeting):")
    (folder / "features.json").write_text("{not json")
    status, out, err = interp(capsys, "features", MODEL, "Hello", "--sae", str(folder), "--top-k", "2")
    assert status == 0 and "feature names skipped" in our_lines(err)[0] and "(greeting)" not in out


def test_plot(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plots" / "features.png"
    status, out, err = interp(capsys, "features", MODEL, PROMPT, "--sae", SAE, "--plot", str(path))
    assert status == 0, err
    assert is_png(path) and f"wrote {path}" in out
    status, out, err = interp(capsys, "features", MODEL, PROMPT, "--sae", SAE, "--json", "--plot", str(path))
    assert status == 0 and json.loads(out)["tokens"]  # stdout stays one JSON document
    assert f"interp: wrote {path}" in our_lines(err)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    other = tmp_path / "none.png"
    status, out, err = interp(capsys, "features", MODEL, PROMPT, "--sae", SAE, "--plot", str(other))
    assert status == 0 and rows_of(out)
    assert our_lines(err) == [f"interp: {_common.PLOTS_HINT}"] and not other.exists()
    assert path.read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sae", "{tmp}/missing"], "no SAE folder at"),
        (["--sae", "{tmp}"], "has no cfg.json or sae_weights.safetensors"),
        (["--sae", "interp:no-such-sae"], "shipped SAEs: interp:tiny-sae"),
        (["--sae", SAE, "--top-k", "0"], "--top-k must be at least 1"),
        (["--sae", SAE, "--plot", "{tmp}/f.notaformat"], "cannot write .notaformat"),
    ],
)
def test_mistakes_are_one_line_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    argv: list[str],
    expected: str,
) -> None:
    from interp_engine.cli import _features

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(_features, "load_model", no_load)
    status, _, err = interp(capsys, "features", MODEL, PROMPT, *[a.format(tmp=tmp_path) for a in argv])
    lines = our_lines(err)
    # an input the command reads is status 1, as in every command (2 is a malformed command line)
    assert status == 1 and len(lines) == 1 and lines[0].startswith("interp: error: ") and expected in lines[0], err
    assert "Traceback" not in err


def test_an_sae_of_another_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = interp(capsys, "features", str(tiny_model_path("gpt2")), PROMPT, "--sae", SAE)
    lines = our_lines(err)
    assert status == 1 and len(lines) == 1 and "width 128" in lines[0] and "64 wide" in lines[0], err
    status, _, err = interp(capsys, "features", MODEL, PROMPT, "--sae")
    assert status == 2 and our_lines(err)[0].startswith("interp: error: argument --sae: expected one argument")


# -- the demo's SAE sections ---------------------------------------------------------------------------


DEMO_ARGS = ["demo", "--no-plots", "--max-tokens", "1", "--induction-length", "6"]


@pytest.fixture(scope="module")
def demo_out() -> str:
    """The demo's stdout on the shipped model (run once for the module)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(DEMO_ARGS)
    assert status == 0, err.getvalue()
    return out.getvalue()


def demo(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    status, out, err = interp(capsys, *DEMO_ARGS, *extra)
    assert status == 0, err
    return out


def section(out: str, start: str, end: str | None = None) -> str:
    text = out[out.index(start) :]
    return text[: text.index(end)] if end else text


def writes_row(text: str, prefix: str) -> list[str]:
    """A row of section 7's table, split into its cells: writes, top 3, P(answer)."""
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return [cell.strip() for cell in re.split(r"\s{2,}", line)]


def top1(sync: Any, probs: torch.Tensor) -> str:
    best = int(probs.argmax())
    return f"{show_token(sync.to_str_tokens([best])[0])} {float(probs[best]):.2f}"


def test_demo_features_and_feature_steering_are_what_they_say(demo_out: str, sync: Any) -> None:
    out = demo_out
    sae = load_sae(SAE)
    ids = sync.to_tokens(PROMPT)[0].tolist()
    tokens = sync.to_str_tokens(ids)
    france, last = tokens.index(" France"), len(ids) - 1
    country = named("country")
    paris = sync.to_tokens(" Paris")[0].tolist()
    assert len(paris) == 1

    six = section(out, "6. features:", "7. steering by feature")
    assert f"{SAE} (topk, 1024 features at resid_post.2, k=16)" in six
    assert rows_of(six)[france]["features"].startswith(f"{country} (country):")
    assert f"the 'country' feature ({country}) fires on ' France' (" in six

    seven = section(out, "7. steering by feature")
    plain = next_token(sync, ids)
    assert int(plain.argmax()) == paris[0]
    none = writes_row(seven, "none")
    assert none[1].startswith(top1(sync, plain)) and none[2] == f"{float(plain[paris[0]]):.2f}"

    # the named feature ablated where it fires: recomputed
    ablated = next_token(sync, ids, SteeringSpec([FeatureWrite("ref", country, "ablate", positions=[france])]))
    row = writes_row(seven, f"ablate {country} (country) at ' France'")
    assert row[1].startswith(top1(sync, ablated)) and row[2] == f"{float(ablated[paris[0]]):.2f}"
    verdict = "stays" if int(ablated.argmax()) == paris[0] else "becomes"
    assert f"ablating the 'country' feature where it fires: the answer {verdict}" in seven

    # the last token's feature the answer needs most: its ablation changes the answer, and no
    # other feature there lowers P(' Paris') more
    (match,) = re.findall(r"^ablate (\d+) at ' is'", seven, flags=re.M)
    needed = int(match)
    dense = Features("ref", dense=True)
    at_last = torch.nonzero(sync.capture(ids, [dense])[dense].values[last] > 0).flatten().tolist()
    assert needed in at_last
    trials = {
        i: float(next_token(sync, ids, SteeringSpec([FeatureWrite("ref", i, "ablate", positions=[last])]))[paris[0]])
        for i in at_last
    }
    assert min(trials, key=lambda i: trials[i]) == needed
    steered = next_token(sync, ids, SteeringSpec([FeatureWrite("ref", needed, "ablate", positions=[last])]))
    assert int(steered.argmax()) != paris[0], "the demo says this ablation changes the answer"
    row = writes_row(seven, f"ablate {needed} at ' is'")
    assert row[1].startswith(top1(sync, steered)) and row[2] == f"{trials[needed]:.2f}"
    assert f"ablating {needed} lowers P(' Paris') most; the answer becomes {top1(sync, steered).split()[0]}" in seven

    # the transplant, recomputed independently: all features at once, as one plain write of
    # reconstruct(x_contrast) - reconstruct(x) at ' France' and ' is' (the error term kept)
    other = sync.to_tokens(CONTRAST)[0].tolist()
    germany = sync.to_str_tokens(other).index(" Germany")
    x = sync.capture(ids, [sae.address])[sae.address]
    y = sync.capture(other, [sae.address])[sae.address]
    delta = torch.zeros_like(x)
    for p, q in ((france, germany), (last, len(other) - 1)):
        delta[p] = sae.reconstruct(y[q : q + 1])[0] - sae.reconstruct(x[p : p + 1])[0]
    swapped = next_token(sync, ids, SteeringSpec([Write(sae.address, delta, op="add")]))
    row = writes_row(seven, "features of ' Germany', ' is' at ' France', ' is'")
    token, probability = row[1].split(",")[0].rsplit(" ", 1)
    assert token == show_token(sync.to_str_tokens([int(swapped.argmax())])[0]) == "' Berlin'"
    assert float(probability) == pytest.approx(float(swapped.max()), abs=0.03)
    assert "the answer becomes ' Berlin'" in seven


def test_demo_finds_its_feature_by_the_name_in_features_json(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / "renamed"
    shutil.copytree(shipped_saes()[SAE], folder)
    report = json.loads((folder / "features.json").read_text(encoding="utf-8"))
    report["features"] = [{**f, "category": "nation"} for f in report["features"] if f["category"] == "country"]
    (folder / "features.json").write_text(json.dumps(report))
    out = demo(capsys, "--sae", str(folder))
    country = named("country")
    assert f"the 'nation' feature ({country}) fires on ' France'" in out
    assert f"ablate {country} (nation) at ' France'" in out and "(country)" not in out
    (folder / "features.json").unlink()
    out = demo(capsys, "--sae", str(folder))
    assert "(no features.json beside" in out and "ablate" in out and "the answer becomes ' Berlin'" in out


def test_demo_skips_the_sae_sections_on_a_model_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    out = demo(capsys, str(tiny_model_path("gpt2")))
    assert "5. steering" in out
    assert f"6. features: skipped ({SAE} cannot be attached here): " in out and "7. steering by feature" not in out
    assert "8. circuits: skipped (interp:tiny-transcoders cannot replace this model's MLPs): " in out
    out = demo(capsys, str(tiny_model_path("gpt2")), "--sae", "", "--transcoders", "")
    assert "6. features" not in out and "8. circuits" not in out
    status, _, err = interp(capsys, "demo", "--sae", "interp:no-such-sae", "--no-plots")
    assert status == 1 and len(our_lines(err)) == 1 and "shipped SAEs" in err


# -- the demo's circuits section ---------------------------------------------------------------------


def test_demo_circuits_section_is_what_it_says(demo_out: str, sync: Any) -> None:
    """Section 8, recomputed: the graph's answer and the subject token feeding it most directly,
    the features at the last position with an edge from it and into the answer (the strongest by
    the smaller of the two), and P(' Paris') with each ablated through the transcoders, with all
    of them, and without the subject's embedding."""
    from interp_engine import load_transcoders
    from interp_engine.circuits import attribution_graph

    eight = section(demo_out, "8. circuits:")
    assert "through interp:tiny-transcoders" in eight and "on eager" in eight
    tcs = load_transcoders("interp:tiny-transcoders")
    graph = attribution_graph(sync, PROMPT, tcs)
    paris = sync.to_tokens(" Paris")[0].tolist()
    answer = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)
    assert answer.token == paris[0]
    assert f"the answer: ' Paris' (p={answer.probability:.3f})" in eight
    last = len(graph.tokens) - 1
    inputs = graph.edges(answer.id, "in")
    france, direct = max(((n, w) for n, w in inputs if n.kind == "embedding" and n.position < last), key=lambda e: e[1])
    assert france.label == " France"
    assert (
        f"' France' (position 3) is the earlier token whose embedding feeds ' Paris' most directly ({direct:+.2f}"
        in eight
    )

    def edge(source: Any, target: Any) -> float:
        return float(graph.adjacency[target.index, source.index])

    both = [(n, edge(france, n), w) for n, w in inputs if n.kind == "feature" and n.position == last]
    both = sorted([c for c in both if c[1] > 0 and c[2] > 0], key=lambda c: -min(c[1], c[2]))[:4]
    assert len(both) == 4
    tcs.attach(sync)
    try:

        def p(spec: SteeringSpec | None = None) -> float:
            return float(next_token(sync, graph.tokens, spec)[paris[0]])

        for node, from_france, into_paris in both:
            row = [line for line in eight.splitlines() if line.startswith(f"layer {node.layer} #{node.feature} ")]
            assert len(row) == 1, node
            cells = row[0].split()
            ablated = p(
                SteeringSpec([FeatureWrite(f"tc.{node.layer}", int(node.feature or 0), "ablate", positions=[last])])
            )
            assert cells[3:] == [
                f"{node.activation:.2f}",
                f"{from_france:+.2f}",
                f"{into_paris:+.2f}",
                f"{ablated:.3f}",
            ]
        together = p(
            SteeringSpec(
                [FeatureWrite(f"tc.{n.layer}", int(n.feature or 0), "ablate", positions=[last]) for n, _, _ in both]
            )
        )
        without = p(graph.steering_spec([france]))
        assert together < 0.5 * p(), "ablating the carriers together barely moves P(' Paris')"
        assert f"{p():.3f} as is; {together:.3f} with these 4 features ablated together" in eight
        assert f"{without:.3f} without the ' France' embedding" in eight
    finally:
        for layer in tcs.layers:
            sync.detach_sae(f"tc.{layer}")


def test_demo_transcoders_it_cannot_read_are_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = interp(capsys, "demo", "--transcoders", "interp:no-such-transcoders", "--no-plots")
    assert status == 1 and len(our_lines(err)) == 1 and "interp:no-such-transcoders" in err


def test_the_circuits_section_through_a_cross_layer_transcoder(sync: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A CLT is not attached (its features write several layers' MLP outputs): the section ablates
    its features with the graph's plain writes (``mode="constant"``), measured as printed."""
    from interp_engine.cli._demo_circuits import attach_demo_transcoders, section_circuits

    from ..support.circuits import random_clt

    demo = attach_demo_transcoders(sync, "clt", random_clt())
    assert not isinstance(demo, str) and not demo.attached
    ids = sync.to_tokens(PROMPT)[0].tolist()
    graph = section_circuits(sync, demo, ids, sync.model)
    out = capsys.readouterr().out
    assert "their decoder writes removed" in out
    answer = max(graph.nodes_of("logit"), key=lambda n: n.probability or 0.0)
    rows = [line.split() for line in out.splitlines() if line.startswith("layer ")]
    assert rows, out
    for cells in rows:
        node = graph.node(("feature", int(cells[1]), len(ids) - 1, int(cells[2].lstrip("#"))))
        probs = next_token(sync, ids, graph.steering_spec([node], mode="constant"))
        assert cells[-1] == f"{float(probs[int(answer.token or 0)]):.3f}", cells
