"""The two ways a command is spawned, without a server: posix_spawn and the Popen fallback.

posix_spawn is used when the command runs in the agent's own working directory (and, for a
bare program name, with the agent's own PATH); both ways must give the child the same world.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchard.core.errors import OrchardError
from orchard.inagent.commands import CommandSpec
from orchard.inagent.process import ProcessResult, ProcessSupervisor
from orchard.inagent.reasons import AgentReason

# What the child reports: its session, its open descriptors, whether SIGPIPE is ignored.
_PROBE = (
    'set -- $(cut -d" " -f6 /proc/$$/stat); echo "sid-is-pid=$(( $1 == $$ ))";'
    " ls /proc/$$/fd | tr '\\n' ' '; echo;"
    ' echo "sigpipe-ignored=$(( (0x$(grep SigIgn /proc/$$/status | cut -f2) >> 12) & 1 ))";'
    ' pwd; echo "$PROBE_VAR"; cat'
)


@pytest.fixture
async def supervisor() -> AsyncIterator[ProcessSupervisor]:
    supervisor = ProcessSupervisor(reap_orphans=False)
    supervisor.start()
    yield supervisor
    supervisor.close()


def _spec(cwd: str, argv: list[str], *, executable: str | None = None, **env: str) -> CommandSpec:
    return CommandSpec(
        executable=executable,
        argv=argv,
        cwd=cwd,
        env={**os.environ, **env},
        stdin=b"from stdin",
        timeout_s=10,
        output_limit_bytes=1 << 20,
    )


def _live_members(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (killed orphans may await reaping)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


async def _group_gone(pgid: int) -> bool:
    for _ in range(100):
        if not _live_members(pgid):
            return True
        await asyncio.sleep(0.02)
    return False


async def _run(supervisor: ProcessSupervisor, spec: CommandSpec) -> tuple[str, ProcessResult]:
    command = supervisor.spawn(spec)
    return command.spawned_by, await command.wait()


async def test_both_ways_give_the_child_the_same_world(
    supervisor: ProcessSupervisor, tmp_path: Path
) -> None:
    here = os.getcwd()
    fast = await _run(supervisor, _spec(here, ["sh", "-c", _PROBE], PROBE_VAR="v"))
    slow = await _run(supervisor, _spec(str(tmp_path), ["sh", "-c", _PROBE], PROBE_VAR="v"))
    assert (fast[0], slow[0]) == ("posix_spawn", "popen")
    for (_, result), cwd in ((fast, here), (slow, str(tmp_path))):
        assert result.exit_code == 0, result.stderr
        lines = result.stdout.decode().splitlines()
        assert lines[0] == "sid-is-pid=1"  # a session (and process group) of its own
        assert lines[1].split() == ["0", "1", "2"]  # its pipes only, nothing of the agent's
        assert lines[2] == "sigpipe-ignored=0"
        assert lines[3:] == [cwd, "v", "from stdin"]


async def test_posix_spawn_runs_a_path_and_falls_back_for_another_path_variable(
    supervisor: ProcessSupervisor,
) -> None:
    here = os.getcwd()
    spawned_by, result = await _run(supervisor, _spec(here, ["sh", "-c", "exit 3"]))
    assert (spawned_by, result.exit_code) == ("posix_spawn", 3)
    true = "/bin/true"
    spawned_by, result = await _run(supervisor, _spec(here, ["true"], executable=true))
    assert (spawned_by, result.exit_code) == ("posix_spawn", 0)
    # posix_spawnp would search the agent's PATH, not the command's: Popen searches this one.
    other_path = f"/nonexistent:{os.environ['PATH']}"
    spawned_by, result = await _run(supervisor, _spec(here, ["true"], PATH=other_path))
    assert (spawned_by, result.exit_code) == ("popen", 0)


@pytest.mark.parametrize("use_posix_spawn", [True, False])
async def test_missing_program_is_explained_either_way(use_posix_spawn: bool) -> None:
    supervisor = ProcessSupervisor(reap_orphans=False, use_posix_spawn=use_posix_spawn)
    supervisor.start()
    try:
        with pytest.raises(OrchardError) as caught:
            supervisor.spawn(_spec(os.getcwd(), ["no-such-program-here"]))
        assert caught.value.reason == AgentReason.EXECUTABLE_NOT_FOUND
        assert supervisor.running == 0
    finally:
        supervisor.close()


async def test_timeout_and_cancel_kill_the_group_of_a_posix_spawned_command(
    supervisor: ProcessSupervisor,
) -> None:
    spec = _spec(os.getcwd(), ["sh", "-c", "sleep 30 & sleep 30"])
    spec = CommandSpec(**{**spec.__dict__, "timeout_s": 0.2})
    command = supervisor.spawn(spec)
    assert command.spawned_by == "posix_spawn"
    result = await asyncio.wait_for(command.wait(), 5)
    assert result.timed_out
    assert await _group_gone(command.pid)

    command = supervisor.spawn(_spec(os.getcwd(), ["sh", "-c", "sleep 30 & sleep 30"]))
    waiting = asyncio.ensure_future(command.wait())
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for _ in range(100):
        if command.done:
            break
        await asyncio.sleep(0.02)
    assert command.done
    assert await _group_gone(command.pid)


async def test_inherited_descriptors_are_made_close_on_exec_at_start() -> None:
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    supervisor = ProcessSupervisor(reap_orphans=False)
    try:
        supervisor.start()
        assert supervisor.use_posix_spawn
        assert not os.get_inheritable(write_end)
        spawned_by, result = await _run(
            supervisor, _spec(os.getcwd(), ["sh", "-c", f"ls /proc/$$/fd/{write_end}"])
        )
        assert spawned_by == "posix_spawn"
        assert result.exit_code != 0  # the descriptor did not reach the child
    finally:
        supervisor.close()
        os.close(read_end)
        os.close(write_end)


async def test_close_kills_a_running_command_and_its_wait_still_ends(tmp_path: Path) -> None:
    """close() kills the group; the command's end is still reported, then the watch set goes."""
    supervisor = ProcessSupervisor(reap_orphans=False)
    supervisor.start()
    command = supervisor.spawn(_spec(str(tmp_path), ["sleep", "30"]))
    supervisor.close()
    result = await asyncio.wait_for(command.wait(), timeout=10)
    assert result.signal == 9 and result.exit_code is None
    assert supervisor.running == 0
    assert supervisor._epoll is None  # closed with the last descriptor it watched


async def test_output_and_exit_seen_in_one_pass(supervisor: ProcessSupervisor) -> None:
    """Many short commands with output, one after another: every byte and status arrives."""
    for index in range(50):
        spec = _spec(os.getcwd(), ["sh", "-c", f"echo out{index}; echo err{index} >&2; exit 3"])
        result = await asyncio.wait_for(supervisor.spawn(spec).wait(), timeout=10)
        assert (result.stdout, result.stderr) == (
            f"out{index}\n".encode(),
            f"err{index}\n".encode(),
        )
        assert result.exit_code == 3
    assert supervisor.running == 0
