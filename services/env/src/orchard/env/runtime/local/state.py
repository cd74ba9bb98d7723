"""Per-sandbox state on disk: what a restarted service needs to adopt or clean up a sandbox.

One JSON file per sandbox, ``<state_dir>/<id>.json``, written before anything else of the
sandbox exists and removed last by delete, so a crash at any point leaves a record that
:meth:`LocalRuntime.list_sandboxes` finds.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["SandboxPaths", "SandboxState", "StateStore"]

_SUFFIX = ".json"


@dataclass(frozen=True)
class SandboxPaths:
    """Host paths of one sandbox's directories."""

    workspace: str  # holds upper/, work/ (in layer/ with a disk limit), root/ and agent.log
    run: str  # holds the agent's socket; never visible inside the sandbox

    disk_bytes: int = 0  # > 0: upper/ and work/ are on a file system of this size (disk.py)

    @property
    def layer(self) -> str:
        """The directory holding upper/ and work/: a mount point when the disk is limited."""
        return f"{self.workspace}/layer" if self.disk_bytes else self.workspace

    @property
    def disk_image(self) -> str:
        """The image file of the limited layer's file system."""
        return f"{self.workspace}/layer.img"

    @property
    def upper(self) -> str:
        return f"{self.layer}/upper"

    @property
    def work(self) -> str:
        return f"{self.layer}/work"

    @property
    def root(self) -> str:
        return f"{self.workspace}/root"

    @property
    def log(self) -> str:
        return f"{self.workspace}/agent.log"


@dataclass(frozen=True)
class SandboxState:
    """What the runtime recorded of one sandbox."""

    sandbox_id: str
    image: str
    paths: SandboxPaths
    cgroup_dirs: tuple[str, ...] = ()
    pid: int = 0  # host pid of the sandbox's PID 1 (the agent); 0 before it exists
    start_time: int = 0  # its start time (clock ticks after boot): guards against pid reuse
    memory_limit_bytes: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    snapshot_layers: tuple[str, ...] = ()
    """Read-only layers between the image and the upper layer, topmost first: the frozen
    copies of the sources a fork descends from (see ``LocalRuntime.fork``)."""

    def with_process(self, pid: int, start_time: int) -> SandboxState:
        return replace(self, pid=pid, start_time=start_time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SandboxState:
        data = json.loads(text)
        data["paths"] = SandboxPaths(**data["paths"])
        data["cgroup_dirs"] = tuple(data["cgroup_dirs"])
        data["snapshot_layers"] = tuple(data.get("snapshot_layers", ()))
        return cls(**data)


class StateStore:
    """The directory of state files."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}{_SUFFIX}"

    def write(self, state: SandboxState) -> None:
        """Atomically (a temporary sibling, renamed)."""
        target = self.path(state.sandbox_id)
        temp = target.with_name(f".{target.name}.tmp")
        temp.write_text(state.to_json(), encoding="utf-8")
        os.replace(temp, target)

    def read(self, sandbox_id: str) -> SandboxState | None:
        try:
            return SandboxState.from_json(self.path(sandbox_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError):
            return None  # a torn or foreign file: the id is still listed, delete() removes it

    def remove(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(sandbox_id).unlink()

    def all(self) -> list[SandboxState]:
        """Every readable state."""
        return [state for state in map(self.read, self.ids()) if state is not None]

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [n[: -len(_SUFFIX)] for n in names if n.endswith(_SUFFIX) and not n.startswith(".")]
