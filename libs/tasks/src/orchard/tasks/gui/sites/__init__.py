"""Offline websites for the GUI domain, generated from a seed and served by one small HTTP
server (standard library only, so it runs on any sandbox's ``python3``). Each site keeps its
state in the server; a task's check reads it (`fetch_state`, or `SiteServer.state`).

| site | what |
|---|---|
| ``shop`` | catalog with search and categories, product pages, cart, checkout, orders |
| ``forms`` | a three-step membership application with validation and review |
| ``playground`` | one widget per action, dialogs, tabs, a page that never answers |
"""

from .base import Request, Response, Site
from .server import SITES, SiteServer, fetch_state, main

__all__ = ["SITES", "Request", "Response", "Site", "SiteServer", "fetch_state", "main"]
