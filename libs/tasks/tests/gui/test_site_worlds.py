"""The sites seeded per task (a world in the constructor, in a reset body, in a file for the
command line), their pages the same for the same world, and the flows of the booking, wiki
and portal sites over plain HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from orchard.tasks.gui.sites import SITES, SiteServer, WorldError, fetch_state, reset_site
from orchard.tasks.gui.sites.booking import make_booking_world
from orchard.tasks.gui.sites.portal import make_portal_world
from orchard.tasks.gui.sites.wiki import make_wiki_world

pytestmark = pytest.mark.timeout(60)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def post(url: str, fields: dict[str, str]) -> tuple[int, str]:
    opener = urllib.request.build_opener(_NoRedirect)
    data = urllib.parse.urlencode(fields).encode()
    try:
        with opener.open(urllib.request.Request(url, data=data), timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Location") or exc.read().decode()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def tiny_shop() -> dict[str, object]:
    return {
        "products": [
            {
                "id": "k1",
                "name": "Copper Kettle",
                "category": "Kitchen",
                "price_cents": 2500,
                "description": "A kettle.",
            },
            {
                "id": "g1",
                "name": "Moss Rake",
                "category": "Garden",
                "price_cents": 900,
                "description": "A rake.",
            },
        ]
    }


def test_a_world_seeds_a_site_in_the_constructor_and_in_a_reset() -> None:
    with SiteServer(["shop"], worlds={"shop": tiny_shop()}, state_token="t") as server:
        page = get(server.url("shop"))
        assert "Copper Kettle" in page and "Moss Rake" in page and "Toys" not in page
        assert post(server.url("shop", "/cart/add"), {"id": "k1", "qty": "2"})[0] == 303
        assert fetch_state(server.base_url, "shop", token="t")["cart"][0]["qty"] == 2
        # A reset without a body starts over from the same world.
        reset_site(server.base_url, "shop", token="t")
        assert fetch_state(server.base_url, "shop", token="t")["cart"] == []
        assert server.world("shop") == tiny_shop()
        # A reset with a body replaces the world; the browser can neither read nor reset it.
        other = SITES["shop"].make_world(3)
        reset_site(server.base_url, "shop", other, token="t")
        assert server.world("shop") == other
        assert other["products"][0]["name"] in get(server.url("shop"))
        with pytest.raises(urllib.error.HTTPError) as refused:
            reset_site(server.base_url, "shop", tiny_shop())
        assert refused.value.code == 401
        request = urllib.request.Request(server.base_url + "/_orchard/world/shop")
        request.add_header("Authorization", "Bearer t")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == other


def test_a_malformed_world_is_refused_and_changes_nothing() -> None:
    with SiteServer(["shop", "booking"], worlds={"shop": tiny_shop()}) as server:
        with pytest.raises(urllib.error.HTTPError) as bad:
            reset_site(server.base_url, "shop", {"products": [{"id": "x"}]})
        assert bad.value.code == 400
        assert "malformed" in json.loads(bad.value.read())["error"]
        assert server.world("shop") == tiny_shop() and "Copper Kettle" in get(server.url("shop"))
        with pytest.raises(WorldError, match="site booking"):
            server.reset("booking", {"today": "not a date"})
    with pytest.raises(ValueError, match="not served"):
        SiteServer(["shop"], worlds={"wiki": make_wiki_world(1)})


def test_the_same_world_gives_the_same_pages() -> None:
    worlds = {name: cls.make_world(11) for name, cls in SITES.items()}
    booking = worlds["booking"]
    room = booking["rooms"][0]["id"]
    slug = worlds["wiki"]["articles"][0]["slug"]
    pages = {
        "shop": ["/", "/product/p01", "/?category=Garden", "/cart"],
        "forms": ["/step/1"],
        "playground": ["/"],
        "booking": ["/", f"/room/{room}", f"/room/{room}/day/{booking['today']}", "/bookings"],
        "wiki": ["/", f"/article/{slug}", f"/article/{slug}/talk", "/search?q=river"],
        "portal": ["/", "/activate", "/terms", "/voucher", "/letter"],
    }
    seen = []
    for _ in range(2):
        with SiteServer(list(SITES), worlds=worlds) as server:
            seen.append(
                [get(server.url(site, path)) for site, paths in pages.items() for path in paths]
            )
    assert seen[0] == seen[1]
    with SiteServer(list(SITES), seed=12) as server:
        other = [get(server.url(site)) for site in pages]
    with SiteServer(list(SITES), worlds=worlds) as server:
        same = [get(server.url(site)) for site in pages]
    # The playground and the form start pages do not depend on the world.
    assert [a != b for a, b in zip(other, same, strict=True)] == [
        True,
        False,
        False,
        True,
        True,
        True,
    ]


def test_booking_book_refuse_cancel_move() -> None:
    world = make_booking_world(4)
    with SiteServer(["booking"], worlds={"booking": world}) as server:
        site = server.sites["booking"]
        taken = world["bookings"][0]
        room = next(r for r in world["rooms"] if r["id"] == taken["room"])
        fields = {"room": room["id"], "date": taken["date"], "slot": taken["slot"]}
        status, body = post(server.url("booking", "/book"), {**fields, "name": "Ana"})
        assert status == 400 and "already taken" in body
        free = next(s for s in world["slots"] if not site._taken(room["id"], taken["date"], s))  # type: ignore[attr-defined]
        status, body = post(
            server.url("booking", "/book"),
            {**fields, "slot": free, "name": "", "attendees": str(room["capacity"] + 1)},
        )
        assert status == 400 and "Your name is required" in body and "Attendees must be" in body
        status, where = post(
            server.url("booking", "/book"),
            {**fields, "slot": free, "name": "Ana", "attendees": "2"},
        )
        assert status == 303 and "/booking/reservation/BK-" in where
        state = server.state("booking")
        new = state["bookings"][-1]
        assert (new["name"], new["slot"], new["status"]) == ("Ana", free, "active")
        assert post(server.url("booking", f"/reservation/{taken['ref']}/cancel"), {})[0] == 303
        move = {"date": new["date"], "slot": taken["slot"]}  # freed by the cancellation
        assert post(server.url("booking", f"/reservation/{new['ref']}/move"), move)[0] == 303
        state = server.state("booking")
        assert [e["action"] for e in state["log"]] == ["book", "cancel", "move"]
        assert state["bookings"][-1]["slot"] == taken["slot"]
        assert (
            next(b for b in state["bookings"] if b["ref"] == taken["ref"])["status"] == "cancelled"
        )
        assert f"Cancel {new['ref']}" in get(server.url("booking", "/bookings"))


def test_booking_calendar_months_are_bounded() -> None:
    world = make_booking_world(5)
    room = world["rooms"][0]["id"]
    today = world["today"]
    with SiteServer(["booking"], worlds={"booking": world}) as server:
        first = get(server.url("booking", f"/room/{room}"))
        assert 'aria-label="Next month"' in first and 'aria-label="Previous month"' not in first
        year, month = int(today[:4]), int(today[5:7])
        index = year * 12 + month - 1 + world["months_ahead"]
        last_month = f"{index // 12}-{index % 12 + 1:02d}"
        last = get(server.url("booking", f"/room/{room}?month={last_month}"))
        assert 'aria-label="Next month"' not in last and 'aria-label="Previous month"' in last
        past = get(server.url("booking", f"/room/{room}/day/{year - 1}-01-04"))
        assert "cannot be booked" in past


def test_wiki_search_edit_and_reply() -> None:
    world = make_wiki_world(6)
    article = world["articles"][0]
    slug = article["slug"]
    with SiteServer(["wiki"], worlds={"wiki": world}) as server:
        results = get(server.url("wiki", "/search?q=" + urllib.parse.quote(article["title"])))
        assert article["title"] in results and "result" in results
        status, body = post(server.url("wiki", f"/article/{slug}/edit"), {"text": " ", "tags": ""})
        assert status == 400 and "cannot be empty" in body
        fields = {"text": "One.\n\nTwo.", "tags": "Wetland, rare, rare", "summary": "s"}
        assert post(server.url("wiki", f"/article/{slug}/edit"), fields)[0] == 303
        assert (
            post(server.url("wiki", f"/article/{slug}/talk"), {"author": "", "reply": "x"})[0]
            == 400
        )
        assert (
            post(server.url("wiki", f"/article/{slug}/talk"), {"author": "Ana", "reply": "Hi"})[0]
            == 303
        )
        state = server.state("wiki")
        edited = next(a for a in state["articles"] if a["slug"] == slug)
        assert edited["body"] == ["One.", "Two."] and edited["tags"] == ["wetland", "rare"]
        assert edited["revision"] == 2 and edited["talk"][-1] == {"author": "Ana", "text": "Hi"}
        assert state["edits"] == [{"slug": slug, "summary": "s"}]
        assert "Tag wetland" in get(server.url("wiki", f"/article/{slug}"))
        assert article["title"] in get(server.url("wiki", "/tag/wetland"))


def test_portal_codes_come_from_the_other_pages() -> None:
    world = make_portal_world(7)
    with SiteServer(["portal"], worlds={"portal": world}) as server:
        activate = get(server.url("portal", "/activate"))
        assert 'target="_blank"' in activate and world["agreement_code"] not in activate
        assert world["agreement_code"] in get(server.url("portal", "/terms"))
        voucher = get(server.url("portal", "/voucher"))
        assert "window.open" in voucher and world["voucher_code"] not in voucher
        assert world["voucher_code"] in get(server.url("portal", "/letter"))
        status, body = post(
            server.url("portal", "/activate"), {"code": "AGR-XXXX", "accept": "yes"}
        )
        assert status == 400 and "not right" in body
        code = world["agreement_code"].lower()
        assert post(server.url("portal", "/activate"), {"code": code, "accept": "yes"})[0] == 200
        plan = world["plans"][0]
        fields = {"code": world["voucher_code"], "plan": plan}
        assert post(server.url("portal", "/voucher"), fields)[0] == 200
        state = server.state("portal")
        assert state["billing_active"] is True
        assert [a["ok"] for a in state["activations"]] == [False, True]
        assert state["redemptions"] == [{"code": world["voucher_code"], "plan": plan, "ok": True}]


def test_the_command_line_serves_a_world_file(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worlds = tmp_path / "worlds.json"
    worlds.write_text(json.dumps({"shop": tiny_shop()}))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchard.tasks.gui.sites",
            "--listen",
            f"127.0.0.1:{port}",
            "--sites",
            "shop",
            "--worlds-file",
            str(worlds),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
        assert "Moss Rake" in get(f"http://127.0.0.1:{port}/shop/")
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    done = subprocess.run(
        [sys.executable, "-m", "orchard.tasks.gui.sites", "--worlds-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "JSON object" in done.stderr
