"""Listen addresses: parse and format the forms every Orchard server accepts.

Three forms, the ones gRPC itself understands:

- ``host:port`` with an IPv4 address or a host name (``127.0.0.1:50051``, ``localhost:0``),
- ``[v6]:port`` with a bracketed IPv6 address (``[::]:50051``),
- ``unix:PATH`` for a Unix domain socket (``unix:/run/orchard/agent.sock``); ``unix://PATH``
  with an absolute path is accepted and means the same.

Port ``0`` asks the kernel for a free port; the server reports the one it got.
This module needs nothing but the standard library, so servers can use it without importing
the configuration machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ListenAddress", "parse_listen_address"]

_UNIX_PREFIX = "unix:"
_MAX_PORT = 65535


@dataclass(frozen=True)
class ListenAddress:
    """One parsed listen address: either a TCP host and port, or a Unix socket path."""

    host: str = ""
    """Host or IP address without brackets; empty for a Unix socket."""
    port: int = 0
    """TCP port; 0 asks for an ephemeral one. Unused for a Unix socket."""
    unix_path: str | None = None
    """Path of the Unix socket, or None for TCP."""

    @property
    def is_unix(self) -> bool:
        """True for a Unix domain socket address."""
        return self.unix_path is not None

    def grpc_target(self) -> str:
        """The address as gRPC spells it (for ``add_insecure_port`` or a channel)."""
        if self.unix_path is not None:
            return f"{_UNIX_PREFIX}{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def with_port(self, port: int) -> ListenAddress:
        """The same TCP address with another port (the one actually bound)."""
        return ListenAddress(host=self.host, port=port, unix_path=self.unix_path)

    def __str__(self) -> str:
        return self.grpc_target()


def parse_listen_address(text: str) -> ListenAddress:
    """Parse ``host:port``, ``[v6]:port`` or ``unix:PATH``; ValueError says what is wrong."""
    text = text.strip()
    if text.startswith(_UNIX_PREFIX):
        path = text[len(_UNIX_PREFIX) :]
        if path.startswith("//"):
            path = path[2:]
            if not path.startswith("/"):
                raise ValueError(f"{text!r}: unix:// needs an absolute path (unix:///run/x.sock)")
        if not path:
            raise ValueError(f"{text!r}: unix: needs a socket path (unix:/run/x.sock)")
        return ListenAddress(unix_path=path)
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"{text!r}: expected [IPv6]:PORT, e.g. [::]:50051")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{text!r}: expected HOST:PORT, [IPv6]:PORT or unix:PATH")
        if ":" in host:
            raise ValueError(f"{text!r}: put an IPv6 address in brackets, e.g. [::1]:50051")
    if not port_text.isdigit() or int(port_text) > _MAX_PORT:
        raise ValueError(f"{text!r}: port must be a number from 0 to {_MAX_PORT}")
    return ListenAddress(host=host, port=int(port_text))
