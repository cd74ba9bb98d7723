"""Errors: one table of reasons, each bound to a gRPC status code, shared by server and client.

A failure a client can act on is an :class:`OrchardError` carrying a *reason*. On the wire it
becomes a rich status: the reason's gRPC code, the message, and a ``google.rpc.Status`` detail
``google.rpc.ErrorInfo{reason, domain="orchard", metadata}`` in the trailing metadata, so any
gRPC client sees the right code and ours can branch on the reason.

Servicers just raise; :class:`ErrorInterceptor` (installed by
:class:`orchard.core.server.GrpcServer`) does the rest for all four kinds of RPC::

    raise OrchardError(Reason.NOT_FOUND, f"no sandbox {sid!r}", metadata={"sandbox_id": sid})

Anything else a handler raises: an ``OSError`` is mapped by its errno (ENOENT → NOT_FOUND,
EACCES → PERMISSION_DENIED, ENOSPC → RESOURCE_EXHAUSTED, ...; see :func:`from_os_error`); the
state store not answering in time (:class:`orchard.core.etcd.EtcdUnavailable`, a busy or
partitioned etcd, or a process too starved to hear it) is ``UNAVAILABLE``, which a client may
retry, logged as a warning; any other exception becomes ``INTERNAL`` with a generic message
and an incident id, while the traceback goes to the log under the same id, never to the client.

Requests that do not parse never reach a handler: the interceptor guards every request
deserializer, and such a call fails with INVALID_ARGUMENT (reason ``MALFORMED_REQUEST``) after
the service's ``authenticate`` check, if it has one, logging one short line at most
(rate-limited). Messages and metadata are capped (:func:`shorten`), so a status quoting a
client's 100 KB input still fits in the trailers.

A service with failures of its own declares its own table, a subclass of :class:`ErrorReason`
whose members are ``(status code, when it happens)``::

    class AgentReason(ErrorReason):
        PROCESS_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "No process with that id.")
        OUTPUT_TRUNCATED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "Output passed its cap.")

Clients branch with :func:`error_info`::

    except grpc.RpcError as exc:
        info = error_info(exc)
        if info is not None and info.reason == "NOT_FOUND": ...
"""

from __future__ import annotations

import enum
import errno
import inspect
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from orchard.core._handlers import wrap_handler
from orchard.core.etcd.exceptions import EtcdUnavailable
from orchard.core.logging import RateLimitedLog

if TYPE_CHECKING:
    from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

__all__ = [
    "ERROR_DOMAIN",
    "ErrorInterceptor",
    "ErrorReason",
    "OrchardError",
    "Reason",
    "client_error",
    "error_info",
    "from_os_error",
    "rich_status",
    "shorten",
]

ERROR_DOMAIN = "orchard"
"""The ``ErrorInfo.domain`` of every error an Orchard service raises."""

_STATUS_DETAILS_KEY = "grpc-status-details-bin"

log = logging.getLogger(__name__)
# Lines a client can trigger at will: a few per method and minute, then counted.
_client_log = RateLimitedLog(log, burst=5, interval_s=60.0)

MAX_MESSAGE_CHARS = 1024
"""Longest status message sent; longer ones are cut (the trailers hold about 8 KB)."""
MAX_QUOTE_CHARS = 200
"""Longest piece of client input quoted in a message or ErrorInfo metadata value."""


def shorten(text: str, limit: int = MAX_QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis and the full length, for quoting
    client input in an error without echoing all of it."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


class ErrorReason(enum.Enum):
    """Base of every reason table: member name = ErrorInfo reason, value = (code, description).

    Subclass it per service; the member's name is what goes on the wire, so keep names unique
    across Orchard and never rename a released one.
    """

    def __init__(self, code: grpc.StatusCode, description: str) -> None:
        self.code = code
        self.description = description

    @property
    def reason(self) -> str:
        """The ``ErrorInfo.reason`` string, e.g. ``"NOT_FOUND"``."""
        return self.name


@enum.unique
class Reason(ErrorReason):
    """Reasons common to every Orchard service."""

    INVALID_ARGUMENT = (grpc.StatusCode.INVALID_ARGUMENT, "A request field is malformed.")
    INVALID_PATH = (grpc.StatusCode.INVALID_ARGUMENT, "A path is malformed or not allowed.")
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "The named thing does not exist.")
    ALREADY_EXISTS = (grpc.StatusCode.ALREADY_EXISTS, "The thing to create exists already.")
    PERMISSION_DENIED = (grpc.StatusCode.PERMISSION_DENIED, "The caller may not do this.")
    FAILED_PRECONDITION = (
        grpc.StatusCode.FAILED_PRECONDITION,
        "The system is not in a state that allows the operation (e.g. sandbox not ready).",
    )
    IS_A_DIRECTORY = (grpc.StatusCode.FAILED_PRECONDITION, "Expected a file, found a directory.")
    NOT_A_DIRECTORY = (grpc.StatusCode.FAILED_PRECONDITION, "Expected a directory.")
    DIRECTORY_NOT_EMPTY = (grpc.StatusCode.FAILED_PRECONDITION, "The directory is not empty.")
    OUTPUT_LIMIT = (grpc.StatusCode.RESOURCE_EXHAUSTED, "Output passed its size cap.")
    RESOURCE_EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "A quota, disk or memory ran out.")
    DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, "The operation ran out of time.")
    ABORTED = (grpc.StatusCode.ABORTED, "A concurrent change won; retry the whole sequence.")
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, "Temporarily unavailable; safe to retry.")
    UNIMPLEMENTED = (grpc.StatusCode.UNIMPLEMENTED, "Not supported here.")
    INTERNAL = (grpc.StatusCode.INTERNAL, "A bug or unexpected failure on the server.")
    MALFORMED_REQUEST = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "The request bytes are not a valid message of the method's request type.",
    )


class OrchardError(Exception):
    """An error for the client: a reason (hence a status code), a message and metadata."""

    def __init__(
        self, reason: ErrorReason, message: str, *, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}

    @property
    def code(self) -> grpc.StatusCode:
        """The gRPC status code the reason maps to."""
        return self.reason.code

    def to_status(self) -> grpc.Status:
        """The rich status (code, message, ErrorInfo detail) to abort a call with."""
        from grpc_status import rpc_status  # noqa: PLC0415 - see to_rpc_status

        return rpc_status.to_status(self.to_rpc_status())

    def to_rpc_status(self) -> status_pb2.Status:
        """The ``google.rpc.Status`` of this error: code, message and the ErrorInfo detail."""
        # Loaded on first use: the protobuf modules cost ~40 ms at import.
        from google.protobuf import any_pb2  # noqa: PLC0415
        from google.rpc import error_details_pb2, status_pb2  # noqa: PLC0415

        # Capped: a message quoting a huge input must not overflow the trailers (the client
        # would get RESOURCE_EXHAUSTED instead of this status).
        message = shorten(self.message, MAX_MESSAGE_CHARS)
        metadata = {shorten(k, 64): shorten(v) for k, v in list(self.metadata.items())[:16]}
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.ErrorInfo(
                reason=self.reason.reason, domain=ERROR_DOMAIN, metadata=metadata
            )
        )
        return status_pb2.Status(code=self.code.value[0], message=message, details=[detail])

    def __repr__(self) -> str:
        return f"OrchardError({self.reason.reason}, {self.message!r})"


# errno → reason; anything not listed is FAILED_PRECONDITION: an OS error says something about
# the state of the files or the system, never that the server has a bug.
_ERRNO_REASONS: dict[int, ErrorReason] = {
    errno.ENOENT: Reason.NOT_FOUND,
    errno.ESRCH: Reason.NOT_FOUND,
    errno.EACCES: Reason.PERMISSION_DENIED,
    errno.EPERM: Reason.PERMISSION_DENIED,
    errno.EROFS: Reason.PERMISSION_DENIED,
    errno.EEXIST: Reason.ALREADY_EXISTS,
    errno.EISDIR: Reason.IS_A_DIRECTORY,
    errno.ENOTDIR: Reason.NOT_A_DIRECTORY,
    errno.ENOTEMPTY: Reason.DIRECTORY_NOT_EMPTY,
    errno.EBUSY: Reason.FAILED_PRECONDITION,
    errno.ETXTBSY: Reason.FAILED_PRECONDITION,
    errno.EXDEV: Reason.FAILED_PRECONDITION,
    errno.EINVAL: Reason.INVALID_ARGUMENT,
    errno.ENAMETOOLONG: Reason.INVALID_PATH,
    errno.ELOOP: Reason.INVALID_PATH,
    errno.ENOSPC: Reason.RESOURCE_EXHAUSTED,
    errno.EDQUOT: Reason.RESOURCE_EXHAUSTED,
    errno.EFBIG: Reason.RESOURCE_EXHAUSTED,
    errno.EMFILE: Reason.RESOURCE_EXHAUSTED,
    errno.ENFILE: Reason.RESOURCE_EXHAUSTED,
    errno.ENOMEM: Reason.RESOURCE_EXHAUSTED,
    errno.ETIMEDOUT: Reason.DEADLINE_EXCEEDED,
    errno.EAGAIN: Reason.UNAVAILABLE,
    errno.ECONNREFUSED: Reason.UNAVAILABLE,
    errno.ECONNRESET: Reason.UNAVAILABLE,
    errno.EHOSTUNREACH: Reason.UNAVAILABLE,
    errno.ENETUNREACH: Reason.UNAVAILABLE,
    errno.ENOSYS: Reason.UNIMPLEMENTED,
    errno.EOPNOTSUPP: Reason.UNIMPLEMENTED,
    errno.ENOTTY: Reason.UNIMPLEMENTED,
    errno.EIO: Reason.FAILED_PRECONDITION,  # e.g. /proc/<pid>/mem at an unmapped address
    errno.ENXIO: Reason.FAILED_PRECONDITION,
    errno.ENODEV: Reason.FAILED_PRECONDITION,
    errno.EBADF: Reason.FAILED_PRECONDITION,
    errno.EFAULT: Reason.INVALID_ARGUMENT,
    errno.ESPIPE: Reason.INVALID_ARGUMENT,
    errno.EOVERFLOW: Reason.INVALID_ARGUMENT,
    errno.ERANGE: Reason.INVALID_ARGUMENT,
    errno.E2BIG: Reason.INVALID_ARGUMENT,
    errno.EMLINK: Reason.RESOURCE_EXHAUSTED,
    errno.EPIPE: Reason.UNAVAILABLE,
}


def from_os_error(exc: OSError, message: str | None = None) -> OrchardError:
    """Translate an OSError by its errno; metadata carries ``errno`` (its name) and ``path``.

    The default message is the OS's own text with the path, e.g.
    ``No such file or directory: '/data/x'``.
    """
    reason = _ERRNO_REASONS.get(exc.errno or 0, Reason.FAILED_PRECONDITION)
    metadata: dict[str, str] = {}
    if exc.errno is not None:
        metadata["errno"] = errno.errorcode.get(exc.errno, str(exc.errno))
    path = _show_path(exc.filename)
    if path is not None:
        path = shorten(path)
        metadata["path"] = path
    if message is None:
        message = exc.strerror or str(exc)
        if path is not None:
            message += f": '{path}'"
    return OrchardError(reason, message, metadata=metadata)


def _show_path(filename: object) -> str | None:
    """A path as a person reads it: bytes decoded, bytes that are not UTF-8 as ``\\xNN``."""
    if filename is None:
        return None
    if isinstance(filename, bytes):
        return filename.decode("utf-8", "backslashreplace")
    return os.fsdecode(filename) if isinstance(filename, os.PathLike) else str(filename)


def rich_status(rpc_error: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` a server attached to a failed call, or None.

    Works with errors from sync stubs (``grpc.RpcError``) and grpc.aio (``AioRpcError``).
    """
    from google.rpc import status_pb2  # noqa: PLC0415

    trailing = getattr(rpc_error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == _STATUS_DETAILS_KEY:
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None


def error_info(rpc_error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ``ErrorInfo`` (reason, domain, metadata) of a failed call, or None if it has none."""
    from google.rpc import error_details_pb2  # noqa: PLC0415

    status = rich_status(rpc_error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Turns exceptions raised by handlers into statuses, for unary and streaming RPCs.

    - :class:`OrchardError` → its code, message and ErrorInfo,
    - ``OSError`` → :func:`from_os_error`,
    - ``EtcdUnavailable`` (the state store did not answer in time) → UNAVAILABLE,
    - ``context.abort(...)`` by the handler itself and cancellation → passed through,
    - anything else → INTERNAL "internal error (incident ID)", traceback logged with that ID.
    """

    def __init__(self, authenticators: Mapping[str, Authenticate] | None = None) -> None:
        # method → (handler found, handler wrapped): wrapping once per method, not per call,
        # spares every call two closures and a namedtuple copy.
        self._wrapped: dict[str, tuple[Any, Any]] = {}
        # service name → its authentication check, run before a malformed request is refused
        self._authenticators = dict(authenticators or {})

    async def intercept_service(
        self, continuation: Any, handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        service = method[1:].rpartition("/")[0]
        guarded = _guard_decoding(handler, method, self._authenticators.get(service))
        wrapped = wrap_handler(guarded, method, _TranslateErrors)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


Authenticate = Callable[[grpc.aio.ServicerContext], object]
"""A service's check of a call's credentials: raises (an OrchardError, UNAUTHENTICATED) when
they are missing or wrong; its return value is ignored."""


class _Malformed:
    """Stands in for a request whose bytes did not parse (see :func:`_guard_decoding`)."""

    __slots__ = ("error", "size")

    def __init__(self, size: int, error: str) -> None:
        self.size = size
        self.error = error


def _guard_decoding(handler: Any, method: str, authenticate: Authenticate | None) -> Any:
    """``handler`` with a request deserializer that cannot raise: grpc.aio decodes a request
    before any interceptor or handler code runs and fails a call it cannot decode with UNKNOWN
    and a logged traceback. Bytes that do not parse become a marker that the behaviour
    refuses, after the service's authentication, with INVALID_ARGUMENT."""
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:
            return _Malformed(len(data), str(exc))

    async def refuse(marker: _Malformed, context: grpc.aio.ServicerContext) -> None:
        if authenticate is not None:
            authenticate(context)  # unauthenticated garbage: UNAUTHENTICATED, not a parse error
        _client_log.log(
            logging.WARNING,
            method,
            "malformed request refused",
            extra={"method": method, "bytes": marker.size},
        )
        raise OrchardError(
            Reason.MALFORMED_REQUEST,
            f"the request to {method} is not a valid protobuf message of its type: "
            f"{shorten(marker.error)}",
        )

    handler = handler._replace(request_deserializer=deserialize)
    for kind in ("unary_unary", "unary_stream"):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return handler._replace(**{kind: _unary_guard(behaviour, refuse)})
    for kind in ("stream_unary", "stream_stream"):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return handler._replace(**{kind: _stream_guard(behaviour, refuse)})
    return handler


Refuse = Callable[[_Malformed, grpc.aio.ServicerContext], Any]


def _unary_guard(behaviour: Callable[..., Any], refuse: Refuse) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            async for response in behaviour(request, context):
                yield response

        return stream

    if inspect.iscoroutinefunction(behaviour):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await behaviour(request, context)

        return call
    return behaviour  # a plain function runs in grpc's thread pool: left as it is


def _stream_guard(behaviour: Callable[..., Any], refuse: Refuse) -> Callable[..., Any]:
    def checked(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def each() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                yield request

        return each()

    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behaviour(checked(requests, context), context):
                yield response

        return stream

    if inspect.iscoroutinefunction(behaviour):

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(checked(requests, context), context)

        return call
    return behaviour


def client_error(exc: Exception, method: str) -> OrchardError:
    """What a handler's exception ``exc`` tells the client of ``method``: an OrchardError as
    it is, an OSError by its errno, a state store that did not answer as UNAVAILABLE (logged as
    a rate-limited warning), anything else INTERNAL with an incident id (the traceback logged
    under it)."""
    if isinstance(exc, OrchardError):
        return exc
    if isinstance(exc, OSError):
        return from_os_error(exc)
    if isinstance(exc, EtcdUnavailable):
        _client_log.log(
            logging.WARNING,
            f"store:{method}",
            "%s: the state store did not answer: %s",
            method,
            exc,
            extra={"method": method},
        )
        return OrchardError(
            Reason.UNAVAILABLE,
            "the service's state store (etcd) did not answer in time; try the call again shortly",
        )
    incident = uuid.uuid4().hex[:12]
    # Rate-limited too: a request that trips a bug can be sent in a loop.
    _client_log.log(
        logging.ERROR,
        f"internal:{method}",
        "unexpected error in %s",
        method,
        exc_info=exc,
        extra={"method": method, "incident": incident},
    )
    return OrchardError(
        Reason.INTERNAL,
        f"internal error (incident {incident}); the server log has the details",
        metadata={"incident": incident},
    )


class _TranslateErrors:
    """Runs around one call; turns what the handler raised into the call's status.

    A plain class rather than ``@asynccontextmanager``: it costs no generator per call.
    """

    __slots__ = ("context", "method")

    def __init__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.method = method
        self.context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        # Cancellation and other BaseExceptions, and the handler's own abort, pass through.
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, grpc.aio.AbortError):
            return False
        await self.context.abort_with_status(client_error(exc, self.method).to_status())
        return False  # not reached: abort_with_status raises AbortError
