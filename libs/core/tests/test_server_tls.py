"""GrpcServer with TLS: who gets through, and configuration errors that name the key.

Certificates come from the ``tls_files`` fixture (made at test time by the openssl command).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.core.config import ConfigError, ServerConfig, ServiceConfig, load_config
from orchard.core.config_sources import PlainServerConfig
from orchard.core.server import GrpcServer

SERVING = health_pb2.HealthCheckResponse.SERVING


async def health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(response.status)


def tls_config(files: dict[str, Path], *, mutual: bool = False, **extra: object) -> ServerConfig:
    return ServerConfig.model_validate(
        {
            "tls_cert_file": str(files["server.crt"]),
            "tls_key_file": str(files["server.key"]),
            "tls_client_ca_file": str(files["ca.crt"]) if mutual else None,
            **extra,
        }
    )


def credentials(
    files: dict[str, Path], ca: str | None = "ca.crt", client: bool = False
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=files[ca].read_bytes() if ca else None,
        private_key=files["client.key"].read_bytes() if client else None,
        certificate_chain=files["client.crt"].read_bytes() if client else None,
    )


async def test_tls_client_with_the_ca_gets_through(tls_files: dict[str, Path]) -> None:
    async with GrpcServer("test", [], tls_config(tls_files)) as server:
        assert server.tls == "tls"
        await server.set_serving()
        for target in (server.addresses[0], f"localhost:{server.port}"):
            async with grpc.aio.secure_channel(target, credentials(tls_files)) as channel:
                assert await health(channel) == SERVING


@pytest.mark.parametrize("client", ["plaintext", "other CA", "system roots"])
async def test_clients_that_cannot_check_the_server_fail(
    tls_files: dict[str, Path], client: str
) -> None:
    async with GrpcServer("test", [], tls_config(tls_files)) as server:
        await server.set_serving()
        target = server.addresses[0]
        if client == "plaintext":
            channel = grpc.aio.insecure_channel(target)
        else:
            ca = "other-ca.crt" if client == "other CA" else None
            channel = grpc.aio.secure_channel(target, credentials(tls_files, ca))
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_certificates_required_with_client_ca(tls_files: dict[str, Path]) -> None:
    async with GrpcServer("test", [], tls_config(tls_files, mutual=True)) as server:
        assert server.tls == "mutual"
        await server.set_serving()
        target = server.addresses[0]
        async with grpc.aio.secure_channel(target, credentials(tls_files)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health(channel)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = credentials(tls_files, client=True)
        async with grpc.aio.secure_channel(target, with_cert) as channel:
            assert await health(channel) == SERVING


async def test_unix_socket_stays_plaintext(tls_files: dict[str, Path], tmp_path: Path) -> None:
    listen = ["127.0.0.1:0", f"unix:{tmp_path / 'server.sock'}"]
    async with GrpcServer("test", [], tls_config(tls_files, listen=listen)) as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[1]) as channel:
            assert await health(channel) == SERVING


async def test_plain_settings_are_checked_at_start(tls_files: dict[str, Path]) -> None:
    unpaired = PlainServerConfig(tls_cert_file=str(tls_files["server.crt"]))
    with pytest.raises(ValueError, match="tls_key_file is required when tls_cert_file is set"):
        await GrpcServer("test", [], unpaired).start()
    missing = PlainServerConfig(tls_cert_file="/nonexistent.crt", tls_key_file="/nonexistent.key")
    with pytest.raises(ValueError, match=r"server\.tls_cert_file: cannot read /nonexistent"):
        await GrpcServer("test", [], missing).start()


def load(env: dict[str, str]) -> ServiceConfig:
    return load_config(ServiceConfig, env=env)


def test_config_errors_name_the_key(tls_files: dict[str, Path], tmp_path: Path) -> None:
    cert, key = str(tls_files["server.crt"]), str(tls_files["server.key"])
    with pytest.raises(ConfigError) as caught:
        load({"ORCHARD_SERVER__TLS_CERT_FILE": cert})
    assert "server: tls_key_file is required when tls_cert_file is set" in str(caught.value)

    with pytest.raises(ConfigError) as caught:
        load({"ORCHARD_SERVER__TLS_CERT_FILE": cert, "ORCHARD_SERVER__TLS_KEY_FILE": "/nope.key"})
    assert "server.tls_key_file: cannot read /nope.key: No such file or directory" in str(
        caught.value
    )
    assert "(from ORCHARD_SERVER__TLS_KEY_FILE)" in str(caught.value)

    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match=r"server\.tls_client_ca_file: .* is not a PEM file"):
        load(
            {
                "ORCHARD_SERVER__TLS_CERT_FILE": cert,
                "ORCHARD_SERVER__TLS_KEY_FILE": key,
                "ORCHARD_SERVER__TLS_CLIENT_CA_FILE": str(not_pem),
            }
        )

    with pytest.raises(ConfigError, match="tls_client_ca_file needs tls_cert_file"):
        load({"ORCHARD_SERVER__TLS_CLIENT_CA_FILE": str(tls_files["ca.crt"])})

    config = load({"ORCHARD_SERVER__TLS_CERT_FILE": cert, "ORCHARD_SERVER__TLS_KEY_FILE": key})
    assert (config.server.tls_cert_file, config.server.tls_key_file) == (cert, key)
    assert load({"ORCHARD_SERVER__TLS_CERT_FILE": ""}).server.tls_cert_file is None
