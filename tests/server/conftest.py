"""Fixtures of the server's tests: an HTTP client of the module's ``server`` fixture (a module
whose client needs other headers or another library defines its own ``client``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from ..support.servers import LiveServer


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
