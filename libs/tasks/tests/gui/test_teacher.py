"""The scripted teacher: its plans, how it turns a step into a call from page text (found,
scrolled to, given up on), its determinism and mistakes; and, in a real Chromium against the
real site server, that it solves tasks of every family as the task's check reads the
server-side state, and that a noisy teacher fails some."""

from __future__ import annotations

import pytest

from orchard.tasks.gui.actions import validate_arguments
from orchard.tasks.gui.browser import BrowserSession
from orchard.tasks.gui.page_text import PageElement, PageText
from orchard.tasks.gui.sites import fetch_state
from orchard.tasks.gui.suite import FAMILIES, GuiTask, generate_suite, make_task, serve_task
from orchard.tasks.gui.teacher import (
    Done,
    Episode,
    ScriptedGuiTeacher,
    Type,
    plan_for,
    run_episode,
)

pytestmark = pytest.mark.timeout(120)
in_browser = pytest.mark.asyncio(loop_scope="module")

TOKEN = "teacher-token"
SUITE = generate_suite(60, seed=0)


def page(*elements: PageElement, url: str = "http://site/x", below: int = 0, above: int = 0) -> str:
    return PageText(
        url=url,
        title="t",
        elements=elements,
        viewport=(1280, 800),
        page_height=2000,
        below=below,
        above=above,
    ).render()


def element(index: int, role: str, name: str, x: int, y: int, **kw: object) -> PageElement:
    return PageElement(index, role, name, x, y, **kw)  # type: ignore[arg-type]


# -- without a browser -------------------------------------------------------------------------


def test_every_family_has_a_plan_that_ends_with_done() -> None:
    for task in SUITE:
        steps = plan_for(task)
        assert steps and isinstance(steps[-1], Done), task.id
        assert not any(isinstance(s, Done) for s in steps[:-1])
    broken = GuiTask.from_dict({**SUITE[0].to_dict(), "family": "casino"})
    with pytest.raises(ValueError, match="no plan"):
        plan_for(broken)


def test_a_step_becomes_a_call_at_the_element_it_names() -> None:
    task = next(t for t in SUITE if t.family == "shop_add")
    teacher = ScriptedGuiTeacher(task)
    shown = page(
        element(1, "link", "Shop", 275, 24),
        element(2, "spinbutton", "Quantity", 67, 233, value="1"),
        element(3, "button", "Add to cart", 177, 233),
    )
    ((_, qty),) = task.goal["cart"].items()
    first = teacher.next_call(shown)
    assert (first.name, first.arguments) == (
        "write",
        {"text": str(qty), "x": 67, "y": 233, "clear": True},
    )
    second = teacher.next_call(shown)
    assert (second.name, second.arguments) == ("click", {"x": 177, "y": 233})
    last = teacher.next_call(shown)
    assert last.name == "done" and teacher.finished
    for call in (first, second, last):
        validate_arguments(call.name, call.arguments)


def test_a_missing_target_is_scrolled_to_then_given_up_on() -> None:
    task = next(t for t in SUITE if t.family == "shop_add")
    teacher = ScriptedGuiTeacher(task)
    calls = [teacher.next_call(page(below=5)) for _ in range(8)]
    assert {(c.name, c.arguments["direction"]) for c in calls} == {("scroll", "down")}
    assert teacher.next_call(page(above=5)).arguments == {"direction": "up", "amount": 500}
    empty = page()
    assert teacher.next_call(empty).name == "wait"
    gave_up = teacher.next_call(empty)
    assert gave_up.name == "done" and "could not find 'Quantity'" in gave_up.arguments["response"]
    assert teacher.finished and teacher.next_call(empty).name == "done"


def test_a_blank_tab_opens_the_start_page() -> None:
    task = SUITE[0]
    call = ScriptedGuiTeacher(task, base_url="http://h:1/").next_call(page(url="about:blank"))
    assert call.arguments == {"url": "http://h:1" + task.start_path}


def test_checkboxes_drop_downs_and_appending() -> None:
    task = next(t for t in SUITE if t.family == "forms_apply")
    teacher = ScriptedGuiTeacher(task)
    teacher._step = next(i for i, s in enumerate(teacher.plan) if type(s).__name__ == "Check")
    plan_name = str(task.goal["plan"]).title()
    countries = task.initial_state["countries"]
    target = countries.index(task.goal["country"]) + 1
    step2 = page(
        element(1, "radio", "Basic", 50, 200, flags=("checked",) if plan_name == "Basic" else ()),
        element(2, "radio", "Plus", 50, 230, flags=("checked",) if plan_name == "Plus" else ()),
        element(3, "radio", "Pro", 50, 260, flags=("checked",) if plan_name == "Pro" else ()),
        element(
            4,
            "combobox",
            "Country",
            100,
            320,
            value=countries[0],
            options=("Choose...", *countries),
        ),
        element(5, "checkbox", "Send me the newsletter", 40, 360, flags=("unchecked",)),
    )
    # The radio is already chosen: nothing to click, on to the country.
    calls = [teacher.next_call(step2) for _ in range(2)]
    assert calls[0].name == "click" and calls[0].arguments == {"x": 100, "y": 320}
    assert calls[1].arguments["keys"] == ["ArrowDown"] * (target - 1) + ["Enter"]
    edit = next(t for t in SUITE if t.family == "wiki_edit")
    teacher = ScriptedGuiTeacher(edit)
    teacher._step = next(i for i, s in enumerate(teacher.plan) if isinstance(s, Type) and s.append)
    fields = page(
        element(1, "textbox", "Article text", 300, 200, value="One."),
        element(2, "textbox", "Tags (separated by commas)", 300, 400, value="north"),
    )
    names = [teacher.next_call(fields).name for _ in range(3)]
    assert names == ["click", "press_keys", "write"]


def test_the_teacher_is_deterministic_for_a_seed_and_its_mistakes_are_marked() -> None:
    task = next(t for t in SUITE if t.family == "booking_new")
    shown = page(
        *(
            element(i, "link", f"Book {name} Room", 600, 200 + 50 * i)
            for i, name in enumerate(
                (
                    "Aspen",
                    "Birch",
                    "Cedar",
                    "Hazel",
                    "Juniper",
                    "Linden",
                    "Maple",
                    "Rowan",
                    "Spruce",
                    "Willow",
                ),
                start=1,
            )
        )
    )

    def calls(seed: int) -> list[tuple[str, dict[str, object], bool]]:
        teacher = ScriptedGuiTeacher(task, seed=seed, mistake_rate=1.0, slip_share=0.0)
        made = [teacher.next_call(shown) for _ in range(3)]
        return [(c.name, c.arguments, c.mistake) for c in made]

    first = calls(3)
    assert first == calls(3)
    assert first[0][2] is True and first[0][0] == "click"
    assert any(calls(seed)[0] != first[0] for seed in range(4, 12))
    with pytest.raises(ValueError, match="mistake_rate"):
        ScriptedGuiTeacher(task, mistake_rate=2.0)


# -- in a real browser against the real site server ---------------------------------------------


async def solve(
    browser: BrowserSession, task: GuiTask, **teacher_args: object
) -> tuple[Episode, bool, str]:
    with serve_task(task, state_token=TOKEN) as server:
        teacher = ScriptedGuiTeacher(task, base_url=server.base_url, **teacher_args)  # type: ignore[arg-type]
        episode = await run_episode(browser, task, server.base_url, teacher)
        state = fetch_state(server.base_url, task.site, token=TOKEN)
    result = task.check(state, episode.response)
    return episode, result.success, result.detail


def sample() -> list[GuiTask]:
    """The first task of every family, and one of every kind of warm-up."""
    tasks = [next(t for t in SUITE if t.family == family) for family in FAMILIES]
    kinds = {tasks[0].goal["kind"] + tasks[0].goal.get("event", "")}
    for index in range(60):
        task = make_task(0, "warmup", index)
        kind = task.goal["kind"] + task.goal.get("event", "")
        if kind not in kinds:
            kinds.add(kind)
            tasks.append(task)
    return tasks


@in_browser
async def test_the_teacher_solves_every_family(browser: BrowserSession) -> None:
    tasks = sample()
    assert {t.family for t in tasks} == set(FAMILIES) and len(tasks) == len(FAMILIES) + 5
    for task in tasks:
        episode, success, detail = await solve(browser, task)
        assert success, (task.id, detail, [c.to_dict() for c in episode.calls])
        assert episode.finished and episode.mistakes == 0
        assert len(episode.calls) <= task.max_steps, task.id
        assert all(o.ok for o in episode.observations), task.id


@in_browser
async def test_a_noisy_teacher_fails_some_episodes_the_same_way_each_time(
    browser: BrowserSession,
) -> None:
    picks = [next(t for t in SUITE if t.family == f) for f in ("booking_new", "shop_find")]
    outcomes = []
    for task in picks:
        episode, success, _ = await solve(browser, task, mistake_rate=1.0, slip_share=1.0, seed=2)
        assert episode.mistakes >= 1 and any(c.mistake for c in episode.calls)
        outcomes.append(success)
    assert outcomes == [False, False]
    # Detours only: every wrong action is undone and the task still succeeds.
    task = picks[0]
    runs = [await solve(browser, task, mistake_rate=1.0, slip_share=0.0, seed=5) for _ in range(2)]
    (first, ok_first, detail), (second, ok_second, _) = runs
    assert ok_first and ok_second, detail
    assert first.mistakes >= 2
    assert [(c.name, c.arguments) for c in first.calls] == [
        (c.name, c.arguments) for c in second.calls
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
@in_browser
async def test_the_teacher_solves_the_whole_suite(browser: BrowserSession) -> None:
    for task in SUITE:
        episode, success, detail = await solve(browser, task)
        assert success, (task.id, detail)
        assert len(episode.calls) <= task.max_steps, task.id
