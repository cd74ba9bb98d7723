"""The process group DeepSpeed trains in, started without a launcher.

DeepSpeed's launcher (`deepspeed train.py`) sets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`MASTER_ADDR` and `MASTER_PORT`; without them `deepspeed.init_distributed` looks for MPI. The
trainer runs as a plain process (a service, a command, a test), so it sets them itself: one
process is rank 0 of a world of 1 on 127.0.0.1; several processes started together pass the
same `master_port` and their own rank.

On a machine without CUDA, `DS_ACCELERATOR=cpu` selects DeepSpeed's CPU accelerator and the
process group uses gloo. Both must be set before `deepspeed` is first imported, so every module
of the trainer imports it through `import_deepspeed()`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = ["ProcessGroupSpec", "free_port", "import_deepspeed", "init_process_group"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel reports free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def import_deepspeed() -> ModuleType:
    """`deepspeed`, with the CPU accelerator selected when CUDA is absent."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's op builders probe for a compiler at import; nothing here builds ops.
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed  # noqa: PLC0415

    module: ModuleType = deepspeed
    return module


@dataclass(frozen=True, slots=True)
class ProcessGroupSpec:
    """Where this process sits in the training world."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """None picks a free port (a world of one only)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if self.world_size > 1 and self.master_port is None:
            raise ValueError("a world of several processes needs one agreed master_port")


def init_process_group(spec: ProcessGroupSpec | None = None) -> None:
    """Join (or create) the default process group; a no-op once it exists.

    Without `spec`, the launcher variables already in the environment win, and a process
    started on its own becomes rank 0 of 1.
    """
    deepspeed = import_deepspeed()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if spec is not None:
        port = spec.master_port if spec.master_port is not None else free_port()
        os.environ.update(
            RANK=str(spec.rank),
            LOCAL_RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(port),
        )
    else:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # DeepSpeed would JIT-compile its shared-memory all-reduce here (50-95 s on first use);
        # gloo carries the all-reduce instead. Its op table is read once and kept for edits.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if os.environ["WORLD_SIZE"] == "1":
        # A world of one needs no rendezvous: an in-memory store instead of a TCP one on a
        # port another process may take between `free_port` and the listen.
        torch.distributed.init_process_group(
            backend,
            store=torch.distributed.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
        )
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
