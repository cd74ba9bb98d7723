"""The agent (PID 1 of a sandbox) holds no more privilege than a command, on both launch paths,
and commands lose raw sockets and user namespaces unless the spec asks and the operator allows.

Each test runs the real service over the real ``local`` runtime, once with the agent forked from
the zygote and once exec'd from the bundle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.config import PrivilegesConfig
from orchard.env.runtime.base import RuntimeUnavailable
from orchard.env.runtime.local.sandbox_init import CAP_NET_RAW, KEPT_CAPABILITIES
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

pytestmark = [pytest.mark.root, pytest.mark.slow]

# Set in the service's environment before its runtime (and so the zygote) starts.
CANARY = "ORCHARD_TEST_SERVICE_CANARY"
CANARY_VALUE = "service-only-" + uuid.uuid4().hex
# Commands' capability mask by default: a container engine's usual set, less NET_RAW and MKNOD.
DEFAULT_CAPS = sum(1 << cap for cap in KEPT_CAPABILITIES)
BETA_TOKEN = "beta-token"  # tenant beta of the tests' configuration (tests/conftest.py)


@pytest.fixture(params=["zygote", "exec"])
async def service(
    request: pytest.FixtureRequest,
    env_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Any]:
    """One replica over a local runtime that launches agents the parametrized way; tenant
    ``alpha`` may ask for raw sockets and user namespaces, ``beta`` for neither."""
    from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig

    monkeypatch.setenv(CANARY, CANARY_VALUE)
    run_dir = tempfile.mkdtemp(prefix="orc-")
    runtime = LocalRuntime(
        LocalRuntimeConfig(
            state_dir=str(tmp_path / "state"),
            workspace_dir=str(tmp_path / "sandboxes"),
            run_dir=run_dir,
            cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
            agent_launch=request.param,
        )
    )
    try:
        try:
            await runtime.start()
        except RuntimeUnavailable as exc:
            pytest.fail(f"the local runtime cannot run here: {exc}")
        yield await env_factory(
            runtime=runtime,
            privileges=PrivilegesConfig(raw_sockets=["alpha"], user_namespaces=["alpha"]),
        )
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
    finally:
        await runtime.close()
        for parent in getattr(getattr(runtime, "_cgroups", None), "parents", ()):
            if os.path.isdir(parent):
                os.rmdir(parent)
        shutil.rmtree(run_dir, ignore_errors=True)


def _status_fields(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


async def _read(env: Any, sandbox_id: str, path: str) -> bytes:
    request = api.ReadFileRequest(sandbox_id=sandbox_id, path=path, limit=65536)
    chunks = [
        message.data async for message in env.stub.ReadFile(request, metadata=env.md(), timeout=10)
    ]
    return b"".join(chunks)


async def test_pid1_and_commands_hold_the_same_reduced_privilege(service: Any, attack: Any) -> None:
    sandbox = await service.ready(timeout_s=60)
    result = await service.shell(sandbox.id, "cat /proc/1/status; echo ===; cat /proc/self/status")
    assert result.status.exit_code == 0, result
    agent_text, command_text = result.stdout.decode().split("===\n")
    agent, command = _status_fields(agent_text), _status_fields(command_text)
    attack.tried("agent keeps host-root capabilities")
    for name in ("CapEff", "CapPrm", "CapBnd"):
        assert int(agent[name], 16) == DEFAULT_CAPS, (name, agent[name])
        assert int(command[name], 16) == DEFAULT_CAPS, (name, command[name])
    for fields in (agent, command):
        assert int(fields["CapInh"], 16) == 0
        assert int(fields["CapAmb"], 16) == 0
        assert fields["NoNewPrivs"] == "1"
        assert fields["Seccomp"] == "2"  # a filter
    attack.held("agent keeps host-root capabilities")


async def test_the_agent_is_out_of_a_commands_reach(service: Any, attack: Any) -> None:
    sandbox = await service.ready(timeout_s=60)
    attack.tried("read the agent's environment, memory and descriptors")
    for command in (
        "cat /proc/1/environ",
        "cat /proc/1/mem",
        "cat /proc/1/fd/0",
        "ls /proc/1/root/",
        "ls /proc/1/cwd/",
    ):
        result = await service.shell(sandbox.id, f"{command} > /dev/null")
        assert result.status.exit_code != 0, (command, result)
        assert b"Permission denied" in result.stderr, (command, result)
    # Through the agent itself (its own file, so readable): nothing of the service's.
    environ = await _read(service, sandbox.id, "/proc/1/environ")
    assert CANARY.encode() not in environ and CANARY_VALUE.encode() not in environ
    attack.held("read the agent's environment, memory and descriptors")


async def test_the_agent_reads_no_more_than_a_command(service: Any, attack: Any) -> None:
    sandbox = await service.ready(timeout_s=60)
    # The kernel log needs CAP_SYSLOG: refused to both.
    attack.tried("have the agent read /proc/kmsg")
    result = await service.shell(sandbox.id, "head -c 16 /proc/kmsg")
    assert result.status.exit_code != 0 and b"not permitted" in result.stderr, result
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _read(service, sandbox.id, "/proc/kmsg")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
    attack.held("have the agent read /proc/kmsg")
    # The host's physical page tables are masked: empty for both.
    for path in ("/proc/kpageflags", "/proc/kpagecount"):
        attack.tried(f"read {path}")
        result = await service.shell(sandbox.id, f"head -c 16 {path} | wc -c")
        assert result.stdout.strip() == b"0", (path, result)
        try:
            assert await _read(service, sandbox.id, path) == b"", path
        except grpc.aio.AioRpcError as exc:  # the device bound over it is not a regular file
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        attack.held(f"read {path}")


async def test_user_namespaces_are_refused(service: Any, attack: Any) -> None:
    sandbox = await service.ready(timeout_s=60)
    attack.tried("create a user namespace")
    result = await service.shell(sandbox.id, "unshare -U -r id -u && echo made-one")
    assert result.status.exit_code != 0 and b"made-one" not in result.stdout, result
    assert b"Operation not permitted" in result.stderr, result
    # Also through clone (CLONE_NEWUSER | SIGCHLD), not only unshare.
    clone = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0); "
        "os._exit(0) if pid == 0 else None; "
        "print('errno', ctypes.get_errno() if pid < 0 else 0)"
    )
    result = await service.shell(sandbox.id, f'python3 -c "{clone}"')
    assert result.stdout.strip() == b"errno 1", result
    attack.held("create a user namespace")

    # Tenant beta is not on the operator's list: it cannot ask for them.
    privileges = env_pb2.SandboxPrivileges(user_namespaces=True)
    spec = env_pb2.SandboxSpec(image="host", privileges=privileges)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await service.stub.CreateSandbox(
            api.CreateSandboxRequest(spec=spec), metadata=service.md(BETA_TOKEN)
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "user_namespaces" in (caught.value.details() or "")
    # Tenant alpha may: its sandbox's commands create one.
    asked = await service.ready(timeout_s=60, privileges=privileges)
    result = await service.shell(asked.id, "unshare -U -r id -u")
    assert result.stdout == b"0\n", result


RAW_SOCKET = (
    "import socket; "
    "s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); print('raw-ok')"
)


async def test_raw_sockets_only_when_asked_and_allowed(service: Any, attack: Any) -> None:
    plain = await service.ready(timeout_s=60)
    attack.tried("open a raw socket")
    result = await service.shell(plain.id, f'python3 -c "{RAW_SOCKET}"')
    assert b"raw-ok" not in result.stdout and b"PermissionError" in result.stderr, result
    status = _status_fields(
        (await service.shell(plain.id, "cat /proc/self/status")).stdout.decode()
    )
    assert not int(status["CapEff"], 16) & (1 << CAP_NET_RAW)
    attack.held("open a raw socket")

    privileges = env_pb2.SandboxPrivileges(raw_sockets=True)
    asked = await service.ready(timeout_s=60, privileges=privileges)
    result = await service.shell(asked.id, f'python3 -c "{RAW_SOCKET}"')
    assert result.stdout.strip() == b"raw-ok", result
    agent = _status_fields((await service.shell(asked.id, "cat /proc/1/status")).stdout.decode())
    assert int(agent["CapEff"], 16) == DEFAULT_CAPS | (1 << CAP_NET_RAW)

    # Tenant beta is not on the operator's list.
    spec = env_pb2.SandboxSpec(image="host", privileges=privileges)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await service.stub.CreateSandbox(
            api.CreateSandboxRequest(spec=spec), metadata=service.md(BETA_TOKEN)
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "raw_sockets" in (caught.value.details() or "")


# Each: (name, a Python expression that makes the system call, returning its result).
DENIED_CALLS = {
    "keyctl": "libc.syscall(250, 0, -3, 0, 0, 0)",  # KEYCTL_GET_KEYRING_ID of the session
    "add_key": "libc.syscall(248, b'user', b'k', b'v', 1, -3)",
    "bpf": "libc.syscall(321, 5, 0, 0)",  # BPF_PROG_LOAD
    "perf_event_open": "libc.syscall(298, 0, 0, -1, -1, 0)",
    "userfaultfd": "libc.syscall(323, 0)",
    "io_uring_setup": "libc.syscall(425, 1, 0)",
    "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    "unshare(mount)": "libc.unshare(0x00020000)",
}


async def test_seccomp_refuses_kernel_surface_and_leaves_work_running(
    service: Any, attack: Any
) -> None:
    sandbox = await service.ready(timeout_s=60)
    for name, call in DENIED_CALLS.items():
        attack.tried(f"syscall {name}")
        script = (
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            f"r = {call}; print(r, ctypes.get_errno())"
        )
        result = await service.shell(sandbox.id, f'python3 -c "{script}"')
        assert result.status.exit_code == 0, (name, result)
        value, errno = result.stdout.split()
        assert int(value) == -1 and int(errno) == 1, (name, result)  # EPERM
        attack.held(f"syscall {name}")
    # Ordinary work keeps working: threads, processes, git, pip, a shell pipeline, ptrace of
    # one's own child.
    work = (
        "set -e; python3 -c 'import concurrent.futures as f, subprocess; "
        "assert sum(f.ThreadPoolExecutor(4).map(abs, [-1, -2])) == 3; "
        'subprocess.run(["true"], check=True)\'; '
        "cd /tmp && git init -q repo && cd repo && git -c user.email=a@b -c user.name=a "
        "commit -q --allow-empty -m x && git log --oneline | wc -l; "
        "python3 -m pip --version >/dev/null; "
        "seq 1000 | sort -n | tail -1"
    )
    result = await service.shell(sandbox.id, work)
    assert result.status.exit_code == 0, result
    assert result.stdout.split() == [b"1", b"1000"], result
