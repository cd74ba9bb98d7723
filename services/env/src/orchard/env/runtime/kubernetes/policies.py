"""The per-sandbox NetworkPolicy: what a sandbox's egress rules allow, over the default deny.

The chart installs a namespace-wide policy that denies all egress of sandbox Pods (and ingress
except from the env service). A sandbox whose request allows destinations gets one more policy,
``<sandbox id>-egress``, selecting only its Pod: one egress rule per allowed destination (an
``ipBlock``; host names resolved to their IPv4 and IPv6 addresses when the policy is written, as
NetworkPolicy selects addresses, not names, plus DNS to the cluster's resolver so that the
sandbox can look the name up too). Rules past their expiry are left out; the runtime rewrites
the policy at the next expiry and deletes it when nothing is left. The rules as requested
travel in an annotation, so a restarted service can schedule the expiries again.

A rule naming another sandbox (``EgressRule.peer``) is an egress entry to that sandbox's Pod
(``podSelector`` on its id), plus a policy of its own on the other side, ``<id>-to-<peer>``,
that lets this sandbox's Pod in on those ports: the chart's default denies every ingress but
the env service's. That policy carries ``orchard.dev/peer-source: <id>`` (not the sandbox-id
label: it is not the sandbox's own policy), is owned by the peer's Pod (so it goes with it),
and is rewritten or deleted with the rule.
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
from orchard.env.runtime.kubernetes.pods import (
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX,
    MANAGED_BY,
    sandbox_labels,
)

__all__ = [
    "ANNOTATION_EGRESS",
    "LABEL_PEER_SOURCE",
    "live_rules",
    "next_expiry",
    "peer_policies",
    "peer_policy_name",
    "policy_manifest",
    "policy_name",
    "rules_from_policy",
]

ANNOTATION_EGRESS = "orchard.dev/egress"
LABEL_PEER_SOURCE = "orchard.dev/peer-source"
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
        entry: dict[str, Any]
        if rule.peer:
            entry = {"to": [{"podSelector": {"matchLabels": {LABEL_SANDBOX: rule.peer}}}]}
        else:
            cidrs, by_name = await _networks(sandbox_id, rule.destination)
            named = named or by_name
            entry = {"to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]}
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
            **({"peer": r.peer} if r.peer else {}),
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
                peer=str(item.get("peer") or ""),
            )
            for item in recorded
        ]
    except (ValueError, KeyError, TypeError):
        return []


def peer_policy_name(source_id: str, peer_id: str) -> str:
    return f"{source_id}-to-{peer_id}"


def peer_policies(
    config: KubernetesRuntimeConfig,
    source_id: str,
    egress: Sequence[EgressRule],
    peer_pods: Mapping[str, str],
    now: float | None = None,
) -> dict[str, dict[str, Any]]:
    """By name, the ingress policies that let ``source_id``'s Pod into the Pods its live peer
    rules name; ``peer_pods`` maps each peer to its Pod's uid (a peer without one is left out:
    its Pod is gone, and a policy it does not own would outlive it)."""
    ports: dict[str, set[tuple[str, int]]] = {}
    for rule in live_rules(egress, now):
        if rule.peer and peer_pods.get(rule.peer):
            protocols = [rule.protocol.upper()] if rule.protocol else ["TCP", "UDP"]
            wanted = ports.setdefault(rule.peer, set())
            wanted.update((protocol, port) for protocol in protocols for port in rule.ports)
    return {
        peer_policy_name(source_id, peer): {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": peer_policy_name(source_id, peer),
                "namespace": config.namespace,
                "labels": {
                    LABEL_MANAGED_BY: MANAGED_BY,
                    LABEL_DEPLOYMENT: config.deployment,
                    LABEL_PEER_SOURCE: source_id,
                },
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": peer, "uid": peer_pods[peer]}
                ],
            },
            "spec": {
                "podSelector": {"matchLabels": {LABEL_SANDBOX: peer}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {LABEL_SANDBOX: source_id}}}],
                        "ports": [
                            {"protocol": protocol, "port": port} for protocol, port in sorted(pairs)
                        ],
                    }
                ],
            },
        }
        for peer, pairs in sorted(ports.items())
    }
