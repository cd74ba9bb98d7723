"""The job store: rollout jobs, their groups, claims and removals in etcd.

Keys, under the service's namespace:

- ``jobs/<job_id>``: the job as JSON (spec, state, progress, the pairs sampled to their end).
  Job ids sort newest first (they start with the creation time counted down), so listing by
  key lists the newest jobs first and pages stay put while jobs are created or removed;
- ``requests/<request_id>``: the job a client's request id created (retries return it);
- ``groups/<job_id>/<index>``: the emitted groups (``orchard.types.v1.TrajectoryGroup``, binary),
  numbered from 0 in emission order;
- ``cancels/<job_id>``: written by a cancel; every write of the job's runner is conditional on
  its absence, so a cancel (from any replica) is never overwritten;
- ``owners/<job_id>``: the process running the job, on that process's lease (it vanishes when
  the process stops or dies, and another process, or the restarted one, adopts the job);
- ``removed/<job_id>``: what is left of an ended job after the retention removed it (its end
  state and times), so a late reader learns why it is gone; itself removed one retention later.

A group is written in one transaction with the job record that counts it and marks its pair
done, so a group is emitted exactly once. An ended job leaves in one transaction too, with its
groups, claim, cancel mark and request id, conditional on the record being unchanged since it
was read: with several replicas sweeping, one removes it and the others' transactions fail.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format, timestamp_pb2

from orchard.core.etcd import Compare, CompareOp, DeleteOp, EtcdStore, Op, PutOp
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "CANCELS",
    "ENDED",
    "GROUPS",
    "JOBS",
    "OWNERS",
    "REMOVED",
    "REQUESTS",
    "STATE_NAMES",
    "BadPageToken",
    "JobCancelled",
    "JobState",
    "JobStore",
    "RemovedJob",
    "StoredJob",
    "decode_page_token",
    "encode_page_token",
    "group_key",
    "job_id_of",
    "new_job_id",
]

JOBS = "jobs/"
REQUESTS = "requests/"
OWNERS = "owners/"
CANCELS = "cancels/"
GROUPS = "groups/"
REMOVED = "removed/"
INDEX_DIGITS = 10
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_TOKEN_PREFIX = "k1:"

STATE_NAMES: dict[int, str] = {
    api.ROLLOUT_JOB_STATE_RUNNING: "RUNNING",
    api.ROLLOUT_JOB_STATE_SUCCEEDED: "SUCCEEDED",
    api.ROLLOUT_JOB_STATE_FAILED: "FAILED",
    api.ROLLOUT_JOB_STATE_CANCELLED: "CANCELLED",
}
ENDED = frozenset(
    {
        api.ROLLOUT_JOB_STATE_SUCCEEDED,
        api.ROLLOUT_JOB_STATE_FAILED,
        api.ROLLOUT_JOB_STATE_CANCELLED,
    }
)


def new_job_id() -> str:
    """32 hex digits: nanoseconds counted down from 2**64 then 64 random bits, so a newer job's
    key sorts first."""
    return f"{(1 << 64) - 1 - time.time_ns():016x}{secrets.token_hex(8)}"


def job_id_of(key: str) -> str | None:
    """The job a key of this store belongs to (jobs/, groups/, cancels/, owners/), else None."""
    for prefix in (JOBS, GROUPS, CANCELS, OWNERS):
        if key.startswith(prefix):
            return key[len(prefix) :].split("/", 1)[0] or None
    return None


def group_key(job_id: str, index: int) -> str:
    return f"{GROUPS}{job_id}/{index:0{INDEX_DIGITS}d}"


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


_PARSED_SPECS: dict[str, tuple[dict[str, Any], api.RolloutJobSpec]] = {}
_PARSED_SPECS_KEPT = 256


def _parsed_spec(job_id: str, spec: dict[str, Any]) -> api.RolloutJobSpec:
    """`spec` (a job record's JSON form) as a message. A job's spec does not change, and its
    record is read at every progress poll and group stream wake-up: parsing a spec of a hundred
    tasks from JSON each time was a few percent of the service's CPU, comparing the JSON forms
    costs far less. Each caller gets a copy of its own."""
    kept = _PARSED_SPECS.get(job_id)
    if kept is None or kept[0] != spec:
        kept = (spec, json_format.ParseDict(spec, api.RolloutJobSpec()))
        if len(_PARSED_SPECS) >= _PARSED_SPECS_KEPT:
            del _PARSED_SPECS[next(iter(_PARSED_SPECS))]
        _PARSED_SPECS[job_id] = kept
    copy = api.RolloutJobSpec()
    copy.CopyFrom(kept[1])
    return copy


@dataclass(slots=True)
class JobState:
    """A job as stored: everything `RolloutJob` shows, and the pairs already done."""

    id: str
    spec: api.RolloutJobSpec
    request_id: str = ""
    state: int = int(api.ROLLOUT_JOB_STATE_RUNNING)
    error: str = ""
    create_time: float = field(default_factory=time.time)
    update_time: float = field(default_factory=time.time)
    rollouts_started: int = 0
    rollouts_done: int = 0
    rollouts_excluded: int = 0
    groups_emitted: int = 0
    groups_dropped: int = 0
    pairs_total: int = 0
    pairs_done: list[str] = field(default_factory=list)
    resumes: int = 0

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "spec": json_format.MessageToDict(self.spec, preserving_proto_field_name=True),
                "request_id": self.request_id,
                "state": STATE_NAMES[self.state],
                "error": self.error,
                "create_time": self.create_time,
                "update_time": self.update_time,
                "rollouts_started": self.rollouts_started,
                "rollouts_done": self.rollouts_done,
                "rollouts_excluded": self.rollouts_excluded,
                "groups_emitted": self.groups_emitted,
                "groups_dropped": self.groups_dropped,
                "pairs_total": self.pairs_total,
                "pairs_done": self.pairs_done,
                "resumes": self.resumes,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> JobState:
        data: dict[str, Any] = json.loads(text)
        states = {name: number for number, name in STATE_NAMES.items()}
        return cls(
            id=data["id"],
            spec=_parsed_spec(data["id"], data["spec"]),
            request_id=data.get("request_id", ""),
            state=states[data["state"]],
            error=data.get("error", ""),
            create_time=data["create_time"],
            update_time=data.get("update_time", data["create_time"]),
            rollouts_started=data.get("rollouts_started", 0),
            rollouts_done=data.get("rollouts_done", 0),
            rollouts_excluded=data.get("rollouts_excluded", 0),
            groups_emitted=data.get("groups_emitted", 0),
            groups_dropped=data.get("groups_dropped", 0),
            pairs_total=data.get("pairs_total", 0),
            pairs_done=list(data.get("pairs_done", [])),
            resumes=data.get("resumes", 0),
        )

    def to_proto(self) -> api.RolloutJob:
        return api.RolloutJob(
            id=self.id,
            spec=self.spec,
            state=self.state,  # type: ignore[arg-type]
            rollouts_done=self.rollouts_done,
            rollouts_excluded=self.rollouts_excluded,
            groups_emitted=self.groups_emitted,
            error=self.error,
            create_time=_timestamp(self.create_time),
            rollouts_started=self.rollouts_started,
            groups_dropped=self.groups_dropped,
            pairs_total=self.pairs_total,
            pairs_done=len(self.pairs_done),
            resumes=self.resumes,
            update_time=_timestamp(self.update_time),
        )


class JobCancelled(Exception):
    """The job was cancelled (possibly through another replica): its runner stops writing."""


class JobStore:
    """Jobs and their groups in etcd."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    async def create(self, job: JobState, *, owner: str = "", lease: int = 0) -> JobState:
        """Stores a new job, claimed by `owner` on `lease` in the same write when given (no
        other replica can adopt it in between); with a request id already used, returns the
        job it created."""
        if job.request_id:
            created = await self.store.create_if_absent(REQUESTS + job.request_id, job.id)
            if created is None:
                existing = await self.store.get(REQUESTS + job.request_id)
                if existing is not None:
                    found = await self.get(existing.value_str)
                    if found is not None:
                        return found
        job.update_time = time.time()
        ops: list[Op] = [PutOp.of(JOBS + job.id, job.to_json())]
        if owner:
            ops.append(PutOp.of(OWNERS + job.id, owner, lease))
        await self.store.txn([], ops)
        return job

    async def put(self, job: JobState) -> None:
        job.update_time = time.time()
        await self.store.put(JOBS + job.id, job.to_json())

    async def put_running(self, job: JobState) -> None:
        """The runner's write: refused (JobCancelled) once the job was cancelled."""
        job.update_time = time.time()
        result = await self.store.txn(
            [Compare.version(CANCELS + job.id, CompareOp.EQUAL, 0)],
            [PutOp.of(JOBS + job.id, job.to_json())],
        )
        if not result.succeeded:
            raise JobCancelled(job.id)

    async def mark_cancelled(self, job_id: str) -> None:
        await self.store.put(CANCELS + job_id, "1")

    async def claim(self, job_id: str, owner: str, lease: int) -> bool:
        """Makes `owner` the job's runner unless another live process is; True when it is."""
        if await self.store.create_if_absent(OWNERS + job_id, owner, lease=lease) is not None:
            return True
        current = await self.store.get(OWNERS + job_id)
        return current is not None and current.value_str == owner

    async def get(self, job_id: str) -> JobState | None:
        kv = await self.store.get(JOBS + job_id)
        return None if kv is None else JobState.from_json(kv.value)

    async def all(self) -> list[JobState]:
        """Every job, newest first."""
        return sorted((s.job for s in await self.stored()), key=lambda j: (-j.create_time, j.id))

    async def stored(self) -> list[StoredJob]:
        """Every job with its record's revision, in key order."""
        return [
            StoredJob(JobState.from_json(kv.value), kv.mod_revision)
            async for kv in self.store.iter_prefix(JOBS)
        ]

    async def page(self, size: int, after: str | None) -> tuple[list[JobState], str | None]:
        """Up to `size` jobs in key order (newest first) after the job `after`, and the id to
        continue after (None on the last page)."""
        start_after = JOBS + after if after is not None else None
        page = await self.store.get_prefix(JOBS, limit=size, start_after=start_after)
        jobs = [JobState.from_json(kv.value) for kv in page.kvs]
        return jobs, (jobs[-1].id if page.more and jobs else None)

    async def emit(self, job: JobState, group: trajectory_pb2.TrajectoryGroup) -> int:
        """Writes the group as the job's next one with the job record, atomically; returns its
        index."""
        index = job.groups_emitted
        job.groups_emitted += 1
        job.update_time = time.time()
        try:
            result = await self.store.txn(
                [Compare.version(CANCELS + job.id, CompareOp.EQUAL, 0)],
                [
                    PutOp.of(group_key(job.id, index), group.SerializeToString()),
                    PutOp.of(JOBS + job.id, job.to_json()),
                ],
            )
        except BaseException:
            job.groups_emitted -= 1  # not written (or not known to be): the count stays true
            raise
        if not result.succeeded:
            job.groups_emitted -= 1
            raise JobCancelled(job.id)
        return index

    async def groups(
        self, job_id: str, start_index: int, *, page_size: int = 64
    ) -> list[tuple[int, trajectory_pb2.TrajectoryGroup]]:
        """The job's groups from `start_index` on, in order (read from that key on)."""
        prefix = f"{GROUPS}{job_id}/"
        after: str | None = group_key(job_id, start_index - 1) if start_index > 0 else None
        out = []
        while True:
            page = await self.store.get_prefix(prefix, limit=page_size, start_after=after)
            for kv in page.kvs:
                group = trajectory_pb2.TrajectoryGroup()
                group.ParseFromString(kv.value)
                out.append((int(kv.key_str.rsplit("/", 1)[1]), group))
            if not page.more or not page.kvs:
                return out
            after = page.kvs[-1].key_str

    # -- retention -----------------------------------------------------------------------

    async def remove(self, stored: StoredJob, retention_s: float) -> bool:
        """Removes an ended job with its groups, claim, cancel mark and request id, leaving a
        `removed/` record, in one transaction that holds only while the job record is as read;
        True when this call removed it."""
        job = stored.job
        if not job.ended:
            raise ValueError(f"job {job.id} has not ended; only ended jobs are removed")
        compare = [Compare.mod_revision(JOBS + job.id, CompareOp.EQUAL, stored.mod_revision)]
        ops: list[Op] = [
            DeleteOp.of(JOBS + job.id),
            DeleteOp.of(f"{GROUPS}{job.id}/", prefix=True),
            DeleteOp.of(CANCELS + job.id),
            DeleteOp.of(OWNERS + job.id),
        ]
        if job.request_id:
            request = await self.store.get(REQUESTS + job.request_id)
            if request is not None and request.value_str == job.id:
                # Freed with the job: a retry after the retention creates a new job.
                compare.append(
                    Compare.mod_revision(
                        REQUESTS + job.request_id, CompareOp.EQUAL, request.mod_revision
                    )
                )
                ops.append(DeleteOp.of(REQUESTS + job.request_id))
        removed = RemovedJob(
            id=job.id,
            state=STATE_NAMES[job.state],
            ended_at=job.update_time,
            removed_at=time.time(),
            retention_s=retention_s,
        )
        ops.append(PutOp.of(REMOVED + job.id, removed.to_json()))
        result = await self.store.txn(compare, ops)
        return result.succeeded

    async def removed(self, job_id: str) -> RemovedJob | None:
        """What stays of a job the retention removed, while it stays."""
        kv = await self.store.get(REMOVED + job_id)
        return None if kv is None else RemovedJob.from_json(kv.value)

    async def forget_removed(self, before: float) -> int:
        """Drops the `removed/` records of jobs removed before `before`; returns how many."""
        dropped = 0
        async for kv in self.store.iter_prefix(REMOVED):
            if RemovedJob.from_json(kv.value).removed_at < before:
                dropped += int(await self.store.delete_if_mod_revision(kv.key, kv.mod_revision))
        return dropped


class BadPageToken(ValueError):
    """A page token this service did not give."""


def encode_page_token(job_id: str) -> str:
    """The opaque token of the page after the job `job_id` (the last key listed)."""
    return base64.urlsafe_b64encode((_TOKEN_PREFIX + job_id).encode()).decode().rstrip("=")


def decode_page_token(token: str) -> str:
    """The job id a token of `encode_page_token` carries; BadPageToken otherwise."""
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BadPageToken(token) from None
    if not text.startswith(_TOKEN_PREFIX) or not JOB_ID.match(text[len(_TOKEN_PREFIX) :]):
        raise BadPageToken(token)
    return text[len(_TOKEN_PREFIX) :]


@dataclass(frozen=True, slots=True)
class RemovedJob:
    """What stays of a job the retention removed: how it ended, when, and when it left."""

    id: str
    state: str
    ended_at: float
    removed_at: float
    retention_s: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "state": self.state,
                "ended_at": self.ended_at,
                "removed_at": self.removed_at,
                "retention_s": self.retention_s,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> RemovedJob:
        data: dict[str, Any] = json.loads(text)
        return cls(
            id=data["id"],
            state=data["state"],
            ended_at=data["ended_at"],
            removed_at=data["removed_at"],
            retention_s=data["retention_s"],
        )


@dataclass(frozen=True, slots=True)
class StoredJob:
    """A job with the revision its record was read at (a removal is conditional on it)."""

    job: JobState
    mod_revision: int
