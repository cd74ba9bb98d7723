"""How a service reaches orchard-env: the settings orchard-reward and orchard-rollout share.

A service on another machine than orchard-env reaches it over TLS (``tls_ca_file``, the CA that
signed orchard-env's certificate) or, on a network the operator trusts, in plaintext
(``insecure``); the bearer token comes from an environment variable, never from a file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from orchard.core.config import ConfigModel

if TYPE_CHECKING:
    from orchard.sdk.aio import AsyncSandboxClient

__all__ = ["EnvClientConfig"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvClientConfig(ConfigModel):
    """Token, TLS and deadline of a service's client of orchard-env (the endpoint is each
    service's own field)."""

    token_env: str = Field(
        default="ORCHARD_TOKEN",
        description="Environment variable holding the bearer token for orchard-env; unset: none.",
    )
    call_timeout_s: float = Field(default=30.0, gt=0, description="Deadline of one quick call.")
    tls_ca_file: str | None = Field(
        default=None,
        description="PEM CA that signed orchard-env's certificate: the connection uses TLS and "
        "checks it. Needed when orchard-env runs on another machine, unless `insecure`.",
    )
    insecure: bool = Field(
        default=False,
        description="Send the token in plaintext to an orchard-env that is not on loopback: "
        "only on a network you trust.",
    )

    @field_validator("token_env")
    @classmethod
    def _check_token_env(cls, value: str) -> str:
        if value and not _ENV_NAME.match(value):
            raise ValueError(f"expected an environment variable name, got {value!r}")
        return value

    @field_validator("tls_ca_file")
    @classmethod
    def _readable_ca(cls, value: str | None) -> str | None:
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError(f"{value} is not a readable file (orchard-env's CA certificate)")
        return value

    def token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The bearer token from ``token_env``, or None when that variable is unset or empty."""
        environ = os.environ if environ is None else environ
        return environ.get(self.token_env) or None if self.token_env else None

    def client(self, endpoint: str) -> AsyncSandboxClient:
        """A client of orchard-env at ``endpoint`` with these settings (raises
        `orchard.sdk.errors.ConfigurationError` for settings that contradict each other)."""
        from orchard.sdk.aio import AsyncSandboxClient  # noqa: PLC0415

        return AsyncSandboxClient(
            endpoint,
            token=self.token(),
            timeout=self.call_timeout_s,
            tls_ca_file=self.tls_ca_file,
            allow_insecure=self.insecure,
        )
