"""How the Claw apps get into a sandbox.

Two archives, each unpacked at :data:`TOOLS_DIR` (``/opt/claw``):

- the tools (:func:`tools_archive`): ``lib/clawapps/`` (a copy of
  `orchard.tasks.claw.apps`, standard library only) and ``bin/`` with the command-line tools
  ``mail``, ``calendar``, ``contacts``, ``notes`` and ``docs`` and the MCP server ``claw-mcp``.
  The host's ``python3`` runs them; a task's setup links ``bin/`` into ``/usr/local/bin``.
- the MCP server's dependencies (:func:`mcp_archive`): ``site/``, the official ``mcp`` SDK and
  everything it needs, copied from the installed distributions of this Python environment
  (so it works offline and matches what the tests ran against). ``claw-mcp`` puts ``site/``
  on its import path. The packages include compiled extensions (pydantic-core, ...), so the
  sandbox's ``python3`` must have the minor version this environment has (3.11 for the
  ``host`` image here); ``claw-mcp`` refuses another version saying so.

The seed state travels in the task's setup command (:func:`seed_command`): a small gzip tar
archive, base64 in the command line, unpacked at :data:`STATE_DIR` (``/srv/claw``).
"""

from __future__ import annotations

import base64
import functools
import io
import shlex
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

from orchard.tasks.bundling import PYTHON_VERSION, distribution_files, requirement_closure
from orchard.tasks.claw.apps.ops import APPS

__all__ = [
    "MCP_COMMAND",
    "STATE_DIR",
    "TOOLS_DIR",
    "build_mcp_site",
    "install_tools",
    "link_command",
    "mcp_archive",
    "seed_command",
    "tools_archive",
    "tools_files",
]

TOOLS_DIR = "/opt/claw"
STATE_DIR = "/srv/claw"
MCP_COMMAND = f"{TOOLS_DIR}/bin/claw-mcp"
_APPS_DIR = Path(__file__).with_name("apps")
_PACKAGE = "clawapps"

_CLI = '''#!/usr/bin/env python3
"""The Claw {app} tool: `{app} --help` lists its commands."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "lib"))
from clawapps.cli import main

sys.exit(main("{app}", sys.argv[1:]))
'''

_MCP = '''#!/usr/bin/env python3
"""The Claw MCP server over stdio: `claw-mcp --help`."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
SITE = os.path.join(ROOT, "site")
BUILT_FOR = {version}
if not os.path.isdir(SITE):
    sys.exit("claw-mcp: its dependencies are missing: unpack the MCP archive "
             "(orchard.tasks.claw.bundle.mcp_archive) at " + ROOT)
if BUILT_FOR and tuple(sys.version_info[:2]) != BUILT_FOR:
    sys.exit("claw-mcp: its dependencies were built for Python %d.%d, this is %d.%d"
             % (BUILT_FOR + tuple(sys.version_info[:2])))
sys.path[:0] = [os.path.join(ROOT, "lib"), SITE]
from clawapps.mcp_server import main

sys.exit(main(sys.argv[1:]))
'''

_MCP_VERSION_FILE = "site/.python-version"


def tools_files() -> dict[str, tuple[bytes, int]]:
    """Relative path under `TOOLS_DIR` -> (content, mode) of the tools archive."""
    out: dict[str, tuple[bytes, int]] = {}
    for source in sorted(_APPS_DIR.glob("*.py")):
        out[f"lib/{_PACKAGE}/{source.name}"] = (source.read_bytes(), 0o644)
    for app in APPS:
        out[f"bin/{app}"] = (_CLI.format(app=app).encode(), 0o755)
    version = f"({sys.version_info[0]}, {sys.version_info[1]})"
    out["bin/claw-mcp"] = (_MCP.format(version=version).encode(), 0o755)
    return out


def _tar(entries: Iterable[tuple[str, bytes, int]], *, gzip: bool = True) -> bytes:
    """A tar archive whose bytes depend on the entries only (no owners, no times)."""
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w:gz" if gzip else "w", format=tarfile.PAX_FORMAT
    ) as archive:
        for name, data, mode in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tools_archive() -> bytes:
    """The tools as a gzip tar archive to unpack at `TOOLS_DIR`."""
    return _tar((name, data, mode) for name, (data, mode) in tools_files().items())


def install_tools(folder: Path) -> Path:
    """Lay the tools out under ``folder`` (a local stand-in for `TOOLS_DIR`); returns its
    ``bin``."""
    for name, (data, mode) in tools_files().items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
    return folder / "bin"


def _site_entries() -> list[tuple[str, bytes, int]]:
    closure = requirement_closure(["mcp"], install_hint="orchard-tasks[claw]")
    entries = [
        (f"site/{name}", path.read_bytes(), mode)
        for name, path, mode in distribution_files(closure)
    ]
    entries.append((_MCP_VERSION_FILE, f"{PYTHON_VERSION}\n".encode(), 0o644))
    return entries


@functools.cache
def mcp_archive() -> bytes:
    """``site/``: the ``mcp`` SDK and its dependencies from this environment, as a gzip tar
    archive to unpack at `TOOLS_DIR` (about 10 MB; made once per process)."""
    return _tar(_site_entries())


def build_mcp_site(folder: Path) -> Path:
    """Lay ``site/`` out under ``folder`` (a local stand-in for `TOOLS_DIR`); returns it."""
    for name, data, mode in _site_entries():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
    return folder / "site"


def seed_command(state: bytes, folder: str = STATE_DIR) -> str:
    """A shell command that lays a seed state archive (`World.archive`) out at ``folder``."""
    encoded = base64.b64encode(state).decode()
    target = shlex.quote(folder)
    return f"mkdir -p {target} && echo {encoded} | base64 -d | tar -xzf - -C {target}"


def link_command(tools_dir: str = TOOLS_DIR) -> str:
    """A shell command that puts the tools on the PATH (``/usr/local/bin``)."""
    return f"mkdir -p /usr/local/bin && ln -sf {shlex.quote(tools_dir)}/bin/* /usr/local/bin/"
