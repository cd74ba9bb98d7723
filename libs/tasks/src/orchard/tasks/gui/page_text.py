"""The active page as compact text, for a student that cannot see pixels and for scripted
teachers: the URL, the title, the scroll position, then the elements on screen in reading order,
each with its role, accessible name, value or state and the centre of its visible part in
viewport pixels (where a click lands on it)::

    url: http://127.0.0.1:8080/shop/product/p04
    title: Steel Kettle - Orchard Outfitters
    scroll: y=0 of 900 (viewport 1280x800)
    [1] link "Shop" @ (241,24)
    [2] heading "Steel Kettle" @ (550,95)
    [3] spinbutton "Quantity" value="1" @ (111,225)
    [4] button "Add to cart" @ (245,225)
    (below the screen: 3 more; scroll down)

One script run in the page (`read_page`) collects it; `PageText.render` bounds the text
(``max_chars``) and says what it cut; `parse_page_text` reads the text back into `PageText`
(what a teacher given only an observation's text works from). Only this module's `read_page`
needs playwright.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.async_api import Page

__all__ = [
    "DEFAULT_MAX_CHARS",
    "PageElement",
    "PageText",
    "parse_page_text",
    "read_page",
]

DEFAULT_MAX_CHARS = 4000
"""The rendering's default bound: about 1,000 tokens, a screenful of a busy page."""
MAX_ITEM_CHARS = 160
"""Longest name or value of one element; longer ones end in an ellipsis."""

# Collects the elements whose visible part is on screen, in document order. Controls (links,
# buttons, fields) are items of their own and their insides are not read again; a block of text
# with no control inside is one item (a table row: its cells joined by " | "); a label that
# names a control is not repeated, the control carries its text as its name.
_COLLECT = r"""
(maxItemChars) => {
  const vw = window.innerWidth, vh = window.innerHeight;
  const CONTROLS = 'a[href],button,input:not([type=hidden]),select,textarea,summary,' +
    '[role=button],[role=link],[role=checkbox],[role=radio],[role=tab],[role=menuitem],' +
    '[role=slider],[role=switch],[role=option],[role=combobox],[role=textbox],' +
    '[contenteditable=""],[contenteditable=true],[onclick],[tabindex]:not([tabindex="-1"])';
  const SKIP = new Set(['SCRIPT', 'STYLE', 'NOSCRIPT', 'TEMPLATE', 'HEAD', 'IFRAME']);
  const WHOLE = new Set(['H1', 'H2', 'H3', 'H4', 'H5', 'H6', 'P', 'LI', 'TR', 'DT', 'DD',
    'LEGEND', 'CAPTION', 'FIGCAPTION', 'BLOCKQUOTE', 'PRE']);
  const INLINE = new Set(['inline', 'inline-block', 'contents', 'none']);
  const items = [];
  let above = 0, below = 0;
  const clean = (s) => (s || '').replace(/\s+/g, ' ').trim();
  const cut = (s) => s.length > maxItemChars ? s.slice(0, maxItemChars - 1) + '\u2026' : s;
  const textOf = (el) => clean(el.innerText || el.textContent);

  function spot(rect) {
    if (rect.width <= 0 || rect.height <= 0) return null;
    const l = Math.max(rect.left, 0), r = Math.min(rect.right, vw);
    const t = Math.max(rect.top, 0), b = Math.min(rect.bottom, vh);
    if (b - t >= 1 && r - l >= 1) return [Math.floor((l + r) / 2), Math.floor((t + b) / 2)];
    if (rect.bottom <= 0) return 'above';
    if (rect.top >= vh) return 'below';
    return null;
  }
  function add(role, name, rect, extra, el) {
    const where = spot(rect);
    if (where === 'above') { above++; return; }
    if (where === 'below') { below++; return; }
    if (where === null) return;
    const item = Object.assign({role: role, name: cut(name), x: where[0], y: where[1]}, extra);
    if (el) {
      const hit = document.elementFromPoint(where[0], where[1]);
      const labels = el.labels ? Array.from(el.labels) : [];
      if (hit && hit !== el && !el.contains(hit) && !labels.some((l) => l.contains(hit))) {
        item.flags = (item.flags || []).concat(['covered']);
      }
    }
    items.push(item);
  }
  function shown(el) {
    if (el.getAttribute('aria-hidden') === 'true') return false;
    if (el.checkVisibility) {
      return el.checkVisibility({checkOpacity: true, checkVisibilityCSS: true});
    }
    const style = getComputedStyle(el);
    return style.display !== 'none' && style.visibility !== 'hidden';
  }
  function ariaName(el) {
    const label = el.getAttribute('aria-label');
    if (label && clean(label)) return clean(label);
    const ids = el.getAttribute('aria-labelledby');
    if (ids) {
      const text = ids.split(/\s+/).map((id) => {
        const node = document.getElementById(id);
        return node ? textOf(node) : '';
      }).join(' ');
      if (clean(text)) return clean(text);
    }
    return '';
  }
  function roleOf(el) {
    const role = el.getAttribute('role');
    if (role) return role;
    const tag = el.tagName;
    if (tag === 'A') return 'link';
    if (tag === 'BUTTON' || tag === 'SUMMARY') return 'button';
    if (tag === 'SELECT') return el.multiple ? 'listbox' : 'combobox';
    if (tag === 'TEXTAREA') return 'textbox';
    if (tag === 'INPUT') {
      const type = (el.type || 'text').toLowerCase();
      if (['submit', 'button', 'reset', 'image', 'file'].includes(type)) return 'button';
      if (type === 'checkbox' || type === 'radio') return type;
      if (type === 'range') return 'slider';
      if (type === 'number') return 'spinbutton';
      if (type === 'search') return 'searchbox';
      return 'textbox';
    }
    if (el.isContentEditable) return 'textbox';
    return 'clickable';
  }
  function control(el) {
    const role = roleOf(el);
    const extra = {};
    const flags = [];
    let name = ariaName(el);
    const field = ['textbox', 'searchbox', 'spinbutton', 'combobox', 'listbox', 'checkbox',
      'radio', 'slider'].includes(role) && ['INPUT', 'SELECT', 'TEXTAREA'].includes(el.tagName);
    if (!name && field) {
      const labels = el.labels ? Array.from(el.labels) : [];
      name = clean(labels.map((l) => textOf(l)).join(' '));
      if (!name) name = clean(el.getAttribute('placeholder') || el.getAttribute('title') ||
        el.getAttribute('name'));
    }
    if (!name) {
      name = textOf(el) || clean(el.value || '') || clean(el.getAttribute('title'));
      if (!name) {
        const img = el.querySelector('img[alt]');
        name = img ? clean(img.getAttribute('alt')) : '';
      }
    }
    if (el.tagName === 'SELECT') {
      const chosen = el.selectedIndex >= 0 ? el.options[el.selectedIndex] : null;
      extra.value = chosen ? clean(chosen.text) : '';
      extra.options = Array.from(el.options).slice(0, 30).map((o) => cut(clean(o.text)));
    } else if (role === 'checkbox' || role === 'radio' || role === 'switch') {
      const on = el.tagName === 'INPUT' ? el.checked : el.getAttribute('aria-checked') === 'true';
      flags.push(on ? 'checked' : 'unchecked');
    } else if (el.tagName === 'INPUT' || el.tagName === 'TEXTAREA') {
      extra.value = el.type === 'password' ? '\u2022'.repeat((el.value || '').length) :
        cut(el.tagName === 'TEXTAREA' ? el.value.replace(/\s+/g, ' ') : el.value);
    } else if (el.isContentEditable) {
      extra.value = cut(textOf(el));
    } else if (el.hasAttribute('aria-valuenow')) {
      extra.value = el.getAttribute('aria-valuenow');
    }
    if (el.disabled || el.getAttribute('aria-disabled') === 'true') flags.push('disabled');
    if (document.activeElement === el) flags.push('focused');
    if (el.tagName === 'A' && (el.getAttribute('target') || '').toLowerCase() === '_blank') {
      flags.push('newtab');
    }
    if (flags.length) extra.flags = flags;
    add(role, name, el.getBoundingClientRect(), extra, el);
  }
  function whole(el) {
    if (el.querySelector(CONTROLS)) return false;
    if (WHOLE.has(el.tagName)) return true;
    for (const child of el.children) {
      if (!INLINE.has(getComputedStyle(child).display)) return false;
    }
    return true;
  }
  function block(el) {
    let text;
    if (el.tagName === 'TR') {
      text = Array.from(el.cells).map((c) => textOf(c)).filter((t) => t).join(' | ');
    } else {
      text = textOf(el);
    }
    if (!text) return;
    const role = /^H[1-6]$/.test(el.tagName) ? 'heading' : 'text';
    // The text's own extent, not the block's: a short line in a wide paragraph is hit there.
    let rect = el.getBoundingClientRect();
    if (el.tagName !== 'TR') {
      const range = document.createRange();
      range.selectNodeContents(el);
      const inner = range.getBoundingClientRect();
      if (inner.width > 0 && inner.height > 0) rect = inner;
    }
    add(role, text, rect, {}, null);
  }
  function walk(node) {
    for (const child of node.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) {
        const text = clean(child.textContent);
        if (!text) continue;
        const range = document.createRange();
        range.selectNodeContents(child);
        add('text', text, range.getBoundingClientRect(), {}, null);
        continue;
      }
      if (child.nodeType !== Node.ELEMENT_NODE || SKIP.has(child.tagName)) continue;
      if (!shown(child)) continue;
      if (child.matches(CONTROLS)) { control(child); continue; }
      if (child.tagName === 'LABEL' && child.control) {
        child.querySelectorAll(CONTROLS).forEach((c) => { if (shown(c)) control(c); });
        continue;
      }
      if (child.tagName === 'IMG') {
        const alt = clean(child.getAttribute('alt'));
        if (alt) add('image', alt, child.getBoundingClientRect(), {}, null);
        continue;
      }
      if (whole(child)) { block(child); continue; }
      walk(child);
    }
  }
  if (document.body) walk(document.body);
  const root = document.documentElement;
  return {
    url: location.href, title: document.title, items: items, above: above, below: below,
    scrollY: Math.round(window.scrollY), height: root ? root.scrollHeight : 0,
    width: vw, viewHeight: vh,
  };
}
"""


@dataclass(frozen=True)
class PageElement:
    """One element on screen. ``x``, ``y``: the centre of its visible part, in viewport
    pixels. ``flags``: checked, unchecked, disabled, focused, newtab (a link that opens a new
    tab), covered (something else is drawn over its centre)."""

    index: int
    role: str
    name: str
    x: int
    y: int
    value: str | None = None
    options: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()

    @property
    def point(self) -> tuple[int, int]:
        return (self.x, self.y)

    def line(self) -> str:
        """``[12] button "Add to cart" @ (640,412)``, with value, options and flags between."""
        parts = [f"[{self.index}] {self.role} {json.dumps(self.name, ensure_ascii=False)}"]
        if self.value is not None:
            parts.append(f"value={json.dumps(self.value, ensure_ascii=False)}")
        if self.options:
            options = json.dumps(list(self.options), ensure_ascii=False, separators=(",", ":"))
            parts.append(f"options={options}")
        parts += list(self.flags)
        parts.append(f"@ ({self.x},{self.y})")
        return " ".join(parts)


@dataclass(frozen=True)
class PageText:
    """What `read_page` found on the active page."""

    url: str
    title: str
    elements: tuple[PageElement, ...] = ()
    scroll_y: int = 0
    page_height: int = 0
    viewport: tuple[int, int] = (0, 0)
    above: int = 0
    """Elements above the screen (scroll up to see them)."""
    below: int = 0
    """Elements below the screen (scroll down to see them)."""
    cut: int = field(default=0, compare=False)
    """Elements on screen a bounded rendering left out (set by `parse_page_text`)."""

    def render(self, max_chars: int = DEFAULT_MAX_CHARS) -> str:
        """The page as text of at most ``max_chars`` characters (the last line says what was
        cut, if anything was)."""
        width, height = self.viewport
        head = [
            f"url: {self.url}",
            f"title: {self.title}",
            f"scroll: y={self.scroll_y} of {self.page_height} (viewport {width}x{height})",
        ]
        tail = []
        if self.above:
            tail.append(f"(above the screen: {self.above} more; scroll up)")
        if self.below:
            tail.append(f"(below the screen: {self.below} more; scroll down)")
        if not self.elements:
            head.append("(nothing on screen)")
        lines = list(head)
        used = sum(len(line) + 1 for line in head + tail)
        # Room for the note that says what was cut.
        budget = max_chars - 64
        shown = 0
        for element in self.elements:
            line = element.line()
            if used + len(line) + 1 > budget:
                break
            lines.append(line)
            used += len(line) + 1
            shown += 1
        left = len(self.elements) - shown
        if left:
            lines.append(f"(cut at {max_chars} characters: {left} more on screen after [{shown}])")
        text = "\n".join(lines + tail)
        return text if len(text) <= max_chars else text[: max_chars - 1] + "\u2026"

    def find(
        self, name: str, roles: tuple[str, ...] | None = None, *, exact: bool = False
    ) -> PageElement | None:
        """The first element (in reading order) named ``name`` (case and spacing ignored), of
        one of ``roles`` if given; failing an exact name, the first whose name starts with it,
        then the first whose name holds it (unless ``exact``). Uncovered elements first."""
        wanted = _norm(name)
        pool = [e for e in self.elements if roles is None or e.role in roles]
        pool.sort(key=lambda e: "covered" in e.flags)
        names = [(_norm(e.name), e) for e in pool]
        for match in ("whole", "start", "part")[: 1 if exact else 3]:
            for have, element in names:
                if (
                    have == wanted
                    or (match == "start" and have.startswith(wanted))
                    or (match == "part" and wanted in have)
                ):
                    return element
        return None

    def text(self) -> str:
        """Every element's name and value, one per line (to search the page's words)."""
        return "\n".join(e.name + (f" {e.value}" if e.value else "") for e in self.elements)


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _from_collected(data: dict[str, Any]) -> PageText:
    elements = tuple(
        PageElement(
            index=i,
            role=str(item["role"]),
            name=str(item["name"]),
            x=int(item["x"]),
            y=int(item["y"]),
            value=None if item.get("value") is None else str(item["value"]),
            options=tuple(str(o) for o in item.get("options", ())),
            flags=tuple(str(f) for f in item.get("flags", ())),
        )
        for i, item in enumerate(data["items"], start=1)
    )
    return PageText(
        url=str(data["url"]),
        title=str(data["title"]),
        elements=elements,
        scroll_y=int(data["scrollY"]),
        page_height=int(data["height"]),
        viewport=(int(data["width"]), int(data["viewHeight"])),
        above=int(data["above"]),
        below=int(data["below"]),
    )


async def read_page(page: Page, max_item_chars: int = MAX_ITEM_CHARS) -> PageText:
    """Collects the page text of a Playwright page (one script evaluation)."""
    data: dict[str, Any] = await page.evaluate(_COLLECT, max_item_chars)
    return _from_collected(data)


_LINE = re.compile(
    r'^\[(?P<index>\d+)\] (?P<role>[\w-]+) (?P<name>"(?:[^"\\]|\\.)*")(?P<rest>.*?)'
    r" @ \((?P<x>-?\d+),(?P<y>-?\d+)\)$"
)
_VALUE = re.compile(r'^ value=("(?:[^"\\]|\\.)*")')
_OPTIONS = re.compile(r'^ options=(\[(?:[^\]"\\]|"(?:[^"\\]|\\.)*")*\])')
_SCROLL = re.compile(r"^scroll: y=(-?\d+) of (\d+) \(viewport (\d+)x(\d+)\)$")
_MORE = re.compile(r"^\((above|below) the screen: (\d+) more")
_CUT = re.compile(r"^\(cut at \d+ characters: (\d+) more")


def parse_page_text(text: str) -> PageText:
    """Reads a rendering (`PageText.render`) back; lines it does not know are passed over."""
    url = title = ""
    scroll = (0, 0, 0, 0)
    elements: list[PageElement] = []
    above = below = cut = 0
    for line in text.splitlines():
        if line.startswith("url: "):
            url = line[5:]
        elif line.startswith("title: "):
            title = line[7:]
        elif match := _SCROLL.match(line):
            scroll = (int(match[1]), int(match[2]), int(match[3]), int(match[4]))
        elif match := _MORE.match(line):
            if match[1] == "above":
                above = int(match[2])
            else:
                below = int(match[2])
        elif match := _CUT.match(line):
            cut = int(match[1])
        elif match := _LINE.match(line):
            element = PageElement(
                index=int(match["index"]),
                role=match["role"],
                name=json.loads(match["name"]),
                x=int(match["x"]),
                y=int(match["y"]),
            )
            rest = match["rest"]
            if value := _VALUE.match(rest):
                element = replace(element, value=json.loads(value[1]))
                rest = rest[value.end() :]
            if options := _OPTIONS.match(rest):
                element = replace(element, options=tuple(json.loads(options[1])))
                rest = rest[options.end() :]
            element = replace(element, flags=tuple(rest.split()))
            elements.append(element)
    return PageText(
        url=url,
        title=title,
        elements=tuple(elements),
        scroll_y=scroll[0],
        page_height=scroll[1],
        viewport=(scroll[2], scroll[3]),
        above=above,
        below=below,
        cut=cut,
    )
