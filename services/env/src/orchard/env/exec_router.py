"""Where exec and file calls go: the link to a READY sandbox's agent, and whether a sandbox whose
agent did not answer is still alive.

The record comes from the record store's view (etcd only for a sandbox this replica's watch
has not delivered yet), the link from :class:`~orchard.env.agents.AgentLinks` (one channel and
one lock per sandbox). The router decides nothing about records: :meth:`ExecRouter.dead_reason`
says why a sandbox is dead, and its caller records the failure.
"""

from __future__ import annotations

from orchard.core.errors import OrchardError
from orchard.core.etcd import EtcdError
from orchard.env.agents import AgentLink, AgentLinks
from orchard.env.reasons import EnvReason
from orchard.env.record_store import RecordStore, not_found, store_unavailable
from orchard.env.runtime.base import FailureReason, Runtime, SandboxStatus
from orchard.env.v1 import env_pb2

__all__ = ["ExecRouter", "dead_reason"]

READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED


def dead_reason(status: SandboxStatus) -> tuple[str, str]:
    """The failure ``(reason, message)`` of a sandbox the runtime reports not RUNNING."""
    if status is SandboxStatus.EXITED:
        return FailureReason.AGENT_EXITED.value, "the sandbox's agent exited"
    return FailureReason.RUNTIME_DIED.value, "the runtime no longer has this sandbox"


class ExecRouter:
    """Links to the agents of READY sandboxes, for one replica."""

    def __init__(self, records: RecordStore, runtime: Runtime, *, use_lanes: bool = True) -> None:
        self._records = records
        self._runtime = runtime
        self.links = AgentLinks(
            verify=runtime.verify_agent, key=runtime.agent_key, use_lanes=use_lanes
        )

    async def agent(self, tenant: str, sandbox_id: str) -> AgentLink:
        """The link to a READY sandbox's agent; NOT_FOUND or FAILED_PRECONDITION otherwise.

        The view answers first; a miss (a sandbox this replica has not heard of yet) reads
        etcd, so a sandbox READY anywhere is usable here at once.
        """
        record = self._records.cached(tenant, sandbox_id)
        if record is None or record.state != READY:
            try:
                record = await self._records.read(tenant, sandbox_id)
            except EtcdError as exc:
                raise store_unavailable(exc) from exc
            if record is None:
                raise not_found(sandbox_id)
        if record.state != READY:
            state = env_pb2.SandboxState.Name(record.state).removeprefix("SANDBOX_STATE_")
            message = f"sandbox {sandbox_id!r} is {state}, not READY"
            if record.state == FAILED:
                message += f" ({record.sandbox.failure.reason}: {record.sandbox.failure.message})"
            raise OrchardError(
                EnvReason.SANDBOX_NOT_READY,
                message,
                metadata={"sandbox_id": sandbox_id, "state": state},
            )
        return await self.links.get(sandbox_id, record.agent_address, record.lane_address)

    async def dead_reason(self, sandbox_id: str) -> tuple[str, str] | None:
        """After its agent did not answer: why the sandbox is dead, or None when the runtime
        still runs it (the agent was only slow)."""
        status = await self._runtime.status(sandbox_id)
        return None if status is SandboxStatus.RUNNING else dead_reason(status)

    def drop(self, sandbox_id: str) -> None:
        """Close the link of a sandbox that is going (FAILED, DELETING or gone)."""
        self.links.drop(sandbox_id)

    async def close(self) -> None:
        await self.links.close()
