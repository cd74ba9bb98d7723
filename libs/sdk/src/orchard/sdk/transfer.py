"""Plans for copying trees between this machine and a sandbox (what to create, in which order)."""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass, field
from pathlib import Path

from orchard.sdk.types import FileInfo

__all__ = ["DownloadItem", "UploadFile", "UploadLink", "UploadPlan", "plan_upload"]


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
