"""What the browser returns after every tool call: the latest screenshot, the viewport size, the
tabs, what happened (the action's result, dialogs, popups, errors) and, when the browser is
asked for it, the active page as text (`orchard.tasks.gui.page_text`). A model reads it as
`Observation.summary`; `parse_summary` reads that text back (what a scripted teacher given only
a conversation works from)."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["DialogRecord", "ErrorKind", "Observation", "TabInfo", "parse_summary"]

# invalid_argument: the call was refused before it ran (fix the arguments);
# timeout: the action or page load did not finish in time (the page may be hung);
# page_crashed: the tab's renderer died (the tab was replaced by a blank one);
# browser_crashed: the browser process died (a fresh browser was started, earlier tabs lost);
# action_failed: the browser ran the action and it failed (e.g. a URL that does not load).
ErrorKind = Literal[
    "invalid_argument", "timeout", "page_crashed", "browser_crashed", "action_failed"
]


@dataclass(frozen=True)
class TabInfo:
    """One open tab."""

    index: int
    url: str
    title: str
    active: bool


@dataclass(frozen=True)
class DialogRecord:
    """A JavaScript dialog the page opened and the browser answered on its own."""

    type: str  # alert, confirm, prompt or beforeunload
    message: str
    answer: str  # "accepted", "dismissed", or 'accepted with "text"' for a prompt


@dataclass(frozen=True)
class Observation:
    """The state after one tool call. ``ok`` is false when the call failed (``error`` says how
    and ``message`` what to do); a failed call still carries the screenshot and tabs."""

    tool: str
    ok: bool
    message: str
    screenshot: bytes | None  # PNG of the active tab's viewport; None when it could not be taken
    viewport: tuple[int, int]  # width, height in pixels: the screenshot's size
    tabs: tuple[TabInfo, ...]
    error: ErrorKind | None = None
    events: tuple[str, ...] = ()  # what else happened: dialogs, popups, tabs the page closed
    dialogs: tuple[DialogRecord, ...] = ()
    done: bool = False
    response: str | None = None  # the agent's answer, from ``done``
    elapsed_s: float = 0.0
    # The active page as text (elements, names, centres); None when not asked for or unreadable.
    page_text: str | None = None

    @property
    def active_tab(self) -> int:
        """Index of the active tab (-1 when there is none, which only a dead browser shows)."""
        return next((t.index for t in self.tabs if t.active), -1)

    def screenshot_base64(self) -> str | None:
        """The screenshot as base64 text (for JSON and image URLs), or None."""
        return None if self.screenshot is None else base64.b64encode(self.screenshot).decode()

    def summary(self) -> str:
        """The observation as text for a model (the screenshot goes beside it as an image)."""
        head = self.message if self.ok else f"error ({self.error}): {self.message}"
        lines = [head]
        lines += [f"note: {event}" for event in self.events]
        width, height = self.viewport
        lines.append(f"viewport: {width}x{height}")
        for tab in self.tabs:
            mark = "*" if tab.active else " "
            lines.append(f"{mark}[{tab.index}] {tab.title or '(no title)'} - {tab.url}")
        if self.screenshot is None:
            lines.append("no screenshot this time")
        if self.page_text is not None:
            lines += ["page text:", self.page_text]
        return "\n".join(lines)

    def to_dict(self, *, screenshot: bool = True) -> dict[str, Any]:
        """JSON-ready form; the screenshot as base64 under ``screenshot_png_base64``."""
        out: dict[str, Any] = {
            "tool": self.tool,
            "ok": self.ok,
            "message": self.message,
            "error": self.error,
            "events": list(self.events),
            "dialogs": [
                {"type": d.type, "message": d.message, "answer": d.answer} for d in self.dialogs
            ],
            "viewport": {"width": self.viewport[0], "height": self.viewport[1]},
            "tabs": [
                {"index": t.index, "url": t.url, "title": t.title, "active": t.active}
                for t in self.tabs
            ],
            "active_tab": self.active_tab,
            "done": self.done,
            "response": self.response,
            "elapsed_s": round(self.elapsed_s, 4),
            "page_text": self.page_text,
        }
        if screenshot:
            out["screenshot_png_base64"] = self.screenshot_base64()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Observation:
        """The observation `to_dict` gave (as a browser sandbox's tool server sends it);
        KeyError or ValueError for one that is not."""
        encoded = data.get("screenshot_png_base64")
        viewport = data["viewport"]
        return cls(
            tool=str(data["tool"]),
            ok=bool(data["ok"]),
            message=str(data["message"]),
            screenshot=base64.b64decode(encoded, validate=True) if encoded else None,
            viewport=(int(viewport["width"]), int(viewport["height"])),
            tabs=tuple(
                TabInfo(int(t["index"]), str(t["url"]), str(t["title"]), bool(t["active"]))
                for t in data["tabs"]
            ),
            error=data.get("error"),
            events=tuple(str(e) for e in data.get("events") or ()),
            dialogs=tuple(
                DialogRecord(str(d["type"]), str(d["message"]), str(d["answer"]))
                for d in data.get("dialogs") or ()
            ),
            done=bool(data.get("done")),
            response=None if data.get("response") is None else str(data["response"]),
            elapsed_s=float(data.get("elapsed_s") or 0.0),
            page_text=None if data.get("page_text") is None else str(data["page_text"]),
        )


_ERROR_HEAD = re.compile(r"^error \((\w+)\): ")
# A failed call without a kind writes "error (None): ...".
_ERROR_KINDS: dict[str, ErrorKind | None] = {kind: kind for kind in get_args(ErrorKind)}
_ERROR_KINDS["None"] = None
_VIEWPORT = re.compile(r"^viewport: (\d+)x(\d+)$")
# The title may hold " - "; a URL holds no space, so the last " - " ends the title.
_TAB = re.compile(r"^([* ])\[(\d+)\] (.*) - (\S*)$")
_PAGE_TEXT = "page text:"


def parse_summary(text: str, tool: str = "") -> Observation:
    """The observation `Observation.summary` wrote as ``text``: its message (and error kind),
    notes, viewport, tabs and page text. What the text does not hold is left empty: the
    screenshot (None, whether or not one was taken), the dialogs (their notes stay in
    ``events``), ``done``, ``response``, the time taken; ``tool`` is the caller's. A message or
    note of several lines comes back whole unless a line of it starts with "note: ".
    ValueError when ``text`` has no viewport line (it is no summary)."""
    lines = text.split("\n")
    at, viewport = next(
        ((i, m) for i, line in enumerate(lines) if i and (m := _VIEWPORT.match(line))), (0, None)
    )
    if viewport is None:
        raise ValueError("not an observation summary: it has no 'viewport: WxH' line")
    # The message, then one note per "note: " line; other lines continue the one before.
    parts = [[lines[0]]]
    for line in lines[1:at]:
        if line.startswith("note: "):
            parts.append([line.removeprefix("note: ")])
        else:
            parts[-1].append(line)
    head, *notes = ("\n".join(part) for part in parts)
    ok, error, message = True, None, head
    if (match := _ERROR_HEAD.match(head)) and match[1] in _ERROR_KINDS:
        ok, error, message = False, _ERROR_KINDS[match[1]], head[match.end() :]
    tabs = []
    rest = at + 1
    while rest < len(lines) and (tab := _TAB.match(lines[rest])):
        title = "" if tab[3] == "(no title)" else tab[3]
        tabs.append(TabInfo(int(tab[2]), tab[4], title, tab[1] == "*"))
        rest += 1
    page_text = None
    if _PAGE_TEXT in lines[rest:]:
        page_text = "\n".join(lines[lines.index(_PAGE_TEXT, rest) + 1 :])
    return Observation(
        tool=tool,
        ok=ok,
        message=message,
        screenshot=None,
        viewport=(int(viewport[1]), int(viewport[2])),
        tabs=tuple(tabs),
        error=error,
        events=tuple(notes),
        page_text=page_text,
    )
