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
next lines while it ends in ``\`` or has a quote open. ```` ```{.console fixture:NAME} ```` sets the fixture up first.

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
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
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
    for name in fixtures:
        request.getfixturevalue(name)
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command, shown in session(text):
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{path.relative_to(ROOT)}:{line}: {command}\n{done.stderr}"
        printed = [out for out in done.stdout.splitlines() if not VLLM_LOG.match(out)]
        assert same_output(shown, printed), (
            f"{path.relative_to(ROOT)}:{line}: {command} printed\n"
            + "\n".join(printed)
            + "\nbut shows\n"
            + "\n".join(shown)
        )


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
