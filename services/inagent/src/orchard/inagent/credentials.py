"""Route credentials: calls that reach the agent directly, not through orchard-env.

orchard-env (``EnvService.OpenAgentRoute``) gives a client a short-lived credential for one
sandbox; the client sends it as ``authorization: Bearer <credential>`` on every call to the
agent, and the agent checks it here without calling anyone. The credential is text::

    v1.<sandbox id>.<tenant>.<expiry>.<nonce>.<mac>

with the sandbox id, the tenant, the nonce and the MAC in unpadded base64url and the expiry in
whole Unix seconds. orchard-env's own credentials, which it sends on its calls to the agent,
start with ``v1-env`` instead of ``v1``: the scope is covered by the MAC, so a client cannot
turn its credential into orchard-env's. No AgentService call is orchard-env's alone today
(``ProveIdentity`` is open to any caller and reveals nothing but possession of the key), so
both scopes open the same calls; :meth:`CredentialCheck.check` tells them apart for a call
that ever needs to be. The MAC is HMAC-SHA256 over everything before its own dot, keyed with
:func:`route_key` of the sandbox key (``ORCHARD_AGENT_KEY``, which the runtime hands the agent
at start). The derived key keeps the two uses of the sandbox key apart: ``ProveIdentity``
answers HMAC(key, nonce || sandbox id) for any caller's nonce and id, and no such message ends
in the byte 0xff (an id is UTF-8), so its answers are never a route key.

A call without the header is served as before (the transport is what restricts those to
orchard-env: see the README); with the agent's ``require_credential`` setting it is refused,
except health, reflection and ``ProveIdentity``. A call with a credential that fails the check
is refused: UNAUTHENTICATED when the credential is malformed, forged or expired,
PERMISSION_DENIED when it is valid but for another sandbox. Checked credentials are kept until
they expire, so a client's later calls cost one dictionary lookup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from orchard.core.errors import OrchardError
from orchard.inagent.reasons import AgentReason

__all__ = [
    "CredentialCheck",
    "CredentialInterceptor",
    "authorize",
    "issue_credential",
    "route_key",
]

VERSION = "v1"
SERVICE_SCOPE = "v1-env"
"""First field of orchard-env's own credentials (a client's start with :data:`VERSION`)."""
ROUTE_KEY_LABEL = b"orchard agent route credential\xff"
"""What the sandbox key signs to derive the route key; ends in 0xff (see the module doc)."""
MAX_CREDENTIAL_CHARS = 2048
CACHE_ENTRIES = 4096
"""Checked credentials kept; the cache is emptied when it fills (clients reuse theirs)."""
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/orchard.inagent.v1.AgentService/ProveIdentity",
    }
)
"""Methods served without a credential even when one is required."""
_SCHEME = "bearer "


def route_key(sandbox_key: bytes) -> bytes:
    """The key that signs route credentials, derived from the sandbox key."""
    return hmac.new(sandbox_key, ROUTE_KEY_LABEL, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_credential(
    sandbox_key: bytes,
    sandbox_id: str,
    tenant: str,
    expire_unix_s: int,
    nonce: bytes,
    *,
    service: bool = False,
) -> str:
    """A credential for ``sandbox_id`` and ``tenant`` valid until ``expire_unix_s`` (with
    ``service``: orchard-env's own); what orchard-env issues (its own copy of this format
    lives in ``orchard.env.agent_routes``)."""
    signed = ".".join(
        (
            SERVICE_SCOPE if service else VERSION,
            _b64(sandbox_id.encode()),
            _b64(tenant.encode()),
            str(int(expire_unix_s)),
            _b64(nonce),
        )
    )
    mac = hmac.new(route_key(sandbox_key), signed.encode("ascii"), hashlib.sha256).digest()
    return f"{signed}.{_b64(mac)}"


def _unauthenticated(message: str) -> OrchardError:
    return OrchardError(AgentReason.CREDENTIAL_INVALID, message)


class CredentialCheck:
    """Verifies route credentials against one sandbox key (see the module docstring)."""

    def __init__(
        self,
        sandbox_key: bytes | None,
        sandbox_id: str | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = route_key(sandbox_key) if sandbox_key else None
        self._sandbox_id = sandbox_id or None
        self._clock = clock
        # credential → (expiry in Unix seconds, whether it is orchard-env's)
        self._verified: dict[str, tuple[int, bool]] = {}

    def check(self, credential: str) -> bool:
        """Whether ``credential``, valid here now, is orchard-env's own (False: a client's);
        raise an OrchardError when it is not valid."""
        now = self._clock()
        known = self._verified.get(credential)
        if known is not None:
            if now < known[0]:
                return known[1]
            del self._verified[credential]
            raise _unauthenticated(_expired(known[0], now))
        expiry = self._verify(credential, now)
        if len(self._verified) >= CACHE_ENTRIES:
            self._verified.clear()
        service = credential.startswith(SERVICE_SCOPE + ".")
        self._verified[credential] = (expiry, service)
        return service

    def _verify(self, credential: str, now: float) -> int:
        if self._key is None:
            raise OrchardError(
                AgentReason.AGENT_KEY_MISSING,
                "this agent was started without a sandbox key (ORCHARD_AGENT_KEY): it cannot "
                "check route credentials; call it through orchard-env",
            )
        parts = credential.split(".") if len(credential) <= MAX_CREDENTIAL_CHARS else []
        if len(parts) != 6 or parts[0] not in (VERSION, SERVICE_SCOPE):
            raise _unauthenticated(
                "the route credential is malformed; open a new route (EnvService.OpenAgentRoute)"
            )
        signed, _, mac_text = credential.rpartition(".")
        try:
            mac = _unb64(mac_text)
            sandbox_id = _unb64(parts[1]).decode()
            expiry = int(parts[3])
        except (binascii.Error, ValueError):
            raise _unauthenticated(
                "the route credential is malformed; open a new route (EnvService.OpenAgentRoute)"
            ) from None
        expected = hmac.new(self._key, signed.encode("ascii"), hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise _unauthenticated(
                "the route credential was not issued for this sandbox's agent (wrong signature); "
                "open a route to the sandbox you mean (EnvService.OpenAgentRoute)"
            )
        if self._sandbox_id is not None and sandbox_id != self._sandbox_id:
            raise OrchardError(
                AgentReason.CREDENTIAL_WRONG_SANDBOX,
                f"the route credential is for sandbox {sandbox_id!r}; this agent serves "
                f"sandbox {self._sandbox_id!r}",
                metadata={"sandbox_id": self._sandbox_id},
            )
        if now >= expiry:
            raise _unauthenticated(_expired(expiry, now))
        return expiry


def _expired(expiry: int, now: float) -> str:
    return (
        f"the route credential expired {now - expiry:.0f} s ago; open a new route "
        "(EnvService.OpenAgentRoute)"
    )


def credential_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer credential in a call's metadata; None without an ``authorization`` entry."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            if text[: len(_SCHEME)].lower() != _SCHEME:
                raise _unauthenticated("the authorization metadata must be `Bearer <credential>`")
            return text[len(_SCHEME) :].strip()
    return None


def authorize(
    check: CredentialCheck,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    *,
    required: bool,
) -> None:
    """Raise (an OrchardError) unless a call with ``metadata`` may be served: its credential,
    if it has one, passes ``check``; without one, only when none is ``required``."""
    credential = credential_of(metadata)
    if credential is not None:
        check.check(credential)
    elif required:
        raise _unauthenticated(
            "this agent serves only calls with a route credential: send "
            "`authorization: Bearer <credential>` from EnvService.OpenAgentRoute"
        )


class CredentialInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls whose route credential fails :class:`CredentialCheck`; see the module
    docstring for calls without one. A refused call gets a handler of the same kind that
    raises, which the server's error interceptor turns into the status."""

    def __init__(self, check: CredentialCheck, *, required: bool = False) -> None:
        self._check = check
        self.required = required

    async def intercept_service(
        self, continuation: Any, handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        try:
            authorize(
                self._check,
                handler_call_details.invocation_metadata,
                required=self.required and handler_call_details.method not in OPEN_METHODS,
            )
        except OrchardError as error:
            handler = await continuation(handler_call_details)
            return None if handler is None else _refusing(handler, error)
        return await continuation(handler_call_details)


def _refusing(handler: grpc.RpcMethodHandler, error: OrchardError) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that fails every call with ``error``."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error
        yield  # an async generator, as the stream kinds expect

    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
