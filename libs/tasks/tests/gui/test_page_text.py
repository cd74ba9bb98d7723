"""The page as text in a real Chromium: names, values and states of the elements on screen, and
centres that a click at them really hits; bounded length, off-screen notes, the round trip
through text, and the observation and summary that carry it."""

from __future__ import annotations

import statistics
import time

import pytest

from orchard.tasks.gui.browser import BrowserConfig, BrowserSession
from orchard.tasks.gui.observation import Observation
from orchard.tasks.gui.page_text import PageText, parse_page_text
from orchard.tasks.gui.sites import SiteServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


def assert_ok(obs: Observation) -> Observation:
    assert obs.ok, obs.summary()
    return obs


async def one_tab(browser: BrowserSession) -> None:
    obs = await browser.observe()
    for index in reversed(range(1, len(obs.tabs))):
        assert_ok(await browser.close_tab(index))


async def page_of(browser: BrowserSession, url: str) -> tuple[Observation, PageText]:
    await one_tab(browser)
    obs = assert_ok(await browser.goto_url(url))
    assert obs.page_text is not None
    return obs, parse_page_text(obs.page_text)


async def test_a_button_is_named_and_its_centre_is_hit(
    browser: BrowserSession, sites: SiteServer
) -> None:
    sites.reset("playground")
    obs, page = await page_of(browser, sites.url("playground"))
    assert page.url == sites.url("playground") and page.title == "Widgets - Widget Playground"
    press = page.find("Press me", ("button",))
    assert press is not None and f'button "Press me" @ ({press.x},{press.y})' in obs.page_text
    assert_ok(await browser.click(press.x, press.y))
    assert sites.state("playground")["presses"] == 1
    # Every control on screen is the element under its own centre.
    for element in page.elements:
        if element.role in ("button", "link", "textbox", "slider"):
            hit = await browser.active_page.evaluate(
                """([x, y]) => {
                  const e = document.elementFromPoint(x, y);
                  const c = e && e.closest('a,button,input,select,textarea,[role]');
                  return c ? (c.getAttribute('aria-label') || c.labels?.[0]?.innerText ||
                    c.innerText || '').trim() : null;
                }""",
                [element.x, element.y],
            )
            assert hit == element.name, (element, hit)


async def test_fields_links_and_their_states(browser: BrowserSession, sites: SiteServer) -> None:
    sites.reset("portal")
    _, page = await page_of(browser, sites.url("portal", "/voucher"))
    plan = page.find("Plan", ("combobox",))
    plans = sites.sites["portal"].plans  # type: ignore[attr-defined]
    assert plan is not None and plan.value == "Choose a plan..."
    assert plan.options == ("Choose a plan...", *plans)
    code = page.find("Voucher code", ("textbox",))
    assert code is not None and code.value == ""
    assert_ok(await browser.write("VCH-1", x=code.x, y=code.y))
    obs = await browser.observe()
    assert obs.page_text is not None
    code = parse_page_text(obs.page_text).find("Voucher code")
    assert code is not None and code.value == "VCH-1" and "focused" in code.flags
    _, page = await page_of(browser, sites.url("portal", "/activate"))
    terms = page.find("terms of service", ("link",), exact=True)
    accept = page.find("I accept the terms of service", ("checkbox",))
    assert terms is not None and "newtab" in terms.flags
    assert accept is not None and "unchecked" in accept.flags
    assert_ok(await browser.click(accept.x, accept.y))
    page = parse_page_text((await browser.observe()).page_text or "")
    accept = page.find("I accept the terms of service", ("checkbox",))
    assert accept is not None and "checked" in accept.flags
    # A label that names a control is not repeated as text.
    assert not any(e.role == "text" and e.name == "Agreement code" for e in page.elements)


async def test_what_is_off_screen_is_counted_not_listed(
    browser: BrowserSession, sites: SiteServer
) -> None:
    _, page = await page_of(browser, sites.url("portal", "/terms"))
    code = sites.sites["portal"].agreement_code  # type: ignore[attr-defined]
    assert page.below > 0 and page.above == 0 and code not in page.text()
    assert all(0 <= e.y < 800 and 0 <= e.x < 1280 for e in page.elements)
    obs = assert_ok(await browser.scroll("down", 5000))
    page = parse_page_text(obs.page_text or "")
    assert page.below == 0 and page.above > 0 and code in page.text() and page.scroll_y > 0
    assert "(above the screen:" in (obs.page_text or "")


async def test_the_text_is_bounded_and_reads_back(
    browser: BrowserSession, sites: SiteServer
) -> None:
    await page_of(browser, sites.url("shop"))
    snapshot = await browser.read_page_text()
    full = snapshot.render(100_000)
    assert parse_page_text(full).elements == snapshot.elements
    assert len(snapshot.elements) > 20
    short = snapshot.render(400)
    assert len(short) <= 400 and "(cut at 400 characters:" in short
    kept = parse_page_text(short)
    assert 0 < len(kept.elements) < len(snapshot.elements)
    assert kept.elements == snapshot.elements[: len(kept.elements)]
    assert kept.cut == len(snapshot.elements) - len(kept.elements)
    # Cheap next to the screenshot: tens of milliseconds on this page.
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        await browser.read_page_text()
        timings.append(time.perf_counter() - started)
    assert statistics.median(timings) < 0.5


async def test_observations_carry_it_when_asked(browser: BrowserSession, sites: SiteServer) -> None:
    obs, _ = await page_of(browser, sites.url("forms", "/step/1"))
    assert obs.page_text is not None and 'textbox "Full name" value=""' in obs.page_text
    summary = obs.summary()
    assert summary.index("viewport: 1280x800") < summary.index("page text:")
    assert summary.endswith(obs.page_text)
    assert obs.to_dict(screenshot=False)["page_text"] == obs.page_text
    async with BrowserSession(BrowserConfig(page_text_max_chars=300)) as small:
        obs = assert_ok(await small.goto_url(sites.url("shop")))
        assert obs.page_text is not None and len(obs.page_text) <= 300
        assert "(cut at 300 characters:" in obs.page_text
    async with BrowserSession(BrowserConfig(page_text=False)) as plain:
        obs = assert_ok(await plain.goto_url(sites.url("shop")))
        assert obs.page_text is None and "page text:" not in obs.summary()
    with pytest.raises(ValueError, match="page_text_max_chars"):
        BrowserConfig(page_text_max_chars=10)
