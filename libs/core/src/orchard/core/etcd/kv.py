"""Key-value records returned by the etcd store."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

Key = bytes | str
"""A key or value: bytes, or a str that is stored UTF-8 encoded."""


def to_bytes(data: Key) -> bytes:
    """Encode a str as UTF-8; pass bytes through."""
    return data.encode() if isinstance(data, str) else data


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that holds every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    # Every byte is 0xff (or the prefix is empty): the range runs to the end of the keyspace.
    return b"\0"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored in etcd, with its revisions.

    `key` has the store's namespace removed. `create_revision` is the revision that created
    the key, `mod_revision` the one that last changed it, `version` counts changes since
    creation (0 after a delete), `lease` is the attached lease id or 0.
    """

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @property
    def key_str(self) -> str:
        """The key decoded as UTF-8."""
        return self.key.decode()

    @property
    def value_str(self) -> str:
        """The value decoded as UTF-8."""
        return self.value.decode()

    @classmethod
    def from_proto(cls, kv: Any, strip: int = 0) -> KeyValue:
        """Build from an `mvccpb.KeyValue`, removing `strip` bytes of namespace from the key."""
        return cls(
            key=bytes(kv.key[strip:]),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    """A page of keys read at one revision.

    `revision` is the store revision the read saw; pass it back as `revision=` to read the
    next page from the same snapshot, or watch from `revision + 1` to follow changes.
    `more` says whether keys past `limit` remain; `count` is the number of keys in the whole
    range (not only this page).
    """

    kvs: list[KeyValue]
    revision: int
    more: bool
    count: int


class SortTarget(enum.Enum):
    """What a range is sorted by."""

    KEY = 0
    VERSION = 1
    CREATE = 2
    MOD = 3
    VALUE = 4


class SortOrder(enum.Enum):
    """Direction of a range sort; NONE returns keys in key order (etcd's default)."""

    NONE = 0
    ASCEND = 1
    DESCEND = 2
