"""docs/tour.ipynb: kept without outputs in git, and executed here cell by cell in a real Python
kernel (nbclient), every cell without an error, printing what the tour says it shows."""

from __future__ import annotations

import pathlib
import re

import nbformat
from nbclient import NotebookClient

TOUR = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tour.ipynb"


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_the_tour_is_stored_without_outputs() -> None:
    notebook = nbformat.read(TOUR, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_the_tour_runs_and_shows_what_it_says() -> None:
    notebook = nbformat.read(TOUR, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(TOUR.parent)}}
    ).execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    printed = "\n".join(_text(c) for c in code)
    assert "(' Paris', 0.652)" in printed
    assert "rank of ' Paris' at the last position, per stream: [994, 64, 29, 4, 0]" in printed
    assert re.search(r"induction score of head 1\.0: 1\.00; with head 0\.0 ablated: 0\.[0-2]\d", printed)
    corr = re.search(r"France -> Italy: correlation of the estimate with real patching, per head: ([-\d.]+)", printed)
    assert corr is not None and float(corr.group(1)) > 0.9
    sums = re.search(r"sum of the components: ([-\d.]+); the model's logit difference: ([-\d.]+)", printed)
    assert sums is not None and sums.group(1) == sums.group(2)
    assert "steered: ' Berlin.'" in printed
    assert "top features at ' France': [813," in printed
    figures = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 5  # lens, induction, patching, DLA, features drawn inline
