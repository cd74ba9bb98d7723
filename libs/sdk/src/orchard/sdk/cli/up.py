"""``orchard up`` and ``orchard down``: Orchard's services on this machine.

``orchard up`` starts, in order, an embedded etcd (data kept under the state dir, so sandbox
records survive a restart), ``orchard-env`` with the local runtime, ``orchard-reward``,
``orchard-rollout`` and ``orchard-trainer serve`` (``--without NAME`` leaves one out), as child
processes. It
generates a local tenant and token once (kept in the profile), writes the profile the SDK and
the command line read by default, prints what runs where, and stays in the foreground until
Ctrl-C or SIGTERM; then it stops what it started, in reverse order. ``--detach`` runs the same
in the background and returns once it serves; ``orchard down`` stops it.

GUI tasks: when a browser folder is there (``--gui-browser DIR``, else
``$ORCHARD_GUI_BROWSER_DIR``, else ``.cache/gui-browser`` of the checkout this orchard-sdk runs
from, where ``make gui-browser`` builds it) and this host has Chromium, orchard-rollout runs
browser episodes from it (``gui.browser_dir``: the ``host`` image shows the folder at its own
path) and the local tenant may give sandboxes user namespaces (Chromium's own sandbox). ``--gui``
insists, saying what is missing; ``--no-gui`` leaves them off.

Everything lives under the state dir (``$ORCHARD_STATE_DIR``, else ``$XDG_STATE_HOME/orchard``,
else ``~/.local/state/orchard``)::

    profile.json     endpoint and token (mode 0600)
    up.json          pid of the running ``orchard up``, its components and the artifact
                     store's URL
    env.yaml         the configuration orchard-env runs with (token digests only)
    reward.yaml      the configuration orchard-reward runs with (the env token comes from
                     its environment, never the file); rollout.yaml and trainer.yaml likewise
    artifacts/       the artifact store (file://): models and datasets recipes hand over,
                     checkpoints and weights orchard-trainer saves and publishes
    trainer-scratch/ orchard-trainer's own working folder (checkpoints being written)
    etcd/            etcd's data
    logs/            env.log, reward.log, up.log (detached runs)
    runtime/         the local runtime's per-sandbox state and writable layers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchard.sdk.cli.output import print_json, print_table
from orchard.sdk.cli.sandbox import UsageError
from orchard.sdk.cli.stack import (
    SERVICES,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TENANT,
    LocalStack,
    StackError,
    tail,
)
from orchard.sdk.connection import Profile, default_profile_path, read_profile, write_profile
from orchard.sdk.connection import state_dir as default_state_dir
from orchard.sdk.errors import OrchardSDKError

__all__ = ["add_up_commands"]

DEFAULT_LISTEN = "127.0.0.1:7100"
DEFAULT_SERVICE_LISTEN = {
    "reward": "127.0.0.1:7200",
    "rollout": "127.0.0.1:7300",
    "trainer": "127.0.0.1:7400",
}
"""Where the services beside orchard-env listen (the ports the charts use)."""

BROWSER_LAUNCHER = "bin/orchard-browser"
"""What makes a folder a browser folder (orchard.tasks.gui.browser_dir.LAUNCHER)."""
CHROMIUM = Path("/usr/bin/chromium")
"""The Chromium orchard-rollout's browser sandboxes start (gui.chromium) in the host image."""
BROWSER_HARNESSES = ("builtin:browser", "builtin:browser-text")


def _checkout_browser_folder() -> Path | None:
    """Where `make gui-browser` builds the folder in the checkout this orchard-sdk runs from
    (an editable install); None for an installed one."""
    here = Path(__file__).resolve()
    inside = Path("libs/sdk/src/orchard/sdk/cli/up.py")
    if len(here.parents) < len(inside.parts):
        return None
    root = here.parents[len(inside.parts) - 1]
    return root / ".cache" / "gui-browser" if here.relative_to(root) == inside else None


class UpError(OrchardSDKError):
    """``orchard up`` could not start something; the message says what and where its log is."""


@dataclass
class Component:
    """One process ``orchard up`` runs."""

    name: str
    address: str
    pid: int
    log: str


def add_up_commands(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> None:
    up = subparsers.add_parser(
        "up",
        help="run Orchard on this machine (etcd, orchard-env with the local runtime, reward)",
        description=(
            "Start an embedded etcd, the environment service with the local runtime, and the "
            "reward, rollout and trainer services, write the profile the SDK and this command "
            "line use by default, "
            "and stay in the foreground until Ctrl-C (then stop them in reverse order). The "
            "local runtime needs root."
        ),
        epilog=(
            "examples:\n  orchard up\n  orchard up --detach && orchard sandbox create\n"
            "  orchard up --without reward --without rollout --without trainer\n"
            "                                    # etcd and the environment service only\n"
            "  make gui-browser && orchard up    # with the browser harnesses for GUI tasks\n"
            "\n"
            "GUI tasks: with a browser folder (--gui-browser DIR, else $ORCHARD_GUI_BROWSER_DIR,\n"
            "else .cache/gui-browser of this checkout, which `make gui-browser` builds) and\n"
            "Chromium (/usr/bin/chromium), orchard-rollout offers builtin:browser and\n"
            "builtin:browser-text, and the local tenant may give sandboxes user namespaces\n"
            "(Chromium's own sandbox). --gui insists and says what is missing; --no-gui: off."
        ),
        formatter_class=formatter,
    )
    up.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"address of the environment service (default: {DEFAULT_LISTEN})",
    )
    for name, address in DEFAULT_SERVICE_LISTEN.items():
        up.add_argument(
            f"--{name}-listen",
            default=address,
            metavar="ADDRESS",
            help=f"address of orchard-{name} (default: {address})",
        )
    up.add_argument(
        "--without",
        action="append",
        default=[],
        choices=sorted(SERVICES),
        help="do not start this service (repeatable)",
    )
    up.add_argument("--state-dir", type=Path, help="where state, logs and the profile live")
    up.add_argument(
        "--detach", action="store_true", help="run in the background; stop with `orchard down`"
    )
    up.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra orchard-env setting, e.g. limits.default_heartbeat_timeout_s=600",
    )
    up.add_argument(
        "--gui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="browser harnesses in orchard-rollout for GUI tasks; default: on when a browser "
        "folder and Chromium are there; --gui fails saying what is missing",
    )
    up.add_argument(
        "--gui-browser",
        type=Path,
        metavar="DIR",
        help="the browser folder (default: $ORCHARD_GUI_BROWSER_DIR, else the checkout's "
        ".cache/gui-browser, which `make gui-browser` builds)",
    )
    up.add_argument("--json", action="store_true", help="print the components as JSON")
    up.set_defaults(run=_up)

    down = subparsers.add_parser(
        "down",
        help="stop what `orchard up --detach` started",
        description="Stop the environment service and etcd that `orchard up` runs.",
        epilog="example:\n  orchard down",
        formatter_class=formatter,
    )
    down.add_argument("--state-dir", type=Path, help="as given to `orchard up`")
    down.set_defaults(run=_down)


# -- up -----------------------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    state = (args.state_dir or default_state_dir()).resolve()
    running = _running(state)
    if running is not None:
        raise UpError(
            f"orchard up is already running here (pid {running['pid']}); "
            "stop it with `orchard down` or Ctrl-C in its terminal"
        )
    browser = _browser_folder(args, os.environ)
    if args.detach:
        return _detach(args, state, browser)
    stop = StopRequest()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return _run(args, state, stop, browser)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.close()


class StopRequest(threading.Event):
    """An Event that a signal handler may set: a flag and a byte to a pipe, never a lock.

    A Python signal handler runs in the main thread between two bytecodes, possibly while that
    thread holds the lock of a plain Event (inside ``wait``): ``set`` would then wait for it
    forever. Waiting here is a ``select`` on the pipe, which the byte ends at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._requested = False
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self._requested = True
        with contextlib.suppress(OSError):  # a full pipe (or a closed one) has woken it anyway
            os.write(self._wake_write, b"\0")

    def is_set(self) -> bool:
        return self._requested

    def clear(self) -> None:
        self._requested = False
        with contextlib.suppress(OSError):
            while os.read(self._wake_read, 512):  # BlockingIOError once empty
                pass

    def wait(self, timeout: float | None = None) -> bool:
        if not self._requested:
            with contextlib.suppress(OSError, ValueError):
                select.select([self._wake_read], [], [], timeout)
        return self._requested

    def close(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


def _browser_folder(args: argparse.Namespace, environ: Mapping[str, str]) -> Path | None:
    """The browser folder orchard-rollout runs GUI episodes from; None: no browser harness.

    A folder named (the flag, the variable) must be one; the checkout's is taken when there.
    Without Chromium the harnesses would fail every episode: off, saying so (``--gui``: an
    error)."""
    if args.gui is False:
        if args.gui_browser is not None:
            raise UsageError("--gui-browser and --no-gui contradict each other: give one")
        return None
    if "rollout" in args.without:
        if args.gui or args.gui_browser is not None:
            raise UsageError("the browser harnesses run in orchard-rollout: drop --without rollout")
        return None
    named = args.gui_browser or environ.get("ORCHARD_GUI_BROWSER_DIR")
    folder = Path(named).absolute() if named else _checkout_browser_folder()
    if folder is None or not (folder / BROWSER_LAUNCHER).is_file():
        build = (
            "`make gui-browser` in an Orchard checkout builds one (or `python -m "
            "orchard.tasks.gui.browser_dir DIR`, with orchard-tasks[gui,claw])"
        )
        if named:
            source = "--gui-browser" if args.gui_browser else "$ORCHARD_GUI_BROWSER_DIR"
            raise UpError(
                f"{source}: {folder} is not a browser folder (no {BROWSER_LAUNCHER}): {build}"
            )
        if args.gui and folder is not None:
            raise UpError(
                f"--gui: no browser folder at {folder}: run `make gui-browser` in the checkout "
                "(it builds that folder), or give --gui-browser DIR"
            )
        if args.gui:
            raise UpError(f"--gui: no browser folder: give --gui-browser DIR; {build}")
        return None
    if not CHROMIUM.exists():
        missing = f"no Chromium at {CHROMIUM} (apt-get install --no-install-recommends chromium)"
        if args.gui or named:
            raise UpError(f"the browser harnesses need Chromium: {missing}")
        sys.stderr.write(f"orchard: browser harnesses off: {missing}\n")
        return None
    return folder


def _run(args: argparse.Namespace, state: Path, stop: threading.Event, browser: Path | None) -> int:
    profile_path = _profile_path(args, state)
    profile = read_profile(profile_path)
    token = profile.token if profile is not None and profile.token else secrets.token_urlsafe(32)
    services = {
        name: getattr(args, f"{name}_listen")
        for name in DEFAULT_SERVICE_LISTEN
        if name not in args.without
    }
    settings, service_settings = list(args.set), {}
    if browser is not None:
        service_settings["rollout"] = {"gui": {"browser_dir": str(browser)}}
        # Chromium keeps its own sandbox as an unprivileged user: a user namespace. First, so
        # that a --set of the user's own wins.
        settings.insert(0, f"privileges.user_namespaces={json.dumps([TENANT])}")
    stack = LocalStack(
        state,
        listen=args.listen,
        token=token,
        settings=settings,
        stop_event=stop,
        services=services,
        service_settings=service_settings,
        host_masked_paths=[profile_path],  # it holds the token; it may live outside the state
    )
    run_file = state / "up.json"
    try:
        try:
            stack.start()
        except StackError as exc:
            raise UpError(str(exc)) from None
        write_profile(Profile(endpoint=args.listen, token=token, tenant=TENANT), profile_path)
        components = [Component("etcd", stack.etcd_endpoint, stack.etcd_pid, stack.etcd_log)]
        components += [
            Component(p.program, p.address, p.pid, str(p.log)) for p in stack.processes.values()
        ]
        run_file.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "components": [asdict(c) for c in components],
                    # where recipes put what they hand the services (StackEndpoints.artifacts)
                    "artifacts": stack.artifacts_url,
                    "gui": _gui(browser),
                }
            )
        )
        _show(components, profile_path, args.json, _gui(browser))
        while not stop.wait(0.5):
            exited = stack.exited()
            if exited is not None:
                sys.stderr.write(
                    f"orchard: {exited.program} exited with status {exited.returncode}; "
                    f"see {exited.log}\n{tail(exited.log)}\n"
                )
                return 1
        sys.stderr.write("orchard: stopping the services, then etcd\n")
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):
            run_file.unlink()
        stack.stop()


def _profile_path(args: argparse.Namespace, state: Path) -> Path:
    # An explicit --state-dir keeps its profile inside it; otherwise the default profile path.
    return state / "profile.json" if args.state_dir else default_profile_path()


def _gui(browser: Path | None) -> dict[str, Any] | None:
    """What ``orchard up`` says of the GUI domain (up.json, --json): None when it is off."""
    if browser is None:
        return None
    return {"harnesses": list(BROWSER_HARNESSES), "browser_dir": str(browser), "tenant": TENANT}


def _show(
    components: list[Component], profile: Path, as_json: bool, gui: dict[str, Any] | None
) -> None:
    if as_json:
        print_json(
            {"components": [asdict(c) for c in components], "profile": str(profile), "gui": gui}
        )
    else:
        print_table(
            ["component", "address", "pid", "log"],
            [[c.name, c.address, c.pid, c.log] for c in components],
        )
        print(f"\nprofile: {profile} (the SDK and `orchard sandbox ...` use it by default)")
        if gui is not None:
            print(
                f"gui:     {', '.join(gui['harnesses'])} (browser folder {gui['browser_dir']}; "
                f"tenant {gui['tenant']} may give sandboxes user namespaces, for Chromium)"
            )
        print("try:     orchard sandbox create --label demo=1")
        print("stop:    Ctrl-C" if sys.stdin.isatty() else "")
    sys.stdout.flush()


# -- detach and down ----------------------------------------------------------------------------


def _running(state: Path) -> dict[str, Any] | None:
    """The live ``orchard up`` of this state dir, or None (a stale up.json is removed)."""
    run_file = state / "up.json"
    try:
        running: dict[str, Any] = json.loads(run_file.read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(int(running["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError):
        run_file.unlink(missing_ok=True)
        return None
    except PermissionError:
        pass
    return running


def _detach(args: argparse.Namespace, state: Path, browser: Path | None) -> int:
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = logs / "up.log"
    command = [
        sys.executable,
        "-m",
        "orchard.sdk.cli",
        "up",
        "--listen",
        args.listen,
    ]
    if args.state_dir:
        command += ["--state-dir", str(state)]
    for setting in args.set:
        command += ["--set", setting]
    for name in DEFAULT_SERVICE_LISTEN:
        command += [f"--{name}-listen", getattr(args, f"{name}_listen")]
    for name in args.without:
        command += ["--without", name]
    # The folder found here, not one the child might find in its own way.
    command += ["--gui-browser", str(browser)] if browser is not None else ["--no-gui"]
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S + 15
    while (running := _running(state)) is None:
        if process.poll() is not None:
            raise UpError(f"orchard up exited with status {process.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            process.terminate()
            raise UpError(f"orchard up did not become ready; see {log}")
        time.sleep(0.1)
    components = [Component(**c) for c in running["components"]]
    components.append(Component("orchard up", "-", process.pid, str(log)))
    _show(components, _profile_path(args, state), args.json, running.get("gui"))
    return 0


def _down(args: argparse.Namespace) -> int:
    state = (args.state_dir or default_state_dir()).resolve()
    running = _running(state)
    if running is None:
        print("nothing to stop: orchard up is not running here")
        return 0
    pid = int(running["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S * 2
    while _alive(pid):
        if time.monotonic() > deadline:
            raise UpError(f"orchard up (pid {pid}) did not stop; it may need `kill -9 {pid}`")
        time.sleep(0.1)
    print(f"stopped orchard up (pid {pid})")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child of ours that exited but was not reaped yet counts as gone.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True
