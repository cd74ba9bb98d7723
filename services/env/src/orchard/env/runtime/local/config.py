"""Configuration of the ``local`` runtime: where it keeps things and what a sandbox gets."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "BUNDLE_ENV",
    "LocalNetwork",
    "LocalResources",
    "LocalRuntimeConfig",
    "default_agent_bundle",
]

BUNDLE_ENV = "ORCHARD_INAGENT_BUNDLE"
"""Environment variable naming the agent bundle directory when the config does not."""

_BUNDLE_IN_REPO = Path("services/inagent/dist/orchard-inagent")


def default_agent_bundle() -> str:
    """The bundle directory: ``$ORCHARD_INAGENT_BUNDLE``, else the repository's build output."""
    from_env = os.environ.get(BUNDLE_ENV)
    if from_env:
        return from_env
    for parent in Path(__file__).resolve().parents:
        if (parent / "services" / "inagent").is_dir():
            return str(parent / _BUNDLE_IN_REPO)
    return str(Path.cwd() / _BUNDLE_IN_REPO)


class LocalResources(BaseModel):
    """Limits a sandbox gets when its request leaves one at zero."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_millis: int = Field(
        default=2000,
        ge=0,
        description="CPU time per second, in thousandths of a CPU; 0: unlimited.",
    )
    memory_bytes: int = Field(
        default=2 << 30,
        ge=0,
        description="Memory limit (the OOM killer acts above it); 0: unlimited.",
    )
    pids: int = Field(
        default=1024,
        ge=0,
        description="Most tasks (processes and threads), the agent included; 0: unlimited.",
    )
    disk_bytes: int = Field(
        default=0,
        ge=0,
        description="Size of the sandbox's writable layer (a loop-mounted ext4 file system of "
        "its own, sparse: it takes host space only as written); writes past it fail with "
        "ENOSPC. 0: unlimited (the layer shares the workspace's file system).",
    )


class LocalNetwork(BaseModel):
    """How sandboxes with egress rules reach their allowed destinations (see ``network.py``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(
        default="10.213.0.0/16",
        description="IPv4 block the sandbox links are cut from, a /31 each (host end, sandbox "
        "end): a /16 holds 32,768 sandboxes with egress. Must not overlap a network the host "
        "routes to (destinations inside it are unreachable).",
    )
    nft_table: str = Field(
        default="orchard",
        pattern=r"^[A-Za-z][A-Za-z0-9_]{0,31}$",
        description="The nftables table (family inet) this runtime owns: one chain and one set "
        "per sandbox with egress. Nothing else on the host is touched.",
    )
    claims_dir: str = Field(
        default="/run/orchard/network",
        description="Host-wide folder where every runtime of this host using the same table "
        "claims its sandboxes' addresses (``<claims_dir>/<table>/slot-<n>`` -> the claiming "
        "runtime's record), so two orchard-env processes on one host never hand out the same "
        "link, nor take the other's sandboxes for leftovers. Under /run: claims end with the "
        "links, at reboot.",
    )
    host_forwarding: bool = Field(
        default=True,
        description="Turn on IPv4 forwarding for the whole host (net.ipv4.ip_forward) when the "
        "first sandbox gets a link, so that destinations beyond this host answer. False: only "
        "the sandbox links forward; enable it on the uplink yourself.",
    )

    @field_validator("pool")
    @classmethod
    def _ipv4_block(cls, pool: str) -> str:
        network = ipaddress.ip_network(pool, strict=True)
        if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 30:
            raise ValueError(f"{pool}: needs an IPv4 block of at least two /31 links")
        return pool


class LocalRuntimeConfig(BaseModel):
    """The ``local`` runtime: sandboxes as namespaced process trees on this host (needs root)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["local"] = Field("local", description="Selects this runtime.")
    state_dir: str = Field(
        "/var/lib/orchard/env/local/state",
        description="One small JSON file per sandbox (pid, start time, cgroups): what lets a "
        "restarted service adopt running sandboxes and find leftovers.",
    )
    workspace_dir: str = Field(
        "/var/lib/orchard/env/local/sandboxes",
        description="Per-sandbox writable layer (overlay upper and work directories) and the "
        "agent's log. Must be a file system overlayfs accepts as upper (ext4, xfs, tmpfs).",
    )
    image_cache_dir: str = Field(
        "/var/lib/orchard/env/local/images",
        description="Unpacked oci-archive and docker-archive images, one read-only directory "
        "per image config digest, unpacked on first use and kept.",
    )
    run_dir: str = Field(
        "/run/orchard-env",
        description="Per-sandbox directory holding the agent's socket, bound into the "
        "sandbox. Keep it short: the socket path must fit in 107 bytes.",
    )
    cgroup_parent: str = Field(
        "orchard",
        description="Cgroup under which each sandbox gets one named after its id. Relative: "
        "below the service's own cgroup (in each v1 hierarchy, or in the v2 tree); absolute: "
        "from the hierarchy's root.",
    )
    cgroup_version: Literal["auto", "v1", "v2"] = Field(
        "auto",
        description="auto: v2 where the host delegates cpu, memory and pids to it, else v1.",
    )
    agent_bundle: str = Field(
        default_factory=default_agent_bundle,
        description="Directory of the self-contained orchard-inagent bundle (`make "
        f"inagent-binary`), bound read-only into every sandbox. Default: ${BUNDLE_ENV}, else "
        "the repository's services/inagent/dist/orchard-inagent.",
    )
    start_timeout_s: float = Field(
        30.0, gt=0, description="How long create() waits for the agent to serve."
    )
    python: str = Field(
        "",
        description="Interpreter that runs the in-sandbox setup before the agent (standard "
        "library only). Empty: the service's own interpreter.",
    )
    agent_launch: Literal["exec", "zygote"] = Field(
        "zygote",
        description="How each sandbox's agent starts. zygote (default): forked from one "
        "pre-loaded agent run by `python` (about 0.05 s CPU and 8 MB per sandbox); "
        "orchard-inagent must be importable there. exec: the bundle's executable, the same "
        "bytes the kubernetes runtime copies in (about 0.35 s CPU and 20 MB per sandbox).",
    )
    pool_size: int = Field(
        4,
        ge=0,
        le=1024,
        description="Sandboxes built ahead, up to the claim (namespaces, cgroup, the root of the "
        "image the latest create used), so that a create of that image only hands over its "
        "request and starts the agent. Refilled in the background after each create; released "
        "at close. Creates of other images, with a disk limit, and forks start afresh. 0: off.",
    )
    fork_snapshot_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Forks made at once from one source share one copy of its writable layer: "
        "a read-only snapshot in memory (a tmpfs under state_dir/snapshots) that each mounts "
        "below its own empty upper layer, instead of a copy per fork. This bounds the memory "
        "all snapshots together may hold (the service's; each goes with the last sandbox using "
        "it); a fork whose snapshot would not fit, or with a disk limit, copies the layer into "
        "its own upper layer on disk, as with 0.",
    )
    pool_image: str = Field(
        "",
        description="The image pooled sandboxes are built for, from start (start returns with "
        "one ready), instead of the image of the latest create; an image reference as in a "
        "request (e.g. host, rootfs:/dir), resolved as the operator's.",
    )
    default_resources: LocalResources = Field(
        default=LocalResources(),
        description="Limits for requests that leave a value at zero.",
    )
    network: LocalNetwork = Field(
        default=LocalNetwork(),
        description="Links, addresses and nftables rules of sandboxes with egress rules.",
    )
