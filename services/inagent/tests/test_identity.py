"""AgentService.ProveIdentity: the agent proves it holds its sandbox's key over the caller's
nonce, keeps the key from commands, and answers FAILED_PRECONDITION without one."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

KEY = secrets.token_hex(32)


def _stub(address: str) -> tuple[grpc.Channel, pb_grpc.AgentServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.AgentServiceStub(channel)


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value
    return error.code(), error.details() or ""


def test_the_proof_is_the_hmac_of_the_nonce_and_the_sandbox_id(launch: Any) -> None:
    agent = launch(env={"ORCHARD_AGENT_KEY": KEY})
    channel, stub = _stub(agent.address)
    with channel:
        nonce = os.urandom(32)
        reply = stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, sandbox_id="sb-1"))
        expected = hmac.new(KEY.encode(), nonce + b"sb-1", hashlib.sha256).digest()
        assert hmac.compare_digest(reply.proof, expected)
        assert reply.version
        # Another nonce or another sandbox id: another proof.
        other = stub.ProveIdentity(pb.ProveIdentityRequest(nonce=os.urandom(32), sandbox_id="sb-1"))
        assert other.proof != reply.proof
        renamed = stub.ProveIdentity(pb.ProveIdentityRequest(nonce=nonce, sandbox_id="sb-2"))
        assert renamed.proof != reply.proof
        for bad, sandbox_id in ((b"short", "sb-1"), (os.urandom(65), "sb-1"), (nonce, "")):
            code, _ = _code(
                lambda n=bad, s=sandbox_id: stub.ProveIdentity(
                    pb.ProveIdentityRequest(nonce=n, sandbox_id=s)
                )
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_agent_without_a_key_answers_failed_precondition(launch: Any) -> None:
    agent = launch()
    channel, stub = _stub(agent.address)
    with channel:
        code, details = _code(
            lambda: stub.ProveIdentity(
                pb.ProveIdentityRequest(nonce=os.urandom(32), sandbox_id="sb-1")
            )
        )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "ORCHARD_AGENT_KEY" in details


def test_commands_never_see_the_key(launch: Any) -> None:
    agent = launch(env={"ORCHARD_AGENT_KEY": KEY})
    channel, stub = _stub(agent.address)
    with channel:
        reply = stub.Exec(
            pb.ExecRequest(command=exec_pb2.Command(shell="env; cat /proc/self/environ"))
        )
    assert reply.result.status.exit_code == 0, reply
    assert KEY.encode() not in reply.result.stdout
    assert b"ORCHARD_AGENT_KEY" not in reply.result.stdout


def test_the_agent_holding_a_key_is_not_dumpable(launch: Any) -> None:
    """Though not PID 1: its /proc/PID/environ (which still holds the key it started with) is
    out of reach of a process of the same uid and capabilities without CAP_SYS_PTRACE (nor
    CAP_SYS_ADMIN or CAP_PERFMON, which also pass the kernel's check; a container has none of
    the three). Both agents and the reader run with the same capabilities, as in a sandbox."""
    setpriv = shutil.which("setpriv")
    assert setpriv, "needs setpriv (util-linux)"
    assert os.geteuid() == 0, "needs root (to drop a few capabilities and keep the uid)"
    without_ptrace = [
        setpriv,
        "--bounding-set",
        "-sys_ptrace,-sys_admin,-perfmon",
        "--inh-caps",
        "-all",
        "--",
    ]
    keyless = launch(prefix=without_ptrace)
    readable = subprocess.run(
        [*without_ptrace, "cat", f"/proc/{keyless.pid}/environ"], capture_output=True, check=False
    )
    assert readable.returncode == 0, readable  # the check itself can read a dumpable process
    holder = launch(prefix=without_ptrace, env={"ORCHARD_AGENT_KEY": KEY})
    refused = subprocess.run(
        [*without_ptrace, "cat", f"/proc/{holder.pid}/environ"], capture_output=True, check=False
    )
    assert refused.returncode != 0, refused
    assert b"Permission denied" in refused.stderr
    assert KEY.encode() not in refused.stdout
