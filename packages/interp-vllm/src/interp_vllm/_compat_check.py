""":mod:`._compat`'s rows checked against the *sources* of a vLLM release, without installing it.

:meth:`._compat.Patch.check` checks a target against the installed vLLM. A vLLM release that is
not installed (one that only ships CUDA wheels, or the next one) is checked here from its files:
each row whose versions include the release must find, by parsing the module's source,

- for a :class:`~._compat.Patch`: its class (or module-level function) and the method, defined on
  the class itself, with the parameters the row names (an added method must not exist);
- for a :class:`~._compat.Reads`: each name as an annotated field of the class body, an
  attribute assigned on ``self`` in one of its methods, or a method or property.

``scripts/check_vllm_runner.py`` runs it on the wheels of the releases the ``cuda`` extra allows;
``tests/vllm/test_vllm_compat.py`` runs it on the installed vLLM's own files.
"""

from __future__ import annotations

import ast
import pathlib
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import _compat
from ._compat import Patch, Reads

Source = Callable[[str], str | None]
"""A release's file by its path inside the distribution (``"vllm/envs.py"``), ``None`` if absent."""


@dataclass(frozen=True)
class Finding:
    """One row checked: ``ok``, or ``problem`` says what is missing; ``skipped`` rows are for
    other releases."""

    row: str
    why: str
    status: str  # "ok" | "problem" | "skipped" | "absent" (an optional class this release lacks)
    detail: str = ""


def tree_source(root: pathlib.Path) -> Source:
    """Files under ``root`` (the folder that holds ``vllm/``)."""

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None

    return read


def wheel_source(wheel: pathlib.Path) -> Source:
    """Files inside a wheel, read from the archive."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(path: str) -> str | None:
        return archive.read(path).decode() if path in names else None

    return read


def version_of(source: Source) -> str | None:
    """The release of the vLLM whose files ``source`` reads (from ``vllm/_version.py``)."""
    text = source("vllm/_version.py")
    match = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", text or "")
    return match.group(1) if match else None


def _module_path(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


def _parse(source: Source, module: str) -> ast.Module | None:
    for path in _module_path(module):
        text = source(path)
        if text is not None:
            return ast.parse(text)
    return None


def _find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """What the class body defines: methods, properties, annotated and assigned fields."""
    found: dict[str, ast.AST] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(node.name, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, node)
    return found


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes assigned on ``self`` anywhere in the class's methods."""
    names = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


def check_patch(patch: Patch, source: Source) -> str | None:
    """What is wrong with ``patch`` in the release ``source`` reads (``None``: nothing; ``""``:
    an optional class it lacks)."""
    module, _, path = patch.target.partition(":")
    tree = _parse(source, module)
    if tree is None:
        return "" if patch.optional else f"module {module} does not exist"
    owner_name, _, attr = path.rpartition(".")
    if not owner_name:  # a module-level function
        function = next(
            (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr), None
        )
        if function is None:
            return f"{module}.{attr} does not exist"
        missing = [p for p in (patch.parameters or ()) if p not in _parameters(function)]
        return f"{module}.{attr} takes ({', '.join(_parameters(function))})" if missing else None
    cls = _find_class(tree, owner_name)
    if cls is None:
        return "" if patch.optional else f"class {module}.{owner_name} does not exist"
    member = _members(cls).get(attr)
    if patch.parameters is None:
        return f"{owner_name}.{attr} already exists" if member is not None else None
    if member is None:
        return "" if patch.optional else f"{owner_name}.{attr} is not defined on the class itself"
    if not isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{owner_name}.{attr} is not a method"
    names = _parameters(member)
    missing = [p for p in patch.parameters if p not in names]
    return f"{owner_name}.{attr} takes ({', '.join(names)}), without {', '.join(missing)}" if missing else None


def check_reads(reads: Reads, source: Source) -> str | None:
    """What ``reads`` misses in the release ``source`` reads (``None``: nothing; ``""``: an
    optional class it lacks)."""
    module, _, owner_name = reads.target.partition(":")
    tree = _parse(source, module)
    cls = _find_class(tree, owner_name) if tree is not None else None
    if cls is None:
        return "" if reads.optional else f"class {module}.{owner_name} does not exist"
    known = set(_members(cls)) | _self_attributes(cls)
    missing = [name for name in reads.names if name not in known]
    return f"{owner_name} has no {', '.join(missing)}" if missing else None


def rows() -> Iterator[Patch | Reads]:
    """Every vLLM row of :mod:`._compat`."""
    for value in vars(_compat).values():
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, tuple):
                yield from (i for i in item if isinstance(i, (Patch, Reads)) and i.package == "vllm")
            elif isinstance(item, (Patch, Reads)) and item.package == "vllm":
                yield item


def check(source: Source, version: str) -> list[Finding]:
    """Every vLLM row of :mod:`._compat` against the release ``source`` reads (``version``)."""
    findings = []
    seen = set()
    for row in rows():
        key = (type(row).__name__, row.target, getattr(row, "names", None))
        if key in seen:
            continue
        seen.add(key)
        if not row.in_range(version):
            findings.append(Finding(row.target, row.why, "skipped", f"written for {row.spelled}"))
            continue
        problem = check_patch(row, source) if isinstance(row, Patch) else check_reads(row, source)
        if problem is None:
            findings.append(Finding(row.target, row.why, "ok"))
        elif problem == "":
            findings.append(Finding(row.target, row.why, "absent", "optional; not in this release"))
        else:
            findings.append(Finding(row.target, row.why, "problem", problem))
    return findings


def check_tree(root: pathlib.Path, version: str) -> list[str]:
    """The problems of the vLLM whose files are under ``root`` (empty: none)."""
    return [f"{f.row}: {f.detail}" for f in check(tree_source(root), version) if f.status == "problem"]


__all__ = ["Finding", "check", "check_patch", "check_reads", "check_tree", "tree_source", "version_of", "wheel_source"]
