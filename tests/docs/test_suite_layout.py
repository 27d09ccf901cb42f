"""The test suite's own layout: one folder per part of the code, each a package (so that pytest
names its modules by folder); no test module imports another or a conftest (shared helpers live in
``interp_testkit`` and ``tests/support``, shared fixtures in the conftests), so any module runs
alone and in any order."""

from __future__ import annotations

import ast
import pathlib

from interp_testkit.suite import ROOT

TESTS = ROOT / "tests"
FOLDERS = sorted(p.parent for p in TESTS.glob("*/test_*.py"))


def _imported(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(level, module)`` of every ``from ... import`` in ``path`` (relative ones with their level)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
        elif isinstance(node, ast.Import):
            out.extend((0, alias.name) for alias in node.names)
    return out


def test_no_test_module_at_the_top_level() -> None:
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_every_test_folder_is_a_package() -> None:
    assert len(set(FOLDERS)) >= 8
    for folder in set(FOLDERS):
        assert (folder / "__init__.py").is_file(), folder


def test_test_module_names_are_unique_across_folders() -> None:
    names = [p.name for p in TESTS.glob("*/test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        for level, module in _imported(path):
            last = module.rsplit(".", 1)[-1]
            if last.startswith("test_") or last == "conftest" or (level == 0 and module.startswith("tests.")):
                offenders.append(f"{path.relative_to(ROOT)}: {'.' * level}{module}")
    assert offenders == []
