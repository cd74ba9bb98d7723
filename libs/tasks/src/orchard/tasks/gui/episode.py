"""A browser episode's two sandboxes, through the environment service.

- **The site sandbox** serves the offline websites with one task's world (``orchard-sites`` of
  the browser folder, see `orchard.tasks.gui.browser_dir`), on a port it accepts peers on
  (``ingress_ports``). Its state endpoint needs a token that exists only inside it: a check
  reads the state from there, and nothing the browser does can read or reset it.
- **The browser sandbox** runs the browser tool server as an unprivileged user, with Chromium's
  own sandbox on when the sandbox may create user namespaces (the operator's
  ``privileges.user_namespaces``), on a Unix socket no web page can reach. It may reach the
  site's port, and nothing else, until the episode's deadline (``EgressRule.to_sandbox``): the
  default-deny egress stays on for everything else.

Each tool call is one exec of ``orchard-browser-call`` in the browser sandbox; its answer is
the observation. A browser server that died is `BrowserUnavailable`, never a hung call.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchard.sdk import AsyncSandbox, AsyncSandboxClient, EgressRule
from orchard.tasks.gui.browser_dir import CALLER, LAUNCHER, SITES
from orchard.tasks.gui.observation import Observation

__all__ = [
    "DEFAULT_SITE_PORT",
    "BrowserEpisode",
    "BrowserSandboxSettings",
    "BrowserUnavailable",
    "SiteStateUnreadable",
    "read_site_state",
]

DEFAULT_SITE_PORT = 8080
_RUN = "/run/orchard-gui"  # the servers' folder in each sandbox
_SOCKET = f"{_RUN}/browser.sock"
_TOKEN = f"{_RUN}/state-token"
_WORLDS = f"{_RUN}/worlds.json"
# Waits inside a sandbox, right after starting a server in the background, for a file or a
# listening port, so starting costs one exec; a server that exits ends the wait at once.
_WAIT_FOR_FILE = (
    "pid=$!; for i in $(seq {tries}); do [ -e {path} ] && exit 0; "
    "kill -0 $pid 2>/dev/null || exit 3; sleep 0.05; done; exit 1"
)
_WAIT_FOR_PORT = (
    "pid=$!; for i in $(seq {tries}); do python3 -S -c 'import socket; "
    'socket.create_connection(("127.0.0.1", {port}), 1)\' 2>/dev/null && exit 0; '
    "kill -0 $pid 2>/dev/null || exit 3; sleep 0.05; done; exit 1"
)
_READ_STATE = """
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1])
request.add_header("Authorization", "Bearer " + open(sys.argv[2]).read().strip())
sys.stdout.write(urllib.request.urlopen(request, timeout=10).read().decode())
"""


class SiteStateUnreadable(RuntimeError):
    """The site sandbox did not give its server-side state (the server is gone, or answered
    something else); the message says what the sandbox reported."""


class BrowserUnavailable(Exception):
    """The browser tool server did not answer (it died, or never started); the message says
    what the sandbox reported."""


@dataclass(frozen=True)
class BrowserSandboxSettings:
    """How browser episodes are made; the defaults suit the ``host`` image of the local
    runtime with ``make gui-browser``'s folder at ``browser_dir``."""

    browser_dir: str
    """Where the image holds the browser folder (`orchard.tasks.gui.browser_dir`)."""
    image: str = "host"
    site_image: str = ""
    """The site sandbox's image; empty: the browser's (it needs python3 and the folder)."""
    site_port: int = DEFAULT_SITE_PORT
    chromium: str = "/usr/bin/chromium"
    browser_user: int | None = 65534
    """The uid (and gid) the browser runs as; None keeps root, where Chromium's sandbox is off."""
    chromium_sandbox: bool = True
    """Chromium's own sandbox: asks the browser sandbox for user namespaces."""
    viewport: tuple[int, int] = (1280, 800)
    action_timeout_s: float = 15.0
    """How long one action (a page load, a click) may take before it is a timeout."""
    heartbeat_timeout_s: float = 120.0
    start_tries: int = 600
    """How many 50 ms waits a server gets to start (about 30 s and the probes' own time)."""
    call_timeout_s: float = 120.0
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.browser_dir.startswith("/"):
            raise ValueError(
                f"browser_dir {self.browser_dir!r} must be absolute (a path in the image)"
            )
        if not 1 <= self.site_port <= 65535:
            raise ValueError(f"site_port {self.site_port} is not a port")


@dataclass
class BrowserEpisode:
    """The two sandboxes of one episode; `open` makes them, `close` deletes both."""

    settings: BrowserSandboxSettings
    site: AsyncSandbox
    browser: AsyncSandbox
    base_url: str
    """The site server's root URL as the browser reaches it (each site under ``/<name>/``)."""
    deadline: float
    """When the browser's allowance to reach the site ends (Unix time)."""

    @classmethod
    async def open(
        cls,
        client: AsyncSandboxClient,
        settings: BrowserSandboxSettings,
        *,
        sites: Sequence[str],
        worlds: Mapping[str, Any] | None = None,
        seed: int = 0,
        lifetime_s: float = 600.0,
        owner_id: str = "",
    ) -> BrowserEpisode:
        """Start the site (serving ``sites``, seeded with ``worlds`` by site, else from
        ``seed``) and the browser, allowed to reach it for ``lifetime_s`` seconds.

        Raises the SDK's errors (e.g. ``PermissionDenied`` when the operator does not allow
        user namespaces and ``chromium_sandbox`` asks for them) and `BrowserUnavailable` when a
        server does not start; nothing is left behind either way."""
        site = await client.create(
            settings.site_image or settings.image,
            ingress_ports=[settings.site_port],
            heartbeat_timeout=settings.heartbeat_timeout_s,
            labels=dict(settings.labels),
            owner_id=owner_id,
        )
        browser: AsyncSandbox | None = None
        try:
            await _start_site(site, settings, sites, worlds or {}, seed)
            deadline = time.time() + lifetime_s
            rule = EgressRule.to_sandbox(site.id, settings.site_port, expire_at=deadline)
            browser = await client.create(
                settings.image,
                egress=[rule],
                user_namespaces=settings.chromium_sandbox,
                heartbeat_timeout=settings.heartbeat_timeout_s,
                labels=dict(settings.labels),
                owner_id=owner_id,
            )
            await _start_browser(browser, settings)
            address = site.info.network_address
            episode = cls(
                settings, site, browser, f"http://{address}:{settings.site_port}", deadline
            )
            # The server answers once Chromium runs: an episode is open when it can act.
            await episode.call("wait", {"seconds": 0})
        except BaseException:
            for made in (browser, site):
                if made is not None:
                    await made.delete()
            raise
        return episode

    async def call(self, tool: str, arguments: Mapping[str, Any] | None = None) -> Observation:
        """Run one tool; its observation (a refused or failed action is one too)."""
        command = [
            "python3",
            "-S",
            f"{self.settings.browser_dir}/{CALLER}",
            _SOCKET,
            tool,
            json.dumps(dict(arguments or {})),
        ]
        result = await self.browser.exec(command, timeout=self.settings.call_timeout_s)
        if result.exit_code != 0 or result.timed_out:
            raise BrowserUnavailable(
                f"browser sandbox {self.browser.id}: {tool} got no observation ("
                + ("timed out" if result.timed_out else f"exit {result.exit_code}")
                + f"): {result.stderr.decode(errors='replace').strip()[-500:]}"
                + await _log_tail(self.browser)
            )
        try:
            return Observation.from_dict(json.loads(result.stdout))
        except (KeyError, ValueError, TypeError) as exc:
            raise BrowserUnavailable(
                f"browser sandbox {self.browser.id}: {tool} answered something that is not an "
                f"observation ({exc})"
            ) from None

    async def site_state(self, site: str) -> dict[str, Any]:
        """One site's server-side state, read inside the site sandbox."""
        return await read_site_state(self.site, site, self.settings.site_port)

    async def close(self) -> None:
        """Delete both sandboxes (idempotent); the site is deleted even when deleting the
        browser fails (that failure is raised after)."""
        try:
            await self.browser.delete()
        finally:
            await self.site.delete()

    async def __aenter__(self) -> BrowserEpisode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _start_site(
    site: AsyncSandbox,
    settings: BrowserSandboxSettings,
    sites: Sequence[str],
    worlds: Mapping[str, Any],
    seed: int,
) -> None:
    await site.exec(f"mkdir -p -m 700 {_RUN}", check=True)
    await site.write_file(_TOKEN, secrets.token_urlsafe(24), mode=0o600)
    await site.write_file(_WORLDS, json.dumps(dict(worlds)), mode=0o600)
    serve = shlex.join(
        [
            "python3",
            f"{settings.browser_dir}/{SITES}",
            "--listen",
            f"0.0.0.0:{settings.site_port}",
            "--sites",
            ",".join(sites),
            "--seed",
            str(seed),
            "--state-token-file",
            _TOKEN,
            "--worlds-file",
            _WORLDS,
        ]
    )
    started = await site.exec(
        f"setsid {serve} </dev/null >{_RUN}/sites.log 2>&1 &\n"
        + _WAIT_FOR_PORT.format(tries=settings.start_tries, port=settings.site_port),
        timeout=settings.start_tries * 0.2 + 30,
    )
    if started.exit_code != 0:
        log = await site.exec(f"tail -c 2000 {_RUN}/sites.log")
        raise BrowserUnavailable(
            f"site sandbox {site.id}: the site server {_how(started.exit_code)}: "
            + log.stdout.decode(errors="replace").strip()
        )


async def _start_browser(browser: AsyncSandbox, settings: BrowserSandboxSettings) -> None:
    user = settings.browser_user
    width, height = settings.viewport
    serve = [
        f"{settings.browser_dir}/{LAUNCHER}",
        "--listen",
        f"unix:{_SOCKET}",
        "--chromium",
        settings.chromium,
        "--width",
        str(width),
        "--height",
        str(height),
        "--action-timeout",
        str(settings.action_timeout_s),
        "--chromium-sandbox",
        "on" if settings.chromium_sandbox and user is not None else "off",
    ]
    prefix = ""
    if user is not None:
        # An unprivileged user with a home of its own; the socket folder is its.
        prefix = (
            f"setpriv --reuid={user} --regid={user} --clear-groups "
            f"env HOME={_RUN}/home XDG_CONFIG_HOME={_RUN}/home "
        )
    chown = f" && chown -R {user}:{user} {_RUN}" if user is not None else ""
    started = await browser.exec(
        f"mkdir -p -m 700 {_RUN}/home{chown}\n"
        f"setsid {prefix}python3 {shlex.join(serve)} </dev/null >{_RUN}/browser.log 2>&1 &\n"
        + _WAIT_FOR_FILE.format(tries=settings.start_tries, path=_SOCKET),
        timeout=settings.start_tries * 0.1 + 30,
    )
    if started.exit_code != 0:
        raise BrowserUnavailable(
            f"browser sandbox {browser.id}: the browser tool server {_how(started.exit_code)}"
            + await _log_tail(browser)
        )


async def read_site_state(
    sandbox: AsyncSandbox, site: str, port: int = DEFAULT_SITE_PORT
) -> dict[str, Any]:
    """One site's server-side state, read inside the episode's site ``sandbox`` (served on
    ``port`` there); `SiteStateUnreadable` when the server does not answer with an object."""
    url = f"http://127.0.0.1:{port}/_orchard/state/{site}"
    result = await sandbox.exec(["python3", "-S", "-c", _READ_STATE, url, _TOKEN], timeout=30)
    if result.exit_code != 0:
        raise SiteStateUnreadable(
            f"site sandbox {sandbox.id}: reading {site}'s state failed: "
            f"{result.stderr.decode(errors='replace').strip()[-500:]}"
        )
    try:
        state = json.loads(result.stdout)
    except ValueError:
        state = None
    if not isinstance(state, dict):
        raise SiteStateUnreadable(f"site sandbox {sandbox.id}: {site}'s state is not an object")
    return state


def _how(code: int | None) -> str:
    """What a start's wait loop (`_WAIT_FOR_FILE`, `_WAIT_FOR_PORT`) ended with."""
    return "exited at start" if code == 3 else "did not start in time"


async def _log_tail(browser: AsyncSandbox) -> str:
    log = await browser.exec(f"tail -c 1500 {_RUN}/browser.log")
    text = log.stdout.decode(errors="replace").strip()
    return f"; its log: {text}" if text else ""
