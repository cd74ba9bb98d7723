"""A page of widgets, one per kind of action: a button, a search box, a long page, a tooltip, a
slider to drag, dialogs, links that open tabs, a page that never answers and one that closes
itself. Warm-up tasks and the checks of a browser sandbox use it. World: ``{"help_code":
"ORCHID-7"}`` (what the help page shows). State: button presses, searches, and the events the
page's scripts report (hover, drag, dialogs, scrolling)."""

from __future__ import annotations

import time
from typing import Any

from .base import Request, Response, Site, esc

__all__ = ["PlaygroundSite"]

_SCRIPT = """
<script>
function report(kind, value) {
  // Reading the answer ends the request, so the browser sees the page settle at once.
  return fetch(BASE + '/api/event', {method: 'POST', headers: {'Content-Type': 'application/json'},
    body: JSON.stringify({kind: kind, value: value})}).then((r) => r.text());
}
document.getElementById('help').addEventListener('mouseenter', () => report('hover', 'help'));
const track = document.getElementById('track'), knob = document.getElementById('knob');
let dragging = false;
knob.addEventListener('pointerdown', (e) => {
  dragging = true;
  knob.setPointerCapture(e.pointerId);
});
knob.addEventListener('pointermove', (e) => {
  if (!dragging) return;
  const r = track.getBoundingClientRect();
  const left = Math.max(0, Math.min(r.width - 30, e.clientX - r.left - 15));
  knob.style.left = left + 'px';
  document.getElementById('level').textContent = Math.round(100 * left / (r.width - 30));
});
knob.addEventListener('pointerup', () => {
  dragging = false;
  report('drag', Number(document.getElementById('level').textContent));
});
document.getElementById('alert').onclick = () => { alert('Saved!'); report('alert', 'closed'); };
document.getElementById('confirm').onclick = () => report('confirm', confirm('Delete it?'));
document.getElementById('prompt').onclick = () => report('prompt', prompt('Your name?', 'Ada'));
document.getElementById('popup').onclick = () => window.open(BASE + '/help', '_blank');
new IntersectionObserver((entries) => {
  if (entries.some((e) => e.isIntersecting)) report('scroll', 'bottom');
}).observe(document.getElementById('bottom'));
</script>
"""


class PlaygroundSite(Site):
    name = "playground"
    title = "Widget Playground"
    description = "one widget per kind of action, dialogs, tabs and a page that never loads"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return {"help_code": "ORCHID-7"}

    def load(self, world: dict[str, Any]) -> None:
        self.help_code = str(world["help_code"])
        self.presses = 0
        self.searches: list[str] = []
        self.events: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {
            "presses": self.presses,
            "searches": list(self.searches),
            "events": [dict(e) for e in self.events],
        }

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/" and method == "GET":
            return self._index()
        if path == "/press" and method == "POST":
            self.presses += 1
            return Response.redirect(self.href("/"))
        if path == "/search" and method == "GET":
            query = request.field("q")
            self.searches.append(query)
            body = f"<h1>Search</h1><p id='result'>You searched for {esc(query)}</p>"
            return self.page("Search", body)
        if path == "/api/event" and method == "POST":
            data = request.body_json if isinstance(request.body_json, dict) else {}
            self.events.append({"kind": str(data.get("kind", "")), "value": data.get("value")})
            return Response.json({"ok": True})
        if path == "/second" and method == "GET":
            return self.page("Second page", "<h1>Second page</h1><p>Nothing else here.</p>")
        if path == "/help" and method == "GET":
            body = f"<h1>Help</h1><p>The help code is <b id='code'>{esc(self.help_code)}</b>.</p>"
            return self.page("Help", body)
        if path == "/closing" and method == "GET":
            body = (
                "<h1>Closing</h1><button id='close' onclick='window.close()'>Close this "
                "tab</button>"
            )
            return self.page("Closing", body)
        if path == "/slow" and method == "GET":
            time.sleep(min(5.0, float(request.field("seconds", "1") or "1")))
            return self.page("Slow", "<h1>Slow page</h1><p>Loaded at last.</p>")
        if path == "/hang":
            return Response.never()
        return self.not_found(f"no page {path}")

    def _index(self) -> Response:
        h = self.href
        body = f"""
<h1>Widgets</h1>
<p>Presses: <b id="presses">{self.presses}</b></p>
<form method="post" action="{h("/press")}"><button id="press" type="submit">Press me</button></form>
<form method="get" action="{h("/search")}"><label for="q">Search</label>
<input id="q" name="q" placeholder="Type and press Enter"></form>
<p><span id="help" style="border-bottom:1px dotted #333;position:relative">What is this?
<span id="tip" style="display:none;position:absolute;left:0;top:24px;background:#333;color:#fff;
padding:4px 8px;border-radius:4px;white-space:nowrap">A page of widgets</span></span></p>
<style>#help:hover #tip{{display:inline !important}}</style>
<p>Level: <b id="level">0</b></p>
<div id="track"
 style="position:relative;width:400px;height:30px;background:#ddd;border-radius:15px">
<div id="knob" role="slider" aria-label="Level slider" aria-valuemin="0" aria-valuemax="100"
 style="position:absolute;left:0;top:0;width:30px;height:30px;border-radius:15px;
background:#2f5d50;touch-action:none"></div></div>
<p><button id="alert" type="button">Alert</button>
<button id="confirm" type="button">Confirm</button>
<button id="prompt" type="button">Prompt</button> <button id="popup" type="button">Open help
window</button></p>
<p><a id="second" href="{h("/second")}">Second page</a> |
<a id="newtab" href="{h("/help")}" target="_blank">Help in a new tab</a> |
<a id="hang" href="{h("/hang")}">A page that never loads</a> |
<a id="closing" href="{h("/closing")}" target="_blank">A tab that closes itself</a></p>
<div style="height:2400px;background:linear-gradient(#f6f6f2,#cfe3da)"></div>
<p id="bottom">The end of the page.</p>
<script>const BASE = {h("")!r};</script>{_SCRIPT}
"""
        return self.page("Widgets", body)
