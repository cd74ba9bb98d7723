"""The HTTP server of the offline sites: each chosen site under ``/<name>/``, its state for
checks at ``/_orchard/state/<name>``. ``POST /_orchard/reset/<name>`` starts a site over: from
the JSON world in the body when there is one (a task's products, rooms, articles), else from
the world it has; ``GET /_orchard/world/<name>`` returns that world. One server with one site
seeded by a task's world serves exactly that task.

Standard library only (``http.server``), one thread per connection, so a page that never
answers (``/playground/hang``) blocks only its own connection. With a state token set, the
``/_orchard/`` endpoints need ``Authorization: Bearer <token>``, which a browser never sends:
an agent cannot read or reset what its check reads.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .base import Request, Response, Site, WorldError, esc, layout
from .booking import BookingSite
from .forms import ApplicationFormSite
from .playground import PlaygroundSite
from .portal import PortalSite
from .shop import ShopSite
from .wiki import WikiSite

__all__ = ["SITES", "SiteServer", "fetch_state", "main", "reset_site"]

SITES: dict[str, type[Site]] = {
    cls.name: cls
    for cls in (ShopSite, ApplicationFormSite, PlaygroundSite, BookingSite, WikiSite, PortalSite)
}
_MAX_BODY = 1 << 20
# How often the serving loop looks for `stop`: a server per task is started and stopped often.
_POLL_S = 0.05
_log = logging.getLogger("orchard.tasks.gui.sites")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: SiteServer) -> None:
        self.owner = owner
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Ends the connections browsers keep open between requests, so their threads end
        with the server instead of waiting for the browser to hang up."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "OrchardSites/0.1"

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        owner = self.server.owner
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = min(int(self.headers.get("Content-Length") or 0), _MAX_BODY)
        raw = self.rfile.read(length) if length else b""
        form: dict[str, list[str]] = {}
        body_json: Any = None
        kind = self.headers.get("Content-Type", "")
        if kind.startswith("application/x-www-form-urlencoded"):
            form = parse_qs(raw.decode(errors="replace"), keep_blank_values=True)
        elif kind.startswith("application/json") and raw:
            try:
                body_json = json.loads(raw)
            except ValueError:
                body_json = None
        parts = url.path.split("/", 2)
        name = parts[1] if len(parts) > 1 else ""
        if name == "_orchard":
            response = owner.admin(
                method, url.path, self.headers.get("Authorization", ""), body_json
            )
        elif name in owner.sites:
            site = owner.sites[name]
            inner = "/" + (parts[2] if len(parts) > 2 else "")
            if len(parts) == 2:
                response = Response.redirect(site.href("/"))
            else:
                with site.lock:
                    response = site.handle(Request(method, inner, query, form, body_json))
        elif url.path == "/":
            response = owner.index()
        else:
            response = Response.html("<h1>Not found</h1>", 404)
        if response.hang:
            owner.stopping.wait()
            self.close_connection = True
            return
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in response.headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(response.body)


class SiteServer:
    """Serves the chosen sites on one port. ``with SiteServer(...) as sites:`` starts it in a
    thread; `serve_forever` runs it in the calling thread (the command line)."""

    def __init__(
        self,
        sites: Sequence[str] = tuple(SITES),
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        state_token: str | None = None,
        worlds: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``worlds`` seeds sites (by name) with a task's content instead of the seed's; a
        malformed one raises `WorldError`, a world for a site not served ValueError."""
        unknown = sorted(set(sites) - set(SITES))
        if unknown:
            raise ValueError(
                f"unknown site(s) {', '.join(unknown)}; the sites are {', '.join(SITES)}"
            )
        if not sites:
            raise ValueError("choose at least one site")
        worlds = worlds or {}
        stray = sorted(set(worlds) - set(sites))
        if stray:
            raise ValueError(f"world(s) for site(s) not served: {', '.join(stray)}")
        self.sites: dict[str, Site] = {name: SITES[name](seed, worlds.get(name)) for name in sites}
        self.seed = seed
        self.state_token = state_token
        self.stopping = threading.Event()
        self._http = _HTTPServer((host, port), self)
        self._thread: threading.Thread | None = None
        self._serving = False

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        host = str(self._http.server_address[0])
        return f"http://{host}:{self.port}"

    def url(self, site: str, path: str = "/") -> str:
        """The full URL of a page of one site."""
        return f"{self.base_url}/{site}{path}"

    def state(self, site: str) -> dict[str, Any]:
        """A site's state, read in-process (`fetch_state` reads it over HTTP)."""
        with self.sites[site].lock:
            return self.sites[site].state()

    def reset(self, site: str | None = None, world: Mapping[str, Any] | None = None) -> None:
        """Starts one site (or every site) over; ``world`` (one site only) replaces its world,
        and a malformed one raises `WorldError` leaving the site as it was."""
        if world is not None and site is None:
            raise ValueError("a world seeds one site: name it")
        for name in [site] if site else list(self.sites):
            with self.sites[name].lock:
                self.sites[name].reset(world)

    def world(self, site: str) -> dict[str, Any]:
        """The world a site starts from (a copy)."""
        with self.sites[site].lock:
            world: dict[str, Any] = json.loads(json.dumps(self.sites[site].world))
        return world

    def start(self) -> None:
        """Serves in a background thread."""
        self._serving = True
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            args=(_POLL_S,),
            name="orchard-gui-sites",
            daemon=True,
        )
        self._thread.start()

    def serve_forever(self) -> None:
        """Serves in the calling thread until `stop` (from another thread or a signal)."""
        self._serving = True
        try:
            self._http.serve_forever(_POLL_S)
        finally:
            self._serving = False

    def stop(self) -> None:
        """Stops serving; connections held by never-answering pages are released."""
        self.stopping.set()
        if self._serving:
            self._http.shutdown()
            self._serving = False
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._http.close_connections()
        self._http.server_close()

    def __enter__(self) -> SiteServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def index(self) -> Response:
        items = "".join(
            f'<li><a href="{site.href("/")}">{esc(site.title)}</a>: {esc(site.description)}</li>'
            for site in self.sites.values()
        )
        return Response.html(layout("Sites", "Sites", f"<h1>Sites</h1><ul>{items}</ul>", []))

    def admin(self, method: str, path: str, authorization: str, body: Any = None) -> Response:
        if self.state_token is not None and not hmac.compare_digest(
            authorization.encode(), f"Bearer {self.state_token}".encode()
        ):
            return Response.json({"error": "a valid state token is required"}, 401)
        _, _, action, name = ([*path.split("/"), "", ""])[:4]
        if name not in self.sites:
            return Response.json(
                {"error": f"no site {name!r}; the sites are {', '.join(self.sites)}"}, 404
            )
        if action == "state" and method == "GET":
            return Response.json(self.state(name))
        if action == "world" and method == "GET":
            return Response.json(self.world(name))
        if action == "reset" and method == "POST":
            if body is not None and not isinstance(body, dict):
                return Response.json({"error": "the body must be a JSON object (a world)"}, 400)
            try:
                self.reset(name, body)
            except WorldError as exc:
                return Response.json({"error": str(exc)}, 400)
            return Response.json({"ok": True})
        return Response.json(
            {
                "error": "use GET /_orchard/state/<site>, GET /_orchard/world/<site> or "
                "POST /_orchard/reset/<site> (body: a JSON world, optional)"
            },
            404,
        )


def fetch_state(
    base_url: str, site: str, *, token: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """A site's state over HTTP, as a task's check reads it from outside the browser."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/_orchard/state/{site}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        state: dict[str, Any] = json.loads(response.read())
    return state


def reset_site(
    base_url: str,
    site: str,
    world: Mapping[str, Any] | None = None,
    *,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> None:
    """Starts a served site over, from ``world`` when given (a task's initial state).
    Raises urllib.error.HTTPError (400 with the reason for a malformed world)."""
    data = json.dumps(dict(world)).encode() if world is not None else b""
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/_orchard/reset/{site}", data=data, method="POST"
    )
    if world is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchard.tasks.gui.sites",
        description="Serve Orchard's offline websites (each under /<site>/).",
    )
    parser.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (port 0: any free)")
    parser.add_argument(
        "--sites", default=",".join(SITES), help=f"comma-separated ({','.join(SITES)})"
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of the generated content")
    parser.add_argument(
        "--state-token-file",
        help="a file holding the token the /_orchard/ endpoints require (none: open)",
    )
    parser.add_argument(
        "--worlds-file",
        help="a JSON file {site: world} that seeds those sites (a task's initial state)",
    )
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--listen {args.listen!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    token = None
    if args.state_token_file:
        with open(args.state_token_file, encoding="utf-8") as f:
            token = f.read().strip()
    worlds: dict[str, Any] = {}
    if args.worlds_file:
        try:
            with open(args.worlds_file, encoding="utf-8") as f:
                worlds = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"--worlds-file {args.worlds_file}: {exc}")
        if not isinstance(worlds, dict):
            parser.error(f"--worlds-file {args.worlds_file}: give a JSON object {{site: world}}")
    names = [n.strip() for n in args.sites.split(",") if n.strip()]
    try:
        server = SiteServer(
            names, seed=args.seed, host=host, port=int(port), state_token=token, worlds=worlds
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _log.info("serving %s at %s", ", ".join(server.sites), server.base_url)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
