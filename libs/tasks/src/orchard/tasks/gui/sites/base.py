"""What every offline site is made of: a `Site` (routes over server-side state started from a
JSON *world*), the request and response it sees, and the shared page layout. Standard library
only."""

from __future__ import annotations

import copy
import html
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlencode

__all__ = ["Request", "Response", "Site", "WorldError", "esc", "layout"]


def esc(value: object) -> str:
    """Text made safe for HTML (attributes included)."""
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Request:
    """One HTTP request as a site sees it: the path inside the site (starting with ``/``)."""

    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    form: dict[str, list[str]] = field(default_factory=dict)
    body_json: Any = None

    def field(self, name: str, default: str = "") -> str:
        """A form field (first value), else a query parameter, else ``default``; stripped."""
        values = self.form.get(name)
        if values:
            return values[0].strip()
        return self.query.get(name, default).strip()

    def fields(self, name: str) -> list[str]:
        return [v.strip() for v in self.form.get(name, [])]


@dataclass(frozen=True)
class Response:
    """What a site answers. ``hang`` holds the connection open without answering (a page that
    never loads, for robustness tasks) until the server stops."""

    status: int = 200
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()
    hang: bool = False

    @classmethod
    def html(cls, text: str, status: int = 200) -> Response:
        return cls(status, text.encode())

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(value).encode(), "application/json")

    @classmethod
    def redirect(cls, location: str, query: dict[str, str] | None = None) -> Response:
        if query:
            location = f"{location}?{urlencode(query)}"
        return cls(303, b"", headers=(("Location", location),))

    @classmethod
    def never(cls) -> Response:
        return cls(hang=True)


_CSS = """
body{font-family:DejaVu Sans,Arial,sans-serif;margin:0;background:#f6f6f2;color:#222}
header{background:#2f5d50;color:#fff;padding:12px 24px;display:flex;gap:24px;align-items:center}
header a{color:#fff;text-decoration:none;font-size:16px}
header .brand{font-weight:bold;font-size:20px}
main{padding:20px 24px;max-width:1100px}
h1{font-size:26px;margin:8px 0 16px}
button,.button{font-size:16px;padding:8px 16px;border-radius:6px;border:1px solid #2f5d50;
 background:#3f7d6a;color:#fff;cursor:pointer;text-decoration:none;display:inline-block}
button.secondary{background:#fff;color:#2f5d50}
input,select,textarea{font-size:16px;padding:6px 8px;border:1px solid #999;border-radius:4px}
label{display:block;margin:10px 0 4px;font-weight:bold}
.grid{display:grid;grid-template-columns:repeat(4,1fr);gap:16px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:12px}
.error{color:#b00020;font-weight:bold}
.notice{background:#e4f2ec;border:1px solid #2f5d50;padding:8px 12px;border-radius:6px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:6px 10px;text-align:left}
"""


def layout(site_title: str, title: str, body: str, nav: list[tuple[str, str]]) -> str:
    """A whole HTML page: the site's header with its navigation, then the body."""
    links = "".join(f'<a href="{esc(href)}">{esc(label)}</a>' for href, label in nav)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{esc(title)} - {esc(site_title)}</title><style>{_CSS}</style></head>"
        f"<body><header><span class='brand'>{esc(site_title)}</span>{links}</header>"
        f"<main>{body}</main></body></html>"
    )


class WorldError(ValueError):
    """A world a site cannot start from; the message names the site and what is wrong."""


class Site:
    """One web application with its state kept in the server, started from a *world*: the
    JSON content a task seeds it with (products, rooms, articles, ...). Subclasses set
    ``name`` and ``title`` and implement `make_world`, `load`, `state` and `handle`; the server
    serializes calls to one site with `lock`, so handlers need no locking of their own."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, seed: int = 0, world: Mapping[str, Any] | None = None) -> None:
        self.seed = seed
        self.lock = threading.Lock()
        self.world: dict[str, Any] = {}
        self.reset(world)

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        """The content a seed gives when no task seeds the site, as JSON."""
        raise NotImplementedError

    def load(self, world: dict[str, Any]) -> None:
        """Starts the site over from ``world`` (a private copy). Raises KeyError, TypeError or
        ValueError when the world is malformed; `reset` reports those as `WorldError`."""
        raise NotImplementedError

    def reset(self, world: Mapping[str, Any] | None = None) -> None:
        """Back to the starting state: of ``world`` when given (the site's world from then on),
        else of the world it has. A malformed world raises `WorldError` and changes nothing."""
        if world is None:
            if not self.world:
                self.world = self.make_world(self.seed)
            self.load(copy.deepcopy(self.world))
            return
        try:
            # A JSON round trip: the world is plain data, as when it arrives over HTTP.
            candidate = json.loads(json.dumps(dict(world)))
            self.load(copy.deepcopy(candidate))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if self.world:
                self.load(copy.deepcopy(self.world))
            raise WorldError(f"site {self.name}: the world is malformed: {exc!r}") from exc
        self.world = candidate

    def state(self) -> dict[str, Any]:
        """What a task's check reads: everything the visitor changed, as JSON."""
        raise NotImplementedError

    def handle(self, request: Request) -> Response:
        raise NotImplementedError

    def href(self, path: str = "/") -> str:
        """The absolute path of a page of this site (sites live under ``/<name>/``)."""
        return f"/{self.name}{path}"

    def page(self, title: str, body: str, status: int = 200) -> Response:
        return Response.html(layout(self.title, title, body, self.nav()), status)

    def nav(self) -> list[tuple[str, str]]:
        return [(self.href("/"), "Home")]

    def not_found(self, what: str) -> Response:
        return self.page("Not found", f"<h1>Not found</h1><p>{esc(what)}</p>", 404)
