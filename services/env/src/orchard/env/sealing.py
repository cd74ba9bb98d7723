"""Secrets at rest: ``spec.env`` values are sealed before a record reaches etcd.

A tenant's environment variables (API keys, tokens) are sealed with Fernet (AES-128-CBC and
HMAC-SHA256, from the ``cryptography`` package) under the key of ``secrets.key_file`` when the
record is made, and stay sealed in every copy of the record (etcd, the watch mirror, forks).
They are opened in two places only: the spec handed to the runtime, and the sandbox returned to
its own tenant. Variable names stay readable. Every replica on one prefix must hold the same
key: the first to start records the key's id (an HMAC of a fixed text, not the key) under the
prefix, and a replica with another key refuses to start.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import tempfile
from collections.abc import Mapping

from cryptography.fernet import Fernet, InvalidToken

from orchard.core.etcd import EtcdStore
from orchard.env.config import SecretsConfig
from orchard.env.v1 import env_pb2

__all__ = ["KEY_ID_KEY", "SEALED_PREFIX", "SealedValueUnreadable", "SpecSealer"]

log = logging.getLogger(__name__)

SEALED_PREFIX = "orchard-sealed:v1:"
"""How a sealed value starts in a stored record (a Fernet token follows)."""
KEY_ID_KEY = "secrets/key-id"
"""Under the prefix: the id of the key the prefix's records are sealed with."""


class SealedValueUnreadable(Exception):
    """A sealed value does not open with this replica's key."""


class SpecSealer:
    """Seals and opens ``spec.env`` values with one Fernet key."""

    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)
        self.key_id = hmac.new(key, b"orchard-env secrets key id", hashlib.sha256).hexdigest()[:16]

    @classmethod
    def from_config(cls, config: SecretsConfig) -> SpecSealer:
        """The key of ``config.key_file``, made first (mode 0600) when missing and allowed."""
        path = config.key_file
        if not os.path.exists(path):
            if not config.generate_key:
                raise RuntimeError(
                    f"secrets.key_file {path} does not exist: copy the key every replica on this "
                    "prefix uses there, or set secrets.generate_key to create one"
                )
            if _write_new_key(path):
                log.warning(
                    "generated a new secrets key; replicas on this etcd prefix must share it",
                    extra={"key_file": path},
                )
        with open(path, "rb") as file:
            key = file.read().strip()
        try:
            return cls(key)
        except ValueError:
            raise RuntimeError(
                f"secrets.key_file {path} does not hold a Fernet key (44 url-safe base64 "
                "characters, e.g. from `python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())'`)"
            ) from None

    async def claim(self, store: EtcdStore) -> None:
        """Record this key's id under the prefix, or check it is the one already recorded."""
        await store.create_if_absent(KEY_ID_KEY, self.key_id)
        stored = await store.get(KEY_ID_KEY)
        if stored is not None and stored.value_str != self.key_id:
            raise RuntimeError(
                f"secrets.key_file holds key {self.key_id}, but the records on this etcd prefix "
                f"are sealed with key {stored.value_str}: every replica on one prefix needs the "
                "same key file"
            )

    # -- values ------------------------------------------------------------------------------

    def seal(self, value: str) -> str:
        return SEALED_PREFIX + self._fernet.encrypt(value.encode()).decode("ascii")

    def open(self, value: str) -> str:
        """The clear value; one stored before sealing existed passes through as it is."""
        if not value.startswith(SEALED_PREFIX):
            return value
        try:
            return self._fernet.decrypt(value[len(SEALED_PREFIX) :].encode("ascii")).decode()
        except (InvalidToken, UnicodeError):
            raise SealedValueUnreadable(
                f"a spec.env value was sealed with another key than this replica's ({self.key_id})"
                ": every replica on one prefix needs the same secrets.key_file"
            ) from None

    def seal_env(self, spec: env_pb2.SandboxSpec) -> None:
        """Seal ``spec.env`` in place (a spec about to be stored)."""
        for name, value in list(spec.env.items()):
            spec.env[name] = self.seal(value)

    def open_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {name: self.open(value) for name, value in env.items()}

    def opened(self, sandbox: env_pb2.Sandbox) -> env_pb2.Sandbox:
        """A copy of ``sandbox`` with its env values in clear (for its own tenant); a value
        this key cannot open stays sealed (and is logged), the rest of the sandbox is served."""
        if not sandbox.spec.env:
            return sandbox
        copy = env_pb2.Sandbox()
        copy.CopyFrom(sandbox)
        for name, value in sandbox.spec.env.items():
            try:
                copy.spec.env[name] = self.open(value)
            except SealedValueUnreadable as exc:
                log.error(str(exc), extra={"sandbox_id": sandbox.id, "variable": name})
        return copy


def _write_new_key(path: str) -> bool:
    """Create ``path`` holding a new key, whole or not at all; False when another process
    created it first."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(prefix=".secrets-key-", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as file:  # mkstemp: mode 0600
            file.write(Fernet.generate_key() + b"\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(staging, path)  # fails if it exists: concurrent starts keep one key
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
