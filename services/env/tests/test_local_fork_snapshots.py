"""Forks share one read-only snapshot of their source (``runtime/local/snapshots.py``): one copy
per ForkSandbox call instead of one per fork, on a tmpfs of its own under the runtime's state
directory, mounted as a layer below each fork's own upper layer. What a fork sees is exactly the
source's file system at the fork (files written, deleted and replaced directories included);
forks and source diverge after; a fork of a fork stacks its source's snapshot; a snapshot goes
with the last sandbox that uses it, and a restarted runtime removes the ones nobody uses."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchard.env.exec_lane import LaneClient
from orchard.env.runtime.base import RuntimeResources, RuntimeSandboxSpec
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root]

SETUP = (
    "mkdir -p /srv/repo/sub && echo one > /srv/repo/a && echo two > /srv/repo/sub/b "
    "&& rm /etc/hostname && rm -rf /opt && mkdir /opt && echo only > /opt/new"
)
"""Writes files, deletes one of the image (a whiteout) and replaces a directory of the image
with a new one (an opaque directory)."""
SEEN = "cat /srv/repo/a /srv/repo/sub/b /opt/new; ls /opt; test ! -e /etc/hostname && echo gone"
EXPECTED = "one\ntwo\nonly\nnew\ngone\n"


def _config(tmp_path: Path, run_dir: str, **settings: Any) -> LocalRuntimeConfig:
    return LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        pool_size=0,
        **settings,
    )


@pytest.fixture
async def runtimes(tmp_path: Path) -> AsyncIterator[Any]:
    """Starts local runtimes on one state directory (a restarted service's); at the end every
    sandbox is deleted and each runtime closed."""
    run_dir = tempfile.mkdtemp(prefix="orc-")
    started: list[LocalRuntime] = []

    async def start(**settings: Any) -> LocalRuntime:
        runtime = LocalRuntime(_config(tmp_path, run_dir, **settings))
        await runtime.start()
        started.append(runtime)
        return runtime

    try:
        yield start
    finally:
        if started:
            for sandbox_id in await started[-1].list_sandboxes():
                await started[-1].delete(sandbox_id)
        for runtime in started:
            await runtime.close()
        if started:
            assert started[-1].remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)


async def _sh(runtime: LocalRuntime, sandbox_id: str, script: str) -> str:
    lane = LaneClient(f"unix:{runtime.config.run_dir}/{sandbox_id}/agent.lane")
    try:
        reply = await lane.exec(agent_pb.ExecRequest(command=exec_pb2.Command(shell=script)), 30)
    finally:
        lane.close()
    assert reply.result.status.exit_code == 0, reply.result.stderr
    return reply.result.stdout.decode()


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        return any(line.split()[4] == path for line in mountinfo)


def _snapshots(runtime: LocalRuntime) -> list[str]:
    directory = Path(runtime.config.state_dir, "snapshots")
    return sorted(str(p) for p in directory.iterdir()) if directory.exists() else []


async def test_forks_of_one_call_share_one_read_only_snapshot_and_diverge(runtimes: Any) -> None:
    runtime = await runtimes()
    await runtime.create(RuntimeSandboxSpec("source", "host"))
    await _sh(runtime, "source", SETUP)
    forks = [f"fork-{i}" for i in range(4)]
    await asyncio.gather(*(runtime.fork("source", RuntimeSandboxSpec(f, "host")) for f in forks))
    states = [runtime.store.read(f) for f in forks]
    layers = {state.snapshot_layers for state in states if state is not None}
    assert len(layers) == 1 and len(next(iter(layers))) == 1, layers
    (snapshot,) = next(iter(layers))
    assert _snapshots(runtime) == [snapshot] and _mounted(snapshot)
    # Nothing was copied into the forks' own upper layers.
    for state in states:
        assert state is not None and os.listdir(state.paths.upper) == []
    for fork in forks:
        assert await _sh(runtime, fork, SEEN) == EXPECTED
    # Read-only underneath: a fork's writes land in its own upper layer only.
    with pytest.raises(OSError):
        Path(snapshot, "srv/repo/a").write_text("changed")
    await _sh(runtime, "fork-0", "echo mine > /srv/repo/a && rm /srv/repo/sub/b")
    assert await _sh(runtime, "fork-1", "cat /srv/repo/a /srv/repo/sub/b") == "one\ntwo\n"
    await _sh(runtime, "source", "echo later > /srv/repo/a")
    assert await _sh(runtime, "fork-2", "cat /srv/repo/a") == "one\n"
    assert await _sh(runtime, "fork-0", "cat /srv/repo/a; ls /srv/repo/sub") == "mine\n"

    # A fork of a fork: its source's snapshot below a new one of the fork's own changes.
    await runtime.fork("fork-0", RuntimeSandboxSpec("grandchild", "host"))
    grandchild = runtime.store.read("grandchild")
    assert grandchild is not None and grandchild.snapshot_layers[1:] == (snapshot,)
    assert await _sh(runtime, "grandchild", "cat /srv/repo/a; ls /srv/repo/sub; cat /opt/new") == (
        "mine\nonly\n"
    )

    # The snapshot goes with the last sandbox that uses it, whoever goes first.
    await runtime.delete("source")
    for fork in forks:
        await runtime.delete(fork)
    assert _mounted(snapshot), "the grandchild still stands on it"
    assert await _sh(runtime, "grandchild", "cat /srv/repo/sub/../a") == "mine\n"
    await runtime.delete("grandchild")
    assert _snapshots(runtime) == [] and not _mounted(snapshot)


async def test_snapshots_stay_within_their_memory_bound_else_forks_copy(runtimes: Any) -> None:
    """All snapshots together within ``fork_snapshot_max_bytes`` (a tenant forking again and
    again cannot fill the host's memory); beyond it, and for a fork with a disk limit, each
    fork gets its own copy on disk."""
    runtime = await runtimes(fork_snapshot_max_bytes=6 * 1024 * 1024)  # room for one
    for source in ("one", "two"):
        await runtime.create(RuntimeSandboxSpec(source, "host"))
        await _sh(runtime, source, SETUP)
    await runtime.fork("one", RuntimeSandboxSpec("fork-one", "host"))
    await runtime.fork("two", RuntimeSandboxSpec("fork-two", "host"))
    one, two = runtime.store.read("fork-one"), runtime.store.read("fork-two")
    assert one is not None and len(one.snapshot_layers) == 1
    assert two is not None and two.snapshot_layers == ()
    assert Path(two.paths.upper, "srv/repo/a").read_text() == "one\n"
    for fork in ("fork-one", "fork-two"):
        assert await _sh(runtime, fork, SEEN) == EXPECTED
    # The first snapshot gone, there is room again.
    await runtime.delete("fork-one")
    await runtime.fork("two", RuntimeSandboxSpec("fork-two-again", "host"))
    again = runtime.store.read("fork-two-again")
    assert again is not None and len(again.snapshot_layers) == 1
    # A disk limit covers every file of the fork: it copies onto its own disk.
    limited = RuntimeSandboxSpec(
        "fork-limited", "host", resources=RuntimeResources(disk_bytes=32 * 1024 * 1024)
    )
    await runtime.delete("fork-two-again")
    await runtime.fork("one", limited)
    state = runtime.store.read("fork-limited")
    assert state is not None and state.snapshot_layers == () and os.path.ismount(state.paths.layer)
    assert await _sh(runtime, "fork-limited", SEEN) == EXPECTED


async def test_a_restarted_runtime_removes_snapshots_nobody_uses(runtimes: Any) -> None:
    first = await runtimes()
    await first.create(RuntimeSandboxSpec("source", "host"))
    await _sh(first, "source", SETUP)
    await first.fork("source", RuntimeSandboxSpec("fork", "host"))
    (kept,) = _snapshots(first)
    # A snapshot left by a crash between its copy and the first fork's record.
    orphan = await first._snapshot(first.store.read("source"))  # type: ignore[arg-type]
    assert orphan is not None and _mounted(orphan)
    await first.close()
    second = await runtimes()
    assert _snapshots(second) == [kept] and _mounted(kept) and not _mounted(orphan)
    assert await _sh(second, "fork", SEEN) == EXPECTED
