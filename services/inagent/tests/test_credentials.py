"""Route credentials: a real agent serves a call that carries a valid credential for its sandbox
and refuses one for another sandbox, an expired, forged or malformed one; with
``require_credential`` it refuses calls without one (except health and ProveIdentity)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.core.errors import OrchardError, error_info
from orchard.inagent.credentials import (
    ROUTE_KEY_LABEL,
    CredentialCheck,
    issue_credential,
    route_key,
)
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

KEY = secrets.token_hex(32)
SANDBOX = "sb-route-1"


def _credential(
    sandbox_id: str = SANDBOX, key: str = KEY, expire: float | None = None, tenant: str = "t"
) -> str:
    expire = time.time() + 60 if expire is None else expire
    return issue_credential(key.encode(), sandbox_id, tenant, int(expire), os.urandom(16))


def _bearer(credential: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {credential}"),)


def _refused(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value
    info = error_info(error)
    return error.code(), error.details() or "", info.reason if info else ""


TRUE = exec_pb2.Command(argv=["true"])


def test_the_agent_checks_credentials(launch: Any) -> None:
    agent = launch(env={"ORCHARD_AGENT_KEY": KEY, "ORCHARD_AGENT_SANDBOX_ID": SANDBOX})
    with grpc.insecure_channel(agent.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        good = _credential()
        reply = stub.Exec(pb.ExecRequest(command=TRUE), metadata=_bearer(good))
        assert reply.result.status.exit_code == 0
        # Again, from the cache; and a stream.
        reply = stub.Exec(pb.ExecRequest(command=TRUE), metadata=_bearer(good))
        assert reply.result.status.exit_code == 0
        events = list(stub.ExecStream(pb.ExecStreamRequest(command=TRUE), metadata=_bearer(good)))
        assert events[-1].event.exit.exit_code == 0

        # Signed with this sandbox's key but naming another sandbox: refused by name.
        code, details, reason = _refused(
            lambda: stub.Exec(
                pb.ExecRequest(command=TRUE), metadata=_bearer(_credential("sb-other"))
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert reason == "CREDENTIAL_WRONG_SANDBOX" and "sb-other" in details

        # Another sandbox's key (the credential of another sandbox): bad signature.
        other_key = secrets.token_hex(32)
        code, details, reason = _refused(
            lambda: stub.Exec(
                pb.ExecRequest(command=TRUE),
                metadata=_bearer(_credential(SANDBOX, key=other_key)),
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED and "signature" in details

        # Expired.
        code, details, reason = _refused(
            lambda: stub.Exec(
                pb.ExecRequest(command=TRUE),
                metadata=_bearer(_credential(expire=time.time() - 5)),
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in details
        assert reason == "CREDENTIAL_INVALID"

        # Tampered: another tenant, or a later expiry, under the same MAC.
        parts = good.split(".")
        for index, value in ((2, "YmV0YQ"), (3, str(int(parts[3]) + 3600))):
            forged = ".".join([*parts[:index], value, *parts[index + 1 :]])
            code, details, _ = _refused(
                lambda f=forged: stub.Exec(pb.ExecRequest(command=TRUE), metadata=_bearer(f))
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED and "signature" in details

        # Malformed, and the wrong scheme; a file call is checked the same way.
        for metadata in (_bearer("v1.x.y"), (("authorization", f"Basic {good}"),)):
            code, details, _ = _refused(
                lambda m=metadata: stub.Exec(pb.ExecRequest(command=TRUE), metadata=m)
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
        code, _, _ = _refused(
            lambda: list(
                stub.ReadFile(pb.ReadFileRequest(path="/etc/hostname"), metadata=_bearer("v1"))
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED

        # Without a credential the agent serves as before (its transport restricts callers).
        reply = stub.Exec(pb.ExecRequest(command=TRUE))
        assert reply.result.status.exit_code == 0


def test_an_agent_that_requires_credentials_refuses_calls_without(launch: Any) -> None:
    agent = launch(
        "--set",
        "require_credential=true",
        env={"ORCHARD_AGENT_KEY": KEY, "ORCHARD_AGENT_SANDBOX_ID": SANDBOX},
    )
    with grpc.insecure_channel(agent.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        code, details, reason = _refused(lambda: stub.Exec(pb.ExecRequest(command=TRUE)))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "OpenAgentRoute" in details
        assert reason == "CREDENTIAL_INVALID"
        code, _, _ = _refused(lambda: stub.GetAgentInfo(pb.GetAgentInfoRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Health and the identity check stay open.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub.ProveIdentity(pb.ProveIdentityRequest(nonce=os.urandom(16), sandbox_id=SANDBOX))
        reply = stub.Exec(pb.ExecRequest(command=TRUE), metadata=_bearer(_credential()))
        assert reply.result.status.exit_code == 0


def test_an_agent_without_a_key_refuses_credentials(launch: Any) -> None:
    agent = launch()
    with grpc.insecure_channel(agent.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        code, _, reason = _refused(
            lambda: stub.Exec(pb.ExecRequest(command=TRUE), metadata=_bearer(_credential()))
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and reason == "AGENT_KEY_MISSING"


def test_the_key_and_sandbox_id_never_reach_commands(launch: Any) -> None:
    agent = launch(env={"ORCHARD_AGENT_KEY": KEY, "ORCHARD_AGENT_SANDBOX_ID": SANDBOX})
    with grpc.insecure_channel(agent.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        reply = stub.Exec(pb.ExecRequest(command=exec_pb2.Command(argv=["env"])))
        assert KEY.encode() not in reply.result.stdout
        assert b"ORCHARD_AGENT" not in reply.result.stdout


def test_proofs_never_give_the_route_key() -> None:
    """ProveIdentity answers HMAC(key, nonce || sandbox id) for any caller's nonce and id: the
    route key's message ends in 0xff, which no UTF-8 sandbox id does."""
    assert ROUTE_KEY_LABEL.endswith(b"\xff")
    for split in range(16, len(ROUTE_KEY_LABEL)):
        with pytest.raises(UnicodeDecodeError):
            ROUTE_KEY_LABEL[split:].decode()
    key = KEY.encode()
    assert route_key(key) == hmac.new(key, ROUTE_KEY_LABEL, hashlib.sha256).digest()


def test_verified_credentials_are_cached_until_they_expire() -> None:
    now = [1000.0]
    check = CredentialCheck(KEY.encode(), SANDBOX, clock=lambda: now[0])
    credential = issue_credential(KEY.encode(), SANDBOX, "t", 1010, b"n" * 16)
    check.check(credential)
    now[0] = 1009.5
    check.check(credential)  # from the cache
    now[0] = 1010.0
    with pytest.raises(OrchardError, match="expired"):
        check.check(credential)
    with pytest.raises(OrchardError, match="expired"):
        check.check(credential)  # gone from the cache: verified again, still expired


def test_orchard_env_credentials_are_told_apart_and_cannot_be_forged_from_a_client_one() -> None:
    """orchard-env's credentials start with ``v1-env``; the MAC covers the scope, so a client's
    credential relabelled as orchard-env's fails the signature."""
    from orchard.env.agent_routes import service_credential  # the service's copy of the format

    check = CredentialCheck(KEY.encode(), SANDBOX)
    expire = int(time.time()) + 60
    service = service_credential(KEY.encode(), SANDBOX, expire)
    assert service.startswith("v1-env.")
    assert check.check(service) is True
    assert check.check(service) is True  # from the cache
    assert check.check(
        issue_credential(KEY.encode(), SANDBOX, "t", expire, b"s" * 16, service=True)
    )
    client = _credential()
    assert check.check(client) is False
    relabelled = "v1-env." + client.split(".", 1)[1]
    with pytest.raises(OrchardError, match="signature"):
        check.check(relabelled)
