"""The file RPCs (ReadFile, WriteFile, ListFiles, StatFile, and Exec's working directory) with
paths an attacker chooses: ``..`` chains, absolute host paths, symlinks made inside the sandbox
that point at ``/``, ``/proc/1/root`` or a host path. Every one resolves inside the sandbox's
own root (a busybox root that holds nothing of the host's): no host file is read or written."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

UP = "../" * 32


async def read(env: Any, sandbox_id: str, path: str) -> tuple[grpc.StatusCode, bytes]:
    """The status of a ReadFile and whatever content came before it."""
    data = b""
    call = env.stub.ReadFile(
        api.ReadFileRequest(sandbox_id=sandbox_id, path=path), metadata=env.md()
    )
    try:
        async for reply in call:
            data += reply.data
    except grpc.aio.AioRpcError as exc:
        return exc.code(), data
    return grpc.StatusCode.OK, data


async def write(
    env: Any, sandbox_id: str, path: str, data: bytes, *, make_parents: bool = False
) -> grpc.StatusCode:
    async def chunks() -> AsyncIterator[api.WriteFileRequest]:
        header = api.WriteFileHeader(sandbox_id=sandbox_id, path=path, make_parents=make_parents)
        yield api.WriteFileRequest(header=header)
        yield api.WriteFileRequest(data=data)

    try:
        await env.stub.WriteFile(chunks(), metadata=env.md())
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def names(env: Any, sandbox_id: str, path: str, token: str = "") -> list[str] | None:
    """The entries ListFiles returns for ``path``, or None when it refused."""
    request = api.ListFilesRequest(sandbox_id=sandbox_id, path=path, page_token=token)
    try:
        reply = await env.stub.ListFiles(request, metadata=env.md())
    except grpc.aio.AioRpcError:
        return None
    return [entry.name for entry in reply.entries]


async def stat(env: Any, sandbox_id: str, path: str, follow: bool) -> grpc.StatusCode:
    request = api.StatFileRequest(sandbox_id=sandbox_id, path=path, follow_symlinks=follow)
    try:
        await env.stub.StatFile(request, metadata=env.md())
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def sh(env: Any, sandbox_id: str, script: str, working_dir: str = "") -> Any:
    command = exec_pb2.Command(shell=script, working_dir=working_dir)
    request = api.ExecRequest(sandbox_id=sandbox_id, command=command)
    return (await env.stub.Exec(request, metadata=env.md())).result


@pytest.fixture
async def jail(isolated: Any, busybox_image: str, host_secret: Any) -> Any:
    """A busybox sandbox holding symlinks an attacker made: to ``/``, ``/proc/1/root``, a
    ``..`` chain and the host's secret folder."""
    sandbox = await isolated.ready(image=busybox_image, timeout_s=60)
    made = await sh(
        isolated,
        sandbox.id,
        f"ln -s / /tmp/to-root && ln -s /proc/1/root /tmp/to-proc-root && "
        f"ln -s {UP} /tmp/up && ln -s {host_secret.mount} /tmp/to-host && "
        f"ln -s {host_secret.file} /tmp/to-secret && ln -s /proc/self/root /tmp/to-self-root",
    )
    assert made.status.exit_code == 0, made
    return sandbox


def _reads(secret: Any) -> list[str]:
    path = str(secret.file)
    return [
        path,
        UP + path.lstrip("/"),
        "/" + UP + path.lstrip("/"),
        f"/tmp/{UP}{path.lstrip('/')}",
        "/tmp/to-root" + path,
        "/tmp/to-proc-root" + path,
        "/tmp/to-self-root" + path,
        "/tmp/up" + path,
        "/tmp/to-host/secret.txt",
        "/tmp/to-secret",
        "/proc/1/root" + path,
        "/proc/self/root" + path,
        "/proc/1/cwd/" + UP + path.lstrip("/"),
        "//" + path,
        path + "/.",
    ]


async def test_reads_never_reach_a_host_file(
    isolated: Any, jail: Any, host_secret: Any, attack: Any
) -> None:
    for path in _reads(host_secret):
        attack.tried(f"ReadFile {path}")
        code, data = await read(isolated, jail.id, path)
        assert code != grpc.StatusCode.OK and host_secret.content not in data, (path, code)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (path, code)
        attack.held(f"ReadFile {path}")
        attack.tried(f"StatFile {path}")
        assert await stat(isolated, jail.id, path, follow=True) != grpc.StatusCode.OK, path
        attack.held(f"StatFile {path}")


async def test_listings_show_only_the_sandbox(
    isolated: Any, jail: Any, host_secret: Any, attack: Any
) -> None:
    own_root = await names(isolated, jail.id, "/")
    assert own_root is not None and "bin" in own_root
    # The host's root has what a busybox root lacks.
    host_only = {entry.name for entry in Path("/").iterdir()} - set(own_root)
    assert host_only
    for path in ("/tmp/to-root", "/tmp/to-proc-root", "/tmp/to-self-root", "/tmp/up", UP):
        attack.tried(f"ListFiles {path}")
        listed = await names(isolated, jail.id, path)
        assert listed == own_root, (path, listed)
        attack.held(f"ListFiles {path}")
    for path in (str(host_secret.mount), "/tmp/to-host", "/proc/1/root" + str(host_secret.mount)):
        attack.tried(f"ListFiles {path}")
        assert await names(isolated, jail.id, path) is None, path
        attack.held(f"ListFiles {path}")
    attack.tried("ListFiles with a forged page token")
    forged = await names(isolated, jail.id, "/", token="b3JjaGFyZC8uLi8uLi8=")
    assert forged is None or set(forged) <= set(own_root)
    attack.held("ListFiles with a forged page token")


async def test_writes_never_reach_a_host_folder(
    isolated: Any, jail: Any, host_secret: Any, tmp_path: Path, attack: Any
) -> None:
    target = tmp_path / "host-target"
    target.mkdir()
    linked = await sh(isolated, jail.id, f"ln -s {target} /tmp/to-target")
    assert linked.status.exit_code == 0
    rel = str(target).lstrip("/")
    paths = [
        f"{target}/abs.txt",
        f"{UP}{rel}/up.txt",
        f"/tmp/{UP}{rel}/tmp-up.txt",
        f"/tmp/to-root/{rel}/via-root.txt",
        f"/tmp/to-proc-root/{rel}/via-proc.txt",
        f"/tmp/up/{rel}/via-up.txt",
        "/tmp/to-target/via-link.txt",
        f"/proc/1/root/{rel}/proc-root.txt",
        f"/proc/self/root/{rel}/self-root.txt",
    ]
    for path in paths:
        for make_parents in (False, True):
            attack.tried(f"WriteFile {path} make_parents={make_parents}")
            code = await write(isolated, jail.id, path, b"pwned", make_parents=make_parents)
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (path, code)
            assert list(target.iterdir()) == [], (path, code)
            attack.held(f"WriteFile {path} make_parents={make_parents}")
    attack.tried("WriteFile over the host secret through a symlink")
    await write(isolated, jail.id, "/tmp/to-secret", b"pwned")
    await write(isolated, jail.id, "/tmp/to-host/secret.txt", b"pwned")
    assert host_secret.file.read_bytes() == host_secret.content
    attack.held("WriteFile over the host secret through a symlink")


async def test_the_agent_bundle_cannot_be_replaced(isolated: Any, jail: Any, attack: Any) -> None:
    """Every sandbox runs the same agent bundle from the host: overwriting it is an escape."""
    from orchard.env.runtime.local.config import default_agent_bundle

    bundle = Path(default_agent_bundle(), "orchard-inagent")
    before = hashlib.sha256(bundle.read_bytes()).hexdigest()
    for path in ("/.orchard/inagent/orchard-inagent", "/.orchard/inagent/evil"):
        attack.tried(f"WriteFile {path}")
        code = await write(isolated, jail.id, path, b"#!/bin/sh\necho pwned\n")
        assert code != grpc.StatusCode.OK, path
        attack.held(f"WriteFile {path}")
    assert hashlib.sha256(bundle.read_bytes()).hexdigest() == before
    assert not Path(default_agent_bundle(), "evil").exists()


async def test_exec_working_dir_stays_inside(
    isolated: Any, jail: Any, host_secret: Any, attack: Any
) -> None:
    for working_dir in (UP, str(host_secret.mount), "/tmp/to-host", "/proc/1/root/" + UP):
        attack.tried(f"Exec in working_dir {working_dir}")
        try:
            result = await sh(isolated, jail.id, "cat secret.txt; pwd -P", working_dir)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        else:
            assert host_secret.content not in result.stdout, (working_dir, result)
        attack.held(f"Exec in working_dir {working_dir}")
