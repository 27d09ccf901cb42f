"""Record what the family tests verified into the committed data file the documentation's
"verified against HF" table is rendered from (docs/reference/model-types-verified.json).

The family tests (``tests/eager/test_eager_families.py``, ``tests/vllm/test_vllm_families.py`` and the
sweep of every model type, ``pytest -m sweep tests/vllm/test_vllm_families.py``) write one JSON per
model type and backend to ``.cache/family-results/<backend>/<model_type>.json``::

    {"model_type": "gpt_neox", "backend": "vllm", "status": "verified" | "refused" | "fails",
     "kinds": ["attn_in", ...], "reason": ""}

This script merges them into the data file: each (backend, model type) it finds replaces the
entry recorded before, with the number of address kinds checked, the reason of a refusal or a
failure, the date the test wrote it and the newest commit before that moment (the code it ran,
uncommitted changes aside); entries no result file mentions stay as they were. What each backend
*serves* is not recorded here: the site renders it from the code at build time
(scripts/model_types.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".cache" / "family-results"
DATA = ROOT / "docs" / "reference" / "model-types-verified.json"
BACKENDS = ("eager", "vllm", "vllm-static")
_MODEL_PATH = re.compile(r"'?[^\s']*\.cache/test-models/[^\s'\"]+'?")
"""A tiny model's folder in a reason, written as MODEL (the folder is this checkout's)."""


def _commit_before(moment: datetime.datetime) -> str | None:
    """The newest commit of HEAD's history made before ``moment``."""
    command = ["git", "-C", str(ROOT), "rev-list", "-1", f"--before={moment.isoformat()}", "HEAD"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout.strip()


def load_results(results: pathlib.Path) -> list[dict[str, Any]]:
    """Every result file under ``results``, with the date it was written (``recorded``)."""
    found = []
    for path in sorted(results.glob("*/*.json")):
        record = json.loads(path.read_text())
        written = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
        found.append({**record, "recorded": written.strftime("%Y-%m-%d"), "commit": _commit_before(written)})
    return found


def merge(data: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """``data`` with each of ``results`` replacing its (backend, model type) entry."""
    table = data.setdefault("results", {})
    for record in results:
        backend, model_type = str(record["backend"]), str(record["model_type"])
        if backend not in BACKENDS:
            raise ValueError(f"{record}: unknown backend {backend!r}")
        table.setdefault(backend, {})[model_type] = {
            "status": record["status"],
            "kinds_checked": len(record.get("kinds") or []),
            "reason": _MODEL_PATH.sub("MODEL", record.get("reason") or ""),
            "recorded": record["recorded"],
            "commit": record.get("commit"),
        }
    data["results"] = {backend: dict(sorted(table.get(backend, {}).items())) for backend in BACKENDS}
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    args = parser.parse_args()
    results = load_results(args.results)
    if not results:
        print(f"no results under {args.results}: run the family tests first", file=sys.stderr)
        return 1
    data = json.loads(args.data.read_text()) if args.data.exists() else {}
    args.data.write_text(json.dumps(merge(data, results), indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(results)} results in {args.data.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
