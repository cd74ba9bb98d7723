"""A content-addressed directory of unpacked images, safe across threads and processes.

Layout under the cache directory::

    rootfs/sha256-<hex>/    a complete root file system; <hex> is the image config's digest
    tmp/sha256-<hex>.<rand>/ one being built; renamed into rootfs/ when complete
    locks/sha256-<hex>.lock  flock(2) held while building, so an image is unpacked once

A directory under ``rootfs/`` exists only complete (an atomic rename), so a reader needs no
lock; a build that died leaves a ``tmp/`` entry, which the next builder of that image removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["ImageCache"]


class ImageCache:
    """Unpacked images keyed by digest; :meth:`rootfs` builds each one once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.unpacked = 0  # images this instance built: tests and logs read it

    def _path(self, part: str, name: str) -> str:
        return os.path.join(self.directory, part, name)

    def rootfs(self, digest: str, build: Callable[[str], None]) -> str:
        """The directory of ``digest`` (``sha256:<hex>``); on a miss ``build(staging_dir)``
        fills a fresh directory, which then becomes it. ``build``'s errors propagate and leave
        nothing behind."""
        name = digest.replace(":", "-")
        final = self._path("rootfs", name)
        if os.path.isdir(final):
            return final
        for part in ("rootfs", "tmp", "locks"):
            os.makedirs(os.path.join(self.directory, part), mode=0o700, exist_ok=True)
        with self._locked(name):
            if os.path.isdir(final):
                return final  # another thread or process built it while we waited
            self._remove_leftovers(name)
            staging = tempfile.mkdtemp(prefix=f"{name}.", dir=os.path.join(self.directory, "tmp"))
            try:
                os.chmod(staging, 0o755)
                build(staging)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            self.unpacked += 1
        return final

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        # One open per call: flock excludes other open file descriptions, threads included.
        lock = self._path("locks", f"{name}.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _remove_leftovers(self, name: str) -> None:
        tmp = os.path.join(self.directory, "tmp")
        for entry in os.listdir(tmp):
            if entry.startswith(f"{name}."):
                shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
