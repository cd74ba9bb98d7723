"""Sandbox records in etcd: the key layout, the stored format, and typed reads and writes.

Keys, under the configured prefix (``orchard/env/`` by default)::

    sandboxes/<tenant>/<sandbox_id>   SandboxRecord (protobuf)  the sandbox's own lease
    requests/<tenant>/<sha256(request_id)[:32]>   sandbox id    the sandbox's lease
    creating/<tenant>/<sandbox_id>    replica id                the creating replica's lease
    replicas/<replica_id>             start time                that replica's lease
    owners/<tenant>/<owner_id>        OwnerRecord (protobuf)    the owner's lease
    owner-requests/<tenant>/<sha256(request_id)[:32]>   owner id   the owner's lease
    slots/<scope>/<index>             sandbox id                the sandbox's lease
    secrets/key-id                    id of the sealing key     none (see ``sealing.py``)
    sync/<replica_id>                 empty                     that replica's lease

A sandbox bound to an owner (``spec.owner_id``) has its record, request key and slots under
the owner's lease instead of one of its own. ``slots/`` keys are admission slots: scope
``all``, ``tenant/<tenant>`` or ``owner/<owner_id>``, index below the configured capacity; a
key exists while its sandbox is admitted (starting or READY), so a prefix count is the number
of admitted sandboxes of that scope across every replica.

A record is a binary protobuf envelope, ``orchard.env.internal.v1.SandboxRecord`` (owners:
``OwnerRecord``): ``sandbox`` is the public ``orchard.env.v1.Sandbox`` (``expire_time`` left out:
it is the lease's remaining TTL), the rest are internal fields every replica needs to serve the
sandbox (the agent's address, the request key to remove with it). Earlier versions stored a JSON
envelope; a value starting with ``{`` is read as that (a binary envelope never starts with it:
its first byte is a field tag), so a deployment upgrades in place and its old records stay
readable until they are rewritten. Keys sort by sandbox id within a tenant, which ListSandboxes
relies on.
``spec.env`` values are stored sealed (``sealing.SpecSealer``): a record never holds them in
clear, in etcd or in memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from orchard.env.internal.v1 import records_pb2
from orchard.env.v1 import env_pb2

__all__ = [
    "CREATING",
    "OWNERS",
    "OWNER_REQUESTS",
    "REPLICAS",
    "REQUESTS",
    "SANDBOXES",
    "SLOTS",
    "SYNC",
    "OwnerRecord",
    "SandboxRecord",
    "creating_key",
    "owner_key",
    "owner_request_key",
    "parse_sandbox_key",
    "request_key",
    "sandbox_key",
    "slot_scope",
]

SANDBOXES = "sandboxes/"
REQUESTS = "requests/"
CREATING = "creating/"
REPLICAS = "replicas/"
OWNERS = "owners/"
OWNER_REQUESTS = "owner-requests/"
SLOTS = "slots/"
SYNC = "sync/"  # a replica's marker: written to see when its watch has caught up

State = env_pb2.SandboxState
_JSON_START = b"{"  # how a record in the earlier JSON form starts


def sandbox_key(tenant: str, sandbox_id: str) -> str:
    return f"{SANDBOXES}{tenant}/{sandbox_id}"


def creating_key(tenant: str, sandbox_id: str) -> str:
    return f"{CREATING}{tenant}/{sandbox_id}"


def request_key(tenant: str, request_id: str) -> str:
    # Hashed: request ids are client strings of any length and alphabet.
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:32]
    return f"{REQUESTS}{tenant}/{digest}"


def owner_key(tenant: str, owner_id: str) -> str:
    return f"{OWNERS}{tenant}/{owner_id}"


def owner_request_key(tenant: str, request_id: str) -> str:
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:32]
    return f"{OWNER_REQUESTS}{tenant}/{digest}"


def slot_scope(kind: str, name: str = "") -> str:
    """The key prefix of one admission scope: ``slots/all/``, ``slots/tenant/<t>/``, ..."""
    return f"{SLOTS}{kind}/{name}/" if name else f"{SLOTS}{kind}/"


def parse_sandbox_key(key: bytes | str) -> tuple[str, str] | None:
    """``(tenant, sandbox_id)`` of a ``sandboxes/`` or ``creating/`` key, else None."""
    text = key.decode() if isinstance(key, bytes) else key
    for prefix in (SANDBOXES, CREATING):
        if text.startswith(prefix):
            tenant, _, sandbox_id = text[len(prefix) :].partition("/")
            if tenant and sandbox_id:
                return tenant, sandbox_id
    return None


@dataclass
class SandboxRecord:
    """What the store holds for one sandbox."""

    sandbox: env_pb2.Sandbox
    agent_address: str = ""
    request_key: str = ""
    # Set when a replica took over a creation whose replica died; for the log and tests.
    adopted_by: str = ""
    # Waiting in the admission queue (PENDING, no creation running anywhere).
    queued: bool = False
    # Its place in the fair order, fixed when it joined the queue (see admission.fair_order).
    queue_round: int = 0
    # The admission slot keys it holds (released on FAILED and delete; its lease drops them).
    slots: tuple[str, ...] = ()
    # The agent's exec lane; "" when it has none (records of versions before the lane, too).
    lane_address: str = ""
    # Filled in on read, never stored.
    mod_revision: int = field(default=0, compare=False)
    lease: int = field(default=0, compare=False)

    @property
    def tenant(self) -> str:
        return self.sandbox.tenant

    @property
    def id(self) -> str:
        return self.sandbox.id

    @property
    def state(self) -> env_pb2.SandboxState.ValueType:
        return self.sandbox.state

    @property
    def key(self) -> str:
        return sandbox_key(self.sandbox.tenant, self.sandbox.id)

    def encode(self) -> bytes:
        envelope = records_pb2.SandboxRecord(
            agent_address=self.agent_address,
            request_key=self.request_key,
            adopted_by=self.adopted_by,
            queued=self.queued,
            queue_round=self.queue_round if self.queued else 0,
            slots=self.slots,
            lane_address=self.lane_address,
        )
        envelope.sandbox.CopyFrom(self.sandbox)
        envelope.sandbox.ClearField("expire_time")
        return envelope.SerializeToString(deterministic=True)

    @classmethod
    def decode(cls, value: bytes, *, mod_revision: int = 0, lease: int = 0) -> SandboxRecord:
        if value.startswith(_JSON_START):
            return cls._decode_json(value, mod_revision=mod_revision, lease=lease)
        envelope = records_pb2.SandboxRecord.FromString(value)
        return cls(
            sandbox=envelope.sandbox,
            agent_address=envelope.agent_address,
            request_key=envelope.request_key,
            adopted_by=envelope.adopted_by,
            queued=envelope.queued,
            queue_round=envelope.queue_round,
            slots=tuple(envelope.slots),
            lane_address=envelope.lane_address,
            mod_revision=mod_revision,
            lease=lease,
        )

    @classmethod
    def _decode_json(cls, value: bytes, *, mod_revision: int, lease: int) -> SandboxRecord:
        """A record as versions before the binary envelope wrote it."""
        envelope = json.loads(value)
        sandbox = json_format.ParseDict(
            envelope["sandbox"], env_pb2.Sandbox(), ignore_unknown_fields=True
        )
        return cls(
            sandbox=sandbox,
            agent_address=envelope.get("agent_address", ""),
            request_key=envelope.get("request_key", ""),
            adopted_by=envelope.get("adopted_by", ""),
            queued=bool(envelope.get("queued", False)),
            queue_round=int(envelope.get("queue_round", 0)),
            slots=tuple(envelope.get("slots", ())),
            mod_revision=mod_revision,
            lease=lease,
        )

    @classmethod
    def from_kv(cls, kv: Any) -> SandboxRecord:
        """From an ``orchard.core.etcd.KeyValue``."""
        return cls.decode(kv.value, mod_revision=kv.mod_revision, lease=kv.lease)


@dataclass
class OwnerRecord:
    """What the store holds for one owner: the public ``Owner`` (minus ``expire_time``)."""

    owner: env_pb2.Owner
    lease: int = field(default=0, compare=False)

    @property
    def key(self) -> str:
        return owner_key(self.owner.tenant, self.owner.id)

    def encode(self) -> bytes:
        envelope = records_pb2.OwnerRecord()
        envelope.owner.CopyFrom(self.owner)
        envelope.owner.ClearField("expire_time")
        return envelope.SerializeToString(deterministic=True)

    @classmethod
    def decode(cls, value: bytes, *, lease: int = 0) -> OwnerRecord:
        if value.startswith(_JSON_START):  # the earlier JSON form
            owner = json_format.Parse(value, env_pb2.Owner(), ignore_unknown_fields=True)
            return cls(owner=owner, lease=lease)
        return cls(owner=records_pb2.OwnerRecord.FromString(value).owner, lease=lease)

    @classmethod
    def from_kv(cls, kv: Any) -> OwnerRecord:
        return cls.decode(kv.value, lease=kv.lease)
