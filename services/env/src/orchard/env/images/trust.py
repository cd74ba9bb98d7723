"""Which host paths an image may name: the operator's allow-list, checked on the real path.

``rootfs:``, ``oci-archive:`` and ``docker-archive:`` name host paths, and ``host`` is the host's
root itself, so what a tenant may name is the operator's setting (``images`` in the service's
configuration), never the tenant's. A path is judged by what it really is: symlinks, ``..`` and
``/proc/<pid>/root`` are resolved first (:func:`os.path.realpath`), and the resolved path is the
one used from then on, so a link swapped after the check cannot redirect the image. Whatever
the allow-list says, the host's root, ``/proc``, ``/sys``, ``/dev`` and the service's protected
directories (its own state, and what the operator names in ``images.host_masked_paths``) are
never sources: neither inside one nor above one, also when reached through a bind mount
(compared by device and inode, not only by name).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchard.env.images.reference import ImageReference
from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = ["OPERATOR", "ImageNotAllowed", "ImageTrust", "check_image", "real_paths"]

_KERNEL_VIEWS = ("/proc", "/sys", "/dev")
_Identity = tuple[int, int]


@dataclass(frozen=True)
class ImageTrust:
    """What one sandbox's image may name on the host: the operator's ``images`` settings as
    they apply to its tenant. ``allowed_paths`` None: any path that is not protected (a caller
    that is the operator itself, e.g. a tool driving the runtime directly)."""

    tenant: str = ""
    allow_host: bool = True
    allowed_paths: tuple[str, ...] | None = None
    host_masked_paths: tuple[str, ...] = ()


OPERATOR = ImageTrust()
"""The trust of a caller that is the operator: the host image and any unprotected path."""


class ImageNotAllowed(RuntimeFailure):
    """The image names the host, or a host path, that this tenant may not use."""

    def __init__(self, message: str) -> None:
        super().__init__(FailureReason.IMAGE_NOT_ALLOWED, message)


def real_paths(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path resolved (symlinks, ``..``), without duplicates, in order."""
    return tuple(dict.fromkeys(os.path.realpath(path) for path in paths))


def check_image(
    reference: ImageReference, trust: ImageTrust, protected: Sequence[str]
) -> ImageReference:
    """``reference`` with its path replaced by the real path, once ``trust`` allows it and it
    touches none of the ``protected`` directories; raises :class:`ImageNotAllowed` saying which
    setting decides."""
    if reference.kind == "host":
        if not trust.allow_host:
            raise ImageNotAllowed(
                f"image host: the host image is off for tenant {trust.tenant!r}; an operator "
                f"allows it with images.allow_host or images.tenants.{trust.tenant}.allow_host"
            )
        return reference
    given = reference.path
    if _kernel_or_root(given, given):
        raise _never(reference)
    try:
        real = os.path.realpath(given)
    except OSError as exc:  # e.g. /proc/<pid>/root of a process it may not trace
        raise ImageNotAllowed(f"image {reference}: {given} cannot be resolved ({exc})") from None
    if trust.allowed_paths is not None and not any(
        _inside(real, os.path.realpath(allowed)) for allowed in trust.allowed_paths
    ):
        raise ImageNotAllowed(
            f"image {reference}: {given} (symlinks resolved) is outside the directories tenant "
            f"{trust.tenant!r} may use; an operator adds a directory holding it to "
            f"images.allowed_paths or images.tenants.{trust.tenant}.allowed_paths"
        )
    if _kernel_or_root(given, real):
        raise _never(reference)
    for directory in (*protected, *trust.host_masked_paths):
        if _overlaps(real, os.path.realpath(directory)):
            # The directory is not named: a tenant learns nothing of the host's layout.
            raise ImageNotAllowed(
                f"image {reference}: {given} is inside or above the service's own state (the "
                "runtime's directories or images.host_masked_paths), never an image source"
            )
    return dataclasses.replace(reference, path=real)


def _never(reference: ImageReference) -> ImageNotAllowed:
    return ImageNotAllowed(
        f"image {reference}: {reference.path} is the host's root, or inside /proc, /sys or /dev, "
        "which are never image sources"
    )


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _identity(path: str) -> _Identity | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _lineage(path: str) -> list[str]:
    """``path`` and each directory above it, up to ``/``."""
    found = [path]
    while path != "/":
        path = os.path.dirname(path)
        found.append(path)
    return found


def _identities(path: str) -> set[_Identity]:
    return {found for found in map(_identity, _lineage(path)) if found is not None}


def _kernel_or_root(given: str, real: str) -> bool:
    if real == "/" or any(_inside(path, view) for view in _KERNEL_VIEWS for path in (given, real)):
        return True
    root = _identity("/")
    # The devices of proc, sysfs and devtmpfs (a /dev that is a plain directory is not one).
    kernel_devices = {
        found[0]
        for found in map(_identity, _KERNEL_VIEWS)
        if found is not None and root is not None and found[0] != root[0]
    }
    mine = _identity(real)
    # A bind mount of the root, or a mount of proc, sysfs or devtmpfs elsewhere.
    return (mine is not None and mine == root) or any(
        device in kernel_devices for device, _ in _identities(real)
    )


def _overlaps(real: str, directory: str) -> bool:
    """Whether ``real`` is inside ``directory`` or holds it, by name or through a bind mount."""
    if _inside(real, directory) or _inside(directory, real):
        return True
    mine, theirs = _identity(real), _identity(directory)
    if mine is None or theirs is None:
        return False
    return theirs in _identities(real) or mine in _identities(directory)
