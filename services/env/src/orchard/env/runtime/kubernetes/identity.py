"""The kubernetes runtime's proof that what answers at a sandbox's address is the agent it
started.

The service reaches an agent at its Pod IP, which a process in the Pod (or a later Pod given the
same IP) could answer for. So every sandbox gets a random key at create: the runtime keeps it in
a Secret of the sandbox's (``pods.key_secret_manifest``; owned by the Pod, so it goes with it),
and the agent gets it as ``ORCHARD_AGENT_KEY`` from that Secret, which it takes out of its
environment and keeps from commands. Before the service first talks to an agent (per replica,
also after a restart), the runtime reads the key from the Secret and asks the agent for
HMAC-SHA256(key, nonce || sandbox id) over a fresh nonce (``AgentService.ProveIdentity``).
Nothing of the key is in the service's records.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

import grpc

from orchard.env.runtime.base import AgentUnreachable
from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc

__all__ = ["expected_proof", "new_key", "prove"]

log = logging.getLogger(__name__)

NONCE_BYTES = 32
# Codes that say nothing about who answers: the agent (or the network) is down or slow.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def new_key() -> str:
    """A fresh sandbox key: 256 random bits as hex (the agent uses the text's bytes)."""
    return secrets.token_hex(32)


def expected_proof(key: str, nonce: bytes, sandbox_id: str) -> bytes:
    """What the agent holding ``key`` answers to ``nonce`` (see the proto's ProveIdentity)."""
    return hmac.new(key.encode(), nonce + sandbox_id.encode(), hashlib.sha256).digest()


async def prove(address: str, key: str, sandbox_id: str, timeout_s: float) -> str | None:
    """Ask what serves at ``address`` to prove it holds ``key``: the agent's version when it
    does, None when it does not (a wrong proof, no key, no such call). Raises
    :class:`AgentUnreachable` when nothing answers in time."""
    nonce = os.urandom(NONCE_BYTES)
    request = inagent_service_pb2.ProveIdentityRequest(nonce=nonce, sandbox_id=sandbox_id)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inagent_service_pb2_grpc.AgentServiceStub(channel)
        try:
            reply = await stub.ProveIdentity(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _UNREACHABLE:
                raise AgentUnreachable(
                    f"the agent of sandbox {sandbox_id!r} at {address} did not answer the "
                    f"identity check ({exc.code().name}: {exc.details()})"
                ) from None
            log.warning(
                "sandbox %s: what serves at %s refused the identity check: %s %s",
                sandbox_id,
                address,
                exc.code().name,
                exc.details(),
            )
            return None
    if not hmac.compare_digest(reply.proof, expected_proof(key, nonce, sandbox_id)):
        log.warning("sandbox %s: what serves at %s gave a wrong proof", sandbox_id, address)
        return None
    return str(reply.version)
