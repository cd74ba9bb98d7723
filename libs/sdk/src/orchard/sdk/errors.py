"""Typed exceptions: one class per kind of failure a caller can act on.

Every failed call to the environment service becomes a :class:`ServiceError` subclass chosen by
the ``google.rpc.ErrorInfo`` reason the service attached, else by the gRPC status code. Nothing
is collapsed into one generic error, so callers branch with ``except``::

    from orchard.sdk import SandboxNotFound, ResourceExhausted

    try:
        sandbox = client.get("sbx-8f3c2a1d9e7b")
    except SandboxNotFound:
        ...  # reaped or never existed
    except ResourceExhausted as exc:
        time.sleep(exc.retry_after or 5)

The hierarchy::

    OrchardSDKError
    ├── ConfigurationError        no endpoint or token could be found
    ├── ServiceError              the service answered with a failure status
    │   ├── InvalidArgument
    │   ├── NotFound
    │   │   ├── SandboxNotFound
    │   │   └── FileNotFound
    │   ├── AlreadyExists
    │   ├── FailedPrecondition
    │   │   └── SandboxNotReady
    │   ├── PermissionDenied
    │   ├── Unauthenticated
    │   ├── ResourceExhausted     .retry_after (seconds) when the service gave a hint
    │   ├── DeadlineExceeded
    │   ├── Unavailable           retried by the client before it reaches you
    │   ├── Aborted, Cancelled, Unimplemented, Internal, UnknownError
    ├── SandboxFailed             the sandbox reached FAILED; .failure_reason says why
    ├── CommandFailed             ExecResult.check() on a non-zero exit
    └── PatchFailed               Sandbox.apply_diff could not apply the diff; .output
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

from orchard.core.errors import ERROR_DOMAIN, rich_status

if TYPE_CHECKING:
    from orchard.sdk.types import ExecResult

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "CommandFailed",
    "ConfigurationError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FileNotFound",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OrchardSDKError",
    "PatchFailed",
    "PermissionDenied",
    "ResourceExhausted",
    "SandboxFailed",
    "SandboxNotFound",
    "SandboxNotReady",
    "ServiceError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "UnknownError",
    "UnsafeListing",
    "from_rpc_error",
]


class OrchardSDKError(Exception):
    """Base of every exception this package raises."""


class ConfigurationError(OrchardSDKError):
    """The client cannot be configured: no endpoint, or an unreadable profile."""


class ServiceError(OrchardSDKError):
    """The environment service (or the transport to it) answered a call with a failure status.

    Attributes: ``code`` (the ``grpc.StatusCode``), ``reason`` (the ``ErrorInfo`` reason, or the
    code's name when the status carried none), ``message`` (what the service said),
    ``metadata`` (the ``ErrorInfo`` metadata, e.g. ``{"sandbox_id": ...}``) and ``method`` (the
    RPC, e.g. ``"CreateSandbox"``).
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        method: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason or code.name
        self.metadata: dict[str, str] = dict(metadata or {})
        self.method = method

    def __str__(self) -> str:
        return f"{self.message} [{self.reason}]" if self.message else self.reason


class InvalidArgument(ServiceError):
    """A request field was rejected (``INVALID_ARGUMENT``): fix the request, do not retry."""


class NotFound(ServiceError):
    """The named thing does not exist (``NOT_FOUND``)."""


class SandboxNotFound(NotFound):
    """The sandbox does not exist, was reaped after missing heartbeats, or is another tenant's."""


class FileNotFound(NotFound):
    """A path inside the sandbox (a file, a directory, an executable) does not exist."""


class AlreadyExists(ServiceError):
    """The thing to create exists already (``ALREADY_EXISTS``)."""


class FailedPrecondition(ServiceError):
    """The system is not in a state that allows the call (``FAILED_PRECONDITION``)."""


class SandboxNotReady(FailedPrecondition):
    """The sandbox is not READY (still PENDING, FAILED or DELETING): exec and files refused."""


class PermissionDenied(ServiceError):
    """The caller may not do this (``PERMISSION_DENIED``)."""


class Unauthenticated(ServiceError):
    """The token is missing or unknown (``UNAUTHENTICATED``)."""


class ResourceExhausted(ServiceError):
    """A quota, the admission queue or an output cap ran out (``RESOURCE_EXHAUSTED``).

    ``retry_after`` is how many seconds the service suggested waiting before trying again, or
    None when it gave no hint. The client never retries this on its own.
    """

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after = retry_after


class DeadlineExceeded(ServiceError):
    """The call ran out of time (``DEADLINE_EXCEEDED``), e.g. a sandbox not READY in time."""


class Unavailable(ServiceError):
    """The service (or the sandbox's agent) could not be reached (``UNAVAILABLE``).

    The client retries this with backoff on calls that are safe to repeat; you see it only
    after the retries ran out, or on a call that is not safe to repeat (``exec``).
    """


class Aborted(ServiceError):
    """A concurrent change won (``ABORTED``); retry the whole sequence."""


class Cancelled(ServiceError):
    """The call was cancelled (``CANCELLED``)."""


class Unimplemented(ServiceError):
    """The service does not support this call (``UNIMPLEMENTED``)."""


class Internal(ServiceError):
    """A bug or unexpected failure in the service (``INTERNAL``); its log has the incident id."""


class UnknownError(ServiceError):
    """A status with no better class (``UNKNOWN``, ``DATA_LOSS``, ``OUT_OF_RANGE``)."""


class SandboxFailed(OrchardSDKError):
    """The sandbox reached FAILED instead of READY.

    ``failure_reason`` is the service's stable reason (e.g. ``"IMAGE_NOT_FOUND"``,
    ``"OUT_OF_MEMORY"``) and ``sandbox_id`` the sandbox's id.
    """

    def __init__(self, sandbox_id: str, failure_reason: str, message: str) -> None:
        super().__init__(f"sandbox {sandbox_id} failed: {message} [{failure_reason}]")
        self.sandbox_id = sandbox_id
        self.failure_reason = failure_reason
        self.message = message


class CommandFailed(OrchardSDKError):
    """A command exited non-zero, by a signal, or timed out; raised by ``ExecResult.check()``.

    ``result`` is the whole :class:`~orchard.sdk.types.ExecResult`.
    """

    def __init__(self, result: ExecResult, command: str = "") -> None:
        self.result = result
        self.command = command
        if result.timed_out:
            how = "timed out"
        elif result.signal is not None:
            how = f"was killed by signal {result.signal}"
        else:
            how = f"exited with status {result.exit_code}"
        tail = result.stderr[-2000:].decode("utf-8", "replace").strip()
        text = f"command {command!r} {how}" if command else f"command {how}"
        super().__init__(f"{text}: {tail}" if tail else text)


class UnsafeListing(OrchardSDKError):
    """A download stopped because what the sandbox listed would land outside the destination
    (a name that is ``..``, absolute, holds a separator or NUL, repeats, or a path that leads
    through a symbolic link). Nothing was written outside the destination; what the download
    wrote inside it so far stays."""


class PatchFailed(OrchardSDKError):
    """A diff could not be applied in the sandbox; ``output`` holds the tool's own words.

    ``tool`` is ``"git apply"`` or ``"patch"``, or empty when the sandbox had neither.
    """

    def __init__(self, message: str, *, tool: str = "", output: str = "") -> None:
        super().__init__(f"{message}\n{output}".rstrip() if output else message)
        self.tool = tool
        self.output = output


_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
}

# Reasons that name the thing more precisely than the status code does.
_BY_REASON: dict[str, type[ServiceError]] = {
    "SANDBOX_NOT_FOUND": SandboxNotFound,
    "SANDBOX_NOT_READY": SandboxNotReady,
    "EXECUTABLE_NOT_FOUND": FileNotFound,
    "WORKING_DIR_NOT_FOUND": FileNotFound,
}

# Metadata keys a service may use for a retry hint, in seconds or milliseconds.
_RETRY_AFTER_KEYS: tuple[tuple[str, float], ...] = (
    ("retry_after_s", 1.0),
    ("retry_after", 1.0),
    ("retry_after_ms", 0.001),
)


def from_rpc_error(
    error: grpc.RpcError, *, method: str = "", sandbox_call: bool = False
) -> ServiceError:
    """The typed exception for a failed call.

    ``sandbox_call`` says the call names a sandbox, so that a plain ``NOT_FOUND`` without a
    file path means the sandbox is gone and a ``FAILED_PRECONDITION`` without a more specific
    reason means it is not READY.
    """
    code: grpc.StatusCode = error.code() if callable(getattr(error, "code", None)) else None
    code = code or grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else None
    message = details or code.name.lower().replace("_", " ")
    reason: str | None = None
    metadata: dict[str, str] = {}
    retry_after: float | None = None
    status = rich_status(error)
    if status is not None:
        from google.rpc import error_details_pb2  # type: ignore[import-untyped]  # noqa: PLC0415

        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain in ("", ERROR_DOMAIN):
                    reason = info.reason or None
                    metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                hint = error_details_pb2.RetryInfo()
                detail.Unpack(hint)
                retry_after = hint.retry_delay.ToTimedelta().total_seconds()
    cls = _classify(code, reason, metadata, sandbox_call)
    kwargs: dict[str, object] = {
        "code": code,
        "reason": reason,
        "metadata": metadata,
        "method": method,
    }
    if cls is ResourceExhausted:
        if retry_after is None:
            retry_after = _retry_after_from_metadata(metadata)
        return ResourceExhausted(message, retry_after=retry_after, **kwargs)
    return cls(message, **kwargs)  # type: ignore[arg-type]


def _classify(
    code: grpc.StatusCode, reason: str | None, metadata: Mapping[str, str], sandbox_call: bool
) -> type[ServiceError]:
    if reason in _BY_REASON:
        return _BY_REASON[reason]
    if code == grpc.StatusCode.NOT_FOUND:
        if "path" in metadata:
            return FileNotFound
        if "sandbox_id" in metadata or sandbox_call:
            return SandboxNotFound
    if (
        code == grpc.StatusCode.FAILED_PRECONDITION
        and reason in (None, "FAILED_PRECONDITION")
        and ("state" in metadata or sandbox_call)
    ):
        return SandboxNotReady
    return _BY_CODE.get(code, UnknownError)


def _retry_after_from_metadata(metadata: Mapping[str, str]) -> float | None:
    for key, scale in _RETRY_AFTER_KEYS:
        text = metadata.get(key, "").strip().removesuffix("s")
        if text:
            try:
                return float(text) * scale
            except ValueError:
                continue
    return None
