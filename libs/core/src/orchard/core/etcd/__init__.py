"""etcd for Orchard services: `EtcdStore`, the async client every service keeps durable state
in, and `EmbeddedEtcd`, a real etcd server process for local runs and tests."""

from orchard.core.etcd.embedded import (
    BINARY_ENV,
    EmbeddedEtcd,
    EmbeddedEtcdCluster,
    EmbeddedEtcdError,
    find_etcd_binary,
)
from orchard.core.etcd.exceptions import (
    CompactedRevision,
    EtcdClosed,
    EtcdError,
    EtcdRequestError,
    EtcdTimeout,
    EtcdUnavailable,
    FutureRevision,
    LeaseNotFound,
)
from orchard.core.etcd.kv import Key, KeyValue, RangeResult, SortOrder, SortTarget
from orchard.core.etcd.lease import Lease, LeaseInfo, LeaseKeepAlive
from orchard.core.etcd.store import EtcdStore
from orchard.core.etcd.txn import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    DeleteResult,
    GetOp,
    Op,
    OpResult,
    PutOp,
    PutResult,
    TxnResult,
)
from orchard.core.etcd.watch import EventType, Watch, WatchEvent

__all__ = [
    "BINARY_ENV",
    "CompactedRevision",
    "Compare",
    "CompareOp",
    "CompareTarget",
    "DeleteOp",
    "DeleteResult",
    "EmbeddedEtcd",
    "EmbeddedEtcdCluster",
    "EmbeddedEtcdError",
    "EtcdClosed",
    "EtcdError",
    "EtcdRequestError",
    "EtcdStore",
    "EtcdTimeout",
    "EtcdUnavailable",
    "EventType",
    "FutureRevision",
    "GetOp",
    "Key",
    "KeyValue",
    "Lease",
    "LeaseInfo",
    "LeaseKeepAlive",
    "LeaseNotFound",
    "Op",
    "OpResult",
    "PutOp",
    "PutResult",
    "RangeResult",
    "SortOrder",
    "SortTarget",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "find_etcd_binary",
]
