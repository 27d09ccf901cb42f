"""Debian's Chromium, headless, for the tests that look at a page as a browser draws it (the docs
site, the attribution graph's HTML view). Playwright drives the system browser: its own browser
download cannot reach the network here, and ``scripts/setup.sh`` installs Debian's."""

from __future__ import annotations

import contextlib
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# no background traffic: this machine's closed network refuses it, many connections at a time
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


@contextlib.contextmanager
def chromium(profile: pathlib.Path, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A Playwright browser context on a fresh profile folder (``--user-data-dir``), closed on exit."""
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: bash scripts/setup.sh installs Debian's chromium"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=list(FLAGS),
            headless=True,
            viewport={"width": width, "height": height},
        )
        try:
            yield context
        finally:
            context.close()
