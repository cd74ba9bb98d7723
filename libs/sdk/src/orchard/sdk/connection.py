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
or ``grpc://`` prefix is accepted and dropped (transport security is not supported yet).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.sdk.errors import ConfigurationError

__all__ = [
    "ENDPOINT_ENV",
    "PROFILE_ENV",
    "STATE_DIR_ENV",
    "TOKEN_ENV",
    "ConnectionSettings",
    "Profile",
    "default_profile_path",
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
    """The gRPC target for an endpoint; ValueError when it is empty or malformed."""
    text = endpoint.strip()
    for scheme in ("http://", "grpc://"):
        text = text.removeprefix(scheme)
    text = text.rstrip("/")
    if not text:
        raise ValueError("the endpoint is empty")
    if text.startswith("https://"):
        raise ValueError("TLS endpoints are not supported yet; use host:port")
    if not text.startswith("unix:") and ":" not in text:
        raise ValueError(f"endpoint {endpoint!r} has no port; use host:port or unix:/path")
    return text


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
    profile_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConnectionSettings:
    """Resolve endpoint and token (see the module docstring); ConfigurationError when none."""
    env = os.environ if environ is None else environ
    token = token if token is not None else (env.get(TOKEN_ENV) or None)
    path = Path(profile_path) if profile_path is not None else default_profile_path(env)
    if endpoint:
        return ConnectionSettings(_normalized(endpoint, "the endpoint argument"), token, "argument")
    if env.get(ENDPOINT_ENV):
        target = _normalized(env[ENDPOINT_ENV], f"${ENDPOINT_ENV}")
        if token is None:
            profile = read_profile(path)
            if profile is not None and normalize_endpoint(profile.endpoint) == target:
                token = profile.token or None
        return ConnectionSettings(target, token, f"${ENDPOINT_ENV}")
    profile = read_profile(path)
    if profile is None:
        raise ConfigurationError(
            "no environment service configured: run `orchard up`, or set "
            f"${ENDPOINT_ENV} (and ${TOKEN_ENV}), or pass endpoint="
        )
    return ConnectionSettings(
        _normalized(profile.endpoint, f"profile {path}"),
        token if token is not None else (profile.token or None),
        f"profile {path}",
        from_local_profile=True,
    )


def _normalized(endpoint: str, origin: str) -> str:
    try:
        return normalize_endpoint(endpoint)
    except ValueError as exc:
        raise ConfigurationError(f"{origin}: {exc}") from None
