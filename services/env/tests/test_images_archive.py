"""oci-archive and docker-archive images: unpacking, the cache, and refusing bad archives."""

from __future__ import annotations

import gzip
import importlib.util
import os
import stat
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from orchard.env.images import ImageResolver, parse_image_reference
from orchard.env.runtime.base import FailureReason, RuntimeFailure


def _load_builders() -> Any:
    name = "image_archives"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


build = _load_builders()
Member, directory, symlink, hard_link = (
    build.Member,
    build.directory,
    build.symlink,
    build.hard_link,
)


def failure(resolver: ImageResolver, image: str) -> RuntimeFailure:
    with pytest.raises(RuntimeFailure) as caught:
        resolver.resolve(image)
    return caught.value


def cache_is_clean(cache: Path) -> bool:
    return not any((cache / "rootfs").iterdir()) and not any((cache / "tmp").iterdir())


def lower_layer(root: Path) -> None:
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    (root / "bin" / "tool").chmod(0o4755)
    os.link(root / "bin" / "tool", root / "bin" / "tool-link")
    (root / "bin" / "sh").symlink_to("/bin/tool")
    (root / "etc").mkdir()
    (root / "etc" / "gone").write_text("deleted by the next layer\n")
    (root / "etc" / "secret").write_text("0600\n")
    (root / "etc" / "secret").chmod(0o600)
    (root / "home" / "user").mkdir(parents=True)
    os.chown(root / "home" / "user", 1234, 5678)
    (root / "opaque" / "sub").mkdir(parents=True)
    (root / "opaque" / "old").write_text("hidden by the opaque whiteout\n")
    (root / "opaque" / "sub" / "deep").write_text("hidden too\n")
    (root / "removed-dir").mkdir()
    (root / "removed-dir" / "file").write_text("x\n")


def upper_layer(root: Path) -> None:
    (root / "etc" / "gone").unlink()
    (root / "removed-dir" / "file").unlink()
    (root / "removed-dir").rmdir()
    (root / "etc" / "added").write_text("layer 2\n")


OPAQUE_LAYER = [
    directory("opaque"),
    Member("opaque/.wh..wh..opq", b""),
    Member("opaque/new", b"from the opaque layer\n"),
]


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One three-layer image as an oci-archive and a docker-archive (built once)."""
    if build.TOOLS_MISSING:
        pytest.fail(f"{build.TOOLS_REASON} (`make setup` installs them)")
    base = tmp_path_factory.mktemp("layered")
    layout = build.OciLayout(base / "oci", "v1")
    layout.layer(lower_layer)
    layout.layer(upper_layer)
    layout.raw_layer(OPAQUE_LAYER)
    return {
        "oci": layout.oci_archive(base / "image-oci.tar", "v1"),
        "docker": layout.docker_archive(base / "image-docker.tar", "tools/layered:v1"),
    }


@pytest.mark.root
def test_layers_apply_in_order_with_whiteouts(layered: dict[str, str], tmp_path: Path) -> None:
    resolver = ImageResolver(str(tmp_path / "cache"))
    resolved = resolver.resolve(layered["oci"])
    (root,) = map(Path, resolved.lower_dirs)
    assert not (root / "etc" / "gone").exists()
    assert not (root / "removed-dir").exists()
    assert (root / "etc" / "added").read_text() == "layer 2\n"
    assert sorted(os.listdir(root / "opaque")) == ["new"]
    assert not any(name.startswith(".wh.") for _, _, names in os.walk(root) for name in names)
    tool = (root / "bin" / "tool").lstat()
    assert stat.S_IMODE(tool.st_mode) == 0o4755
    assert (root / "bin" / "tool-link").lstat().st_ino == tool.st_ino
    assert os.readlink(root / "bin" / "sh") == "/bin/tool"
    assert stat.S_IMODE((root / "etc" / "secret").lstat().st_mode) == 0o600
    home = (root / "home" / "user").lstat()
    assert (home.st_uid, home.st_gid) == (1234, 5678)
    assert resolver.cache is not None and resolver.cache.unpacked == 1


@pytest.mark.root
def test_both_formats_and_new_resolvers_reuse_one_unpack(
    layered: dict[str, str], tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    first = ImageResolver(cache)
    path = first.resolve(layered["oci"]).lower_dirs
    marker = os.stat(path[0]).st_ino
    # The config digest names the tree, so the docker form of the same image is a hit.
    again = ImageResolver(cache)  # as a restarted service would
    assert again.resolve(layered["docker"]).lower_dirs == path
    assert again.resolve(layered["docker"].rsplit(":", 2)[0]).lower_dirs == path  # first image
    assert again.resolve(layered["oci"]).lower_dirs == path
    assert first.cache is not None and again.cache is not None
    assert (first.cache.unpacked, again.cache.unpacked) == (1, 0)
    assert os.stat(path[0]).st_ino == marker


@pytest.mark.root
def test_concurrent_resolves_unpack_once(layered: dict[str, str], tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    resolvers = [ImageResolver(cache) for _ in range(2)]
    results: list[tuple[str, ...]] = []
    barrier = threading.Barrier(8)

    def resolve(index: int) -> None:
        barrier.wait()
        image = layered["oci"] if index % 2 else layered["docker"]
        results.append(resolvers[index % 2].resolve(image).lower_dirs)

    threads = [threading.Thread(target=resolve, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert sum(r.cache.unpacked for r in resolvers if r.cache is not None) == 1
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_tags_and_digests_pick_the_image(tmp_path: Path) -> None:
    archive = tmp_path / "two.tar"
    written = build.write_oci_archive(
        archive,
        {
            "one": [build.layer_tar([Member("which", b"one\n")])],
            "two": [build.layer_tar([Member("which", b"two\n")])],
        },
    )
    resolver = ImageResolver(str(tmp_path / "cache"))

    def which(image: str) -> str:
        return Path(resolver.resolve(image).lower_dirs[0], "which").read_text()

    assert which(f"oci-archive:{archive}") == "one\n"  # no tag: the first
    assert which(f"oci-archive:{archive}:two") == "two\n"
    assert which(f"oci-archive:{archive}@{written['one'].manifest_digest}") == "one\n"
    missing = failure(resolver, f"oci-archive:{archive}:three")
    assert missing.reason is FailureReason.IMAGE_NOT_FOUND and "tags: one, two" in str(missing)
    unknown = failure(resolver, f"oci-archive:{archive}@sha256:{'0' * 64}")
    assert unknown.reason is FailureReason.IMAGE_NOT_FOUND


def test_plain_layers_fifos_and_device_nodes(tmp_path: Path) -> None:
    archive = tmp_path / "plain.tar"
    layer = build.layer_tar(
        [
            directory("dev"),
            Member("dev/sda", type=tarfile.BLKTYPE, mode=0o666),
            Member("dev/ttyX", type=tarfile.CHRTYPE, mode=0o666),
            Member("run-fifo", type=tarfile.FIFOTYPE, mode=0o640),
            Member("file", b"plain\n"),
        ]
    )
    build.write_oci_archive(archive, {"latest": [layer]}, compress=lambda data: data)
    root = Path(
        ImageResolver(str(tmp_path / "cache")).resolve(f"oci-archive:{archive}").lower_dirs[0]
    )
    assert (root / "file").read_text() == "plain\n"
    assert os.listdir(root / "dev") == []  # device nodes are never made
    assert stat.S_ISFIFO((root / "run-fifo").lstat().st_mode)


MALICIOUS = {
    "dotdot": [[Member("../escape", b"out\n")]],
    "dotdot-inside": [[directory("a"), Member("a/../../escape", b"out\n")]],
    "absolute": [[Member("/escape", b"out\n")]],
    "symlink-then-file": [[symlink("evil", "{outside}"), Member("evil/escape", b"out\n")]],
    "relative-symlink-then-file": [
        [symlink("evil", "../../../../../../../../{outside}"), Member("evil/escape", b"out\n")]
    ],
    "symlink-in-lower-layer": [[symlink("evil", "{outside}")], [Member("evil/escape", b"out\n")]],
    "hard-link-outside": [[hard_link("link", "../../outside-file")]],
    "whiteout-through-symlink": [[symlink("evil", "{outside}")], [Member("evil/.wh.keep", b"")]],
}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_layers_are_refused_without_writing_outside(tmp_path: Path, case: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep\n")
    layers = []
    for members in MALICIOUS[case]:
        for member in members:
            member.linkname = member.linkname.format(outside=str(outside).lstrip("/"))
            if member.type == tarfile.SYMTYPE and "../" not in member.linkname:
                member.linkname = "/" + member.linkname
        layers.append(build.layer_tar(members))
    archive = tmp_path / "evil.tar"
    build.write_oci_archive(archive, {"latest": layers})
    cache = tmp_path / "cache"
    caught = failure(ImageResolver(str(cache)), f"oci-archive:{archive}")
    assert caught.reason is FailureReason.IMAGE_INVALID
    assert str(archive) in str(caught) and "layer" in str(caught)
    assert sorted(os.listdir(outside)) == ["keep"]
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()
    assert cache_is_clean(cache)


def _zstd_frame(data: bytes) -> bytes:
    return b"\x28\xb5\x2f\xfd" + data  # the magic is all the refusal looks at


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("tampered-layer", "does not match its digest"),
        ("tampered-manifest", "does not match its digest"),
        ("truncated-gzip", "unreadable"),
        ("zstd", "zstd-compressed"),
        ("wrong-diff-id", "diff id"),
    ],
)
def test_corrupt_archives_are_image_invalid(tmp_path: Path, case: str, expected: str) -> None:
    layer = build.layer_tar([Member("file", b"data\n" * 1000)])
    compressed = gzip.compress(layer, mtime=0)
    layers = [layer]
    compress: Any = lambda data: gzip.compress(data, mtime=0)  # noqa: E731
    tamper: Any = lambda name, data: data  # noqa: E731
    if case == "tampered-layer":
        other = gzip.compress(layer + b"\0" * 512)
        tamper = lambda name, data: other if data == compressed else data  # noqa: E731
    elif case == "tampered-manifest":
        tamper = lambda name, data: data.replace(b'"schemaVersion": 2', b'"schemaVersion":2')  # noqa: E731
    elif case == "truncated-gzip":
        compress = lambda data: compressed[: len(compressed) // 2]  # noqa: E731
    elif case == "zstd":
        compress = _zstd_frame
    else:
        layers = [build.layer_tar([Member("file", b"other\n")])]
        compress = lambda data: compressed  # noqa: E731
    archive = tmp_path / "bad.tar"
    build.write_oci_archive(archive, {"latest": layers}, compress=compress, tamper=tamper)
    cache = tmp_path / "cache"
    caught = failure(ImageResolver(str(cache)), f"oci-archive:{archive}")
    assert caught.reason is FailureReason.IMAGE_INVALID, caught
    assert expected in str(caught) and str(archive) in str(caught)
    if (cache / "rootfs").exists():
        assert cache_is_clean(cache)


def test_missing_and_unreadable_archives(tmp_path: Path) -> None:
    resolver = ImageResolver(str(tmp_path / "cache"))
    missing = failure(resolver, f"docker-archive:{tmp_path}/none.tar")
    assert missing.reason is FailureReason.IMAGE_NOT_FOUND and "does not exist" in str(missing)
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 100)
    broken = failure(resolver, f"oci-archive:{garbage}")
    assert broken.reason is FailureReason.IMAGE_INVALID and "tar" in str(broken)
    oci = tmp_path / "oci.tar"
    build.write_oci_archive(oci, {"latest": [build.layer_tar([Member("f", b"")])]})
    wrong_kind = failure(resolver, f"docker-archive:{oci}")
    assert wrong_kind.reason is FailureReason.IMAGE_INVALID and "oci-archive:" in str(wrong_kind)
    no_cache = failure(ImageResolver(), f"oci-archive:{oci}")
    assert no_cache.reason is FailureReason.IMAGE_INVALID and "cache" in str(no_cache)


def test_digest_references_parse() -> None:
    digest = "sha256:" + "ab" * 32
    reference = parse_image_reference(f"oci-archive:/images/x.tar@{digest}")
    assert (reference.path, reference.tag, reference.digest) == ("/images/x.tar", "", digest)
    assert str(reference) == f"oci-archive:/images/x.tar@{digest}"
    named = parse_image_reference("docker-archive:/images/x.tar:library/busybox:1.36")
    assert (named.path, named.tag) == ("/images/x.tar", "library/busybox:1.36")
