"""Fixtures shared by every test in the workspace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchard.core.etcd import EmbeddedEtcd, find_etcd_binary


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One real etcd server for the whole session; tests isolate themselves by key namespace
    and must not compact it or kill it (start their own `EmbeddedEtcd` for that)."""
    try:
        find_etcd_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with EmbeddedEtcd() as server:
        yield server
