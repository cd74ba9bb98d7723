"""A job's worker group as Ray actors in a placement group, for jobs larger than one machine.

`RayWorkerGroup` is `workers.WorkerGroup` with Ray in place of local processes: one actor per
rank (`RankActor`, holding a `rank.RankTrainer`), each in its bundle of one placement group
(``PACK``: on as few nodes as the bundles fit), rank 0's node address and a free port of it as
the torch.distributed rendezvous. Commands, answers and faults are the same: a rank whose
actor dies (its process killed, its node gone) raises `RankLost` and stops the group.

`RayRuntime` connects the service to Ray once: a cluster address, or a local Ray bound to
127.0.0.1 in a head process it starts and ends with the service (`orchard.trainer.ray_head`;
ending whatever processes that Ray started).
The ranks read and write the paths the controller names (scratch folder, model folder), so on
a cluster those must be on a volume every node mounts.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from orchard.core import local_ray
from orchard.core.local_ray import RAY_LOCAL_ENV, alive, descendants, end_processes
from orchard.trainer.distributed import free_port
from orchard.trainer.rank import RankFault, RankReady, RankSetup, RankTrainer
from orchard.trainer.workers import RankError, RankLost, WorkerGroupConfig

__all__ = ["RAY_LOCAL_ENV", "RankActor", "RayPlacement", "RayRuntime", "RayWorkerGroup"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RayPlacement:
    """What each rank asks Ray for."""

    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    local: bool = True
    """The Ray of this machine (ranks are local processes, watched by pid)."""


def import_ray(*, local: bool) -> Any:
    """Ray, set up for a local Ray when ``local`` (see `orchard.core.local_ray`)."""
    return local_ray.import_ray(local=local, extra="orchard-trainer[ray]")


class RayRuntime:
    """The service's connection to Ray, made on first use; `close` ends a local Ray.

    A local Ray runs in a head process of its own (`orchard.trainer.ray_head`), started by
    this runtime and ended with it, with every process under it."""

    def __init__(self, address: str | None, init_cpus: int | None = None) -> None:
        self.address = address
        self.init_cpus = init_cpus
        self._lock = threading.Lock()
        self._head: subprocess.Popen[str] | None = None
        self._connected = False

    def ensure(self, timeout_s: float = 120.0) -> Any:
        """Ray, connected (blocking: call off the event loop)."""
        with self._lock:
            ray = import_ray(local=self.address is None)
            if ray.is_initialized():
                return ray
            address = self.address
            if address is None:
                address = self._start_head(timeout_s)
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            self._connected = True
            return ray

    def _start_head(self, timeout_s: float) -> str:
        command = [sys.executable, "-m", "orchard.trainer.ray_head"]
        if self.init_cpus is not None:
            command += ["--num-cpus", str(self.init_cpus)]
        head = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **RAY_LOCAL_ENV},
            start_new_session=True,
        )
        self._head = head
        assert head.stdout is not None
        ready, _, _ = select.select([head.stdout], [], [], timeout_s)
        line = head.stdout.readline() if ready else ""
        if not line:
            self._end_head()
            raise RankLost(
                f"the local Ray did not start within {timeout_s:g} s (its head process "
                f"{_describe(head)}); see the service's log"
            )
        return str(json.loads(line)["address"])

    def close(self) -> None:
        """Disconnect; a local Ray this runtime started is shut down and its processes end."""
        with self._lock:
            if self._connected:
                self._connected = False
                import_ray(local=self.address is None).shutdown()
            self._end_head()

    def _end_head(self) -> None:
        head, self._head = self._head, None
        if head is None:
            return
        started = descendants(head.pid)  # before it exits and they lose their parent
        if head.stdin is not None:
            with contextlib.suppress(OSError):
                head.stdin.close()
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        if head.stdout is not None:
            head.stdout.close()
        end_processes(started)


def _describe(process: subprocess.Popen[str]) -> str:
    code = process.poll()
    return "is still starting" if code is None else f"exited with status {code}"


class RankActor:
    """The body of one rank's Ray actor (made remote by `RayWorkerGroup`)."""

    def __init__(self) -> None:
        self._trainer: RankTrainer | None = None

    def rendezvous(self) -> tuple[str, int, int]:
        """This node's address, a free port on it, and this process's id."""
        ray = importlib.import_module("ray")
        address = str(ray.util.get_node_ip_address())
        return address, free_port(address), os.getpid()

    def start(self, setup: RankSetup) -> tuple[str, Any]:
        try:
            self._trainer = RankTrainer(setup)
        except Exception as exc:
            return "error", RankFault.of(exc)
        return "ok", self._trainer.ready()

    def run(self, command: str, arguments: dict[str, Any]) -> tuple[str, Any]:
        if self._trainer is None:
            return "error", RankFault("other", "the rank has not started")
        try:
            return "ok", getattr(self._trainer, command)(**arguments)
        except Exception as exc:
            return "error", RankFault.of(exc)

    def close(self) -> None:
        import torch  # noqa: PLC0415

        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RayWorkerGroup:
    """The ranks of one job as Ray actors (see the module docstring)."""

    def __init__(
        self, name: str, config: WorkerGroupConfig, placement: RayPlacement, ray: Any
    ) -> None:
        self.name = name
        self.config = config
        self.placement = placement
        self._ray = ray
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._group: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self.lost: str | None = None

    @classmethod
    def start(
        cls,
        name: str,
        setup: RankSetup,
        config: WorkerGroupConfig,
        placement: RayPlacement,
        runtime: RayRuntime,
    ) -> tuple[RayWorkerGroup, RankReady]:
        ray = runtime.ensure()
        from ray.util.placement_group import placement_group  # noqa: PLC0415
        from ray.util.scheduling_strategies import (  # noqa: PLC0415
            PlacementGroupSchedulingStrategy,
        )

        group = cls(name, config, placement, ray)
        world = config.ranks
        bundle: dict[str, float] = {"CPU": placement.cpus_per_rank}
        if placement.gpus_per_rank:
            bundle["GPU"] = placement.gpus_per_rank
        try:
            group._group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            ready, _ = ray.wait([group._group.ready()], timeout=config.start_timeout_s)
            if not ready:
                cpus = ray.cluster_resources().get("CPU", 0)
                raise RankLost(
                    f"Ray could not place {world} rank(s) of {bundle} within "
                    f"{config.start_timeout_s:g} s; the cluster offers {cpus:g} CPUs "
                    "(workers.ranks, workers.ray.cpus_per_rank)"
                )
            remote = ray.remote(max_restarts=0, max_task_retries=0)(RankActor)
            for index in range(world):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=group._group, placement_group_bundle_index=index
                )
                group._actors.append(
                    remote.options(
                        num_cpus=placement.cpus_per_rank,
                        num_gpus=placement.gpus_per_rank,
                        scheduling_strategy=strategy,
                    ).remote()
                )
            found = group._gather([a.rendezvous.remote() for a in group._actors], "start", True)
            address, port, _ = found[0]
            group._pids = [pid for _, _, pid in found]
            threads = config.threads_per_rank or max(1, int(placement.cpus_per_rank))
            starts = [
                actor.start.remote(
                    replace(
                        setup,
                        rank=index,
                        world_size=world,
                        master_addr=address,
                        master_port=port,
                        threads=threads,
                    )
                )
                for index, actor in enumerate(group._actors)
            ]
            first: RankReady = group._gather(starts, "start")[0]
        except BaseException:
            group.close()
            raise
        log.info("Ray worker group started", extra={"group": name, "pids": group._pids})
        return group, first

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    @property
    def size(self) -> int:
        return len(self._actors)

    def call(self, command: str, **arguments: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RankLost(self.lost or f"the worker group of {self.name} is closed")
            refs = [actor.run.remote(command, arguments) for actor in self._actors]
            return self._gather(refs, command)[0]

    def exited(self) -> list[int]:
        """pidfds of the ranks on a local Ray; none on a cluster (a call notices there)."""
        return [os.pidfd_open(pid) for pid in self._pids] if self.placement.local else []

    def check(self) -> str | None:
        if self._closed:
            return self.lost
        for rank, pid in enumerate(self._pids):
            if self.placement.local and not alive(pid):
                with self._lock:
                    if not self._closed:
                        self._lose(rank, "was killed or exited while idle", raise_=False)
                return self.lost
        return None

    def close(self) -> None:
        if self._closed and self._group is None:
            return
        self._closed = True
        ray = self._ray
        if self._actors:
            closing = [actor.close.remote() for actor in self._actors]
            with contextlib.suppress(Exception):
                ray.wait(closing, num_returns=len(closing), timeout=self.config.stop_timeout_s)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None
        end_processes(set(self._pids) if self.placement.local else set())

    def _gather(self, refs: list[Any], doing: str, raw: bool = False) -> list[Any]:
        ray = self._ray
        errors = ray.exceptions.RayActorError
        index = {ref: k for k, ref in enumerate(refs)}
        answers: dict[int, Any] = {}
        fault: RankError | None = None
        deadline = None if doing != "start" else time.monotonic() + self.config.start_timeout_s
        pending = list(refs)
        while pending:
            if fault is not None:
                grace = time.monotonic() + self.config.fault_grace_s
                deadline = grace if deadline is None else min(deadline, grace)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = index[pending[0]]
                self._lose(late, f"stopped answering in {doing!r}")
            for ref in ready:
                rank = index[ref]
                try:
                    value = ray.get(ref)
                except errors as exc:
                    detail = str(exc).strip().splitlines()[0][:300] if str(exc) else "no detail"
                    self._lose(rank, f"died in {doing!r} ({detail})")
                if raw:
                    answers[rank] = value
                    continue
                status, payload = value
                answers[rank] = payload
                if status == "error" and fault is None:
                    fault = RankError(rank, payload)
        if fault is not None:
            raise fault
        return [answers[k] for k in range(len(refs))]

    def _lose(self, rank: int, how: str, *, raise_: bool = True) -> None:
        pid = f"pid {self._pids[rank]}" if rank < len(self._pids) else "not started"
        self.lost = (
            f"rank {rank} of {len(self._actors)} (Ray actor, {pid}) {how}; the job's other "
            "ranks were stopped"
        )
        log.error("worker group %s lost: %s", self.name, self.lost)
        self.close()
        if raise_:
            raise RankLost(self.lost)
