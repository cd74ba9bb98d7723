"""The agent's own error reasons, on top of the common table in :mod:`orchard.core.errors`."""

from __future__ import annotations

import enum

import grpc

from orchard.core.errors import ErrorReason

__all__ = ["AgentReason"]


@enum.unique
class AgentReason(ErrorReason):
    """Failures specific to the agent; the member name is the ``ErrorInfo.reason``."""

    EXECUTABLE_NOT_FOUND = (
        grpc.StatusCode.NOT_FOUND,
        "The command's executable does not exist (or is not on PATH).",
    )
    NOT_EXECUTABLE = (
        grpc.StatusCode.PERMISSION_DENIED,
        "The command's executable exists but may not be executed.",
    )
    WORKING_DIR_NOT_FOUND = (
        grpc.StatusCode.NOT_FOUND,
        "The command's working directory does not exist.",
    )
    AGENT_KEY_MISSING = (
        grpc.StatusCode.FAILED_PRECONDITION,
        "The agent was started without a sandbox key (ORCHARD_AGENT_KEY): it cannot prove "
        "which sandbox it serves.",
    )
    CREDENTIAL_INVALID = (
        grpc.StatusCode.UNAUTHENTICATED,
        "The call's route credential is malformed, forged or expired (or missing where the "
        "agent requires one): open a new route with EnvService.OpenAgentRoute.",
    )
    CREDENTIAL_WRONG_SANDBOX = (
        grpc.StatusCode.PERMISSION_DENIED,
        "The call's route credential is valid but for another sandbox.",
    )
    MALFORMED_REQUEST = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "The request bytes are not a valid message of the method's request type.",
    )
