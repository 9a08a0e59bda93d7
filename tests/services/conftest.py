"""A real nats-server per test module, on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.tools.nats_server import EmbeddedNatsServer


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNatsServer() as server:
        yield server.url
