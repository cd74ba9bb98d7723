"""File operations: stat, list, read and atomic write, on bytes paths, with clear errors.

OS errors propagate as ``OSError`` and are mapped to status codes by the core error table
(ENOENT → NOT_FOUND, EACCES → PERMISSION_DENIED, ENOSPC → RESOURCE_EXHAUSTED, ...); checks the
OS would not make, or would make with a vague message, raise :class:`OrchardError` here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import contextlib
import errno
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass, field

from google.protobuf import timestamp_pb2

from orchard.core.errors import OrchardError, Reason
from orchard.inagent.paths import NAME_MAX, check_path, display, resolve
from orchard.types.v1 import files_pb2

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PAGE_SIZE",
    "MAX_CHUNK_BYTES",
    "MAX_PAGE_SIZE",
    "AtomicWriter",
    "FileReader",
    "file_info",
    "list_files",
    "stat_file",
]

DEFAULT_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10_000
DEFAULT_FILE_MODE = 0o644
_PARENT_MODE = 0o755
_TOKEN_PREFIX = b"after\0"
_TEMP_SUFFIX = b".orchard-tmp"


def file_info(
    path: bytes, st: os.stat_result, *, symlink_target: bytes | None = None
) -> files_pb2.FileInfo:
    """Describe ``path`` from its stat result; ``path`` should be absolute."""
    text, raw = display(path)
    name, _ = display(os.path.basename(path) or path)
    modify_time = timestamp_pb2.Timestamp(
        seconds=st.st_mtime_ns // 1_000_000_000, nanos=st.st_mtime_ns % 1_000_000_000
    )
    info = files_pb2.FileInfo(
        path=text,
        name=name,
        raw_path=raw,
        type=_file_type(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        modify_time=modify_time,
    )
    if symlink_target is not None:
        info.symlink_target = display(symlink_target)[0]
    return info


def _file_type(mode: int) -> files_pb2.FileType.ValueType:
    if stat.S_ISREG(mode):
        return files_pb2.FILE_TYPE_REGULAR
    if stat.S_ISDIR(mode):
        return files_pb2.FILE_TYPE_DIRECTORY
    if stat.S_ISLNK(mode):
        return files_pb2.FILE_TYPE_SYMLINK
    return files_pb2.FILE_TYPE_OTHER


def _describe(path: bytes, *, follow_symlinks: bool) -> files_pb2.FileInfo:
    st = os.stat(path, follow_symlinks=follow_symlinks)
    target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return file_info(path, st, symlink_target=target)


def stat_file(path: str, working_dir: bytes, *, follow_symlinks: bool) -> files_pb2.FileInfo:
    """What is known about ``path``; a symlink is described itself unless ``follow_symlinks``."""
    return _describe(resolve(check_path(path), working_dir), follow_symlinks=follow_symlinks)


def list_files(
    path: str, working_dir: bytes, *, page_size: int, page_token: str
) -> tuple[list[files_pb2.FileInfo], str]:
    """One page of a directory's entries sorted bytewise by name, and the next page's token.

    The token names the last entry returned, so paging survives entries being added or removed
    between pages (each name is listed at most once, in order).
    """
    if page_size < 0 or page_size > MAX_PAGE_SIZE:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"page_size must be from 0 to {MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE}), "
            f"got {page_size}",
            metadata={"field": "page_size"},
        )
    size = page_size or DEFAULT_PAGE_SIZE
    after = _decode_page_token(page_token) if page_token else None
    directory = resolve(check_path(path), working_dir)
    names = sorted(os.listdir(directory))
    start = bisect.bisect_right(names, after) if after is not None else 0
    entries: list[files_pb2.FileInfo] = []
    index = start
    while index < len(names) and len(entries) < size:
        name = names[index]
        index += 1
        try:
            entries.append(_describe(os.path.join(directory, name), follow_symlinks=False))
        except FileNotFoundError:
            continue  # removed since the listing; a listing is not a snapshot
    more = index < len(names)
    last = names[index - 1] if entries else after
    token = _encode_page_token(last) if more and last is not None else ""
    return entries, token


def _encode_page_token(name: bytes) -> str:
    return base64.urlsafe_b64encode(_TOKEN_PREFIX + name).decode("ascii")


def _decode_page_token(token: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raw = b""
    if not raw.startswith(_TOKEN_PREFIX):
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            "page_token is not a next_page_token this agent returned",
            metadata={"field": "page_token"},
        )
    return raw[len(_TOKEN_PREFIX) :]


@dataclass
class FileReader:
    """An open regular file and the byte range to send; close it with :meth:`close`."""

    info: files_pb2.FileInfo
    fd: int
    position: int
    end: int | None
    chunk_bytes: int

    @classmethod
    def open(
        cls, path: str, working_dir: bytes, *, offset: int, limit: int, chunk_bytes: int
    ) -> FileReader:
        """Open ``path`` for reading; FAILED_PRECONDITION unless it is a regular file."""
        for name, value in (("offset", offset), ("limit", limit), ("chunk_size", chunk_bytes)):
            if value < 0:
                raise OrchardError(
                    Reason.INVALID_ARGUMENT,
                    f"{name} must not be negative, got {value}",
                    metadata={"field": name},
                )
        resolved = resolve(check_path(path), working_dir)
        # O_NONBLOCK so that opening a FIFO does not wait for a writer; it is refused below.
        fd = os.open(resolved, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise OrchardError(
                    Reason.IS_A_DIRECTORY,
                    f"{display(resolved)[0]!r} is a directory, not a regular file",
                    metadata={"path": display(resolved)[0]},
                )
            if not stat.S_ISREG(st.st_mode):
                raise OrchardError(
                    Reason.FAILED_PRECONDITION,
                    f"{display(resolved)[0]!r} is not a regular file",
                    metadata={"path": display(resolved)[0]},
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return cls(
            info=file_info(resolved, st),
            fd=fd,
            position=offset,
            end=offset + limit if limit else None,
            chunk_bytes=min(chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES),
        )

    def read_chunk(self) -> bytes:
        """The next chunk of the range; empty at its end (or the file's)."""
        size = self.chunk_bytes
        if self.end is not None:
            size = min(size, self.end - self.position)
        if size <= 0:
            return b""
        data = os.pread(self.fd, size, self.position)
        self.position += len(data)
        return data

    def close(self) -> None:
        """Close the file; safe to call twice."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class AtomicWriter:
    """Writes a file to a temporary sibling and renames it into place on :meth:`commit`.

    Until the commit the destination is untouched; :meth:`discard` (always call it, e.g. in a
    ``finally``) removes the temporary file unless the commit happened.
    """

    destination: bytes
    mode: int
    no_overwrite: bool
    temp_path: bytes
    fd: int
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    committed: bool = False

    @classmethod
    def create(
        cls,
        path: str,
        working_dir: bytes,
        *,
        mode: int,
        make_parents: bool,
        no_overwrite: bool,
    ) -> AtomicWriter:
        """Check the destination and open the temporary file next to it."""
        if mode & ~0o7777:
            raise OrchardError(
                Reason.INVALID_ARGUMENT,
                f"mode {mode:#o} has bits outside 0o7777 (permission bits only)",
                metadata={"field": "mode"},
            )
        destination = resolve(check_path(path), working_dir)
        shown = display(destination)[0]
        parent, name = os.path.split(destination)
        if not name:
            raise OrchardError(
                Reason.INVALID_PATH, f"{shown!r} names no file", metadata={"field": "path"}
            )
        if make_parents:
            _make_directories(parent)
        elif not os.path.isdir(parent):
            if os.path.lexists(parent):
                raise OrchardError(
                    Reason.NOT_A_DIRECTORY,
                    f"parent {display(parent)[0]!r} is not a directory",
                    metadata={"path": display(parent)[0]},
                )
            raise OrchardError(
                Reason.NOT_FOUND,
                f"parent directory {display(parent)[0]!r} does not exist "
                "(set make_parents to create it)",
                metadata={"path": display(parent)[0]},
            )
        cls._check_destination(destination, no_overwrite=no_overwrite)
        stem = name[: NAME_MAX - 32]  # room for the dot, random part and suffix
        temp_path = os.path.join(
            parent, b"." + stem + b"." + secrets.token_hex(6).encode() + _TEMP_SUFFIX
        )
        fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return cls(
            destination=destination,
            mode=mode or DEFAULT_FILE_MODE,
            no_overwrite=no_overwrite,
            temp_path=temp_path,
            fd=fd,
        )

    @staticmethod
    def _check_destination(destination: bytes, *, no_overwrite: bool) -> None:
        try:
            st = os.lstat(destination)
        except FileNotFoundError:
            return
        shown = display(destination)[0]
        if stat.S_ISDIR(st.st_mode):
            raise OrchardError(
                Reason.IS_A_DIRECTORY, f"{shown!r} is a directory", metadata={"path": shown}
            )
        if no_overwrite:
            raise _already_exists(shown)

    def write(self, data: bytes) -> None:
        """Append ``data`` to the temporary file."""
        self.digest.update(data)
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    async def commit(self) -> tuple[files_pb2.FileInfo, str]:
        """Flush, set the mode and rename into place; return the file's info and SHA-256."""
        # The thread owns the descriptor from here, so a cancelled call cannot close it under it.
        fd, self.fd = self.fd, -1
        await asyncio.to_thread(_finish_file, fd, self.mode)
        if self.no_overwrite:
            # link() fails with EEXIST instead of replacing, closing the race with the check.
            try:
                os.link(self.temp_path, self.destination)
            except FileExistsError:
                raise _already_exists(display(self.destination)[0]) from None
            os.unlink(self.temp_path)
        else:
            os.rename(self.temp_path, self.destination)
        self.committed = True
        await asyncio.to_thread(_fsync_directory, os.path.dirname(self.destination))
        info = file_info(self.destination, os.lstat(self.destination))
        return info, self.digest.hexdigest()

    def discard(self) -> None:
        """Close and remove the temporary file unless committed; safe to call twice."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.committed:
            self.committed = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp_path)


def _make_directories(path: bytes) -> None:
    """``os.makedirs(path, exist_ok=True)`` without recursion: a path may have ~2,000 levels
    within PATH_MAX, more than Python's recursion limit allows ``os.makedirs``."""
    missing: list[bytes] = []
    current = path
    while not os.path.isdir(current):
        if os.path.lexists(current):
            raise OrchardError(
                Reason.NOT_A_DIRECTORY,
                f"{display(current)[0]!r} is not a directory",
                metadata={"path": display(current)[0]},
            )
        missing.append(current)
        up = os.path.dirname(current)
        if up == current:
            break
        current = up
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by someone else
            os.mkdir(directory, _PARENT_MODE)


def _already_exists(shown: str) -> OrchardError:
    return OrchardError(
        Reason.ALREADY_EXISTS,
        f"{shown!r} exists and no_overwrite is set",
        metadata={"path": shown},
    )


def _finish_file(fd: int, mode: int) -> None:
    try:
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path: bytes) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EROFS):  # some file systems cannot
            raise
    finally:
        os.close(fd)
