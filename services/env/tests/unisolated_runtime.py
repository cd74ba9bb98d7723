"""``UnisolatedProcessRuntime``: a test double of :class:`orchard.env.runtime.base.Runtime`.

It provides NO isolation: each sandbox is the real ``orchard-inagent`` started as a plain
subprocess of the test (its own session, a working directory of its own, a Unix socket). It
exists to test the environment service's own logic (records, leases, waiting, reaping,
reconciliation, tenants, replicas, restarts) independent of the isolation layer; everything
that touches what a sandbox is belongs to the ``local`` runtime and its conformance suite.

State lives on disk under ``state_dir`` (one directory per sandbox holding the agent's pid),
so several service processes on one machine share one view of it, as replicas of the real
runtimes do; the agents outlive the service that started them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    Runtime,
    RuntimeFailure,
    RuntimeSandbox,
    RuntimeSandboxSpec,
    SandboxExit,
    SandboxStatus,
)
from orchard.env.runtime.local.spawn import read_to_eof
from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc
from orchard.inagent.version import __version__ as AGENT_VERSION

AGENT = str(Path(sys.executable).parent / "orchard-inagent")


def make(options: Mapping[str, Any]) -> UnisolatedProcessRuntime:
    """The ``runtime.factory`` for ``type: plugin`` in an ``orchard-env`` process."""
    return UnisolatedProcessRuntime(
        Path(options["state_dir"]), **{k: v for k, v in options.items() if k != "state_dir"}
    )


class UnisolatedProcessRuntime(Runtime):
    """Runs each sandbox's agent as a plain process; NO isolation (see the module doc)."""

    name = "unisolated-test"

    def __init__(
        self, state_dir: Path, *, start_timeout_s: float = 20.0, fail_images: Sequence[str] = ()
    ) -> None:
        self.state_dir = Path(state_dir)
        self.start_timeout_s = start_timeout_s
        self.fail_images = set(fail_images)
        self.created: list[str] = []
        self.forked: list[tuple[str, str]] = []
        self.deleted: list[str] = []  # ids delete() was called for while their agent ran
        self.start_delay_s = 0.0  # tests: how long each start takes before the agent starts
        self.exec_lane = True  # agents also serve the exec lane, as the local runtime's do
        self._children: dict[str, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._exits: asyncio.Queue[SandboxExit] = asyncio.Queue()
        self._deleting: set[str] = set()
        self._adopted: dict[str, int] = {}  # sandbox id → pidfd of an agent another process started

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        loop = asyncio.get_running_loop()
        for pidfd in self._adopted.values():
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._adopted.clear()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def _dir(self, sandbox_id: str) -> Path:
        return self.state_dir / sandbox_id

    async def create(self, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        if spec.image in self.fail_images:
            raise RuntimeFailure(FailureReason.IMAGE_NOT_FOUND, f"no image {spec.image!r}")
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        home = self._dir(spec.sandbox_id)
        (home / "work").mkdir(parents=True, exist_ok=True)
        socket = home / "agent.sock"
        argv = [AGENT, "--listen", f"unix:{socket}", "--working-dir", str(home / "work")]
        lane = f"unix:{home / 'agent.lane'}" if self.exec_lane else ""
        if lane:
            argv += ["--lane", lane]
        on_demand = bool(lane) and spec.agent_grpc_on_demand
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC) if on_demand else (-1, -1)
        if on_demand:
            # As the local runtime: only the lane until orchard-env opens gRPC over it, and
            # readiness on a pipe (there is no gRPC to poll).
            argv += ["--grpc-on-demand", "true", "--ready-fd", str(ready_write)]
        for name, value in spec.env.items():
            argv += ["--set", f"env.{name}={value}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    pass_fds=(ready_write,) if on_demand else (),
                )
            finally:
                if on_demand:
                    os.close(ready_write)
            (home / "agent.json").write_text(json.dumps({"pid": process.pid}))
            self._children[spec.sandbox_id] = process
            address = f"unix:{socket}"
            if on_demand:
                version = await self._wait_ready_pipe(ready_read, process)
            else:
                version = await self._wait_serving(address, process)
        except BaseException:
            await self.delete(spec.sandbox_id)
            raise
        self.created.append(spec.sandbox_id)
        watcher = asyncio.create_task(self._watch(spec.sandbox_id, process))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return RuntimeSandbox(spec.sandbox_id, address, version, lane_address=lane)

    async def _wait_ready_pipe(self, fd: int, process: asyncio.subprocess.Process) -> str:
        try:
            text = await asyncio.wait_for(read_to_eof(fd), self.start_timeout_s)
        except TimeoutError:
            raise RuntimeFailure(FailureReason.AGENT_START_TIMEOUT, "agent not serving") from None
        finally:
            os.close(fd)
        if not text.strip():
            raise RuntimeFailure(FailureReason.AGENT_EXITED, "the agent exited at start")
        return AGENT_VERSION

    async def _wait_serving(self, address: str, process: asyncio.subprocess.Process) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inagent_service_pb2_grpc.AgentServiceStub(channel)
            while True:
                try:
                    info = await stub.GetAgentInfo(
                        inagent_service_pb2.GetAgentInfoRequest(), timeout=1, wait_for_ready=False
                    )
                    return str(info.version)
                except grpc.aio.AioRpcError:
                    if process.returncode is not None:
                        raise RuntimeFailure(
                            FailureReason.AGENT_EXITED, "the agent exited at start"
                        ) from None
                    if time.monotonic() > deadline:
                        raise RuntimeFailure(
                            FailureReason.AGENT_START_TIMEOUT, "agent not serving"
                        ) from None
                    await asyncio.sleep(0.01)

    async def _watch(self, sandbox_id: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        self._children.pop(sandbox_id, None)
        if sandbox_id not in self._deleting and self._dir(sandbox_id).exists():
            await self._exits.put(
                SandboxExit(
                    sandbox_id, FailureReason.AGENT_EXITED, f"the agent exited with status {code}"
                )
            )

    async def adopt(self, sandbox_id: str) -> None:
        """Watch an agent another service process started, through a pidfd."""
        if sandbox_id in self._children or sandbox_id in self._adopted:
            return
        pid = self._pid(sandbox_id)
        if pid is None:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._report_exit(sandbox_id, "the agent is gone")
            return
        self._adopted[sandbox_id] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._adopted_exited, sandbox_id)

    def _adopted_exited(self, sandbox_id: str) -> None:
        pidfd = self._adopted.pop(sandbox_id, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
        self._report_exit(sandbox_id, "the agent exited")

    def _report_exit(self, sandbox_id: str, message: str) -> None:
        if sandbox_id not in self._deleting and self._dir(sandbox_id).exists():
            self._exits.put_nowait(SandboxExit(sandbox_id, FailureReason.AGENT_EXITED, message))

    def _pid(self, sandbox_id: str) -> int | None:
        try:
            return int(json.loads((self._dir(sandbox_id) / "agent.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    async def fork(self, source_id: str, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        """A copy of the source's working directory, then a plain create (no isolation)."""
        source = self._dir(source_id) / "work"
        if await self.status(source_id) is not SandboxStatus.RUNNING:
            raise RuntimeFailure(FailureReason.RUNTIME_DIED, f"sandbox {source_id} is not running")
        self.forked.append((source_id, spec.sandbox_id))
        shutil.copytree(source, self._dir(spec.sandbox_id) / "work", symlinks=True)
        return await self.create(spec)

    async def delete(self, sandbox_id: str) -> None:
        self._deleting.add(sandbox_id)
        try:
            pid = self._pid(sandbox_id)
            if pid is not None:
                self.deleted.append(sandbox_id)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            child = self._children.pop(sandbox_id, None)
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    await child.wait()
            elif pid is not None:
                deadline = time.monotonic() + 5
                # Not our child (an earlier service process started it): nothing to await.
                while self._alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)
        finally:
            self._deleting.discard(sandbox_id)

    async def status(self, sandbox_id: str) -> SandboxStatus:
        if not self._dir(sandbox_id).exists():
            return SandboxStatus.ABSENT
        pid = self._pid(sandbox_id)
        return (
            SandboxStatus.RUNNING if pid is not None and self._alive(pid) else SandboxStatus.EXITED
        )

    async def list_sandboxes(self) -> list[str]:
        if not self.state_dir.exists():
            return []
        return sorted(p.name for p in self.state_dir.iterdir() if p.is_dir())

    async def update_egress(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        return None

    async def exits(self) -> AsyncIterator[SandboxExit]:  # type: ignore[override]
        while True:
            yield await self._exits.get()
