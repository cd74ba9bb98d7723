"""Leases: keys that vanish unless someone keeps refreshing them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from orchard.core.etcd._connection import Connection, ConnectionSource
from orchard.core.etcd.exceptions import EtcdError, EtcdUnavailable, LeaseNotFound, map_rpc_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: keys put with it are deleted when it expires or is revoked."""

    id: int
    ttl: int


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A lease's remaining time: `ttl` seconds left of `granted_ttl`, and its keys (without
    the store's namespace) when they were asked for."""

    id: int
    ttl: int
    granted_ttl: int
    keys: list[bytes]


class LeaseKeepAlive:
    """Refreshes one lease every `interval` seconds (a third of its TTL by default) until
    stopped, or until etcd reports the lease gone.

    A refresh that fails with a retryable error is tried again at the next interval, so a
    short etcd outage does not lose the lease as long as it is shorter than the TTL. When
    the lease is found expired, the keep-alive ends and `error` holds `LeaseNotFound`.
    Created by `EtcdStore.keep_alive`; stopped by `stop()`, `EtcdStore.revoke_lease` or
    `EtcdStore.close`.
    """

    def __init__(
        self,
        source: ConnectionSource,
        lease: Lease,
        *,
        interval: float | None,
        call_timeout: float,
        on_done: Callable[[LeaseKeepAlive], None],
    ) -> None:
        self.lease = lease
        self.interval = interval if interval is not None else max(lease.ttl / 3, 0.1)
        self._source = source
        self._call_timeout = call_timeout
        self._on_done = on_done
        self._stopping = asyncio.Event()
        self._error: EtcdError | None = None
        self._last_refresh = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"etcd-lease-keepalive-{lease.id:x}"
        )

    @property
    def running(self) -> bool:
        """Whether the keep-alive is still refreshing the lease."""
        return not self._task.done()

    @property
    def error(self) -> EtcdError | None:
        """Why the keep-alive ended on its own (`LeaseNotFound`, or a non-retryable error)."""
        return self._error

    @property
    def last_refresh(self) -> float:
        """`time.monotonic()` of the last successful refresh (or of the grant)."""
        return self._last_refresh

    async def stop(self) -> None:
        """Stop refreshing; the lease itself stays until it expires or is revoked."""
        self._stopping.set()
        await asyncio.shield(self._task)

    async def wait(self) -> None:
        """Wait until the keep-alive ends; raises its `error` if it ended on its own."""
        await asyncio.shield(self._task)
        if self._error is not None:
            raise self._error

    async def _run(self) -> None:
        # One keep-alive stream, reopened (on the store's current endpoint) after a failure.
        stream: tuple[Connection, Any] | None = None
        failures = 0
        try:
            while not self._stopping.is_set():
                try:
                    if stream is None:
                        connection = self._source.current()
                        stream = (connection, connection.lease.LeaseKeepAlive())
                    ttl = await self._refresh(*stream)
                except EtcdUnavailable as e:
                    failures += 1
                    level = logging.WARNING if failures == 1 else logging.DEBUG
                    log.log(level, "lease %x keep-alive failed, will retry: %s", self.lease.id, e)
                    if stream is not None:
                        stream[1].cancel()
                    stream = None
                except EtcdError as e:
                    self._error = e
                    return
                else:
                    if ttl <= 0:
                        self._error = LeaseNotFound(f"lease {self.lease.id:x} has expired")
                        return
                    if failures:
                        log.info("lease %x keep-alive recovered", self.lease.id)
                    failures = 0
                    self._last_refresh = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.interval)
        finally:
            if stream is not None:
                stream[1].cancel()
            self._on_done(self)

    async def _refresh(self, connection: Connection, call: Any) -> int:
        """Send one keep-alive on the stream; returns the lease's new TTL (<= 0: gone)."""
        try:
            async with asyncio.timeout(self._call_timeout):
                await call.write(rpc.LeaseKeepAliveRequest(ID=self.lease.id))
                response = await call.read()
        except grpc.aio.AioRpcError as e:
            error = map_rpc_error(e, connection.endpoint)
        except TimeoutError:
            error = EtcdUnavailable(f"etcd at {connection.endpoint} did not answer a keep-alive")
        except asyncio.InvalidStateError:
            # gRPC refuses to write to a stream that already failed (etcd went away).
            error = EtcdUnavailable(f"the keep-alive stream to etcd at {connection.endpoint} broke")
        except asyncio.CancelledError:
            # The store closed this channel under us (failover): not our task's cancellation.
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not call.cancelled():
                raise
            error = EtcdUnavailable(f"the channel to etcd at {connection.endpoint} was closed")
        else:
            if response is grpc.aio.EOF:
                error = EtcdUnavailable(f"etcd at {connection.endpoint} ended the keep-alive")
            else:
                return int(response.TTL)
        if isinstance(error, EtcdUnavailable):
            self._source.report_unavailable(connection)
        raise error
