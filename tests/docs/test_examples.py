r"""Every Python example of the READMEs and the documentation site runs, and prints what it shows.

The code blocks are collected with pytest-markdown-docs's parser (the fence options of
mkdocs-material's superfences: ```` ```{.python continuation} ```` continues the block before
it, ```` ```{.python fixture:NAME} ```` puts the pytest fixture ``NAME`` in the block's globals).
A line ``#> text`` in a block is output: the block's printed lines must equal those lines in
order (``...`` matches anything, as in doctest). A block runs as a script
(``__name__ == "__main__"``) in a fresh folder of its own.

A ```` ```console ```` block is a terminal session: each ``$ COMMAND`` line runs in bash (with
this environment's ``interp`` on the ``PATH``), in a fresh folder per block, and the lines after
it up to the next ``$`` are what it prints (stdout, compared as above); a command goes on over the
next lines while it ends in ``\`` or has a quote open. ```` ```{.console fixture:NAME} ```` sets the fixture up first;
a fixture that returns a :class:`ConsoleSetup` also sets environment variables (``$MODEL``) or
prepares the folder (``fixture:checkout``: the folder is a view of the checkout's root, its files
linked, so ``.venv/bin/...`` and ``packages/...`` work as they do there and what the commands
write stays in the folder). A command that ends in `` &`` runs in the background, as in a
terminal (a server), and is stopped, with its process group, when the block ends; a later
command of the block waits for it (``curl --retry-connrefused``).

Shell blocks that are not terminal sessions (```` ```bash ````) hold only ``pip install``
commands, which cannot run without the network: each requirement they name, and each ``pip
install`` in a page's inline code, must be a distribution of this workspace with the extras its
pyproject.toml declares, or a folder of the checkout with a pyproject.toml declaring them
(:func:`pip_install_problems`). Every other command is a console block, run here.

Only examples that need what CI cannot have are skipped, by a fixture that says why:
``fixture:needs_hub`` (a model from the Hugging Face hub) and ``fixture:needs_gpu`` (CUDA). The
vLLM examples run on one engine of ``interp:tiny`` shared by every block that names
``fixture:vllm_tiny``; the HTTP client examples on one ``interp serve interp:tiny`` at
``127.0.0.1:8000`` with the SAE the serving guide writes attached as ``res``
(``fixture:interp_server``).
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import io
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from markdown_it import MarkdownIt
from pytest_markdown_docs.plugin import FenceSyntax, extract_fence_tests, parse_superfences_block_info

ROOT = pathlib.Path(__file__).resolve().parents[2]


def documents() -> list[pathlib.Path]:
    """The README, the packages' READMEs and every page of the site."""
    packages = sorted((ROOT / "packages").glob("*/README.md"))
    return [ROOT / "README.md", *packages, *sorted((ROOT / "docs").rglob("*.md"))]


def blocks() -> list[Any]:
    parser = MarkdownIt("commonmark")
    found = []
    for path in documents():
        found += extract_fence_tests(
            parser, path.read_text(encoding="utf-8"), 0, path, "md", fence_syntax=FenceSyntax.superfences
        )
    return found


BLOCKS = blocks()


Console = tuple[pathlib.Path, int, str, tuple[str, ...]]


def console_blocks() -> list[Console]:
    """``(path, first line, text, fixture names)`` of every ```` ```console ```` block (and
    ```` ```{.console fixture:NAME} ````)."""
    found = []
    for path in documents():
        for token in MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8")):
            info = parse_superfences_block_info(token.info) if token.type == "fence" else []
            if info[:1] == ["console"] and token.map:
                options = [option for option in info[1:] if option.startswith("fixture:")]
                fixtures = tuple(option.removeprefix("fixture:") for option in options)
                found.append((path, token.map[0] + 1, token.content, fixtures))
    return found


CONSOLES = console_blocks()

SHELLS = ("bash", "sh", "shell")


def shell_blocks() -> list[tuple[pathlib.Path, int, str]]:
    """``(path, first line, text)`` of every ```` ```bash ```` (sh, shell) block."""
    found = []
    for path in documents():
        for token in MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8")):
            info = parse_superfences_block_info(token.info) if token.type == "fence" else []
            if info[:1] and info[0] in SHELLS and token.map:
                found.append((path, token.map[0] + 1, token.content))
    return found


PIP_INSTALL = re.compile(r"(?:^|[\s/])pip install\b")


def pip_installs() -> list[tuple[pathlib.Path, int, str]]:
    """Every ``pip install`` command of the documents: the lines of shell and console blocks
    and the pages' inline code."""
    found = []
    for path in documents():
        tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
        for token in tokens:
            line = token.map[0] + 1 if token.map else 0
            if token.type == "fence":
                for command in token.content.splitlines():
                    command = command.removeprefix("$ ")
                    if PIP_INSTALL.search(command):
                        found.append((path, line, command))
            for child in token.children or []:
                if child.type == "code_inline" and PIP_INSTALL.search(child.content):
                    found.append((path, line, child.content))
    return found


def _pyproject(folder: pathlib.Path) -> dict[str, Any] | None:
    import tomllib

    file = folder / "pyproject.toml"
    return tomllib.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def workspace_distributions() -> dict[str, dict[str, Any]]:
    """``{distribution name: its pyproject}`` of the packages under ``packages/``."""
    found = {}
    for folder in sorted((ROOT / "packages").iterdir()):
        project = _pyproject(folder)
        if project is not None:
            found[project["project"]["name"]] = project
    return found


def _extras_problem(spec: str, extras: set[str], project: dict[str, Any]) -> str | None:
    declared = set(project["project"].get("optional-dependencies", {}))
    missing = sorted(extras - declared)
    return f"{spec}: no extra {', '.join(missing)} (declared: {', '.join(sorted(declared))})" if missing else None


def pip_install_problems(command: str, root: pathlib.Path = ROOT) -> list[str]:
    """What in ``command`` (a ``pip install`` line) names nothing this workspace has."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    words = shlex.split(command, comments=True)
    words = words[next(i for i, word in enumerate(words) if word == "install") + 1 :]
    distributions = {canonicalize_name(name): p for name, p in workspace_distributions().items()}
    problems: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-c", "--constraint", "-r", "--requirement"):
            if not (root / words[i + 1]).is_file():
                problems.append(f"{word} {words[i + 1]}: no such file in the checkout")
            i += 2
            continue
        if word in ("-e", "--editable"):
            word, i = words[i + 1], i + 1
        elif word.startswith("-"):
            i += 1
            continue
        i += 1
        folder, _, extras = word.partition("[")
        wanted = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
        if "/" in folder or folder.startswith("."):
            project = _pyproject(root / folder)
            if project is None:
                problems.append(f"{word}: no pyproject.toml at {folder} in the checkout")
            elif problem := _extras_problem(word, wanted, project):
                problems.append(problem)
            continue
        try:
            requirement = Requirement(word)
        except InvalidRequirement as exc:
            problems.append(f"{word}: {exc}")
            continue
        project = distributions.get(canonicalize_name(requirement.name))
        if project is None:
            problems.append(f"{word}: no distribution {requirement.name} in packages/ ({', '.join(distributions)})")
        elif problem := _extras_problem(word, set(requirement.extras), project):
            problems.append(problem)
    return problems


@dataclass(frozen=True)
class ConsoleSetup:
    """What a console block's fixture gives the block: environment variables and a step that
    prepares its folder."""

    env: Mapping[str, str] = field(default_factory=dict)
    prepare: Callable[[pathlib.Path], None] | None = None


def _run_beside(
    command: str, cwd: pathlib.Path, env: Mapping[str, str], background: list[subprocess.Popen[str]]
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, within 600 s; ended early, as failed, when a background
    command of the block exits meanwhile (a server that could not start: nothing will answer)."""
    with subprocess.Popen(
        ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        deadline = time.monotonic() + 600
        while True:
            try:
                out, err = process.communicate(timeout=0.5)
                return subprocess.CompletedProcess(command, process.returncode, out, err)
            except subprocess.TimeoutExpired:
                gone = [p for p in background if p.poll() is not None]
                if gone or time.monotonic() > deadline:
                    process.kill()
                    out, err = process.communicate()
                    why = "a background command exited" if gone else "600 s passed"
                    return subprocess.CompletedProcess(command, -9, out, f"{err}\n(stopped: {why})")


def _stop(process: subprocess.Popen[str]) -> None:
    """Stop a background command and everything it started (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def incomplete(command: str) -> bool:
    """Whether a command goes on to the next line (a trailing backslash, or an open quote)."""
    if command.endswith("\\"):
        return True
    try:
        shlex.split(command)
    except ValueError:
        return True
    return False


def session(text: str) -> list[tuple[str, list[str]]]:
    """The commands of a console block, each with the lines shown after it."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and not steps[-1][1] and incomplete(steps[-1][0]):
            steps[-1] = (steps[-1][0] + "\n" + line, [])
        elif steps:
            steps[-1][1].append(line)
        else:
            raise ValueError(f"a console block starts with a command ($ ...), not {line!r}")
    return steps


def expected_output(source: str) -> list[str]:
    """The ``#> `` lines of a block, in order, without the marker."""
    marked = [line.strip() for line in source.splitlines() if line.strip().startswith("#>")]
    return [line[3:] for line in marked]


def same_output(expected: list[str], printed: list[str]) -> bool:
    checker = doctest.OutputChecker()
    want = "\n".join(line.rstrip() for line in expected) + "\n"
    got = "\n".join(line.rstrip() for line in printed) + "\n"
    return checker.check_output(want, got, doctest.ELLIPSIS)


VLLM_LOG = re.compile(r"^\(\w+ pid=\d+\) (DEBUG|INFO|WARNING|ERROR) ")
"""vLLM's own log lines, which it writes to stdout: not the example's output."""


def run_block(source: str, filename: str, fixtures: dict[str, Any]) -> list[str]:
    """Run one block as a script; its printed lines (vLLM's log lines left out)."""
    module = types.ModuleType("__main__")
    namespace = module.__dict__
    namespace["__file__"] = filename
    namespace.update(fixtures)
    out = io.StringIO()
    code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    return [line for line in out.getvalue().splitlines() if not VLLM_LOG.match(line)]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.source_path.relative_to(ROOT)}:{b.start_line}" for b in BLOCKS])
def test_example(
    block: Any, request: pytest.FixtureRequest, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixtures = {name: request.getfixturevalue(name) for name in block.fixture_names}
    monkeypatch.chdir(tmp_path)
    printed = run_block(block.source, str(block.source_path), fixtures)
    expected = expected_output(block.source)
    if expected or printed:
        assert same_output(expected, printed), (
            f"{block.source_path.relative_to(ROOT)}:{block.start_line} printed\n"
            + "\n".join(printed)
            + "\nbut shows\n"
            + "\n".join(expected)
        )


@pytest.mark.parametrize("console", CONSOLES, ids=[f"{c[0].relative_to(ROOT)}:{c[1]}" for c in CONSOLES])
def test_console(console: Console, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> None:
    path, line, text, fixtures = console
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for name in fixtures:
        setup = request.getfixturevalue(name)
        if isinstance(setup, ConsoleSetup):
            env.update(setup.env)
            if setup.prepare is not None:
                setup.prepare(tmp_path)
    background: list[tuple[str, subprocess.Popen[str], pathlib.Path]] = []
    try:
        for command, shown in session(text):
            if command.rstrip().endswith("&"):
                assert not shown, f"{path.relative_to(ROOT)}:{line}: a background command shows no output"
                log = tmp_path / f"background-{len(background)}.log"
                with log.open("w") as out:
                    process = subprocess.Popen(
                        ["bash", "-c", command.rstrip()[:-1]],
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                background.append((command, process, log))
                continue
            done = _run_beside(command, tmp_path, env, [process for _, process, _ in background])
            logs = "".join(f"\n-- {c} (background):\n{log.read_text()[-4000:]}" for c, _, log in background)
            assert done.returncode == 0, f"{path.relative_to(ROOT)}:{line}: {command}\n{done.stderr}{logs}"
            printed = [out for out in done.stdout.splitlines() if not VLLM_LOG.match(out)]
            assert same_output(shown, printed), (
                f"{path.relative_to(ROOT)}:{line}: {command} printed\n"
                + "\n".join(printed)
                + "\nbut shows\n"
                + "\n".join(shown)
            )
        for command, process, log in background:
            assert process.poll() is None, (
                f"{path.relative_to(ROOT)}:{line}: {command} exited:\n{log.read_text()[-4000:]}"
            )
    finally:
        for _, process, _ in background:
            _stop(process)


def test_examples_are_collected() -> None:
    """The collection finds the examples of every page that has Python (a broken fence would hide them)."""
    pages = {b.source_path.relative_to(ROOT).as_posix() for b in BLOCKS}
    assert {"README.md", "docs/guides/capture.md", "docs/guides/research.md", "docs/guides/saes.md"} <= pages
    assert len(BLOCKS) >= 25


def test_no_block_is_left_out_silently() -> None:
    """``notest`` would drop a block without a word: blocks are skipped only by a fixture that says why."""
    for path in documents():
        text = path.read_text(encoding="utf-8")
        assert "notest" not in text, f"{path.relative_to(ROOT)}: use fixture:needs_hub or fixture:needs_gpu"


RUN_OUTSIDE_THE_SUITE = {
    "bash scripts/test.sh": "the suite itself (CI runs it)",
    "bash scripts/demo.sh": (
        "scripts/setup.sh reinstalls the workspace's editable packages, which the suite's other process "
        "is importing; its two steps run in CI: setup.sh in scripts/test.sh, `interp demo` in every site build "
        "(test_demo_sh_is_setup_then_the_demo)"
    ),
    ".venv/bin/mkdocs build --strict": "tests/docs/test_docs_site.py builds the site so and checks its pages",
}
"""The shell blocks that are not ``pip install`` and are not run here, each with the reason."""


def test_every_shell_command_is_run_or_checked() -> None:
    """A ```` ```bash ```` block holds ``pip install`` lines (checked against the workspace) or one of
    :data:`RUN_OUTSIDE_THE_SUITE`; any other command belongs in a console block, which runs."""
    for path, line, text in shell_blocks():
        for command in text.splitlines():
            command = command.split("#")[0].strip()
            if command and not PIP_INSTALL.search(command):
                assert command in RUN_OUTSIDE_THE_SUITE, (
                    f"{path.relative_to(ROOT)}:{line}: {command!r} is neither run (write it as a console "
                    "block) nor a pip install line"
                )


def test_pip_install_names_what_the_workspace_has() -> None:
    commands = pip_installs()
    assert len(commands) >= 10  # the packages' READMEs, the install page, the guides' extras
    for path, line, command in commands:
        assert not pip_install_problems(command), (
            f"{path.relative_to(ROOT)}:{line}: {command}",
            pip_install_problems(command),
        )


def test_a_wrong_pip_install_is_caught() -> None:
    assert not pip_install_problems('pip install interp-core "interp-vllm[cuda,ray]" -e packages/interp-eager[peft]')
    assert not pip_install_problems('.venv/bin/pip install -c constraints.txt -e ".[bench]"  # comment [x]')
    assert pip_install_problems("pip install interp-cor")  # no such distribution
    assert pip_install_problems('pip install "interp-core[plot]"')  # the extra is plots
    assert pip_install_problems("pip install -e packages/interp-nope")
    assert pip_install_problems("pip install -c nope.txt interp-core")


def test_the_entry_point_example_is_the_group_the_core_reads() -> None:
    """docs/backends/writing.md's pyproject snippet registers under the group the core's plugin
    discovery reads, as tests/toy_backend (a third-party backend the suite installs) does."""
    import tomllib

    from interp_engine.hookspecs import ENTRY_POINT_GROUP

    page = ROOT / "docs" / "backends" / "writing.md"
    fences = [t for t in MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8")) if t.type == "fence"]
    snippets = [tomllib.loads(t.content) for t in fences if t.info.strip() == "toml"]
    assert len(snippets) == 1
    assert set(snippets[0]["project"]["entry-points"]) == {ENTRY_POINT_GROUP}
    toy = tomllib.loads((ROOT / "tests" / "toy_backend" / "pyproject.toml").read_text())
    assert ENTRY_POINT_GROUP in toy["project"]["entry-points"]


def test_demo_sh_is_setup_then_the_demo() -> None:
    """What lets CI stand for ``bash scripts/demo.sh``: it is setup.sh (run by test.sh) and then
    ``interp demo`` with the arguments given (run by every site build)."""
    lines = [ln for ln in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[-2:] == ["bash scripts/setup.sh", 'exec .venv/bin/interp demo "$@"']
    assert "bash scripts/setup.sh" in (ROOT / "scripts" / "test.sh").read_text().splitlines()


def test_a_server_that_cannot_start_fails_the_block_at_once(tmp_path: pathlib.Path) -> None:
    block = "$ exit 3 &\n$ sleep 120\n"
    started = time.monotonic()
    with pytest.raises(AssertionError, match="a background command exited"):
        test_console((ROOT / "README.md", 0, block, ()), tmp_path, None)  # type: ignore[arg-type]
    assert time.monotonic() - started < 30


def test_a_background_command_is_stopped(tmp_path: pathlib.Path) -> None:
    """A console block's `` &`` command runs while the block goes on, and does not outlive it."""
    pid_file = tmp_path / "pid"
    block = (
        f"$ echo $$ > {pid_file}; sleep 300 &\n$ for i in $(seq 50); do [ -s {pid_file} ] && break; sleep 0.1; done\n"
    )
    console = (ROOT / "README.md", 0, block, ())
    test_console(console, tmp_path, None)  # type: ignore[arg-type]
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


def test_output_lines_are_checked() -> None:
    assert same_output(["a ... c"], ["a b c"])
    assert not same_output(["0.65"], ["0.64"])
    assert not same_output(["x"], [])


# -- fixtures the blocks name ----------------------------------------------------------------------


@pytest.fixture
def needs_hub() -> None:
    pytest.skip("needs a model from the Hugging Face hub (this machine has no network)")


@pytest.fixture
def needs_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def link_checkout(folder: pathlib.Path) -> None:
    """Make ``folder`` look like the checkout's root: a link to each of its entries but git's."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "site"):
            (folder / entry.name).symlink_to(entry)


@pytest.fixture
def checkout() -> ConsoleSetup:
    """The block runs where a user of the checkout runs it: its root (a view of it, linked)."""
    return ConsoleSetup(prepare=link_checkout)


@pytest.fixture
def tiny_env() -> ConsoleSetup:
    """``$MODEL``: the folder of ``interp:tiny`` (for servers that take a folder, not its name)."""
    from interp_engine import tiny_model_path

    return ConsoleSetup(env={"MODEL": str(tiny_model_path())})


@pytest.fixture(scope="module")
def vllm_tiny() -> Iterator[Any]:
    """``interp:tiny`` on the vllm backend behind its sync facade, one engine for every block."""
    from interp_engine import load_model, sync_model
    from interp_testkit.suite import KV_CACHE_BYTES

    model = sync_model(load_model("interp:tiny", backend="vllm", kv_cache_memory_bytes=KV_CACHE_BYTES))
    model.warmup()
    yield model
    model.shutdown()


def write_serving_sae(folder: pathlib.Path) -> None:
    """The SAE docs/guides/serving.md writes: a random 512-feature TopK SAE over ``resid_post.1``."""
    import torch

    from interp_engine import Sae

    g = torch.Generator().manual_seed(0)
    W_enc, W_dec = torch.randn(128, 512, generator=g) * 0.1, torch.randn(512, 128, generator=g) * 0.1
    Sae("topk", W_enc, torch.zeros(512), W_dec, torch.zeros(128), "blocks.1.hook_resid_post", k=8).save(folder)


@pytest.fixture(scope="module")
def interp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``interp serve interp:tiny --sae res=res-sae`` on 127.0.0.1:8000 (eager), as the serving
    guide starts it."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8000)) == 0:
            raise RuntimeError("127.0.0.1:8000 is taken: the serving examples need it")
    folder = tmp_path_factory.mktemp("serving")
    write_serving_sae(folder / "res-sae")
    command = [sys.executable, "-m", "interp_engine.cli", "serve", "interp:tiny", "--sae", f"res={folder / 'res-sae'}"]
    command += ["--port", "8000"]
    log = folder / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get("http://127.0.0.1:8000/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"interp serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield "http://127.0.0.1:8000"
    finally:
        server.terminate()
        server.wait(timeout=60)
