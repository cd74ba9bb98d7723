"""Artifacts by URL: models, datasets, checkpoints, weights, exports and reports, read and
written through one storage layer built on fsspec.

No local path crosses a service boundary: an RPC field that names an artifact takes a URL, and a
service reads and writes it only through an :class:`ArtifactStore`, the operator's settings:

- ``root``: where the service writes (``file:///srv/orchard/artifacts`` on a volume every
  service mounts, the default; ``s3://bucket/orchard`` or any fsspec scheme whose driver is
  installed; ``memory://`` in tests);
- ``allowed``: more URL prefixes a client may name (the root is always allowed).

A URL a client names must lie under one of those prefixes, so a tenant cannot make a service
read ``file:///etc/shadow``, another service's private files, or an arbitrary ``http://`` host.
``file://`` URLs are checked after their symlinks are resolved: a link in the store pointing
outside it is refused. URLs must be absolute (``file:///abs/path``), without ``..`` segments,
query, fragment or fsspec chaining (``a::b``).

Failures are :class:`OrchardError` subclasses, so a servicer just lets them through and the
client sees the status: a malformed URL is INVALID_ARGUMENT ``ARTIFACT_URL_INVALID``, one
outside the allowed prefixes PERMISSION_DENIED ``ARTIFACT_ACCESS_DENIED``, a missing object
NOT_FOUND ``ARTIFACT_NOT_FOUND``, a store that refuses the service PERMISSION_DENIED
``ARTIFACT_STORE_DENIED``, a scheme without an installed driver FAILED_PRECONDITION
``ARTIFACT_SCHEME_UNAVAILABLE``.

Artifacts are written once and never change (a new checkpoint, a new weight version, a new
dataset get new URLs), which is what lets :meth:`ArtifactStore.get_dir` cache a download by URL.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import grpc
from pydantic import Field, field_validator

from orchard.core.config import ConfigModel
from orchard.core.errors import ErrorReason, OrchardError, from_os_error, shorten

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped]

__all__ = [
    "ArtifactAccessDenied",
    "ArtifactError",
    "ArtifactNotFound",
    "ArtifactReason",
    "ArtifactSchemeUnavailable",
    "ArtifactStore",
    "ArtifactStoreDenied",
    "ArtifactUrl",
    "ArtifactUrlInvalid",
    "ArtifactsConfig",
    "as_url",
    "parse_url",
]


class ArtifactReason(ErrorReason):
    """Failures of the artifact layer, shared by every service that reads or writes artifacts."""

    ARTIFACT_URL_INVALID = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "An artifact URL is malformed (no scheme, '..', a query...).",
    )
    ARTIFACT_ACCESS_DENIED = (
        grpc.StatusCode.PERMISSION_DENIED,
        "An artifact URL lies outside the prefixes the operator allows.",
    )
    ARTIFACT_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "No artifact at that URL.")
    ARTIFACT_STORE_DENIED = (
        grpc.StatusCode.PERMISSION_DENIED,
        "The artifact store refused the service access (file mode, bucket policy).",
    )
    ARTIFACT_SCHEME_UNAVAILABLE = (
        grpc.StatusCode.FAILED_PRECONDITION,
        "The URL's scheme needs an fsspec driver this service does not have.",
    )


class ArtifactError(OrchardError):
    """A failure of the artifact layer; ``url`` is in the metadata."""

    reason_of: ArtifactReason = ArtifactReason.ARTIFACT_URL_INVALID

    def __init__(self, url: str, message: str) -> None:
        super().__init__(self.reason_of, message, metadata={"url": shorten(url)})
        self.url = url


class ArtifactUrlInvalid(ArtifactError):
    reason_of = ArtifactReason.ARTIFACT_URL_INVALID


class ArtifactAccessDenied(ArtifactError):
    reason_of = ArtifactReason.ARTIFACT_ACCESS_DENIED


class ArtifactNotFound(ArtifactError):
    reason_of = ArtifactReason.ARTIFACT_NOT_FOUND


class ArtifactStoreDenied(ArtifactError):
    reason_of = ArtifactReason.ARTIFACT_STORE_DENIED


class ArtifactSchemeUnavailable(ArtifactError):
    reason_of = ArtifactReason.ARTIFACT_SCHEME_UNAVAILABLE


# fsspec schemes that wrap or unpack other filesystems: a URL naming one could reach through
# the store to whatever it wraps, so none is accepted.
_WRAPPING_SCHEMES = frozenset(
    {
        "blockcache",
        "cached",
        "dir",
        "filecache",
        "simplecache",
        "reference",
        "zip",
        "tar",
        "libarchive",
        "generic",
        "async_wrapper",
        "asyncwrapper",
        "data",
        "local",
    }
)


@dataclass(frozen=True, slots=True)
class ArtifactUrl:
    """A checked artifact URL: ``scheme://`` plus the driver's path, in one canonical form."""

    scheme: str
    path: str
    """The path fsspec takes (``/abs/path`` for file and memory, ``bucket/key`` for s3)."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.path}"

    def __str__(self) -> str:
        return self.url

    def child(self, *names: str) -> ArtifactUrl:
        """The URL of ``names`` under this one (each name one segment, checked)."""
        path = self.path.rstrip("/")
        for name in names:
            for segment in name.strip("/").split("/"):
                _check_segment(self.url, segment)
                path = f"{path}/{segment}"
        return ArtifactUrl(self.scheme, path)

    def is_under(self, prefix: ArtifactUrl) -> bool:
        if self.scheme != prefix.scheme:
            return False
        base = prefix.path.rstrip("/")
        return self.path == base or self.path.startswith(base + "/") or base in ("", "/")


def _check_segment(url: str, segment: str) -> None:
    if segment in ("", ".", ".."):
        raise ArtifactUrlInvalid(
            url,
            f"artifact URL {shorten(url)!r}: empty, '.' and '..' segments are not allowed; "
            "name the artifact by its plain absolute URL",
        )


def _bare_path_hint(url: str) -> str:
    if url.startswith("/"):
        return f"write file://{url} for a file on the shared volume"
    return "write file:///ABSOLUTE/PATH for a file on the shared volume, or SCHEME://BUCKET/KEY"


def parse_url(url: str, *, what: str = "artifact URL") -> ArtifactUrl:
    """Check the form of ``url`` (not where it points); raises :class:`ArtifactUrlInvalid`.

    ``what`` names the field in the message (``spec.dataset``).
    """
    if not isinstance(url, str) or not url:
        raise ArtifactUrlInvalid(str(url), f"{what} is empty: give an artifact URL")
    shown = shorten(url)
    if any(ord(c) < 0x20 or c == "\x7f" for c in url):
        raise ArtifactUrlInvalid(url, f"{what} {shown!r} holds control characters")
    if "::" in url:
        raise ArtifactUrlInvalid(url, f"{what} {shown!r}: chained URLs (a::b) are not accepted")
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url:
        raise ArtifactUrlInvalid(
            url, f"{what} {shown!r} is not a URL (no scheme): {_bare_path_hint(url)}"
        )
    scheme = parts.scheme.lower()
    if scheme in _WRAPPING_SCHEMES:
        raise ArtifactUrlInvalid(
            url, f"{what} {shown!r}: scheme {scheme!r} is not an artifact store scheme"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ArtifactUrlInvalid(url, f"{what} {shown!r}: a query or fragment is not allowed")
    if parts.username or parts.password:
        raise ArtifactUrlInvalid(
            url, f"{what} {shown!r}: credentials do not belong in a URL; the store has its own"
        )
    path = unquote(parts.path)
    if "\x00" in path:
        raise ArtifactUrlInvalid(url, f"{what} {shown!r} holds a NUL byte")
    segments = path.split("/")
    # a trailing slash names the same folder; anything else empty, '.' or '..' is refused
    inner = segments[1:-1] if len(segments) > 2 and segments[-1] == "" else segments[1:]
    for segment in inner:
        _check_segment(url, segment)
    path = path.rstrip("/")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ArtifactUrlInvalid(
                url,
                f"{what} {shown!r}: a file URL names a path on the shared volume, "
                f"file:///ABSOLUTE/PATH, not a host ({parts.netloc!r})",
            )
        return ArtifactUrl("file", path or "/")
    if scheme == "memory":
        return ArtifactUrl("memory", f"/{parts.netloc}{path}" if parts.netloc else path or "/")
    if not parts.netloc:
        raise ArtifactUrlInvalid(
            url, f"{what} {shown!r}: name the bucket or host after {scheme}://"
        )
    return ArtifactUrl(scheme, f"{parts.netloc}{path}")


def as_url(value: str) -> str:
    """An operator's setting as a URL: a bare path becomes ``file://`` + its absolute form."""
    if "://" in value:
        return parse_url(value, what="artifacts setting").url
    if not value:
        raise ValueError("an artifact location must not be empty")
    return parse_url(Path(value).absolute().as_uri(), what="artifacts setting").url


class ArtifactsConfig(ConfigModel):
    """Where a service keeps artifacts and which URLs clients may name (validated at start)."""

    root: str = Field(
        default="artifacts",
        min_length=1,
        validate_default=True,
        description="URL of the store this service writes under: file:///PATH on a volume "
        "every service mounts (a bare path is taken as one), or s3://BUCKET/PREFIX, gs://... "
        "when that fsspec driver is installed.",
    )
    allowed: list[str] = Field(
        default_factory=list,
        description="More URL prefixes clients may name for models and datasets, besides "
        "root. http(s) hosts are reached only when listed here.",
    )
    cache_dir: str = Field(
        default="",
        description="Local folder for copies of artifacts from non-file stores (model folders "
        "are downloaded once per URL). Empty: a folder under the system's temporary directory.",
    )
    options: dict[str, str] = Field(
        default_factory=dict,
        description="fsspec storage options of root's driver (endpoint_url, region...); "
        "credentials come from the driver's own environment variables, never from here.",
    )

    @field_validator("root")
    @classmethod
    def _root_url(cls, value: str) -> str:
        return _config_url(value)

    @field_validator("allowed")
    @classmethod
    def _allowed_urls(cls, value: list[str]) -> list[str]:
        return [_config_url(v) for v in value]

    def store(self) -> ArtifactStore:
        """The store these settings describe."""
        return ArtifactStore(
            self.root,
            allowed=self.allowed,
            cache_dir=self.cache_dir or None,
            options=self.options,
        )


def _config_url(value: str) -> str:
    try:
        return as_url(value)
    except ArtifactError as exc:
        raise ValueError(exc.message) from None


def _default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"orchard-artifact-cache-{os.getuid()}"


class ArtifactStore:
    """The one way a service reads and writes artifacts (see the module docstring).

    Every method takes a URL and checks it lies under the root or an allowed prefix; a URL a
    client names goes through :meth:`check` first so a bad one fails the RPC with a clear
    status before any work starts.
    """

    def __init__(
        self,
        root: str,
        *,
        allowed: Sequence[str] = (),
        cache_dir: str | os.PathLike[str] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.root = parse_url(root, what="artifacts.root")
        self._prefixes = [self.root, *(parse_url(a, what="artifacts.allowed") for a in allowed)]
        self._cache_dir = Path(cache_dir) if cache_dir else _default_cache_dir()
        self._options = dict(options or {})
        self._filesystems: dict[str, AbstractFileSystem] = {}

    @property
    def root_url(self) -> str:
        return self.root.url

    @property
    def prefixes(self) -> list[str]:
        """The URL prefixes this store accepts (root first)."""
        return [p.url for p in self._prefixes]

    def url(self, *names: str) -> str:
        """The URL of ``names`` under the root, e.g. ``store.url("checkpoints", job_id)``."""
        return self.root.child(*names).url

    # -- checks ----------------------------------------------------------------------------

    def check(self, url: str, *, what: str = "artifact URL") -> ArtifactUrl:
        """``url`` parsed and inside the allowed prefixes (symlinks resolved for file://);
        raises :class:`ArtifactUrlInvalid` or :class:`ArtifactAccessDenied`."""
        parsed = parse_url(url, what=what)
        if parsed.scheme == "file":
            real = ArtifactUrl("file", os.path.realpath(parsed.path))
            if not any(real.is_under(self._real(p)) for p in self._prefixes):
                raise ArtifactAccessDenied(url, self._outside(url, what, real, parsed))
            return real
        if not any(parsed.is_under(p) for p in self._prefixes):
            raise ArtifactAccessDenied(url, self._outside(url, what, parsed, parsed))
        return parsed

    def _check_links(self, url: str, folder: Path) -> None:
        """Refuse a folder holding a link that leads outside the allowed prefixes: whoever
        reads the folder in place (a model loader) would follow it, and copy what it found
        into what it writes back (a checkpoint's tokenizer)."""
        for parent, dirs, files in os.walk(folder, followlinks=False):
            for name in (*dirs, *files):
                entry = Path(parent) / name
                if not entry.is_symlink():
                    continue
                real = ArtifactUrl("file", os.path.realpath(entry))
                if not any(real.is_under(self._real(p)) for p in self._prefixes):
                    raise ArtifactAccessDenied(
                        url,
                        f"artifact folder {shorten(url)!r} holds a link that leads outside the "
                        f"artifact store ({entry.relative_to(folder)} -> {real.url}); links "
                        f"must stay under {', '.join(self.prefixes)} (artifacts.root and "
                        "artifacts.allowed)",
                    )

    @staticmethod
    def _real(prefix: ArtifactUrl) -> ArtifactUrl:
        if prefix.scheme != "file":
            return prefix
        return ArtifactUrl("file", os.path.realpath(prefix.path))

    def _outside(self, url: str, what: str, real: ArtifactUrl, parsed: ArtifactUrl) -> str:
        via = f" (it resolves to {real.url})" if real != parsed else ""
        return (
            f"{what} {shorten(url)!r} lies outside the artifact store{via}: this service reads "
            f"and writes only under {', '.join(self.prefixes)}; put the artifact there, or ask "
            "the operator to add its prefix to artifacts.allowed"
        )

    # -- filesystems -----------------------------------------------------------------------

    def _fs(self, url: ArtifactUrl, shown: str) -> AbstractFileSystem:
        fs = self._filesystems.get(url.scheme)
        if fs is not None:
            return fs
        import fsspec  # noqa: PLC0415 (loaded on first use)

        options = self._options if url.scheme == self.root.scheme else {}
        try:
            fs = fsspec.filesystem(url.scheme, **options)
        except (ImportError, ValueError) as exc:
            raise ArtifactSchemeUnavailable(
                shown,
                f"cannot open {shorten(shown)!r}: no fsspec driver for {url.scheme}:// in this "
                f"service ({exc}); install it (e.g. s3fs, gcsfs) or use another artifacts.root",
            ) from None
        self._filesystems[url.scheme] = fs
        return fs

    @contextlib.contextmanager
    def _errors(self, url: str, doing: str) -> Iterator[None]:
        """OS and driver errors as artifact errors naming the URL."""
        try:
            yield
        except OrchardError:
            raise
        except FileNotFoundError:
            raise ArtifactNotFound(
                url, f"no artifact at {shorten(url)!r} (while {doing}); check the URL"
            ) from None
        except PermissionError as exc:
            raise ArtifactStoreDenied(
                url,
                f"the artifact store refused {doing} {shorten(url)!r}: {exc}; the service "
                "needs read (and for outputs write) access to artifacts.root",
            ) from None
        except OSError as exc:
            raise from_os_error(
                exc, f"{doing} {shorten(url)!r} failed: {exc.strerror or exc}"
            ) from None

    # -- reading ---------------------------------------------------------------------------

    def exists(self, url: str) -> bool:
        checked = self.check(url)
        with self._errors(url, "looking up"):
            return bool(self._fs(checked, url).exists(checked.path))

    def is_file(self, url: str) -> bool:
        checked = self.check(url)
        with self._errors(url, "looking up"):
            return bool(self._fs(checked, url).isfile(checked.path))

    def is_dir(self, url: str) -> bool:
        checked = self.check(url)
        with self._errors(url, "looking up"):
            return bool(self._fs(checked, url).isdir(checked.path))

    def require(self, url: str, *, what: str = "artifact URL", folder: bool = False) -> str:
        """``url`` checked, existing (a folder when ``folder``); its canonical URL."""
        checked = self.check(url, what=what)
        fs = self._fs(checked, url)
        with self._errors(url, "looking up"):
            found = fs.isdir(checked.path) if folder else fs.isfile(checked.path)
            exists = found or fs.exists(checked.path)
        if not found:
            kind = "folder" if folder else "file"
            detail = f"it is not a {kind}" if exists else "nothing is there"
            raise ArtifactNotFound(url, f"{what} {shorten(url)!r}: {detail}; check the URL")
        return checked.url

    def read_bytes(self, url: str) -> bytes:
        checked = self.check(url)
        with self._errors(url, "reading"):
            return bytes(self._fs(checked, url).cat_file(checked.path))

    @contextlib.contextmanager
    def open_read(self, url: str, *, text: bool = False) -> Iterator[IO[Any]]:
        """Stream the artifact: ``with store.open_read(url, text=True) as lines: ...``."""
        checked = self.check(url)
        with self._errors(url, "reading"):
            handle = self._fs(checked, url).open(checked.path, "rb")
        with handle:
            if text:
                import io  # noqa: PLC0415

                with io.TextIOWrapper(handle, encoding="utf-8") as wrapped:
                    yield wrapped
            else:
                yield handle

    def list(self, url: str) -> list[str]:
        """The URLs directly under the folder ``url``, sorted."""
        checked = self.check(url)
        with self._errors(url, "listing"):
            names = self._fs(checked, url).ls(checked.path, detail=False)
        base = checked.path.rstrip("/")
        out = []
        for name in names:
            child = str(name).rstrip("/")
            if checked.scheme == "memory" and not child.startswith("/"):
                child = "/" + child
            if child != base:
                out.append(ArtifactUrl(checked.scheme, child).url)
        return sorted(out)

    def get_dir(self, url: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
        """A local folder with the contents of the folder ``url``.

        A ``file://`` folder is returned as it is (the shared volume, no copy); any other is
        downloaded once into the cache (``cache_dir``, else the store's), keyed by URL, and
        moved into place whole, so concurrent callers never see half a folder.
        """
        checked = self.check(url)
        fs = self._fs(checked, url)
        if checked.scheme == "file":
            folder = Path(checked.path)
            if not folder.is_dir():
                raise ArtifactNotFound(url, f"no artifact folder at {shorten(url)!r}")
            self._check_links(url, folder)
            return folder
        cache = Path(cache_dir) if cache_dir else self._cache_dir
        target = cache / hashlib.sha256(checked.url.encode()).hexdigest()[:32]
        if target.is_dir():
            return target
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
        try:
            with self._errors(url, "downloading"):
                if not fs.isdir(checked.path):
                    raise FileNotFoundError(errno.ENOENT, "no folder", checked.path)
                _download(fs, checked.path, staging)
            try:
                staging.rename(target)
            except OSError as exc:
                if not target.is_dir():  # another caller finished first: theirs stays
                    raise from_os_error(exc) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    # -- writing ---------------------------------------------------------------------------

    def write_bytes(self, url: str, data: bytes) -> str:
        """Write ``data`` at ``url`` whole (file://: a temporary file renamed into place);
        returns the canonical URL."""
        with self.open_write(url) as handle:
            handle.write(data)
        return self.check(url).url

    @contextlib.contextmanager
    def open_write(self, url: str) -> Iterator[IO[bytes]]:
        """Write a stream; the artifact appears only when the block ends without an error
        (file://: atomically, by rename)."""
        checked = self.check(url)
        fs = self._fs(checked, url)
        if checked.scheme != "file":
            with self._errors(url, "writing"):
                parent = checked.path.rsplit("/", 1)[0]
                if parent:
                    fs.makedirs(parent, exist_ok=True)
                handle = fs.open(checked.path, "wb")
            with handle:
                yield handle
            return
        target = Path(checked.path)
        with self._errors(url, "writing"):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            with self._errors(url, "writing"):
                os.replace(staging, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise

    def put_dir(self, local_dir: str | os.PathLike[str], url: str) -> str:
        """Copy the folder ``local_dir`` to ``url`` (which must not exist yet: artifacts never
        change); file:// gets it whole by rename. Returns the canonical URL."""
        source = Path(local_dir)
        if not source.is_dir():
            raise FileNotFoundError(errno.ENOENT, "not a folder to upload", str(source))
        checked = self.check(url)
        fs = self._fs(checked, url)
        with self._errors(url, "writing"):
            if fs.exists(checked.path):
                raise FileExistsError(
                    errno.EEXIST, "an artifact exists there already; artifacts never change", url
                )
            if checked.scheme == "file":
                target = Path(checked.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}"
                try:
                    shutil.copytree(source, staging, symlinks=False)
                    staging.rename(target)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            else:
                _upload(fs, source, checked.path)
        return checked.url


def _download(fs: AbstractFileSystem, remote: str, local: Path) -> None:
    """Copy every file under ``remote`` into ``local`` (no link is followed or made)."""
    base = remote.rstrip("/")
    for name in fs.find(base):
        relative = str(name).lstrip("/")[len(base.lstrip("/")) :].lstrip("/")
        parts = relative.split("/")
        if not relative or any(p in ("", ".", "..") for p in parts):
            continue
        target = local.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open(name, "rb") as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)


def _upload(fs: AbstractFileSystem, local: Path, remote: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        key = f"{remote}/{path.relative_to(local).as_posix()}"
        fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
        with path.open("rb") as src, fs.open(key, "wb") as dst:
            shutil.copyfileobj(src, dst)
