"""Reading image archives: an OCI image layout in a tar (``oci-archive``) and ``docker save``
output (``docker-archive``), without unpacking the outer tar.

Both come down to :class:`ImageContents`: the config's digest and the layers in order, each with
the digest of its uncompressed tar (the config's ``diff_ids``). The unpacker checks every layer
against its diff id, and OCI blobs against their descriptors, so the config digest names the
unpacked tree whatever format carried it.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import platform
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from orchard.env.images.reference import ImageReference
from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = ["DigestingReader", "ImageArchive", "ImageContents", "LayerBlob", "open_layer"]

_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_JSON_BYTES = 8 << 20
_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
_REF_NAME = "org.opencontainers.image.ref.name"
_CONTAINERD_NAME = "io.containerd.image.name"
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ARCHES = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}


@dataclass(frozen=True)
class LayerBlob:
    """One layer: where it is in the archive and the digests it must have."""

    member: str
    diff_id: str  # sha256 of the uncompressed tar
    digest: str = ""  # sha256 of the blob as stored, where the format records one (OCI)


@dataclass(frozen=True)
class ImageContents:
    config_digest: str
    layers: tuple[LayerBlob, ...]


class DigestingReader:
    """A read-only stream that hashes what passes through it."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source = source
        self.sha256 = hashlib.sha256()
        self._pending = b""

    def peek(self, size: int) -> bytes:
        if len(self._pending) < size:
            self._pending += self.source.read(size - len(self._pending))
        return self._pending[:size]

    def read(self, size: int = -1) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            if size < 0:
                data += self.source.read()
            elif size < len(data):
                data, self._pending = data[:size], data[size:]
        else:
            data = self.source.read(size)
        self.sha256.update(data)
        return data

    def drain(self) -> str:
        """Read what is left (a tar's end padding) and return ``sha256:<hex>`` of it all."""
        while self.read(1 << 20):
            pass
        return "sha256:" + self.sha256.hexdigest()


def open_layer(blob: IO[bytes], what: str) -> tuple[DigestingReader, DigestingReader]:
    """(stored, uncompressed) digesting streams of a layer blob: gzip or plain tar."""
    stored = DigestingReader(blob)
    magic = stored.peek(4)
    if magic.startswith(_ZSTD_MAGIC):
        raise RuntimeFailure(
            FailureReason.IMAGE_INVALID,
            f"{what} is zstd-compressed, which this runtime cannot read; rebuild the image "
            "with gzip layers (e.g. `skopeo copy --dest-compress-format gzip`)",
        )
    if magic.startswith(_GZIP_MAGIC):
        plain = gzip.GzipFile(fileobj=stored, mode="rb")  # type: ignore[call-overload]
        return stored, DigestingReader(plain)
    return stored, stored


class ImageArchive:
    """An open archive; :meth:`contents` picks the referenced image and checks its metadata."""

    def __init__(self, reference: ImageReference) -> None:
        self.reference = reference
        path = reference.path
        if not os.path.exists(path):
            raise self._failure(f"{path} does not exist", FailureReason.IMAGE_NOT_FOUND)
        if not os.path.isfile(path):
            raise self._failure(f"{path} is not a file")
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by close()
        except (tarfile.TarError, EOFError, OSError) as error:
            raise self._failure(f"{path} is not a readable tar archive ({error})") from None
        self._members: dict[str, tarfile.TarInfo] = {}
        for member in self._tar.getmembers():
            self._members[os.path.normpath(member.name).lstrip("/")] = member

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> ImageArchive:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _failure(
        self, what: str, reason: FailureReason = FailureReason.IMAGE_INVALID
    ) -> RuntimeFailure:
        return RuntimeFailure(reason, f"image {self.reference}: {what}")

    # -- members -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def open_member(self, name: str) -> Iterator[IO[bytes]]:
        member = self._members.get(os.path.normpath(name).lstrip("/"))
        if member is None or not (member.isfile() or member.issym() or member.islnk()):
            raise self._failure(f"{name} is missing from the archive")
        try:
            stream = self._tar.extractfile(member)
        except (KeyError, tarfile.TarError) as error:  # a dangling link inside the archive
            raise self._failure(f"{name} cannot be read ({error})") from None
        if stream is None:
            raise self._failure(f"{name} is not a file")
        with stream:
            yield stream

    def _json(self, name: str, digest: str = "") -> tuple[Any, str]:
        """The parsed JSON of ``name`` and its ``sha256:`` digest (checked against ``digest``)."""
        with self.open_member(name) as stream:
            data = stream.read(_MAX_JSON_BYTES + 1)
        if len(data) > _MAX_JSON_BYTES:
            raise self._failure(f"{name} is larger than {_MAX_JSON_BYTES} bytes")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest and actual != digest:
            raise self._failure(f"{name} does not match its digest {digest} (it is {actual})")
        try:
            return json.loads(data), actual
        except ValueError as error:
            raise self._failure(f"{name} is not valid JSON ({error})") from None

    def _check_digest(self, digest: object, where: str) -> str:
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise self._failure(f"{where}: digest {digest!r} is not sha256:<64 hex digits>")
        return digest

    # -- formats -----------------------------------------------------------------------------

    def contents(self) -> ImageContents:
        if self.reference.kind == "oci-archive":
            return self._oci()
        return self._docker()

    def _oci(self) -> ImageContents:
        if "index.json" not in self._members:
            hint = (
                " (a docker save archive? use docker-archive:)"
                if ("manifest.json" in self._members)
                else ""
            )
            raise self._failure(f"no index.json: not an OCI image layout{hint}")
        index, _ = self._json("index.json")
        descriptor = self._pick_manifest(self._manifests(index, "index.json"))
        digest = descriptor["digest"]
        manifest, _ = self._json(_blob(digest), digest)
        config = _field(manifest, "config", dict) or {}
        config_digest = self._check_digest(config.get("digest"), "the manifest's config")
        config_json, _ = self._json(_blob(config_digest), config_digest)
        diff_ids = self._diff_ids(config_json)
        layers = _field(manifest, "layers", list)
        if layers is None or len(layers) != len(diff_ids):
            raise self._failure(
                f"manifest {digest} lists {len(layers or [])} layers, its config "
                f"{len(diff_ids)} diff ids"
            )
        blobs = []
        for position, (layer, diff_id) in enumerate(zip(layers, diff_ids, strict=True)):
            where = f"layer {position + 1} of manifest {digest}"
            layer_digest = self._check_digest(
                layer.get("digest") if isinstance(layer, dict) else None, where
            )
            blobs.append(LayerBlob(_blob(layer_digest), diff_id, layer_digest))
        return ImageContents(config_digest, tuple(blobs))

    def _manifests(self, index: Any, where: str, depth: int = 0) -> list[dict[str, Any]]:
        """The image manifests an index lists, nested indexes (multi-platform) expanded."""
        found: list[dict[str, Any]] = []
        for descriptor in _field(index, "manifests", list) or []:
            if not isinstance(descriptor, dict):
                raise self._failure(f"{where} lists a manifest that is not an object")
            digest = self._check_digest(descriptor.get("digest"), where)
            if descriptor.get("mediaType") in (_OCI_INDEX, _DOCKER_LIST):
                if depth >= 2:
                    raise self._failure(f"{where}: indexes nested too deep")
                nested, _ = self._json(_blob(digest), digest)
                for inner in self._manifests(nested, f"index {digest}", depth + 1):
                    names = {**descriptor.get("annotations", {}), **inner.get("annotations", {})}
                    found.append({**inner, "annotations": names})
            else:
                found.append(descriptor)
        return found

    def _pick_manifest(self, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        reference = self.reference
        if not manifests:
            raise self._failure("the index lists no image")
        if reference.digest:
            for descriptor in manifests:
                if descriptor["digest"] == reference.digest:
                    return descriptor
            raise self._failure(
                f"no manifest {reference.digest} in the index", FailureReason.IMAGE_NOT_FOUND
            )
        if reference.tag:
            for descriptor in manifests:
                annotations = descriptor.get("annotations") or {}
                names = (annotations.get(_REF_NAME), annotations.get(_CONTAINERD_NAME))
                if reference.tag in names or _docker_name(reference.tag) in {
                    _docker_name(name) for name in names if name
                }:
                    return descriptor
            tags = sorted(
                {(d.get("annotations") or {}).get(_REF_NAME) or "" for d in manifests} - {""}
            )
            raise self._failure(
                f"no manifest tagged {reference.tag!r} (tags: {', '.join(tags) or 'none'})",
                FailureReason.IMAGE_NOT_FOUND,
            )
        here = _ARCHES.get(platform.machine(), platform.machine())
        for descriptor in manifests:
            wanted = descriptor.get("platform")
            if not isinstance(wanted, dict) or (
                wanted.get("os", "linux") == "linux" and wanted.get("architecture") == here
            ):
                return descriptor
        raise self._failure(
            f"no image for linux/{here} in the index", FailureReason.IMAGE_NOT_FOUND
        )

    def _docker(self) -> ImageContents:
        if "manifest.json" not in self._members:
            hint = " (an OCI layout? use oci-archive:)" if "index.json" in self._members else ""
            raise self._failure(f"no manifest.json: not a docker save archive{hint}")
        entries, _ = self._json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise self._failure("manifest.json lists no image")
        entry = self._pick_docker_entry(entries)
        config_name = _field(entry, "Config", str)
        if not config_name:
            raise self._failure("a manifest.json entry has no Config")
        named = re.search(r"([0-9a-f]{64})(?:\.json)?$", config_name)
        config_json, config_digest = self._json(config_name, f"sha256:{named[1]}" if named else "")
        diff_ids = self._diff_ids(config_json)
        layers = _field(entry, "Layers", list)
        if layers is None or len(layers) != len(diff_ids):
            raise self._failure(
                f"manifest.json lists {len(layers or [])} layers, the config {len(diff_ids)} "
                "diff ids"
            )
        for layer in layers:
            if not isinstance(layer, str):
                raise self._failure(f"manifest.json: layer {layer!r} is not a path")
        return ImageContents(
            config_digest,
            tuple(LayerBlob(name, diff) for name, diff in zip(layers, diff_ids, strict=True)),
        )

    def _pick_docker_entry(self, entries: list[Any]) -> dict[str, Any]:
        reference = self.reference
        if reference.digest:
            for entry in entries:
                config = _field(entry, "Config", str) or ""
                if reference.digest.removeprefix("sha256:") in config:
                    return entry  # type: ignore[no-any-return]
            raise self._failure(
                f"no image with config {reference.digest}", FailureReason.IMAGE_NOT_FOUND
            )
        if not reference.tag:
            first = entries[0]
            if not isinstance(first, dict):
                raise self._failure("manifest.json: an entry is not an object")
            return first
        wanted = _docker_name(reference.tag)
        tags: list[str] = []
        for entry in entries:
            repo_tags = _field(entry, "RepoTags", list) or []
            tags += [tag for tag in repo_tags if isinstance(tag, str)]
            if wanted in {_docker_name(tag) for tag in repo_tags if isinstance(tag, str)}:
                return entry  # type: ignore[no-any-return]
        raise self._failure(
            f"no image tagged {reference.tag!r} (tags: {', '.join(tags) or 'none'})",
            FailureReason.IMAGE_NOT_FOUND,
        )

    def _diff_ids(self, config: Any) -> list[str]:
        rootfs = _field(config, "rootfs", dict) or {}
        if rootfs.get("type") != "layers" or not isinstance(rootfs.get("diff_ids"), list):
            raise self._failure("the image config has no rootfs.diff_ids")
        return [self._check_digest(diff, "a config diff id") for diff in rootfs["diff_ids"]]


def _blob(digest: str) -> str:
    algorithm, _, hex_digest = digest.partition(":")
    return f"blobs/{algorithm}/{hex_digest}"


def _field(value: Any, name: str, kind: type) -> Any:
    field = value.get(name) if isinstance(value, dict) else None
    return field if isinstance(field, kind) else None


def _docker_name(name: str) -> str:
    """``busybox`` → ``docker.io/library/busybox:latest``, as docker names images."""
    repository, at, digest = name.partition("@")
    last = repository.rsplit("/", 1)[-1]
    if not at and ":" not in last:
        repository += ":latest"
    first, slash, _ = repository.partition("/")
    if not slash or not ("." in first or ":" in first or first == "localhost"):
        repository = "docker.io/" + ("library/" if not slash else "") + repository
    return repository + at + digest
