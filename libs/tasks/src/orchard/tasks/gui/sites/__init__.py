"""Offline websites for the GUI domain, served by one small HTTP server (standard library only,
so it runs on any sandbox's ``python3``). Each site starts from a *world*, the JSON content a
task seeds it with (made from a seed when no task does), and keeps its state in the server,
where a task's check reads it (`fetch_state`, or `SiteServer.state`).

| site | what |
|---|---|
| ``shop`` | catalog with search and categories, product pages, cart, checkout, orders |
| ``forms`` | a three-step membership application with validation and review |
| ``playground`` | one widget per action, dialogs, tabs, a page that never answers |
| ``booking`` | meeting rooms: month calendars, slots, booking, cancelling, rescheduling |
| ``wiki`` | articles with facts, search, categories and tags, editing, discussions |
| ``portal`` | a customer portal whose codes are on pages that open in another tab |
"""

from .base import Request, Response, Site, WorldError
from .server import SITES, SiteServer, fetch_state, main, reset_site

__all__ = [
    "SITES",
    "Request",
    "Response",
    "Site",
    "SiteServer",
    "WorldError",
    "fetch_state",
    "main",
    "reset_site",
]
