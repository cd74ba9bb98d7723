"""A command started while the sandbox is at its process limit (fork fails with EAGAIN).

Right after a fork bomb is killed for its timeout its processes are still exiting and being
reaped, and they count against the sandbox's pids limit: a command started then waits a moment
for room instead of failing, and when no room comes it fails with RESOURCE_EXHAUSTED and what to
do (not UNAVAILABLE, which orchard-env reads as a dead sandbox). The agent here runs in a real
pids cgroup the test makes.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_CHILD = r"""
import asyncio, os, sys
from orchard.inagent.commands import CommandSpec
from orchard.inagent.process import ProcessLimitReached, ProcessSupervisor

async def main() -> None:
    supervisor = ProcessSupervisor(reap_orphans=False)
    supervisor.start()
    spec = CommandSpec(executable=None, argv=["true"], cwd=os.getcwd(), env=dict(os.environ),
                       stdin=b"", timeout_s=10, output_limit_bytes=1 << 20)
    sys.stdin.readline()  # the test has put this process into the cgroup
    print("trying", flush=True)
    try:
        command = await supervisor.spawn_when_possible(spec, patience_s=float(sys.argv[1]))
    except ProcessLimitReached as error:
        print("limit", error.code.name, error.message, flush=True)
        return
    result = await command.wait()
    print("exited", result.exit_code, flush=True)

asyncio.run(main())
"""


def _pids_hierarchy() -> Path:
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        return v1
    unified = Path("/sys/fs/cgroup")
    if "pids" in (unified / "cgroup.subtree_control").read_text().split():
        return unified
    raise AssertionError("no pids cgroup controller on this machine (the agent's limit needs it)")


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    group = _pids_hierarchy() / f"orchard-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:  # its last process is still exiting
                time.sleep(0.05)


def _start_limited(group: Path, patience_s: float) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(patience_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    # The child alone fills the limit: any process it starts fails with EAGAIN.
    (group / "pids.max").write_text("1")
    (group / "cgroup.procs").write_text(str(child.pid))
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    return child


def test_a_command_waits_for_room_at_the_process_limit(pids_cgroup: Path) -> None:
    child = _start_limited(pids_cgroup, patience_s=10)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "trying"
    time.sleep(0.3)  # it is retrying now: room comes, as when a killed bomb's processes go
    (pids_cgroup / "pids.max").write_text("8")
    out, _ = child.communicate(timeout=30)
    assert out.strip() == "exited 0"
    assert int((pids_cgroup / "pids.events").read_text().split()[1]) > 0  # the limit was hit


def test_no_room_is_resource_exhausted_with_what_to_do(pids_cgroup: Path) -> None:
    child = _start_limited(pids_cgroup, patience_s=0.3)
    out, _ = child.communicate(timeout=30)
    assert "trying" in out
    assert "limit RESOURCE_EXHAUSTED" in out, out
    assert "process limit" in out and "resources.pids" in out, out
