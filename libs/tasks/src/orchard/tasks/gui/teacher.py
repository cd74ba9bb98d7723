"""A scripted teacher for the GUI suite: a plan of semantic steps per task (`plan_for`) and
`ScriptedGuiTeacher`, which turns the next step into a real tool call with coordinates read
from the latest observation's page text (`orchard.tasks.gui.page_text`).

A step names what a person would aim at ("click the button named Add to cart", "type 3 into
the field labelled Quantity"); the teacher finds it on screen, scrolls when it is not there (down
to the end, then up), waits once, and gives up with ``done`` saying what it could not find.
With ``mistake_rate`` it now and then does something wrong instead of a step: clicks a
look-alike control of the same kind, types a garbled text, picks another option. Mistakes stay
on the site (never a closed browser or a foreign page) and come in two kinds: a *detour* the
teacher undoes (it goes back from the page a wrong click opened, closes a tab it opened, then
does the step; a retyped field or a re-chosen option simply overwrite), and, with chance
``slip_share``, a *slip* it goes on from as if the step were done (the wrong slot is booked,
the field keeps its typo, the next target is never found). Slips make a noisy teacher fail
some episodes, for credit assignment. Everything is deterministic given the task and
``seed``.

`run_episode` plays a task with the teacher in a `BrowserSession` (for tests, demos and
scripted rollouts); the tools' names and arguments are those of `orchard.tasks.gui.actions`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .actions import validate_arguments
from .observation import Observation
from .page_text import PageElement, PageText, parse_page_text
from .sites.booking import long_date
from .sites.shop import SHIPPING_CENTS
from .suite import GuiTask

if TYPE_CHECKING:
    from .browser import BrowserSession

__all__ = [
    "Check",
    "Choose",
    "Click",
    "CloseTab",
    "Done",
    "Drag",
    "Episode",
    "Hover",
    "Look",
    "PlanStep",
    "ScriptedGuiTeacher",
    "ScrollToEnd",
    "SwitchTab",
    "ToolCall",
    "Type",
    "plan_for",
    "run_episode",
    "step_dict",
]

# Roles a click aims at; text and headings are read, not clicked.
_CLICKABLE = (
    "link",
    "button",
    "checkbox",
    "radio",
    "tab",
    "menuitem",
    "option",
    "switch",
    "clickable",
    "combobox",
)
_FIELDS = ("textbox", "searchbox", "spinbutton")
_SCROLL_PIXELS = 500
_MAX_SCROLLS = 8
_MAX_KEYS = 20  # press_keys takes at most 20 keys a call


# -- the semantic steps ------------------------------------------------------------------------


@dataclass(frozen=True)
class Click:
    """Click the control named ``name`` (``exact``: the whole name; else a prefix or part)."""

    name: str
    roles: tuple[str, ...] = _CLICKABLE
    exact: bool = True

    def describe(self) -> str:
        return f"I click {self.name!r}."


@dataclass(frozen=True)
class Type:
    """Type ``text`` into the field labelled ``label``: replacing what it holds, or after it
    (``append``); ``submit`` presses Enter afterwards."""

    label: str
    text: str
    submit: bool = False
    append: bool = False

    def describe(self) -> str:
        where = "at the end of" if self.append else "into"
        return f"I type {self.text.strip()!r} {where} the field {self.label!r}."


@dataclass(frozen=True)
class Choose:
    """Pick the option whose text starts with ``option`` in the drop-down ``label``."""

    label: str
    option: str

    def describe(self) -> str:
        return f"I choose {self.option!r} in {self.label!r}."


@dataclass(frozen=True)
class Check:
    """Make the checkbox or radio button ``label`` checked (``on``) or unchecked."""

    label: str
    on: bool = True

    def describe(self) -> str:
        return f"I make sure {self.label!r} is {'checked' if self.on else 'not checked'}."


@dataclass(frozen=True)
class Hover:
    """Point at the element named ``name``."""

    name: str

    def describe(self) -> str:
        return f"I point at {self.name!r}."


@dataclass(frozen=True)
class Drag:
    """Drag the element named ``name`` by ``dx``, ``dy`` pixels."""

    name: str
    dx: int
    dy: int = 0

    def describe(self) -> str:
        return f"I drag {self.name!r} by {self.dx} pixels."


@dataclass(frozen=True)
class Look:
    """Bring ``text`` on screen (scrolling if need be) before going on; no call when it is."""

    text: str

    def describe(self) -> str:
        return f"I read {self.text!r}."


@dataclass(frozen=True)
class ScrollToEnd:
    """Scroll down until nothing is left below the screen."""

    def describe(self) -> str:
        return "I scroll down to the end of the page."


@dataclass(frozen=True)
class SwitchTab:
    index: int

    def describe(self) -> str:
        return f"I go back to tab {self.index}."


@dataclass(frozen=True)
class CloseTab:
    index: int | None = None

    def describe(self) -> str:
        return "I close this tab."


@dataclass(frozen=True)
class Done:
    """Finish, with the answer or a short report."""

    answer: str

    def describe(self) -> str:
        return "Finished."


PlanStep = (
    Click | Type | Choose | Check | Hover | Drag | Look | ScrollToEnd | SwitchTab | CloseTab | Done
)


def step_dict(step: PlanStep) -> dict[str, Any]:
    """A step as JSON: ``{"step": "click", "name": ...}``."""
    return {"step": type(step).__name__.lower(), **dataclasses.asdict(step)}


# -- the plans ---------------------------------------------------------------------------------


def _plan_warmup(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    kind = goal["kind"]
    if kind == "presses":
        times = int(goal["presses"])
        return [*([Click("Press me")] * times), Done(f"Pressed the button {times} times.")]
    if kind == "playground_search":
        return [Type("Search", goal["query"], submit=True), Done(f"Searched for {goal['query']}.")]
    if kind == "event" and goal["event"] == "hover":
        return [Hover("What is this?"), Done("The tooltip says: A page of widgets.")]
    if kind == "event":
        return [ScrollToEnd(), Done("Scrolled to the end of the page.")]
    if kind == "drag":
        # The knob travels 370 pixels (the track less the knob) from level 0 to 100.
        return [
            Drag("Level slider", round(int(goal["level"]) * 3.7)),
            Done(f"The level is about {goal['level']}."),
        ]
    code = str(goal["expected"][0])
    return [Click("Help in a new tab"), Look(code), Done(f"The help code is {code}.")]


def _product(task: GuiTask, pid: str) -> dict[str, Any]:
    return next(p for p in task.initial_state["products"] if p["id"] == pid)


def _plan_shop_add(task: GuiTask) -> list[PlanStep]:
    ((pid, qty),) = task.goal["cart"].items()
    name = _product(task, pid)["name"]
    return [
        Type("Quantity", str(qty)),
        Click("Add to cart"),
        Done(f"Added {qty} x {name} to the cart."),
    ]


def _find_and_add(name: str, qty: int) -> list[PlanStep]:
    steps: list[PlanStep] = [
        Type("Search products", name, submit=True),
        Click(name, roles=("link",)),
    ]
    if qty != 1:
        steps.append(Type("Quantity", str(qty)))
    return [*steps, Click("Add to cart")]


def _plan_shop_find(task: GuiTask) -> list[PlanStep]:
    ((pid, qty),) = task.goal["cart"].items()
    name = _product(task, pid)["name"]
    return [*_find_and_add(name, int(qty)), Done(f"Added {qty} x {name} to the cart.")]


def _plan_shop_cheapest(task: GuiTask) -> list[PlanStep]:
    answer = str(task.goal["expected"][0])
    return [
        Click(task.goal["category"], roles=("link",)),
        Look(answer),
        Done(f"{answer}"),
    ]


def _plan_shop_checkout(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    steps: list[PlanStep] = []
    for n, pid in enumerate(goal["order"]):
        if n:
            steps.append(Click("Shop", roles=("link",)))
        steps += _find_and_add(_product(task, pid)["name"], int(goal["items"][pid]))
    shipping = str(goal["shipping"])
    steps += [
        Click("Checkout"),
        Type("Full name", goal["name"]),
        Type("Email", goal["email"]),
        Type("Street address", goal["address"]),
        Type("City", goal["city"]),
        Choose("Shipping", shipping.title()),
        Click("Place order"),
        Done(f"Placed the order with {shipping} shipping (${SHIPPING_CENTS[shipping] / 100:.2f})."),
    ]
    return steps


def _plan_forms_apply(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    return [
        Type("Full name", goal["full_name"]),
        Type("Email", goal["email"]),
        Type("Phone (optional)", goal["phone"]),
        Click("Next"),
        Check(str(goal["plan"]).title()),
        Choose("Country", goal["country"]),
        Check("Send me the newsletter", on=bool(goal["newsletter"])),
        Click("Next"),
        Type("Comments", goal["comments"]),
        Check("I agree to the library rules"),
        Click("Submit application"),
        Done(f"Sent the application for {goal['full_name']}."),
    ]


def _months_between(first: dt.date, second: dt.date) -> int:
    return (second.year - first.year) * 12 + second.month - first.month


def _month_steps(months: int) -> list[PlanStep]:
    name = "Next month" if months > 0 else "Previous month"
    return [Click(name, roles=("link",))] * abs(months)


def _booking(task: GuiTask, ref: str) -> dict[str, Any]:
    return next(b for b in task.initial_state["bookings"] if b["ref"] == ref)


def _plan_booking_new(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    today = dt.date.fromisoformat(task.initial_state["today"])
    day = dt.date.fromisoformat(goal["date"])
    return [
        Click(f"Book {goal['room_name']}"),
        *_month_steps(_months_between(today, day)),
        Click(long_date(day), roles=("link",)),
        Click(f"Book {goal['slot']}"),
        Type("Your name", goal["name"]),
        Type("Attendees", str(goal["attendees"])),
        Click("Confirm booking"),
        Done(f"Booked the {goal['room_name']} on {long_date(day)} at {goal['slot']}."),
    ]


def _plan_booking_cancel(task: GuiTask) -> list[PlanStep]:
    ref = task.goal["ref"]
    return [
        Click("All bookings"),
        Click(f"Cancel {ref}"),
        Click("Yes, cancel booking"),
        Done(f"Cancelled booking {ref}."),
    ]


def _plan_booking_reschedule(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    old = dt.date.fromisoformat(_booking(task, goal["ref"])["date"])
    day = dt.date.fromisoformat(goal["date"])
    return [
        Click("All bookings"),
        Click(f"Reschedule {goal['ref']}"),
        *_month_steps(_months_between(old, day)),
        Click(long_date(day), roles=("link",)),
        Click(f"Move to {goal['slot']}"),
        Click("Confirm move"),
        Done(f"Moved {goal['ref']} to {long_date(day)} at {goal['slot']}."),
    ]


def _open_article(title: str) -> list[PlanStep]:
    return [Type("Search the wiki", title, submit=True), Click(title, roles=("link",))]


def _plan_wiki_search(task: GuiTask) -> list[PlanStep]:
    query = task.goal["query"]
    return [Type("Search the wiki", query, submit=True), Done(f"Searched the wiki for {query}.")]


def _plan_wiki_lookup(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    value = str(goal["expected"][0])
    return [
        *_open_article(goal["title"]),
        Look(value),
        Done(f"The {str(goal['fact']).lower()} of {goal['title']} is {value}."),
    ]


def _plan_wiki_reply(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    return [
        *_open_article(goal["title"]),
        Click("Discussion", exact=False),
        Type("Your name", goal["author"]),
        Type("Your reply", goal["text"]),
        Click("Post reply"),
        Done(f"Posted the reply on {goal['title']}."),
    ]


def _plan_wiki_edit(task: GuiTask) -> list[PlanStep]:
    goal = task.goal
    change: PlanStep
    if goal.get("tag"):
        change = Type("Tags (separated by commas)", f", {goal['tag']}", append=True)
    else:
        change = Type("Article text", f"\n\n{goal['sentence']}", append=True)
    return [
        *_open_article(goal["title"]),
        Click("Edit this article"),
        change,
        Click("Save changes"),
        Done(f"Edited {goal['title']}."),
    ]


def _plan_tabs_terms(task: GuiTask) -> list[PlanStep]:
    code = str(task.initial_state["agreement_code"])
    return [
        Click("Activate online billing"),
        Click("terms of service", roles=("link",)),
        Look(code),
        SwitchTab(0),
        Type("Agreement code", code),
        Check("I accept the terms of service"),
        Click("Activate billing"),
        Done("Online billing is active."),
    ]


def _plan_tabs_voucher(task: GuiTask) -> list[PlanStep]:
    code = str(task.initial_state["voucher_code"])
    plan = str(task.goal["plan"])
    return [
        Click("Redeem a voucher"),
        Click("Open my welcome letter"),
        Look(code),
        Click("Close this letter"),
        Type("Voucher code", code),
        Choose("Plan", plan),
        Click("Redeem voucher"),
        Done(f"Redeemed the voucher for the {plan} plan."),
    ]


_PLANS: dict[str, Callable[[GuiTask], list[PlanStep]]] = {
    "warmup": _plan_warmup,
    "shop_add": _plan_shop_add,
    "wiki_search": _plan_wiki_search,
    "shop_find": _plan_shop_find,
    "shop_cheapest": _plan_shop_cheapest,
    "booking_new": _plan_booking_new,
    "booking_cancel": _plan_booking_cancel,
    "wiki_lookup": _plan_wiki_lookup,
    "wiki_reply": _plan_wiki_reply,
    "tabs_terms": _plan_tabs_terms,
    "shop_checkout": _plan_shop_checkout,
    "forms_apply": _plan_forms_apply,
    "booking_reschedule": _plan_booking_reschedule,
    "wiki_edit": _plan_wiki_edit,
    "tabs_voucher": _plan_tabs_voucher,
}


def plan_for(task: GuiTask) -> list[PlanStep]:
    """The semantic steps that solve ``task`` from its start page, ending with `Done`."""
    make = _PLANS.get(task.family)
    if make is None:
        raise ValueError(f"no plan for GUI family {task.family!r}")
    return make(task)


# -- the teacher -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool's name and arguments (`orchard.tasks.gui.actions`), what the
    teacher meant by it, and whether it was a deliberate mistake."""

    name: str
    arguments: dict[str, Any]
    thought: str = ""
    mistake: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "arguments": dict(self.arguments),
            "thought": self.thought,
            "mistake": self.mistake,
        }


def _garble(text: str, rng: random.Random) -> str:
    """A typo: two neighbouring characters swapped, or one dropped."""
    stripped = text.strip()
    if len(stripped) < 2:
        return stripped + "x"
    i = rng.randrange(len(stripped) - 1)
    if stripped[i] != stripped[i + 1] and rng.random() < 0.5:
        return stripped[:i] + stripped[i + 1] + stripped[i] + stripped[i + 2 :]
    return stripped[:i] + stripped[i + 1 :]


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


class ScriptedGuiTeacher:
    """Steps through `plan_for(task)`, one tool call per `next_call`. Give it each
    observation (with its page text) or the page text alone; ``base_url`` lets it open the
    start page itself when the tab is blank. ``mistake_rate``: the chance, per click, typing or
    choosing step, of a wrong action in its place; ``slip_share``: the share of those left
    uncorrected (the rest are undone, then the step is done)."""

    def __init__(
        self,
        task: GuiTask,
        *,
        base_url: str | None = None,
        seed: int = 0,
        mistake_rate: float = 0.0,
        slip_share: float = 0.5,
    ) -> None:
        for name, value in (("mistake_rate", mistake_rate), ("slip_share", slip_share)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        self.slip_share = slip_share
        self.task = task
        self.plan = plan_for(task)
        self.base_url = base_url.rstrip("/") if base_url else None
        self.mistake_rate = mistake_rate
        self._rng = random.Random(f"gui-teacher/{seed}/{task.id}")
        self._step = 0
        self._queue: list[ToolCall] = []
        self._restore: tuple[str, int | None] | None = None
        self._restore_calls = 0
        self._slipped = False
        self._scrolled_down = 0
        self._scrolled_up = 0
        self._waited = False
        self.mistakes = 0
        self.finished = False
        self.gave_up: str | None = None

    @property
    def step_index(self) -> int:
        """Index of the plan step the teacher is at."""
        return self._step

    def next_call(self, observation: Observation | str) -> ToolCall:
        """The next tool call, from the latest observation (or its page text)."""
        if isinstance(observation, Observation):
            if observation.page_text is None:
                raise ValueError(
                    "the observation has no page text: start the browser with page_text=True"
                )
            page = parse_page_text(observation.page_text)
            tabs: int | None = len(observation.tabs)
        else:
            page, tabs = parse_page_text(observation), None
        if self.finished:
            final = self.plan[-1]
            answer = final.answer if isinstance(final, Done) else ""
            return ToolCall("done", {"response": self.gave_up or answer}, "Already finished.")
        if self._restore is not None:
            call = self._undo(page, tabs)
            if call is not None:
                return call
        if self._queue:
            return self._queue.pop(0)
        if page.url in ("", "about:blank") and self.base_url:
            return ToolCall(
                "goto_url",
                {"url": self.task.start_url(self.base_url)},
                "I open the page the task starts on.",
            )
        while True:
            step = self.plan[self._step]
            if not self._slipped and self._rng.random() < self.mistake_rate:
                self._slipped = True
                keep = self._rng.random() < self.slip_share
                wrong = self._mistake(step, page, tabs, keep=keep)
                if wrong:
                    self.mistakes += 1
                    if keep:
                        self._advance(step)
                    wrong = [dataclasses.replace(c, mistake=True) for c in wrong]
                    self._queue = wrong[1:]
                    return wrong[0]
            calls = self._resolve(step, page)
            if calls is None:
                return self._recover(step, page)
            if isinstance(step, ScrollToEnd) and calls and self._scrolled_down < _MAX_SCROLLS:
                # Not done until nothing is left below (or a page that keeps growing has had
                # its share of scrolls): stay on this step.
                self._scrolled_down += 1
                return calls[0]
            if isinstance(step, ScrollToEnd):
                calls = []
            self._advance(step)
            if calls:
                self._queue = calls[1:]
                return calls[0]

    def _advance(self, step: PlanStep) -> None:
        self._step += 1
        self._slipped = False
        self._scrolled_down = self._scrolled_up = 0
        self._waited = False
        if isinstance(step, Done):
            self.finished = True

    # -- resolving a step into calls -----------------------------------------------------------

    def _resolve(self, step: PlanStep, page: PageText) -> list[ToolCall] | None:
        """The calls that carry ``step`` out on ``page``; None when its target is not on
        screen; an empty list when nothing needs doing."""
        thought = step.describe()
        if isinstance(step, Click):
            target = page.find(step.name, step.roles, exact=step.exact)
            return None if target is None else [_click(target, thought)]
        if isinstance(step, Type):
            target = page.find(step.label, _FIELDS)
            if target is None:
                return None
            if step.append:
                calls = [
                    _click(target, thought),
                    ToolCall("press_keys", {"keys": ["Control+End"]}, "I go to the end of it."),
                    ToolCall("write", {"text": step.text, "clear": False}, thought),
                ]
            else:
                calls = [
                    ToolCall(
                        "write",
                        {"text": step.text, "x": target.x, "y": target.y, "clear": True},
                        thought,
                    )
                ]
            if step.submit:
                calls.append(ToolCall("press_keys", {"keys": ["Enter"]}, "I send it with Enter."))
            return calls
        if isinstance(step, Choose):
            target = page.find(step.label, ("combobox",))
            if target is None:
                return None
            return _choose(target, step.option, thought)
        if isinstance(step, Check):
            target = page.find(step.label, ("checkbox", "radio", "switch"), exact=True)
            if target is None:
                return None
            if ("checked" in target.flags) == step.on:
                return []
            return [_click(target, thought)]
        if isinstance(step, Hover):
            target = page.find(step.name)
            if target is None:
                return None
            return [ToolCall("hover", {"x": target.x, "y": target.y}, thought)]
        if isinstance(step, Drag):
            target = page.find(step.name)
            if target is None:
                return None
            width, height = page.viewport
            to_x = min(max(target.x + step.dx, 0), max(width - 1, 0))
            to_y = min(max(target.y + step.dy, 0), max(height - 1, 0))
            arguments = {"from_x": target.x, "from_y": target.y, "to_x": to_x, "to_y": to_y}
            return [ToolCall("drag", arguments, thought)]
        if isinstance(step, Look):
            return [] if _norm(step.text) in _norm(page.text()) else None
        if isinstance(step, ScrollToEnd):
            if page.below == 0:
                return []
            return [ToolCall("scroll", {"direction": "down", "amount": 2000}, thought)]
        if isinstance(step, SwitchTab):
            return [ToolCall("switch_tab", {"index": step.index}, thought)]
        if isinstance(step, CloseTab):
            arguments = {} if step.index is None else {"index": step.index}
            return [ToolCall("close_tab", arguments, thought)]
        return [ToolCall("done", {"response": step.answer}, thought)]

    def _recover(self, step: PlanStep, page: PageText) -> ToolCall:
        """The target is not on screen: scroll down to the end, then up, wait once, give up."""
        what = next(
            (getattr(step, a) for a in ("name", "label", "text") if getattr(step, a, "")),
            step.describe(),
        )
        if page.below and self._scrolled_down < _MAX_SCROLLS:
            self._scrolled_down += 1
            return ToolCall(
                "scroll",
                {"direction": "down", "amount": _SCROLL_PIXELS},
                f"I do not see {what!r} yet; I scroll down.",
            )
        if page.above and self._scrolled_up < _MAX_SCROLLS:
            self._scrolled_up += 1
            return ToolCall(
                "scroll",
                {"direction": "up", "amount": _SCROLL_PIXELS},
                f"I do not see {what!r}; I scroll up.",
            )
        if not self._waited:
            self._waited = True
            self._scrolled_down = self._scrolled_up = 0
            return ToolCall("wait", {"seconds": 1}, f"{what!r} is not there; I wait a moment.")
        self.finished = True
        self.gave_up = f"I could not find {what!r} on {page.url}."
        return ToolCall("done", {"response": self.gave_up}, "I give up.")

    # -- mistakes --------------------------------------------------------------------------------

    def _mistake(
        self, step: PlanStep, page: PageText, tabs: int | None, *, keep: bool
    ) -> list[ToolCall] | None:
        """Wrong calls in place of ``step``, or None when the step has no sensible wrong twin
        on this page. ``keep``: a slip the teacher goes on from as if the step were done;
        else a detour it undoes (going back from a page or closing a tab a wrong click
        opened) before doing the step."""
        if isinstance(step, Click):
            target = page.find(step.name, step.roles, exact=step.exact)
            if target is None:
                return None
            twins = [
                e
                for e in page.elements
                if e.role == target.role
                and _norm(e.name) != _norm(target.name)
                and "newtab" not in e.flags
                and "disabled" not in e.flags
            ]
            if not twins:
                return None
            wrong = self._rng.choice(twins)
            if not keep:
                self._restore = (page.url, tabs)
                self._restore_calls = 0
            return [_click(wrong, f"I click {wrong.name!r}.")]
        if isinstance(step, Type) and step.text.strip():
            target = page.find(step.label, _FIELDS)
            if target is None:
                return None
            text = _garble(step.text, self._rng)
            arguments = {"text": text, "x": target.x, "y": target.y, "clear": not step.append}
            calls = [ToolCall("write", arguments, f"I type {text!r}.")]
            if keep and step.submit:
                calls.append(ToolCall("press_keys", {"keys": ["Enter"]}, "I send it."))
            return calls
        if isinstance(step, Choose):
            target = page.find(step.label, ("combobox",))
            if target is None:
                return None
            others = [o for o in target.options if not _norm(o).startswith(_norm(step.option))]
            if not others:
                return None
            return _choose(target, self._rng.choice(others), "I pick an option.")
        return None

    def _undo(self, page: PageText, tabs: int | None) -> ToolCall | None:
        """After a wrong click: close a tab it opened, or go back from a page it opened."""
        if self._restore is None:
            return None
        url, tabs_before = self._restore
        if self._restore_calls < 3:
            self._restore_calls += 1
            if tabs is not None and tabs_before is not None and tabs > tabs_before:
                return ToolCall("close_tab", {}, "That opened a tab I do not need; I close it.")
            if page.url and page.url != url:
                return ToolCall("go_back", {}, "That was the wrong page; I go back.")
        self._restore = None
        return None


def _click(target: PageElement, thought: str) -> ToolCall:
    return ToolCall("click", {"x": target.x, "y": target.y}, thought)


def _choose(target: PageElement, option: str, thought: str) -> list[ToolCall]:
    """Open the drop-down, move to the option with the arrow keys, take it with Enter."""
    wanted = _norm(option)
    options = [_norm(o) for o in target.options]
    index = next((i for i, o in enumerate(options) if o == wanted), None)
    if index is None:
        index = next((i for i, o in enumerate(options) if o.startswith(wanted)), 0)
    current = (
        options.index(_norm(target.value or "")) if _norm(target.value or "") in options else 0
    )
    moves = index - current
    key = "ArrowDown" if moves > 0 else "ArrowUp"
    keys = [key] * abs(moves) + ["Enter"]
    calls = [_click(target, thought)]
    for start in range(0, len(keys), _MAX_KEYS):
        calls.append(ToolCall("press_keys", {"keys": keys[start : start + _MAX_KEYS]}, thought))
    return calls


# -- playing a task ----------------------------------------------------------------------------


@dataclass
class Episode:
    """What `run_episode` did: the calls, the observations after them, and the answer."""

    task_id: str
    calls: list[ToolCall] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    response: str | None = None
    finished: bool = False
    """Whether the teacher called ``done`` within the step budget."""

    @property
    def mistakes(self) -> int:
        return sum(c.mistake for c in self.calls)


async def run_episode(
    browser: BrowserSession,
    task: GuiTask,
    base_url: str,
    teacher: ScriptedGuiTeacher | None = None,
    *,
    max_steps: int | None = None,
) -> Episode:
    """Closes every tab but the first (plans count tabs from a fresh browser's one), opens the
    task's start page there and lets the teacher act until it calls ``done`` or ``max_steps``
    calls (default: twice the task's hint) are made. The caller seeds the site
    (`orchard.tasks.gui.suite.serve_task`) and checks it afterwards."""
    teacher = teacher or ScriptedGuiTeacher(task, base_url=base_url)
    budget = max_steps if max_steps is not None else 2 * task.max_steps
    episode = Episode(task.id)
    tabs = len((await browser.observe()).tabs)
    for index in reversed(range(1, tabs)):
        await browser.close_tab(index)
    observation = await browser.goto_url(task.start_url(base_url))
    for _ in range(budget):
        if observation.page_text is None:
            text = (await browser.read_page_text()).render(browser.config.page_text_max_chars)
            observation = dataclasses.replace(observation, page_text=text)
        call = teacher.next_call(observation)
        validate_arguments(call.name, call.arguments)
        observation = await browser.call(call.name, call.arguments)
        episode.calls.append(call)
        episode.observations.append(observation)
        if observation.done:
            episode.response, episode.finished = observation.response, True
            break
    return episode
