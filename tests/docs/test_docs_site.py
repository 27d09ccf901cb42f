"""The documentation site: it builds with ``mkdocs build --strict``, its generated tables are the
code's own tables, its benchmark figures carry their age, and two of its pages render in a real
browser (headless Chromium, driven by Playwright) with their title, navigation and code."""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import replace
from html import unescape
from types import ModuleType
from typing import Any

import pytest

from ..support.browser import chromium

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


BUILD_SECONDS = 1200
"""The build's deadline: about two minutes on an idle machine from a fresh checkout (its model-type
table runs both backends' verdicts), several times that while the other test process starts
engines beside it; the module's tests take it as their timeout (the first to use the site builds it)."""
pytestmark = pytest.mark.timeout(BUILD_SECONDS)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The site, built once with ``mkdocs build --strict`` (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_SECONDS,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return out


def page(site: pathlib.Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


# -- the build ---------------------------------------------------------------------------------------


def test_the_strict_build_has_every_page(site: pathlib.Path) -> None:
    for path in ("", "guides/capture", "reference/api", "reference/addresses", "reference/cli", "benchmarks"):
        assert (site / path / "index.html").is_file(), path
    assert (site / "tour" / "index.html").is_file()  # the notebook, rendered without running it
    api = page(site, "reference/api")
    assert "load_model" in api and "run_with_cache" in api and "doc-heading" in api  # from the docstrings
    assert ":class:" not in api and ":func:" not in api  # Sphinx roles rendered as code
    for plot in ("lens", "induction", "features"):  # drawn by interp demo while the site builds
        png = site / "getting-started" / "demo-plots" / f"{plot}.png"
        assert png.is_file() and not _blank(png), plot
        assert f'src="../demo-plots/{plot}.png"' in page(site, "getting-started/demo"), plot


def test_every_marker_is_replaced(site: pathlib.Path) -> None:
    for html in site.rglob("*.html"):
        assert "<!-- generated:" not in html.read_text(encoding="utf-8"), html


def test_a_page_that_lands_later_joins_the_navigation(tmp_path: pathlib.Path) -> None:
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "plots.md").write_text("# Plots\n")
    config = {"docs_dir": str(tmp_path), "nav": [{"Guides": [{"Plots": "guides/plots.md"}]}]}
    assert hooks.on_config(config)["nav"] == [{"Guides": [{"Plots": "guides/plots.md"}]}]
    (tmp_path / "guides" / "circuits.md").write_text("text first\n\n# Circuits and transcoders\n")
    guides = hooks.on_config(config)["nav"][0]["Guides"]
    assert guides == [{"Plots": "guides/plots.md"}, {"Circuits and transcoders": "guides/circuits.md"}]
    assert hooks.on_config(config)["nav"][0]["Guides"] == guides  # once


def test_an_unknown_marker_fails_the_build() -> None:
    with pytest.raises(KeyError, match="nope"):
        hooks.generate("<!-- generated: nope -->")
    with pytest.raises(KeyError, match="no benchmark"):
        hooks.generate("<!-- generated: bench:nope -->")


# -- the generated tables are the code's tables --------------------------------------------------------


def test_the_vocabulary_is_the_kind_rows(site: pathlib.Path) -> None:
    from interp_engine import ALIASES, KINDS

    html = unescape(page(site, "reference/addresses"))
    for kind, info in KINDS.items():
        assert f"<code>{kind}</code>" in html and info.meaning.split("(")[0].strip()[:30] in html, kind
    for alias in ALIASES:
        assert f"<code>{alias}</code>" in html, alias
    fake = dict(KINDS, fake_kind=replace(KINDS["mlp_out"], meaning="a kind added in a test", order=230))
    table = hooks.render_kinds(fake)
    assert "| `fake_kind` L | d_model | yes | a kind added in a test |" in table
    assert table.index("`mlp_out`") < table.index("`fake_kind`") < table.index("`resid_post`")  # forward order
    assert "| `fake` | `resid_post` |" in hooks.render_aliases({"fake": "resid_post"})
    needs = hooks.render_needs(dict(KINDS, fake_kind=replace(KINDS["mlp_post"], missing="a test says so")))
    assert "| `fake_kind` | `dense_mlp` | a test says so |" in needs


def test_the_op_table_is_the_registry(site: pathlib.Path) -> None:
    from interp_engine.steering._writes import OP_ROWS, op_table

    assert hooks.generate("<!-- generated: ops -->") == op_table()
    html = page(site, "guides/steering")
    for row in OP_ROWS:
        assert f"<td><code>{row.name}</code></td>" in html, row.name


def test_the_error_tree_is_the_classes(site: pathlib.Path) -> None:
    from interp_engine import InterpError

    html = page(site, "reference/errors")
    pending = [InterpError]
    while pending:
        cls = pending.pop()
        assert f"<code>{cls.__name__}</code>" in html, cls
        # the core's tree: a backend's or a test's subclass exists only where its module was imported
        pending += [sub for sub in cls.__subclasses__() if sub.__module__.split(".")[0] == "interp_engine"]

    class Root(Exception):
        """The root of a test's tree."""

    class Child(Root, KeyError):
        """A child that is also a KeyError.

        More text that is not shown."""

    tree = hooks.render_errors(Root)
    assert tree.splitlines() == [
        "- **`Root`**: The root of a test's tree.",
        "    - **`Child`** (KeyError): A child that is also a KeyError.",
    ]


def test_the_cli_reference_is_the_parser(site: pathlib.Path) -> None:
    from interp_engine.cli import build_parser

    html = page(site, "reference/cli")
    for name, sub in hooks._subcommands(build_parser()).items():
        assert f"interp {name}" in html, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"<code>{option}</code>" in html, (name, option)
    parser = argparse.ArgumentParser(prog="interp")
    sub = parser.add_subparsers().add_parser("frob", description="Frobs a model.")
    sub.add_argument("--depth", type=int, default=3, help="how deep")
    text = hooks.render_cli(parser)
    assert "### `interp frob`" in text and "Frobs a model." in text
    assert "| `--depth` `DEPTH` | `3` | how deep |" in text


def test_the_http_reference_is_the_schema(site: pathlib.Path) -> None:
    from interp_engine.server import create_app

    html = page(site, "reference/http")
    for path in create_app("interp:tiny").openapi()["paths"]:
        assert f"<code>{path}</code>" in html, path
    schema = {
        "paths": {"/v1/frob": {"post": {"description": "Frobs.", "requestBody": _body("FrobRequest")}}},
        "components": {
            "schemas": {
                "FrobRequest": {"properties": {"depth": {"type": "integer", "description": "how deep"}}, "required": []}
            }
        },
    }
    text = hooks.render_http(schema)
    assert "| `POST` | `/v1/frob` | `FrobRequest` | Frobs. |" in text
    assert "| `depth` | integer |  | how deep |" in text


def _body(name: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


# -- the model types ---------------------------------------------------------------------------------


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_type_table_is_the_backends_verdict(site: pathlib.Path) -> None:
    """One row per model type the eager backend names, each cell what that backend's own code
    makes of a tiny model of the type (the build's run is read back, not redone)."""
    from interp_eager import verified_model_types
    from interp_engine import load_model
    from interp_testkit.suite import tiny_model_path

    support = hooks.model_type_support()
    assert sorted(support) == verified_model_types()
    html = unescape(page(site, "reference/model-types"))
    for model_type, row in support.items():
        assert f"<code>{model_type}</code>" in html, model_type
        for entry in row.values():
            assert entry["status"] in ("serves", "refused") and (entry["status"] == "serves") == ("kinds" in entry)
            if "reason" in entry:
                assert entry["reason"] in html, (model_type, entry["reason"])
    assert "Model architectures ['XGLMForCausalLM'] are not supported" in html  # vLLM's own refusal
    model = load_model(str(tiny_model_path("gpt2")), backend="eager")  # the eager cell, loaded here
    assert support["gpt2"]["eager"] == {"status": "serves", "kinds": list(model.points())}


def test_a_model_type_row_says_what_each_backend_serves() -> None:
    support = {
        "frob": {
            "eager": {"status": "serves", "kinds": ["embed", "logits"]},
            "vllm": {"status": "refused", "reason": "no"},
        },
        "grob": {
            "eager": {"status": "serves", "kinds": ["embed", "attn_scores"]},
            "vllm": {"status": "serves", "kinds": ["embed", "logits_raw"]},
        },
    }
    text = hooks.render_model_types(support)
    assert "| `frob` | ✓ 2 kinds | refused | vllm: no |" in text
    assert "| `grob` | ✓ 2 kinds | ✓ 2 kinds | only eager serves `attn_scores`; only vllm serves `logits_raw` |" in text
    assert text.endswith("Served: eager 2 of 2 model types, vllm 1.")


def test_the_verified_table_is_the_committed_results(site: pathlib.Path) -> None:
    data = json.loads(hooks.VERIFIED.read_text())
    assert set(data["results"]) == {"eager", "vllm", "vllm-static"} and data["about"]
    for backend, table in data["results"].items():
        for model_type, entry in table.items():
            assert entry["status"] in ("verified", "fails", "refused"), (backend, model_type)
            assert isinstance(entry["kinds_checked"], int) and len(entry["recorded"]) == 10, (backend, model_type)
            assert entry["commit"] is None or len(entry["commit"]) == 40, (backend, model_type)
    html = page(site, "reference/model-types")
    assert 'href="../model-types-verified.json"' in html
    assert (site / "reference" / "model-types-verified.json").is_file()  # the data, served beside its table
    entry = {"status": "verified", "kinds_checked": 3, "recorded": "2026-01-02"}
    fake = {"results": {"eager": {"frob": entry}, "vllm": {}}}
    assert "| `frob` | ✓ 3 kinds (2026-01-02) | not run |  |" in hooks.render_verified(fake)


def test_recording_results_replaces_their_entries(tmp_path: pathlib.Path) -> None:
    family_table = _script("family_table")
    (tmp_path / "vllm").mkdir()
    reason = f"vLLM cannot build a config for '{ROOT}/.cache/test-models/frob-vllm': no"
    record = {"model_type": "frob", "backend": "vllm", "status": "refused", "kinds": [], "reason": reason}
    (tmp_path / "vllm" / "frob.json").write_text(json.dumps(record))
    before = {"results": {"vllm": {"frob": {"status": "verified"}, "grob": {"status": "fails"}}}}
    data = family_table.merge(before, family_table.load_results(tmp_path))
    assert data["results"]["vllm"]["grob"] == {"status": "fails"}  # no result: kept
    frob = data["results"]["vllm"]["frob"]
    assert (frob["status"], frob["kinds_checked"]) == ("refused", 0)
    assert frob["reason"] == "vLLM cannot build a config for MODEL: no" and len(frob["commit"]) == 40


# -- benchmark figures and their age -----------------------------------------------------------------


def _git(repo: pathlib.Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _commit(repo: pathlib.Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


def _record(commit: str, value: float = 0.99) -> dict[str, Any]:
    return {
        "schema": 1,
        "bench": "fake",
        "measures": ["code", "bench/fake.py"],
        "runs": [
            {
                "command": ".venv/bin/python bench/fake.py",
                "commit": commit,
                "dirty": False,
                "date": "2026-12-04T23:50:00Z",
                "machine": {"cores": 2, "cpu": "a CPU", "python": "3.11.7", "torch": "2.13.0", "vllm": None},
                "results": [
                    {"name": "capture_vs_plain", "value": value, "target": "0.97", "met": True, "rounds": [1.0, 0.98]},
                    {"name": "bytes", "value": None, "target": None, "met": None, "rounds": None, "note": "not run"},
                ],
            }
        ],
    }


def test_a_figure_shows_its_age_in_commits(tmp_path: pathlib.Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    ran_at = _commit(repo, "code/a.py", "x = 1\n")
    results = repo / "bench" / "results"
    results.mkdir(parents=True)
    (repo / "bench" / "fake.py").write_text("")
    before = hooks.render_bench_section("fake", results, repo)
    assert "No results recorded yet: `.venv/bin/python bench/fake.py`" in before
    (results / "fake.json").write_text(json.dumps(_record(ran_at)))
    text = hooks.render_bench_section("fake", results, repo)
    assert "| `capture_vs_plain` | 0.99 | 0.97 | yes | 1, 0.98 |  |" in text
    assert "| `bytes` | — |  |  |  | not run |" in text
    assert "current: no commit since it ran" in text and hooks.stale_results(results, repo) == {}
    _commit(repo, "docs/other.md", "not measured\n")  # outside the measured paths: still current
    assert "current" in hooks.render_bench_section("fake", results, repo)
    _commit(repo, "code/a.py", "x = 2\n")
    _commit(repo, "code/b.py", "y = 1\n")
    assert "**stale: 2 commits** since it ran" in hooks.render_bench_section("fake", results, repo)
    assert hooks.stale_results(results, repo) == {"fake": 2}
    (results / "fake_narrow.json").write_text(json.dumps(_record("f" * 40, 0.5)))  # a variant, from elsewhere
    text = hooks.render_bench_section("fake", results, repo)
    assert "**`fake`**" in text and "| 0.5 |" in text and "is not in this checkout's history" in text
    assert hooks.stale_results(results, repo) == {"fake": 2, "fake_narrow": None}


def test_every_benchmark_has_its_table_on_the_page(site: pathlib.Path) -> None:
    markdown = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "<!-- generated: bench-others -->" in markdown  # a benchmark without a section of its own
    html = page(site, "benchmarks")
    for name in hooks.bench_names():
        if f"<!-- generated: bench:{name} -->" not in markdown:
            assert f'<h3 id="{name}"><code>{name}</code>' in html, name  # under "Other benchmarks"
        for path in hooks.result_files(name):
            assert f"bench-results/{path.name}" in html and (site / "bench-results" / path.name).is_file()
        if not hooks.result_files(name):
            assert f"bench/{name}.py</code> writes" in html, name


def test_a_new_benchmark_gets_a_section_of_its_own(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "known.py").write_text('"""Known."""\n')
    (tmp_path / "bench" / "frob.py").write_text('"""Frobs the model:\nhow fast.\n\nMore."""\n')
    (tmp_path / "bench" / "_helper.py").write_text("")
    text = hooks.render_other_benches({"known"}, tmp_path / "bench" / "results", tmp_path)
    assert text.splitlines()[:3] == ["### `frob`", "", "Frobs the model: how fast."]
    assert "No results recorded yet: `.venv/bin/python bench/frob.py`" in text
    assert "known" not in text and "_helper" not in text


def test_the_result_files_are_valid_and_their_age_is_known() -> None:
    """Every recorded result has the schema the page reads; stale ones are reported (a benchmark
    takes minutes to an hour on this machine, so a stale figure is flagged, not a failure)."""
    for path in sorted(hooks.RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        assert record["schema"] == 1 and record["measures"] and record["runs"], path
        for run in record["runs"]:
            assert len(run["commit"]) == 40 and {"command", "date", "machine", "results"} <= set(run), path
            assert all({"name", "value", "target", "met"} <= set(result) for result in run["results"]), path
    stale = hooks.stale_results()
    if stale:
        warnings.warn(f"benchmark results older than the code they measure (commits since): {stale}", stacklevel=1)


# -- the site in a browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(site: pathlib.Path) -> Iterator[str]:
    """The built site over HTTP on a free loopback port, as ``mkdocs serve`` would serve it."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Debian's Chromium, headless, with a fresh profile and no background network traffic."""
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def _blank(png: pathlib.Path) -> bool:
    """Whether a screenshot is one flat colour (nothing rendered)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    return float(pixels[..., :3].std()) < 0.02


@pytest.mark.parametrize(
    ("path", "title", "code"),
    [("", "interp-engine", "load_model"), ("reference/api/", "API", "run_with_cache")],
)
def test_a_page_renders_in_a_browser(
    browser: Any, served: str, tmp_path: pathlib.Path, path: str, title: str, code: str
) -> None:
    tab = browser.new_page()
    try:
        tab.goto(served + path, wait_until="load")
        assert tab.title().startswith(title), tab.title()
        nav = tab.locator("nav.md-nav--primary").first
        assert nav.is_visible()
        for section in ("Getting started", "Guides", "Backends", "Reference"):
            assert nav.get_by_text(section, exact=True).count() >= 1, section
        block = tab.locator("div.highlight pre, .doc-signature pre").filter(has_text=code).first
        assert block.is_visible()
        assert block.locator("span").count() > 3  # highlighted: the code is split into styled tokens
        shot = tmp_path / "page.png"
        tab.screenshot(path=str(shot))
        assert shot.stat().st_size > 20_000 and not _blank(shot)
    finally:
        tab.close()
