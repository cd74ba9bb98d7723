"""Route credentials: what ``EnvService.OpenAgentRoute`` gives a client so that it can call a
sandbox's agent directly, skipping this service on the exec and file path.

A credential names one sandbox and the tenant that asked, carries an expiry and a random nonce,
and is signed with a key derived from the sandbox's agent key (the runtime's
``Runtime.agent_key``): the agent, which holds that key, checks it without calling the service.
The format and the key derivation are ``orchard.inagent.credentials``'s (the agent ships on its
own, so each side keeps its copy; the tests run one against the other)::

    v1.<b64url sandbox id>.<b64url tenant>.<expiry, Unix s>.<b64url nonce>.<b64url mac>
    mac = HMAC-SHA256(HMAC-SHA256(agent key, "orchard agent route credential" 0xff),
                      everything before the last dot)

orchard-env's own calls to an agent carry a credential too (:func:`service_credential`), whose
first field is ``v1-env`` instead of ``v1``: the MAC covers it, so a client's credential cannot
pass for the service's. Agents on Kubernetes refuse calls without a credential.

Tenancy holds on both routes: the service issues a credential only for a READY sandbox of the
calling tenant (the same lookup as Exec), and a credential opens no other sandbox, since every
sandbox has its own key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from dataclasses import dataclass

__all__ = ["AgentRoute", "issue_credential", "route_key", "service_credential"]

VERSION = "v1"
SERVICE_SCOPE = "v1-env"
SERVICE_TENANT = "orchard-env"
ROUTE_KEY_LABEL = b"orchard agent route credential\xff"
NONCE_BYTES = 16


@dataclass(frozen=True)
class AgentRoute:
    """Where a client reaches a sandbox's agent, and with what, until when."""

    address: str
    credential: str
    expire_unix_s: int


def route_key(agent_key: bytes) -> bytes:
    """The key that signs route credentials, derived from the sandbox's agent key."""
    return hmac.new(agent_key, ROUTE_KEY_LABEL, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def issue_credential(
    agent_key: bytes,
    sandbox_id: str,
    tenant: str,
    expire_unix_s: int,
    nonce: bytes | None = None,
    *,
    service: bool = False,
) -> str:
    """A credential for ``sandbox_id`` and ``tenant``, valid until ``expire_unix_s`` (with
    ``service``: orchard-env's own, for its calls to the agent)."""
    signed = ".".join(
        (
            SERVICE_SCOPE if service else VERSION,
            _b64(sandbox_id.encode()),
            _b64(tenant.encode()),
            str(int(expire_unix_s)),
            _b64(os.urandom(NONCE_BYTES) if nonce is None else nonce),
        )
    )
    mac = hmac.new(route_key(agent_key), signed.encode("ascii"), hashlib.sha256).digest()
    return f"{signed}.{_b64(mac)}"


def open_route(
    agent_key: bytes, sandbox_id: str, tenant: str, address: str, ttl_s: int
) -> AgentRoute:
    """A fresh route to ``address`` for ``tenant``, valid ``ttl_s`` seconds from now."""
    expire = int(time.time()) + ttl_s
    return AgentRoute(address, issue_credential(agent_key, sandbox_id, tenant, expire), expire)


def service_credential(agent_key: bytes, sandbox_id: str, expire_unix_s: int) -> str:
    """orchard-env's own credential for its calls to ``sandbox_id``'s agent."""
    return issue_credential(agent_key, sandbox_id, SERVICE_TENANT, expire_unix_s, service=True)
