"""Escapes tried from inside a sandbox of the real ``local`` runtime, through the service: pid,
mount, network, ptrace and cgroup isolation. Commands run as the sandbox's root, with the
``host`` image's tools (python3, mount, unshare) as an attacker's toolbox."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2, resources_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def run(env: Any, sandbox_id: str, script: str, timeout_s: float = 30) -> Any:
    """The script's ExecResult, run by the sandbox's shell."""
    command = exec_pb2.Command(shell=script)
    command.timeout.FromNanoseconds(int(timeout_s * 1e9))
    request = api.ExecRequest(sandbox_id=sandbox_id, command=command)
    return (await env.stub.Exec(request, metadata=env.md(), timeout=timeout_s + 30)).result


async def python(env: Any, sandbox_id: str, code: str) -> Any:
    """Runs ``code`` with the sandbox's python3 (the host image has it)."""
    return await run(env, sandbox_id, f"python3 - <<'ORCHARD_EOF'\n{code}\nORCHARD_EOF")


async def agent_answers(env: Any, sandbox_id: str) -> bool:
    result = await run(env, sandbox_id, "echo alive")
    sandbox = await env.stub.GetSandbox(
        api.GetSandboxRequest(sandbox_id=sandbox_id), metadata=env.md()
    )
    return bool(
        result.stdout == b"alive\n" and sandbox.sandbox.state == env_pb2.SANDBOX_STATE_READY
    )


# -- pid namespace -------------------------------------------------------------------------


async def test_host_processes_are_invisible_and_cannot_be_signalled(
    isolated: Any, host_sleeper: subprocess.Popen[bytes], attack: Any
) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    attack.tried("list host processes")
    listing = await run(
        isolated, sandbox.id, "for p in /proc/[0-9]*; do cat $p/cmdline; echo; done"
    )
    assert listing.status.exit_code == 0, listing
    lines = [line for line in listing.stdout.split(b"\n") if line]
    # The agent, the shell and its loop: nothing of the host (pytest, the sleeper, init).
    assert not any(b"pytest" in line or line.startswith(b"sleep") for line in lines), lines
    assert len(lines) < 10, lines
    attack.held("list host processes")

    attack.tried("signal a host pid")
    killed = await run(isolated, sandbox.id, f"kill -9 {host_sleeper.pid}")
    assert killed.status.exit_code != 0
    assert host_sleeper.poll() is None
    attack.held("signal a host pid")

    attack.tried("kill -9 -1 (every process it can signal)")
    await run(isolated, sandbox.id, "kill -9 -1")
    assert host_sleeper.poll() is None
    assert await agent_answers(isolated, sandbox.id)
    attack.held("kill -9 -1 (every process it can signal)")

    attack.tried("SIGKILL the agent (PID 1)")
    await run(isolated, sandbox.id, "kill -9 1")
    assert await agent_answers(isolated, sandbox.id)
    attack.held("SIGKILL the agent (PID 1)")


# -- mount namespace -----------------------------------------------------------------------


async def test_mounts_cannot_be_made_or_changed(isolated: Any, attack: Any) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    attempts = {
        "mount a tmpfs": "mount -t tmpfs evil /mnt",
        "bind-mount /": "mount --bind / /mnt",
        "mount proc anew": "mount -t proc proc /mnt",
        "remount the agent bundle read-write": "mount -o remount,rw /.orchard/inagent",
        "remount /sys read-write": "mount -o remount,rw /sys",
        "remount /proc/sys read-write": "mount -o remount,rw /proc/sys",
        "unmount a /proc mask": "umount /proc/kallsyms",
        "unmount /proc/sys": "umount -l /proc/sys",
        "write /proc/sys": "echo evil > /proc/sys/kernel/hostname",
        "write into the agent bundle": "echo evil > /.orchard/inagent/evil",
        "pivot_root": "mkdir -p /tmp/new && pivot_root /tmp/new /tmp/new",
    }
    for name, script in attempts.items():
        attack.tried(name)
        result = await run(isolated, sandbox.id, script)
        assert result.status.exit_code != 0, (name, result)
        attack.held(name)
    mountinfo = (await run(isolated, sandbox.id, "cat /proc/self/mountinfo")).stdout
    assert b"evil" not in mountinfo and b" /mnt " not in mountinfo


async def test_writes_through_the_host_image_stay_in_the_sandbox(
    isolated: Any, attack: Any
) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    name = f"/etc/orchard-escape-{uuid.uuid4().hex[:8]}"
    attack.tried("write a file into the host's /etc")
    try:
        result = await run(isolated, sandbox.id, f"echo evil > {name} && cat {name}")
        assert result.stdout == b"evil\n", result  # its own writable layer takes it
        assert not os.path.lexists(name)
        attack.held("write a file into the host's /etc")
    finally:
        if os.path.lexists(name):
            os.unlink(name)


async def test_host_mounts_are_invisible(isolated: Any, host_secret: Any, attack: Any) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    attack.tried("see a host mount")
    mountinfo = await run(isolated, sandbox.id, "cat /proc/self/mountinfo /proc/1/mountinfo")
    assert str(host_secret.mount).encode() not in mountinfo.stdout
    read = await run(isolated, sandbox.id, f"cat {host_secret.file}")
    assert host_secret.content not in read.stdout and read.status.exit_code != 0
    attack.held("see a host mount")


async def test_chroot_and_proc_root_lead_nowhere(
    isolated: Any, host_secret: Any, attack: Any
) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    attack.tried("chroot escape (chroot into a subdir, fchdir out, climb, chroot .)")
    escaped = await python(
        isolated,
        sandbox.id,
        f"""import os
os.makedirs('/tmp/jail', exist_ok=True)
outside = os.open('/', os.O_RDONLY)
os.chroot('/tmp/jail')
os.fchdir(outside)
for _ in range(256):
    os.chdir('..')
os.chroot('.')
print(os.path.exists({str(host_secret.file)!r}))""",
    )
    assert escaped.stdout == b"False\n", escaped
    attack.held("chroot escape (chroot into a subdir, fchdir out, climb, chroot .)")

    attack.tried("/proc/PID/root of every visible process")
    through_proc = await run(
        isolated,
        sandbox.id,
        f"for p in /proc/[0-9]*; do cat $p/root{host_secret.file} 2>/dev/null; done; "
        f"cat /proc/1/root/proc/1/root{host_secret.file}",
    )
    assert host_secret.content not in through_proc.stdout
    attack.held("/proc/PID/root of every visible process")

    attack.tried("the agent's open files and working directory")
    fds = await run(isolated, sandbox.id, "ls -l /proc/1/fd/ 2>&1; ls /proc/1/cwd/ 2>&1")
    assert fds.status.exit_code != 0 or b"Permission denied" in fds.stdout, fds
    attack.held("the agent's open files and working directory")


# -- network -------------------------------------------------------------------------------


@pytest.fixture
def host_listeners() -> Iterator[dict[str, Any]]:
    """TCP servers on the host's loopback and on every address, and an abstract Unix socket."""
    loopback = socket.create_server(("127.0.0.1", 0))
    anywhere = socket.create_server(("0.0.0.0", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"orchard-test-{uuid.uuid4().hex[:8]}"
    abstract.bind("\0" + name)
    abstract.listen()
    for listener in (loopback, anywhere, abstract):
        listener.setblocking(False)
    try:
        yield {
            "loopback": loopback,
            "anywhere": anywhere,
            "abstract": abstract,
            "abstract_name": name,
        }
    finally:
        for listener in (loopback, anywhere, abstract):
            listener.close()


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True)
    return [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]


async def test_network_is_denied_by_default(
    isolated: Any, host_listeners: dict[str, Any], attack: Any
) -> None:
    first = await isolated.ready(timeout_s=60)
    second = await isolated.ready(timeout_s=60)
    loopback_port = host_listeners["loopback"].getsockname()[1]
    anywhere_port = host_listeners["anywhere"].getsockname()[1]
    # The other sandbox listens on its own loopback.
    await run(isolated, second.id, "python3 -m http.server 8765 >/dev/null 2>&1 &")
    targets = [("127.0.0.1", loopback_port)] + [
        (address, anywhere_port) for address in _host_addresses()
    ]
    attack.tried("TCP to host services (loopback and every host address)")
    attack.tried("TCP to another sandbox's listener")
    attack.tried("abstract Unix socket of the host")
    attack.tried("another sandbox's agent socket by its host path")
    attack.tried("the exec lane of its own agent and another sandbox's by their host paths")
    second_socket, second_lane = await _agent_sockets(isolated, second.id)
    _, own_lane = await _agent_sockets(isolated, first.id)
    paths = [f"\0{host_listeners['abstract_name']}", second_socket, second_lane, own_lane]
    probe = await python(
        isolated,
        first.id,
        f"""import socket
targets = {targets!r} + [("127.0.0.1", 8765)]
for host, port in targets:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("connected", host, port)
    except OSError as exc:
        print("refused", host, port, exc)
for path in {paths!r}:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        print("connected", repr(path))
    except OSError as exc:
        print("refused", repr(path), exc)
print(sorted(__import__("os").listdir("/sys/class/net")))""",
    )
    assert probe.status.exit_code == 0, probe
    assert b"connected" not in probe.stdout, probe.stdout.decode()
    assert probe.stdout.rstrip().endswith(b"['lo']"), probe.stdout.decode()
    for key in ("loopback", "anywhere", "abstract"):
        with pytest.raises(BlockingIOError):
            host_listeners[key].accept()
    attack.held("TCP to host services (loopback and every host address)")
    attack.held("TCP to another sandbox's listener")
    attack.held("abstract Unix socket of the host")
    attack.held("another sandbox's agent socket by its host path")
    attack.held("the exec lane of its own agent and another sandbox's by their host paths")


async def _agent_sockets(env: Any, sandbox_id: str) -> tuple[str, str]:
    """The host paths of a sandbox's agent socket and exec lane (from the service's record)."""
    record = await env.app.controller.get("alpha", sandbox_id)
    assert record.lane_address.startswith("unix:"), record
    return record.agent_address.removeprefix("unix:"), record.lane_address.removeprefix("unix:")


# -- ptrace --------------------------------------------------------------------------------


async def test_the_agent_cannot_be_traced_or_read(isolated: Any, attack: Any) -> None:
    sandbox = await isolated.ready(timeout_s=60)
    attack.tried("ptrace attach to the agent (PID 1)")
    attack.tried("read the agent's memory and environment")
    result = await python(
        isolated,
        sandbox.id,
        """import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
# Control: tracing its own child works, so a refusal below is the agent's protection.
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
own = libc.ptrace(PTRACE_ATTACH, child, 0, 0)
print("child", own)
os.kill(child, 9)
os.waitpid(child, 0)
agent = libc.ptrace(PTRACE_ATTACH, 1, 0, 0)
print("agent", agent, os.strerror(ctypes.get_errno()))
for name in ("mem", "environ", "maps"):
    try:
        with open(f"/proc/1/{name}", "rb") as f:
            print(name, "read", len(f.read(64)))
    except OSError as exc:
        print(name, "denied", exc.errno)""",
    )
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "child 0", result
    assert lines[1].startswith("agent -1 "), result
    assert all(" denied " in line for line in lines[2:]), lines
    assert await agent_answers(isolated, sandbox.id)
    attack.held("ptrace attach to the agent (PID 1)")
    attack.held("read the agent's memory and environment")


# -- cgroups -------------------------------------------------------------------------------


def _limits(dirs: list[Path]) -> dict[str, str]:
    found = {}
    for directory in dirs:
        for name in ("memory.limit_in_bytes", "memory.max", "pids.max", "cpu.cfs_quota_us"):
            if (directory / name).exists():
                found[name] = (directory / name).read_text()
    return found


def _members(dirs: list[Path]) -> list[set[str]]:
    return [set((directory / "cgroup.procs").read_text().split()) for directory in dirs]


async def test_cgroup_limits_cannot_be_changed_or_left(
    isolated: Any, sandbox_cgroups: Any, attack: Any
) -> None:
    sandbox = await isolated.ready(
        timeout_s=60, resources=resources_pb2.Resources(memory_bytes=256 << 20, pids=128)
    )
    dirs = sandbox_cgroups(sandbox.id)
    assert dirs, "the sandbox has no cgroup"
    before = _limits(dirs)
    attempts = {
        "mount the cgroup v1 hierarchies": "mount -t cgroup -o memory,pids cg /mnt",
        "mount cgroup2": "mount -t cgroup2 cg /mnt",
        "write the limits through /sys": "echo max > /sys/fs/cgroup/pids/pids.max",
        "new cgroup namespace": "unshare --cgroup true",
        "move to the root cgroup through /sys": "echo $$ > /sys/fs/cgroup/pids/cgroup.procs",
    }
    for name, script in attempts.items():
        attack.tried(name)
        result = await run(isolated, sandbox.id, script)
        assert result.status.exit_code != 0, (name, result)
        attack.held(name)
    await run(isolated, sandbox.id, "sleep 30 >/dev/null 2>&1 &")
    assert _limits(dirs) == before
    inside = _members(dirs)
    assert all(members == inside[0] and len(members) >= 2 for members in inside), inside


async def test_user_namespaces_give_no_way_out_of_the_cgroup(
    isolated: Any, sandbox_cgroups: Any, attack: Any
) -> None:
    """A user namespace's capabilities must not reach the host's cgroup hierarchy."""
    sandbox = await isolated.ready(timeout_s=60)
    dirs = sandbox_cgroups(sandbox.id)
    before = _limits(dirs)
    name = f"orchard-escape-{uuid.uuid4().hex[:8]}"
    unified = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if " - cgroup2 " in line
    ]
    attack.tried("user + cgroup namespace, mount cgroup2, create a cgroup and move into it")
    try:
        await run(
            isolated,
            sandbox.id,
            f"unshare -UrmC sh -c 'mount -t cgroup2 none /mnt && mkdir /mnt/{name} "
            f"&& echo $$ > /mnt/{name}/cgroup.procs; mount -t cgroup -o pids none /mnt'",
        )
        created = [point for point in unified if os.path.isdir(f"{point}/{name}")]
        assert created == [], f"a sandbox created {created} in the host's cgroup hierarchy"
        assert _limits(dirs) == before
        attack.held("user + cgroup namespace, mount cgroup2, create a cgroup and move into it")
    finally:
        for point in unified:
            leftover = Path(point, name)
            if leftover.is_dir():
                for pid in (leftover / "cgroup.procs").read_text().split():
                    Path(point, "cgroup.procs").write_text(pid)
                leftover.rmdir()


async def test_a_fork_bomb_stays_within_its_pids_limit(
    isolated: Any, sandbox_cgroups: Any, attack: Any
) -> None:
    sandbox = await isolated.ready(timeout_s=60, resources=resources_pb2.Resources(pids=64))
    pids_dirs = [d for d in sandbox_cgroups(sandbox.id) if (d / "pids.max").exists()]
    assert pids_dirs, "no pids cgroup"
    attack.tried("fork bomb")
    result = await run(isolated, sandbox.id, "b() { b | b & }; b; sleep 3", timeout_s=4)
    assert result.status.timed_out or result.status.exit_code is not None
    peak = (
        int((pids_dirs[0] / "pids.peak").read_text())
        if (pids_dirs[0] / "pids.peak").exists()
        else 0
    )
    events = (pids_dirs[0] / "pids.events").read_text()
    assert peak <= 64
    assert "max 0" not in events, events  # the limit was hit, and it held
    assert await agent_answers(isolated, sandbox.id)
    attack.held("fork bomb")


async def test_memory_over_the_limit_kills_the_command_not_the_agent(
    isolated: Any, attack: Any
) -> None:
    sandbox = await isolated.ready(
        timeout_s=60, resources=resources_pb2.Resources(memory_bytes=160 << 20)
    )
    attack.tried("allocate past the memory limit")
    result = await run(
        isolated, sandbox.id, "exec python3 -c 'b = []\nwhile True: b.append(bytearray(1 << 20))'"
    )
    assert result.status.signal == 9, result  # the OOM killer's SIGKILL, as the agent saw it
    assert await agent_answers(isolated, sandbox.id)
    attack.held("allocate past the memory limit")
