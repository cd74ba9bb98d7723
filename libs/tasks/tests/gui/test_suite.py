"""The GUI suite without a browser: ids, families, difficulties, splits, determinism and the JSON
round trip; and every family's check against a real site server driven over HTTP, where doing
what the intent asks passes and a wrong behaviour (wrong slot, wrong item, wrong code, ...)
fails."""

from __future__ import annotations

import collections
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from orchard.tasks.gui.sites import SITES, fetch_state
from orchard.tasks.gui.suite import (
    FAMILIES,
    MAX_TASKS,
    GuiTask,
    generate_suite,
    make_task,
    serve_task,
    split_suite,
    task_by_id,
)

pytestmark = pytest.mark.timeout(60)

TOKEN = "check-token"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def post(url: str, fields: dict[str, Any]) -> int:
    opener = urllib.request.build_opener(_NoRedirect)
    data = urllib.parse.urlencode({k: str(v) for k, v in fields.items()}).encode()
    try:
        with opener.open(urllib.request.Request(url, data=data), timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def post_json(url: str, value: Any) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(value).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _free_slot(task: GuiTask, room: str, date: str, avoid: str) -> str:
    world = task.initial_state
    taken = {
        b["slot"]
        for b in world["bookings"]
        if b["room"] == room and b["date"] == date and b["status"] == "active"
    }
    return next(s for s in world["slots"] if s not in taken and s != avoid)


def act(task: GuiTask, base: str, *, right: bool) -> str | None:
    """Does over HTTP what the task asks (``right``) or a plausible wrong version of it;
    returns the answer for tasks that ask a question."""
    goal, site = task.goal, f"{base}/{task.site}"
    kind = goal["kind"]
    if kind == "answer":
        return goal["expected"][0] if right else (goal["wrong"] or ["I do not know"])[0]
    if kind == "presses":
        for _ in range(goal["presses"] + (0 if right else 1)):
            assert post(f"{site}/press", {}) == 303
    elif kind == "playground_search":
        query = goal["query"] if right else goal["query"] + " lamp"
        get(f"{site}/search?" + urllib.parse.urlencode({"q": query}))
    elif kind == "event":
        value = goal["value"] if right else "elsewhere"
        post_json(f"{site}/api/event", {"kind": goal["event"], "value": value})
    elif kind == "drag":
        level = goal["level"] + (0 if right else 30)
        post_json(f"{site}/api/event", {"kind": "drag", "value": level})
    elif kind == "shop_cart":
        ((pid, qty),) = goal["cart"].items()
        assert post(f"{site}/cart/add", {"id": pid, "qty": qty + (0 if right else 1)}) == 303
    elif kind == "shop_order":
        for pid, qty in goal["items"].items():
            assert post(f"{site}/cart/add", {"id": pid, "qty": qty}) == 303
        shipping = (
            goal["shipping"] if right else {"standard": "express"}.get(goal["shipping"], "standard")
        )
        fields = {k: goal[k] for k in ("name", "email", "address", "city")}
        assert post(f"{site}/checkout", {**fields, "shipping": shipping}) == 303
    elif kind == "form":
        step1 = {"full_name": goal["full_name"], "email": goal["email"], "phone": goal["phone"]}
        assert post(f"{site}/step/1", step1) == 303
        plan = goal["plan"] if right else next(p for p in ("basic", "pro") if p != goal["plan"])
        step2 = {"plan": plan, "country": goal["country"]}
        if goal["newsletter"]:
            step2["newsletter"] = "yes"
        assert post(f"{site}/step/2", step2) == 303
        assert post(f"{site}/step/3", {"comments": goal["comments"], "agree": "yes"}) == 303
    elif kind == "booking_new":
        slot = goal["slot"] if right else _free_slot(task, goal["room"], goal["date"], goal["slot"])
        fields = {k: goal[k] for k in ("room", "date", "name", "attendees")}
        assert post(f"{site}/book", {**fields, "slot": slot}) == 303
    elif kind == "booking_cancel":
        target = next(b for b in task.initial_state["bookings"] if b["ref"] == goal["ref"])
        others = [b for b in task.initial_state["bookings"] if b["ref"] != goal["ref"]]
        # The wrong one: the same person's other booking, which the intent's day rules out.
        twin = next((b for b in others if b["name"] == target["name"]), others[0])
        ref = goal["ref"] if right else twin["ref"]
        assert post(f"{site}/reservation/{ref}/cancel", {}) == 303
    elif kind == "booking_move":
        room = next(b for b in task.initial_state["bookings"] if b["ref"] == goal["ref"])["room"]
        slot = goal["slot"] if right else _free_slot(task, room, goal["date"], goal["slot"])
        fields = {"date": goal["date"], "slot": slot}
        assert post(f"{site}/reservation/{goal['ref']}/move", fields) == 303
    elif kind == "wiki_search":
        query = goal["query"] if right else goal["query"] + "x"
        get(f"{site}/search?" + urllib.parse.urlencode({"q": query}))
    elif kind == "wiki_reply":
        author = goal["author"] if right else "Somebody Else"
        fields = {"author": author, "reply": goal["text"]}
        assert post(f"{site}/article/{goal['slug']}/talk", fields) == 303
    elif kind == "wiki_edit":
        article = next(a for a in task.initial_state["articles"] if a["slug"] == goal["slug"])
        text, tags = "\n\n".join(article["body"]), ", ".join(article["tags"])
        if goal.get("tag"):
            # Wrong: the new tag replaces the old ones.
            tags = f"{tags}, {goal['tag']}" if right else goal["tag"]
        else:
            # Wrong: the sentence at the start instead of the end.
            parts = [text, goal["sentence"]] if right else [goal["sentence"], text]
            text = "\n\n".join(parts)
        fields = {"text": text, "tags": tags, "summary": "edit"}
        assert post(f"{site}/article/{goal['slug']}/edit", fields) == 303
    elif kind == "activation":
        code = task.initial_state["agreement_code"] if right else "AGR-0000"
        post(f"{site}/activate", {"code": code, "accept": "yes"})
    elif kind == "redemption":
        plan = (
            goal["plan"]
            if right
            else next(p for p in task.initial_state["plans"] if p != goal["plan"])
        )
        post(f"{site}/voucher", {"code": task.initial_state["voucher_code"], "plan": plan})
    else:
        raise AssertionError(f"no HTTP script for goal kind {kind}")
    return "Done."


def play(task: GuiTask, *, right: bool) -> tuple[bool, float, str]:
    with serve_task(task, state_token=TOKEN) as server:
        response = act(task, server.base_url, right=right)
        state = fetch_state(server.base_url, task.site, token=TOKEN)
    result = task.check(state, response)
    return result.success, result.score, result.detail


SUITE = generate_suite(60, seed=0)


def test_sixty_distinct_tasks_over_every_site_and_level() -> None:
    assert len(SUITE) == 60
    assert len({t.id for t in SUITE}) == 60
    assert len({t.intent for t in SUITE}) == 60
    for task in SUITE:
        prefix, seed, family, index = task.id.split("/")
        assert (prefix, seed, family) == ("gui", "0", task.family) and index.isdigit()
        assert task.max_steps >= 1 and task.start_path.startswith(f"/{task.site}/")
    families = collections.Counter(t.family for t in SUITE)
    assert len(families) >= 8 and set(families) == set(FAMILIES)
    assert {t.site for t in SUITE} == set(SITES)
    assert {t.difficulty for t in SUITE} == {1, 2, 3}
    assert {FAMILIES[f].difficulty for f in families} == {1, 2, 3}


def test_the_largest_suite_has_distinct_ids_and_intents() -> None:
    tasks = generate_suite(MAX_TASKS, seed=1)
    assert len({t.id for t in tasks}) == len({t.intent for t in tasks}) == MAX_TASKS > 60
    with pytest.raises(ValueError, match="count must lie"):
        generate_suite(MAX_TASKS + 1)


def test_a_seed_gives_the_same_suite_and_another_seed_another() -> None:
    again = generate_suite(60, seed=0)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in SUITE]
    other = generate_suite(60, seed=1)
    assert [t.id for t in other] != [t.id for t in SUITE]
    assert [t.initial_state for t in other] != [t.initial_state for t in SUITE]
    assert all(task_by_id(t.id) == t for t in SUITE)


def test_tasks_survive_a_json_round_trip() -> None:
    for task in SUITE:
        copy = GuiTask.from_dict(json.loads(json.dumps(task.to_dict())))
        assert copy == task and copy.check({}, None) == task.check({}, None)
    data = SUITE[0].to_dict()
    del data["goal"]
    with pytest.raises(ValueError, match="needs goal"):
        GuiTask.from_dict(data)
    with pytest.raises(ValueError, match="difficulty must be"):
        GuiTask.from_dict({**SUITE[0].to_dict(), "difficulty": 7})
    with pytest.raises(ValueError, match="not a GUI task id"):
        task_by_id("claw/0/reply_mail/1")
    with pytest.raises(ValueError, match="unknown GUI family"):
        task_by_id("gui/0/casino/1")


def test_splits_are_disjoint_covering_and_graded() -> None:
    splits = split_suite(SUITE, seed=0)
    ids = [t.id for part in splits.values() for t in part]
    assert len(ids) == len(set(ids)) == 60 and set(ids) == {t.id for t in SUITE}
    assert {k: len(v) for k, v in splits.items()} == {"sft": 36, "rl": 12, "evaluate": 12}
    for part in splits.values():
        assert {t.difficulty for t in part} == {1, 2, 3}
    assert split_suite(SUITE, seed=0) == splits
    assert split_suite(SUITE, seed=5) != splits
    assert sum(len(v) for v in split_suite(generate_suite(17), seed=2).values()) == 17
    with pytest.raises(ValueError, match="sum to 1"):
        split_suite(SUITE, {"sft": 0.5, "rl": 0.2, "evaluate": 0.2})


def test_no_task_is_solved_before_anyone_acts() -> None:
    for task in SUITE:
        state = SITES[task.site](0, task.initial_state).state()
        result = task.check(state, None)
        assert not result.success and result.score < 1, task.id


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_check_passes_the_right_behaviour_and_fails_a_wrong_one(family: str) -> None:
    for task in [t for t in SUITE if t.family == family][:2]:
        success, score, detail = play(task, right=True)
        assert success and score == 1.0, (task.id, detail)
        success, score, detail = play(task, right=False)
        assert not success and score < 1.0, (task.id, detail)
        assert "FAILED" in detail


def test_every_warmup_kind_is_checked() -> None:
    seen: set[str] = set()
    for index in range(60):
        task = make_task(0, "warmup", index)
        kind = task.goal["kind"] + task.goal.get("event", "")
        if kind in seen:
            continue
        seen.add(kind)
        assert play(task, right=True)[0], task.id
        assert not play(task, right=False)[0], task.id
    assert seen == {"presses", "playground_search", "eventhover", "eventscroll", "drag", "answer"}


def test_answers_are_matched_as_whole_words_and_wrong_candidates_fail() -> None:
    task = next(t for t in SUITE if t.family == "wiki_lookup")
    value = task.goal["expected"][0]
    assert task.needs_response and not SUITE[1].needs_response
    assert task.check({}, f"It is {value}.").success
    assert task.check({}, f"it is {value.upper().replace(',', '')}").success
    assert not task.check({}, None).success
    assert not task.check({}, f"1{value}").success
    if task.goal["wrong"]:
        hedged = task.check({}, f"{value} or maybe {task.goal['wrong'][0]}")
        assert not hedged.success and 0 < hedged.score < 1
