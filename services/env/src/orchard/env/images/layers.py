"""Applying one image layer, a tar stream, onto a root directory without writing outside it.

Every path is walked one component at a time from a descriptor of the root with
``O_NOFOLLOW``: a symlink already in the tree (from this layer or a lower one) is never
followed, so a member whose parent is a symlink is refused rather than resolved, and so are
absolute names and ``..``. Symlink targets are stored as they are: they are data, read only
inside the sandbox. Python's tarfile extraction filters do not fit a root file system (``data``
refuses absolute symlinks and device files and drops setuid bits; ``tar`` drops setuid bits
too), so members are written here with ``os`` calls relative to directory descriptors.

OCI whiteouts: ``.wh.<name>`` deletes ``<name>`` of the lower layers; ``.wh..wh..opq`` empties
its directory of what the lower layers put there. Device nodes are skipped (a node in a shared
image must not open the host's disks to a sandbox); FIFOs are made.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LayerError", "LayerStats", "apply_layer"]

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20

Path = tuple[str, ...]


class LayerError(Exception):
    """A member that cannot be applied safely or at all; the message names it."""


@dataclass
class LayerStats:
    """What one layer did to the tree."""

    written: int = 0  # files, directories, symlinks, hard links and FIFOs
    removed: int = 0  # entries deleted by whiteouts
    skipped_devices: int = 0


def _split(name: str, what: str) -> Path:
    if name.startswith("/"):
        raise LayerError(f"{what} {name!r} is absolute")
    if "\0" in name:
        raise LayerError(f"{what} {name!r} holds a NUL byte")
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if ".." in parts:
        raise LayerError(f"{what} {name!r} leaves the root ('..')")
    return parts


class _Tree:
    """The root directory being built, reached only through descriptors."""

    def __init__(self, root: str) -> None:
        self.root_fd = os.open(root, _DIR_FLAGS)
        self.own_root = os.geteuid() == 0

    def close(self) -> None:
        os.close(self.root_fd)

    @contextlib.contextmanager
    def directory(self, parts: Path, *, create: bool) -> Iterator[int | None]:
        """A descriptor of directory ``parts`` (None if missing and not ``create``): every
        component must be a real directory; missing ones are made (mode 0755, as tar does)."""
        fd = os.dup(self.root_fd)
        try:
            for index, part in enumerate(parts):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        yield None
                        return
                    os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as error:
                    if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    where = "/".join(parts[: index + 1])
                    raise LayerError(
                        f"{where} is a symlink or a file, not a directory (symlinks are never "
                        "followed while unpacking)"
                    ) from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def set_owner_mode_time(self, member: tarfile.TarInfo, fd: int) -> None:
        if self.own_root:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)  # after chown, which clears setuid bits
        mtime_ns = int(member.mtime * 1e9)
        os.utime(fd, ns=(mtime_ns, mtime_ns))


def _remove(dir_fd: int, name: str) -> bool:
    try:
        existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(existing.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)  # descriptor-based: never follows a symlink
    else:
        os.unlink(name, dir_fd=dir_fd)
    return True


def apply_layer(layer: tarfile.TarFile, root: str) -> LayerStats:
    """Apply the members of ``layer`` (read in order, stream mode is fine) onto ``root``.

    Raises :class:`LayerError` for a member that would leave ``root`` or cannot be applied;
    the tree is then half-applied and only fit to be removed.
    """
    tree = _Tree(root)
    try:
        return _Applier(layer, tree).run()
    finally:
        tree.close()


class _Applier:
    def __init__(self, layer: tarfile.TarFile, tree: _Tree) -> None:
        self.layer = layer
        self.tree = tree
        self.stats = LayerStats()
        self.created: set[Path] = set()  # paths of this layer, which its whiteouts spare
        self.dirs: dict[Path, tarfile.TarInfo] = {}  # metadata set last: children touch mtime
        self.skipped: set[Path] = set()

    def run(self) -> LayerStats:
        for member in self.layer:
            parts = _split(member.name, "member")
            if not parts:
                continue  # the root itself keeps the cache's owner and mode
            try:
                self._apply(member, parts)
            except LayerError as error:
                raise LayerError(f"member {member.name!r}: {error}") from None
            except OSError as error:
                raise LayerError(f"member {member.name!r}: {error.strerror or error}") from None
        for parts in sorted(self.dirs, key=len, reverse=True):
            with self.tree.directory(parts, create=False) as fd:
                if fd is not None:
                    self.tree.set_owner_mode_time(self.dirs[parts], fd)
        return self.stats

    def _apply(self, member: tarfile.TarInfo, parts: Path) -> None:
        parent, name = parts[:-1], parts[-1]
        if name == OPAQUE_WHITEOUT:
            self._opaque(parent)
            return
        if name.startswith(WHITEOUT_PREFIX):
            target = name[len(WHITEOUT_PREFIX) :]
            if target in ("", ".", "..") or target.startswith(WHITEOUT_PREFIX):
                return  # aufs bookkeeping (.wh..wh.plnk and the like), not a deletion
            self._whiteout(parent, target)
            return
        if member.ischr() or member.isblk():
            self.stats.skipped_devices += 1
            self.skipped.add(parts)
            return
        self.created.add(parts)
        with self.tree.directory(parent, create=True) as dir_fd:
            assert dir_fd is not None
            if member.isdir():
                self._directory(dir_fd, name, parts, member)
            elif member.issym():
                self._symlink(dir_fd, name, member)
            elif member.islnk():
                self._hard_link(dir_fd, name, parts, member)
            elif member.isfifo():
                _remove(dir_fd, name)
                os.mkfifo(name, 0o600, dir_fd=dir_fd)
                self._set_metadata_at(dir_fd, name, member)
            else:  # regular (tarfile reads unknown types as regular too)
                self._file(dir_fd, name, member)
        self.stats.written += 1

    def _opaque(self, parent: Path) -> None:
        with self.tree.directory(parent, create=True) as dir_fd:
            assert dir_fd is not None
            for entry in os.listdir(dir_fd):
                if (*parent, entry) not in self.created:
                    self.stats.removed += _remove(dir_fd, entry)

    def _whiteout(self, parent: Path, target: str) -> None:
        if (*parent, target) in self.created:
            return  # a whiteout hides lower layers only
        with self.tree.directory(parent, create=False) as dir_fd:
            if dir_fd is not None:
                self.stats.removed += _remove(dir_fd, target)

    def _directory(self, dir_fd: int, name: str, parts: Path, member: tarfile.TarInfo) -> None:
        try:
            existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is None or not stat.S_ISDIR(existing.st_mode):
            _remove(dir_fd, name)
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        self.dirs[parts] = member

    def _symlink(self, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        if not member.linkname:
            raise LayerError("a symlink with an empty target")
        _remove(dir_fd, name)
        os.symlink(member.linkname, name, dir_fd=dir_fd)
        if self.tree.own_root:
            os.chown(name, member.uid, member.gid, dir_fd=dir_fd, follow_symlinks=False)
        mtime_ns = int(member.mtime * 1e9)
        os.utime(name, ns=(mtime_ns, mtime_ns), dir_fd=dir_fd, follow_symlinks=False)

    def _hard_link(self, dir_fd: int, name: str, parts: Path, member: tarfile.TarInfo) -> None:
        target = _split(member.linkname, "hard link target")
        if not target:
            raise LayerError("a hard link to the root")
        if target in self.skipped:
            self.skipped.add(parts)
            return
        if target == parts:
            return
        with self.tree.directory(target[:-1], create=False) as source_fd:
            try:
                if source_fd is None:
                    raise FileNotFoundError
                source = os.stat(target[-1], dir_fd=source_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise LayerError(f"hard link target {member.linkname!r} does not exist") from None
            if stat.S_ISDIR(source.st_mode):
                raise LayerError(f"hard link target {member.linkname!r} is a directory")
            _remove(dir_fd, name)
            os.link(
                target[-1], name, src_dir_fd=source_fd, dst_dir_fd=dir_fd, follow_symlinks=False
            )

    def _file(self, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        source = self.layer.extractfile(member)
        if source is None:
            raise LayerError("no data for a regular file")
        _remove(dir_fd, name)
        fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, _COPY_CHUNK)
            out.flush()
            self.tree.set_owner_mode_time(member, out.fileno())

    def _set_metadata_at(self, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # a FIFO: no wait
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            self.tree.set_owner_mode_time(member, fd)
        finally:
            os.close(fd)
