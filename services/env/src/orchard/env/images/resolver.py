"""Resolving an image reference to the read-only directories a sandbox's root stacks.

- ``host``: the host's root file system, read-only. Only the root mount itself shows: an
  overlay lower layer never crosses into the mounts below it (``/proc``, ``/sys``, ``/dev``,
  ...), so ``/`` serves as the layer directly.
- ``rootfs:/abs/dir``: a directory holding a root file system, used in place (never written).
- ``oci-archive:/path[:tag|@digest]`` (an OCI image layout in a tar) and
  ``docker-archive:/path[:name:tag|@digest]`` (``docker save`` output): unpacked once, layers
  applied in order with their whiteouts, into one flattened directory per image config digest
  under the resolver's cache (:mod:`orchard.env.images.cache`); that directory is the single
  lower layer. Flattened rather than one directory per layer: OCI whiteouts would need
  rewriting as overlayfs ones (device nodes, trusted xattrs), and a long layer list must fit in
  one page of mount options; the price is no sharing of base layers between images.

Every path is checked against the sandbox's :class:`~orchard.env.images.trust.ImageTrust` on
its real path, here, when the runtime creates the sandbox (whatever the service checked when the
request came), and that real path is what is mounted or unpacked.

Resolving an archive blocks for as long as unpacking takes: call it from a thread.
"""

from __future__ import annotations

import logging
import os
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchard.env.images.archive import ImageArchive, ImageContents, open_layer
from orchard.env.images.cache import ImageCache
from orchard.env.images.layers import LayerError, apply_layer
from orchard.env.images.reference import ImageReference, parse_image_reference
from orchard.env.images.trust import OPERATOR, ImageTrust, check_image, real_paths
from orchard.env.runtime.base import FailureReason, RuntimeFailure

log = logging.getLogger(__name__)

__all__ = ["ImageResolver", "ResolvedImage"]

# overlayfs splits lowerdir on ':' and its options on ','.
_UNUSABLE_IN_LAYER_PATHS = (",", ":", "\n")


@dataclass(frozen=True)
class ResolvedImage:
    """An image as directories: ``lower_dirs`` top layer first, all read-only; for the host
    image, ``masked_paths``: real host paths the sandbox must not see."""

    reference: ImageReference
    lower_dirs: tuple[str, ...]
    is_host: bool = False
    masked_paths: tuple[str, ...] = ()


class ImageResolver:
    """Resolves references; ``cache_dir`` holds unpacked archives (without it, archive images
    are refused). ``protected`` are the caller's own directories: never an image source, and
    hidden from host sandboxes (the cache directory is one of them)."""

    def __init__(self, cache_dir: str | None = None, protected: Sequence[str] = ()) -> None:
        self.cache_dir = cache_dir
        self.protected = (*protected, *((cache_dir,) if cache_dir else ()))
        self.cache = ImageCache(cache_dir) if cache_dir else None
        if cache_dir and any(char in cache_dir for char in _UNUSABLE_IN_LAYER_PATHS):
            raise ValueError(f"image cache {cache_dir!r}: no ',' or ':' (overlayfs lowerdir)")

    def resolve(self, image: str, trust: ImageTrust | None = None) -> ResolvedImage:
        """The directories of ``image`` as ``trust`` allows them (None: the operator's own
        call); raises :class:`RuntimeFailure` (IMAGE_*)."""
        trust = trust or OPERATOR
        reference = check_image(parse_image_reference(image), trust, self.protected)
        if reference.kind == "host":
            masked = real_paths((*self.protected, *trust.host_masked_paths))
            return ResolvedImage(reference, ("/",), is_host=True, masked_paths=masked)
        if reference.kind == "rootfs":
            return ResolvedImage(reference, (self._rootfs_dir(reference),))
        return ResolvedImage(reference, (self._unpacked(reference),))

    def _unpacked(self, reference: ImageReference) -> str:
        if self.cache is None:
            raise RuntimeFailure(
                FailureReason.IMAGE_INVALID,
                f"image {reference}: archive images need an image cache directory, and this "
                "resolver has none",
            )
        cache = self.cache
        with ImageArchive(reference) as archive:
            contents = archive.contents()
            unpacked = cache.rootfs(
                contents.config_digest,
                lambda staging: _unpack(archive, contents, staging, str(reference)),
            )
        # The real path: the sandbox's setup refuses a layer whose path has a symlink in it.
        return os.path.realpath(unpacked)

    @staticmethod
    def _rootfs_dir(reference: ImageReference) -> str:
        path = reference.path
        if not os.path.isdir(path):
            raise RuntimeFailure(
                FailureReason.IMAGE_NOT_FOUND, f"image {reference}: {path} is not a directory"
            )
        if any(char in path for char in _UNUSABLE_IN_LAYER_PATHS):
            raise RuntimeFailure(
                FailureReason.IMAGE_INVALID,
                f"image {reference}: the path may not contain ',' or ':' (overlayfs)",
            )
        return path


def _unpack(archive: ImageArchive, contents: ImageContents, root: str, image: str) -> None:
    started = time.monotonic()
    for position, layer in enumerate(contents.layers, start=1):
        what = f"image {image}: layer {position} ({layer.member})"
        with archive.open_member(layer.member) as blob:
            stored, plain = open_layer(blob, what)
            try:
                with tarfile.open(fileobj=plain, mode="r|") as tar:  # type: ignore[call-overload]
                    stats = apply_layer(tar, root)
                diff_id = plain.drain()
                digest = stored.drain()
            except LayerError as error:
                raise RuntimeFailure(FailureReason.IMAGE_INVALID, f"{what}: {error}") from None
            except (tarfile.TarError, EOFError, OSError) as error:
                raise RuntimeFailure(
                    FailureReason.IMAGE_INVALID, f"{what}: unreadable ({error})"
                ) from None
        if layer.digest and digest != layer.digest:
            raise RuntimeFailure(
                FailureReason.IMAGE_INVALID,
                f"{what}: the blob does not match its digest {layer.digest} (it is {digest})",
            )
        if diff_id != layer.diff_id:
            raise RuntimeFailure(
                FailureReason.IMAGE_INVALID,
                f"{what}: the uncompressed layer does not match its diff id {layer.diff_id} "
                f"(it is {diff_id})",
            )
        if stats.skipped_devices:
            log.info("skipped device nodes", extra={"image": image, "count": stats.skipped_devices})
    log.info(
        "image unpacked",
        extra={
            "image": image,
            "config": contents.config_digest,
            "layers": len(contents.layers),
            "seconds": round(time.monotonic() - started, 3),
        },
    )
