"""Tenants: the bearer token of a call names the tenant it acts as."""

from __future__ import annotations

import hashlib
import hmac

import grpc

from orchard.core.errors import OrchardError
from orchard.env.config import AuthConfig
from orchard.env.reasons import EnvReason

__all__ = ["TenantAuthenticator"]


class TenantAuthenticator:
    """Maps ``authorization: Bearer <token>`` metadata to a tenant name.

    Tokens are compared by their SHA-256 digest, so configuration may hold digests only.
    """

    def __init__(self, config: AuthConfig) -> None:
        self._by_digest: dict[bytes, str] = {}
        for name, tenant in config.tenants.items():
            for token in tenant.tokens:
                if token.startswith("sha256:") and len(token) == 71:
                    digest = bytes.fromhex(token[7:])
                else:
                    digest = hashlib.sha256(token.encode()).digest()
                self._by_digest[digest] = name
        self._anonymous = config.anonymous_tenant

    def tenant_of_token(self, token: str | None) -> str:
        if not token:
            if self._anonymous is not None:
                return self._anonymous
            raise OrchardError(
                EnvReason.UNAUTHENTICATED,
                "missing bearer token: send metadata `authorization: Bearer <token>`",
            )
        digest = hashlib.sha256(token.encode()).digest()
        for known, name in self._by_digest.items():
            # Constant-time per entry, so timing tells nothing about how much matched.
            if hmac.compare_digest(known, digest):
                return name
        raise OrchardError(EnvReason.UNAUTHENTICATED, "unknown bearer token")

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The tenant of a call, or UNAUTHENTICATED."""
        token: str | None = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, credential = text.partition(" ")
                if scheme.lower() != "bearer" or not credential.strip():
                    raise OrchardError(
                        EnvReason.UNAUTHENTICATED,
                        "the authorization metadata must be `Bearer <token>`",
                    )
                token = credential.strip()
                break
        return self.tenant_of_token(token)
