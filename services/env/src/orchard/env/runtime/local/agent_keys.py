"""The local runtime's per-sandbox agent keys.

Every agent gets a key of its own sandbox at start (``ORCHARD_AGENT_KEY``, as the kubernetes
runtime hands it from a Secret): with it the agent checks route credentials
(``EnvService.OpenAgentRoute``) without asking the service. Keys are not stored one by one:
each is HMAC-SHA256 of the sandbox id under one host secret, a file in the runtime's state
directory (mode 0600, made on first use), so every replica on the host and a restarted
service derive the same key, and nothing of it is in the records. The state directory is
private to the runtime: no sandbox sees it (``private_paths``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = ["AgentKeys"]

SECRET_NAME = "agent-keys.secret"
_SECRET_BYTES = 32
_LABEL = b"orchard local agent key\x00"


class AgentKeys:
    """Derives sandbox keys from the host secret in ``state_dir``."""

    def __init__(self, state_dir: str) -> None:
        self._path = os.path.join(state_dir, SECRET_NAME)
        self._secret: bytes | None = None

    def key_for(self, sandbox_id: str) -> str:
        """The key of ``sandbox_id``: 64 hex digits (the agent uses the text's bytes)."""
        return hmac.new(self._load(), _LABEL + sandbox_id.encode(), hashlib.sha256).hexdigest()

    def _load(self) -> bytes:
        if self._secret is None:
            if not os.path.exists(self._path):
                # Linked into place whole, so a replica racing this one reads one secret or
                # the other's, never half of one.
                temp = f"{self._path}.{os.getpid()}.tmp"
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="ascii") as file:
                    file.write(secrets.token_hex(_SECRET_BYTES))
                try:
                    os.link(temp, self._path)
                except FileExistsError:
                    pass
                finally:
                    os.unlink(temp)
            with open(self._path, encoding="ascii") as file:
                text = file.read().strip()
            if len(text) != 2 * _SECRET_BYTES:
                raise RuntimeError(f"{self._path}: not a {_SECRET_BYTES}-byte hex secret")
            self._secret = bytes.fromhex(text)
        return self._secret
