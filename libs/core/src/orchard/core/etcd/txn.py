"""Transaction building blocks: comparisons, operations and results.

A transaction evaluates every `Compare` atomically; if all hold it applies the `success`
operations, otherwise the `failure` ones, in one revision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from orchard.core.etcd.kv import Key, KeyValue, RangeResult, to_bytes


class CompareTarget(enum.Enum):
    """Which field of a key a `Compare` looks at (etcd's `Compare.CompareTarget`)."""

    VERSION = 0
    CREATE_REVISION = 1
    MOD_REVISION = 2
    VALUE = 3
    LEASE = 4


class CompareOp(enum.Enum):
    """The comparison operator (etcd's `Compare.CompareResult`)."""

    EQUAL = 0
    GREATER = 1
    LESS = 2
    NOT_EQUAL = 3


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: `target(key) op operand`.

    A key that does not exist has version, create and mod revision 0, so
    `Compare.create_revision(k, CompareOp.EQUAL, 0)` means "k is absent".
    """

    key: bytes
    target: CompareTarget
    op: CompareOp
    operand: bytes | int

    @classmethod
    def version(cls, key: Key, op: CompareOp, version: int) -> Compare:
        """Compare the number of changes since the key was created."""
        return cls(to_bytes(key), CompareTarget.VERSION, op, version)

    @classmethod
    def create_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        """Compare the revision that created the key (0: absent)."""
        return cls(to_bytes(key), CompareTarget.CREATE_REVISION, op, revision)

    @classmethod
    def mod_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        """Compare the revision that last changed the key (0: absent)."""
        return cls(to_bytes(key), CompareTarget.MOD_REVISION, op, revision)

    @classmethod
    def value(cls, key: Key, op: CompareOp, value: Key) -> Compare:
        """Compare the key's value."""
        return cls(to_bytes(key), CompareTarget.VALUE, op, to_bytes(value))

    @classmethod
    def lease(cls, key: Key, op: CompareOp, lease_id: int) -> Compare:
        """Compare the id of the lease attached to the key (0: none)."""
        return cls(to_bytes(key), CompareTarget.LEASE, op, lease_id)


@dataclass(frozen=True, slots=True)
class PutOp:
    """Set `key` to `value`, attached to `lease` when not 0."""

    key: bytes
    value: bytes
    lease: int = 0

    @classmethod
    def of(cls, key: Key, value: Key, lease: int = 0) -> PutOp:
        """Build from str or bytes."""
        return cls(to_bytes(key), to_bytes(value), lease)


@dataclass(frozen=True, slots=True)
class DeleteOp:
    """Delete `key`, or every key under it when `prefix` is set."""

    key: bytes
    prefix: bool = False

    @classmethod
    def of(cls, key: Key, prefix: bool = False) -> DeleteOp:
        """Build from str or bytes."""
        return cls(to_bytes(key), prefix)


@dataclass(frozen=True, slots=True)
class GetOp:
    """Read `key`, or every key under it when `prefix` is set."""

    key: bytes
    prefix: bool = False

    @classmethod
    def of(cls, key: Key, prefix: bool = False) -> GetOp:
        """Build from str or bytes."""
        return cls(to_bytes(key), prefix)


Op = PutOp | DeleteOp | GetOp


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of a `PutOp`: the key as it was before, when it existed."""

    prev: KeyValue | None


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """Outcome of a `DeleteOp`: how many keys were deleted."""

    deleted: int


OpResult = PutResult | DeleteResult | RangeResult


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Outcome of a transaction.

    `succeeded` says which branch ran; `revision` is the store revision after it (a write
    branch creates one new revision); `results` holds one entry per operation of that branch.
    """

    succeeded: bool
    revision: int
    results: list[OpResult]
