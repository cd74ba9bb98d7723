"""Image references: ``host``, ``rootfs:/abs/dir``, ``oci-archive:/path[:tag|@digest]``,
``docker-archive:/path[:name:tag|@digest]``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = ["ImageKind", "ImageReference", "parse_image_reference"]

ImageKind = Literal["host", "rootfs", "oci-archive", "docker-archive"]
_KINDS: tuple[ImageKind, ...] = ("host", "rootfs", "oci-archive", "docker-archive")
_DIGEST = re.compile(r"(?P<path>.+)@(?P<digest>sha256:[0-9a-f]{64})")


@dataclass(frozen=True)
class ImageReference:
    """A parsed image name: its kind, the path it points at (if any) and, for archives, an
    optional tag or ``sha256:`` digest picking one image of several."""

    kind: ImageKind
    path: str = ""
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        if self.kind == "host":
            return "host"
        text = f"{self.kind}:{self.path}"
        if self.digest:
            return f"{text}@{self.digest}"
        return text + (f":{self.tag}" if self.tag else "")


def parse_image_reference(text: str) -> ImageReference:
    """Parse ``text``; raises :class:`RuntimeFailure` (IMAGE_INVALID) naming what is wrong."""
    if text == "host":
        return ImageReference("host")
    kind, sep, rest = text.partition(":")
    if not sep or kind not in _KINDS or kind == "host":
        raise RuntimeFailure(
            FailureReason.IMAGE_INVALID,
            f"image {text!r}: expected 'host', 'rootfs:/abs/dir', 'oci-archive:/path[:ref]' or "
            "'docker-archive:/path[:ref]'",
        )
    path, tag, digest = rest, "", ""
    pinned = _DIGEST.fullmatch(rest) if kind != "rootfs" else None
    if pinned:
        path, digest = pinned["path"], pinned["digest"]
    elif kind != "rootfs" and ":" in rest:
        path, _, tag = rest.partition(":")
    normal = path.rstrip("/") or "/"
    if not os.path.isabs(path) or os.path.normpath(path) != normal or "\0" in path:
        raise RuntimeFailure(
            FailureReason.IMAGE_INVALID, f"image {text!r}: the path must be absolute and normal"
        )
    return ImageReference(kind, path.rstrip("/") or "/", tag, digest)
