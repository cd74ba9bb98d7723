"""Downloads write only below the destination the caller gave, whatever the sandbox lists.

The server here is hostile on purpose: a real gRPC ``EnvService`` on loopback whose ListFiles
answers what an impostor agent answered (``../escaped.txt``, absolute names, separators, NUL,
a link to plant before a file, a tree that never ends). It is the attacker, so it is a test
double; the client, the CLI and the file system are real.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.v1 import env_pb2, env_service_pb2, env_service_pb2_grpc
from orchard.sdk import AsyncSandboxClient, SandboxClient, errors
from orchard.sdk.cli import main
from orchard.types.v1 import files_pb2

TOKEN = "hostile-test-token"
SANDBOX_ID = "sbx-hostile"
PAYLOAD = b"written by the sandbox\n"


def _entry(parent: str, name: str, kind: int, target: str = "") -> files_pb2.FileInfo:
    return files_pb2.FileInfo(
        path=f"{parent.rstrip('/')}/{name}",
        name=name,
        type=kind,
        size=len(PAYLOAD) if kind == files_pb2.FILE_TYPE_REGULAR else len(target),
        mode=0o644 if kind != files_pb2.FILE_TYPE_DIRECTORY else 0o755,
        symlink_target=target,
    )


REGULAR, DIRECTORY, SYMLINK = (
    files_pb2.FILE_TYPE_REGULAR,
    files_pb2.FILE_TYPE_DIRECTORY,
    files_pb2.FILE_TYPE_SYMLINK,
)


class HostileEnvService(env_service_pb2_grpc.EnvServiceServicer):  # type: ignore[misc]
    """Answers GetSandbox, StatFile, ListFiles and ReadFile with what ``listings`` says."""

    def __init__(self) -> None:
        self.listings: dict[str, list[files_pb2.FileInfo]] = {}
        self.endless = False  # every directory holds one more directory

    def GetSandbox(self, request: Any, context: Any) -> Any:
        sandbox = env_pb2.Sandbox(id=request.sandbox_id, state=env_pb2.SANDBOX_STATE_READY)
        return env_service_pb2.GetSandboxResponse(sandbox=sandbox)

    def HeartbeatSandbox(self, request: Any, context: Any) -> Any:
        return env_service_pb2.HeartbeatSandboxResponse()

    def StatFile(self, request: Any, context: Any) -> Any:
        path = request.path.rstrip("/") or "/"
        kind = DIRECTORY if path in self.listings or self.endless else REGULAR
        info = _entry(path.rsplit("/", 1)[0] or "/", path.rsplit("/", 1)[1], kind)
        info.path = path
        return env_service_pb2.StatFileResponse(info=info)

    def ListFiles(self, request: Any, context: Any) -> Any:
        if self.endless:
            return env_service_pb2.ListFilesResponse(entries=[_entry(request.path, "d", DIRECTORY)])
        return env_service_pb2.ListFilesResponse(entries=self.listings.get(request.path, []))

    def ReadFile(self, request: Any, context: Any) -> Iterator[Any]:
        info = _entry("/", "f", REGULAR)
        yield env_service_pb2.ReadFileResponse(info=info, data=PAYLOAD)


@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Any, str]]:
    servicer = HostileEnvService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    env_service_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in list(os.environ):
        if name.startswith("ORCHARD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ORCHARD_STATE_DIR", str(tmp_path / "state"))
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait(10)


def _outside(tmp_path: Path) -> list[Path]:
    """Everything written next to the destination (not below it)."""
    return sorted(
        path for path in tmp_path.iterdir() if path.name not in ("dest", "state", "outside")
    ) + sorted((tmp_path / "outside").iterdir())


HOSTILE_NAMES = {
    "parent": "../escaped.txt",
    "dotdot": "..",
    "dot": ".",
    "empty": "",
    "absolute": "{outside}/escaped.txt",
    "separator": "a/../../escaped.txt",
    "nul": "escaped\0.txt",
}


@pytest.mark.parametrize("name", HOSTILE_NAMES.values(), ids=HOSTILE_NAMES.keys())
def test_download_refuses_names_that_leave_the_destination(
    hostile: tuple[Any, str], tmp_path: Path, name: str
) -> None:
    servicer, address = hostile
    (tmp_path / "outside").mkdir()
    entry = _entry("/dir", "x", REGULAR)
    name = name.format(outside=tmp_path / "outside")
    entry.name = name
    entry.path = f"/dir/{name}"
    servicer.listings["/dir"] = [_entry("/dir", "ok.txt", REGULAR), entry]
    with SandboxClient(address, token=TOKEN) as client:
        sandbox = client.get(SANDBOX_ID)
        with pytest.raises(errors.UnsafeListing):
            sandbox.download("/dir", tmp_path / "dest")
    assert _outside(tmp_path) == []
    assert not (tmp_path / "escaped.txt").exists()


def test_a_planted_link_is_replaced_not_followed(hostile: tuple[Any, str], tmp_path: Path) -> None:
    """A link named like the download's temporary file, listed before the file, would make
    the file's content land on the link's target outside the destination."""
    servicer, address = hostile
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    servicer.listings["/dir"] = [
        _entry("/dir", ".f.orchard-partial", SYMLINK, str(victim)),
        _entry("/dir", "f", REGULAR),
    ]
    with SandboxClient(address, token=TOKEN) as client:
        client.get(SANDBOX_ID).download("/dir", tmp_path / "dest")
    assert not victim.exists() and not victim.is_symlink()
    assert (tmp_path / "dest" / "f").read_bytes() == PAYLOAD
    assert _outside(tmp_path) == []


def test_a_name_listed_twice_cannot_turn_a_link_into_a_directory(
    hostile: tuple[Any, str], tmp_path: Path
) -> None:
    servicer, address = hostile
    outside = tmp_path / "outside"
    outside.mkdir()
    servicer.listings["/dir"] = [
        _entry("/dir", "sub", SYMLINK, str(outside)),
        _entry("/dir", "sub", DIRECTORY),
    ]
    servicer.listings["/dir/sub"] = [_entry("/dir/sub", "escaped.txt", REGULAR)]
    with SandboxClient(address, token=TOKEN) as client, pytest.raises(errors.UnsafeListing):
        client.get(SANDBOX_ID).download("/dir", tmp_path / "dest")
    assert _outside(tmp_path) == []


def test_a_link_in_the_destination_is_not_written_through(
    hostile: tuple[Any, str], tmp_path: Path
) -> None:
    """A directory entry whose local path is already a link (left by an earlier download into
    the same destination) is refused rather than followed."""
    servicer, address = hostile
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    servicer.listings["/dir"] = [_entry("/dir", "sub", DIRECTORY)]
    servicer.listings["/dir/sub"] = [_entry("/dir/sub", "escaped.txt", REGULAR)]
    with SandboxClient(address, token=TOKEN) as client, pytest.raises(errors.UnsafeListing):
        client.get(SANDBOX_ID).download("/dir", dest)
    assert _outside(tmp_path) == []


def test_an_endless_tree_is_refused(hostile: tuple[Any, str], tmp_path: Path) -> None:
    servicer, address = hostile
    servicer.endless = True

    async def download() -> None:
        async with AsyncSandboxClient(address, token=TOKEN) as client:
            sandbox = await client.get(SANDBOX_ID)
            await sandbox.download("/dir", tmp_path / "dest")

    with pytest.raises(errors.UnsafeListing, match="directories deep"):
        asyncio.run(download())


def test_the_async_client_and_the_cli_refuse_too(
    hostile: tuple[Any, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer, address = hostile
    (tmp_path / "outside").mkdir()
    servicer.listings["/dir"] = [_entry("/dir", "../escaped.txt", REGULAR)]

    async def download() -> None:
        async with AsyncSandboxClient(address, token=TOKEN) as client:
            sandbox = await client.get(SANDBOX_ID)
            await sandbox.download("/dir", tmp_path / "dest")

    with pytest.raises(errors.UnsafeListing):
        asyncio.run(download())

    monkeypatch.setenv("ORCHARD_ENDPOINT", address)
    monkeypatch.setenv("ORCHARD_TOKEN", TOKEN)
    code = main(["sandbox", "cp", f"{SANDBOX_ID}:/dir", str(tmp_path / "dest")])
    err = capsys.readouterr().err
    assert code != 0 and "escaped.txt" in err, err
    assert _outside(tmp_path) == []
    assert not (tmp_path / "escaped.txt").exists()
