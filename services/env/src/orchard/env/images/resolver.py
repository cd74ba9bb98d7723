"""Resolving an image reference to the read-only directories a sandbox's root stacks.

- ``host``: the host's root file system, read-only. Only the root mount itself shows: an
  overlay lower layer never crosses into the mounts below it (``/proc``, ``/sys``, ``/dev``,
  ...), so ``/`` serves as the layer directly.
- ``rootfs:/abs/dir``: a directory holding a root file system, used in place (never written).
- ``oci-archive:`` / ``docker-archive:``: not yet. They will be unpacked once, whiteouts
  applied, into a content-addressed directory under the resolver's cache and resolve to it,
  so the runtime's side does not change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from orchard.env.images.reference import ImageReference, parse_image_reference
from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = ["ImageResolver", "ResolvedImage"]

# overlayfs splits lowerdir on ':' and its options on ','.
_UNUSABLE_IN_LAYER_PATHS = (",", ":", "\n")


@dataclass(frozen=True)
class ResolvedImage:
    """An image as directories: ``lower_dirs`` top layer first, all read-only."""

    reference: ImageReference
    lower_dirs: tuple[str, ...]
    is_host: bool = False


class ImageResolver:
    """Resolves references; ``cache_dir`` will hold unpacked archives."""

    def __init__(self, cache_dir: str | None = None) -> None:
        self.cache_dir = cache_dir

    def resolve(self, image: str) -> ResolvedImage:
        """The directories of ``image``; raises :class:`RuntimeFailure` (IMAGE_*)."""
        reference = parse_image_reference(image)
        if reference.kind == "host":
            return ResolvedImage(reference, ("/",), is_host=True)
        if reference.kind == "rootfs":
            return ResolvedImage(reference, (self._rootfs_dir(reference),))
        raise RuntimeFailure(
            FailureReason.IMAGE_INVALID,
            f"image {image!r}: {reference.kind} images are not supported by this runtime yet; "
            "unpack it (e.g. `umoci unpack`) and use rootfs:/path/to/rootfs",
        )

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
