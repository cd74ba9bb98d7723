"""The artifact layer: URL checks (the attacks a tenant could try), round trips on file:// and
memory://, get_dir's cache, and the statuses its errors become on a real gRPC server."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fsspec
import grpc
import pytest

from orchard.core.artifacts import (
    ArtifactAccessDenied,
    ArtifactNotFound,
    ArtifactSchemeUnavailable,
    ArtifactsConfig,
    ArtifactStore,
    ArtifactUrlInvalid,
    as_url,
    parse_url,
)
from orchard.core.config import ConfigError, load_config
from orchard.core.errors import OrchardError, error_info
from orchard.core.server import GrpcServer, ServiceBinding


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def store(store_dir: Path, tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(store_dir.as_uri(), cache_dir=tmp_path / "cache")


@pytest.fixture
def memory_store(tmp_path: Path) -> Iterator[ArtifactStore]:
    bucket = f"test-{uuid.uuid4().hex[:8]}"
    yield ArtifactStore(f"memory://{bucket}", cache_dir=tmp_path / "cache")
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("/etc/passwd", "file:///etc/passwd"),
        ("data/train.jsonl", "file:///ABSOLUTE/PATH"),
        ("file:///srv/store/../../etc/passwd", "'..'"),
        ("file:///srv/store/%2e%2e/etc", "'..'"),
        ("file:///srv/store/./x", "'.'"),
        ("file:///srv//x", "empty"),
        ("file://otherhost/srv/x", "not a host"),
        ("file:///srv/x?version=2", "query"),
        ("file:///srv/x#frag", "fragment"),
        ("simplecache::file:///srv/x", "chained"),
        ("zip://member::file:///srv/a.zip", "chained"),
        ("tar:///srv/a.tar", "not an artifact store scheme"),
        ("s3://user:secret@bucket/key", "credentials"),
        ("s3:///key", "bucket"),
        ("file:///srv/x\n", "control"),
    ],
)
def test_malformed_urls_are_refused_with_what_to_write(url: str, says: str) -> None:
    with pytest.raises(ArtifactUrlInvalid) as caught:
        parse_url(url, what="spec.dataset")
    assert says in caught.value.message
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason.reason == "ARTIFACT_URL_INVALID"


def test_canonical_forms() -> None:
    assert parse_url("file:///srv/store/").url == "file:///srv/store"
    assert parse_url("file://localhost/srv/a%20b").url == "file:///srv/a b"
    assert parse_url("memory://bucket/a/b").url == "memory:///bucket/a/b"
    assert parse_url("s3://bucket/key/x").url == "s3://bucket/key/x"
    assert as_url("/srv/store") == "file:///srv/store"


def test_urls_outside_the_store_are_denied(store: ArtifactStore, store_dir: Path) -> None:
    for url in (
        "file:///etc/passwd",
        "file:///etc/shadow",
        store_dir.parent.as_uri(),  # the folder above the root
        store_dir.as_uri() + "-sibling/x",  # a prefix of the name is not a parent
        "http://169.254.169.254/latest/meta-data",
        "https://example.com/model",
        "memory://x/y",
    ):
        with pytest.raises(ArtifactAccessDenied) as caught:
            store.check(url, what="spec.dataset")
        assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "artifacts.allowed" in caught.value.message
    assert store.check(store_dir.as_uri() + "/d/x.jsonl").path == str(store_dir / "d/x.jsonl")


def test_symlink_out_of_the_store_is_denied(store: ArtifactStore, store_dir: Path) -> None:
    (store_dir / "escape").symlink_to("/etc")
    (store_dir / "passwd").symlink_to("/etc/passwd")
    inside = store_dir / "inside.txt"
    inside.write_text("ok")
    (store_dir / "alias").symlink_to(inside)
    for name in ("escape/passwd", "passwd"):
        with pytest.raises(ArtifactAccessDenied) as caught:
            store.read_bytes(f"{store_dir.as_uri()}/{name}")
        assert "resolves to file:///etc" in caught.value.message
    assert store.read_bytes(f"{store_dir.as_uri()}/alias") == b"ok"  # a link inside stays


def test_a_folder_with_a_link_out_of_the_store_is_denied(
    store: ArtifactStore, store_dir: Path
) -> None:
    # a model loader follows links inside the folder, then saves what it read into a
    # checkpoint the tenant can read back: the folder is refused as a whole
    model = store_dir / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(ArtifactAccessDenied) as caught:
        store.get_dir(store.url("model"))
    assert "sub/tokenizer.json -> file:///etc/passwd" in caught.value.message
    (model / "sub" / "tokenizer.json").unlink()
    (model / "sub" / "tokenizer.json").symlink_to(model / "config.json")  # inside: fine
    assert store.get_dir(store.url("model")) == model


def test_allowed_prefixes_widen_what_clients_may_name(store_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "models").mkdir(parents=True)
    (shared / "models" / "a.txt").write_text("a")
    store = ArtifactStore(store_dir.as_uri(), allowed=[(shared / "models").as_uri()])
    assert store.read_bytes((shared / "models" / "a.txt").as_uri()) == b"a"
    with pytest.raises(ArtifactAccessDenied):
        store.check((shared / "other").as_uri())
    web = ArtifactStore(store_dir.as_uri(), allowed=["https://models.example.com/orchard"])
    assert web.check("https://models.example.com/orchard/m1").url.startswith("https://")
    with pytest.raises(ArtifactAccessDenied):
        web.check("https://models.example.com/other")


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_round_trips(
    kind: str, store: ArtifactStore, memory_store: ArtifactStore, tmp_path: Path
) -> None:
    chosen = store if kind == "file" else memory_store
    url = chosen.url("datasets", "a.jsonl")
    assert not chosen.exists(url)
    assert chosen.write_bytes(url, b'{"id": 1}\n') == url
    assert chosen.exists(url) and chosen.is_file(url)
    assert chosen.read_bytes(url) == b'{"id": 1}\n'
    with chosen.open_read(url, text=True) as lines:
        assert [line.strip() for line in lines] == ['{"id": 1}']
    with chosen.open_write(chosen.url("datasets", "b.jsonl")) as out:
        out.write(b"streamed")
    assert chosen.list(chosen.url("datasets")) == [
        chosen.url("datasets", "a.jsonl"),
        chosen.url("datasets", "b.jsonl"),
    ]
    local = tmp_path / f"model-{kind}"
    (local / "sub").mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "sub" / "w.bin").write_bytes(os.urandom(1000))
    folder_url = chosen.put_dir(local, chosen.url("models", "m1"))
    assert chosen.is_dir(folder_url)
    with pytest.raises(OrchardError) as again:
        chosen.put_dir(local, folder_url)
    assert again.value.code == grpc.StatusCode.ALREADY_EXISTS
    got = chosen.get_dir(folder_url)
    assert (got / "config.json").read_text() == "{}"
    assert (got / "sub" / "w.bin").read_bytes() == (local / "sub" / "w.bin").read_bytes()
    with pytest.raises(ArtifactNotFound):
        chosen.read_bytes(chosen.url("datasets", "missing.jsonl"))
    with pytest.raises(ArtifactNotFound):
        chosen.require(chosen.url("models", "m1"), what="spec.dataset")  # a folder, not a file


def test_file_writes_are_atomic(store: ArtifactStore, store_dir: Path) -> None:
    url = store.url("out.bin")
    store.write_bytes(url, b"first")
    with pytest.raises(RuntimeError), store.open_write(url) as out:
        out.write(b"half")
        raise RuntimeError("the writer died")
    assert store.read_bytes(url) == b"first"  # the old content stays whole
    assert sorted(p.name for p in store_dir.iterdir()) == ["out.bin"]  # no temporary left


def test_get_dir_returns_file_folders_in_place(store: ArtifactStore, store_dir: Path) -> None:
    (store_dir / "m").mkdir()
    assert store.get_dir(store.url("m")) == store_dir / "m"
    with pytest.raises(ArtifactNotFound):
        store.get_dir(store.url("missing"))


def test_get_dir_downloads_once_per_url(memory_store: ArtifactStore, tmp_path: Path) -> None:
    local = tmp_path / "m"
    local.mkdir()
    (local / "config.json").write_text("{}")
    url = memory_store.put_dir(local, memory_store.url("models", "m"))
    cache = tmp_path / "cache"
    first = memory_store.get_dir(url)
    assert first.parent == cache and (first / "config.json").is_file()
    # a second call finds the copy: the store's object going away does not matter any more
    fsspec.filesystem("memory").rm(parse_url(url).path, recursive=True)
    assert memory_store.get_dir(url) == first
    assert [p.name for p in cache.iterdir()] == [first.name]  # no staging folder left
    with pytest.raises(ArtifactNotFound):
        memory_store.get_dir(memory_store.url("models", "gone"))
    assert [p.name for p in cache.iterdir()] == [first.name]


def test_unknown_driver_says_what_to_install(tmp_path: Path) -> None:
    store = ArtifactStore("s3://bucket/orchard")
    with pytest.raises(ArtifactSchemeUnavailable) as caught:
        store.exists("s3://bucket/orchard/x")
    assert "s3fs" in caught.value.message and caught.value.code.name == "FAILED_PRECONDITION"


def test_os_permission_error_is_permission_denied(store: ArtifactStore, store_dir: Path) -> None:
    # root reads every mode, so a read-only mount is the refusal a service meets here
    if os.geteuid() != 0:
        (store_dir / "locked").mkdir(mode=0o000)
        url = store.url("locked", "x")
    else:
        url = "file:///proc/1/mem"
        store = ArtifactStore("file:///proc/1")
    with pytest.raises(OrchardError) as caught:
        store.read_bytes(url)
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_config_turns_paths_into_urls(tmp_path: Path) -> None:
    config = ArtifactsConfig(root=str(tmp_path / "store"), allowed=["memory://shared"])
    assert config.root == (tmp_path / "store").as_uri()
    assert config.store().prefixes == [(tmp_path / "store").as_uri(), "memory:///shared"]
    from orchard.core.config import ServiceConfig

    class WithArtifacts(ServiceConfig):
        artifacts: ArtifactsConfig = ArtifactsConfig()

    with pytest.raises(ConfigError) as caught:
        load_config(WithArtifacts, argv=["--set", "artifacts.root=file:///a/../b"], env={})
    assert "artifacts.root" in str(caught.value) and ".." in str(caught.value)


# -- the statuses a client sees --------------------------------------------------------------

SERVICE = "orchard.test.v1.Artifacts"


@pytest.fixture
async def channel(store: ArtifactStore) -> AsyncIterator[grpc.aio.Channel]:
    async def read(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return store.read_bytes(store.check(request.decode(), what="request.url").url)

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Read": grpc.unary_unary_rpc_method_handler(read, None, None)}
    )
    async with (
        GrpcServer("test", [ServiceBinding.generic(handler)]) as server,
        grpc.aio.insecure_channel(server.addresses[0]) as channel,
    ):
        yield channel


async def test_errors_reach_clients_as_statuses(
    channel: grpc.aio.Channel, store: ArtifactStore, store_dir: Path
) -> None:
    read = channel.unary_unary(f"/{SERVICE}/Read")
    (store_dir / "ok.txt").write_text("fine")
    assert await read(store.url("ok.txt").encode()) == b"fine"
    cases = [
        (b"file:///etc/shadow", grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED"),
        (b"/etc/shadow", grpc.StatusCode.INVALID_ARGUMENT, "ARTIFACT_URL_INVALID"),
        (store.url("no.txt").encode(), grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND"),
    ]
    for request, code, reason in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read(request)
        assert caught.value.code() == code
        info = error_info(caught.value)
        assert info is not None and info.reason == reason
        assert info.metadata["url"] == request.decode()
        assert request.decode() in (caught.value.details() or "")
