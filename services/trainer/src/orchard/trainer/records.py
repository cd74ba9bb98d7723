"""Training job records in etcd: the key layout, the stored format, typed reads and writes.

Keys, under the configured prefix (``orchard/trainer/`` by default)::

    jobs/<job_id>                          JobRecord (JSON)
    requests/<sha256(request_id)[:32]>     job id: a retried CreateTrainingJob finds its job

A record is a JSON envelope: ``job`` is the public ``orchard.trainer.v1.TrainingJob`` and
``checkpoints`` its ``Checkpoint`` messages (oldest first), both in protobuf JSON form. Only
the replica running a job writes its record; every write replaces the whole record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from orchard.core.etcd import Compare, CompareOp, EtcdStore, PutOp
from orchard.trainer.v1 import trainer_service_pb2 as api

__all__ = ["JOBS", "REQUESTS", "JobRecord", "JobStore", "job_key", "request_key"]

JOBS = "jobs/"
REQUESTS = "requests/"


def job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def request_key(request_id: str) -> str:
    # Hashed: request ids are client strings of any length and alphabet.
    return f"{REQUESTS}{hashlib.sha256(request_id.encode()).hexdigest()[:32]}"


@dataclass
class JobRecord:
    """What the store holds for one job."""

    job: api.TrainingJob
    checkpoints: list[api.Checkpoint] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def key(self) -> str:
        return job_key(self.job.id)

    def checkpoint_at(self, step: int) -> api.Checkpoint | None:
        for checkpoint in self.checkpoints:
            if checkpoint.step == step:
                return checkpoint
        return None

    def encode(self) -> bytes:
        envelope: dict[str, Any] = {
            "job": json_format.MessageToDict(self.job),
            "checkpoints": [json_format.MessageToDict(c) for c in self.checkpoints],
        }
        return json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> JobRecord:
        envelope = json.loads(value)
        job = json_format.ParseDict(envelope["job"], api.TrainingJob(), ignore_unknown_fields=True)
        checkpoints = [
            json_format.ParseDict(c, api.Checkpoint(), ignore_unknown_fields=True)
            for c in envelope.get("checkpoints", [])
        ]
        return cls(job=job, checkpoints=checkpoints)


class JobStore:
    """Job records on an `EtcdStore` the caller owns."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store

    async def create(self, record: JobRecord, request_id: str = "") -> tuple[JobRecord, bool]:
        """Store a new job; with a `request_id` seen before, the job it created instead.
        Returns (record, created)."""
        if request_id:
            existing = await self.by_request(request_id)
            if existing is not None:
                return existing, False
        compares = [Compare.create_revision(record.key, CompareOp.EQUAL, 0)]
        puts = [PutOp.of(record.key, record.encode())]
        if request_id:
            compares.append(Compare.create_revision(request_key(request_id), CompareOp.EQUAL, 0))
            puts.append(PutOp.of(request_key(request_id), record.id))
        result = await self._store.txn(compares, puts)
        if not result.succeeded:
            # A concurrent retry with the same request id won the race.
            existing = await self.by_request(request_id) if request_id else None
            if existing is None:
                raise RuntimeError(f"job id {record.id!r} is taken")
            return existing, False
        return record, True

    async def by_request(self, request_id: str) -> JobRecord | None:
        """The job a CreateTrainingJob with `request_id` made, if any."""
        kv = await self._store.get(request_key(request_id))
        if kv is None:
            return None
        return await self.get(kv.value.decode())

    async def get(self, job_id: str) -> JobRecord | None:
        kv = await self._store.get(job_key(job_id))
        return JobRecord.decode(kv.value) if kv is not None else None

    async def put(self, record: JobRecord) -> None:
        await self._store.put(record.key, record.encode())

    async def list_jobs(self) -> list[JobRecord]:
        """Every job, newest first (by create time, then id)."""
        result = await self._store.list_prefix(JOBS)
        records = [JobRecord.decode(kv.value) for kv in result.kvs]
        records.sort(key=lambda r: (r.job.create_time.ToNanoseconds(), r.id), reverse=True)
        return records
