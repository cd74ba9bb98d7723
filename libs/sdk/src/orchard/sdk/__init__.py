"""Orchard's Python client for the environment service, sync and async.

::

    from orchard.sdk import SandboxClient

    with SandboxClient() as client:
        with client.create(image="host") as sandbox:
            print(sandbox.exec(["uname", "-a"]).check().stdout_text)

:class:`AsyncSandboxClient` is the same API with ``await`` (and ``async with``/``async for``).
Connection settings come from arguments, ``$ORCHARD_ENDPOINT``/``$ORCHARD_TOKEN``, or the
profile ``orchard up`` writes. Failures are typed (:mod:`orchard.sdk.errors`).
"""

from orchard.sdk.aio import AsyncSandbox, AsyncSandboxClient, SandboxCreation, TransferProgress
from orchard.sdk.connection import ConnectionSettings, Profile
from orchard.sdk.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    CommandFailed,
    ConfigurationError,
    DeadlineExceeded,
    FailedPrecondition,
    FileNotFound,
    Internal,
    InvalidArgument,
    NotFound,
    OrchardSDKError,
    PatchFailed,
    PermissionDenied,
    ResourceExhausted,
    SandboxFailed,
    SandboxNotFound,
    SandboxNotReady,
    ServiceError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    UnknownError,
)
from orchard.sdk.retry import RetryPolicy
from orchard.sdk.sync import Sandbox, SandboxClient
from orchard.sdk.types import (
    EgressRule,
    ExecEvent,
    ExecExit,
    ExecResult,
    ExecStarted,
    ExecStderr,
    ExecStdout,
    FileInfo,
    FileType,
    Resources,
    SandboxInfo,
    SandboxState,
)

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "Cancelled",
    "CommandFailed",
    "ConfigurationError",
    "ConnectionSettings",
    "DeadlineExceeded",
    "EgressRule",
    "ExecEvent",
    "ExecExit",
    "ExecResult",
    "ExecStarted",
    "ExecStderr",
    "ExecStdout",
    "FailedPrecondition",
    "FileInfo",
    "FileNotFound",
    "FileType",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OrchardSDKError",
    "PatchFailed",
    "PermissionDenied",
    "Profile",
    "ResourceExhausted",
    "Resources",
    "RetryPolicy",
    "Sandbox",
    "SandboxClient",
    "SandboxCreation",
    "SandboxFailed",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxNotReady",
    "SandboxState",
    "ServiceError",
    "TransferProgress",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "UnknownError",
]
