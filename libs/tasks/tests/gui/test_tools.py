"""Each of the 13 tools does what it says on a real page, and a scripted shop checkout ends with
the order in the shop's server-side state."""

from __future__ import annotations

import base64
import struct

import pytest

from orchard.tasks.gui.actions import TOOL_NAMES, tool_schemas
from orchard.tasks.gui.browser import BrowserSession
from orchard.tasks.gui.observation import Observation
from orchard.tasks.gui.sites import SiteServer, fetch_state

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


async def center(browser: BrowserSession, selector: str) -> tuple[float, float]:
    point = await browser.locate(selector)
    assert point is not None, f"nothing matches {selector!r} on {browser.active_page.url}"
    return point


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def assert_ok(obs: Observation) -> Observation:
    assert obs.ok, obs.summary()
    assert obs.screenshot is not None and png_size(obs.screenshot) == obs.viewport
    return obs


async def one_tab(browser: BrowserSession) -> None:
    obs = await browser.observe()
    for index in reversed(range(1, len(obs.tabs))):
        assert_ok(await browser.close_tab(index))


async def open_playground(browser: BrowserSession, sites: SiteServer) -> None:
    sites.reset("playground")
    await one_tab(browser)
    assert_ok(await browser.goto_url(sites.url("playground")))


def events(sites: SiteServer, kind: str) -> list[object]:
    return [e["value"] for e in sites.state("playground")["events"] if e["kind"] == kind]


async def test_tool_schemas_are_the_13_tools() -> None:
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOL_NAMES)
    assert len(schemas) == 13
    for schema in schemas:
        assert schema["type"] == "function"
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
    click = next(s for s in schemas if s["function"]["name"] == "click")
    assert click["function"]["parameters"]["required"] == ["x", "y"]


async def test_observation_has_screenshot_viewport_and_tabs(
    browser: BrowserSession, sites: SiteServer
) -> None:
    await open_playground(browser, sites)
    obs = assert_ok(await browser.observe())
    assert obs.viewport == (1280, 800)
    assert obs.tabs[0].active and obs.tabs[0].title == "Widgets - Widget Playground"
    assert obs.tabs[0].url == sites.url("playground")
    assert base64.b64decode(obs.screenshot_base64() or "") == obs.screenshot
    data = obs.to_dict()
    assert data["active_tab"] == 0 and data["viewport"] == {"width": 1280, "height": 800}
    assert "[0] Widgets - Widget Playground" in obs.summary()


async def test_click_changes_server_state(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#press")
    obs = assert_ok(await browser.click(x, y))
    assert sites.state("playground")["presses"] == 1
    assert await browser.active_page.text_content("#presses") == "1"
    assert obs.message.startswith("clicked at")


async def test_write_and_press_enter(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#q")
    obs = assert_ok(await browser.write("green kettle", x=x, y=y))
    assert 'input "q"' in obs.message
    assert_ok(await browser.write("blue kettle", clear=True))
    obs = assert_ok(await browser.press_keys("Enter"))
    assert sites.state("playground")["searches"] == ["blue kettle"]
    assert obs.tabs[0].url.endswith("/playground/search?q=blue+kettle")


async def test_write_without_focus_says_so(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    obs = assert_ok(await browser.write("lost"))
    assert "no text field had focus" in obs.message


async def test_scroll_moves_the_page(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    obs = assert_ok(await browser.scroll("down", 5000))
    assert "y=0" not in obs.message
    assert await browser.active_page.evaluate("scrollY") > 1000
    assert events(sites, "scroll") == ["bottom"]
    assert_ok(await browser.scroll("up", 5000))
    assert await browser.active_page.evaluate("scrollY") == 0


async def test_drag_moves_the_slider(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#knob")
    assert_ok(await browser.drag(x, y, x + 200, y))
    (level,) = events(sites, "drag")
    assert isinstance(level, int) and 45 <= level <= 60


async def test_hover_shows_the_tooltip(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    assert not await browser.active_page.is_visible("#tip")
    x, y = await center(browser, "#help")
    before = (await browser.observe()).screenshot
    obs = assert_ok(await browser.hover(x, y))
    assert await browser.active_page.is_visible("#tip")
    assert events(sites, "hover") == ["help"]
    assert obs.screenshot != before


async def test_wait_waits(browser: BrowserSession, sites: SiteServer) -> None:
    obs = assert_ok(await browser.wait(0.3))
    assert obs.elapsed_s >= 0.3 and obs.message == "waited 0.3 s"


async def test_goto_and_go_back(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#second")
    obs = assert_ok(await browser.click(x, y))
    assert obs.tabs[0].url == sites.url("playground", "/second")
    assert obs.tabs[0].title.startswith("Second page")
    obs = assert_ok(await browser.go_back())
    assert obs.tabs[0].url == sites.url("playground")
    obs = assert_ok(await browser.goto_url(sites.url("shop")))
    assert obs.tabs[0].title == "Shop - Orchard Outfitters"


async def test_tabs(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    obs = assert_ok(await browser.new_tab(sites.url("shop")))
    assert [t.active for t in obs.tabs] == [False, True]
    assert obs.tabs[1].url == sites.url("shop") and obs.active_tab == 1
    obs = assert_ok(await browser.new_tab())
    assert [t.url for t in obs.tabs][2] == "about:blank" and obs.active_tab == 2
    obs = assert_ok(await browser.switch_tab(0))
    assert obs.active_tab == 0 and "Widgets" in obs.tabs[0].title
    obs = assert_ok(await browser.close_tab(2))
    assert len(obs.tabs) == 2 and obs.active_tab == 0
    obs = assert_ok(await browser.close_tab())
    assert len(obs.tabs) == 1 and obs.tabs[0].url == sites.url("shop")
    obs = await browser.close_tab()
    assert not obs.ok and obs.error == "invalid_argument" and "only tab" in obs.message


async def test_link_to_a_new_tab_becomes_active(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#newtab")
    obs = assert_ok(await browser.click(x, y))
    assert len(obs.tabs) == 2 and obs.active_tab == 1
    assert obs.tabs[1].url == sites.url("playground", "/help")
    assert any("opened a new tab 1" in e for e in obs.events)
    assert await browser.active_page.text_content("#code") == "ORCHID-7"
    obs = assert_ok(await browser.switch_tab(0))
    # After bring_to_front the old tab answers at once (no ~2 s stall on background tabs).
    x, y = await center(browser, "#press")
    obs = assert_ok(await browser.click(x, y))
    assert obs.elapsed_s < 1.5 and sites.state("playground")["presses"] == 1


async def test_a_page_that_closes_its_tab(browser: BrowserSession, sites: SiteServer) -> None:
    await open_playground(browser, sites)
    x, y = await center(browser, "#closing")
    obs = assert_ok(await browser.click(x, y))
    assert obs.active_tab == 1
    x, y = await center(browser, "#close")
    obs = assert_ok(await browser.click(x, y))
    assert len(obs.tabs) == 1 and obs.active_tab == 0
    assert "tab 1 was closed" in obs.events


async def test_done_returns_the_response(browser: BrowserSession) -> None:
    obs = assert_ok(await browser.done("The code is ORCHID-7"))
    assert obs.done and obs.response == "The code is ORCHID-7"


async def test_shop_checkout_end_to_end(browser: BrowserSession, sites: SiteServer) -> None:
    """A scripted agent: search, open a product, add two, check out; the shop has the order."""
    sites.reset("shop")
    await one_tab(browser)
    shop = sites.sites["shop"]
    wanted = shop.catalog[3]  # type: ignore[attr-defined]
    assert_ok(await browser.goto_url(sites.url("shop")))
    x, y = await center(browser, "#search")
    assert_ok(await browser.write(wanted.name, x=x, y=y))
    assert_ok(await browser.press_keys("Enter"))
    x, y = await center(browser, f".product[data-id={wanted.id}] a")
    obs = assert_ok(await browser.click(x, y))
    assert obs.tabs[obs.active_tab].title.startswith(wanted.name)
    x, y = await center(browser, "#qty")
    assert_ok(await browser.write("2", x=x, y=y, clear=True))
    x, y = await center(browser, "#add")
    obs = assert_ok(await browser.click(x, y))
    assert obs.tabs[obs.active_tab].url == sites.url("shop", "/cart")
    assert sites.state("shop")["cart"] == [{"id": wanted.id, "name": wanted.name, "qty": 2}]
    x, y = await center(browser, "#checkout")
    assert_ok(await browser.click(x, y))
    # Submitting without the fields is refused by the shop, which says what is missing.
    x, y = await center(browser, "#place")
    assert_ok(await browser.click(x, y))
    assert "Full name is required" in (await browser.active_page.content())
    for field, value in (
        ("#name", "Ada Lovelace"),
        ("#email", "ada@example.org"),
        ("#address", "12 Analytical Row"),
        ("#city", "London"),
    ):
        x, y = await center(browser, field)
        assert_ok(await browser.write(value, x=x, y=y))
    x, y = await center(browser, "#shipping")
    assert_ok(await browser.click(x, y))  # a <select>: its popup is drawn outside the page
    assert_ok(await browser.press_keys("ArrowDown", "Enter"))
    x, y = await center(browser, "#place")
    obs = assert_ok(await browser.click(x, y))
    assert obs.tabs[obs.active_tab].title.startswith("Order ORD-1001")
    state = fetch_state(sites.base_url, "shop")
    assert state["cart"] == []
    (order,) = state["orders"]
    assert order["id"] == "ORD-1001" and order["name"] == "Ada Lovelace"
    assert order["items"] == [
        {"id": wanted.id, "name": wanted.name, "qty": 2, "price_cents": wanted.price_cents}
    ]
    assert order["shipping"] == "express"
    assert order["total_cents"] == 2 * wanted.price_cents + 1499
    assert state["searches"] == [wanted.name]
    assert_ok(await browser.done("Ordered ORD-1001"))
