"""Check interp-vllm's runner seam and server plugin against vLLM releases that are not installed.

Every row of ``interp_vllm._compat`` (what the V1 and V2 runner seams wrap and read, the worker
methods they add, what the ``vllm serve`` plugin wraps) is looked up in the release's own source
files, read from its wheel without installing it (``interp_vllm._compat_check``). A row written for
the release whose target moved is a problem; the script exits 1 if there is one.

    .venv/bin/python scripts/check_vllm_runner.py                    # the releases the cuda extra allows
    .venv/bin/python scripts/check_vllm_runner.py 0.34.0             # one release (downloaded)
    .venv/bin/python scripts/check_vllm_runner.py path/to/vllm-0.35.0-...whl

Wheels are downloaded with ``pip download --no-deps`` into ``.cache/vllm-wheels`` (hundreds of MB
each: CUDA builds) and reused. Nothing is installed.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "vllm-wheels"
RELEASES = ("0.33.0", "0.34.0")
"""The CUDA releases the ``cuda`` extra allows beyond the installed CPU build's 0.32."""


def wheel(release: str) -> pathlib.Path:
    """The release's wheel, downloaded into :data:`CACHE` if it is not there."""
    found = sorted(CACHE.glob(f"vllm-{release}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"vllm=={release}", "-d", str(CACHE)],
            check=True,
        )
        found = sorted(CACHE.glob(f"vllm-{release}-*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no wheel of vllm=={release}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    from interp_vllm._compat_check import check, version_of, wheel_source

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", help="versions (downloaded) or wheel files; default: 0.33.0 0.34.0")
    args = parser.parse_args(argv)
    problems = 0
    for given in args.releases or RELEASES:
        path = pathlib.Path(given) if given.endswith(".whl") else wheel(given)
        source = wheel_source(path)
        version = version_of(source) or given
        print(f"vllm {version} ({path.name})")
        for finding in check(source, version):
            detail = f"  -- {finding.detail}" if finding.detail else ""
            print(f"  {finding.status:8} {finding.row}{detail}")
            problems += finding.status == "problem"
    print("no problems" if not problems else f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
