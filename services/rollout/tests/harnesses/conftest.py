"""Fixtures of the program-harness tests: the harness cache (``make harnesses``), the host
address sandboxes reach the model endpoint at, and a sandbox client of the REAL environment
service (``env_service`` of the parent conftest: ``orchard up``, local runtime, root)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchard.rollout.harnesses.sandboxed import MANIFEST, HarnessCache, host_address
from orchard.sdk import AsyncSandboxClient, RetryPolicy

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="session")
def harness_cache() -> HarnessCache:
    """The cache `tools/harnesses.py` builds; its absence fails the tests (never skips)."""
    path = Path(os.environ.get("ORCHARD_HARNESS_CACHE") or ROOT / ".cache" / "harnesses")
    if not (path / MANIFEST).is_file():
        pytest.fail(f"no harness cache at {path}: run `make harnesses`")
    return HarnessCache(str(path))


@pytest.fixture(scope="session")
def reachable_host() -> str:
    """An address of this host that sandboxes route to (model endpoints listen there)."""
    address = host_address()
    if address.startswith("127."):
        pytest.fail("this host has no IPv4 address besides loopback for sandboxes to reach")
    return address


@pytest.fixture
async def sandboxes(env_service: dict[str, Any]) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(
        profile=env_service["profile"], retry=RetryPolicy(initial_backoff=0.05)
    ) as client:
        yield client
        # Every rollout deletes its sandbox.
        assert [s.id async for s in client.list()] == []
