"""Where the client connects and with which token: arguments, then environment, then profile.

Resolution order for the endpoint:

1. the ``endpoint=`` argument,
2. ``$ORCHARD_ENDPOINT``,
3. the local profile that ``orchard up`` writes (``$ORCHARD_PROFILE``, else
   ``<state dir>/profile.json``; the state dir is ``$ORCHARD_STATE_DIR``, else
   ``$XDG_STATE_HOME/orchard``, else ``~/.local/state/orchard``).

The token comes from ``token=``, else ``$ORCHARD_TOKEN``, else the profile, but the profile's
token is used only with the profile's own endpoint: a local token is never sent elsewhere.

Endpoints are gRPC targets: ``host:port``, ``[v6]:port`` or ``unix:/path``; an ``http://``
or ``grpc://`` prefix is accepted and dropped.

TLS: an ``https://`` or ``tls://`` prefix, ``tls=True``, or a CA file (``tls_ca_file=``, else
``$ORCHARD_TLS_CA``) makes the client connect with TLS; the server's certificate is checked
against that CA, or the system's roots when none is given. Unix sockets are always plaintext.

A bearer token is sent only over TLS or to a loopback or Unix endpoint, where nobody else can
read it on the way; to send one in plaintext to another address, pass ``allow_insecure=True``
(``orchard --insecure``), and only on a network you trust.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchard.sdk.errors import ConfigurationError

__all__ = [
    "ENDPOINT_ENV",
    "PROFILE_ENV",
    "STATE_DIR_ENV",
    "TLS_CA_ENV",
    "TOKEN_ENV",
    "ConnectionSettings",
    "Profile",
    "default_profile_path",
    "is_local_endpoint",
    "normalize_endpoint",
    "read_profile",
    "resolve_connection",
    "state_dir",
    "write_profile",
]

ENDPOINT_ENV = "ORCHARD_ENDPOINT"
TOKEN_ENV = "ORCHARD_TOKEN"
PROFILE_ENV = "ORCHARD_PROFILE"
STATE_DIR_ENV = "ORCHARD_STATE_DIR"
TLS_CA_ENV = "ORCHARD_TLS_CA"

_PLAIN_SCHEMES = ("http://", "grpc://")
_TLS_SCHEMES = ("https://", "tls://")


@dataclass(frozen=True)
class Profile:
    """What ``orchard up`` leaves for the SDK and the command line: where and how to connect."""

    endpoint: str
    token: str = ""
    tenant: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "token": self.token, "tenant": self.tenant}


@dataclass(frozen=True)
class ConnectionSettings:
    """A resolved endpoint and token, and where each came from (for error messages)."""

    endpoint: str
    token: str | None
    source: str
    """``"argument"``, ``"$ORCHARD_ENDPOINT"`` or ``"profile <path>"``."""
    from_local_profile: bool = False
    """True when the endpoint came from the profile ``orchard up`` writes."""
    tls: bool = False
    """Connect with TLS (an ``https://``/``tls://`` endpoint, ``tls=True`` or a CA file)."""
    tls_ca_file: str | None = None
    """PEM file of the CA that signed the server's certificate; None: the system's roots."""
    tls_ca: bytes | None = field(default=None, repr=False)
    """The contents of ``tls_ca_file``, read once when the connection is resolved."""


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The directory for Orchard's local state: profile, etcd data, logs."""
    env = os.environ if environ is None else environ
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "orchard"


def default_profile_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$ORCHARD_PROFILE``, else ``<state dir>/profile.json``."""
    env = os.environ if environ is None else environ
    if env.get(PROFILE_ENV):
        return Path(env[PROFILE_ENV])
    return state_dir(env) / "profile.json"


def normalize_endpoint(endpoint: str) -> str:
    """The gRPC target for an endpoint, without its scheme; ValueError when empty or malformed."""
    return _parse_endpoint(endpoint)[0]


def _parse_endpoint(endpoint: str) -> tuple[str, bool | None]:
    """``(target, tls)``: tls is True for ``https://``/``tls://``, False for ``http://``/
    ``grpc://``, None without a scheme."""
    text = endpoint.strip()
    tls: bool | None = None
    for schemes, secure in ((_PLAIN_SCHEMES, False), (_TLS_SCHEMES, True)):
        for scheme in schemes:
            if text.lower().startswith(scheme):
                text, tls = text[len(scheme) :], secure
    text = text.rstrip("/")
    if not text:
        raise ValueError("the endpoint is empty")
    if not text.startswith("unix:") and ":" not in text:
        raise ValueError(f"endpoint {endpoint!r} has no port; use host:port or unix:/path")
    if tls and text.startswith("unix"):
        raise ValueError(f"endpoint {endpoint!r}: Unix sockets are plaintext, not TLS")
    return text, tls


def is_local_endpoint(target: str) -> bool:
    """True for a Unix socket or a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``,
    also ``0.0.0.0``/``::``): endpoints where traffic does not leave this machine. Names are not
    resolved."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rpartition(":")[0] or target
    host = host.removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # Dialing 0.0.0.0 or :: reaches this machine (what `orchard up --listen 0.0.0.0:N` leaves).
    return address.is_loopback or address.is_unspecified


def read_profile(path: Path) -> Profile | None:
    """The profile at ``path``, or None when there is none; ConfigurationError when unreadable."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the Orchard profile {path}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("endpoint"), str):
        raise ConfigurationError(f"the Orchard profile {path} has no endpoint")
    return Profile(
        endpoint=raw["endpoint"], token=str(raw.get("token", "")), tenant=str(raw.get("tenant", ""))
    )


def write_profile(profile: Profile, path: Path | None = None) -> Path:
    """Write the profile atomically with mode 0600 (it holds a token); return its path."""
    path = path or default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(profile.to_json(), out, indent=2)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def resolve_connection(
    endpoint: str | None = None,
    token: str | None = None,
    *,
    tls: bool | None = None,
    tls_ca_file: str | os.PathLike[str] | None = None,
    allow_insecure: bool = False,
    profile_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConnectionSettings:
    """Resolve endpoint, token and TLS (see the module docstring).

    ``tls`` None: TLS for an ``https://``/``tls://`` endpoint, plaintext for ``http://``/
    ``grpc://``, else TLS when a CA file is given for a TCP endpoint. ConfigurationError when
    nothing is configured, the settings contradict each other, the CA file cannot be read, or a
    token would go in plaintext to a non-loopback address without ``allow_insecure``.
    """
    env = os.environ if environ is None else environ
    settings, scheme_tls = _resolve_endpoint(endpoint, token, env, profile_path)
    ca_origin = "tls_ca_file" if tls_ca_file is not None else f"${TLS_CA_ENV}"
    ca_file = os.fspath(tls_ca_file) if tls_ca_file is not None else env.get(TLS_CA_ENV) or None
    unix = settings.endpoint.startswith("unix")
    if tls is not None and scheme_tls is not None and tls != scheme_tls:
        raise ConfigurationError(
            f"{settings.source}: the endpoint's scheme says "
            f"{'TLS' if scheme_tls else 'plaintext'}, but tls={tls}"
        )
    if tls is None:
        tls = scheme_tls if scheme_tls is not None else bool(ca_file) and not unix
    if tls and unix:
        raise ConfigurationError(
            f"{settings.endpoint}: Unix sockets are plaintext; TLS is for TCP endpoints"
        )
    ca = _read_ca(ca_file, ca_origin) if tls and ca_file else None
    settings = replace(settings, tls=tls, tls_ca_file=ca_file if tls else None, tls_ca=ca)
    exposed = settings.token and not tls and not is_local_endpoint(settings.endpoint)
    if exposed and not allow_insecure:
        raise ConfigurationError(
            f"refusing to send the bearer token in plaintext to {settings.endpoint} "
            f"(from {settings.source}): connect with TLS (an https:// endpoint, tls=True or a "
            f"CA file in ${TLS_CA_ENV}), or allow plaintext with allow_insecure=True "
            "(orchard --insecure) on a network you trust"
        )
    return settings


def _read_ca(path: str, origin: str) -> bytes:
    try:
        with open(path, "rb") as pem:
            return pem.read()
    except OSError as exc:
        raise ConfigurationError(
            f"{origin}: cannot read the CA file {path}: {exc.strerror or exc}"
        ) from None


def _resolve_endpoint(
    endpoint: str | None,
    token: str | None,
    env: Mapping[str, str],
    profile_path: str | os.PathLike[str] | None,
) -> tuple[ConnectionSettings, bool | None]:
    """The endpoint and token, and what the endpoint's scheme says of TLS (None: nothing)."""
    token = token if token is not None else (env.get(TOKEN_ENV) or None)
    path = Path(profile_path) if profile_path is not None else default_profile_path(env)
    if endpoint:
        target, tls = _normalized(endpoint, "the endpoint argument")
        return ConnectionSettings(target, token, "argument"), tls
    if env.get(ENDPOINT_ENV):
        target, tls = _normalized(env[ENDPOINT_ENV], f"${ENDPOINT_ENV}")
        if token is None:
            profile = read_profile(path)
            if profile is not None and normalize_endpoint(profile.endpoint) == target:
                token = profile.token or None
        return ConnectionSettings(target, token, f"${ENDPOINT_ENV}"), tls
    profile = read_profile(path)
    if profile is None:
        raise ConfigurationError(
            "no environment service configured: run `orchard up`, or set "
            f"${ENDPOINT_ENV} (and ${TOKEN_ENV}), or pass endpoint="
        )
    target, tls = _normalized(profile.endpoint, f"profile {path}")
    settings = ConnectionSettings(
        target,
        token if token is not None else (profile.token or None),
        f"profile {path}",
        from_local_profile=True,
    )
    return settings, tls


def _normalized(endpoint: str, origin: str) -> tuple[str, bool | None]:
    try:
        return _parse_endpoint(endpoint)
    except ValueError as exc:
        raise ConfigurationError(f"{origin}: {exc}") from None
