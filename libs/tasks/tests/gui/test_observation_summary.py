"""`parse_summary` reads `Observation.summary` back: every part the text holds comes back, for
made-up observations of every shape and for real ones from a real Chromium on the real site
server, and the scripted teacher decides the same from the parsed observation as from the
original."""

from __future__ import annotations

import dataclasses

import pytest

from orchard.tasks.gui.browser import BrowserSession
from orchard.tasks.gui.observation import Observation, TabInfo, parse_summary
from orchard.tasks.gui.sites import SiteServer
from orchard.tasks.gui.suite import generate_suite, serve_task
from orchard.tasks.gui.teacher import ScriptedGuiTeacher

in_browser = pytest.mark.asyncio(loop_scope="module")

PAGE = 'url: http://127.0.0.1:1/shop/\ntitle: Shop - Orchard\n[1] link "Shop" @ (241,24)'


def _kept(observation: Observation, tool: str = "") -> Observation:
    """The parts of ``observation`` its summary holds."""
    return dataclasses.replace(
        observation,
        tool=tool,
        screenshot=None,
        dialogs=(),
        done=False,
        response=None,
        elapsed_s=0.0,
    )


SHAPES = [
    Observation(
        tool="click",
        ok=True,
        message="clicked at (10, 20)",
        screenshot=b"\x89PNG",
        viewport=(1280, 800),
        tabs=(
            TabInfo(0, "http://h/shop/", "Steel Kettle - Orchard - Outfitters", False),
            TabInfo(1, "about:blank", "", True),
        ),
        events=("the page opened a new tab 1; it is now active", "tab 2 was closed"),
        done=True,
        response="ok",
        elapsed_s=0.5,
        page_text=PAGE,
    ),
    Observation(
        tool="goto_url",
        ok=False,
        message="goto_url did not finish within 3 s;\nthe page may be hung",
        screenshot=None,
        viewport=(800, 600),
        tabs=(TabInfo(0, "http://h/a?q=x%20y", "(no title) twin", True),),
        error="timeout",
        events=("a note\nof two lines",),
    ),
    # A failed call whose kind is unknown, no tabs (a dead browser), an empty page text.
    Observation("wait", False, "gone", None, (100, 100), (), page_text=""),
    Observation("scroll", True, "scrolled", b"x", (1, 1), (TabInfo(3, "", "t", True),)),
]


@pytest.mark.parametrize("observation", SHAPES, ids=[o.tool for o in SHAPES])
def test_what_the_summary_holds_comes_back(observation: Observation) -> None:
    parsed = parse_summary(observation.summary(), tool=observation.tool)
    assert parsed == _kept(observation, observation.tool)
    assert parsed.active_tab == observation.active_tab
    if observation.screenshot is None:
        assert parsed.summary() == observation.summary()


def test_text_that_is_no_summary_is_refused() -> None:
    with pytest.raises(ValueError, match="viewport"):
        parse_summary(PAGE)
    with pytest.raises(ValueError, match="viewport"):
        parse_summary("viewport: 10x10")  # the first line is always the message


@in_browser
async def test_real_observations_come_back_and_the_teacher_reads_them_alike(
    browser: BrowserSession, sites: SiteServer
) -> None:
    first = await browser.goto_url(sites.url("shop", "/"))
    opened = await browser.call("new_tab", {"url": sites.url("wiki", "/")})
    failed = await browser.call("switch_tab", {"index": 7})
    for observation in (first, opened, failed):
        assert observation.page_text, observation.message
        parsed = parse_summary(observation.summary())
        assert parsed == _kept(observation), observation.summary()
    assert [t.active for t in parse_summary(opened.summary()).tabs] == [False, True]
    assert parse_summary(failed.summary()).error == "invalid_argument"
    await browser.close_tab(1)

    task = next(t for t in generate_suite(15, seed=0) if t.family == "shop_add")
    with serve_task(task) as server:
        observation = await browser.goto_url(task.start_url(server.base_url))
    teachers = [ScriptedGuiTeacher(task, seed=1, mistake_rate=0.5) for _ in range(2)]
    parsed = parse_summary(observation.summary())
    for _ in range(3):
        assert teachers[0].next_call(observation) == teachers[1].next_call(parsed)
