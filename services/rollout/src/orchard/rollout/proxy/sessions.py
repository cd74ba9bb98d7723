"""Capture sessions: the calls of one rollout, as they arrive and finish, and settling.

A harness may still have a call in flight when it reports that it is done (a black-box agent
exits while its last request is being answered; a retry races its original). So a rollout's
records are taken only once they have settled: nothing pending, and no call started or finished
for a quiet period.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchard.rollout.capture import CallRecord

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
_FRESH_TAIL = re.compile(r"\.[0-9a-f]{10}$")
"""The random tail of the rollout service's ids (``<task>.<index>.<10 hex digits>``,
`runner.new_rollout_id`): a retry of rollout `index` gets a new one."""


def rollout_draw_key(rollout_id: str) -> str:
    """What names a rollout across jobs and retries: its id without the random tail the
    rollout service gives it (``<task>.<index>``); any other id as it is."""
    return _FRESH_TAIL.sub("", rollout_id)


class CaptureError(Exception):
    """Base class of the capture sessions' errors."""


class UnknownRollout(CaptureError, KeyError):
    """No capture session is open for this rollout id."""


class CaptureNotSettled(CaptureError, TimeoutError):
    """Calls were still pending (or still arriving) when the settle timeout ran out."""

    def __init__(self, message: str, *, pending: int, records: int) -> None:
        super().__init__(message)
        self.pending = pending
        self.records = records


@dataclass(eq=False)
class CaptureSession:
    """The calls of one rollout."""

    rollout_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    records: list[CallRecord] = field(default_factory=list)
    failed_calls: int = 0
    """Calls that got an error answer (no record: nothing was sampled)."""
    pending: int = 0
    _next_seq: int = 0
    _changed_at: float = field(default_factory=time.monotonic)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def begin_call(self) -> int:
        """Count a call as pending; returns its sequence number (arrival order)."""
        async with self._changed:
            seq = self._next_seq
            self._next_seq += 1
            self.pending += 1
            self._touch()
            return seq

    async def end_call(self, record: CallRecord | None) -> None:
        """The call is answered: keep its record (None when it failed)."""
        async with self._changed:
            self.pending -= 1
            if record is None:
                self.failed_calls += 1
            else:
                self.records.append(record)
            self._touch()

    def call_seed(self, seed: int, call: int) -> int:
        """The sampling seed of call `call` (from 0, in arrival order) of this rollout in a
        proxy seeded with `seed`: a 63-bit digest of the seed, `rollout_draw_key` of the
        rollout and the call, so a rollout draws the same in every job with that seed."""
        key = f"{seed}/{rollout_draw_key(self.rollout_id)}/{call}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1

    @property
    def started_calls(self) -> int:
        """Calls that have arrived so far (answered, failed or pending)."""
        return self._next_seq

    async def wait_for_calls(self, count: int) -> None:
        """Wait until `count` calls have arrived; bound it with `asyncio.timeout`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._next_seq >= count)

    def _touch(self) -> None:
        self._changed_at = time.monotonic()
        self._changed.notify_all()

    async def settle(
        # Giving up is part of settling: it raises with the counts.
        self,
        timeout: float,  # noqa: ASYNC109
        quiet_s: float,
    ) -> tuple[CallRecord, ...]:
        """The records in arrival order, once nothing is pending and nothing changed for
        `quiet_s`; raises `CaptureNotSettled` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                while True:
                    async with self._changed:
                        await self._changed.wait_for(lambda: self.pending == 0)
                        quiet_until = self._changed_at + quiet_s
                    now = time.monotonic()
                    if now >= quiet_until:
                        async with self._changed:
                            if self.pending == 0 and self._changed_at + quiet_s <= now:
                                return tuple(sorted(self.records, key=_seq))
                        continue
                    if quiet_until > deadline:
                        raise TimeoutError
                    await asyncio.sleep(quiet_until - now)
        except TimeoutError:
            raise CaptureNotSettled(
                f"rollout {self.rollout_id!r} did not settle within {timeout} s: "
                f"{self.pending} calls pending, {len(self.records)} recorded",
                pending=self.pending,
                records=len(self.records),
            ) from None


def _seq(record: CallRecord) -> int:
    return record.seq
