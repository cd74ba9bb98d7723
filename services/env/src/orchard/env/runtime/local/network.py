"""Sandbox networking: default deny, and links for sandboxes that may reach named destinations.

Every sandbox gets a new network namespace with only ``lo`` (brought up by
:mod:`~orchard.env.runtime.local.sandbox_init`): no route anywhere. That is all a sandbox without
egress rules ever has. The first time a sandbox has rules (at create or on an update), it gets a
link:

- a veth pair: the host end in the service's namespace, named ``orc`` + 12 hex digits of a hash of
  the table and the sandbox id (interface names hold 15 characters; its alias carries
  ``<table>/<sandbox id>`` in full), the other end ``eth0`` in the sandbox;
- a /31 from the configured pool (host end even, sandbox end odd), recorded in
  ``<state_dir>/network/<id>.json`` before anything else exists and claimed without collisions
  across processes, restarts and other runtimes of the host sharing the table by a symlink
  ``<claims_dir>/<table>/slot-<n>`` -> that record (a claim whose record is gone is stale and
  taken over); a runtime counts as its own only the chains and links no other runtime's live
  claim names;
- a default route in the sandbox via the host end; forwarding on the host end (and, if
  ``host_forwarding``, for the host);
- its nftables chain and sets (see :mod:`~orchard.env.runtime.local.nft`), written before the
  link exists so no packet ever passes unfiltered.

The sandbox cannot change any of this: it lacks CAP_NET_ADMIN (``sandbox_init`` drops it from the
bounding set). Host names are resolved (IPv4) when the rules are applied; later changes of their
addresses are not followed. Once a sandbox has a link it keeps it until deleted; an empty policy
then drops everything. IPv6 destinations are refused: sandbox links carry IPv4 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    RuntimeFailure,
    RuntimeNotSupported,
)
from orchard.env.runtime.local import nft
from orchard.env.runtime.local.config import LocalNetwork

__all__ = ["SandboxLink", "SandboxNetworks", "resolve_peers", "resolve_rules"]

log = logging.getLogger(__name__)

LINK_PREFIX = "orc"
SANDBOX_INTERFACE = "eth0"
_SYS_NET = Path("/sys/class/net")
_PROC_NET = Path("/proc/sys/net")


@dataclass(frozen=True)
class SandboxLink:
    """What ``<state_dir>/network/<id>.json`` records of one sandbox's link."""

    sandbox_id: str
    slot: int
    link: str  # host end
    host_address: str
    sandbox_address: str
    rule_sets: int = 0  # at least as many allow sets as the table holds for it


def link_name(table: str, sandbox_id: str) -> str:
    digest = hashlib.sha256(f"{table}/{sandbox_id}".encode()).hexdigest()
    return LINK_PREFIX + digest[:12]


def _timeout_ms(rule: EgressRule, now: float) -> int | None:
    """Milliseconds the rule has left; None when it never expires; <= 0 when it has."""
    if rule.expire_unix_s is None:
        return None
    return math.floor((rule.expire_unix_s - now) * 1000)


def resolve_peers(
    table: str, egress: Sequence[EgressRule], now: float | None = None
) -> list[nft.PeerAllowance]:
    """The rules that name another sandbox, as peer allowances; expired ones left out."""
    now = time.time() if now is None else now
    peers = []
    for rule in egress:
        timeout_ms = _timeout_ms(rule, now)
        if not rule.peer or (timeout_ms is not None and timeout_ms <= 0) or not rule.ports:
            continue
        peers.append(
            nft.PeerAllowance(
                link_name(table, rule.peer),
                ipaddress.IPv4Address(rule.destination),
                (rule.protocol,) if rule.protocol else ("tcp", "udp"),
                tuple(sorted(set(rule.ports))),
                timeout_ms,
            )
        )
    return peers


async def resolve_rules(
    sandbox_id: str, egress: Sequence[EgressRule], now: float | None = None
) -> list[nft.Allowance]:
    """Rules as nftables allowances: host names resolved, expired rules and peer rules (see
    `resolve_peers`) left out."""
    now = time.time() if now is None else now
    loop = asyncio.get_running_loop()
    allowances = []
    for rule in egress:
        if rule.peer:
            continue
        timeout_ms = _timeout_ms(rule, now)
        if timeout_ms is not None and timeout_ms <= 0:
            continue
        try:
            network = ipaddress.ip_network(rule.destination, strict=False)
        except ValueError:
            try:
                infos = await loop.getaddrinfo(
                    rule.destination, None, family=socket.AF_INET, type=socket.SOCK_STREAM
                )
            except OSError as exc:
                raise RuntimeFailure(
                    FailureReason.INTERNAL,
                    f"sandbox {sandbox_id}: cannot resolve {rule.destination!r}: {exc}",
                ) from None
            addresses = sorted({ipaddress.IPv4Address(info[4][0]) for info in infos})
            networks = tuple(ipaddress.IPv4Network(address) for address in addresses)
        else:
            if not isinstance(network, ipaddress.IPv4Network):
                raise RuntimeNotSupported(
                    f"sandbox {sandbox_id}: {rule.destination} is IPv6; the local runtime gives "
                    "sandboxes IPv4 only"
                )
            networks = (network,)
        protocols = (rule.protocol,) if rule.protocol else ("tcp", "udp")
        allowances.append(
            nft.Allowance(networks, protocols, nft.merge_ports(rule.ports), timeout_ms)
        )
    return allowances


class SandboxNetworks:
    """Links and rules of the sandboxes of one runtime (one nftables table, one state dir)."""

    def __init__(self, config: LocalNetwork, state_dir: str) -> None:
        self.config = config
        self.table = config.nft_table
        self.pool = ipaddress.IPv4Network(config.pool)
        self.directory = Path(state_dir).absolute() / "network"
        self.claims = Path(config.claims_dir) / self.table
        self._table_ready = False
        self._forwarding_checked = False
        self._listed_chains: set[str] = set()  # chains the last ids() saw

    # -- the interface the runtime uses ------------------------------------------------------

    def has_link(self, sandbox_id: str) -> bool:
        return self._record_path(sandbox_id).exists()

    async def apply(
        self, sandbox_id: str, pid: int, egress: Sequence[EgressRule], *, accepts: bool = False
    ) -> str:
        """Make the sandbox (PID 1 at host ``pid``) allowed ``egress`` and nothing else; one
        that ``accepts`` peers gets its link even without rules. Returns its address on its
        link, "" when it has none."""
        record = self._read(sandbox_id)
        if record is None and not egress and not accepts:
            return ""  # default deny: no link at all
        allowances = await resolve_rules(sandbox_id, egress)
        peers = resolve_peers(self.table, egress)
        if record is None:
            record = self._allocate(sandbox_id)
        if len(allowances) > record.rule_sets:
            record = replace(record, rule_sets=len(allowances))
            self._write(record)  # first: the file never undercounts the table's sets
        script = nft.replace_sandbox(
            self.table,
            sandbox_id,
            record.link,
            ipaddress.IPv4Address(record.sandbox_address),
            allowances,
            old_sets=record.rule_sets,
            peers=peers,
        )
        if not self._table_ready:
            script = f"{nft.skeleton(self.table)}\n{script}"
        await self._nft(script)
        self._table_ready = True
        if not (_SYS_NET / record.link).exists():
            await self._plumb(record, pid)
        if record.rule_sets != len(allowances):
            self._write(replace(record, rule_sets=len(allowances)))
        return record.sandbox_address

    async def remove(self, sandbox_id: str) -> None:
        """Release the sandbox's link, rules and address; idempotent."""
        record = self._read(sandbox_id)
        link = record.link if record else link_name(self.table, sandbox_id)
        if (_SYS_NET / link).exists():
            # Usually gone already: a veth dies with the sandbox's namespace.
            with contextlib.suppress(RuntimeFailure):
                await _run(_ip(), "link", "del", link)
        if record is None and sandbox_id not in self._listed_chains:
            return  # the common case: a sandbox that never had a link
        try:
            if record is not None:
                sets = record.rule_sets
            else:  # its record was lost: ask the table
                sets = await nft.count_sandbox_sets(self.table, sandbox_id)
            await self._nft(nft.remove_sandbox(self.table, sandbox_id, link, sets))
        except (RuntimeFailure, nft.NftError):
            if await nft.table_exists(self.table):
                raise
        self._listed_chains.discard(sandbox_id)
        claim = str(self._record_path(sandbox_id))
        slots = [self.claims / f"slot-{record.slot}"] if record else self._slots()
        for slot in slots:
            with contextlib.suppress(OSError):
                if os.readlink(slot) == claim:
                    slot.unlink()
        with contextlib.suppress(FileNotFoundError):
            self._record_path(sandbox_id).unlink()

    async def ids(self) -> set[str]:
        """Sandboxes with a record, a chain or a link of this runtime."""
        found = set()
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    found.add(entry.name[: -len(".json")])
        others = self._claimed_by_others()
        self._listed_chains = set(await self._chains()) - others
        found.update(self._listed_chains)
        marker = f"{self.table}/"
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(_SYS_NET):
                if entry.name.startswith(LINK_PREFIX):
                    with contextlib.suppress(OSError):
                        alias = (_SYS_NET / entry.name / "ifalias").read_text().strip()
                        if alias.startswith(marker) and alias[len(marker) :] not in others:
                            found.add(alias[len(marker) :])
        return found

    def _claimed_by_others(self) -> set[str]:
        """Sandboxes whose address another runtime of this host claims (its record exists)."""
        others = set()
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.claims):
                with contextlib.suppress(OSError):
                    target = Path(os.readlink(entry.path))
                    if target.parent != self.directory and target.exists():
                        others.add(target.name.removesuffix(".json"))
        return others

    async def close_table(self) -> None:
        """Delete the whole table (tests; a host that no longer runs this runtime)."""
        if await nft.table_exists(self.table):
            await self._nft(f"delete table inet {self.table}")
        self._table_ready = False
        with contextlib.suppress(OSError):
            self.claims.rmdir()  # only when no runtime claims anything in it

    # -- addresses ---------------------------------------------------------------------------

    def _record_path(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.json"

    def _read(self, sandbox_id: str) -> SandboxLink | None:
        try:
            return SandboxLink(**json.loads(self._record_path(sandbox_id).read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return None

    def _write(self, record: SandboxLink) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = self._record_path(record.sandbox_id)
        temp = target.with_name(f".{target.name}.tmp")
        temp.write_text(json.dumps(asdict(record), sort_keys=True))
        os.replace(temp, target)

    def _slots(self) -> list[Path]:
        """This runtime's claims."""
        own = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.claims):
                with contextlib.suppress(OSError):
                    if Path(os.readlink(entry.path)).parent == self.directory:
                        own.append(Path(entry.path))
        return own

    def _claim(self, slot: int, record_path: Path) -> bool:
        """Claim `slot` for the record at `record_path`; False when a live claim holds it."""
        if os.path.lexists(self.directory / f"slot-{slot}"):
            return False  # an older claim in the state dir: its sandbox keeps the address
        path = self.claims / f"slot-{slot}"
        for _ in range(2):
            try:
                os.symlink(record_path, path)
                return True
            except FileExistsError:
                try:
                    target = os.readlink(path)
                except OSError:
                    continue  # released meanwhile: try again
                if target == str(record_path):
                    return True
                if Path(target).exists():
                    return False
                # Stale: its record is gone (a runtime removed with its state). Take it over.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return False

    def _allocate(self, sandbox_id: str) -> SandboxLink:
        """Claim a free /31: start where the id hashes to, take the first free slot."""
        slots = self.pool.num_addresses // 2
        start = int(hashlib.sha256(sandbox_id.encode()).hexdigest(), 16) % slots
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.claims.mkdir(mode=0o700, parents=True, exist_ok=True)
        record_path = self._record_path(sandbox_id)
        for step in range(slots):
            slot = (start + step) % slots
            host = self.pool.network_address + 2 * slot
            record = SandboxLink(
                sandbox_id=sandbox_id,
                slot=slot,
                link=link_name(self.table, sandbox_id),
                host_address=str(host),
                sandbox_address=str(host + 1),
            )
            self._write(record)  # before the claim: a crash leaves a findable record
            if self._claim(slot, record_path):
                return record
        self._record_path(sandbox_id).unlink()
        raise RuntimeFailure(
            FailureReason.RESOURCES_UNAVAILABLE,
            f"no free address for sandbox {sandbox_id}: all {slots} links of {self.pool} are taken",
        )

    # -- the link ----------------------------------------------------------------------------

    async def _plumb(self, record: SandboxLink, pid: int) -> None:
        self._enable_host_forwarding()
        ip = _ip()
        await _run(
            ip,
            "-batch",
            "-",
            stdin=(
                f"link add {record.link} type veth peer name {SANDBOX_INTERFACE} netns {pid}\n"
                f"link set {record.link} alias {self.table}/{record.sandbox_id}\n"
                f"addr add {record.host_address}/31 dev {record.link}\n"
                f"link set {record.link} up\n"
            ),
        )
        _sysctl(f"ipv6/conf/{record.link}/disable_ipv6", "1")
        _sysctl(f"ipv4/conf/{record.link}/forwarding", "1")
        await _run(
            _nsenter(),
            f"--net=/proc/{pid}/ns/net",
            ip,
            "-batch",
            "-",
            stdin=(
                f"addr add {record.sandbox_address}/31 dev {SANDBOX_INTERFACE}\n"
                f"link set {SANDBOX_INTERFACE} up\n"
                f"route add default via {record.host_address} dev {SANDBOX_INTERFACE}\n"
            ),
        )

    def _enable_host_forwarding(self) -> None:
        if self._forwarding_checked or not self.config.host_forwarding:
            return
        path = _PROC_NET / "ipv4" / "ip_forward"
        if path.read_text().strip() != "1":
            log.info("turning on IPv4 forwarding (net.ipv4.ip_forward) for sandbox egress")
            path.write_text("1")
        self._forwarding_checked = True

    async def _chains(self) -> list[str]:
        try:
            return await nft.list_sandbox_chains(self.table)
        except nft.NftError:
            return []

    async def _nft(self, script: str) -> None:
        try:
            await nft.run_nft(script)
        except nft.NftError as exc:
            raise RuntimeFailure(FailureReason.INTERNAL, str(exc)) from None


def _sysctl(name: str, value: str) -> None:
    (_PROC_NET / name).write_text(value)


def _binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if found is None:
        raise RuntimeFailure(FailureReason.INTERNAL, f"`{name}` is missing (iproute2/util-linux)")
    return found


def _ip() -> str:
    return _binary("ip")


def _nsenter() -> str:
    return _binary("nsenter")


async def _run(*argv: str, stdin: str = "") -> None:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate(stdin.encode())
    if process.returncode != 0:
        raise RuntimeFailure(
            FailureReason.INTERNAL,
            f"{' '.join(argv[:3])} failed: {err.decode(errors='replace').strip()[-1000:]}",
        )
