"""The README's "Research workflows" section runs as written on the shipped model (eager), and
prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Research workflows")
    return text[start : text.index("\n## ", start + 1)]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(), re.S)


def test_every_research_example_runs() -> None:
    blocks = _blocks()
    assert len(blocks) >= 2
    for block in blocks:  # each block stands alone (its own imports and model)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            exec(compile(block, str(README), "exec"), {})


def test_the_patching_example_prints_what_its_comments_say() -> None:
    (block,) = [b for b in _blocks() if "patching.sweep" in b]
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        exec(compile(block, str(README), "exec"), namespace)
    printed = out.getvalue().splitlines()
    assert printed[0] == "('layer', 'position') torch.Size([4, 5])"
    clean, corrupt = (float(x) for x in printed[1].split())
    said = re.search(r"the unpatched runs' metric: ([-\d.]+), ([-\d.]+)", block)
    assert said is not None
    assert (f"{clean:.2f}", f"{corrupt:.1f}") == (said.group(1), said.group(2))
    top = namespace["restored"].top(3)  # type: ignore[attr-defined]
    assert all(value > 0.9 for _, value in top)  # cells that restore (nearly) all of it
