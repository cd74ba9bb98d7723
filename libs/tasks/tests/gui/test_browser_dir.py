"""The folder a browser sandbox runs the tool server from (`orchard.tasks.gui.browser_dir`):
built here, run with the system's ``python3`` (as an image's would be), called over its Unix
socket with ``orchard-browser-call`` against the real site server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchard.tasks.gui.browser_dir import CALLER, LAUNCHER, build_browser_dir
from orchard.tasks.gui.sites import SiteServer

SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("gui") / "browser"
    build_browser_dir(target)
    return target


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Path]:
    socket_path = folder.parent / "browser.sock"
    process = subprocess.Popen(
        [SYSTEM_PYTHON, str(folder / LAUNCHER), "--listen", f"unix:{socket_path}"],
        env={"PATH": os.environ["PATH"]},  # nothing of this environment's Python
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the browser tool server did not start"
            time.sleep(0.05)
        yield socket_path
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def call(folder: Path, socket_path: Path, tool: str, arguments: Any = None) -> tuple[int, Any]:
    argv = [SYSTEM_PYTHON, "-S", str(folder / CALLER), str(socket_path), tool]
    if arguments is not None:
        argv.append(json.dumps(arguments))
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    text = done.stdout.decode() or done.stderr.decode()
    try:
        return done.returncode, json.loads(text)
    except ValueError:
        return done.returncode, text


def test_the_folder_holds_what_it_needs_and_nothing_of_this_environment(folder: Path) -> None:
    assert (folder / "python-version").read_text().strip().count(".") == 1
    assert (folder / "site" / "playwright" / "__init__.py").is_file()
    driver = folder / "site" / "playwright" / "driver" / "node"
    assert driver.is_file() and os.access(driver, os.X_OK)  # the driver stays a program
    assert (folder / "lib" / "orchard" / "tasks" / "gui" / "browser_server.py").is_file()
    assert not (folder / "lib" / "orchard" / "tasks" / "claw").exists()
    # Rebuilding replaces it whole, with no staging folder left behind.
    build_browser_dir(folder)
    assert sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(".")) == []


def test_calls_over_the_socket_drive_the_browser(folder: Path, server: Path) -> None:
    with SiteServer(seed=3, sites=["playground"]) as sites:
        code, opened = call(folder, server, "goto_url", {"url": f"{sites.base_url}/playground/"})
        assert code == 0 and opened["ok"], opened
        assert opened["tabs"][0]["url"].startswith(sites.base_url)
        assert opened["screenshot_png_base64"]
        code, waited = call(folder, server, "wait", {"seconds": 0.1})
        assert code == 0 and waited["ok"] and waited["message"] == "waited 0.1 s"
        # A refused call is an observation that says what to fix, not a failed command.
        code, refused = call(folder, server, "click", {"x": -1})
        assert code == 0 and not refused["ok"] and refused["error"] == "invalid_argument"
        code, unknown = call(folder, server, "fly")
        assert (
            code == 0 and unknown["error"] == "invalid_argument" and "no tool" in unknown["message"]
        )


def test_a_malformed_call_and_a_dead_server_say_so(folder: Path, server: Path) -> None:
    code, answer = call(folder, server, "wait", "not an object")
    assert code == 2 and "arguments must be an object" in json.dumps(answer)
    missing = server.with_name("nobody.sock")
    code, text = call(folder, missing, "wait")
    assert code == 2 and "did not answer" in str(text)


def test_the_socket_is_its_owners_only(server: Path) -> None:
    assert server.stat().st_mode & 0o777 == 0o600


def test_the_launcher_refuses_another_python(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "browser"
    shutil.copytree(folder / "bin", copy / "bin")
    (copy / "python-version").write_text("2.7\n")
    done = subprocess.run(
        [SYSTEM_PYTHON, str(copy / LAUNCHER), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0 and "built for Python 2.7" in done.stderr
