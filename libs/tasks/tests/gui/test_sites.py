"""The offline sites over plain HTTP (no browser): seeded content, server-side state, the state
endpoint and its token, validation, the command line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from orchard.tasks.gui.sites import SITES, SiteServer, fetch_state
from orchard.tasks.gui.sites.shop import make_catalog

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
        return exc.code, exc.read().decode() if exc.code != 303 else exc.headers["Location"]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_content_is_seeded() -> None:
    assert make_catalog(3) == make_catalog(3)
    assert make_catalog(3) != make_catalog(4)
    names = [p.name for p in make_catalog(0)]
    assert len(names) == len(set(names)) == 24


def test_every_site_answers_and_starts_empty() -> None:
    with SiteServer(seed=1) as server:
        assert set(SITES) == {"shop", "forms", "playground", "booking", "wiki", "portal"}
        for name in SITES:
            assert "<title>" in get(server.url(name))
        assert server.state("shop") == {"cart": [], "orders": [], "searches": []}
        assert fetch_state(server.base_url, "forms")["submissions"] == []
        assert "Orchard Outfitters" in get(server.base_url + "/")


def test_the_multi_step_form_validates_and_records() -> None:
    with SiteServer(["forms"], seed=2) as server:
        url = server.url("forms", "/step/1")
        status, body = post(url, {"full_name": "", "email": "nope"})
        assert status == 400 and "Full name is required" in body and "Email must be" in body
        assert post(url, {"full_name": "Grace Hopper", "email": "grace@example.org"})[0] == 303
        country = server.sites["forms"].countries[0]  # type: ignore[attr-defined]
        step2 = server.url("forms", "/step/2")
        assert post(step2, {"plan": "pro", "country": country, "newsletter": "yes"})[0] == 303
        step3 = server.url("forms", "/step/3")
        status, body = post(step3, {"comments": "hi"})
        assert status == 400 and "You must agree" in body
        assert post(step3, {"comments": "hi", "agree": "yes"})[0] == 303
        (submission,) = server.state("forms")["submissions"]
        assert submission == {
            "reference": "LIB-02001",
            "full_name": "Grace Hopper",
            "email": "grace@example.org",
            "phone": "",
            "plan": "pro",
            "country": country,
            "newsletter": True,
            "comments": "hi",
        }
        assert "LIB-02001" in get(server.url("forms", "/done"))


def test_the_state_endpoint_needs_the_token() -> None:
    with SiteServer(["shop"], state_token="s3cret") as server:
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch_state(server.base_url, "shop")
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            fetch_state(server.base_url, "shop", token="wrong")
        assert fetch_state(server.base_url, "shop", token="s3cret")["orders"] == []
        with pytest.raises(urllib.error.HTTPError) as missing:
            fetch_state(server.base_url, "wiki", token="s3cret")
        assert missing.value.code == 404


def test_unknown_sites_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown site"):
        SiteServer(["casino"])


def test_the_command_line_serves_the_sites(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchard.tasks.gui.sites",
            "--listen",
            f"127.0.0.1:{port}",
            "--sites",
            "shop,playground",
            "--seed",
            "5",
            "--state-token-file",
            str(token),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
        product = make_catalog(5)[0]
        assert product.name in get(base + "/shop/")
        assert post(base + "/shop/cart/add", {"id": product.id, "qty": "3"})[0] == 303
        state = fetch_state(base, "shop", token="t0ken")
        assert state["cart"] == [{"id": product.id, "name": product.name, "qty": 3}]
        assert "Widget Playground" in get(base + "/playground/")
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0
