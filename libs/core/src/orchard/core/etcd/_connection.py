"""The gRPC channel to one etcd endpoint, shared by the store, its watches and keep-alives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
from aetcd import rpc

# Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s), and ping
# idle streams so a silently dropped peer surfaces within ~40 s. etcd's default
# --grpc-keepalive-min-time is 5 s; pinging more often gets the connection closed.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def grpc_target(endpoint: str) -> str:
    """Turn `http://host:port` (or `host:port`) into a gRPC target; TLS is not supported yet."""
    if "://" not in endpoint:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"etcd endpoint must look like http://host:port, got {endpoint!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


@dataclass(eq=False)
class Connection:
    """One open channel and the etcd service stubs bound to it."""

    endpoint: str
    channel: grpc.aio.Channel
    kv: Any
    lease: Any
    watch: Any
    maintenance: Any

    @classmethod
    def open(cls, endpoint: str) -> Connection:
        """Create the channel; gRPC connects lazily, on the first call."""
        channel = grpc.aio.insecure_channel(grpc_target(endpoint), options=CHANNEL_OPTIONS)
        return cls(
            endpoint=endpoint,
            channel=channel,
            kv=rpc.KVStub(channel),
            lease=rpc.LeaseStub(channel),
            watch=rpc.WatchStub(channel),
            maintenance=rpc.MaintenanceStub(channel),
        )


class ConnectionSource(Protocol):
    """What watches and keep-alives need from the store: the live connection, and a way to
    report that it failed so the store can move to the next endpoint."""

    def current(self) -> Connection:
        """The connection to use now; raises `EtcdClosed` once the store is closed."""
        ...

    def report_unavailable(self, connection: Connection) -> None:
        """Tell the store that `connection` failed with a retryable error."""
        ...
