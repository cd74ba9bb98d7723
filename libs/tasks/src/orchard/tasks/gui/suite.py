"""The built-in GUI suite: browser tasks on the offline sites, generated in code, of graded
difficulty (1: one or two actions; 2: a short flow over a few pages; 3: a long flow over many).

A task is an intent a person would write ("Book the Cedar Room for Ana Silva on ..."), the one
site it runs on and that site's world (its products, rooms, articles: the task seeds the site,
so one site server serves exactly one task), the page it starts on, a step budget, and a goal
that `GuiTask.check` scores against the site's server-side state (`fetch_state`), never the
browser. Tasks that ask a question are scored on the answer given to ``done`` as well
(``check(state, response)``; `GuiTask.needs_response`).

Task ids carry what regenerates them: ``gui/<seed>/<family>/<n>`` is the ``n``-th task of
``family`` made from ``seed`` (`task_by_id`). `generate_suite` cycles through the families;
`split_suite` divides each difficulty level, family by family, between SFT, RL and held-out
evaluation. Tasks cross service boundaries as JSON (`GuiTask.to_dict`, `GuiTask.from_dict`).
Standard library only.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..splits import Split, deal_splits
from .sites import SiteServer
from .sites.booking import long_date, make_booking_world
from .sites.forms import PLANS as FORM_PLANS
from .sites.forms import make_countries
from .sites.playground import PlaygroundSite
from .sites.portal import make_portal_world
from .sites.shop import SHIPPING_CENTS, product_dicts
from .sites.wiki import make_wiki_world

__all__ = [
    "DEFAULT_COUNT",
    "FAMILIES",
    "FAMILY_DESCRIPTIONS",
    "ID_PREFIX",
    "MAX_TASKS",
    "MIN_TASKS",
    "SUITE_DESCRIPTION",
    "SUITE_NAME",
    "CheckResult",
    "Family",
    "GuiTask",
    "Split",
    "generate_suite",
    "make_task",
    "serve_task",
    "split_suite",
    "task_by_id",
]

SUITE_NAME = "builtin:gui"
SUITE_DESCRIPTION = (
    "Browser tasks generated in code on offline sites (shop, form, room booking, wiki, a "
    "portal with new tabs, a widget playground), each seeding its site and scored from the "
    "site's server-side state"
)
ID_PREFIX = "gui"
DEFAULT_COUNT = 60
MIN_TASKS = 1
_PER_FAMILY_MAX = 100
_SCAN_FACTOR = 8
"""How many task numbers per wanted task `generate_suite` tries for distinct intents."""


def _norm(text: str) -> str:
    return " ".join(str(text).split()).casefold()


def _plain(text: str) -> str:
    # 1,234 and 1234 are the same number.
    return re.sub(r"(?<=\d),(?=\d{3})", "", _norm(text))


def _mentions(text: str, value: str) -> bool:
    """Whether ``value`` occurs in ``text`` as whole words (case, spacing and thousands
    separators ignored)."""
    pattern = r"(?<![\w.])" + re.escape(_plain(value)) + r"(?!\w)"
    return re.search(pattern, _plain(text)) is not None


@dataclass(frozen=True)
class CheckResult:
    """A task's score: ``success`` when every part of the goal holds, ``score`` the share of
    parts that hold (0 to 1), ``detail`` what held and what did not."""

    success: bool
    score: float
    detail: str


class _Tally:
    """The parts of a goal as they are checked, into a `CheckResult`."""

    def __init__(self) -> None:
        self.parts: list[tuple[bool, str]] = []

    def add(self, ok: bool, what: str) -> bool:
        self.parts.append((ok, what))
        return ok

    def result(self) -> CheckResult:
        if not self.parts:
            return CheckResult(False, 0.0, "nothing to check")
        held = sum(ok for ok, _ in self.parts)
        detail = "; ".join(f"{'ok' if ok else 'FAILED'}: {what}" for ok, what in self.parts)
        return CheckResult(held == len(self.parts), held / len(self.parts), detail)


_ANSWER_KINDS = frozenset({"answer"})


@dataclass(frozen=True)
class GuiTask:
    """One browser task. ``initial_state`` is the world its ``site`` starts from;
    ``start_path`` the page it starts on (a path on the site server, e.g. ``/shop/``);
    ``goal`` what `check` verifies, as JSON (``kind`` names the check)."""

    id: str
    family: str
    difficulty: int
    site: str
    initial_state: dict[str, Any]
    start_path: str
    intent: str
    max_steps: int
    goal: dict[str, Any]

    @property
    def needs_response(self) -> bool:
        """Whether the check scores the answer given to ``done`` (an information lookup)."""
        return self.goal.get("kind") in _ANSWER_KINDS

    def start_url(self, base_url: str) -> str:
        return base_url.rstrip("/") + self.start_path

    def check(self, state: Mapping[str, Any], response: str | None = None) -> CheckResult:
        """Scores the site's state after the episode (and the answer, for a lookup)."""
        kind = self.goal.get("kind", "")
        checker = _CHECKS.get(kind)
        if checker is None:
            return CheckResult(False, 0.0, f"unknown goal kind {kind!r}")
        tally = _Tally()
        try:
            checker(self, state, response, tally)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            tally.add(False, f"the state is not what {self.site} reports: {exc!r}")
        return tally.result()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "family": self.family,
            "difficulty": self.difficulty,
            "site": self.site,
            "initial_state": self.initial_state,
            "start_path": self.start_path,
            "intent": self.intent,
            "max_steps": self.max_steps,
            "goal": self.goal,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GuiTask:
        """The task `to_dict` gave (after any JSON round trip); ValueError naming what is
        missing or wrong."""
        fields = (
            "id",
            "family",
            "difficulty",
            "site",
            "initial_state",
            "start_path",
            "intent",
            "max_steps",
            "goal",
        )
        missing = [f for f in fields if f not in data]
        if missing:
            raise ValueError(f"a GUI task needs {', '.join(missing)}")
        if not isinstance(data["initial_state"], dict) or not isinstance(data["goal"], dict):
            raise ValueError("initial_state and goal must be JSON objects")
        difficulty = int(data["difficulty"])
        if difficulty not in (1, 2, 3):
            raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
        return cls(
            id=str(data["id"]),
            family=str(data["family"]),
            difficulty=difficulty,
            site=str(data["site"]),
            initial_state=dict(data["initial_state"]),
            start_path=str(data["start_path"]),
            intent=str(data["intent"]),
            max_steps=int(data["max_steps"]),
            goal=dict(data["goal"]),
        )


def serve_task(task: GuiTask, **kwargs: Any) -> SiteServer:
    """A site server with exactly the task's site, seeded with its world (not started; use
    ``with``). ``kwargs``: `SiteServer`'s host, port, state_token."""
    return SiteServer([task.site], worlds={task.site: task.initial_state}, **kwargs)


# -- the checks: each reads only the site's state (and the answer) -----------------------------

_Checker = Callable[[GuiTask, Mapping[str, Any], "str | None", _Tally], None]


def _check_answer(task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally) -> None:
    goal = task.goal
    if not t.add(bool(response and response.strip()), "an answer was given"):
        return
    text = response or ""
    for value in goal["expected"]:
        t.add(_mentions(text, value), f"the answer names {value!r}")
    wrong = [w for w in goal.get("wrong", []) if _mentions(text, w)]
    t.add(
        not wrong, "the answer names no wrong candidate" + (f" (it names {wrong})" if wrong else "")
    )


def _check_presses(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    want = task.goal["presses"]
    t.add(state["presses"] == want, f"the button was pressed {want} times (got {state['presses']})")


def _check_playground_search(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    phrase = task.goal["query"]
    searches = [_norm(s) for s in state["searches"]]
    t.add(_norm(phrase) in searches, f"searched for {phrase!r} (searches: {state['searches']})")


def _check_event(task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally) -> None:
    kind, value = task.goal["event"], task.goal["value"]
    seen = [e for e in state["events"] if e["kind"] == kind]
    t.add(any(e["value"] == value for e in seen), f"the page reported {kind} {value!r}")


def _check_drag(task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally) -> None:
    levels = [e["value"] for e in state["events"] if e["kind"] == "drag"]
    target, tolerance = task.goal["level"], task.goal["tolerance"]
    if not t.add(bool(levels), "the slider was dragged"):
        return
    last = levels[-1]
    t.add(
        isinstance(last, int | float) and abs(last - target) <= tolerance,
        f"the slider ends at {target} ± {tolerance} (it is at {last})",
    )


def _cart(state: Mapping[str, Any]) -> dict[str, int]:
    return {str(item["id"]): int(item["qty"]) for item in state["cart"]}


def _check_shop_cart(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    want = {k: int(v) for k, v in task.goal["cart"].items()}
    cart = _cart(state)
    for pid, qty in want.items():
        t.add(cart.get(pid) == qty, f"{qty} x {pid} in the cart (got {cart.get(pid, 0)})")
    extra = sorted(set(cart) - set(want))
    t.add(not extra, "nothing else in the cart" + (f" (also {extra})" if extra else ""))
    t.add(not state["orders"], "no order was placed")


def _check_shop_order(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    goal = task.goal
    orders = state["orders"]
    if not t.add(len(orders) == 1, f"exactly one order was placed (got {len(orders)})"):
        return
    order = orders[0]
    items = {str(i["id"]): int(i["qty"]) for i in order["items"]}
    want = {k: int(v) for k, v in goal["items"].items()}
    t.add(items == want, f"the order holds {want} (it holds {items})")
    for key in ("name", "email", "address", "city"):
        t.add(
            _norm(order[key]) == _norm(goal[key]),
            f"{key} is {goal[key]!r} (got {order[key]!r})",
        )
    t.add(order["shipping"] == goal["shipping"], f"shipping is {goal['shipping']}")


def _check_form(task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally) -> None:
    goal = task.goal
    submissions = state["submissions"]
    if not t.add(len(submissions) == 1, f"one application was sent (got {len(submissions)})"):
        return
    sent = submissions[0]
    for key in ("full_name", "email", "phone", "plan", "country", "comments"):
        t.add(_norm(sent.get(key, "")) == _norm(goal[key]), f"{key} is {goal[key]!r}")
    t.add(sent.get("newsletter") is goal["newsletter"], f"newsletter is {goal['newsletter']}")


def _bookings(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(b["ref"]): b for b in state["bookings"]}


def _others_unchanged(
    task: GuiTask, now: dict[str, dict[str, Any]], t: _Tally, except_ref: str = ""
) -> None:
    changed = [
        b["ref"]
        for b in task.initial_state["bookings"]
        if b["ref"] != except_ref and now.get(b["ref"]) != b
    ]
    t.add(
        not changed,
        "the other bookings are as they were" + (f" ({changed} changed)" if changed else ""),
    )


def _check_booking_new(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    goal = task.goal
    now = _bookings(state)
    before = {b["ref"] for b in task.initial_state["bookings"]}
    new = [b for ref, b in now.items() if ref not in before and b["status"] == "active"]
    _others_unchanged(task, now, t)
    if not t.add(len(new) == 1, f"exactly one new booking (got {len(new)})"):
        return
    booking = new[0]
    for key in ("room", "date", "slot"):
        t.add(booking[key] == goal[key], f"{key} is {goal[key]} (got {booking[key]})")
    t.add(_norm(booking["name"]) == _norm(goal["name"]), f"booked for {goal['name']!r}")
    t.add(int(booking["attendees"]) == int(goal["attendees"]), f"{goal['attendees']} attendees")


def _check_booking_cancel(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    ref = task.goal["ref"]
    now = _bookings(state)
    t.add(now.get(ref, {}).get("status") == "cancelled", f"{ref} is cancelled")
    _others_unchanged(task, now, t, except_ref=ref)
    t.add(len(now) == len(task.initial_state["bookings"]), "no booking was added")


def _check_booking_move(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    goal = task.goal
    now = _bookings(state)
    booking = now.get(goal["ref"], {})
    t.add(booking.get("status") == "active", f"{goal['ref']} is still booked")
    t.add(
        (booking.get("date"), booking.get("slot")) == (goal["date"], goal["slot"]),
        f"{goal['ref']} is on {goal['date']} at {goal['slot']} "
        f"(it is on {booking.get('date')} at {booking.get('slot')})",
    )
    _others_unchanged(task, now, t, except_ref=goal["ref"])
    t.add(len(now) == len(task.initial_state["bookings"]), "no booking was added")


def _articles(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(a["slug"]): a for a in state["articles"]}


def _check_wiki_search(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    term = task.goal["query"]
    t.add(
        _norm(term) in [_norm(s) for s in state["searches"]],
        f"searched for {term!r} (searches: {state['searches']})",
    )


def _wiki_others_unchanged(task: GuiTask, now: dict[str, dict[str, Any]], t: _Tally) -> None:
    slug = task.goal["slug"]
    changed = [
        a["slug"]
        for a in task.initial_state["articles"]
        if a["slug"] != slug
        and (
            now[a["slug"]]["body"] != a["body"]
            or now[a["slug"]]["tags"] != a["tags"]
            or now[a["slug"]]["talk"] != a["talk"]
        )
    ]
    t.add(
        not changed,
        "the other articles are as they were" + (f" ({changed} changed)" if changed else ""),
    )


def _initial_article(task: GuiTask) -> dict[str, Any]:
    slug = task.goal["slug"]
    return next(a for a in task.initial_state["articles"] if a["slug"] == slug)


def _check_wiki_reply(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    goal = task.goal
    now = _articles(state)
    before = _initial_article(task)
    talk = now[goal["slug"]]["talk"]
    t.add(talk[: len(before["talk"])] == before["talk"], "earlier replies are kept")
    new = talk[len(before["talk"]) :]
    if not t.add(len(new) == 1, f"one reply was posted (got {len(new)})"):
        return
    t.add(_norm(new[0]["author"]) == _norm(goal["author"]), f"signed {goal['author']!r}")
    t.add(_norm(new[0]["text"]) == _norm(goal["text"]), f"the reply says {goal['text']!r}")
    t.add(now[goal["slug"]]["body"] == before["body"], "the article itself is unchanged")
    _wiki_others_unchanged(task, now, t)


def _check_wiki_edit(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    goal = task.goal
    now = _articles(state)
    before = _initial_article(task)
    article = now[goal["slug"]]
    if goal.get("tag"):
        want = sorted({*before["tags"], goal["tag"]})
        t.add(sorted(article["tags"]) == want, f"the tags are {want} (got {article['tags']})")
        t.add(article["body"] == before["body"], "the text is unchanged")
    else:
        sentence = _norm(goal["sentence"])
        text = _norm(" ".join(article["body"]))
        kept = _norm(" ".join(before["body"]))
        t.add(text.startswith(kept), "the earlier text is kept as it was")
        t.add(text[len(kept) :].strip() == sentence, f"{goal['sentence']!r} is added at the end")
        t.add(sorted(article["tags"]) == sorted(before["tags"]), "the tags are unchanged")
    _wiki_others_unchanged(task, now, t)


def _check_activation(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    t.add(state["billing_active"] is True, "online billing is active")
    t.add(any(a["ok"] for a in state["activations"]), "the right agreement code was entered")


def _check_redemption(
    task: GuiTask, state: Mapping[str, Any], response: str | None, t: _Tally
) -> None:
    plan = task.goal["plan"]
    done = [r for r in state["redemptions"] if r["ok"]]
    t.add(any(r["plan"] == plan for r in done), f"the voucher was redeemed for {plan}")
    other = sorted({r["plan"] for r in done if r["plan"] != plan})
    t.add(not other, "not for another plan" + (f" (also {other})" if other else ""))


_CHECKS: dict[str, _Checker] = {
    "answer": _check_answer,
    "presses": _check_presses,
    "playground_search": _check_playground_search,
    "event": _check_event,
    "drag": _check_drag,
    "shop_cart": _check_shop_cart,
    "shop_order": _check_shop_order,
    "form": _check_form,
    "booking_new": _check_booking_new,
    "booking_cancel": _check_booking_cancel,
    "booking_move": _check_booking_move,
    "wiki_search": _check_wiki_search,
    "wiki_reply": _check_wiki_reply,
    "wiki_edit": _check_wiki_edit,
    "activation": _check_activation,
    "redemption": _check_redemption,
}

# -- the families ------------------------------------------------------------------------------

_PEOPLE = (
    ("Ana", "Silva"),
    ("Ben", "Carter"),
    ("Chen", "Wei"),
    ("Dara", "Quinn"),
    ("Eva", "Novak"),
    ("Femi", "Adeyemi"),
    ("Gita", "Rao"),
    ("Hugo", "Martin"),
    ("Ines", "Costa"),
    ("Jamal", "Idris"),
    ("Kira", "Holm"),
    ("Luis", "Ortega"),
    ("Maya", "Cohen"),
    ("Nils", "Dahl"),
    ("Olga", "Petrova"),
    ("Pavel", "Novak"),
)
_STREETS = ("Elm Street", "Mill Lane", "Harbour Road", "Station Road", "Oak Avenue", "High Street")
_CITIES = ("Leeds", "Porto", "Lyon", "Graz", "Tartu", "Malmo", "Cork", "Bergen", "Delft")
_WORDS = (
    "amber",
    "brisk",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "jasper",
    "kelp",
    "lumen",
    "meadow",
    "nectar",
    "onyx",
    "pebble",
    "quartz",
    "russet",
)


@dataclass(frozen=True)
class _Parts:
    site: str
    world: dict[str, Any]
    start_path: str
    intent: str
    goal: dict[str, Any]


def _person(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(_PEOPLE)
    return f"{first} {last}", f"{first.lower()}.{last.lower()}@example.org"


def _warmup(key: str, rng: random.Random) -> _Parts:
    world = PlaygroundSite.make_world(0)
    world["help_code"] = f"{rng.choice(_WORDS).upper()}-{rng.randint(10, 99)}"
    start = "/playground/"
    variant = rng.choice(("press", "search", "hover", "scroll", "drag", "help"))
    if variant == "press":
        times = rng.randint(1, 3)
        word = {1: "once", 2: "twice", 3: "three times"}[times]
        intent = rng.choice(
            (f"Press the 'Press me' button {word}.", f"Click the Press me button {word}, no more.")
        )
        goal: dict[str, Any] = {"kind": "presses", "presses": times}
    elif variant == "search":
        query = f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}"
        intent = rng.choice(
            (f"Search the playground for '{query}'.", f"Use the search box to look up '{query}'.")
        )
        goal = {"kind": "playground_search", "query": query}
    elif variant == "hover":
        intent = rng.choice(
            (
                "Show the tooltip of 'What is this?' by pointing at it.",
                "Hover over 'What is this?' to see what the page is.",
            )
        )
        goal = {"kind": "event", "event": "hover", "value": "help"}
    elif variant == "scroll":
        intent = rng.choice(
            ("Scroll to the very end of the widget page.", "Scroll down until the end of the page.")
        )
        goal = {"kind": "event", "event": "scroll", "value": "bottom"}
    elif variant == "drag":
        level = rng.choice((20, 30, 40, 50, 60, 70, 80))
        intent = rng.choice(
            (f"Drag the level slider to about {level}.", f"Set the level to roughly {level}.")
        )
        goal = {"kind": "drag", "level": level, "tolerance": 8}
    else:
        intent = rng.choice(
            (
                "Open 'Help in a new tab' and tell me the help code it shows.",
                "What is the help code? It is on the help page, which opens in a new tab.",
                "Find the help code (the help link opens a new tab) and report it.",
            )
        )
        goal = {"kind": "answer", "expected": [world["help_code"]], "wrong": ["ORCHID-7"]}
    return _Parts("playground", world, start, intent, goal)


def _shop_world(key: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    products = product_dicts(key)
    return {"products": products}, products


def _shop_add(key: str, rng: random.Random) -> _Parts:
    world, products = _shop_world(key)
    product = rng.choice(products)
    qty = rng.randint(2, 6)
    intent = rng.choice(
        (
            f"Add {qty} of this {product['name']} to the cart.",
            f"Put {qty} {product['name']} items in my cart.",
            f"I want {qty} of the {product['name']}: add them to the cart.",
        )
    )
    goal = {"kind": "shop_cart", "cart": {product["id"]: qty}}
    return _Parts("shop", world, f"/shop/product/{product['id']}", intent, goal)


def _shop_find(key: str, rng: random.Random) -> _Parts:
    world, products = _shop_world(key)
    product = rng.choice(products)
    qty = rng.randint(1, 4)
    intent = rng.choice(
        (
            f"Find the {product['name']} in the shop and add {qty} to the cart.",
            f"Search the shop for the {product['name']} and put {qty} in the cart.",
        )
    )
    goal = {"kind": "shop_cart", "cart": {product["id"]: qty}}
    return _Parts("shop", world, "/shop/", intent, goal)


def _shop_cheapest(key: str, rng: random.Random) -> _Parts:
    world, products = _shop_world(key)
    most = rng.random() < 0.5
    categories = sorted({p["category"] for p in products})
    rng.shuffle(categories)
    for category in categories:
        members = sorted(
            (p for p in products if p["category"] == category),
            key=lambda p: p["price_cents"],
            reverse=most,
        )
        # A tie would make two answers right.
        if len(members) > 1 and members[0]["price_cents"] != members[1]["price_cents"]:
            break
    chosen = members[0]
    extreme = rng.choice(
        ("most expensive", "priciest", "highest-priced")
        if most
        else ("cheapest", "least expensive", "lowest-priced")
    )
    question = rng.choice(
        (
            f"Which is the {extreme} product in the shop's {category} category?",
            f"Look through the {category} category: which product is the {extreme}?",
            f"In the {category} section of the shop, find the {extreme} product.",
            f"What is the {extreme} item the shop sells under {category}?",
        )
    )
    answer = rng.choice(
        ("Answer with its name.", "Reply with just the product name.", "Tell me its name.")
    )
    goal = {
        "kind": "answer",
        "expected": [chosen["name"]],
        "wrong": [p["name"] for p in members[1:]],
        "category": category,
    }
    return _Parts("shop", world, "/shop/", f"{question} {answer}", goal)


def _shop_checkout(key: str, rng: random.Random) -> _Parts:
    world, products = _shop_world(key)
    first, second = rng.sample(products, 2)
    qty_first, qty_second = 1, rng.randint(2, 3)
    name, email = _person(rng)
    address = f"{rng.randint(2, 98)} {rng.choice(_STREETS)}"
    city = rng.choice(_CITIES)
    shipping = rng.choice(sorted(SHIPPING_CENTS))
    intent = (
        f"Order one {first['name']} and {qty_second} {second['name']} for {name} "
        f"({email}), delivered to {address}, {city}, with {shipping} shipping."
    )
    goal = {
        "kind": "shop_order",
        "items": {first["id"]: qty_first, second["id"]: qty_second},
        "order": [first["id"], second["id"]],
        "name": name,
        "email": email,
        "address": address,
        "city": city,
        "shipping": shipping,
    }
    return _Parts("shop", world, "/shop/", intent, goal)


_COMMENTS = (
    "I would like to borrow audiobooks.",
    "Please send the card by post.",
    "I teach at the primary school nearby.",
    "Interested in the reading club.",
)


def _forms_apply(key: str, rng: random.Random) -> _Parts:
    countries = make_countries(key)
    world = {"countries": countries, "reference_prefix": f"LIB-{rng.randint(10, 99)}"}
    name, email = _person(rng)
    phone = f"+44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"
    plan = rng.choice(FORM_PLANS)
    country = rng.choice(countries)
    newsletter = rng.random() < 0.5
    comments = rng.choice(_COMMENTS)
    letter = "with" if newsletter else "without"
    intent = (
        f"Apply for library membership for {name}: email {email}, phone {phone}, the "
        f"{plan} plan, country {country}, {letter} the newsletter, and the comment "
        f"'{comments}'."
    )
    goal = {
        "kind": "form",
        "full_name": name,
        "email": email,
        "phone": phone,
        "plan": plan,
        "country": country,
        "newsletter": newsletter,
        "comments": comments,
    }
    return _Parts("forms", world, "/forms/step/1", intent, goal)


def _open_days(world: dict[str, Any], months: int) -> list[dt.date]:
    """The open days from today to the end of the ``months``-th month (1: this month)."""
    today = dt.date.fromisoformat(world["today"])
    index = today.year * 12 + today.month - 1 + months
    end = dt.date(index // 12, index % 12 + 1, 1)
    days = []
    day = today
    while day < end:
        if day.weekday() in world["open_weekdays"]:
            days.append(day)
        day += dt.timedelta(days=1)
    return days


def _free_slots(world: dict[str, Any], room: str, day: dt.date) -> list[str]:
    taken = {
        b["slot"]
        for b in world["bookings"]
        if b["room"] == room and b["date"] == day.isoformat() and b["status"] == "active"
    }
    return [s for s in world["slots"] if s not in taken]


def _booking_new(key: str, rng: random.Random) -> _Parts:
    world = make_booking_world(key)
    today = dt.date.fromisoformat(world["today"])
    room = rng.choice(world["rooms"])
    next_month = rng.random() < 0.5
    days = [d for d in _open_days(world, 2) if (d.month != today.month) == next_month and d > today]
    day = rng.choice(days[:20])
    slot = rng.choice(_free_slots(world, room["id"], day))
    name, _ = _person(rng)
    attendees = rng.randint(2, room["capacity"])
    intent = rng.choice(
        (
            f"Book the {room['name']} on {long_date(day)} at {slot} for {name}, "
            f"{attendees} people.",
            f"Reserve the {room['name']} for {name} ({attendees} attendees) on "
            f"{long_date(day)}, {slot}.",
        )
    )
    goal = {
        "kind": "booking_new",
        "room": room["id"],
        "room_name": room["name"],
        "date": day.isoformat(),
        "slot": slot,
        "name": name,
        "attendees": attendees,
    }
    return _Parts("booking", world, "/booking/", intent, goal)


def _booking_target(world: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A booking whose person also holds another booking (so the day tells them apart)."""
    target: dict[str, Any] = rng.choice(world["bookings"])
    rooms = {r["id"]: r for r in world["rooms"]}
    for day in _open_days(world, 1)[3:]:
        if day.isoformat() != target["date"]:
            free = _free_slots(world, target["room"], day)
            if free:
                twin = dict(target)
                twin.update(
                    ref=f"BK-{world['next_ref']}",
                    date=day.isoformat(),
                    slot=rng.choice(free),
                    attendees=rng.randint(1, rooms[target["room"]]["capacity"]),
                )
                world["next_ref"] += 1
                world["bookings"].append(twin)
                world["bookings"].sort(key=lambda b: (b["date"], b["slot"], b["room"]))
                break
    return target


def _booking_cancel(key: str, rng: random.Random) -> _Parts:
    world = make_booking_world(key)
    target = _booking_target(world, rng)
    room = next(r for r in world["rooms"] if r["id"] == target["room"])
    day = long_date(dt.date.fromisoformat(target["date"]))
    intent = rng.choice(
        (
            f"Cancel {target['name']}'s booking of the {room['name']} on {day}.",
            f"{target['name']} no longer needs the {room['name']} on {day} at "
            f"{target['slot']}: cancel that booking.",
        )
    )
    goal = {"kind": "booking_cancel", "ref": target["ref"]}
    return _Parts("booking", world, "/booking/", intent, goal)


def _booking_reschedule(key: str, rng: random.Random) -> _Parts:
    world = make_booking_world(key)
    target = _booking_target(world, rng)
    room = next(r for r in world["rooms"] if r["id"] == target["room"])
    old = dt.date.fromisoformat(target["date"])
    options = [
        d
        for d in _open_days(world, 2)
        if d != old and abs((d - old).days) <= 35 and _free_slots(world, room["id"], d)
    ]
    day = rng.choice(options)
    slot = rng.choice(_free_slots(world, room["id"], day))
    intent = rng.choice(
        (
            f"Move {target['name']}'s {room['name']} booking on {long_date(old)} to "
            f"{long_date(day)} at {slot}.",
            f"Reschedule the {room['name']} booking {target['name']} has on "
            f"{long_date(old)}: it should be on {long_date(day)}, {slot} instead.",
        )
    )
    goal = {"kind": "booking_move", "ref": target["ref"], "date": day.isoformat(), "slot": slot}
    return _Parts("booking", world, "/booking/", intent, goal)


def _wiki_pick(key: str, rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    world = make_wiki_world(key)
    return world, rng.choice(world["articles"])


def _wiki_search(key: str, rng: random.Random) -> _Parts:
    world, article = _wiki_pick(key, rng)
    term = rng.choice((article["title"], article["title"].split()[-1], *article["tags"]))
    intent = rng.choice(
        (f"Search the wiki for '{term}'.", f"Use the wiki's search box to look for '{term}'.")
    )
    goal = {"kind": "wiki_search", "query": term}
    return _Parts("wiki", world, "/wiki/", intent, goal)


def _wiki_lookup(key: str, rng: random.Random) -> _Parts:
    world, article = _wiki_pick(key, rng)
    fact, value = rng.choice(article["facts"])
    wrong = sorted(
        {
            v
            for a in world["articles"]
            if a["slug"] != article["slug"]
            for k, v in a["facts"]
            if k == fact and _norm(v) != _norm(value) and not _mentions(v, value)
        }
    )
    intent = rng.choice(
        (
            f"According to the wiki, what is the {fact.lower()} of {article['title']}? "
            "Answer with the value.",
            f"Look up {article['title']} on the wiki and tell me its {fact.lower()}.",
        )
    )
    goal = {
        "kind": "answer",
        "expected": [value],
        "wrong": wrong,
        "slug": article["slug"],
        "title": article["title"],
        "fact": fact,
    }
    return _Parts("wiki", world, "/wiki/", intent, goal)


_REPLIES = (
    "I can confirm the figures from my own visit.",
    "There is a new footpath along the north side.",
    "The old photos are in the town archive.",
    "Thanks, this helped me plan a trip.",
    "The spring counts were higher this year.",
    "A guided walk starts at the visitor centre.",
)


def _wiki_reply(key: str, rng: random.Random) -> _Parts:
    world, article = _wiki_pick(key, rng)
    author, _ = _person(rng)
    text = rng.choice(_REPLIES)
    intent = (
        f"In the discussion of the wiki article {article['title']}, post a reply signed "
        f"{author} saying: {text}"
    )
    goal = {
        "kind": "wiki_reply",
        "slug": article["slug"],
        "title": article["title"],
        "author": author,
        "text": text,
        "replies": len(article["talk"]),
    }
    return _Parts("wiki", world, "/wiki/", intent, goal)


_SENTENCES = (
    "A footbridge was built here in 2026.",
    "Volunteers count it every spring.",
    "The area is closed to cars on Sundays.",
    "Local guides lead walks in summer.",
    "It appears on the valley's oldest map.",
)


def _wiki_edit(key: str, rng: random.Random) -> _Parts:
    world, article = _wiki_pick(key, rng)
    goal: dict[str, Any] = {"kind": "wiki_edit", "slug": article["slug"], "title": article["title"]}
    unused = [
        t for t in ("wetland", "historic", "rare", "popular", "alpine") if t not in article["tags"]
    ]
    if unused and rng.random() < 0.5:
        tag = rng.choice(unused)
        goal["tag"] = tag
        goal["tags_text"] = ", ".join(article["tags"])
        intent = (
            f"Add the tag '{tag}' to the wiki article {article['title']}, keeping its other tags."
        )
    else:
        sentence = rng.choice(_SENTENCES)
        goal["sentence"] = sentence
        intent = (
            f"Edit the wiki article {article['title']}: add the sentence '{sentence}' at the "
            "end of its text."
        )
    return _Parts("wiki", world, "/wiki/", intent, goal)


def _tabs_terms(key: str, rng: random.Random) -> _Parts:
    world = make_portal_world(key)
    intent = rng.choice(
        (
            f"Turn on online billing for account {world['account']} in the Greenfield portal. "
            "The agreement code is at the end of the terms of service.",
            f"Activate online billing for {world['customer']} (account {world['account']}); "
            "you need the code printed at the end of the terms, which open in a new tab.",
        )
    )
    goal = {"kind": "activation"}
    return _Parts("portal", world, "/portal/", intent, goal)


def _tabs_voucher(key: str, rng: random.Random) -> _Parts:
    world = make_portal_world(key)
    plan = rng.choice(world["plans"])
    intent = rng.choice(
        (
            f"Redeem the voucher from {world['customer']}'s welcome letter for the {plan} plan "
            f"(account {world['account']}).",
            f"On account {world['account']}, use the voucher code in the welcome letter to pay "
            f"for the {plan} plan.",
        )
    )
    goal = {"kind": "redemption", "plan": plan}
    return _Parts("portal", world, "/portal/", intent, goal)


@dataclass(frozen=True)
class Family:
    """A kind of task: its difficulty, a step budget, what it asks and its generator."""

    difficulty: int
    max_steps: int
    description: str
    make: Callable[[str, random.Random], _Parts]


FAMILIES: dict[str, Family] = {
    "warmup": Family(
        1, 6, "One playground widget: press, search, hover, scroll, drag, a new tab.", _warmup
    ),
    "shop_add": Family(1, 6, "On a product page, put a number of it in the cart.", _shop_add),
    "wiki_search": Family(1, 5, "Search the wiki for a term.", _wiki_search),
    "shop_find": Family(
        2, 12, "Search the shop for a product and put some in the cart.", _shop_find
    ),
    "shop_cheapest": Family(
        2, 10, "Name the cheapest or dearest product of a category (an answer).", _shop_cheapest
    ),
    "booking_new": Family(
        2, 14, "Book a room on a day and time, this month or the next.", _booking_new
    ),
    "booking_cancel": Family(2, 10, "Cancel one of a person's two bookings.", _booking_cancel),
    "wiki_lookup": Family(
        2, 12, "Read a fact from an article's infobox (an answer).", _wiki_lookup
    ),
    "wiki_reply": Family(2, 16, "Post a signed reply in an article's discussion.", _wiki_reply),
    "tabs_terms": Family(
        2, 16, "Copy a code from a page that opens in a new tab into a form.", _tabs_terms
    ),
    "shop_checkout": Family(
        3, 40, "Buy two products and check out with an address and shipping.", _shop_checkout
    ),
    "forms_apply": Family(3, 30, "Fill in and send a three-step application.", _forms_apply),
    "booking_reschedule": Family(
        3, 18, "Move a booking to another day and time.", _booking_reschedule
    ),
    "wiki_edit": Family(
        3, 18, "Add a tag or a sentence to an article through its edit form.", _wiki_edit
    ),
    "tabs_voucher": Family(
        3, 20, "Read a code in a popup window, close it, redeem it for a plan.", _tabs_voucher
    ),
}
"""Family name -> difficulty, step budget, description, generator."""

FAMILY_DESCRIPTIONS = {name: family.description for name, family in FAMILIES.items()}
MAX_TASKS = _PER_FAMILY_MAX * len(FAMILIES)
"""The largest suite: a hundred tasks per family, each with its own intent."""


def make_task(seed: int, family: str, index: int) -> GuiTask:
    """The ``index``-th task of ``family`` from ``seed``; the same on every machine."""
    spec = FAMILIES.get(family)
    if spec is None:
        raise ValueError(f"unknown GUI family {family!r}; families: {', '.join(FAMILIES)}")
    if index < 0:
        raise ValueError(f"task number must be >= 0, got {index}")
    key = f"{seed}/{family}/{index}"
    parts = spec.make(key, random.Random(key))
    return GuiTask(
        id=f"{ID_PREFIX}/{seed}/{family}/{index}",
        family=family,
        difficulty=spec.difficulty,
        site=parts.site,
        initial_state=parts.world,
        start_path=parts.start_path,
        intent=parts.intent,
        max_steps=spec.max_steps,
        goal=parts.goal,
    )


def task_by_id(task_id: str) -> GuiTask:
    """The task ``gui/<seed>/<family>/<n>`` names; ValueError saying what is wrong."""
    parts = task_id.split("/")
    if len(parts) != 4 or parts[0] != ID_PREFIX:
        raise ValueError(f"{task_id!r} is not a GUI task id ({ID_PREFIX}/<seed>/<family>/<n>)")
    _, seed, family, index = parts
    if not re.fullmatch(r"-?\d+", seed) or not index.isdigit():
        raise ValueError(f"{task_id!r}: the seed and the task number must be whole numbers")
    return make_task(int(seed), family, int(index))


def generate_suite(count: int = DEFAULT_COUNT, seed: int = 0) -> list[GuiTask]:
    """``count`` tasks cycling through the families (so difficulties stay balanced), each
    with an intent no other task of the suite has."""
    if not MIN_TASKS <= count <= MAX_TASKS:
        raise ValueError(f"count must lie in [{MIN_TASKS}, {MAX_TASKS}], got {count}")
    families = list(FAMILIES)
    wanted = {f: len(range(i, count, len(families))) for i, f in enumerate(families)}
    chosen = {f: _family_tasks(seed, f, n) for f, n in wanted.items()}
    return [chosen[families[i % len(families)]][i // len(families)] for i in range(count)]


def _family_tasks(seed: int, family: str, count: int) -> list[GuiTask]:
    """``count`` tasks of ``family`` with distinct intents (a scripted policy or a person
    reading a report tells them apart by it): task numbers whose intent repeats an earlier one
    are passed over; should the family run short, the rest repeat in task-number order."""
    unique: list[GuiTask] = []
    repeated: list[GuiTask] = []
    seen: set[str] = set()
    index = 0
    while len(unique) < count and index < max(count, 1) * _SCAN_FACTOR:
        task = make_task(seed, family, index)
        (repeated if task.intent in seen else unique).append(task)
        seen.add(task.intent)
        index += 1
    return (unique + repeated)[:count]


def split_suite(
    tasks: Sequence[GuiTask],
    fractions: Mapping[Split, float] | None = None,
    seed: int = 0,
) -> dict[Split, list[GuiTask]]:
    """Tasks divided by ``fractions`` (default 60 % SFT, 20 % RL, 20 % held-out), disjoint and
    covering. Difficulty levels are taken one after another and, within a level, its families
    in an order the seed shuffles; what rounding leaves over carries to the next family, so
    the sizes follow the fractions over the whole suite and a split with fraction f gets at
    least ``floor(f * n)`` of a level's n tasks (every level of a 60-task suite is in every
    split)."""
    shares: dict[Split, float] = dict(fractions or {"sft": 0.6, "rl": 0.2, "evaluate": 0.2})
    unknown = set(shares) - {"sft", "rl", "evaluate"}
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; the splits are sft, rl, evaluate")
    if any(v < 0 for v in shares.values()) or abs(sum(shares.values()) - 1.0) > 1e-9:
        raise ValueError(
            f"fractions must be >= 0 and sum to 1, they sum to {sum(shares.values()):g}"
        )
    rng = random.Random(f"gui-split/{seed}")
    groups = []
    for level in sorted({t.difficulty for t in tasks}):
        names = sorted({t.family for t in tasks if t.difficulty == level})
        rng.shuffle(names)
        for family in names:
            members = sorted(
                (t for t in tasks if t.family == family and t.difficulty == level),
                key=lambda t: t.id,
            )
            rng.shuffle(members)
            groups.append(members)
    out = deal_splits(groups, shares)
    for chosen in out.values():
        chosen.sort(key=lambda t: t.id)
    return out
