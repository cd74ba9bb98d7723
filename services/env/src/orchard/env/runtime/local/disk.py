"""A sandbox's disk limit: its writable layer on an ext4 file system of its own, of that size.

The file system lives in a sparse image file in the sandbox's workspace (``layer.img``), made by
``mkfs.ext4`` and loop-mounted at ``layer/``; the overlay's upper and work directories are in
it. A sandbox that fills it gets ENOSPC, and the host never gives it more than the image's size.
The image is sparse, so a sandbox holds only what it wrote (plus a few MB of metadata).

Why a loop device: overlayfs needs the upper and work directories on one file system that has
the limit; the host's own file system has no project quotas here, and a size-limited tmpfs
would hold the data in memory (charged to the sandbox's memory cgroup). The loop device is set
up with autoclear (``mount -o loop``): it detaches by itself once the last mount of the file
system is gone, so unmounting releases everything. The mount is in the service's mount
namespace (it must outlive the start, for forks and deletes); a sandbox sees only the overlay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import subprocess

from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = ["MIN_DISK_BYTES", "disk_tools_missing", "make_layer_disk", "release_layer_disk"]

MIN_DISK_BYTES = 16 * 1024 * 1024
"""Smallest layer file system made (ext4 needs room for its own metadata)."""
_TOOL_TIMEOUT_S = 60.0
_MNT_DETACH = 2

# -O ^has_journal: the layer is scratch (a host crash ends the sandbox anyway), and a journal
# would cost up to 1 GB of writes per file system. lazy_itable_init plus noinit_itable at mount:
# inode tables are never zeroed, so making and mounting write only a few MB whatever the size.
_MKFS = (
    "mkfs.ext4",
    "-q",
    "-F",
    "-O",
    "^has_journal",
    "-E",
    "lazy_itable_init=1,nodiscard",
    "-m",
    "0",
)
_MOUNT_OPTIONS = "loop,noinit_itable,nodev"

_libc = ctypes.CDLL(None, use_errno=True)


def disk_tools_missing() -> str | None:
    """What this host lacks for disk limits (a sentence with the fix), or None."""
    for tool, package in (("mkfs.ext4", "e2fsprogs"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package})"
    if not os.path.exists("/dev/loop-control"):
        return "there is no /dev/loop-control (load the loop module: `modprobe loop`)"
    return None


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=_TOOL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(
            FailureReason.RESOURCES_UNAVAILABLE,
            f"cannot make the sandbox's disk: {argv[0]} took over {_TOOL_TIMEOUT_S:g} s",
        ) from None
    if done.returncode != 0:
        raise RuntimeFailure(
            FailureReason.RESOURCES_UNAVAILABLE,
            f"cannot make the sandbox's disk ({argv[0]} failed): "
            f"{done.stderr.decode(errors='replace').strip()[-500:]}",
        )


def _make(image: str, mount_point: str, size: int) -> None:
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: nothing is allocated until written
    finally:
        os.close(fd)
    _run(*_MKFS, image)
    os.mkdir(mount_point, 0o755)
    _run("mount", "-t", "ext4", "-o", _MOUNT_OPTIONS, image, mount_point)


async def make_layer_disk(image: str, mount_point: str, size_bytes: int) -> None:
    """Make an ext4 file system of ``size_bytes`` in the new file ``image`` and mount it at
    ``mount_point`` (created). Undo with :func:`release_layer_disk` (also after a failure).

    The tools run from a worker thread, not the event loop: a burst of creations would
    otherwise spend the loop on spawning them and a watcher thread per child."""
    missing = disk_tools_missing()
    if missing is not None:
        raise RuntimeFailure(
            FailureReason.RESOURCES_UNAVAILABLE,
            f"cannot limit the sandbox's disk: {missing}; or set no disk limit "
            "(disk_bytes 0 and a default of 0)",
        )
    size = max(size_bytes, MIN_DISK_BYTES)
    making = asyncio.ensure_future(asyncio.to_thread(_make, image, mount_point, size))
    try:
        await asyncio.shield(making)
    except asyncio.CancelledError:
        # Let the mount finish (bounded by the tools' timeout) so the caller's cleanup,
        # which runs next, finds and releases it rather than racing it.
        with contextlib.suppress(Exception):
            await making
        raise


def release_layer_disk(mount_point: str) -> None:
    """Unmount the layer file system if it is mounted (detached at once even when busy; the
    loop device goes with its last mount). Safe to call when it never was mounted."""
    if not os.path.ismount(mount_point):
        return
    if _libc.umount2(os.fsencode(mount_point), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unmount {mount_point}: {os.strerror(code)}")
