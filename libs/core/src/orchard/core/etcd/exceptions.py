"""Typed errors of the etcd store, and the mapping from gRPC status codes to them."""

from __future__ import annotations

import grpc


class EtcdError(Exception):
    """Base class of every error the etcd store raises."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached or did not answer in time; the call may be retried.

    A mutation that fails this way may or may not have been applied: callers that retry
    writes should use a compare-and-swap so that a retry is harmless.
    """


class EtcdTimeout(EtcdUnavailable):
    """A call ran past its deadline (a slow or partitioned server); retryable."""


class EtcdClosed(EtcdError):
    """The store was used before `connect()` or after `close()`."""


class CompactedRevision(EtcdError):
    """The requested revision has been compacted away: re-list, then watch from the new revision.

    `compact_revision` is the oldest revision still available, where etcd reports it (watches);
    0 where it does not (reads at an old revision).
    """

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class FutureRevision(EtcdError):
    """The requested revision is newer than the store's current revision."""


class LeaseNotFound(EtcdError):
    """The lease does not exist: it expired or was revoked."""


class EtcdRequestError(EtcdError):
    """etcd rejected the request (bad argument, space quota, auth...); retrying will not help."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


# CANCELLED: the channel was closed under the call (failover to another endpoint, or close()).
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def map_rpc_error(error: grpc.aio.AioRpcError, endpoint: str) -> EtcdError:
    """Translate a failed gRPC call into the matching typed error."""
    code = error.code()
    details = error.details() or ""
    where = f"etcd at {endpoint}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EtcdTimeout(f"{where} did not answer in time: {details}")
    if code in _RETRYABLE:
        return EtcdUnavailable(f"{where} is unavailable: {details}")
    if "required revision has been compacted" in details:
        return CompactedRevision(f"{where}: {details}")
    if "required revision is a future revision" in details:
        return FutureRevision(f"{where}: {details}")
    if "lease not found" in details:
        return LeaseNotFound(f"{where}: {details}")
    return EtcdRequestError(f"{where} rejected the request ({code.name}): {details}", code)
