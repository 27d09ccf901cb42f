"""The ``interp`` command run in process, and what its tests check in its output."""

from __future__ import annotations

import pathlib

import pytest

from interp_engine.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def interp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``main`` in process: (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse: --help and usage errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def our_lines(err: str) -> list[str]:
    """The stderr lines the command wrote (the backend's own weight-loading bar aside)."""
    return [line for line in err.splitlines() if line.startswith("interp")]


def is_png(path: pathlib.Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG
