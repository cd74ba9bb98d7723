"""TLS for Orchard's gRPC servers: reading PEM files and building server credentials.

A server serves TLS on its TCP listeners when ``server.tls_cert_file`` and
``server.tls_key_file`` are set; with ``server.tls_client_ca_file`` it also requires every
client to present a certificate signed by that CA (mutual TLS). Unix socket listeners stay
plaintext: gRPC's Unix transport has no TLS to offer, and the socket's file mode decides who may
connect.

Imported only when a configuration is validated or a server with TLS starts.
"""

from __future__ import annotations

import os

import grpc

__all__ = ["TLS_KEYS", "read_pem", "server_credentials", "tls_pairing_problem"]

TLS_KEYS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
"""The TLS fields of the ``server`` section."""

_PEM_MARKER = b"-----BEGIN "


def read_pem(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a PEM file; ValueError saying why when it cannot be read or is not PEM."""
    try:
        with open(path, "rb") as pem:
            data = pem.read()
    except OSError as exc:
        raise ValueError(f"cannot read {os.fspath(path)!s}: {exc.strerror or exc}") from None
    if _PEM_MARKER not in data:
        raise ValueError(f"{os.fspath(path)!s} is not a PEM file (no '-----BEGIN' line)")
    return data


def tls_pairing_problem(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None
) -> str | None:
    """Why these TLS settings do not go together, or None: certificate and key come as a pair,
    and a client CA only makes sense on a TLS server."""
    if bool(cert_file) != bool(key_file):
        given, missing = (
            ("tls_cert_file", "tls_key_file") if cert_file else ("tls_key_file", "tls_cert_file")
        )
        return f"{missing} is required when {given} is set (set both, or neither)"
    if client_ca_file and not cert_file:
        return (
            "tls_client_ca_file needs tls_cert_file and tls_key_file (client certificates are "
            "checked only on a TLS server)"
        )
    return None


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``; with ``client_ca_file``, client certificates are
    required and checked against it. Raises ValueError naming the unreadable file."""
    problems = []
    pems: dict[str, bytes] = {}
    for key, path in (
        ("tls_cert_file", cert_file),
        ("tls_key_file", key_file),
        ("tls_client_ca_file", client_ca_file),
    ):
        if path:
            try:
                pems[key] = read_pem(path)
            except ValueError as exc:
                problems.append(f"server.{key}: {exc}")
    if problems:
        raise ValueError("; ".join(problems))
    client_ca = pems.get("tls_client_ca_file")
    return grpc.ssl_server_credentials(
        [(pems["tls_key_file"], pems["tls_cert_file"])],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
