"""The nftables ruleset of sandbox egress, as ``nft -f`` scripts, and running them.

One table (family ``inet``, so IPv6 meets the same drops) that this runtime owns whole::

    set sandbox_links     host ends of sandbox links (veth names)
    map from_sandbox      host end -> jump to that sandbox's chain
    chain forward/input   (base) from a sandbox: its chain; into a sandbox from elsewhere:
                          replies only
    chain output          (base) the host opens nothing into a sandbox: replies only
    chain postrouting     (base, nat) what leaves a sandbox for elsewhere is masqueraded
    chain sandbox-<id>    its own address only; to another sandbox: replies to what that one
                          opened, or a peer allowance; then one accept per rule, then drop
    set peers-<id>        its peer allowances: (peer's link . address . protocol . port),
                          each with the rule's expiry as an element timeout
    set allow-<id>-<n>    rule n's (address . protocol . port) elements, each with the
                          rule's expiry as an element timeout: the kernel ends it on time

Every packet a sandbox sends passes its chain (no "established: accept" on the way out), so a
replaced or expired allowance also stops connections already open. Each rule has its own set
because a set with interval elements refuses overlapping ones, and two rules may overlap.

One sandbox reaches another only through a peer allowance, which names the other's link as
well as its address: an address rule (even 0.0.0.0/0) allows nothing into a sandbox, and an
allowance outliving its peer cannot reach a later sandbox given the same address, since link
names come from sandbox ids. Which peers accept which ports the service checks before it
writes the allowance.

Every script is one transaction: it applies whole or not at all.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Allowance",
    "NftError",
    "PeerAllowance",
    "chain_name",
    "count_sandbox_sets",
    "list_sandbox_chains",
    "remove_sandbox",
    "replace_sandbox",
    "run_nft",
    "skeleton",
    "table_exists",
]

CHAIN_PREFIX = "sandbox-"
_SET_TYPE = "ipv4_addr . inet_proto . inet_service"
_PEER_SET_TYPE = "ifname . ipv4_addr . inet_proto . inet_service"


class NftError(Exception):
    """``nft`` refused a script or is missing; the message carries its stderr."""


@dataclass(frozen=True)
class Allowance:
    """One rule, resolved: addresses, protocols and port ranges it allows until its timeout."""

    networks: tuple[ipaddress.IPv4Network, ...]
    protocols: tuple[str, ...]  # "tcp", "udp"
    port_ranges: tuple[tuple[int, int], ...]  # disjoint, inclusive; (0, 65535) for every port
    timeout_ms: int | None = None  # None: as long as the sandbox

    def elements(self) -> str:
        timeout = f" timeout {self.timeout_ms}ms" if self.timeout_ms is not None else ""
        return ", ".join(
            f"{network} . {protocol} . {_ports(low, high)}{timeout}"
            for network in self.networks
            for protocol in self.protocols
            for low, high in self.port_ranges
        )


@dataclass(frozen=True)
class PeerAllowance:
    """One peer rule, resolved: the other sandbox's link and address, protocols and ports."""

    link: str
    address: ipaddress.IPv4Address
    protocols: tuple[str, ...]
    ports: tuple[int, ...]  # never empty: the ports the peer accepts on
    timeout_ms: int | None = None

    def elements(self) -> str:
        timeout = f" timeout {self.timeout_ms}ms" if self.timeout_ms is not None else ""
        return ", ".join(
            f'"{self.link}" . {self.address} . {protocol} . {port}{timeout}'
            for protocol in self.protocols
            for port in self.ports
        )


def _ports(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def merge_ports(ports: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Disjoint inclusive ranges covering ``ports``; every port when there are none."""
    values = sorted(set(ports))
    if not values:
        return ((0, 65535),)
    ranges: list[list[int]] = []
    for port in values:
        if ranges and port == ranges[-1][1] + 1:
            ranges[-1][1] = port
        else:
            ranges.append([port, port])
    return tuple((low, high) for low, high in ranges)


def chain_name(sandbox_id: str) -> str:
    return f"{CHAIN_PREFIX}{sandbox_id}"


def _set_name(sandbox_id: str, index: int) -> str:
    return f"allow-{sandbox_id}-{index}"


def _peer_set_name(sandbox_id: str) -> str:
    return f"peers-{sandbox_id}"


def skeleton(table: str) -> str:
    """The table and its base chains; idempotent (the base chains are flushed and refilled)."""
    t = f"inet {table}"
    return "\n".join(
        [
            f"add table {t}",
            f"add set {t} sandbox_links {{ type ifname; }}",
            f"add map {t} from_sandbox {{ type ifname : verdict; }}",
            f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
            f"add chain {t} input {{ type filter hook input priority filter; policy accept; }}",
            f"add chain {t} output {{ type filter hook output priority filter; policy accept; }}",
            f"add chain {t} postrouting "
            "{ type nat hook postrouting priority srcnat; policy accept; }",
            *(f"flush chain {t} {name}" for name in ("forward", "input", "output", "postrouting")),
            # From a sandbox, even an established connection passes its chain (expiry holds).
            f"add rule {t} forward oifname @sandbox_links iifname != @sandbox_links "
            "ct state established,related accept",
            f"add rule {t} forward iifname vmap @from_sandbox",
            f"add rule {t} forward oifname @sandbox_links drop",
            f"add rule {t} input iifname vmap @from_sandbox",
            f"add rule {t} output oifname @sandbox_links ct state established,related accept",
            f"add rule {t} output oifname @sandbox_links drop",
            f"add rule {t} postrouting iifname @sandbox_links oifname != @sandbox_links masquerade",
        ]
    )


def replace_sandbox(
    table: str,
    sandbox_id: str,
    link: str,
    address: ipaddress.IPv4Address,
    allowances: Sequence[Allowance],
    *,
    old_sets: int,
    peers: Sequence[PeerAllowance] = (),
) -> str:
    """The sandbox's chain and sets, replacing whatever it had (``old_sets`` of them)."""
    t = f"inet {table}"
    chain = chain_name(sandbox_id)
    peer_set = _peer_set_name(sandbox_id)
    lines = [f"add chain {t} {chain}", f"flush chain {t} {chain}"]
    lines += _drop_sets(t, sandbox_id, range(len(allowances), old_sets))
    lines += [
        f"add set {t} {peer_set} {{ type {_PEER_SET_TYPE}; flags timeout; }}",
        f"flush set {t} {peer_set}",
        *(f"add element {t} {peer_set} {{ {peer.elements()} }}" for peer in peers),
        f"add rule {t} {chain} ip saddr != {address} drop",  # no spoofed sources
        # Answers to connections a peer opened into this sandbox.
        f"add rule {t} {chain} oifname @sandbox_links ct direction reply accept",
        f"add rule {t} {chain} oifname . ip daddr . meta l4proto . th dport @{peer_set} accept",
        f"add rule {t} {chain} oifname @sandbox_links drop",
    ]
    for index, allowance in enumerate(allowances):
        name = _set_name(sandbox_id, index)
        lines += [
            f"add set {t} {name} {{ type {_SET_TYPE}; flags interval, timeout; }}",
            f"flush set {t} {name}",
            f"add element {t} {name} {{ {allowance.elements()} }}",
            f"add rule {t} {chain} ip daddr . meta l4proto . th dport @{name} accept",
        ]
    lines += [
        f"add rule {t} {chain} drop",
        # Entries that exist already are kept as they are (`add` is not `create`).
        f'add element {t} from_sandbox {{ "{link}" : jump {chain} }}',
        f'add element {t} sandbox_links {{ "{link}" }}',
    ]
    return "\n".join(lines)


def remove_sandbox(table: str, sandbox_id: str, link: str, old_sets: int) -> str:
    """Everything of the sandbox in the table; also when some of it is gone already."""
    t = f"inet {table}"
    chain = chain_name(sandbox_id)
    # `add` first makes each `delete` valid whether or not the object existed.
    return "\n".join(
        [
            f"add chain {t} {chain}",
            f'add element {t} from_sandbox {{ "{link}" : jump {chain} }}',
            f'add element {t} sandbox_links {{ "{link}" }}',
            f'delete element {t} from_sandbox {{ "{link}" }}',
            f'delete element {t} sandbox_links {{ "{link}" }}',
            f"flush chain {t} {chain}",
            *_drop_sets(t, sandbox_id, range(old_sets)),
            f"add set {t} {_peer_set_name(sandbox_id)} {{ type {_PEER_SET_TYPE}; flags timeout; }}",
            f"delete set {t} {_peer_set_name(sandbox_id)}",
            f"delete chain {t} {chain}",
        ]
    )


def _drop_sets(t: str, sandbox_id: str, indexes: Iterable[int]) -> list[str]:
    lines = []
    for index in indexes:
        name = _set_name(sandbox_id, index)
        lines += [
            f"add set {t} {name} {{ type {_SET_TYPE}; flags interval, timeout; }}",
            f"delete set {t} {name}",
        ]
    return lines


def nft_binary() -> str:
    found = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")
    if found is None:
        raise NftError("`nft` is missing: install nftables (Debian: apt-get install nftables)")
    return found


async def run_nft(script: str) -> None:
    """Run ``script`` through ``nft -f -``: one transaction."""
    await _nft("-f", "-", stdin=script)


async def _nft(*args: str, stdin: str = "") -> str:
    process = await asyncio.create_subprocess_exec(
        nft_binary(),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate(stdin.encode())
    if process.returncode != 0:
        raise NftError(f"nft failed: {err.decode(errors='replace').strip()[-2000:]}")
    return out.decode()


async def table_exists(table: str) -> bool:
    try:
        text = await _nft("-j", "list", "tables", "inet")
    except NftError:
        return False
    items = json.loads(text or "{}").get("nftables", [])
    return any(item.get("table", {}).get("name") == table for item in items)


async def list_sandbox_chains(table: str) -> list[str]:
    """Ids of the sandboxes that have a chain in ``table``; none when there is no table."""
    text = await _nft("-j", "list", "chains", "inet")
    ids = []
    for item in json.loads(text or "{}").get("nftables", []):
        chain = item.get("chain")
        if chain and chain.get("table") == table and chain["name"].startswith(CHAIN_PREFIX):
            ids.append(chain["name"][len(CHAIN_PREFIX) :])
    return ids


async def count_sandbox_sets(table: str, sandbox_id: str) -> int:
    """How many allow sets (one past the highest index) ``table`` holds for the sandbox."""
    prefix = f"allow-{sandbox_id}-"
    text = await _nft("-j", "list", "sets", "inet")  # with elements: for rare repairs only
    count = 0
    for item in json.loads(text or "{}").get("nftables", []):
        found = item.get("set")
        if found and found.get("table") == table and found["name"].startswith(prefix):
            index = found["name"][len(prefix) :]
            if index.isdigit():
                count = max(count, int(index) + 1)
    return count
