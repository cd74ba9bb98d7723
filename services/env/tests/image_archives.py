"""Building image archives for the image tests, offline.

Two ways: ``umoci`` + ``skopeo`` (real tools, real layer diffs, real format conversion), and
:func:`write_oci_archive`, which writes an OCI layout tar from hand-made layers (for layers no
tool would make: malicious ones, device nodes, corrupt blobs).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

TOOLS_MISSING = [tool for tool in ("umoci", "skopeo") if shutil.which(tool) is None]
TOOLS_REASON = f"needs {' and '.join(TOOLS_MISSING)} (apt-get install umoci skopeo)"


def run(*argv: str | Path) -> None:
    subprocess.run([str(arg) for arg in argv], check=True, capture_output=True, timeout=120)


class OciLayout:
    """An OCI image layout built layer by layer with umoci: each :meth:`layer` unpacks the
    image, lets ``change`` edit the root file system, and repacks the difference."""

    def __init__(self, directory: Path, tag: str = "latest") -> None:
        self.directory = directory
        self.tag = tag
        self.image = f"{directory}:{tag}"
        run("umoci", "init", "--layout", directory)
        run("umoci", "new", "--image", self.image)
        self._bundles = 0

    def layer(self, change: Callable[[Path], None]) -> None:
        self._bundles += 1
        bundle = self.directory.parent / f"{self.directory.name}-bundle{self._bundles}"
        run("umoci", "unpack", "--image", self.image, bundle)
        change(bundle / "rootfs")
        run("umoci", "repack", "--image", self.image, bundle)
        shutil.rmtree(bundle)

    def raw_layer(self, members: Sequence[Member]) -> None:
        """Append a hand-made layer verbatim (whiteouts as given)."""
        path = self.directory.parent / f"{self.directory.name}-raw.tar"
        path.write_bytes(layer_tar(members))
        run("umoci", "raw", "add-layer", "--image", self.image, path)
        path.unlink()

    def oci_archive(self, path: Path, tag: str = "") -> str:
        run("skopeo", "copy", f"oci:{self.image}", f"oci-archive:{path}" + (f":{tag}" * bool(tag)))
        return f"oci-archive:{path}" + (f":{tag}" * bool(tag))

    def docker_archive(self, path: Path, name: str = "") -> str:
        target = f"docker-archive:{path}" + (f":{name}" * bool(name))
        run("skopeo", "copy", f"oci:{self.image}", target)
        return target


@dataclass
class Member:
    """One entry of a hand-made layer."""

    name: str
    data: bytes | None = None  # a regular file when set
    type: bytes = tarfile.REGTYPE
    linkname: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


def directory(name: str, mode: int = 0o755) -> Member:
    return Member(name, type=tarfile.DIRTYPE, mode=mode)


def symlink(name: str, target: str) -> Member:
    return Member(name, type=tarfile.SYMTYPE, linkname=target, mode=0o777)


def hard_link(name: str, target: str) -> Member:
    return Member(name, type=tarfile.LNKTYPE, linkname=target)


def layer_tar(members: Sequence[Member]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            info = tarfile.TarInfo(member.name)
            info.type = member.type if member.data is None else tarfile.REGTYPE
            info.linkname = member.linkname
            info.mode = member.mode
            info.uid, info.gid = member.uid, member.gid
            info.mtime = 1_700_000_000
            if member.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
                info.devmajor, info.devminor = 8, 0
            data = member.data or b""
            info.size = len(data) if member.data is not None else 0
            tar.addfile(info, io.BytesIO(data) if member.data is not None else None)
    return out.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class WrittenImage:
    manifest_digest: str
    config_digest: str
    layer_digests: list[str]


def write_oci_archive(
    path: Path,
    images: dict[str, Sequence[bytes]],
    *,
    compress: Callable[[bytes], bytes] = lambda data: gzip.compress(data, mtime=0),
    tamper: Callable[[str, bytes], bytes] = lambda name, data: data,
) -> dict[str, WrittenImage]:
    """Write an OCI layout tar holding one image per tag (its layer tars, bottom first).
    ``tamper(blob_name, data)`` may alter a blob after its digest is taken."""
    blobs: dict[str, bytes] = {}
    index: list[dict[str, object]] = []
    written: dict[str, WrittenImage] = {}
    for tag, layers in images.items():
        stored = [compress(layer) for layer in layers]
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Labels": {"tag": tag}},
                "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in layers]},
            }
        ).encode()
        layer_media = "application/vnd.oci.image.layer.v1.tar+gzip"
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": _digest(config),
                    "size": len(config),
                },
                "layers": [
                    {"mediaType": layer_media, "digest": _digest(blob), "size": len(blob)}
                    for blob in stored
                ],
            }
        ).encode()
        for blob in (config, manifest, *stored):
            blobs[_digest(blob)] = blob
        index.append(
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _digest(manifest),
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        )
        written[tag] = WrittenImage(
            _digest(manifest), _digest(config), [_digest(blob) for blob in stored]
        )
    files = {
        "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
        "index.json": json.dumps({"schemaVersion": 2, "manifests": index}).encode(),
    }
    for digest, blob in blobs.items():
        name = "blobs/sha256/" + digest.removeprefix("sha256:")
        files[name] = tamper(name, blob)
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return written
