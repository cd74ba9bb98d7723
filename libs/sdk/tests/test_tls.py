"""TLS in the SDK: a client with the CA reaches a TLS server; tokens never go out in plaintext.

The server is a real :class:`orchard.core.server.GrpcServer` with TLS, serving a minimal
EnvService TEST DOUBLE that answers ListSandboxes (an empty page) and records the token it got.
Certificates come from the ``tls_files`` fixture (made at test time by the openssl command).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.server import GrpcServer, ServiceBinding
from orchard.env.v1 import env_service_pb2, env_service_pb2_grpc
from orchard.sdk import AsyncSandboxClient, ConfigurationError, RetryPolicy, SandboxClient
from orchard.sdk.cli import main
from orchard.sdk.connection import is_local_endpoint, resolve_connection
from orchard.sdk.errors import Unavailable

TOKEN = "tls-test-token"


class ListingEnvService(env_service_pb2_grpc.EnvServiceServicer):
    """Answers ListSandboxes with no sandboxes; remembers each call's authorization header."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []

    async def ListSandboxes(
        self, request: env_service_pb2.ListSandboxesRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.ListSandboxesResponse:
        metadata = dict(context.invocation_metadata() or ())
        self.authorizations.append(str(metadata.get("authorization", "")))
        return env_service_pb2.ListSandboxesResponse()


@pytest.fixture
async def tls_server(
    tls_files: dict[str, Path], isolated_env: Path
) -> AsyncIterator[tuple[GrpcServer, ListingEnvService]]:
    servicer = ListingEnvService()
    binding = ServiceBinding.servicer(
        "orchard.env.v1.EnvService", env_service_pb2_grpc.add_EnvServiceServicer_to_server, servicer
    )
    config = ServerConfig(
        tls_cert_file=str(tls_files["server.crt"]), tls_key_file=str(tls_files["server.key"])
    )
    async with GrpcServer("env", [binding], config) as server:
        await server.set_serving()
        yield server, servicer


async def test_client_with_the_ca_reaches_the_tls_server(
    tls_server: tuple[GrpcServer, ListingEnvService],
    tls_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, servicer = tls_server
    ca = tls_files["ca.crt"]
    async with AsyncSandboxClient(
        f"https://localhost:{server.port}", token=TOKEN, tls_ca_file=ca
    ) as client:
        assert client.settings.tls
        assert await client.list_page() == ([], "")
    # A CA from the environment turns TLS on for a plain host:port.
    monkeypatch.setenv("ORCHARD_TLS_CA", str(ca))
    async with AsyncSandboxClient(server.addresses[0], token=TOKEN) as client:
        assert await client.list_page() == ([], "")
    assert servicer.authorizations == [f"Bearer {TOKEN}"] * 2


async def test_client_without_the_ca_cannot_connect(
    tls_server: tuple[GrpcServer, ListingEnvService], tls_files: dict[str, Path]
) -> None:
    server, servicer = tls_server
    once = RetryPolicy(max_attempts=1)
    for client in (
        AsyncSandboxClient(server.addresses[0], token=TOKEN, retry=once),  # plaintext
        AsyncSandboxClient(f"https://{server.addresses[0]}", retry=once),  # system roots
        AsyncSandboxClient(server.addresses[0], tls_ca_file=tls_files["other-ca.crt"], retry=once),
    ):
        async with client:
            with pytest.raises(Unavailable):
                await client.list_page()
    assert servicer.authorizations == []


async def test_sync_client_and_cli_over_tls(
    tls_server: tuple[GrpcServer, ListingEnvService],
    tls_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, servicer = tls_server
    ca = str(tls_files["ca.crt"])

    def blocking() -> int:
        with SandboxClient(server.addresses[0], token=TOKEN, tls_ca_file=ca) as client:
            assert client.list_page() == ([], "")
        return main(["--endpoint", server.addresses[0], "--tls-ca", ca, "sandbox", "ls"])

    assert await asyncio.to_thread(blocking) == 0  # the server runs on this loop
    assert len(servicer.authorizations) == 2


def test_token_is_not_sent_in_plaintext_to_another_machine(isolated_env: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        resolve_connection("10.1.2.3:7100", "secret")
    message = str(caught.value)
    assert "refusing to send the bearer token in plaintext to 10.1.2.3:7100" in message
    assert "secret" not in message
    # Explicitly allowed, over TLS, without a token, or where it stays on this machine: fine.
    assert resolve_connection("10.1.2.3:7100", "secret", allow_insecure=True).token == "secret"
    assert resolve_connection("tls://10.1.2.3:7100", "secret").tls
    assert resolve_connection("10.1.2.3:7100").token is None
    for local in ("127.0.0.1:1", "127.8.0.1:1", "[::1]:1", "localhost:1", "0.0.0.0:1", "unix:/a"):
        assert is_local_endpoint(local)
        assert resolve_connection(local, "secret").token == "secret"
    for remote in ("10.0.0.1:1", "[2001:db8::1]:1", "env.example:443", "dns:///127.0.0.1:1"):
        assert not is_local_endpoint(remote)


def test_cli_refuses_plaintext_token_and_names_insecure(
    isolated_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--endpoint", "10.1.2.3:7100", "--token", "t", "sandbox", "ls"]) == 1
    err = capsys.readouterr().err
    assert "refusing to send the bearer token in plaintext to 10.1.2.3:7100" in err
    assert "--insecure" in err


def test_tls_settings_that_cannot_work(isolated_env: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="Unix sockets are plaintext"):
        resolve_connection("unix:/run/env.sock", tls=True)
    with pytest.raises(ConfigurationError, match="scheme says TLS, but tls=False"):
        resolve_connection("https://10.1.2.3:443", tls=False)
    with pytest.raises(ConfigurationError, match=r"\$ORCHARD_TLS_CA: cannot read the CA file"):
        resolve_connection("10.1.2.3:443", environ={"ORCHARD_TLS_CA": str(tmp_path / "no.pem")})
    # A CA in the environment does not touch Unix endpoints (the local profile's kind).
    unix = resolve_connection("unix:/run/env.sock", environ={"ORCHARD_TLS_CA": "/unused.pem"})
    assert not unix.tls
