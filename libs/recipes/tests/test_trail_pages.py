"""The report's screenshot trail pages, opened in a real headless Chromium (Debian's, through
Playwright): every screenshot loads, every step's action shows, and what came from the sandbox
(the intent, the answer, URLs, titles, arguments) is shown as text and never runs. The
screenshots are real Chromium screenshots; the trails lie in a real file:// artifact store. A
missing Chromium or Playwright fails these tests; it never skips them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from playwright.sync_api import Browser, Page, sync_playwright

from orchard.core.artifacts import ArtifactStore
from orchard.recipes.pipeline import build_report
from orchard.recipes.recipe_tasks import RecipeTask
from orchard.recipes.stages import StageContext
from orchard.recipes.trails import TrailChoice, choose_trails, keeps_trails, write_trail_pages
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.sdk.report import TRAILS_INDEX, write_report
from orchard.tasks.gui.browser import OFFLINE_CHROMIUM_ARGS
from orchard.types.v1 import reward_pb2, trajectory_pb2

HOSTILE_INTENT = "<script>window.pwned=1</script> Find the cheapest lamp & add it"
HOSTILE_ANSWER = '<img src=x onerror="window.pwned=2">'
HOSTILE_TITLE = "</title><script>window.pwned=3</script>"
HOSTILE_URL = 'javascript:window.pwned=4//"><script>window.pwned=5</script>'


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    args = [*OFFLINE_CHROMIUM_ARGS]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium's own sandbox cannot start as root
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=args
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    try:
        yield context.new_page()
    finally:
        context.close()


def _screenshots(browser: Browser, count: int) -> list[bytes]:
    """Real PNGs: Chromium's screenshots of small pages, each different."""
    context = browser.new_context(viewport={"width": 480, "height": 300})
    try:
        page = context.new_page()
        shots = []
        for i in range(count):
            page.set_content(f"<h1>Shop page {i}</h1><button>Add to cart {i}</button>")
            shots.append(page.screenshot())
        return shots
    finally:
        context.close()


def _store(tmp_path: Path) -> ArtifactStore:
    root = tmp_path / "store"
    root.mkdir()
    return ArtifactStore(root.as_uri())


def _write_trail(
    store: ArtifactStore, rollout_id: str, trail: dict[str, Any], shots: dict[str, bytes]
) -> str:
    folder = store.url("trails", "job1", rollout_id)
    for name, data in shots.items():
        store.write_bytes(f"{folder}/{name}", data)
    return store.write_bytes(f"{folder}/trail.json", json.dumps(trail).encode())


def _hostile_trail(task_id: str) -> dict[str, Any]:
    step = {
        "ok": True,
        "error": None,
        "events": [],
        "tabs": [],
        "elapsed_s": 0.1,
    }
    return {
        "version": 1,
        "job_id": "job1",
        "rollout_id": f"{task_id}.0.abc",
        "task_id": task_id,
        "gui_task_id": task_id,
        "harness": "builtin:browser",
        "intent": HOSTILE_INTENT,
        "start_url": HOSTILE_URL,
        "steps": [
            {**step, "index": 0, "tool": "goto_url", "arguments": {"url": HOSTILE_URL},
             "message": "opened the page", "url": HOSTILE_URL, "title": HOSTILE_TITLE,
             "screenshot": "000.png"},
            {**step, "index": 1, "tool": "type_text",
             "arguments": {"text": "<b onmouseover=window.pwned=6>lamp</b>"},
             "message": "typed 37 characters", "url": "http://site/search?q=<x>",
             "title": "Search", "screenshot": "001.png"},
            {**step, "index": 2, "tool": "click", "arguments": {"x": 120, "y": 44},
             "ok": False, "error": "timeout", "message": "<svg onload=window.pwned=7>",
             "events": ["<iframe src=javascript:window.pwned=8>"], "url": "", "title": "",
             "screenshot": "002.png"},
            {**step, "index": 3, "tool": "scroll", "arguments": {"dy": 300},
             "message": "scrolled", "url": "http://site/", "title": "Shop",
             "screenshot": "../../../../etc/passwd"},
            {**step, "index": 4, "tool": "done", "arguments": {"answer": HOSTILE_ANSWER},
             "message": "done", "url": "http://site/", "title": "Shop",
             "screenshot": "004.png"},
        ],
        "response": HOSTILE_ANSWER,
        "status": "completed",
        "outcome": "submitted",
        "format_failures": 0,
        "reward": {"value": 1.0, "scorer": "gui-state", "detail": "<b>success</b>"},
        "failure": None,
    }  # fmt: skip


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_a_trail_page_shows_each_step_with_its_screenshot_and_runs_nothing_it_shows(
    tmp_path: Path, browser: Browser, page: Page
) -> None:
    store = _store(tmp_path)
    shots = _screenshots(browser, 3)
    # Step 2's "screenshot" is HTML, step 3's names a file outside the trail: neither is copied.
    not_png = b"<html><script>window.pwned=9</script></html>"
    url = _write_trail(
        store,
        "gui-7-shop-1.0.abc",
        _hostile_trail("gui/7/shop/1"),
        {"000.png": shots[0], "001.png": shots[1], "002.png": not_png, "004.png": shots[2]},
    )
    report = tmp_path / "report"
    choice = TrailChoice("base", "gui/7/shop/1", "builtin:browser", "r1", url, 1.0, True)
    (link,) = write_trail_pages([choice], store, report)

    assert link.page == "trails/base/1-gui-7-shop-1.html" and link.steps == 5
    trails = report / "trails"
    assert sorted(p.relative_to(trails).as_posix() for p in _files_under(trails)) == [
        "base/1-gui-7-shop-1.html",
        "base/1-gui-7-shop-1/000.png",
        "base/1-gui-7-shop-1/001.png",
        "base/1-gui-7-shop-1/004.png",
        "index.html",
    ]
    text = (report / link.page).read_text()
    assert str(tmp_path) not in text and "file:" not in text and "<script>" not in text

    page.goto((report / link.page).as_uri())
    page.wait_for_load_state("load")
    widths = page.evaluate("[...document.images].map(i => i.complete ? i.naturalWidth : 0)")
    assert widths == [480, 480, 480]
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.evaluate("document.scripts.length") == 0
    assert page.locator(".intent").inner_text() == HOSTILE_INTENT
    assert page.locator(".answer").inner_text() == HOSTILE_ANSWER
    assert "success" in page.locator(".reward").inner_text()
    for number, tool in enumerate(["goto_url", "type_text", "click", "scroll", "done"]):
        action = page.locator(f"#step-{number} .action")
        assert action.is_visible() and action.inner_text().startswith(f"{tool}(")
    assert "<b onmouseover=window.pwned=6>lamp</b>" in page.locator("#step-1 .action").inner_text()
    assert "error (timeout): <svg onload=window.pwned=7>" in page.locator("#step-2").inner_text()
    assert HOSTILE_TITLE in page.locator("#step-0").inner_text()
    for number in (2, 3):
        assert page.locator(f"#step-{number}").inner_text().endswith("(no screenshot this step)")
    assert page.locator("a").count() == 1  # back to the index; a sandbox's URL is never a link

    page.goto((trails / "index.html").as_uri())
    page.wait_for_load_state("load")
    page.locator("a", has_text="base/1-gui-7-shop-1.html").click()
    page.wait_for_load_state("load")
    assert page.url == (report / link.page).as_uri()


def _trajectory(
    rollout: str, value: float | None, trail: str = "", branch: bool = False
) -> trajectory_pb2.Trajectory:
    trajectory = trajectory_pb2.Trajectory(id=f"{rollout}/0", rollout_id=rollout)
    if value is None:
        trajectory.reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
    else:
        trajectory.reward.status = reward_pb2.REWARD_STATUS_SCORED
        trajectory.reward.value = value
    if trail:
        trajectory.metadata["gui_trail"] = trail
    if branch:
        trajectory.metadata["branch"] = "compaction"
    return trajectory


def _group(task: str, *trajectories: trajectory_pb2.Trajectory) -> trajectory_pb2.TrajectoryGroup:
    return trajectory_pb2.TrajectoryGroup(
        task_id=task, harness="builtin:browser", trajectories=trajectories
    )


def test_the_choice_mixes_successes_and_failures_over_different_tasks_the_same_each_time() -> None:
    groups = [
        _group("t/b", _trajectory("b.1", 1.0, "u/b1"), _trajectory("b.2", 0.0, "u/b2")),
        _group("t/a", _trajectory("a.1", 1.0, "u/a1"), _trajectory("a.2", 1.0, "u/a2")),
        _group(
            "t/c",
            _trajectory("c.1", None, "u/c1"),  # excluded: never shown
            _trajectory("c.2", 0.0),  # no trail
            _trajectory("c.3", 0.0, "u/c3", branch=True),
        ),
    ]
    chosen = choose_trails("base", groups, 0.5)
    assert [(c.rollout_id, c.resolved) for c in chosen] == [
        ("a.1", True),
        ("b.2", False),
        ("a.2", True),
    ]
    assert choose_trails("base", list(reversed(groups)), 0.5) == chosen
    assert [c.rollout_id for c in choose_trails("base", groups, 0.5, per_model=2)] == [
        "a.1",
        "b.2",
    ]
    only_wins = [_group("t/a", _trajectory("a.1", 1.0, "u/a1"), _trajectory("a.2", 1.0, "u/a2"))]
    assert [c.rollout_id for c in choose_trails("sft", only_wins, 0.5)] == ["a.1", "a.2"]
    assert choose_trails("base", [_group("t/c", _trajectory("c.2", 0.0))], 0.5) == []


def test_an_evaluation_keeps_trails_when_it_has_gui_tasks() -> None:
    gui = RecipeTask(split="evaluate", instance=None, gui_id="gui/7/shop/1")
    claw = RecipeTask(split="evaluate", instance=None, claw_id="claw/7/mail/1")
    assert keeps_trails([claw, gui]) and not keeps_trails([claw]) and not keeps_trails([])


def _context(tmp_path: Path, artifacts: str) -> StageContext:
    recipe = Recipe.model_validate({"name": "gui-run", "tasks": {"builtin": {"count": 24}}})
    stack = StackEndpoints(
        env="e", env_token="", reward="r", etcd="x", trainer="t", rollout="o", artifacts=artifacts
    )
    return StageContext(recipe=recipe, run=RunDir(tmp_path / "run"), stack=stack, tasks={})


def _evaluated(ctx: StageContext, name: str, groups: list[trajectory_pb2.TrajectoryGroup]) -> None:
    out = ctx.run.stage("evaluate")
    lines = [json_format.MessageToJson(g, indent=None) for g in groups]
    (out / f"{name}.groups.jsonl").write_text("".join(line + "\n" for line in lines))


def test_the_report_links_the_trail_pages_of_the_evaluated_models(
    tmp_path: Path, browser: Browser, page: Page
) -> None:
    store = _store(tmp_path)
    shots = _screenshots(browser, 2)
    trail = _hostile_trail("gui/7/shop/1")
    trail["steps"] = trail["steps"][:2]
    url = _write_trail(store, "r1", trail, {"000.png": shots[0], "001.png": shots[1]})
    ctx = _context(tmp_path, store.root_url)
    result = {"model": "base", "weight_version": "base", "resolved": 1, "attempts": 2}
    ctx.run.finish(
        "evaluate",
        {"models": {"base": result, "sft": {**result, "model": "sft", "same_weights_as": "base"}}},
    )
    _evaluated(
        ctx,
        "base",
        [
            _group("gui/7/shop/1", _trajectory("r1", 1.0, url)),
            # A trail the store refuses (outside it): left out, the report goes on.
            _group("gui/7/shop/2", _trajectory("r2", 0.0, "file:///etc/trail.json")),
        ],
    )

    report = build_report(ctx)
    assert [(t.model, t.task_id, t.steps) for t in report.trails] == [("base", "gui/7/shop/1", 2)]
    markdown = write_report(report, ctx.run.root / "report").read_text()
    assert f"[all trails]({TRAILS_INDEX})" in markdown
    assert "| base | gui/7/shop/1 | builtin:browser | 1 | yes | 2 | " in markdown
    assert "[page](trails/base/1-gui-7-shop-1.html)" in markdown
    assert (
        json.loads((ctx.run.root / "report" / "report.json").read_text())["trails"][0]["page"]
        == "trails/base/1-gui-7-shop-1.html"
    )

    page.goto((ctx.run.root / "report" / TRAILS_INDEX).as_uri())
    page.wait_for_load_state("load")
    assert page.locator("tr").count() == 2
    page.locator("a").first.click()
    page.wait_for_load_state("load")
    assert page.evaluate("[...document.images].map(i => i.naturalWidth)") == [480, 480]


def test_a_run_without_trails_has_no_trail_section(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "")
    ctx.run.finish("evaluate", {"models": {"base": {"resolved": 0, "attempts": 1}}})
    _evaluated(ctx, "base", [_group("gui/7/shop/1", _trajectory("r1", 0.0))])
    report = build_report(ctx)
    assert report.trails == ()
    markdown = write_report(report, ctx.run.root / "report").read_text()
    assert "trails" not in markdown
    assert not (ctx.run.root / "report" / "trails").exists()
