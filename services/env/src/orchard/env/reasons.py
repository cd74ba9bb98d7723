"""Error reasons of the environment service, on top of :class:`orchard.core.errors.Reason`."""

from __future__ import annotations

import grpc

from orchard.core.errors import ErrorReason

__all__ = ["EnvReason"]


class EnvReason(ErrorReason):
    """Failures a client of ``orchard.env.v1.EnvService`` can branch on."""

    UNAUTHENTICATED = (
        grpc.StatusCode.UNAUTHENTICATED,
        "The call carries no bearer token, or one no tenant holds.",
    )
    SANDBOX_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "No such sandbox for this tenant.")
    OWNER_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "No such owner for this tenant (or it expired).")
    ADMISSION_QUEUE_FULL = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "The admission queue is full; nothing was created. Retry after `retry_after_s`.",
    )
    SANDBOX_NOT_READY = (
        grpc.StatusCode.FAILED_PRECONDITION,
        "The sandbox is not READY (still PENDING, FAILED or being deleted).",
    )
    AGENT_UNAVAILABLE = (
        grpc.StatusCode.UNAVAILABLE,
        "The sandbox's agent did not answer; the sandbox may have died.",
    )
    STATE_STORE_UNAVAILABLE = (
        grpc.StatusCode.UNAVAILABLE,
        "The state store (etcd) did not answer; retry.",
    )
    SERVICE_STARTING = (grpc.StatusCode.UNAVAILABLE, "The service is still starting; retry.")
    AGENT_NOT_VERIFIED = (
        grpc.StatusCode.PERMISSION_DENIED,
        "What serves at the sandbox's agent address is not the agent its runtime started (an "
        "impostor); nothing was sent to it.",
    )
    PRIVILEGE_NOT_ALLOWED = (
        grpc.StatusCode.PERMISSION_DENIED,
        "The spec asks for a privilege (SandboxPrivileges) the operator does not allow this "
        "tenant; nothing was created.",
    )
    IMAGE_NOT_ALLOWED = (
        grpc.StatusCode.PERMISSION_DENIED,
        "The image is the host, or names a host path, that the operator's `images` settings do "
        "not allow this tenant; nothing was created.",
    )
