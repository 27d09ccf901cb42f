"""Print, one per line, the uv options that carry pip's configuration (scripts/setup.sh reads them).

uv reads no pip configuration: the indexes, find-links and constraints a machine gives pip (in
pip.conf files or PIP_* variables) are what `pip config list` prints. Each that uv has an option
for is printed as that option (`--find-links=/opt/wheels`); the certificate, the network timeout
and the retries as the variables uv reads instead (`SSL_CERT_FILE=...`, `UV_HTTP_TIMEOUT=...`,
`UV_HTTP_RETRIES=...`, which setup.sh exports). Other keys have no bearing on what is installed.

Usage: python scripts/pip_config_to_uv.py [PYTHON]  (the interpreter whose pip is asked; default
this one)
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's key (the part after the last dot of `global.find-links`, `install.constraint`,
# `:env:.find-links`) -> uv's option; each value may list several, space-separated
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# pip's key -> the variable uv reads for the same setting
VARIABLES = {
    "cert": "SSL_CERT_FILE",
    "timeout": "UV_HTTP_TIMEOUT",
    "default-timeout": "UV_HTTP_TIMEOUT",
    "retries": "UV_HTTP_RETRIES",
}


def uv_args(listing: str) -> list[str]:
    """uv's options and variables for the lines of `pip config list`."""
    args: list[str] = []
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        values = shlex.split(raw)
        if len(values) == 1:  # `pip config list` quotes the whole value: a list is space-separated
            values = values[0].split()
        for value in values:
            if name in OPTIONS:
                arg = f"{OPTIONS[name]}={value}"
            elif name in VARIABLES:
                arg = f"{VARIABLES[name]}={value}"
            elif name == "no-index" and value.lower() in ("1", "true", "yes", "on"):
                arg = "--no-index"
            else:
                continue
            if arg not in args:  # a key set both in a file and in the environment
                args.append(arg)
    return args


def main() -> None:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    print("\n".join(uv_args(listing)))


if __name__ == "__main__":
    main()
