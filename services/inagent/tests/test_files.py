"""WriteFile, ReadFile, ListFiles and StatFile against a real agent process."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import files_pb2

Stub = pb_grpc.AgentServiceStub
CHUNK = 64 * 1024


def write_messages(header: pb.WriteFileHeader, data: bytes) -> Iterator[pb.WriteFileRequest]:
    yield pb.WriteFileRequest(header=header)
    for start in range(0, len(data), CHUNK):
        yield pb.WriteFileRequest(data=data[start : start + CHUNK])


def write(stub: Stub, path: str, data: bytes, **header: Any) -> pb.WriteFileResponse:
    messages = write_messages(pb.WriteFileHeader(path=path, **header), data)
    return stub.WriteFile(messages, timeout=30)


def read(stub: Stub, path: str, **request: Any) -> tuple[files_pb2.FileInfo, bytes]:
    replies = list(stub.ReadFile(pb.ReadFileRequest(path=path, **request), timeout=30))
    assert replies[0].HasField("info")
    assert all(not r.HasField("info") for r in replies[1:])
    return replies[0].info, b"".join(r.data for r in replies)


def expect(code: grpc.StatusCode, words: str, call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    assert caught.value.code() == code, caught.value.details()
    assert words in caught.value.details(), caught.value.details()
    return caught.value


# --- write and read


def test_round_trip_of_a_multi_mib_random_file(stub: Stub, tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024 + 123)
    target = tmp_path / "blob.bin"
    reply = write(stub, str(target), data)
    assert reply.sha256 == hashlib.sha256(data).hexdigest()
    assert reply.info.size == len(data)
    assert reply.info.type == files_pb2.FILE_TYPE_REGULAR
    assert reply.info.path == str(target)
    assert reply.info.name == "blob.bin"
    assert reply.info.mode == 0o644
    assert target.read_bytes() == data
    info, back = read(stub, str(target))
    assert back == data
    assert info.size == len(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin"]  # no temporary left


def test_empty_file_and_relative_path(stub: Stub, agent: Any) -> None:
    reply = write(stub, "empty.txt", b"")
    target = agent.working_dir / "empty.txt"
    try:
        assert reply.info.path == str(target)
        assert target.read_bytes() == b""
        info, data = read(stub, "empty.txt")
        assert (info.size, data) == (0, b"")
    finally:
        target.unlink()


def test_mode_and_overwrite(stub: Stub, tmp_path: Path) -> None:
    target = tmp_path / "f"
    write(stub, str(target), b"one", mode=0o600)
    assert (target.stat().st_mode & 0o7777) == 0o600
    reply = write(stub, str(target), b"two", mode=0o755)
    assert target.read_bytes() == b"two"
    assert reply.info.mode == 0o755


def test_no_overwrite_refuses_an_existing_file(stub: Stub, tmp_path: Path) -> None:
    target = tmp_path / "keep"
    target.write_bytes(b"old")
    error = expect(
        grpc.StatusCode.ALREADY_EXISTS,
        "exists",
        lambda: write(stub, str(target), b"new", no_overwrite=True),
    )
    info = error_info(error)
    assert info is not None and info.reason == "ALREADY_EXISTS"
    assert target.read_bytes() == b"old"
    write(stub, str(tmp_path / "fresh"), b"new", no_overwrite=True)
    assert (tmp_path / "fresh").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "keep"]


def test_make_parents(stub: Stub, tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c.txt"
    expect(
        grpc.StatusCode.NOT_FOUND,
        "set make_parents",
        lambda: write(stub, str(target), b"x"),
    )
    write(stub, str(target), b"x", make_parents=True)
    assert target.read_bytes() == b"x"


def test_write_over_a_directory_is_failed_precondition(stub: Stub, tmp_path: Path) -> None:
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "is a directory",
        lambda: write(stub, str(tmp_path), b"x"),
    )


def test_header_must_come_first_and_only_first(stub: Stub, tmp_path: Path) -> None:
    target = str(tmp_path / "f")
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "first WriteFile message must carry the header",
        lambda: stub.WriteFile(iter([pb.WriteFileRequest(data=b"x")]), timeout=10),
    )
    twice = [pb.WriteFileRequest(header=pb.WriteFileHeader(path=target))] * 2
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "only the first",
        lambda: stub.WriteFile(iter(twice), timeout=10),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "ended without a header",
        lambda: stub.WriteFile(iter([]), timeout=10),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside 0o7777",
        lambda: write(stub, target, b"", mode=0o170000),
    )
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_the_old_file_and_no_temporary(
    stub: Stub, tmp_path: Path, procs: Any
) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"original")

    def broken() -> Iterator[pb.WriteFileRequest]:
        yield pb.WriteFileRequest(header=pb.WriteFileHeader(path=str(target)))
        yield pb.WriteFileRequest(data=os.urandom(CHUNK))
        raise RuntimeError("client gives up half way")

    with pytest.raises(grpc.RpcError):
        stub.WriteFile(broken(), timeout=10)
    assert procs.wait_until(lambda: [p.name for p in tmp_path.iterdir()] == ["precious"])
    assert target.read_bytes() == b"original"


def test_cancelled_write_leaves_the_old_file(stub: Stub, tmp_path: Path, procs: Any) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"original")
    gate = __import__("threading").Event()

    def stalled() -> Iterator[pb.WriteFileRequest]:
        yield pb.WriteFileRequest(header=pb.WriteFileHeader(path=str(target)))
        yield pb.WriteFileRequest(data=b"partial")
        gate.wait(10)

    future = stub.WriteFile.future(stalled(), timeout=30)
    assert procs.wait_until(lambda: len(list(tmp_path.iterdir())) == 2)  # the temporary
    future.cancel()
    gate.set()
    assert procs.wait_until(lambda: [p.name for p in tmp_path.iterdir()] == ["precious"])
    assert target.read_bytes() == b"original"


def test_read_with_offset_limit_and_chunk_size(stub: Stub, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    target = tmp_path / "r"
    target.write_bytes(data)
    replies = list(
        stub.ReadFile(
            pb.ReadFileRequest(path=str(target), offset=10, limit=50_000, chunk_size=4096),
            timeout=10,
        )
    )
    assert b"".join(r.data for r in replies) == data[10:50_010]
    assert max(len(r.data) for r in replies) == 4096
    assert read(stub, str(target), offset=99_990)[1] == data[99_990:]
    assert read(stub, str(target), offset=200_000)[1] == b""


def test_read_errors(stub: Stub, tmp_path: Path) -> None:
    expect(grpc.StatusCode.NOT_FOUND, "No such file", lambda: read(stub, str(tmp_path / "x")))
    expect(grpc.StatusCode.FAILED_PRECONDITION, "is a directory", lambda: read(stub, str(tmp_path)))
    os.mkfifo(tmp_path / "fifo")
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "not a regular file",
        lambda: read(stub, str(tmp_path / "fifo")),
    )
    (tmp_path / "f").write_bytes(b"x")
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "offset",
        lambda: read(stub, str(tmp_path / "f"), offset=-1),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT, "limit", lambda: read(stub, str(tmp_path / "f"), limit=-1)
    )


# --- list and stat


def test_listing_pages_sorted_bytewise_with_a_non_utf8_name(stub: Stub, tmp_path: Path) -> None:
    names = [f"file{i:02d}" for i in range(23)] + ["B", "a", "é"]
    for name in names:
        (tmp_path / name).write_text(name)
    (tmp_path / "dir").mkdir()
    bad = os.fsencode(tmp_path) + b"/bad\xff\xfe"
    with open(bad, "wb") as file:
        file.write(b"odd")
    expected = sorted([n.encode() for n in [*names, "dir"]] + [b"bad\xff\xfe"])

    seen: list[files_pb2.FileInfo] = []
    token = ""
    pages = 0
    while True:
        reply = stub.ListFiles(
            pb.ListFilesRequest(path=str(tmp_path), page_size=10, page_token=token), timeout=10
        )
        pages += 1
        seen.extend(reply.entries)
        token = reply.next_page_token
        if not token:
            break
    assert pages == 3
    raw_names = [e.raw_path.rsplit(b"/", 1)[1] if e.raw_path else e.name.encode() for e in seen]
    assert raw_names == expected
    odd = next(e for e in seen if e.raw_path)
    assert odd.name == "bad\\xff\\xfe"
    assert odd.path == f"{tmp_path}/bad\\xff\\xfe"
    assert odd.raw_path == bad
    assert odd.size == 3
    kinds = {e.name: e.type for e in seen}
    assert kinds["dir"] == files_pb2.FILE_TYPE_DIRECTORY
    assert kinds["a"] == files_pb2.FILE_TYPE_REGULAR
    # the escaped path can be read back only through raw bytes; the display form is for people
    assert stub.ListFiles(pb.ListFilesRequest(path=str(tmp_path)), timeout=10).next_page_token == ""


def test_listing_errors(stub: Stub, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "page_token",
        lambda: stub.ListFiles(
            pb.ListFilesRequest(path=str(tmp_path), page_token="bogus!"), timeout=5
        ),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "page_size",
        lambda: stub.ListFiles(
            pb.ListFilesRequest(path=str(tmp_path), page_size=10_001), timeout=5
        ),
    )
    expect(
        grpc.StatusCode.NOT_FOUND,
        "No such file",
        lambda: stub.ListFiles(pb.ListFilesRequest(path=str(tmp_path / "none")), timeout=5),
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "Not a directory",
        lambda: stub.ListFiles(pb.ListFilesRequest(path=str(tmp_path / "f")), timeout=5),
    )


def test_stat_follows_symlinks_only_when_asked(stub: Stub, tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"12345")
    (tmp_path / "link").symlink_to("target")
    link = stub.StatFile(pb.StatFileRequest(path=str(tmp_path / "link")), timeout=5).info
    assert link.type == files_pb2.FILE_TYPE_SYMLINK
    assert link.symlink_target == "target"
    assert link.size == len("target")
    followed = stub.StatFile(
        pb.StatFileRequest(path=str(tmp_path / "link"), follow_symlinks=True), timeout=5
    ).info
    assert followed.type == files_pb2.FILE_TYPE_REGULAR
    assert followed.size == 5
    assert followed.modify_time.seconds > 0
    expect(
        grpc.StatusCode.NOT_FOUND,
        "No such file",
        lambda: stub.StatFile(pb.StatFileRequest(path=str(tmp_path / "gone")), timeout=5),
    )


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("", "path is empty"),
        ("/tmp/a\0b", "NUL byte"),
        ("/" + "x/" * 2100, "PATH_MAX"),
        ("/tmp/" + "y" * 256, "NAME_MAX"),
    ],
)
def test_bad_paths_are_invalid_for_every_file_rpc(stub: Stub, path: str, words: str) -> None:
    calls = [
        lambda: stub.StatFile(pb.StatFileRequest(path=path), timeout=5),
        lambda: stub.ListFiles(pb.ListFilesRequest(path=path), timeout=5),
        lambda: read(stub, path),
        lambda: write(stub, path, b"x"),
    ]
    for call in calls:
        error = expect(grpc.StatusCode.INVALID_ARGUMENT, words, call)
        info = error_info(error)
        assert info is not None and info.reason == "INVALID_PATH"
    assert stub.GetAgentInfo(pb.GetAgentInfoRequest(), timeout=5).version
