"""Claw tasks as a rollout job carries them (`orchard.tasks.spec.TaskSpec`).

Each spec runs on the ``host`` image: the tools archive (and, for MCP harnesses, the MCP
dependencies, and the MCP server declared in the spec) unpacked at ``/opt/claw`` from the
artifact store, a setup that lays the seed
state out at ``/srv/claw`` and links the tools into ``/usr/local/bin``, and ScoreTask with the
task's id as the check: the reward service regenerates the checks from the id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from orchard.tasks.claw.bundle import (
    MCP_COMMAND,
    TOOLS_DIR,
    link_command,
    mcp_archive,
    seed_command,
)
from orchard.tasks.claw.bundle import tools_archive as _tools_archive
from orchard.tasks.claw.suite import DEFAULT_COUNT, ClawTask, Split, generate_suite, split_suite
from orchard.tasks.spec import McpServer, ServiceTaskCheck, TaskFile, TaskSpec

__all__ = ["MCP_SERVER", "ArtifactWriter", "publish_archives", "suite_specs", "task_spec"]

MCP_SERVER = McpServer("claw", (MCP_COMMAND,))
"""The Claw tools as one MCP server over stdio (`claw-mcp`, every app); agent programs with MCP
support are configured to start it, and see its tools beside their shell."""


class ArtifactWriter(Protocol):
    """What publishing needs of an artifact store (`orchard.core.artifacts.ArtifactStore`)."""

    def url(self, *names: str) -> str: ...

    def exists(self, url: str) -> bool: ...

    def write_bytes(self, url: str, data: bytes) -> str: ...


def _publish(store: ArtifactWriter, stem: str, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()[:24]
    url = store.url("tasks", f"{stem}-{digest}.tar.gz")
    if not store.exists(url):
        url = store.write_bytes(url, data)
    return url


def publish_archives(store: ArtifactWriter, *, mcp: bool = False) -> tuple[TaskFile, ...]:
    """The tools archive (and with ``mcp`` the MCP dependencies) in ``store``, named by their
    content so a second call reuses them; as the files of a task."""
    files = [TaskFile(_publish(store, "claw-tools", _tools_archive()), TOOLS_DIR)]
    if mcp:
        files.append(TaskFile(_publish(store, "claw-mcp-site", mcp_archive()), TOOLS_DIR))
    return tuple(files)


def task_spec(
    task: ClawTask, files: Sequence[TaskFile], *, memory: str = "", mcp: bool = False
) -> TaskSpec:
    """What the rollout runner drives for ``task``; ``files`` from :func:`publish_archives`
    (with ``mcp=True`` for an ``mcp`` spec, which declares `MCP_SERVER`)."""
    return TaskSpec(
        id=task.id,
        instruction=task.instruction,
        check=ServiceTaskCheck(task.id),
        image="host",
        setup=(seed_command(task.world.archive()), link_command()),
        files=tuple(files),
        memory=memory,
        mcp_servers=(MCP_SERVER,) if mcp else (),
    )


def suite_specs(
    split: Split,
    files: Sequence[TaskFile],
    *,
    count: int = DEFAULT_COUNT,
    seed: int = 0,
    fractions: dict[Split, float] | None = None,
    memory: str = "",
    mcp: bool = False,
) -> list[TaskSpec]:
    """The specs of one split (``sft``, ``rl`` or ``evaluate``) of the suite (count, seed)."""
    if split not in ("sft", "rl", "evaluate"):
        raise ValueError(f"split must be sft, rl or evaluate, got {split!r}")
    chosen = split_suite(generate_suite(count, seed), fractions, seed=seed)[split]
    return [task_spec(task, files, memory=memory, mcp=mcp) for task in chosen]
