"""Meeting rooms to book: rooms with their capacity and equipment, a month calendar per room
with month navigation, the free and taken slots of a day, a booking form, and the list of
bookings where one is cancelled or moved to another day and time.

World: ``{"today": "2027-03-10", "slots": ["09:00", ...], "open_weekdays": [0, ..., 4],
"months_ahead": 2, "rooms": [{id, name, capacity, features}], "bookings": [{ref, room, date,
slot, name, attendees, status}], "next_ref": 1001}`` (`make_booking_world` for a seed). The
calendar's "today" comes from the world, never from the clock, so a page looks the same on
every run. State: every booking (``status`` active or cancelled) and a log of what the visitor
did (``book``, ``cancel``, ``move``).
"""

from __future__ import annotations

import calendar
import datetime as dt
import random
from typing import Any
from urllib.parse import urlencode

from .base import Request, Response, Site, esc

__all__ = ["BookingSite", "long_date", "make_booking_world"]

_ROOM_NAMES = (
    "Cedar",
    "Maple",
    "Willow",
    "Birch",
    "Juniper",
    "Aspen",
    "Rowan",
    "Hazel",
    "Linden",
    "Spruce",
)
_FEATURES = ("Projector", "Whiteboard", "Video call screen", "Window view", "Standing desk")
_PEOPLE = (
    "Mira Okafor",
    "Jonas Berg",
    "Lena Park",
    "Tomas Reyes",
    "Aiko Sato",
    "Priya Nair",
    "Omar Haddad",
    "Sofia Lund",
    "Kwame Mensah",
    "Elena Rossi",
    "Yusuf Demir",
    "Hanna Virtanen",
)
_SLOTS = ("09:00", "10:00", "11:00", "12:00", "13:00", "14:00", "15:00", "16:00")


def long_date(day: dt.date) -> str:
    """How the site writes a date: ``Friday 12 March 2027``."""
    return (
        f"{calendar.day_name[day.weekday()]} {day.day} {calendar.month_name[day.month]} {day.year}"
    )


def _month_key(day: dt.date) -> str:
    return f"{day.year:04d}-{day.month:02d}"


def _add_months(day: dt.date, months: int) -> dt.date:
    index = day.year * 12 + day.month - 1 + months
    return dt.date(index // 12, index % 12 + 1, 1)


def make_booking_world(seed: int | str, rooms: int = 5, bookings: int = 10) -> dict[str, Any]:
    """Rooms, a fixed today and some bookings already made, for a seed."""
    rng = random.Random(f"booking/{seed}")
    today = dt.date(2027, rng.randint(1, 10), rng.randint(1, 20))
    names = rng.sample(_ROOM_NAMES, rooms)
    room_list: list[dict[str, Any]] = [
        {
            "id": name.lower(),
            "name": f"{name} Room",
            "capacity": rng.choice((4, 6, 8, 10, 12, 16)),
            "features": sorted(rng.sample(_FEATURES, rng.randint(1, 3))),
        }
        for name in names
    ]
    world: dict[str, Any] = {
        "today": today.isoformat(),
        "slots": list(_SLOTS),
        "open_weekdays": [0, 1, 2, 3, 4],
        "months_ahead": 2,
        "rooms": room_list,
        "bookings": [],
        "next_ref": 1001 + rng.randrange(0, 8000, 100),
    }
    taken: set[tuple[str, str, str]] = set()
    while len(world["bookings"]) < bookings:
        room = rng.choice(room_list)
        day = today + dt.timedelta(days=rng.randint(0, 40))
        slot = rng.choice(_SLOTS)
        if day.weekday() > 4 or (room["id"], day.isoformat(), slot) in taken:
            continue
        taken.add((room["id"], day.isoformat(), slot))
        world["bookings"].append(
            {
                "ref": f"BK-{world['next_ref']}",
                "room": room["id"],
                "date": day.isoformat(),
                "slot": slot,
                "name": rng.choice(_PEOPLE),
                "attendees": rng.randint(1, room["capacity"]),
                "status": "active",
            }
        )
        world["next_ref"] += 1
    world["bookings"].sort(key=lambda b: (b["date"], b["slot"], b["room"]))
    return world


class BookingSite(Site):
    name = "booking"
    title = "Harbor Rooms"
    description = "meeting rooms: a month calendar per room, slots, booking, cancel, reschedule"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return make_booking_world(seed)

    def load(self, world: dict[str, Any]) -> None:
        self.today = dt.date.fromisoformat(world["today"])
        self.slots = [str(s) for s in world["slots"]]
        self.open_weekdays = {int(d) for d in world["open_weekdays"]}
        self.months_ahead = int(world["months_ahead"])
        self.rooms = {str(r["id"]): dict(r) for r in world["rooms"]}
        if not self.rooms or not self.slots:
            raise ValueError("a booking world needs rooms and slots")
        for room in self.rooms.values():
            room["name"], room["capacity"] = str(room["name"]), int(room["capacity"])
            room["features"] = [str(f) for f in room.get("features", [])]
        self.bookings = [dict(b) for b in world["bookings"]]
        for booking in self.bookings:
            if booking["room"] not in self.rooms:
                raise ValueError(f"booking {booking['ref']}: no room {booking['room']!r}")
            dt.date.fromisoformat(booking["date"])
        self.next_ref = int(world["next_ref"])
        self.log: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {
            "today": self.today.isoformat(),
            "bookings": [dict(b) for b in self.bookings],
            "log": [dict(e) for e in self.log],
        }

    def nav(self) -> list[tuple[str, str]]:
        return [(self.href("/"), "Rooms"), (self.href("/bookings"), "All bookings")]

    # -- routes ------------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        parts = [p for p in path.split("/") if p]
        if not parts and method == "GET":
            return self._rooms()
        if parts[:1] == ["room"] and len(parts) == 2 and method == "GET":
            return self._calendar(parts[1], request)
        if parts[:1] == ["room"] and len(parts) == 4 and parts[2] == "day" and method == "GET":
            return self._day(parts[1], parts[3], request.field("move"))
        if parts == ["book"]:
            return self._book(request)
        if parts == ["bookings"] and method == "GET":
            return self._list(request)
        if parts[:1] == ["reservation"] and len(parts) >= 2:
            booking = self._booking(parts[1])
            if booking is None:
                return self.not_found(f"no booking {parts[1]}")
            action = parts[2] if len(parts) > 2 else ""
            if action == "" and method == "GET":
                return self._details(booking, request.field("notice"))
            if action == "cancel":
                return self._cancel(booking, method)
            if action == "reschedule" and method == "GET":
                query = {"move": booking["ref"], "month": booking["date"][:7]}
                return Response.redirect(self.href(f"/room/{booking['room']}"), query)
            if action == "move":
                return self._move(booking, request)
        return self.not_found(f"no page {path}")

    # -- helpers -----------------------------------------------------------------------------

    def _booking(self, ref: str) -> dict[str, Any] | None:
        return next((b for b in self.bookings if b["ref"] == ref), None)

    def _taken(self, room: str, day: str, slot: str, ignore: str = "") -> bool:
        return any(
            b["room"] == room
            and b["date"] == day
            and b["slot"] == slot
            and b["status"] == "active"
            and b["ref"] != ignore
            for b in self.bookings
        )

    def _last_day(self) -> dt.date:
        return _add_months(self.today, self.months_ahead + 1) - dt.timedelta(days=1)

    def _bookable(self, day: dt.date) -> bool:
        return self.today <= day <= self._last_day() and day.weekday() in self.open_weekdays

    def _parse_day(self, text: str) -> dt.date | None:
        try:
            return dt.date.fromisoformat(text)
        except ValueError:
            return None

    def _when(self, booking: dict[str, Any]) -> str:
        day = dt.date.fromisoformat(booking["date"])
        return f"{long_date(day)} at {booking['slot']}"

    # -- pages -------------------------------------------------------------------------------

    def _rooms(self) -> Response:
        rows = "".join(
            f"<tr><td><b>{esc(r['name'])}</b></td><td>{r['capacity']} people</td>"
            f"<td>{esc(', '.join(r['features']) or '-')}</td>"
            f'<td><a class="button" href="{self.href("/room/" + rid)}">Book {esc(r["name"])}'
            "</a></td></tr>"
            for rid, r in self.rooms.items()
        )
        body = (
            f"<h1>Meeting rooms</h1><p>Today is {esc(long_date(self.today))}. Rooms can be "
            f"booked up to {self.months_ahead} months ahead, on weekdays.</p>"
            "<table><tr><th>Room</th><th>Seats</th><th>Equipment</th><th></th></tr>"
            f"{rows}</table>"
        )
        return self.page("Rooms", body)

    def _calendar(self, room_id: str, request: Request) -> Response:
        room = self.rooms.get(room_id)
        if room is None:
            return self.not_found(f"no room {room_id}")
        first = dt.date(self.today.year, self.today.month, 1)
        shown = first
        if month_text := request.field("month"):
            try:
                year, month = (int(x) for x in month_text.split("-"))
                shown = dt.date(year, month, 1)
            except ValueError:
                pass  # a month the calendar cannot show: the first one instead
        last = _add_months(first, self.months_ahead)
        shown = min(max(shown, first), last)
        move = request.field("move")
        extra = {"move": move} if move else {}
        links = []
        if shown > first:
            query = urlencode({"month": _month_key(_add_months(shown, -1)), **extra})
            links.append(
                f'<a href="{self.href("/room/" + room_id)}?{esc(query)}" '
                'aria-label="Previous month">&lsaquo; Previous month</a>'
            )
        if shown < last:
            query = urlencode({"month": _month_key(_add_months(shown, 1)), **extra})
            links.append(
                f'<a href="{self.href("/room/" + room_id)}?{esc(query)}" '
                'aria-label="Next month">Next month &rsaquo;</a>'
            )
        weeks = calendar.Calendar(firstweekday=0).monthdatescalendar(shown.year, shown.month)
        cells = []
        for week in weeks:
            row = []
            for day in week:
                if day.month != shown.month:
                    row.append("<td class='out'></td>")
                elif self._bookable(day):
                    href = self.href(f"/room/{room_id}/day/{day.isoformat()}")
                    if move:
                        href += "?" + urlencode({"move": move})
                    row.append(
                        f'<td><a class="day" href="{esc(href)}" aria-label="{long_date(day)}">'
                        f"{day.day}</a></td>"
                    )
                else:
                    row.append(f"<td class='closed'>{day.day}</td>")
            cells.append("<tr>" + "".join(row) + "</tr>")
        head = "".join(f"<th>{d}</th>" for d in ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"))
        heading = f"Move {esc(move)}: pick a new day" if move else f"Book the {esc(room['name'])}"
        body = (
            f"<h1>{heading}</h1><p>{esc(room['name'])}: {room['capacity']} seats. "
            "Days you can book are links.</p>"
            f"<h2>{calendar.month_name[shown.month]} {shown.year}</h2>"
            f"<p class='monthnav'>{' | '.join(links)}</p>"
            f"<table class='calendar'><tr>{head}</tr>{''.join(cells)}</table>"
        )
        return self.page(f"{room['name']} - {calendar.month_name[shown.month]}", body)

    def _day(self, room_id: str, day_text: str, move: str) -> Response:
        room = self.rooms.get(room_id)
        day = self._parse_day(day_text)
        if room is None or day is None:
            return self.not_found("no such room or day")
        back_query = {"month": _month_key(day), **({"move": move} if move else {})}
        back = (
            f'<a href="{self.href("/room/" + room_id)}?{esc(urlencode(back_query))}">'
            "Back to the calendar</a>"
        )
        if not self._bookable(day):
            body = f"<h1>{esc(long_date(day))}</h1><p>This day cannot be booked.</p>{back}"
            return self.page("Closed", body)
        rows = []
        for slot in self.slots:
            if self._taken(room_id, day.isoformat(), slot, ignore=move):
                rows.append(f"<tr><td>{slot}</td><td>Taken</td><td></td></tr>")
                continue
            if move:
                query = urlencode({"date": day.isoformat(), "slot": slot})
                href = self.href(f"/reservation/{move}/move") + "?" + query
                label, text = f"Move to {slot}", "Move here"
            else:
                query = urlencode({"room": room_id, "date": day.isoformat(), "slot": slot})
                href = self.href("/book") + "?" + query
                label, text = f"Book {slot}", "Book"
            rows.append(
                f"<tr><td>{slot}</td><td>Free</td><td><a class='button' href=\"{esc(href)}\" "
                f'aria-label="{label}">{text}</a></td></tr>'
            )
        body = (
            f"<h1>{esc(room['name'])}, {esc(long_date(day))}</h1><p>{back}</p>"
            f"<table class='slots'><tr><th>Time</th><th>Status</th><th></th></tr>"
            f"{''.join(rows)}</table>"
        )
        return self.page(f"{room['name']} - {day.isoformat()}", body)

    def _book(self, request: Request) -> Response:
        room_id, slot = request.field("room"), request.field("slot")
        room = self.rooms.get(room_id)
        day = self._parse_day(request.field("date"))
        if room is None or day is None or slot not in self.slots:
            return self.not_found("choose a room, a day and a time from the calendar")
        values = {"name": request.field("name"), "attendees": request.field("attendees", "1")}
        errors: list[str] = []
        if request.method == "POST":
            if not values["name"]:
                errors.append("Your name is required")
            try:
                attendees = int(values["attendees"])
            except ValueError:
                attendees = 0
            if not 1 <= attendees <= room["capacity"]:
                errors.append(f"Attendees must be between 1 and {room['capacity']}")
            if not self._bookable(day):
                errors.append("This day cannot be booked")
            if self._taken(room_id, day.isoformat(), slot):
                errors.append("This time is already taken")
            if not errors:
                ref = f"BK-{self.next_ref}"
                self.next_ref += 1
                self.bookings.append(
                    {
                        "ref": ref,
                        "room": room_id,
                        "date": day.isoformat(),
                        "slot": slot,
                        "name": values["name"],
                        "attendees": attendees,
                        "status": "active",
                    }
                )
                self.log.append({"action": "book", "ref": ref})
                return Response.redirect(
                    self.href(f"/reservation/{ref}"), {"notice": "Booking confirmed"}
                )
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        hidden = "".join(
            f'<input type="hidden" name="{k}" value="{esc(v)}">'
            for k, v in (("room", room_id), ("date", day.isoformat()), ("slot", slot))
        )
        body = (
            f"<h1>Confirm your booking</h1>{error_html}<p>{esc(room['name'])}, "
            f"{esc(long_date(day))} at {slot}</p>"
            f'<form method="post" action="{self.href("/book")}">{hidden}'
            '<label for="name">Your name</label>'
            f'<input id="name" name="name" size="30" value="{esc(values["name"])}">'
            '<label for="attendees">Attendees</label><input id="attendees" name="attendees" '
            f'type="number" min="1" max="{room["capacity"]}" value="{esc(values["attendees"])}">'
            '<p><button type="submit" id="confirm">Confirm booking</button></p></form>'
        )
        return self.page("Confirm booking", body, 400 if errors else 200)

    def _list(self, request: Request) -> Response:
        active = sorted(
            (b for b in self.bookings if b["status"] == "active"),
            key=lambda b: (b["date"], b["slot"], b["room"]),
        )
        rows = []
        for b in active:
            ref = b["ref"]
            rows.append(
                f"<tr><td>{ref}</td><td>{esc(self.rooms[b['room']]['name'])}</td>"
                f"<td>{esc(long_date(dt.date.fromisoformat(b['date'])))}</td><td>{b['slot']}</td>"
                f"<td>{esc(b['name'])}</td><td>"
                f'<a href="{self.href(f"/reservation/{ref}/reschedule")}" '
                f'aria-label="Reschedule {ref}">Reschedule</a> '
                f'<a href="{self.href(f"/reservation/{ref}/cancel")}" '
                f'aria-label="Cancel {ref}">Cancel</a></td></tr>'
            )
        notice = request.field("notice")
        notice_html = f'<p class="notice">{esc(notice)}</p>' if notice else ""
        body = (
            f"<h1>All bookings</h1>{notice_html}<table><tr><th>Reference</th><th>Room</th>"
            f"<th>Day</th><th>Time</th><th>Booked by</th><th></th></tr>{''.join(rows)}</table>"
            if active
            else f"<h1>All bookings</h1>{notice_html}<p>There are no bookings.</p>"
        )
        return self.page("All bookings", body)

    def _details(self, booking: dict[str, Any], notice: str) -> Response:
        room = self.rooms[booking["room"]]
        notice_html = f'<p class="notice">{esc(notice)}</p>' if notice else ""
        ref = booking["ref"]
        actions = (
            f'<p><a class="button" href="{self.href(f"/reservation/{ref}/reschedule")}">'
            f'Reschedule</a> <a class="button" href="{self.href(f"/reservation/{ref}/cancel")}">'
            "Cancel booking</a></p>"
            if booking["status"] == "active"
            else "<p>This booking is cancelled.</p>"
        )
        body = (
            f"<h1>Booking {ref}</h1>{notice_html}<table>"
            f"<tr><th>Room</th><td>{esc(room['name'])}</td></tr>"
            f"<tr><th>When</th><td>{esc(self._when(booking))}</td></tr>"
            f"<tr><th>Booked by</th><td>{esc(booking['name'])}</td></tr>"
            f"<tr><th>Attendees</th><td>{booking['attendees']}</td></tr></table>{actions}"
        )
        return self.page(f"Booking {ref}", body)

    def _cancel(self, booking: dict[str, Any], method: str) -> Response:
        ref = booking["ref"]
        if method == "POST":
            if booking["status"] == "active":
                booking["status"] = "cancelled"
                self.log.append({"action": "cancel", "ref": ref})
            return Response.redirect(self.href("/bookings"), {"notice": f"{ref} is cancelled"})
        room = self.rooms[booking["room"]]
        body = (
            f"<h1>Cancel booking {ref}?</h1><p>{esc(room['name'])}, {esc(self._when(booking))},"
            f" booked by {esc(booking['name'])}.</p>"
            f'<form method="post" action="{self.href(f"/reservation/{ref}/cancel")}">'
            '<button type="submit" id="yes">Yes, cancel booking</button> '
            f'<a class="button" href="{self.href("/bookings")}">Keep booking</a></form>'
        )
        return self.page(f"Cancel {ref}", body)

    def _move(self, booking: dict[str, Any], request: Request) -> Response:
        ref = booking["ref"]
        day = self._parse_day(request.field("date"))
        slot = request.field("slot")
        if day is None or slot not in self.slots:
            return self.not_found("choose a new day and time from the calendar")
        errors: list[str] = []
        if request.method == "POST":
            if booking["status"] != "active":
                errors.append("This booking is cancelled")
            if not self._bookable(day):
                errors.append("This day cannot be booked")
            if self._taken(booking["room"], day.isoformat(), slot, ignore=ref):
                errors.append("This time is already taken")
            if not errors:
                before = {"date": booking["date"], "slot": booking["slot"]}
                booking["date"], booking["slot"] = day.isoformat(), slot
                self.log.append({"action": "move", "ref": ref, "from": before})
                return Response.redirect(
                    self.href(f"/reservation/{ref}"), {"notice": "Booking moved"}
                )
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        hidden = "".join(
            f'<input type="hidden" name="{k}" value="{esc(v)}">'
            for k, v in (("date", day.isoformat()), ("slot", slot))
        )
        body = (
            f"<h1>Move booking {ref}?</h1>{error_html}<p>From {esc(self._when(booking))} to "
            f"{esc(long_date(day))} at {slot}.</p>"
            f'<form method="post" action="{self.href(f"/reservation/{ref}/move")}">{hidden}'
            '<button type="submit" id="move">Confirm move</button></form>'
        )
        return self.page(f"Move {ref}", body, 400 if errors else 200)
