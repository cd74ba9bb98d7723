"""The per-sandbox NetworkPolicy: what a sandbox's egress rules allow, over the default deny.

The chart installs a namespace-wide policy that denies all egress of sandbox Pods (and ingress
except from the env service). A sandbox whose request allows destinations gets one more policy,
``<sandbox id>-egress``, selecting only its Pod: one egress rule per allowed destination (an
``ipBlock``; host names resolved to their IPv4 and IPv6 addresses when the policy is written, as
NetworkPolicy selects addresses, not names, plus DNS to the cluster's resolver so that the
sandbox can look the name up too). Rules past their expiry are left out; the runtime rewrites
the policy at the next expiry and deletes it when nothing is left. The rules as requested
travel in an annotation, so a restarted service can schedule the expiries again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from orchard.env.runtime.base import EgressRule, FailureReason, RuntimeFailure
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.kubernetes.pods import LABEL_SANDBOX, sandbox_labels

__all__ = [
    "ANNOTATION_EGRESS",
    "live_rules",
    "next_expiry",
    "policy_manifest",
    "policy_name",
    "rules_from_policy",
]

ANNOTATION_EGRESS = "orchard.dev/egress"
_SUFFIX = "-egress"
_DNS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}


def policy_name(sandbox_id: str) -> str:
    return sandbox_id + _SUFFIX


def sandbox_of_policy(name: str) -> str | None:
    return name.removesuffix(_SUFFIX) if name.endswith(_SUFFIX) else None


def live_rules(egress: Sequence[EgressRule], now: float | None = None) -> list[EgressRule]:
    now = time.time() if now is None else now
    return [r for r in egress if r.expire_unix_s is None or r.expire_unix_s > now]


def next_expiry(egress: Sequence[EgressRule], now: float | None = None) -> float | None:
    """The earliest expiry still ahead, when the policy must be written again."""
    ahead = [r.expire_unix_s for r in live_rules(egress, now) if r.expire_unix_s is not None]
    return min(ahead) if ahead else None


async def _networks(sandbox_id: str, destination: str) -> tuple[list[str], bool]:
    """CIDRs of a destination and whether it was a name."""
    try:
        network = ipaddress.ip_network(destination, strict=False)
    except ValueError:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(destination, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise RuntimeFailure(
                FailureReason.INTERNAL,
                f"sandbox {sandbox_id}: cannot resolve {destination!r}: {exc}",
            ) from None
        addresses = sorted({ipaddress.ip_address(info[4][0]) for info in infos}, key=str)
        return [str(ipaddress.ip_network(a)) for a in addresses], True
    return [str(network)], False


async def policy_manifest(
    config: KubernetesRuntimeConfig,
    sandbox_id: str,
    egress: Sequence[EgressRule],
    now: float | None = None,
) -> dict[str, Any] | None:
    """The sandbox's allow policy, or None when no rule is live (then it has none)."""
    rules = live_rules(egress, now)
    if not rules:
        return None
    entries: list[dict[str, Any]] = []
    named = False
    for rule in rules:
        cidrs, by_name = await _networks(sandbox_id, rule.destination)
        named = named or by_name
        entry: dict[str, Any] = {"to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]}
        protocols = [rule.protocol.upper()] if rule.protocol else ["TCP", "UDP"]
        if rule.ports:
            entry["ports"] = [
                {"protocol": protocol, "port": port}
                for port in sorted(set(rule.ports))
                for protocol in protocols
            ]
        elif rule.protocol:
            entry["ports"] = [{"protocol": protocol} for protocol in protocols]
        entries.append(entry)
    if named:
        entries.append(
            {
                "to": [_DNS_PEER],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            }
        )
    recorded = [
        {
            "destination": r.destination,
            "ports": list(r.ports),
            "protocol": r.protocol,
            "expire_unix_s": r.expire_unix_s,
        }
        for r in egress
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(sandbox_id),
            "namespace": config.namespace,
            "labels": sandbox_labels(config, sandbox_id),
            "annotations": {ANNOTATION_EGRESS: json.dumps(recorded, sort_keys=True)},
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_SANDBOX: sandbox_id}},
            "policyTypes": ["Egress"],
            "egress": entries,
        },
    }


def rules_from_policy(policy: Mapping[str, Any]) -> list[EgressRule]:
    """The rules a policy was written for (its annotation); [] when unreadable."""
    annotations = (policy.get("metadata") or {}).get("annotations") or {}
    try:
        recorded = json.loads(annotations.get(ANNOTATION_EGRESS, "[]"))
        return [
            EgressRule(
                destination=str(item["destination"]),
                ports=tuple(int(p) for p in item.get("ports") or ()),
                protocol=str(item.get("protocol") or ""),
                expire_unix_s=item.get("expire_unix_s"),
            )
            for item in recorded
        ]
    except (ValueError, KeyError, TypeError):
        return []
