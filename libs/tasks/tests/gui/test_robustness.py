"""What an agent (or a bad page) can do wrong comes back as a clear observation, fast: bad
arguments, dialogs, a page that never answers, a crashed tab, a killed browser."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from orchard.tasks.gui.browser import BrowserConfig, BrowserSession, BrowserUnavailableError
from orchard.tasks.gui.sites import SiteServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


async def center(browser: BrowserSession, selector: str) -> tuple[float, float]:
    point = await browser.locate(selector)
    assert point is not None, f"nothing matches {selector!r} on {browser.active_page.url}"
    return point


async def open_playground(browser: BrowserSession, sites: SiteServer) -> None:
    sites.reset("playground")
    obs = await browser.goto_url(sites.url("playground"))
    assert obs.ok, obs.summary()


@pytest.mark.parametrize(
    ("tool", "arguments", "expected"),
    [
        ("fly", {}, "no tool 'fly'; the tools are click, write"),
        ("click", {"x": 10}, "click: missing required argument(s) y"),
        ("click", {"x": "ten", "y": 5}, "click: x must be a number, got 'ten'"),
        ("click", {"x": True, "y": 5}, "click: x must be a number, got True"),
        ("click", {"x": 1500, "y": 5}, "click: x=1500 is outside the viewport (0 <= x < 1280)"),
        ("click", {"x": 5, "y": 800}, "click: y=800 is outside the viewport (0 <= y < 800)"),
        ("click", {"x": -1, "y": 5}, "click: x must be at least 0, got -1"),
        ("click", {"x": 1, "y": 5, "z": 1}, "click: unknown argument(s) z; its arguments are"),
        ("drag", {"from_x": 1, "from_y": 1, "to_x": 1, "to_y": 900}, "to_y=900 is outside"),
        ("switch_tab", {"index": 4}, "switch_tab: there is no tab 4; the tabs are 0 to 0"),
        ("close_tab", {"index": 1}, "close_tab: there is no tab 1"),
        ("press_keys", {"keys": []}, "press_keys: keys must hold 1 to 20 items, got 0"),
        ("press_keys", {"keys": ["Enterr"]}, 'press_keys: unknown key "Enterr" (key names'),
        ("scroll", {"direction": "sideways"}, "scroll: direction must be one of up, down"),
        ("wait", {"seconds": 60}, "wait: seconds must be between 0 and 10.0, got 60"),
        ("goto_url", {"url": "file:///etc/passwd"}, "only http:// and https:// URLs"),
        ("write", {"text": "a", "x": 3}, "write: give both x and y, or neither"),
        ("done", "finished", "done: the arguments must be a JSON object"),
    ],
)
async def test_bad_arguments_say_what_to_fix(
    browser: BrowserSession, sites: SiteServer, tool: str, arguments: object, expected: str
) -> None:
    obs = await browser.call(tool, arguments)  # type: ignore[arg-type]
    assert not obs.ok and obs.error == "invalid_argument"
    assert expected in obs.message, obs.message
    assert obs.screenshot is not None and obs.tabs  # the agent still sees the page
    assert obs.elapsed_s < 2


async def test_dialogs_are_answered_and_reported(
    browser: BrowserSession, sites: SiteServer
) -> None:
    await open_playground(browser, sites)
    for button, kind, message in (
        ("#alert", "alert", "Saved!"),
        ("#confirm", "confirm", "Delete it?"),
        ("#prompt", "prompt", "Your name?"),
    ):
        x, y = await center(browser, button)
        obs = await browser.click(x, y)
        assert obs.ok, obs.summary()
        (dialog,) = obs.dialogs
        assert (dialog.type, dialog.message) == (kind, message)
        assert any(f"opened a {kind} dialog" in e for e in obs.events)
        assert obs.elapsed_s < 2.5
    answers = {e["kind"]: e["value"] for e in sites.state("playground")["events"]}
    assert answers == {"alert": "closed", "confirm": True, "prompt": "Ada"}


async def test_a_page_that_never_answers_times_out(
    browser: BrowserSession, sites: SiteServer
) -> None:
    started = time.monotonic()
    obs = await browser.goto_url(sites.url("playground", "/hang"))
    assert not obs.ok and obs.error == "timeout"
    assert "did not finish within 3 s" in obs.message and "loading was stopped" in obs.message
    assert time.monotonic() - started < 6
    assert obs.screenshot is not None and obs.tabs[0].url == sites.url("playground")
    # The browser is still usable.
    obs = await browser.goto_url(sites.url("playground"))
    assert obs.ok and obs.tabs[obs.active_tab].url == sites.url("playground")


async def test_a_click_into_a_hung_page_is_cut_off(
    browser: BrowserSession, sites: SiteServer
) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#hang")
    started = time.monotonic()
    obs = await browser.click(x, y)
    assert time.monotonic() - started < 6
    assert obs.ok  # the click happened; the page it asked for never came
    assert any("still loading" in e for e in obs.events), obs.events
    assert obs.screenshot is not None  # the page it had, while the next one never comes
    obs = await browser.goto_url(sites.url("shop"))
    assert obs.ok, obs.summary()


async def test_a_crashed_tab_is_replaced(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    # How a renderer dies on demand: the browser's own chrome://crash (agents cannot open it).
    with contextlib.suppress(Exception):
        await browser.active_page.goto("chrome://crash", timeout=3000)
    obs = await browser.wait(0.1)
    assert not obs.ok and obs.error == "page_crashed", obs.summary()
    assert "tab 0 crashed" in obs.message
    assert obs.tabs[0].url == "about:blank" and obs.screenshot is not None
    obs = await browser.goto_url(sites.url("playground"))
    assert obs.ok, obs.summary()


async def test_a_killed_browser_is_reported_and_relaunched(sites: SiteServer) -> None:
    async with BrowserSession(BrowserConfig(action_timeout_s=3.0, settle_timeout_s=1.0)) as b:
        assert (await b.goto_url(sites.url("playground"))).ok
        old = b.browser_pid()
        assert old is not None
        os.kill(old, signal.SIGKILL)
        started = time.monotonic()
        obs = await b.click(10, 10)
        assert time.monotonic() - started < 15
        assert not obs.ok and obs.error == "browser_crashed", obs.summary()
        assert "fresh browser" in obs.message
        assert [t.url for t in obs.tabs] == ["about:blank"] and obs.screenshot is not None
        assert b.browser_pid() not in (None, old)
        obs = await b.goto_url(sites.url("playground"))
        assert obs.ok, obs.summary()
    assert b.browser_pids() == []


async def test_a_missing_chromium_is_a_clear_error() -> None:
    with pytest.raises(BrowserUnavailableError, match="install Debian's chromium"):
        async with BrowserSession(BrowserConfig(executable_path="/nonexistent/chromium")):
            pass
