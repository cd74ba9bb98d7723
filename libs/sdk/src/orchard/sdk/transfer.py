"""Plans for copying trees between this machine and a sandbox (what to create, in which order)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from dataclasses import dataclass, field
from pathlib import Path

from orchard.sdk.errors import UnsafeListing
from orchard.sdk.types import FileInfo

__all__ = [
    "MAX_DOWNLOAD_DEPTH",
    "DownloadItem",
    "UploadFile",
    "UploadLink",
    "UploadPlan",
    "checked_entry_name",
    "confined",
    "open_new_file",
    "plan_upload",
]

MAX_DOWNLOAD_DEPTH = 1024
"""Deepest directory a download follows; a listing that never ends is refused, not followed."""


@dataclass(frozen=True)
class UploadFile:
    """One regular file to write."""

    local: Path
    remote: str
    size: int
    mode: int


@dataclass(frozen=True)
class UploadLink:
    """One symbolic link to recreate as it is (its target is not followed)."""

    remote: str
    target: str


@dataclass
class UploadPlan:
    """Everything an upload creates: directories first, then files, then links."""

    files: list[UploadFile] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)
    """Directories that would not be created as a file's parent (empty ones, the root)."""
    symlinks: list[UploadLink] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(item.size for item in self.files)


@dataclass(frozen=True)
class DownloadItem:
    """One remote entry and where it lands locally."""

    info: FileInfo
    local: Path


def plan_upload(local: Path, remote: str) -> UploadPlan:
    """What copying ``local`` (a file, a link or a tree) to ``remote`` creates.

    Raises FileNotFoundError when ``local`` does not exist. Devices, sockets and pipes are
    skipped.
    """
    plan = UploadPlan()
    info = local.lstat()
    if stat.S_ISLNK(info.st_mode):
        plan.symlinks.append(UploadLink(remote, os.readlink(local)))
    elif stat.S_ISREG(info.st_mode):
        plan.files.append(UploadFile(local, remote, info.st_size, stat.S_IMODE(info.st_mode)))
    elif stat.S_ISDIR(info.st_mode):
        plan.directories.append(remote)
        for directory, subdirs, names in os.walk(local):
            base = Path(directory)
            relative = base.relative_to(local)
            target_dir = posixpath.join(remote, *relative.parts)
            for name in sorted(subdirs):
                path = base / name
                if path.is_symlink():
                    # os.walk lists links to directories here and does not descend into them.
                    plan.symlinks.append(
                        UploadLink(posixpath.join(target_dir, name), os.readlink(path))
                    )
                else:
                    plan.directories.append(posixpath.join(target_dir, name))
            for name in sorted(names):
                path = base / name
                entry = path.lstat()
                target = posixpath.join(target_dir, name)
                if stat.S_ISLNK(entry.st_mode):
                    plan.symlinks.append(UploadLink(target, os.readlink(path)))
                elif stat.S_ISREG(entry.st_mode):
                    plan.files.append(
                        UploadFile(path, target, entry.st_size, stat.S_IMODE(entry.st_mode))
                    )
        # A directory that holds a file is created as that file's parent.
        parents = {posixpath.dirname(item.remote) for item in plan.files}
        plan.directories = [d for d in plan.directories if d not in parents]
    return plan


def checked_entry_name(directory: str, name: str, seen: set[str]) -> str:
    """``name``, as a sandbox listed it in ``directory``, if it is one plain path component.

    Whatever the sandbox answers, a download writes only below its destination: a name that is
    empty, ``.``, ``..``, holds a separator or NUL, or repeats in one listing raises
    :class:`~orchard.sdk.errors.UnsafeListing`.
    """
    problem = ""
    if name in ("", ".", ".."):
        problem = "is not a file name"
    elif "/" in name or "\0" in name or (os.altsep and os.altsep in name):
        problem = "holds a path separator or NUL"
    elif name in seen:
        problem = "appears twice in one listing"
    if problem:
        raise UnsafeListing(
            f"the sandbox listed {name!r} in {directory}: the name {problem}; download stopped"
        )
    seen.add(name)
    return name


def confined(path: Path, root: str, *, may_be_link: bool = False) -> None:
    """Raise :class:`~orchard.sdk.errors.UnsafeListing` unless writing ``path`` stays below
    ``root`` (a real path): its parent resolves inside, and it is not a link (unless a link
    is what is being replaced)."""
    parent = os.path.realpath(path.parent)
    inside = parent == root or parent.startswith(root.rstrip(os.sep) + os.sep)
    if not inside or (not may_be_link and path.is_symlink()):
        raise UnsafeListing(
            f"{path} would be written through a symbolic link, outside {root}; download stopped"
        )


def open_new_file(path: Path) -> int:
    """A new file at ``path``, never one a link there points to (``O_EXCL | O_NOFOLLOW``)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a partial copy left by an earlier run (a link is removed, not followed)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)
