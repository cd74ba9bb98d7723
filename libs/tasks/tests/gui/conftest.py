"""One real Chromium and the real site server per test module (no mocks). A missing Chromium
or playwright fails these tests; it never skips them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from orchard.tasks.gui.browser import BrowserConfig, BrowserSession
from orchard.tasks.gui.sites import SiteServer

# Short limits so the hung-page tests are quick; a real episode uses the defaults.
TEST_CONFIG = BrowserConfig(action_timeout_s=3.0, settle_timeout_s=1.5, screenshot_timeout_s=3.0)


@pytest.fixture(scope="module")
def sites() -> Iterator[SiteServer]:
    with SiteServer(seed=7) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[BrowserSession]:
    async with BrowserSession(TEST_CONFIG) as session:
        yield session
