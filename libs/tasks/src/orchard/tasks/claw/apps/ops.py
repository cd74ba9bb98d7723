"""Every operation of every Claw app, described once: the command-line tools build their
arguments from these descriptions and the MCP server its tool schemas, and both call
:func:`call`, so the two front ends cannot disagree.

An operation takes a dict of arguments and returns a JSON value. A call first uses up a seeded
fault if one is due (raising `Transient`, nothing changed), then runs; every call, failed or
not, is appended to the audit log with the front end it came through.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store import ClawError, Invalid, NotFound, Store, Transient, write_atomic

__all__ = ["APPS", "OPERATIONS", "Operation", "Param", "call", "operation"]

APPS = ("mail", "calendar", "contacts", "notes", "docs")


@dataclass(frozen=True)
class Param:
    name: str
    help: str
    type: str = "string"
    """string, integer, boolean or list (of strings)."""
    required: bool = False
    positional: bool = False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Operation:
    app: str
    name: str
    summary: str
    handler: Callable[[Store, dict[str, Any]], Any]
    params: tuple[Param, ...] = ()
    changes: bool = False
    """Whether it changes the state (read-only operations are safe to repeat)."""
    examples: tuple[str, ...] = field(default=())

    @property
    def tool_name(self) -> str:
        return f"{self.app}_{self.name.replace('-', '_')}"

    def input_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments (the MCP tool's ``inputSchema``)."""
        kinds: dict[str, dict[str, Any]] = {
            "string": {"type": "string"},
            "integer": {"type": "integer"},
            "boolean": {"type": "boolean"},
            "list": {"type": "array", "items": {"type": "string"}},
        }
        properties: dict[str, Any] = {}
        for param in self.params:
            schema: dict[str, Any] = {**kinds[param.type], "description": param.help}
            if param.choices:
                schema["enum"] = list(param.choices)
            properties[param.name] = schema
        required = [p.name for p in self.params if p.required]
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }


OPERATIONS: dict[tuple[str, str], Operation] = {}


Handler = Callable[[Store, dict[str, Any]], Any]


def operation(
    app: str, name: str, summary: str, *params: Param, changes: bool = False
) -> Callable[[Handler], Handler]:
    """Register the decorated function as operation ``name`` of ``app``."""

    def register(handler: Handler) -> Handler:
        OPERATIONS[(app, name)] = Operation(app, name, summary, handler, params, changes)
        return handler

    return register


def _checked(op: Operation, args: Mapping[str, Any]) -> dict[str, Any]:
    known = {p.name: p for p in op.params}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise Invalid(f"{op.app} {op.name}: unknown argument(s) {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for param in op.params:
        value = args.get(param.name)
        if value is None or value in ([], ""):
            if param.required:
                raise Invalid(f"{op.app} {op.name}: {param.name} is required ({param.help})")
            out[param.name] = [] if param.type == "list" else None
            continue
        if param.type == "list":
            items = [value] if isinstance(value, str) else list(value)
            value = [s.strip() for item in items for s in str(item).split(",") if s.strip()]
        elif param.type == "integer":
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise Invalid(f"{op.app} {op.name}: {param.name} must be a whole number") from None
        elif param.type == "boolean":
            value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        else:
            value = str(value)
        if param.choices and value not in param.choices:
            raise Invalid(
                f"{op.app} {op.name}: {param.name} must be one of {', '.join(param.choices)}"
            )
        out[param.name] = value
    return out


def call(app: str, name: str, args: Mapping[str, Any], *, via: str, home: str | None = None) -> Any:
    """Run one operation against the state folder; raises a `ClawError` subclass."""
    op = OPERATIONS.get((app, name))
    if op is None:
        raise Invalid(f"{app} has no operation {name!r}")
    with Store.open(home) as store:
        entry: dict[str, Any] = {"via": via, "app": app, "op": name, "args": dict(args)}
        fault = store.take_fault(app, name)
        if fault is not None:
            store.flush()  # the fault is used up even though the call fails
            store.audit({**entry, "ok": False, "error": Transient.kind, "message": fault})
            raise Transient(f"{app} {name}: {fault} (transient: nothing changed; try again)")
        try:
            result = op.handler(store, _checked(op, args))
        except ClawError as exc:
            store.discard()
            store.audit({**entry, "ok": False, "error": exc.kind, "message": str(exc)})
            raise
        store.audit({**entry, "ok": True, "result": _summary(result)})
        return result


def _summary(result: Any) -> Any:
    """What the audit log keeps of a result: its id, or the ids it lists."""
    if isinstance(result, dict):
        return {k: result[k] for k in ("id", "path", "status", "folder") if k in result}
    if isinstance(result, list):
        return [r.get("id") or r.get("path") for r in result if isinstance(r, dict)][:50]
    return None


# -- mail -------------------------------------------------------------------------------------


def _messages(store: Store) -> list[dict[str, Any]]:
    data = store.load("mail")
    messages: list[dict[str, Any]] = data.setdefault("messages", [])
    return messages


def _message(store: Store, message_id: str) -> dict[str, Any]:
    for message in _messages(store):
        if message["id"] == message_id:
            return message
    raise NotFound(f"no message {message_id!r} (mail list or mail search shows the ids)")


def _brief(message: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("id", "folder", "from", "to", "subject", "date", "read")
    return {k: message.get(k) for k in keys}


def _new_message(store: Store, folder: str, **fields: Any) -> dict[str, Any]:
    owner = store.config["owner"]["email"]
    message = {
        "id": store.next_id("mail", "m"),
        "folder": folder,
        "from": owner,
        "to": [],
        "cc": [],
        "subject": "",
        "body": "",
        "date": store.now().isoformat(timespec="minutes"),
        "read": True,
        "in_reply_to": None,
        "forward_of": None,
        **fields,
    }
    _messages(store).append(message)
    store.mark("mail")
    return message


_ADDRESS = re.compile(r"^[^@\s,]+@[^@\s,]+\.[A-Za-z]{2,}$")


def _addresses(values: list[str], what: str) -> list[str]:
    for value in values:
        if not _ADDRESS.match(value):
            raise Invalid(f"{what}: {value!r} is not an email address")
    return values


FOLDERS = ("inbox", "sent", "drafts", "archive", "trash")


@operation(
    "mail",
    "list",
    "List messages in a folder, newest first.",
    Param("folder", "inbox, sent, drafts, archive or trash", choices=FOLDERS),
    Param("unread", "only unread messages", "boolean"),
    Param("limit", "at most this many", "integer"),
)
def _mail_list(store: Store, args: dict[str, Any]) -> Any:
    folder = args["folder"] or "inbox"
    found = [m for m in _messages(store) if m["folder"] == folder]
    if args["unread"]:
        found = [m for m in found if not m.get("read")]
    found.sort(key=lambda m: m["date"], reverse=True)
    return [_brief(m) for m in found[: args["limit"] or None]]


@operation(
    "mail",
    "read",
    "Show one message in full (and mark it read).",
    Param("id", "the message id, e.g. m3", required=True, positional=True),
    changes=True,
)
def _mail_read(store: Store, args: dict[str, Any]) -> Any:
    message = _message(store, args["id"])
    if not message.get("read"):
        message["read"] = True
        store.mark("mail")
    return message


@operation(
    "mail",
    "search",
    "Find messages whose sender, recipients, subject or body match.",
    Param("query", "words to look for (case-insensitive)", positional=True),
    Param("from", "only messages from this address (or part of it)"),
    Param("folder", "only this folder", choices=FOLDERS),
)
def _mail_search(store: Store, args: dict[str, Any]) -> Any:
    words = (args["query"] or "").lower().split()
    found = []
    for message in _messages(store):
        if args["folder"] and message["folder"] != args["folder"]:
            continue
        if args["from"] and args["from"].lower() not in message["from"].lower():
            continue
        text = " ".join(
            [
                message["from"],
                *message["to"],
                *message.get("cc", []),
                message["subject"],
                message["body"],
            ]
        ).lower()
        if all(word in text for word in words):
            found.append(message)
    found.sort(key=lambda m: m["date"], reverse=True)
    return [_brief(m) for m in found]


@operation(
    "mail",
    "send",
    "Send a new message.",
    Param("to", "recipient addresses", "list", required=True),
    Param("subject", "the subject line", required=True),
    Param("body", "the message text", required=True),
    Param("cc", "copy to these addresses", "list"),
    changes=True,
)
def _mail_send(store: Store, args: dict[str, Any]) -> Any:
    return _new_message(
        store,
        "sent",
        to=_addresses(args["to"], "to"),
        cc=_addresses(args["cc"], "cc"),
        subject=args["subject"],
        body=args["body"],
    )


@operation(
    "mail",
    "reply",
    "Reply to a message (to its sender; --all: to everyone on it).",
    Param("id", "the message replied to", required=True, positional=True),
    Param("body", "the reply text", required=True),
    Param("all", "reply to all recipients too", "boolean"),
    changes=True,
)
def _mail_reply(store: Store, args: dict[str, Any]) -> Any:
    original = _message(store, args["id"])
    owner = store.config["owner"]["email"]
    to = [original["from"]] if original["from"] != owner else list(original["to"])
    cc: list[str] = []
    if args["all"]:
        cc = [a for a in [*original["to"], *original.get("cc", [])] if a not in (owner, *to)]
    subject = original["subject"]
    if not subject.lower().startswith("re:"):
        subject = f"Re: {subject}"
    quoted = "\n".join(f"> {line}" for line in original["body"].splitlines())
    return _new_message(
        store,
        "sent",
        to=to,
        cc=cc,
        subject=subject,
        in_reply_to=original["id"],
        body=f"{args['body']}\n\nOn {original['date']}, {original['from']} wrote:\n{quoted}",
    )


@operation(
    "mail",
    "forward",
    "Forward a message, with a note on top.",
    Param("id", "the message forwarded", required=True, positional=True),
    Param("to", "recipient addresses", "list", required=True),
    Param("body", "a note above the forwarded message"),
    changes=True,
)
def _mail_forward(store: Store, args: dict[str, Any]) -> Any:
    original = _message(store, args["id"])
    subject = original["subject"]
    if not subject.lower().startswith("fwd:"):
        subject = f"Fwd: {subject}"
    body = (
        f"{args['body'] or ''}\n\n---------- Forwarded message ----------\n"
        f"From: {original['from']}\nDate: {original['date']}\nSubject: {original['subject']}\n\n"
        f"{original['body']}"
    )
    return _new_message(
        store,
        "sent",
        to=_addresses(args["to"], "to"),
        subject=subject,
        body=body.lstrip(),
        forward_of=original["id"],
    )


@operation(
    "mail",
    "draft",
    "Save a message as a draft, unsent.",
    Param("to", "recipient addresses", "list"),
    Param("subject", "the subject line"),
    Param("body", "the message text"),
    changes=True,
)
def _mail_draft(store: Store, args: dict[str, Any]) -> Any:
    return _new_message(
        store,
        "drafts",
        to=_addresses(args["to"], "to"),
        subject=args["subject"] or "",
        body=args["body"] or "",
    )


@operation(
    "mail",
    "delete",
    "Move a message to the trash.",
    Param("id", "the message id", required=True, positional=True),
    changes=True,
)
def _mail_delete(store: Store, args: dict[str, Any]) -> Any:
    message = _message(store, args["id"])
    message["folder"] = "trash"
    store.mark("mail")
    return _brief(message)


@operation(
    "mail",
    "move",
    "Move a message to another folder.",
    Param("id", "the message id", required=True, positional=True),
    Param("folder", "inbox, archive or trash", required=True, choices=FOLDERS),
    changes=True,
)
def _mail_move(store: Store, args: dict[str, Any]) -> Any:
    message = _message(store, args["id"])
    message["folder"] = args["folder"]
    store.mark("mail")
    return _brief(message)


# -- calendar ---------------------------------------------------------------------------------


def _events(store: Store) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = store.load("calendar").setdefault("events", [])
    return events


def _event(store: Store, event_id: str) -> dict[str, Any]:
    for event in _events(store):
        if event["id"] == event_id:
            return event
    raise NotFound(f"no event {event_id!r} (calendar list shows the ids)")


def _when(value: str, what: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(value.replace(" ", "T"))
    except ValueError:
        raise Invalid(f"{what} {value!r} is not a date and time like 2026-03-19T14:30") from None


def _day(value: str, what: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise Invalid(f"{what} {value!r} is not a date like 2026-03-19") from None


def _clock(value: str, what: str) -> dt.time:
    try:
        return dt.time.fromisoformat(value)
    except ValueError:
        raise Invalid(f"{what} {value!r} is not a time like 09:00") from None


def _stamp(moment: dt.datetime) -> str:
    return moment.isoformat(timespec="minutes")


def _end(start: dt.datetime, args: dict[str, Any], current: str | None = None) -> dt.datetime:
    if args.get("end"):
        end = _when(args["end"], "end")
    elif args.get("duration"):
        end = start + dt.timedelta(minutes=int(args["duration"]))
    elif current is not None:
        return _when(current, "end")
    else:
        raise Invalid("give the event's end (--end) or its length in minutes (--duration)")
    if end <= start:
        raise Invalid("the event must end after it starts")
    return end


@operation(
    "calendar",
    "list",
    "List events, earliest first (cancelled ones only with --all).",
    Param("from", "first day, e.g. 2026-03-16"),
    Param("to", "last day"),
    Param("all", "include cancelled events", "boolean"),
)
def _calendar_list(store: Store, args: dict[str, Any]) -> Any:
    first = _day(args["from"], "from") if args["from"] else None
    last = _day(args["to"], "to") if args["to"] else None
    found = []
    for event in _events(store):
        day = _when(event["start"], "start").date()
        if (first and day < first) or (last and day > last):
            continue
        if event["status"] == "cancelled" and not args["all"]:
            continue
        found.append(event)
    return sorted(found, key=lambda e: e["start"])


@operation(
    "calendar",
    "show",
    "Show one event.",
    Param("id", "the event id, e.g. e2", required=True, positional=True),
)
def _calendar_show(store: Store, args: dict[str, Any]) -> Any:
    return _event(store, args["id"])


@operation(
    "calendar",
    "create",
    "Create an event and invite people to it.",
    Param("title", "what the event is", required=True),
    Param("start", "start, e.g. 2026-03-19T14:00", required=True),
    Param("end", "end, e.g. 2026-03-19T14:30 (or give duration)"),
    Param("duration", "length in minutes (instead of end)", "integer"),
    Param("invite", "invitee email addresses", "list"),
    Param("location", "where"),
    changes=True,
)
def _calendar_create(store: Store, args: dict[str, Any]) -> Any:
    start = _when(args["start"], "start")
    end = _end(start, args)
    event = {
        "id": store.next_id("calendar", "e"),
        "title": args["title"],
        "start": _stamp(start),
        "end": _stamp(end),
        "location": args["location"] or "",
        "invitees": _addresses(args["invite"], "invite"),
        "status": "confirmed",
    }
    _events(store).append(event)
    store.mark("calendar")
    return event


@operation(
    "calendar",
    "update",
    "Change an event: its title, time, place or invitees.",
    Param("id", "the event id", required=True, positional=True),
    Param("title", "new title"),
    Param("start", "new start (the length is kept unless end or duration is given)"),
    Param("end", "new end"),
    Param("duration", "new length in minutes", "integer"),
    Param("invite", "invitees to add", "list"),
    Param("uninvite", "invitees to remove", "list"),
    Param("location", "new place"),
    changes=True,
)
def _calendar_update(store: Store, args: dict[str, Any]) -> Any:
    event = _event(store, args["id"])
    if event["status"] == "cancelled":
        raise Invalid(f"event {event['id']} is cancelled")
    old_start, old_end = _when(event["start"], "start"), _when(event["end"], "end")
    start = _when(args["start"], "start") if args["start"] else old_start
    keeps_length = not (args["end"] or args["duration"])
    end = start + (old_end - old_start) if keeps_length else _end(start, args)
    event.update(start=_stamp(start), end=_stamp(end))
    if args["title"]:
        event["title"] = args["title"]
    if args["location"] is not None:
        event["location"] = args["location"]
    invitees = [a for a in event["invitees"] if a not in args["uninvite"]]
    invitees += [a for a in _addresses(args["invite"], "invite") if a not in invitees]
    event["invitees"] = invitees
    store.mark("calendar")
    return event


@operation(
    "calendar",
    "cancel",
    "Cancel an event.",
    Param("id", "the event id", required=True, positional=True),
    changes=True,
)
def _calendar_cancel(store: Store, args: dict[str, Any]) -> Any:
    event = _event(store, args["id"])
    event["status"] = "cancelled"
    store.mark("calendar")
    return event


def free_slots(
    events: list[dict[str, Any]], day: dt.date, minutes: int, first: dt.time, last: dt.time
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The free gaps of at least ``minutes`` on ``day`` between ``first`` and ``last``."""
    window_start, window_end = dt.datetime.combine(day, first), dt.datetime.combine(day, last)
    busy = sorted(
        (_when(e["start"], "start"), _when(e["end"], "end"))
        for e in events
        if e["status"] != "cancelled"
    )
    gaps, cursor = [], window_start
    for start, end in busy:
        if end <= cursor or start >= window_end:
            continue
        if start > cursor:
            gaps.append((cursor, min(start, window_end)))
        cursor = max(cursor, end)
    if cursor < window_end:
        gaps.append((cursor, window_end))
    return [(a, b) for a, b in gaps if b - a >= dt.timedelta(minutes=minutes)]


@operation(
    "calendar",
    "free",
    "Find free time on a day: gaps of at least the given length.",
    Param("date", "the day, e.g. 2026-03-19", required=True),
    Param("duration", "minutes needed", "integer", required=True),
    Param("from", "earliest time, default the working day's start (09:00)"),
    Param("to", "latest end, default the working day's end (17:00)"),
)
def _calendar_free(store: Store, args: dict[str, Any]) -> Any:
    workday = store.config.get("workday", ["09:00", "17:00"])
    first = _clock(args["from"] or workday[0], "from")
    last = _clock(args["to"] or workday[1], "to")
    gaps = free_slots(_events(store), _day(args["date"], "date"), args["duration"], first, last)
    return [{"start": _stamp(a), "end": _stamp(b)} for a, b in gaps]


# -- contacts ---------------------------------------------------------------------------------

CONTACT_FIELDS = ("name", "email", "phone", "company", "title")


def _contacts(store: Store) -> list[dict[str, Any]]:
    contacts: list[dict[str, Any]] = store.load("contacts").setdefault("contacts", [])
    return contacts


@operation(
    "contacts",
    "search",
    "Find contacts by name, email, company or title.",
    Param("query", "words to look for (empty: everyone)", positional=True),
)
def _contacts_search(store: Store, args: dict[str, Any]) -> Any:
    words = (args["query"] or "").lower().split()
    return [
        c
        for c in _contacts(store)
        if all(w in " ".join(str(c.get(k, "")) for k in CONTACT_FIELDS).lower() for w in words)
    ]


@operation(
    "contacts",
    "show",
    "Show one contact.",
    Param("id", "the contact id, e.g. c4", required=True, positional=True),
)
def _contacts_show(store: Store, args: dict[str, Any]) -> Any:
    for contact in _contacts(store):
        if contact["id"] == args["id"]:
            return contact
    raise NotFound(f"no contact {args['id']!r} (contacts search shows the ids)")


@operation(
    "contacts",
    "add",
    "Add a contact.",
    Param("name", "full name", required=True),
    Param("email", "email address", required=True),
    Param("phone", "phone number"),
    Param("company", "company"),
    Param("title", "job title"),
    changes=True,
)
def _contacts_add(store: Store, args: dict[str, Any]) -> Any:
    _addresses([args["email"]], "email")
    contact = {"id": store.next_id("contacts", "c")}
    contact.update({k: args[k] or "" for k in CONTACT_FIELDS})
    _contacts(store).append(contact)
    store.mark("contacts")
    return contact


@operation(
    "contacts",
    "update",
    "Change fields of a contact.",
    Param("id", "the contact id", required=True, positional=True),
    Param("name", "new name"),
    Param("email", "new email address"),
    Param("phone", "new phone number"),
    Param("company", "new company"),
    Param("title", "new job title"),
    changes=True,
)
def _contacts_update(store: Store, args: dict[str, Any]) -> Any:
    contact = _contacts_show(store, {"id": args["id"]})
    if args["email"]:
        _addresses([args["email"]], "email")
    changed = {k: args[k] for k in CONTACT_FIELDS if args[k] is not None}
    if not changed:
        raise Invalid("contacts update: give at least one field to change")
    contact.update(changed)
    store.mark("contacts")
    return contact


# -- notes ------------------------------------------------------------------------------------


def _note_paths(store: Store) -> list[str]:
    base = store.folder("notes")
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


@operation("notes", "list", "List the notes.")
def _notes_list(store: Store, args: dict[str, Any]) -> Any:
    base = store.folder("notes")
    out = []
    for path in _note_paths(store):
        text = (base / path).read_text(encoding="utf-8")
        first = text.strip().splitlines()[0] if text.strip() else ""
        out.append({"path": path, "title": first.lstrip("# ").strip(), "bytes": len(text)})
    return out


@operation(
    "notes",
    "read",
    "Show a note.",
    Param("path", "the note's path, e.g. standup.md", required=True, positional=True),
)
def _notes_read(store: Store, args: dict[str, Any]) -> Any:
    path = store.file_in("notes", args["path"])
    if not path.is_file():
        raise NotFound(f"no note {args['path']!r} (notes list shows them)")
    return {"path": args["path"], "text": path.read_text(encoding="utf-8")}


@operation(
    "notes",
    "write",
    "Write a note (replacing it, or --append to add to its end).",
    Param("path", "the note's path, e.g. ideas.md", required=True, positional=True),
    Param("text", "the text", required=True),
    Param("append", "add to the end instead of replacing", "boolean"),
    changes=True,
)
def _notes_write(store: Store, args: dict[str, Any]) -> Any:
    path = store.file_in("notes", args["path"])
    text = args["text"] if args["text"].endswith("\n") else args["text"] + "\n"
    if args["append"] and path.is_file():
        text = path.read_text(encoding="utf-8") + text
    write_atomic(path, text)
    return {"path": args["path"], "bytes": len(text)}


@operation(
    "notes",
    "search",
    "Find notes containing all the words.",
    Param("query", "words to look for", required=True, positional=True),
)
def _notes_search(store: Store, args: dict[str, Any]) -> Any:
    words = args["query"].lower().split()
    base = store.folder("notes")
    out = []
    for path in _note_paths(store):
        text = (base / path).read_text(encoding="utf-8")
        if all(word in text.lower() for word in words):
            lines = [line for line in text.splitlines() if any(w in line.lower() for w in words)]
            out.append({"path": path, "lines": lines[:10]})
    return out


@operation(
    "notes",
    "delete",
    "Delete a note.",
    Param("path", "the note's path", required=True, positional=True),
    changes=True,
)
def _notes_delete(store: Store, args: dict[str, Any]) -> Any:
    path = store.file_in("notes", args["path"])
    if not path.is_file():
        raise NotFound(f"no note {args['path']!r}")
    path.unlink()
    return {"path": args["path"], "status": "deleted"}


# -- documents --------------------------------------------------------------------------------


def _doc(store: Store, relative: str, *, must_exist: bool = True) -> Path:
    path = store.file_in("docs", relative)
    if path.suffix not in (".csv", ".md"):
        raise Invalid(f"{relative!r}: documents are .csv spreadsheets or .md documents")
    if must_exist and not path.is_file():
        raise NotFound(f"no document {relative!r} (docs list shows them)")
    return path


def read_sheet(path: Path) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
    return (rows[0], rows[1:]) if rows else ([], [])


def _write_sheet(path: Path, header: list[str], rows: list[list[str]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_atomic(path, buffer.getvalue())


def sections(text: str) -> list[tuple[str, str]]:
    """A document's ``## `` sections as (heading, body); text before the first is ("", ...)."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line[3:].strip(), []))
        else:
            out[-1][1].append(line)
    return [(h, "\n".join(b).strip("\n")) for h, b in out if h or "\n".join(b).strip()]


def _join_sections(parts: list[tuple[str, str]]) -> str:
    chunks = []
    for heading, body in parts:
        chunks.append((f"## {heading}\n" if heading else "") + (body + "\n" if body else ""))
    return "\n".join(chunks)


@operation("docs", "list", "List the documents and spreadsheets.")
def _docs_list(store: Store, args: dict[str, Any]) -> Any:
    base = store.folder("docs")
    out: list[dict[str, Any]] = []
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        name = str(path.relative_to(base))
        if path.suffix == ".csv":
            header, rows = read_sheet(path)
            out.append({"path": name, "kind": "sheet", "columns": header, "rows": len(rows)})
        else:
            heads = [h for h, _ in sections(path.read_text(encoding="utf-8")) if h]
            out.append({"path": name, "kind": "document", "sections": heads})
    return out


@operation(
    "docs",
    "read",
    "Show a spreadsheet's rows or a document (or one --section of it).",
    Param("path", "e.g. budget.csv or plan.md", required=True, positional=True),
    Param("section", "only this section of a document"),
)
def _docs_read(store: Store, args: dict[str, Any]) -> Any:
    path = _doc(store, args["path"])
    if path.suffix == ".csv":
        header, rows = read_sheet(path)
        return {
            "path": args["path"],
            "columns": header,
            "rows": [dict(zip(header, r, strict=False)) for r in rows],
        }
    parts = sections(path.read_text(encoding="utf-8"))
    if args["section"]:
        for heading, body in parts:
            if heading.lower() == args["section"].lower():
                return {"path": args["path"], "section": heading, "text": body}
        raise NotFound(f"{args['path']} has no section {args['section']!r}")
    return {"path": args["path"], "text": path.read_text(encoding="utf-8")}


def _row_index(header: list[str], rows: list[list[str]], key: str, relative: str) -> int:
    for index, row in enumerate(rows):
        if row and row[0].strip().lower() == key.strip().lower():
            return index
    raise NotFound(f"{relative}: no row whose {header[0]!r} is {key!r}")


def _column(header: list[str], name: str, relative: str) -> int:
    for index, column in enumerate(header):
        if column.strip().lower() == name.strip().lower():
            return index
    raise NotFound(f"{relative}: no column {name!r} (columns: {', '.join(header)})")


@operation(
    "docs",
    "get",
    "Read one cell of a spreadsheet: the row is named by its first column.",
    Param("path", "the spreadsheet, e.g. budget.csv", required=True, positional=True),
    Param("row", "the value in the row's first column", required=True),
    Param("column", "the column's name", required=True),
)
def _docs_get(store: Store, args: dict[str, Any]) -> Any:
    path = _doc(store, args["path"])
    header, rows = read_sheet(path)
    row = rows[_row_index(header, rows, args["row"], args["path"])]
    column = _column(header, args["column"], args["path"])
    return {"path": args["path"], "row": row[0], "column": header[column], "value": row[column]}


@operation(
    "docs",
    "set",
    "Change one cell of a spreadsheet: the row is named by its first column.",
    Param("path", "the spreadsheet", required=True, positional=True),
    Param("row", "the value in the row's first column", required=True),
    Param("column", "the column's name", required=True),
    Param("value", "the new value", required=True),
    changes=True,
)
def _docs_set(store: Store, args: dict[str, Any]) -> Any:
    path = _doc(store, args["path"])
    if path.suffix != ".csv":
        raise Invalid(f"{args['path']} is a document, not a spreadsheet")
    header, rows = read_sheet(path)
    index = _row_index(header, rows, args["row"], args["path"])
    column = _column(header, args["column"], args["path"])
    rows[index] += [""] * (len(header) - len(rows[index]))
    rows[index][column] = args["value"]
    _write_sheet(path, header, rows)
    return {
        "path": args["path"],
        "row": rows[index][0],
        "column": header[column],
        "value": args["value"],
    }


@operation(
    "docs",
    "add-row",
    "Add a row to a spreadsheet, as column=value pairs.",
    Param("path", "the spreadsheet", required=True, positional=True),
    Param("cell", "column=value pairs", "list", required=True),
    changes=True,
)
def _docs_add_row(store: Store, args: dict[str, Any]) -> Any:
    path = _doc(store, args["path"])
    header, rows = read_sheet(path)
    row = [""] * len(header)
    for pair in args["cell"]:
        name, sep, value = pair.partition("=")
        if not sep:
            raise Invalid(f"cell {pair!r} must be column=value")
        row[_column(header, name, args["path"])] = value
    rows.append(row)
    _write_sheet(path, header, rows)
    return {"path": args["path"], "row": dict(zip(header, row, strict=True))}


@operation(
    "docs",
    "write-section",
    "Replace (or --append to) a section of a document; a missing section or document is made.",
    Param("path", "the document, e.g. report.md", required=True, positional=True),
    Param("section", "the section's heading", required=True),
    Param("text", "the section's text", required=True),
    Param("append", "add to the section instead of replacing it", "boolean"),
    changes=True,
)
def _docs_write_section(store: Store, args: dict[str, Any]) -> Any:
    path = _doc(store, args["path"], must_exist=False)
    if path.suffix != ".md":
        raise Invalid(f"{args['path']} is a spreadsheet: use docs set")
    parts = sections(path.read_text(encoding="utf-8")) if path.is_file() else []
    text = args["text"].strip("\n")
    for index, (heading, body) in enumerate(parts):
        if heading.lower() == args["section"].lower():
            parts[index] = (heading, f"{body}\n{text}".strip("\n") if args["append"] else text)
            break
    else:
        parts.append((args["section"], text))
    write_atomic(path, _join_sections(parts))
    return {"path": args["path"], "section": args["section"]}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def tool_names() -> list[str]:
    return [op.tool_name for op in OPERATIONS.values()]
