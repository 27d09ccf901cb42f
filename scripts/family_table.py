"""Render the documentation's table of model types from what the family tests recorded.

The family tests (``tests/eager/test_eager_families.py``, ``tests/vllm/test_vllm_families.py`` and the
sweep of every model type, ``pytest -m sweep`` on the vLLM family tests) write one JSON per model type and backend to
``.cache/family-results/<backend>/<model_type>.json``::

    {"model_type": "gpt_neox", "backend": "vllm", "status": "verified" | "refused" | "fails",
     "kinds": ["attn_in", ...], "reason": ""}

This script joins them into one markdown table (model type; eager, vllm, vllm-static: how many
address kinds were checked against HF, or "refused"; what is refused and why) and writes it
between the ``<!-- family-table -->`` markers of docs/reference/model-types.md (``--print``: to stdout
instead).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".cache" / "family-results"
BACKENDS = ("eager", "vllm", "vllm-static")
START, END = "<!-- family-table:start -->", "<!-- family-table:end -->"


def load(results: pathlib.Path) -> dict[str, dict[str, dict[str, object]]]:
    """``{model_type: {backend: record}}`` from every recorded result."""
    table: dict[str, dict[str, dict[str, object]]] = {}
    for path in sorted(results.glob("*/*.json")):
        record = json.loads(path.read_text())
        table.setdefault(str(record["model_type"]), {})[str(record["backend"])] = record
    return table


def cell(record: dict[str, object] | None) -> str:
    if record is None:
        return "not run"
    if record.get("status") == "verified":
        kinds = record.get("kinds") or []
        return f"✓ {len(kinds)} kinds" if isinstance(kinds, list) else "✓"
    return "fails" if record.get("status") == "fails" else "refused"


def render(table: dict[str, dict[str, dict[str, object]]]) -> str:
    lines = [
        "| model type | eager | vllm | vllm-static | refused or failing, and why |",
        "|---|---|---|---|---|",
    ]
    for model_type in sorted(table):
        row = table[model_type]
        reasons = [
            f"{backend}: {row[backend].get('reason')}"
            for backend in BACKENDS
            if backend in row and row[backend].get("status") != "verified" and row[backend].get("reason")
        ]
        cells = " | ".join(cell(row.get(backend)) for backend in BACKENDS)
        lines.append(f"| `{model_type}` | {cells} | {'; '.join(reasons)} |")
    verified = {b: sum(1 for row in table.values() if row.get(b, {}).get("status") == "verified") for b in BACKENDS}
    lines.append("")
    lines.append("Verified model types: " + ", ".join(f"{b} {n}" for b, n in verified.items()) + ".")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of writing docs/reference/model-types.md")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    table = load(args.results)
    if not table:
        print(f"no results under {args.results}: run the family tests first", file=sys.stderr)
        return 1
    text = render(table)
    if args.print:
        print(text)
        return 0
    page = ROOT / "docs" / "reference" / "model-types.md"
    body = page.read_text()
    if START not in body or END not in body:
        print(f"{page} has no {START} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    print(f"wrote {len(table)} model types to {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
