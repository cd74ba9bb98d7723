"""Fixtures for the rollout tests: the REAL environment service (etcd + orchard-env with the
local runtime, started by ``orchard up --detach``; needs root) and a scripted policy."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CLI = [sys.executable, "-m", "orchard.sdk.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tails(state: Path, chars: int = 3000) -> str:
    """The end of every log in an ``orchard up`` state folder."""
    return "\n".join(
        f"--- {log}:\n{log.read_text(errors='replace')[-chars:]}"
        for log in sorted((state / "logs").glob("*.log"))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def env_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``orchard up --detach --without reward`` in a private state dir, cgroup parent and run
    dir; yields the JSON it printed (``profile``, ``components``) and stops and removes
    everything at the end."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    from orchard.core.etcd import find_etcd_binary
    from orchard.sdk.cli.host_probe import remove_cgroup_parent

    try:
        find_etcd_binary()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (`make setup` installs etcd)")
    state = tmp_path_factory.mktemp("env-state")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ORCHARD_") or k in {"ORCHARD_ETCD_BINARY", "ORCHARD_INAGENT_BUNDLE"}
    }
    env["ORCHARD_STATE_DIR"] = str(state)
    tag = uuid.uuid4().hex[:8]
    cgroup_parent, run_dir = f"orchard-rt-{tag}", f"/run/orchard-rt-{tag}"
    up = subprocess.run(
        [
            *CLI, "up", "--detach", "--json", "--listen", f"127.0.0.1:{_free_port()}",
            # The other services' fixed default ports may be taken; these tests need none.
            "--without", "reward", "--without", "rollout", "--without", "trainer",
            "--set", f"runtime.cgroup_parent={cgroup_parent}",
            "--set", f"runtime.run_dir={run_dir}",
        ],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # A service that dies is a failure, with what `orchard up` printed and its logs' tails.
    assert up.returncode == 0, (
        f"orchard up failed (status {up.returncode}):\n{up.stderr[-4000:]}\n{_log_tails(state)}"
    )
    started = json.loads(up.stdout)
    try:
        yield {"env": env, "state": state, "profile": Path(started["profile"]), **started}
    finally:
        down = subprocess.run(
            [*CLI, "down"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert down.returncode == 0, down.stderr
        for component in started["components"]:
            deadline = time.monotonic() + 10
            while _alive(component["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(component["pid"]), component
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
