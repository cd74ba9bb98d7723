"""The browser tool server as a folder a browser sandbox runs it from.

A browser sandbox's image holds Chromium and this folder (:data:`IMAGE_BROWSER_DIR` in the
image the charts use; locally, where ``make gui-browser`` builds it, which the ``host`` image
shows read-only at the same path)::

    bin/orchard-browser   the launcher: the image's python3 with lib/ and site/ on its path
    bin/orchard-browser-call  one JSON call to a running server's Unix socket (standard
                          library only: ``python3 -S`` starts it in a few milliseconds)
    bin/orchard-sites     the offline websites' server (``python -m orchard.tasks.gui.sites``;
                          standard library only), for a site sandbox of the same image
    lib/orchard/tasks/gui the GUI package (this one)
    site/                 playwright, mcp and what they need, from this environment
    python-version        the Python minor version site/ was built for

``orchard-browser`` takes the arguments of ``python -m orchard.tasks.gui.browser_server``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from orchard.tasks.bundling import PYTHON_VERSION, distribution_files, requirement_closure

__all__ = ["CALLER", "IMAGE_BROWSER_DIR", "LAUNCHER", "SITES", "build_browser_dir", "main"]

IMAGE_BROWSER_DIR = "/opt/orchard-browser"
LAUNCHER = "bin/orchard-browser"
CALLER = "bin/orchard-browser-call"
SITES = "bin/orchard-sites"
_GUI = Path(__file__).parent
_STAMP = "python-version"

_LAUNCHER = '''#!/usr/bin/env python3
"""The GUI browser tool server: `orchard-browser --help`."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
with open(os.path.join(ROOT, "python-version")) as stamp:
    BUILT_FOR = tuple(int(part) for part in stamp.read().split("."))
if tuple(sys.version_info[:2]) != BUILT_FOR:
    sys.exit("orchard-browser: its packages were built for Python %d.%d, this is %d.%d"
             % (BUILT_FOR + tuple(sys.version_info[:2])))
sys.path[:0] = [os.path.join(ROOT, "lib"), os.path.join(ROOT, "site")]
from orchard.tasks.gui.browser_server import main

sys.exit(main(sys.argv[1:]))
'''


_CALLER = '''#!/usr/bin/env python3
"""orchard-browser-call SOCKET TOOL [ARGUMENTS_JSON]: one call to the browser tool server on its
Unix socket; prints the observation (JSON). Exit 0 whenever the server answered (a failed
action is an observation with "ok": false), 2 when it did not (dead, or no such socket)."""
import http.client
import json
import socket
import sys


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit("usage: orchard-browser-call SOCKET TOOL [ARGUMENTS_JSON]")
    try:
        arguments = json.loads(argv[2]) if len(argv) == 3 else {}
    except ValueError as exc:
        print("orchard-browser-call: ARGUMENTS_JSON is not JSON: %s" % exc, file=sys.stderr)
        return 2
    body = json.dumps({"tool": argv[1], "arguments": arguments})
    connection = UnixConnection(argv[0], timeout=120)
    try:
        connection.request("POST", "/call", body.encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    except OSError as exc:
        print("orchard-browser-call: the browser tool server did not answer: %s" % exc,
              file=sys.stderr)
        return 2
    sys.stdout.buffer.write(data)
    return 0 if response.status == 200 else 2


sys.exit(main(sys.argv[1:]))
'''


_SITES = '''#!/usr/bin/env python3
"""The offline websites: `orchard-sites --help`."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "lib"))
from orchard.tasks.gui.sites.server import main

sys.exit(main(sys.argv[1:]))
'''


def build_browser_dir(target: Path) -> Path:
    """Lay the folder out at ``target`` (replacing what is there); returns the launcher.

    Built next to ``target`` and renamed into place, so a reader never sees half of it."""
    target = target.absolute()
    staging = target.with_name(f".{target.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    closure = requirement_closure(["playwright", "mcp"], install_hint="orchard-tasks[gui,claw]")
    for name, source, mode in distribution_files(closure):
        _copy(source, staging / "site" / name, mode)
    for source in sorted(_GUI.rglob("*.py")):
        relative = source.relative_to(_GUI)
        _copy(source, staging / "lib" / "orchard" / "tasks" / "gui" / relative, 0o644)
    (staging / _STAMP).write_text(f"{PYTHON_VERSION}\n")
    for name, text in ((LAUNCHER, _LAUNCHER), (CALLER, _CALLER), (SITES, _SITES)):
        script = staging / name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        script.chmod(0o755)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target / LAUNCHER


def _copy(source: Path, destination: Path, mode: int) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)
    os.chmod(destination, mode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchard.tasks.gui.browser_dir",
        description="Build the folder a browser sandbox runs the browser tool server from.",
    )
    parser.add_argument("target", type=Path, help="the folder to build (replaced whole)")
    args = parser.parse_args(argv)
    launcher = build_browser_dir(args.target)
    print(f"browser tool server: {launcher}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
