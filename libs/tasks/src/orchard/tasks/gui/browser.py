"""One Playwright-driven Chromium and the 13 atomic tools over it: `BrowserSession`.

The session owns a single headless Chromium (the system's, started with ``executable_path``;
Playwright's own browser downloads are never used) with a fresh profile folder and the flags
that keep it off the network unless a page asks. Every tool call returns an `Observation`, and
never raises for what an agent can cause: bad arguments, a dialog, a page that never answers, a
crashed tab or a dead browser each come back as an observation saying what happened and what to
do. Calls are serialized; each is bounded by the configured timeouts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from playwright.async_api import (
    BrowserContext,
    CDPSession,
    Dialog,
    Page,
    Playwright,
    Request,
    async_playwright,
)
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

from .actions import MAX_WAIT_SECONDS, ToolArgumentError, validate_arguments
from .observation import DialogRecord, ErrorKind, Observation, TabInfo
from .page_text import DEFAULT_MAX_CHARS, PageText, read_page

__all__ = ["OFFLINE_CHROMIUM_ARGS", "BrowserConfig", "BrowserSession", "BrowserUnavailableError"]

# Chromium reaches for outside hosts on its own (updates, sync, field trials, QUIC probes);
# these flags stop that, so the only traffic is what the pages ask for.
OFFLINE_CHROMIUM_ARGS: tuple[str, ...] = (
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--metrics-recording-only",
    "--password-store=basic",
)


class BrowserUnavailableError(RuntimeError):
    """Chromium or Playwright is missing or cannot start; the message says what to install."""


@dataclass(frozen=True)
class BrowserConfig:
    """How the browser is started and how long an action may take."""

    executable_path: str = "/usr/bin/chromium"
    """The Chromium binary (Debian's ``chromium`` package)."""
    viewport_width: int = 1280
    """Viewport (and screenshot) width in pixels."""
    viewport_height: int = 800
    """Viewport (and screenshot) height in pixels."""
    action_timeout_s: float = 10.0
    """Longest one action may take, a navigation included; past it the call reports a timeout."""
    settle_timeout_s: float = 3.0
    """After an action, how long to wait for the loads and requests it started."""
    screenshot_timeout_s: float = 5.0
    """Longest a screenshot may take (a page busy in a script never paints)."""
    launch_timeout_s: float = 30.0
    """Longest the browser may take to start."""
    sandbox: bool | None = None
    """Chromium's own sandbox; None: on unless running as root (where it cannot start)."""
    dialog_answer: Literal["accept", "dismiss"] = "accept"
    """How JavaScript dialogs (alert, confirm, prompt, beforeunload) are answered."""
    prompt_text: str = ""
    """What an accepted ``prompt()`` gets; empty: the prompt's default value."""
    max_tabs: int = 10
    """Most tabs open at once; ``new_tab`` past it is refused."""
    extra_args: tuple[str, ...] = ()
    """More Chromium flags, after `OFFLINE_CHROMIUM_ARGS`."""
    page_text: bool = True
    """Whether every observation carries the active page as text (`Observation.page_text`);
    reading it takes about 10 to 40 ms a call, a fraction of the screenshot's 40 to 120 ms."""
    page_text_max_chars: int = DEFAULT_MAX_CHARS
    """Longest page text; a longer page is cut, saying so."""
    page_text_timeout_s: float = 2.0
    """Longest reading the page text may take (a page busy in a script never answers)."""

    def __post_init__(self) -> None:
        if self.viewport_width < 100 or self.viewport_height < 100:
            raise ValueError("the viewport must be at least 100x100 pixels")
        for name in (
            "action_timeout_s",
            "settle_timeout_s",
            "screenshot_timeout_s",
            "page_text_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_tabs < 1:
            raise ValueError("max_tabs must be at least 1")
        if self.page_text_max_chars < 200:
            raise ValueError("page_text_max_chars must be at least 200")

    @property
    def sandbox_on(self) -> bool:
        """Whether Chromium's sandbox is used (root cannot use it)."""
        return self.sandbox if self.sandbox is not None else os.geteuid() != 0


_ALLOWED_SCHEMES = ("http://", "https://")
_NAVIGATIONS = frozenset({"goto_url", "go_back", "new_tab"})
_MAY_OPEN_TABS = frozenset({"click", "press_keys"})


def _normalize_url(url: str) -> str:
    url = url.strip()
    if url == "about:blank":
        return url
    if "://" not in url:
        url = "http://" + url
    if not url.lower().startswith(_ALLOWED_SCHEMES):
        raise ToolArgumentError(f"url {url!r}: only http:// and https:// URLs can be opened")
    return url


def _check_executable(path: str) -> None:
    if not os.access(path, os.X_OK):
        raise BrowserUnavailableError(
            f"no Chromium at {path}: install Debian's chromium "
            "(`apt-get install --no-install-recommends chromium`, which `make setup` does)"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class BrowserSession:
    """One browser and its tabs, driven by the 13 tools (`call`). Use ``async with``."""

    def __init__(self, config: BrowserConfig | None = None) -> None:
        self.config = config or BrowserConfig()
        self._lock = asyncio.Lock()
        self._playwright: Playwright | None = None
        self._context: BrowserContext | None = None
        self._profile: Path | None = None
        self._tabs: list[Page] = []
        self._active = 0
        self._alive = False
        self._events: list[str] = []
        self._dialogs: list[DialogRecord] = []
        self._crashed: set[Page] = set()
        self._popups: list[Page] = []
        self._popup_seen = asyncio.Event()
        self._opening_tab = False
        self._requests: dict[Request, float] = {}
        self._cdp: dict[Page, CDPSession] = {}
        self.launch_seconds = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> BrowserSession:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Starts Playwright and the browser with one blank tab."""
        _check_executable(self.config.executable_path)
        self._playwright = await async_playwright().start()
        try:
            await self._launch()
        except BaseException:
            await self.close()
            raise

    async def _launch(self) -> None:
        if self._playwright is None:
            raise RuntimeError("start() the session first")
        self._profile = Path(tempfile.mkdtemp(prefix="orchard-gui-profile-"))
        started = time.monotonic()
        try:
            context = await self._playwright.chromium.launch_persistent_context(
                self._profile,
                executable_path=self.config.executable_path,
                headless=True,
                args=[*OFFLINE_CHROMIUM_ARGS, *self.config.extra_args],
                chromium_sandbox=self.config.sandbox_on,
                viewport={
                    "width": self.config.viewport_width,
                    "height": self.config.viewport_height,
                },
                device_scale_factor=1,
                timeout=self.config.launch_timeout_s * 1000,
                handle_sigint=False,
                handle_sigterm=False,
                handle_sighup=False,
            )
        except PlaywrightError as exc:
            raise BrowserUnavailableError(
                f"Chromium at {self.config.executable_path} did not start: {_first_line(exc)}"
            ) from exc
        self.launch_seconds = time.monotonic() - started
        context.set_default_timeout(self.config.action_timeout_s * 1000)
        context.set_default_navigation_timeout(self.config.action_timeout_s * 1000)
        context.on("page", self._on_page)
        context.on("close", self._on_context_close)
        context.on("request", self._on_request)
        context.on("requestfinished", self._on_request_done)
        context.on("requestfailed", self._on_request_done)
        self._context = context
        self._tabs, self._active, self._alive = [], 0, True
        self._crashed.clear()
        self._popups.clear()
        self._requests.clear()
        self._cdp.clear()
        for page in context.pages:
            self._adopt(page)
        if not self._tabs:
            self._opening_tab = True
            try:
                self._adopt(await context.new_page())
            finally:
                self._opening_tab = False

    async def close(self) -> None:
        """Closes the browser and Playwright and removes the profile folder. Idempotent."""
        await self._shut_browser()
        if self._playwright is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._playwright.stop(), timeout=10)
            self._playwright = None

    async def _shut_browser(self) -> None:
        context, self._context = self._context, None
        self._alive = False
        if context is not None:
            with contextlib.suppress(TimeoutError, PlaywrightError):
                await asyncio.wait_for(context.close(), timeout=10)
        # A browser that ignored the close (stopped, wedged) is ours to kill: found by its
        # profile folder, which no other process names.
        for pid in self.browser_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None
        self._tabs = []

    async def relaunch(self) -> None:
        """Replaces the browser with a fresh one (one blank tab; earlier tabs are lost)."""
        async with self._lock:
            await self._relaunch()

    async def _relaunch(self) -> None:
        await self._shut_browser()
        if self._playwright is None:
            self._playwright = await async_playwright().start()
        await self._launch()

    # -- what tests, teachers and benchmarks look at -------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the browser process is running."""
        return self._alive and self.browser_pid() is not None

    @property
    def active_page(self) -> Page:
        """The active tab's Playwright page (for scripted teachers and checks, not agents)."""
        if not self._tabs:
            raise RuntimeError("the browser has no tabs (it is closed or has died)")
        return self._tabs[self._active]

    @property
    def viewport(self) -> tuple[int, int]:
        return (self.config.viewport_width, self.config.viewport_height)

    def browser_pids(self) -> list[int]:
        """Every process of this session's browser (Linux: found by its profile folder)."""
        if self._profile is None:
            return []
        marker = f"--user-data-dir={self._profile}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                pids.append(int(entry.name))
        return pids

    def browser_pid(self) -> int | None:
        """The main browser process (the one that is no renderer, GPU or utility process)."""
        for pid in self.browser_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"--type=" not in cmdline:
                return pid
        return None

    async def read_page_text(self) -> PageText:
        """The active tab as text (`PageText`; `PageText.render` bounds it), whatever the
        config says. For teachers and tests; an agent gets it in `Observation.page_text`."""
        return await asyncio.wait_for(
            read_page(self.active_page), timeout=self.config.page_text_timeout_s
        )

    async def locate(self, selector: str) -> tuple[float, float] | None:
        """Centre of the first element matching a CSS selector on the active tab, in viewport
        pixels, or None when there is none. For scripted teachers and tests; agents see only
        screenshots."""
        box = await self.active_page.locator(selector).first.bounding_box(
            timeout=self.config.action_timeout_s * 1000
        )
        if box is None:
            return None
        return (box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)

    # -- events from the browser ---------------------------------------------------------------

    def _adopt(self, page: Page) -> None:
        if page in self._tabs:
            return
        self._tabs.append(page)
        page.on("dialog", self._on_dialog)
        page.on("crash", self._on_crash)
        page.on("close", self._on_page_close)

    def _on_page(self, page: Page) -> None:
        if page in self._tabs:
            return
        self._adopt(page)
        if not self._opening_tab:
            self._popups.append(page)
            self._popup_seen.set()

    def _on_context_close(self, _context: BrowserContext) -> None:
        self._alive = False

    def _on_crash(self, page: Page) -> None:
        self._crashed.add(page)

    def _on_page_close(self, page: Page) -> None:
        self._cdp.pop(page, None)
        if page not in self._tabs:
            return
        index = self._tabs.index(page)
        self._tabs.remove(page)
        if self._alive and self._context is not None:
            self._events.append(f"tab {index} was closed")
        if index < self._active or self._active >= len(self._tabs):
            self._active = max(0, self._active - 1)

    def _on_request(self, request: Request) -> None:
        self._requests[request] = time.monotonic()

    def _on_request_done(self, request: Request) -> None:
        self._requests.pop(request, None)

    async def _on_dialog(self, dialog: Dialog) -> None:
        accept = self.config.dialog_answer == "accept"
        answer = "accepted" if accept else "dismissed"
        try:
            if not accept:
                await dialog.dismiss()
            elif dialog.type == "prompt":
                text = self.config.prompt_text or dialog.default_value
                await dialog.accept(text)
                answer = f"accepted with {text!r}"
            else:
                await dialog.accept()
        except PlaywrightError:
            answer = "left open (the page went away)"
        self._dialogs.append(DialogRecord(dialog.type, dialog.message, answer))
        self._events.append(f"the page opened a {dialog.type} dialog {dialog.message!r}: {answer}")

    # -- the tools -----------------------------------------------------------------------------

    async def call(self, tool: str, arguments: Mapping[str, Any] | None = None) -> Observation:
        """Runs one tool and returns the observation after it. Never raises for a bad call, a
        hung page, a dialog or a crash; raises only when the browser cannot be started again."""
        async with self._lock:
            started = time.monotonic()
            error: ErrorKind | None = None
            done, response = False, None
            try:
                args = validate_arguments(tool, arguments)
            except ToolArgumentError as exc:
                return await self._observe(tool, started, str(exc), "invalid_argument")
            if not self.alive:
                await self._relaunch()
                return await self._observe(
                    tool,
                    started,
                    f"{tool} was not run: the browser had exited; a fresh browser was started "
                    "with one blank tab (earlier tabs are gone)",
                    "browser_crashed",
                )
            await self._replace_crashed_tabs()
            self._note_background_popups()
            budget = self.config.action_timeout_s + self.config.settle_timeout_s + 2.0
            if tool == "wait":
                budget += float(args["seconds"])
            action_started = time.monotonic()
            try:
                message = await asyncio.wait_for(self._run(tool, args), timeout=budget)
                if tool == "done":
                    done, response = True, str(args["response"])
                else:
                    await asyncio.wait_for(self._settle(tool, action_started), timeout=budget)
            except ToolArgumentError as exc:
                message, error = str(exc), "invalid_argument"
            except (TimeoutError, PlaywrightTimeoutError):
                message, error = self._timeout_message(tool), "timeout"
                if tool in _NAVIGATIONS:
                    message = await self._stop_loading(message)
            except PlaywrightError as exc:
                message, error = await self._classify_failure(tool, exc)
            if error is None and self._crashed:
                message, error = await self._crash_message(tool), "page_crashed"
            return await self._observe(tool, started, message, error, done=done, response=response)

    async def observe(self) -> Observation:
        """The current state, without acting (the first observation of an episode)."""
        async with self._lock:
            started = time.monotonic()
            if not self.alive:
                await self._relaunch()
                return await self._observe(
                    "observe",
                    started,
                    "the browser had exited; a fresh browser was started with one blank tab",
                    "browser_crashed",
                )
            return await self._observe("observe", started, "the current page")

    def _timeout_message(self, tool: str) -> str:
        limit = self.config.action_timeout_s
        return (
            f"{tool} did not finish within {limit:g} s; the page may be hung or still loading. "
            "wait and look again, go_back, or goto_url another page"
        )

    async def _devtools(self, page: Page) -> CDPSession:
        session = self._cdp.get(page)
        if session is None:
            if self._context is None:
                raise RuntimeError("the browser is closed")
            session = await self._context.new_cdp_session(page)
            self._cdp[page] = session
        return session

    async def _stop_loading(self, message: str) -> str:
        """Stops a navigation that is not coming back, as a person would press Esc: the tab
        keeps showing (and answering on) the page it had."""
        try:
            session = await self._devtools(self.active_page)
            await asyncio.wait_for(session.send("Page.stopLoading"), timeout=2.0)
        except (TimeoutError, PlaywrightError):
            return message
        return f"{message} (loading was stopped; the tab shows the page it had)"

    async def _screenshot(self, page: Page) -> bytes:
        # DevTools' own capture: Playwright's screenshot waits for a pending navigation to
        # commit, so it never returns while a page does not answer.
        session = await self._devtools(page)
        shot = await session.send("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(shot["data"])

    async def _classify_failure(self, tool: str, exc: PlaywrightError) -> tuple[str, ErrorKind]:
        text = _first_line(exc)
        if "Unknown key" in text:
            key = text.partition("Unknown key:")[2].strip()
            return (
                f"press_keys: unknown key {key} (key names are like Enter, Tab, ArrowDown, "
                "PageDown, Escape, Control+a)",
                "invalid_argument",
            )
        if not self.alive:
            await self._relaunch()
            return (
                f"{tool} failed: the browser process died; a fresh browser was started with one "
                "blank tab (earlier tabs are gone)",
                "browser_crashed",
            )
        if self._crashed:
            return await self._crash_message(tool), "page_crashed"
        return f"{tool} failed: {text}", "action_failed"

    async def _crash_message(self, tool: str) -> str:
        indices = sorted(self._tabs.index(p) for p in self._crashed if p in self._tabs)
        await self._replace_crashed_tabs()
        tabs = ", ".join(str(i) for i in indices) or "?"
        return (
            f"{tool}: the page in tab {tabs} crashed; the tab now shows a blank page "
            "(goto_url to load a page again)"
        )

    async def _replace_crashed_tabs(self) -> None:
        """A crashed renderer takes no more commands: put a blank page in its tab's place."""
        if not self._crashed or self._context is None:
            return
        for page in list(self._crashed):
            if page not in self._tabs:
                continue
            index = self._tabs.index(page)
            self._opening_tab = True
            try:
                fresh = await self._context.new_page()
            finally:
                self._opening_tab = False
            self._tabs.remove(fresh)
            self._tabs[index] = fresh
            with contextlib.suppress(PlaywrightError):
                await asyncio.wait_for(page.close(), timeout=5)
        self._crashed.clear()
        with contextlib.suppress(PlaywrightError, TimeoutError):
            await asyncio.wait_for(self.active_page.bring_to_front(), timeout=5)

    def _check_point(
        self, tool: str, x: float, y: float, names: tuple[str, str] = ("x", "y")
    ) -> None:
        width, height = self.viewport
        if not x < width:
            raise ToolArgumentError(
                f"{tool}: {names[0]}={x:g} is outside the viewport (0 <= {names[0]} < {width})"
            )
        if not y < height:
            raise ToolArgumentError(
                f"{tool}: {names[1]}={y:g} is outside the viewport (0 <= {names[1]} < {height})"
            )

    async def _run(self, tool: str, args: dict[str, Any]) -> str:
        page = self.active_page
        ms = self.config.action_timeout_s * 1000
        if tool == "click":
            self._check_point(tool, args["x"], args["y"])
            await page.mouse.click(
                args["x"], args["y"], button=args["button"], click_count=args["clicks"]
            )
            times = {1: "", 2: " twice", 3: " three times"}[args["clicks"]]
            return f"clicked{times} at ({args['x']:g}, {args['y']:g})"
        if tool == "write":
            if "x" in args or "y" in args:
                if "x" not in args or "y" not in args:
                    raise ToolArgumentError("write: give both x and y, or neither")
                self._check_point(tool, args["x"], args["y"])
                await page.mouse.click(args["x"], args["y"])
            target = await self._focused_field(page)
            if args["clear"]:
                await page.keyboard.press("ControlOrMeta+a")
                await page.keyboard.press("Backspace")
            await page.keyboard.type(args["text"])
            if target is None:
                return (
                    f"typed {len(args['text'])} characters, but no text field had focus "
                    "(click a field first, or give x and y)"
                )
            return f"typed {len(args['text'])} characters into {target}"
        if tool == "press_keys":
            for key in args["keys"]:
                await page.keyboard.press(key)
            return f"pressed {', '.join(args['keys'])}"
        if tool == "scroll":
            width, height = self.viewport
            x = args.get("x", width / 2)
            y = args.get("y", height / 2)
            self._check_point(tool, x, y)
            amount = args["amount"]
            dx, dy = {
                "up": (0, -amount),
                "down": (0, amount),
                "left": (-amount, 0),
                "right": (amount, 0),
            }[args["direction"]]
            await page.mouse.move(x, y)
            await page.mouse.wheel(dx, dy)
            await asyncio.sleep(0.15)  # the wheel returns before the page has scrolled
            position = await page.evaluate(
                "() => [Math.round(scrollX), Math.round(scrollY),"
                " document.documentElement.scrollHeight]"
            )
            return (
                f"scrolled {args['direction']} {amount} px; the page is at "
                f"x={position[0]}, y={position[1]} of height {position[2]}"
            )
        if tool == "wait":
            seconds = min(float(args["seconds"]), MAX_WAIT_SECONDS)
            await asyncio.sleep(seconds)
            return f"waited {seconds:g} s"
        if tool == "drag":
            self._check_point(tool, args["from_x"], args["from_y"], ("from_x", "from_y"))
            self._check_point(tool, args["to_x"], args["to_y"], ("to_x", "to_y"))
            await page.mouse.move(args["from_x"], args["from_y"])
            await page.mouse.down()
            await page.mouse.move(args["to_x"], args["to_y"], steps=12)
            await page.mouse.up()
            return (
                f"dragged from ({args['from_x']:g}, {args['from_y']:g}) "
                f"to ({args['to_x']:g}, {args['to_y']:g})"
            )
        if tool == "hover":
            self._check_point(tool, args["x"], args["y"])
            await page.mouse.move(args["x"], args["y"])
            return f"moved the mouse to ({args['x']:g}, {args['y']:g})"
        if tool == "goto_url":
            url = _normalize_url(args["url"])
            await page.goto(url, wait_until="load", timeout=ms)
            return f"opened {page.url}"
        if tool == "go_back":
            before = page.url
            back = await page.go_back(wait_until="load", timeout=ms)
            if back is None and before == page.url:
                raise ToolArgumentError(
                    "go_back: this tab has no earlier page (goto_url or switch_tab instead)"
                )
            return f"went back to {page.url}"
        if tool == "new_tab":
            if len(self._tabs) >= self.config.max_tabs:
                raise ToolArgumentError(
                    f"new_tab: {self.config.max_tabs} tabs are open, the most allowed; "
                    "close_tab one first"
                )
            target = _normalize_url(args["url"]) if args.get("url") else None
            if self._context is None:
                raise RuntimeError("the browser is closed")
            self._opening_tab = True
            try:
                fresh = await self._context.new_page()
            finally:
                self._opening_tab = False
            self._adopt(fresh)
            self._active = self._tabs.index(fresh)
            await fresh.bring_to_front()
            if target is not None:
                await fresh.goto(target, wait_until="load", timeout=ms)
                return f"opened tab {self._active} at {fresh.url}"
            return f"opened blank tab {self._active}"
        if tool == "switch_tab":
            index = self._check_tab(tool, args["index"])
            self._active = index
            await self._tabs[index].bring_to_front()
            return f"switched to tab {index}"
        if tool == "close_tab":
            index = self._check_tab(tool, args.get("index", self._active))
            if len(self._tabs) == 1:
                raise ToolArgumentError(
                    "close_tab: this is the only tab and cannot be closed (goto_url instead)"
                )
            page = self._tabs[index]
            self._tabs.remove(page)
            if index < self._active or self._active >= len(self._tabs):
                self._active = max(0, self._active - 1)
            await page.close()
            await self.active_page.bring_to_front()
            return f"closed tab {index}; tab {self._active} is active"
        if tool == "done":
            return "done: the episode's answer is recorded"
        raise ToolArgumentError(f"no tool {tool!r}")  # unreachable: validated before

    def _check_tab(self, tool: str, index: int) -> int:
        if not 0 <= index < len(self._tabs):
            raise ToolArgumentError(
                f"{tool}: there is no tab {index}; the tabs are 0 to {len(self._tabs) - 1}"
            )
        return index

    async def _focused_field(self, page: Page) -> str | None:
        description: str | None = await page.evaluate(
            """() => {
              const e = document.activeElement;
              if (!e || e === document.body) return null;
              const editable = e.isContentEditable ||
                (e.tagName === 'TEXTAREA') ||
                (e.tagName === 'INPUT' && !['button','submit','checkbox','radio','reset',
                  'file','image','range','color'].includes(e.type));
              if (!editable) return null;
              const name = e.getAttribute('aria-label') || e.name || e.id || e.placeholder || '';
              return e.tagName.toLowerCase() + (name ? ` "${name}"` : '');
            }"""
        )
        return description

    async def _settle(self, tool: str, since: float) -> None:
        """Waits (a bounded time) for what the action started: a popup, a navigation, the
        requests sent after the action began. Requests older than the action (a page that never
        answers) are not waited for."""
        deadline = time.monotonic() + self.config.settle_timeout_s
        # A click or key can open a tab; Chromium announces it a little after the input.
        floor = 0.25 if tool in _MAY_OPEN_TABS else 0.05
        if not self._popups:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._popup_seen.wait(), timeout=floor)
        await self._activate_popups()
        if not self._tabs:
            return
        page = self.active_page
        still_loading = (
            f"the page was still loading {self.config.settle_timeout_s:g} s after the action"
        )
        try:
            remaining = max(0.05, deadline - time.monotonic())
            await page.wait_for_load_state("load", timeout=remaining * 1000)
            while any(t >= since for t in self._requests.values()):
                if time.monotonic() >= deadline:
                    self._events.append(still_loading)
                    break
                await asyncio.sleep(0.03)
        except PlaywrightTimeoutError:
            self._events.append(still_loading)
        except PlaywrightError:
            pass  # the page went away; the observation shows what is left
        await self._activate_popups()

    async def _activate_popups(self) -> None:
        """Tabs the page opened during the action become active, as in a desktop browser."""
        popups = [p for p in self._popups if p in self._tabs]
        self._popups.clear()
        self._popup_seen.clear()
        if not popups:
            return
        self._active = self._tabs.index(popups[-1])
        self._events.append(f"the page opened a new tab {self._active}; it is now active")
        with contextlib.suppress(PlaywrightError):
            await popups[-1].bring_to_front()

    def _note_background_popups(self) -> None:
        """Tabs a page opened between calls (a timer, a late script) stay in the background:
        the agent chose its action looking at the active tab."""
        for page in self._popups:
            if page in self._tabs:
                index = self._tabs.index(page)
                self._events.append(
                    f"the page opened tab {index} in the background (switch_tab {index} to see it)"
                )
        self._popups.clear()
        self._popup_seen.clear()

    async def _observe(
        self,
        tool: str,
        started: float,
        message: str,
        error: ErrorKind | None = None,
        *,
        done: bool = False,
        response: str | None = None,
    ) -> Observation:
        self._note_background_popups()
        tabs: list[TabInfo] = []
        screenshot: bytes | None = None
        page_text: str | None = None
        if self._alive and self._tabs:
            for index, page in enumerate(self._tabs):
                try:
                    title = await asyncio.wait_for(page.title(), timeout=1.0)
                except (TimeoutError, PlaywrightError):
                    title = ""
                tabs.append(TabInfo(index, page.url, title, index == self._active))
            try:
                screenshot = await asyncio.wait_for(
                    self._screenshot(self.active_page),
                    timeout=self.config.screenshot_timeout_s,
                )
            except (TimeoutError, PlaywrightError):
                self._events.append(
                    "no screenshot: the page did not paint in "
                    f"{self.config.screenshot_timeout_s:g} s (it may be busy or hung)"
                )
            # A page that did not paint will not run the reading script either.
            if self.config.page_text and screenshot is not None:
                page_text = await self._page_text()
        events, self._events = tuple(self._events), []
        dialogs, self._dialogs = tuple(self._dialogs), []
        return Observation(
            tool=tool,
            ok=error is None,
            message=message,
            screenshot=screenshot,
            viewport=self.viewport,
            tabs=tuple(tabs),
            error=error,
            events=events,
            dialogs=dialogs,
            done=done,
            response=response,
            elapsed_s=time.monotonic() - started,
            page_text=page_text,
        )

    async def _page_text(self) -> str | None:
        try:
            snapshot = await asyncio.wait_for(
                read_page(self.active_page), timeout=self.config.page_text_timeout_s
            )
        except (TimeoutError, PlaywrightError) as exc:
            reason = (
                "it did not answer in time"
                if isinstance(exc, TimeoutError)
                else "it was navigating"
            )
            self._events.append(f"no page text: {reason} (look again)")
            return None
        return snapshot.render(self.config.page_text_max_chars)

    # -- one method per tool, for Python callers ----------------------------------------------

    async def click(self, x: float, y: float, button: str = "left", clicks: int = 1) -> Observation:
        return await self.call("click", {"x": x, "y": y, "button": button, "clicks": clicks})

    async def write(
        self, text: str, x: float | None = None, y: float | None = None, clear: bool = False
    ) -> Observation:
        args: dict[str, Any] = {"text": text, "clear": clear}
        if x is not None:
            args["x"] = x
        if y is not None:
            args["y"] = y
        return await self.call("write", args)

    async def press_keys(self, *keys: str) -> Observation:
        return await self.call("press_keys", {"keys": list(keys)})

    async def scroll(
        self, direction: str, amount: int = 600, x: float | None = None, y: float | None = None
    ) -> Observation:
        args: dict[str, Any] = {"direction": direction, "amount": amount}
        if x is not None:
            args["x"] = x
        if y is not None:
            args["y"] = y
        return await self.call("scroll", args)

    async def wait(self, seconds: float = 1.0) -> Observation:
        return await self.call("wait", {"seconds": seconds})

    async def drag(self, from_x: float, from_y: float, to_x: float, to_y: float) -> Observation:
        return await self.call(
            "drag", {"from_x": from_x, "from_y": from_y, "to_x": to_x, "to_y": to_y}
        )

    async def hover(self, x: float, y: float) -> Observation:
        return await self.call("hover", {"x": x, "y": y})

    async def goto_url(self, url: str) -> Observation:
        return await self.call("goto_url", {"url": url})

    async def go_back(self) -> Observation:
        return await self.call("go_back", {})

    async def new_tab(self, url: str | None = None) -> Observation:
        return await self.call("new_tab", {} if url is None else {"url": url})

    async def switch_tab(self, index: int) -> Observation:
        return await self.call("switch_tab", {"index": index})

    async def close_tab(self, index: int | None = None) -> Observation:
        return await self.call("close_tab", {} if index is None else {"index": index})

    async def done(self, response: str) -> Observation:
        return await self.call("done", {"response": response})
