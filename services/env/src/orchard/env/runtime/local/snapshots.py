"""Fork snapshots: a source sandbox's writable layer, copied once, shared read-only by its forks.

A fork's file system is the source's at one instant. Copying the source's upper layer into each
fork's own upper layer costs one copy per fork (eight forks of a 16 MiB checkout: 128 MiB
written, most of a fork's time). A snapshot is that copy made once, on a tmpfs of its own,
remounted read-only; every fork of the call mounts it as an overlay layer between the image and
its own, empty, upper layer, and a fork of a fork adds its source's snapshot above the ones the
source already has.

Why a tmpfs: overlayfs refuses a lower layer inside another lower layer of the same file system
(ELOOP), and for the host image the lowest layer is ``/``, which holds every directory of the
host's root file system; a tmpfs is a file system of its own. Its pages are memory (the
service's), so the runtime keeps all snapshots together within ``fork_snapshot_max_bytes`` and
copies per fork beyond that (a tenant forking again and again cannot fill the host's memory);
a fork with a disk limit copies onto its own disk, which the limit then covers whole. A
snapshot lives under ``<state_dir>/snapshots/`` (hidden from host-image sandboxes with the rest
of the state directory) until no sandbox's state names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import uuid

from orchard.env.runtime.base import FailureReason, RuntimeFailure

__all__ = [
    "copy_tree",
    "drop_snapshot",
    "make_snapshot",
    "snapshot_dirs",
    "snapshot_needs",
    "snapshot_size",
    "tree_bytes",
]

_PAGE = 4096
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MNT_DETACH = 2
_SLACK_BYTES = 4 * 1024 * 1024
"""Room on a snapshot's tmpfs beyond the pages its files need (directories, rounding)."""

_libc = ctypes.CDLL(None, use_errno=True)


def tree_bytes(root: str) -> tuple[int, int]:
    """``(bytes, entries)`` a tmpfs needs for a copy of the tree at ``root``: every regular file
    and symlink target in whole pages, and the number of entries (inodes)."""
    total, entries = 0, 0
    for directory, dirs, files in os.walk(root):
        entries += len(dirs) + len(files)
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(os.path.join(directory, name))
                total += -(-info.st_size // _PAGE) * _PAGE
    return total, entries


def _new_dir(directory: str) -> str:
    """A new, empty directory under ``directory`` (made if need be); its real path (the
    sandbox setup refuses a layer whose path is not)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.realpath(os.path.join(directory, uuid.uuid4().hex))
    os.mkdir(path, 0o755)
    return path


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {fstype} at {target}: {os.strerror(code)}")


def snapshot_needs(source_upper: str) -> tuple[int, int]:
    """``(bytes, inodes)`` a snapshot of ``source_upper`` is made with (its tmpfs's size and
    inode count: the tree's pages, room for directories and rounding)."""
    needed, entries = tree_bytes(source_upper)
    return needed + needed // 8 + _SLACK_BYTES, 2 * entries + 1024


async def make_snapshot(directory: str, source_upper: str, size: int, inodes: int) -> str:
    """A read-only copy of ``source_upper`` on a tmpfs of its own under ``directory``, of
    ``size`` bytes and ``inodes`` inodes at most (:func:`snapshot_needs`). RuntimeFailure when
    the copy fails (nothing is left of it then)."""
    path = _new_dir(directory)
    options = f"size={size},nr_inodes={inodes},mode=0755"
    try:
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        await copy_tree(source_upper, path)
        # Read-only from here: nothing may change a layer under a mounted overlay.
        _mount("tmpfs", path, "tmpfs", _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "")
    except BaseException:
        drop_snapshot(path)
        raise
    return path


def snapshot_size(path: str) -> int:
    """The most memory the mounted snapshot at ``path`` may hold (its tmpfs's size); 0 when
    nothing is mounted there."""
    info = os.statvfs(path)
    return (
        0
        if info.f_fsid == os.statvfs(os.path.dirname(path)).f_fsid
        else info.f_blocks * info.f_frsize
    )


async def copy_tree(source: str, target: str) -> None:
    """Copy the tree at ``source`` into the existing directory ``target`` as an overlay layer
    must be copied (``cp -a``: whiteouts, opaque directories, owners, modes and extended
    attributes kept; copy-on-write where the file system can)."""
    process = await asyncio.create_subprocess_exec(
        "cp",
        "-a",
        "--reflink=auto",
        "--",
        f"{source}/.",
        target,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    if process.returncode != 0:
        raise RuntimeFailure(
            FailureReason.INTERNAL,
            f"copying the source's file system failed: {stderr.decode(errors='replace')}",
        )


def drop_snapshot(path: str) -> None:
    """Unmount a snapshot (lazily: a sandbox still starting on it keeps it until it is done)
    and remove its directory. Idempotent."""
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more), or gone
            raise OSError(code, f"unmount {path}: {os.strerror(code)}")
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def snapshot_dirs(directory: str) -> list[str]:
    """The snapshots under ``directory`` (their real paths)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [os.path.realpath(os.path.join(directory, name)) for name in names]
