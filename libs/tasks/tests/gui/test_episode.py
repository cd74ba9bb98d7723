"""A browser episode in real sandboxes: etcd and orchard-env with the local runtime (root), the
site in one ``host``-image sandbox and the browser in another, the browser folder from
``make gui-browser`` (built here when missing)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from orchard.sdk import AsyncSandboxClient
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack, StackError
from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir
from orchard.tasks.gui.episode import BrowserEpisode, BrowserSandboxSettings, BrowserUnavailable

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parents[4]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def browser_dir() -> str:
    """The folder `make gui-browser` builds; the host image shows it at the same path."""
    folder = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (folder / LAUNCHER).exists():
        build_browser_dir(folder)
    return str(folder.absolute())


@pytest.fixture(scope="module")
def env_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """etcd and orchard-env with their own cgroup parent and run dir, removed at the end; the
    tenant may give sandboxes user namespaces (Chromium's own sandbox)."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    run_dir = Path(tempfile.mkdtemp(prefix="og-"))  # sandbox socket paths must stay short
    cgroup_parent = f"orchard-gui-{uuid.uuid4().hex[:8]}"
    stack = LocalStack(
        tmp_path_factory.mktemp("gui-stack"),
        listen=f"127.0.0.1:{_free_port()}",
        token=secrets.token_urlsafe(16),
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
        settings=['privileges.user_namespaces=["*"]'],
    )
    try:
        stack.start()
        yield stack
    except StackError as exc:
        pytest.fail(str(exc))
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(env_stack: LocalStack) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(env_stack.endpoint, token=env_stack.token) as made:
        yield made


async def test_a_browser_sandbox_drives_its_site_sandbox_as_an_unprivileged_user(
    client: AsyncSandboxClient, browser_dir: str
) -> None:
    settings = BrowserSandboxSettings(browser_dir=browser_dir, action_timeout_s=3.0)
    async with await BrowserEpisode.open(
        client, settings, sites=["playground"], seed=5, lifetime_s=120
    ) as episode:
        opened = await episode.call("goto_url", {"url": f"{episode.base_url}/playground/"})
        assert opened.ok, opened.summary()
        assert opened.screenshot and opened.screenshot.startswith(b"\x89PNG")
        assert opened.viewport == (1280, 800)
        assert opened.tabs[0].url.startswith(episode.base_url)
        # The browser and Chromium run as the unprivileged user, Chromium with its sandbox.
        processes = await episode.browser.exec(
            "ps -eo uid=,args= | grep -E '[c]hromium|[o]rchard-browser'"
        )
        lines = processes.stdout.decode().splitlines()
        assert lines and all(line.split()[0] == "65534" for line in lines), lines
        assert not any("--no-sandbox" in line for line in lines), lines
        # The site's state is read inside the site sandbox; the browser cannot read it.
        state = await episode.site_state("playground")
        assert isinstance(state, dict)
        peek = await episode.call(
            "goto_url", {"url": f"{episode.base_url}/_orchard/state/playground"}
        )
        assert "a valid state token is required" in (peek.page_text or ""), peek.summary()
        # The browser reaches nothing but its site: not the site's other ports, not the host.
        for url in (
            f"http://{episode.site.info.network_address}:22/",
            "http://10.0.0.1/",
        ):
            refused = await episode.call("goto_url", {"url": url})
            assert not refused.ok and refused.error in ("action_failed", "timeout"), refused


async def test_the_allowance_ends_with_the_episode(
    client: AsyncSandboxClient, browser_dir: str
) -> None:
    settings = BrowserSandboxSettings(browser_dir=browser_dir, action_timeout_s=3.0)
    async with await BrowserEpisode.open(
        client, settings, sites=["playground"], seed=5, lifetime_s=8
    ) as episode:
        url = f"{episode.base_url}/playground/"
        assert (await episode.call("goto_url", {"url": url})).ok
        await asyncio.sleep(max(0.0, episode.deadline - time.time()) + 0.2)
        late = await episode.call("goto_url", {"url": url})
        assert not late.ok, late.summary()


async def test_a_dead_browser_is_unavailable_and_bad_settings_are_refused(
    client: AsyncSandboxClient, browser_dir: str
) -> None:
    settings = BrowserSandboxSettings(browser_dir=browser_dir)
    async with await BrowserEpisode.open(
        client, settings, sites=["playground"], lifetime_s=60
    ) as episode:
        await episode.browser.exec("pkill -KILL -f orchard-browser; rm -f /run/orchard-gui/*.sock")
        with pytest.raises(BrowserUnavailable, match="got no observation"):
            await episode.call("wait", {"seconds": 0.1})
    with pytest.raises(ValueError, match="absolute"):
        BrowserSandboxSettings(browser_dir="relative/dir")
    # The start's wait ends as soon as the server exits, saying so.
    with pytest.raises(BrowserUnavailable, match="exited at start"):
        await BrowserEpisode.open(
            client, BrowserSandboxSettings(browser_dir="/nowhere"), sites=["playground"]
        )
    assert [info async for info in client.list()] == []  # nothing left behind
