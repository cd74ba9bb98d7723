"""Egress rules that name another sandbox (``sandbox:<id>``), resolved for the runtime.

A sandbox reaches another one only when both agree: the target's policy lists the ports it
accepts on (``ingress_ports``, fixed at create, which also gives it an address), and the
source holds an egress rule naming it, which may expire. Both must be the same tenant's. The
service resolves such a rule to the target's address and the ports both sides name, and hands
the runtime a rule it can enforce without knowing tenants (`EgressRule.peer`).

At an RPC (create, update) a rule that cannot be resolved is refused with a status; when a
creation that was accepted reaches the runtime later, a target that went away meanwhile makes
its rule allow nothing (the rule is left out, and a line says so).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import EtcdError
from orchard.env.reasons import EnvReason
from orchard.env.record_store import RecordStore, not_found, store_unavailable
from orchard.env.runtime.base import EgressRule
from orchard.env.v1 import env_pb2
from orchard.env.validation import PEER_PREFIX, invalid

__all__ = ["PEER_PREFIX", "peer_of", "resolve_peer_rules"]

log = logging.getLogger(__name__)


def peer_of(destination: str) -> str | None:
    """The sandbox id a destination names, or None for an address, block or host name."""
    return destination[len(PEER_PREFIX) :] if destination.startswith(PEER_PREFIX) else None


async def resolve_peer_rules(
    records: RecordStore,
    tenant: str,
    sandbox_id: str,
    rules: Sequence[EgressRule],
    *,
    field: str,
    strict: bool,
) -> tuple[EgressRule, ...]:
    """``rules`` with each ``sandbox:<id>`` rule resolved to its target's address and ports.

    ``strict`` (at an RPC): NOT_FOUND for a target that is unknown or another tenant's,
    FAILED_PRECONDITION for one not READY or accepting none of the rule's ports,
    INVALID_ARGUMENT for a sandbox naming itself. Otherwise such a rule is left out."""
    resolved = []
    for index, rule in enumerate(rules):
        target_id = peer_of(rule.destination)
        if target_id is None:
            resolved.append(rule)
            continue
        where = f"{field}.egress[{index}].destination"
        try:
            resolved.append(
                await _resolve(
                    records,
                    tenant,
                    sandbox_id=sandbox_id,
                    target_id=target_id,
                    rule=rule,
                    where=where,
                )
            )
        except OrchardError as exc:
            if strict:
                raise
            log.warning(
                "an egress rule allows nothing: %s", exc.message, extra={"sandbox_id": sandbox_id}
            )
    return tuple(resolved)


async def _resolve(
    records: RecordStore,
    tenant: str,
    *,
    sandbox_id: str,
    target_id: str,
    rule: EgressRule,
    where: str,
) -> EgressRule:
    if target_id == sandbox_id:
        raise invalid(where, "a sandbox needs no rule to reach itself")
    try:
        target = await records.read(tenant, target_id)
    except EtcdError as exc:
        raise store_unavailable(exc) from exc
    if target is None:
        raise not_found(target_id)
    accepted = tuple(target.sandbox.spec.network_policy.ingress_ports)
    if target.state != env_pb2.SANDBOX_STATE_READY or (
        accepted and not target.sandbox.network_address
    ):
        raise OrchardError(
            EnvReason.SANDBOX_NOT_READY,
            f"{where}: sandbox {target_id!r} is not READY; name it once it is",
            metadata={"sandbox_id": target_id},
        )
    ports = tuple(sorted(set(rule.ports) & set(accepted))) if rule.ports else accepted
    if not ports:
        wanted = ", ".join(str(p) for p in rule.ports)
        raise OrchardError(
            Reason.FAILED_PRECONDITION,
            f"{where}: sandbox {target_id!r} accepts connections on "
            + (f"ports {', '.join(str(p) for p in accepted)}" if accepted else "no port")
            + f", none of {wanted or 'them'}"
            + ("" if accepted else " (its policy has no ingress_ports)"),
            metadata={"sandbox_id": target_id},
        )
    return replace(rule, destination=target.sandbox.network_address, ports=ports, peer=target.id)
