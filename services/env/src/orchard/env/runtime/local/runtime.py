"""The ``local`` runtime: each sandbox a process tree in its own namespaces on this host.

A sandbox is: a state file (``state.py``), a workspace directory with the overlay's writable
layer, a run directory with the agent's socket, a cgroup per hierarchy (``cgroups.py``) and
PID 1 of a new pid namespace, which is the agent (``sandbox_init.py``, ``spawn.py``). Every
mount lives in the sandbox's own mount namespace, so they all vanish with the sandbox's last
process, except one: with a disk limit, the writable layer is a loop-mounted file system of its
own in the workspace (``disk.py``), which delete unmounts.

The sandbox does not depend on the service: it runs in its own session, reparented to the
host's init. A new :class:`LocalRuntime` adopts running sandboxes from their state files and
watches each PID 1 through a pidfd on the event loop (one reader per sandbox, no polling).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import marshal
import os
import re
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace

from orchard.env.images import ImageResolver, ResolvedImage
from orchard.env.images.trust import real_paths
from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    Runtime,
    RuntimeFailure,
    RuntimeResources,
    RuntimeSandbox,
    RuntimeSandboxSpec,
    RuntimeUnavailable,
    SandboxExit,
    SandboxStatus,
)
from orchard.env.runtime.local.agent_keys import AgentKeys
from orchard.env.runtime.local.cgroups import CgroupDriver, FreezeFailed, select_cgroup_driver
from orchard.env.runtime.local.config import LocalRuntimeConfig
from orchard.env.runtime.local.disk import make_layer_disk, release_layer_disk
from orchard.env.runtime.local.network import SandboxNetworks
from orchard.env.runtime.local.pool import SHELL_ID, PoolKey, Shell, ShellPool, new_shell_id
from orchard.env.runtime.local.process import open_pidfd, peer_pid, signal_pidfd
from orchard.env.runtime.local.snapshots import (
    copy_tree,
    drop_snapshot,
    make_snapshot,
    snapshot_dirs,
    snapshot_needs,
    snapshot_size,
)
from orchard.env.runtime.local.spawn import AgentLaunch, StartedSandbox, start_sandbox_process
from orchard.env.runtime.local.state import SandboxPaths, SandboxState, StateStore
from orchard.env.runtime.local.zygote import AgentZygote

__all__ = ["AGENT_MOUNT", "LocalRuntime"]

log = logging.getLogger(__name__)

AGENT_MOUNT = "/.orchard/inagent"
"""Where the agent bundle appears inside every sandbox (read-only)."""
SOCKET_NAME = "agent.sock"
LANE_NAME = "agent.lane"
"""The agent's exec lane (:mod:`orchard.inagent.exec_lane`), beside its gRPC socket."""
AGENT_EXECUTABLE = "orchard-inagent"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MAX_UNIX_PATH = 107
_KILL_WAIT_S = 10.0
_CGROUP_DRAIN_TRIES = 200
_LOG_TAIL_BYTES = 1500
CLAIM_FIFO = "claim"  # in a pooled sandbox's run directory, until its claim
# sandbox_init.CLAIMED (that module is a script, not imported): what a claim sets.
CLAIMED = ("hostname", "working_dir", "argv", "env", "raw_sockets", "user_namespaces")
_MAX_CLAIM_BYTES = 60_000  # below a pipe's 64 KiB buffer
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WALK_MAX_DEPTH = 64  # open directories remove_tree holds at once; deeper trees go to rm


def agent_package_version() -> str:
    """The version of the orchard-inagent package this interpreter imports ("" without it)."""
    try:
        from orchard.inagent.version import __version__  # noqa: PLC0415 - the agent's package
    except ImportError:
        return ""
    return __version__


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it, however deep a sandbox nested it.

    Walked in this process (a delete used to spend two ``rm`` processes on it): without
    recursion, every step relative to an open directory (a symlink is removed, never
    followed), and only on ``path``'s file system. What that walk leaves (a tree deeper than
    it holds directories open for, another file system mounted inside, an entry it cannot
    remove) goes to ``rm``, which walks any depth and stays on this file system too."""
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        _unlink_tree(path)
    if not os.path.lexists(path):
        return
    done = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    if os.path.lexists(path):
        raise RuntimeFailure(
            FailureReason.INTERNAL,
            f"cannot remove {path}: {done.stderr.decode(errors='replace').strip()[-500:]}",
        )


def _unlink_tree(path: str) -> None:
    """Remove ``path`` depth first, holding one open directory per level (at most
    ``_WALK_MAX_DEPTH``); raises OSError where it stops, having removed what it passed."""
    top = os.lstat(path)
    if not stat.S_ISDIR(top.st_mode):
        os.unlink(path)
        return
    parent, name = os.path.split(os.path.abspath(path))
    parent_fd = os.open(parent, _DIR_FLAGS)
    levels: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = []  # (fd, name, entries)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        levels.append((fd, name, _entries(fd)))
        if os.fstat(fd).st_dev != top.st_dev:
            raise OSError(f"{path} changed while being removed")
        while levels:
            fd, name, entries = levels[-1]
            entry = next(entries, None)
            if entry is None:
                levels.pop()
                os.close(fd)
                os.rmdir(name, dir_fd=levels[-1][0] if levels else parent_fd)
            elif not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.name, dir_fd=fd)
            elif len(levels) >= _WALK_MAX_DEPTH:
                raise OSError(f"{path}: deeper than {_WALK_MAX_DEPTH} levels")
            else:
                child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                levels.append((child, entry.name, _entries(child)))
                if os.fstat(child).st_dev != top.st_dev:
                    raise OSError(f"{path}: another file system is mounted inside")
    finally:
        for fd, _, _ in levels:
            os.close(fd)
        os.close(parent_fd)


def _entries(fd: int) -> Iterator[os.DirEntry[str]]:
    """A directory's entries, read whole before any is removed."""
    with os.scandir(fd) as entries:
        return iter(list(entries))


def _check_id(sandbox_id: str, *, pooled: bool = False) -> None:
    """Refuse ids a request may not name; ``pooled``: a pooled sandbox's id too (delete)."""
    if not _ID.fullmatch(sandbox_id) and not (pooled and SHELL_ID.fullmatch(sandbox_id)):
        raise ValueError(
            f"sandbox id {sandbox_id!r}: 1-63 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )


def _log_tail(path: str) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - _LOG_TAIL_BYTES))
            return file.read().decode(errors="replace").strip()
    except OSError:
        return ""


async def _readable(fd: int, timeout_s: float) -> bool:
    """Wait until ``fd`` (a pidfd: its process exited) is readable; False on timeout."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(ready, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


@dataclass
class _FreezeHold:
    """A source sandbox frozen for the forks copying it, and the snapshot they share."""

    frozen: asyncio.Future[None]
    users: int = 0
    snapshot: asyncio.Future[str | None] | None = None


class LocalRuntime(Runtime):
    """Sandboxes on this host (needs root). See the module docstring."""

    name = "local"

    def __init__(self, config: LocalRuntimeConfig, images: ImageResolver | None = None) -> None:
        self.config = config
        self.images = images or ImageResolver(
            config.image_cache_dir,
            protected=(config.state_dir, config.workspace_dir, config.run_dir),
        )
        self.store = StateStore(config.state_dir)
        self.networks = SandboxNetworks(config.network, config.state_dir)
        self.agent_keys = AgentKeys(config.state_dir)
        self._cgroups: CgroupDriver | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._pidfds: dict[str, int] = {}  # sandbox id → pidfd of its PID 1, while running
        self._deleting: set[str] = set()
        self._freezes: dict[str, _FreezeHold] = {}  # source id → its freeze while forks copy
        # Snapshot layers in use by no state yet (a fork being made), by how many users.
        self._pins: collections.Counter[str] = collections.Counter()
        self._snapshot_bytes: dict[str, int] = {}  # snapshot → the memory it may hold
        self._snapshot_bytes_making = 0  # of the snapshots being copied now
        self._pool = ShellPool(0, self._build_shell, self._discard_shell)  # sized at start
        self._exits: asyncio.Queue[SandboxExit | None] = asyncio.Queue()
        self._started = False
        self._zygote = AgentZygote(config.python) if config.agent_launch == "zygote" else None
        # A zygote run by this interpreter serves the agent this process imports: its version
        # is known without asking each agent (a bundle or another interpreter may differ).
        self._agent_version = agent_package_version() if self._zygote and not config.python else ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._check_host()
        cgroups = select_cgroup_driver(self.config.cgroup_parent, self.config.cgroup_version)
        cgroups.prepare()
        self._cgroups = cgroups
        if self._zygote is not None:
            await self._zygote.start()  # fails fast, with the fix, when it cannot start
        for directory in (self.config.state_dir, self.config.workspace_dir, self.config.run_dir):
            os.makedirs(directory, mode=0o711, exist_ok=True)
        self._started = True
        for sandbox_id in self.store.ids():
            if not SHELL_ID.fullmatch(sandbox_id):
                self._adopt(sandbox_id)
        # Pooled sandboxes of an earlier run ended with it: remove what is left of them.
        for shell_id in await self._dead_shells():
            await self.delete(shell_id)
        # Snapshots no sandbox uses any more (their last fork went with an earlier run).
        await self._release_snapshots(snapshot_dirs(self._snapshots_dir))
        for snapshot in snapshot_dirs(self._snapshots_dir):
            self._snapshot_bytes[snapshot] = snapshot_size(snapshot)
        self._pool = ShellPool(self.config.pool_size, self._build_shell, self._discard_shell)
        if self.config.pool_size and self.config.pool_image:
            await self._pool.pin(await self._pool_key(self.config.pool_image))
        log.info(
            "local runtime ready",
            extra={"cgroup": cgroups.version, "adopted": sorted(self._pidfds)},
        )

    def _check_host(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeUnavailable(
                "the local runtime needs root (namespaces, mounts, cgroups); run the service "
                "as root or use the kubernetes runtime"
            )
        with open("/proc/filesystems", encoding="ascii") as file:
            if "\toverlay\n" not in file.read():
                raise RuntimeUnavailable(
                    "overlayfs is not available (not in /proc/filesystems); `modprobe overlay`"
                )
        agent = os.path.join(self.config.agent_bundle, AGENT_EXECUTABLE)
        if not os.access(agent, os.X_OK):
            raise RuntimeUnavailable(
                f"the agent bundle is missing: no executable {agent}; run `make inagent-binary` "
                "(or point agent_bundle / $ORCHARD_INAGENT_BUNDLE at a built bundle)"
            )
        longest = len(self.config.run_dir) + 1 + 63 + 1 + max(len(SOCKET_NAME), len(LANE_NAME))
        if longest > _MAX_UNIX_PATH:
            raise RuntimeUnavailable(
                f"run_dir {self.config.run_dir!r} is too long: a sandbox's socket path could "
                f"reach {longest} bytes, above the {_MAX_UNIX_PATH} a Unix socket allows"
            )

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for pidfd in self._pidfds.values():
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._pidfds.clear()
        await self._pool.close()
        if self._zygote is not None:
            await self._zygote.close()
        self._started = False
        self._exits.put_nowait(None)

    def remove_cgroup_parents(self) -> list[str]:
        """rmdir this runtime's cgroup parent in every hierarchy; return those left because
        something is still in them (a leak). For private runtimes (tests, benchmarks) once
        every sandbox is deleted."""
        busy = []
        for parent in self._cgroups.parents if self._cgroups is not None else ():
            try:
                os.rmdir(parent)
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(parent)
        return busy

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        self._require_started()
        _check_id(spec.sandbox_id)
        # Unpacking an archive image the first time takes a while: off the event loop.
        image = await asyncio.to_thread(self.images.resolve, spec.image, spec.image_trust)
        sandbox_id = spec.sandbox_id
        async with self._lock(sandbox_id):
            if self._leftovers(sandbox_id):
                raise RuntimeFailure(
                    FailureReason.INTERNAL, f"sandbox {sandbox_id} exists already; delete it first"
                )
            try:
                return await self._create_locked(spec, image)
            except BaseException:
                # Shielded: a cancelled create still releases everything it made.
                await asyncio.shield(self._delete_locked(sandbox_id))
                raise
            finally:
                self._pool.refill()

    async def _create_locked(
        self,
        spec: RuntimeSandboxSpec,
        image: ResolvedImage,
        snapshot_of: SandboxState | None = None,
    ) -> RuntimeSandbox:
        cgroups = self._driver()
        sandbox_id = spec.sandbox_id
        resources = self._resources(spec.resources)
        paths = SandboxPaths(
            workspace=os.path.join(self.config.workspace_dir, sandbox_id),
            run=os.path.join(self.config.run_dir, sandbox_id),
            disk_bytes=resources.disk_bytes,
        )
        state = SandboxState(
            sandbox_id=sandbox_id,
            image=spec.image,
            paths=paths,
            cgroup_dirs=cgroups.dirs_for(sandbox_id),
            memory_limit_bytes=resources.memory_bytes,
            labels=dict(spec.labels),
        )
        started = None
        if snapshot_of is None and not paths.disk_bytes:
            started = await self._claim_shell(spec, image, state, resources)
        if started is None:
            started, state = await self._start_fresh(spec, image, state, resources, snapshot_of)
        try:
            self._pidfds[sandbox_id] = started.pidfd
            self.store.write(state.with_process(started.pid, started.start_time))
            # While the agent starts: a sandbox with egress rules or ingress ports gets its
            # link and rules.
            address = await self.networks.apply(
                sandbox_id, started.pid, spec.egress, accepts=bool(spec.ingress_ports)
            )
            await started.wait_ready(self.config.start_timeout_s)
        except RuntimeFailure as failure:
            if failure.reason is FailureReason.AGENT_EXITED and cgroups.oom_kills(
                state.cgroup_dirs
            ):
                failure.reason = FailureReason.OUT_OF_MEMORY
                failure.message = (
                    f"the agent was killed for memory at start (limit {resources.memory_bytes} "
                    "bytes); raise the sandbox's memory"
                )
            tail = _log_tail(paths.log)
            if tail and failure.reason is not FailureReason.IMAGE_INVALID:
                failure.message = f"{failure.message}; agent log: {tail}"
                failure.args = (failure.message,)
            raise
        finally:
            started.close()
        self._watch(sandbox_id, started.pidfd)
        return RuntimeSandbox(
            sandbox_id,
            f"unix:{paths.run}/{SOCKET_NAME}",
            self._agent_version,
            network_address=address if spec.ingress_ports else "",
            lane_address=f"unix:{paths.run}/{LANE_NAME}",
        )

    async def _start_fresh(
        self,
        spec: RuntimeSandboxSpec,
        image: ResolvedImage,
        state: SandboxState,
        resources: RuntimeResources,
        snapshot_of: SandboxState | None,
    ) -> tuple[StartedSandbox, SandboxState]:
        """Make the sandbox's directories and cgroup and start its PID 1 (not yet ready); the
        state as recorded (a fork's names the snapshot layers it mounts)."""
        paths, cgroups = state.paths, self._driver()
        self.store.write(state)  # first, so that a crash from here on leaves a findable record
        os.makedirs(paths.workspace, mode=0o700)
        if paths.disk_bytes:
            await make_layer_disk(paths.disk_image, paths.layer, paths.disk_bytes)
        for directory in (paths.upper, paths.work, paths.root):
            os.mkdir(directory, 0o755)
        os.makedirs(paths.run, mode=0o755)
        if snapshot_of is not None:
            # Pinned until the state names them: the source's own layers, should the source go
            # meanwhile, and the new snapshot (_copy_frozen pins it for this fork).
            layers = snapshot_of.snapshot_layers
            self._pin(layers)
            try:
                snapshot = await self._copy_frozen(snapshot_of, paths)
                if snapshot:
                    layers = (snapshot, *layers)
                state = replace(state, snapshot_layers=layers)
                self.store.write(state)
            except BaseException:
                self._unpin(layers)
                await asyncio.shield(self._release_snapshots(layers))
                raise
            self._unpin(layers)
        cgroups.create(state.sandbox_id, resources)
        launch = self._launch(spec, image, state)
        return await self._start_process(launch), state

    async def _start_process(self, launch: AgentLaunch) -> StartedSandbox:
        if self._zygote is not None:
            return await self._zygote.start_sandbox_process(launch)
        return await start_sandbox_process(launch, self.config.python)

    # -- pooled sandboxes (pool.py) ----------------------------------------------------------

    async def _claim_shell(
        self,
        spec: RuntimeSandboxSpec,
        image: ResolvedImage,
        state: SandboxState,
        resources: RuntimeResources,
    ) -> StartedSandbox | None:
        """Turn a pooled sandbox into ``spec``'s; None when none fits (then start afresh)."""
        launch = self._launch(spec, image, state)
        claim = marshal.dumps({name: getattr(launch, name) for name in CLAIMED})
        if len(claim) > _MAX_CLAIM_BYTES:
            return None  # the FIFO's buffer must take it whole: never block the event loop
        shell = self._pool.take(
            PoolKey(image.lower_dirs, launch.masked_dirs),
            pinned_image=spec.image == self.config.pool_image,
        )
        if shell is None:
            return None
        cgroups, paths, started = self._driver(), state.paths, shell.started
        claimed = state.with_process(started.pid, started.start_time)
        try:
            self.store.write(claimed)  # first: from here on, delete finds the sandbox
            cgroups.take_over(shell.state.cgroup_dirs, started.pid, state.sandbox_id, resources)
            os.rename(shell.state.paths.workspace, paths.workspace)
            os.rename(shell.state.paths.run, paths.run)
            self.store.remove(shell.shell_id)
            os.write(shell.claim_fd, claim)
        except BaseException as exc:
            shell.close_fds()  # its PID 1 sees end-of-file and exits
            await asyncio.shield(self._delete_locked(state.sandbox_id))
            await asyncio.shield(self._delete_locked(shell.shell_id))
            if not isinstance(exc, Exception):
                raise
            log.warning("sandbox %s: a pooled sandbox failed at claim: %r", spec.sandbox_id, exc)
            return None
        os.close(shell.claim_fd)  # end-of-file: the claim is whole
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{paths.run}/{CLAIM_FIFO}")
        return started

    async def _pool_key(self, image_reference: str) -> PoolKey:
        image = await asyncio.to_thread(self.images.resolve, image_reference, None)
        return PoolKey(image.lower_dirs, self._masked_dirs(image))

    async def _build_shell(self, key: PoolKey) -> Shell:
        """A sandbox built up to its claim, under an id no request can use."""
        shell_id = new_shell_id()
        self._pool.building(shell_id)
        cgroups, paths = self._driver(), self._paths(shell_id)
        resources = self._resources(RuntimeResources())
        state = SandboxState(
            sandbox_id=shell_id,
            image="",
            paths=paths,
            cgroup_dirs=cgroups.dirs_for(shell_id),
            memory_limit_bytes=resources.memory_bytes,
        )
        claim_fd = -1
        started: StartedSandbox | None = None
        try:
            self.store.write(state)  # first, as for any sandbox
            os.makedirs(paths.workspace, mode=0o700)
            for directory in (paths.upper, paths.work, paths.root):
                os.mkdir(directory, 0o755)
            os.makedirs(paths.run, mode=0o755)
            fifo = f"{paths.run}/{CLAIM_FIFO}"
            os.mkfifo(fifo, 0o600)
            # Read and write: opening never waits, and this is the FIFO's only writer.
            claim_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            cgroups.create(shell_id, resources)
            started = await self._start_process(self._shell_launch(key, state, fifo))
            state = state.with_process(started.pid, started.start_time)
            self.store.write(state)
            await started.wait_shell(self.config.start_timeout_s)
        except BaseException:
            for fd in (claim_fd, *((started.pidfd, started.ready_fd) if started else ())):
                with contextlib.suppress(OSError):
                    os.close(fd)
            await asyncio.shield(self._delete_locked(shell_id))
            raise
        return Shell(key, state, started, claim_fd)

    def _shell_launch(self, key: PoolKey, state: SandboxState, fifo: str) -> AgentLaunch:
        """What a pooled sandbox is built with: the request's part comes with its claim."""
        paths = state.paths
        return AgentLaunch(
            hostname=state.sandbox_id,
            root=paths.root,
            lower_dirs=key.lower_dirs,
            upper_dir=paths.upper,
            work_dir=paths.work,
            agent_bundle=os.path.realpath(self.config.agent_bundle),
            run_dir=paths.run,
            socket_name=SOCKET_NAME,
            lane_name=LANE_NAME,
            working_dir="/",
            masked_dirs=key.masked_dirs,
            cgroup_procs=tuple(self._driver().procs_files(state.cgroup_dirs)),
            log_file=paths.log,
            argv=(),
            env={},
            claim_fifo=fifo,
        )

    async def _discard_shell(self, shell: Shell) -> None:
        shell.close_fds()  # end-of-file on its claim FIFO: its PID 1 exits by itself
        try:
            async with self._lock(shell.shell_id):
                await self._delete_locked(shell.shell_id)
        except Exception:
            log.exception("cannot remove pooled sandbox %s", shell.shell_id)

    async def _dead_shells(self, found: set[str] | None = None) -> set[str]:
        """Pooled sandboxes whose PID 1 is gone (their runtime exited): leftovers."""
        if found is None:
            found = set(self.store.ids()) | self._driver().ids()
            for directory in (self.config.workspace_dir, self.config.run_dir):
                with contextlib.suppress(FileNotFoundError):
                    found.update(entry.name for entry in os.scandir(directory) if entry.is_dir())
        return {name for name in found if SHELL_ID.fullmatch(name) and not self._shell_alive(name)}

    def _shell_alive(self, shell_id: str) -> bool:
        """Whether a shell is this pool's or still has a PID 1 (another runtime's)."""
        if self._pool.owns(shell_id):
            return True
        state = self.store.read(shell_id)
        if state is None:
            return False
        if not state.pid:  # being built, unless it was for longer than a start may take
            with contextlib.suppress(FileNotFoundError):
                age = time.time() - self.store.path(shell_id).stat().st_mtime
                return age < self.config.start_timeout_s
            return False
        pidfd = open_pidfd(state.pid, state.start_time)
        if pidfd is None:
            return False
        os.close(pidfd)
        return True

    def _masked_dirs(self, image: ResolvedImage) -> tuple[str, ...]:
        # The host image shows the host's root: hide this runtime's state whatever resolved it.
        if not image.is_host:
            return ()
        return real_paths((*self.private_paths(), *image.masked_paths))

    def _launch(
        self, spec: RuntimeSandboxSpec, image: ResolvedImage, state: SandboxState
    ) -> AgentLaunch:
        working_dir = os.path.normpath(os.path.join("/", spec.working_dir or "/"))
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": spec.sandbox_id}
        env.update(spec.env)
        # sandbox_init adds where the agent listens (the run directory, never mounted inside).
        argv = [f"{AGENT_MOUNT}/{AGENT_EXECUTABLE}", "--working-dir", working_dir]
        if spec.agent_grpc_on_demand:
            argv += ["--grpc-on-demand", "true"]  # its lane is always given (LANE_NAME)
        agent_own = {name: value for name, value in env.items() if name.startswith("ORCHARD_")}
        if agent_own:
            # The agent reads ORCHARD_* as its own settings and hides them from commands, so a
            # sandbox's ORCHARD_* variables travel as configuration of the commands' env.
            import json  # noqa: PLC0415 - rare

            argv += ["--set", f"env={json.dumps(agent_own)}"]
            env = {name: value for name, value in env.items() if name not in agent_own}
        # The agent takes both out of its environment at start; commands never see them.
        env["ORCHARD_AGENT_KEY"] = self.agent_keys.key_for(spec.sandbox_id)
        env["ORCHARD_AGENT_SANDBOX_ID"] = spec.sandbox_id
        return AgentLaunch(
            hostname=spec.sandbox_id,
            root=state.paths.root,
            lower_dirs=(*state.snapshot_layers, *image.lower_dirs),
            upper_dir=state.paths.upper,
            work_dir=state.paths.work,
            agent_bundle=os.path.realpath(self.config.agent_bundle),
            run_dir=state.paths.run,
            socket_name=SOCKET_NAME,
            lane_name=LANE_NAME,
            working_dir=working_dir,
            masked_dirs=self._masked_dirs(image),
            cgroup_procs=tuple(self._driver().procs_files(state.cgroup_dirs)),
            log_file=state.paths.log,
            argv=tuple(argv),
            env=env,
            raw_sockets=spec.raw_sockets,
            user_namespaces=spec.user_namespaces,
        )

    async def fork(self, source_id: str, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        """Start ``spec`` over a copy of the source's writable layer taken now.

        The source's cgroup is frozen while the copy is made and thawed after (also when it
        fails), so the copy is the file system of one instant: no file arrives half-written by
        a process that was writing it. Its agent answers again once thawed. Forks of one source
        made at once share one freeze and one copy: a read-only snapshot on a tmpfs of its own
        (``snapshots.py``; up to ``fork_snapshot_max_bytes``), which each fork mounts as a layer
        between the image's layers (and the snapshots its source has, for a fork of a fork) and
        its own empty upper layer. A larger layer is copied into each fork's upper layer
        (``cp -a --reflink=auto``). On a v1 host without the freezer hierarchy each fork copies
        while the source keeps running, and a file it writes meanwhile may arrive torn.
        Processes are not copied.
        """
        self._require_started()
        _check_id(source_id)
        _check_id(spec.sandbox_id)
        source = self.store.read(source_id)
        if source is None or await self.status(source_id) is not SandboxStatus.RUNNING:
            raise RuntimeFailure(
                FailureReason.RUNTIME_DIED, f"sandbox {source_id} is not running: cannot fork it"
            )
        image = await asyncio.to_thread(self.images.resolve, source.image, spec.image_trust)
        sandbox_id = spec.sandbox_id
        async with self._lock(sandbox_id):
            if self._leftovers(sandbox_id):
                raise RuntimeFailure(
                    FailureReason.INTERNAL, f"sandbox {sandbox_id} exists already; delete it first"
                )
            try:
                return await self._create_locked(spec, image, snapshot_of=source)
            except BaseException:
                await asyncio.shield(self._delete_locked(sandbox_id))
                raise

    async def _copy_frozen(self, source: SandboxState, paths: SandboxPaths) -> str | None:
        """With the source frozen: the snapshot its forks share (made by the first of them),
        or None when its layer was copied into ``paths``' upper layer instead."""
        source_id, dirs, cgroups = source.sandbox_id, source.cgroup_dirs, self._driver()
        if not cgroups.can_freeze(dirs):
            log.warning("sandbox %s: no freezer; copying it while it runs", source_id)
            await copy_tree(source.paths.upper, paths.upper)
            return None
        # Forks of one source at once share one freeze; the last to finish thaws.
        hold = self._freezes.get(source_id)
        if hold is None:
            hold = self._freezes[source_id] = _FreezeHold(
                asyncio.ensure_future(cgroups.freeze(dirs))
            )
        hold.users += 1
        try:
            try:
                await asyncio.shield(hold.frozen)
            except FreezeFailed as exc:
                raise RuntimeFailure(
                    FailureReason.INTERNAL, f"cannot freeze sandbox {source_id} to copy it: {exc}"
                ) from None
            if paths.disk_bytes:
                # Its disk limit covers every file it has: the copy goes onto its own disk.
                await copy_tree(source.paths.upper, paths.upper)
                return None
            if hold.snapshot is None:
                hold.snapshot = asyncio.ensure_future(self._snapshot(source))
            snapshot = await asyncio.shield(hold.snapshot)
            if snapshot is None:
                await copy_tree(source.paths.upper, paths.upper)
            else:
                self._pin((snapshot,))  # for the caller, until its state names it
            return snapshot
        finally:
            hold.users -= 1
            if hold.users == 0:
                del self._freezes[source_id]
                if not hold.frozen.done():
                    hold.frozen.cancel()
                cgroups.thaw(dirs)  # also when the copy failed or the fork was cancelled
                await self._end_snapshot(hold.snapshot)

    async def _snapshot(self, source: SandboxState) -> str | None:
        """A snapshot of the (frozen) source's upper layer, pinned until its freeze ends; None
        when it would take all snapshots together over ``fork_snapshot_max_bytes``."""
        size, inodes = await asyncio.to_thread(snapshot_needs, source.paths.upper)
        held = sum(self._snapshot_bytes.values()) + self._snapshot_bytes_making
        if held + size > self.config.fork_snapshot_max_bytes:
            return None
        self._snapshot_bytes_making += size  # counted while it is copied
        try:
            snapshot = await make_snapshot(self._snapshots_dir, source.paths.upper, size, inodes)
        finally:
            self._snapshot_bytes_making -= size
        self._snapshot_bytes[snapshot] = size
        self._pin((snapshot,))
        return snapshot

    async def _end_snapshot(self, made: asyncio.Future[str | None] | None) -> None:
        """A freeze's snapshot once its forks are made: unpinned, and dropped when none of them
        recorded it (they all failed); one still being made is stopped (and removed)."""
        if made is None:
            return
        if not made.done():
            made.cancel()
            return
        if made.cancelled() or made.exception() is not None:
            return
        snapshot = made.result()
        if snapshot is not None:
            self._unpin((snapshot,))
            await self._release_snapshots((snapshot,))

    @property
    def _snapshots_dir(self) -> str:
        return os.path.join(self.config.state_dir, "snapshots")

    def _pin(self, layers: Sequence[str]) -> None:
        self._pins.update(layers)

    def _unpin(self, layers: Sequence[str]) -> None:
        self._pins.subtract(layers)
        for layer in layers:
            if self._pins[layer] <= 0:
                del self._pins[layer]

    async def _release_snapshots(self, layers: Sequence[str]) -> None:
        """Drop those of ``layers`` that no sandbox's state names and no fork being made
        holds. A drop that fails is logged (the next start tries again)."""
        candidates = [layer for layer in layers if layer not in self._pins]
        if not candidates:
            return
        states = await asyncio.to_thread(self.store.all)
        used = {layer for state in states for layer in state.snapshot_layers}
        for layer in candidates:
            if layer in used:
                continue
            try:
                await asyncio.to_thread(drop_snapshot, layer)
            except OSError as exc:
                log.warning("cannot remove the fork snapshot %s: %s", layer, exc)
            else:
                self._snapshot_bytes.pop(layer, None)

    async def delete(self, sandbox_id: str) -> None:
        self._require_started()
        _check_id(sandbox_id, pooled=True)  # list_sandboxes reports dead pooled ones
        async with self._lock(sandbox_id):
            await self._delete_locked(sandbox_id)

    async def _delete_locked(self, sandbox_id: str) -> None:
        self._deleting.add(sandbox_id)
        try:
            state = self.store.read(sandbox_id)
            pidfd = self._unwatch(sandbox_id)
            if pidfd is None and state is not None:
                pidfd = open_pidfd(state.pid, state.start_time)
            if state is not None:
                self._driver().thaw(state.cgroup_dirs)  # a frozen PID 1 would not die
            if pidfd is not None:
                try:
                    # PID 1 of the pid namespace: the kernel kills everyone else in it, and
                    # its pidfd turns readable only once they are all gone.
                    signal_pidfd(pidfd)
                    if not await _readable(pidfd, _KILL_WAIT_S):
                        log.warning("sandbox %s: PID 1 outlived SIGKILL", sandbox_id)
                finally:
                    os.close(pidfd)
            cgroups = self._driver()
            dirs = tuple(
                dict.fromkeys(
                    (*(state.cgroup_dirs if state else ()), *cgroups.dirs_for(sandbox_id))
                )
            )
            await self._remove_cgroups(sandbox_id, cgroups, dirs)
            await self.networks.remove(sandbox_id)
            paths = state.paths if state else self._paths(sandbox_id)
            # Unmounted first (a state file lost in a crash: looked for anyway), so that the
            # removal below never walks the sandbox's own file system.
            release_layer_disk(os.path.join(paths.workspace, "layer"))
            for directory in (paths.workspace, paths.run):
                await asyncio.to_thread(remove_tree, directory)
            self.store.remove(sandbox_id)
            if state is not None and state.snapshot_layers:
                await self._release_snapshots(state.snapshot_layers)
        finally:
            self._deleting.discard(sandbox_id)

    @staticmethod
    async def _remove_cgroups(
        sandbox_id: str, cgroups: CgroupDriver, dirs: tuple[str, ...]
    ) -> None:
        for _ in range(_CGROUP_DRAIN_TRIES):
            cgroups.kill_tasks(dirs)
            if cgroups.remove(dirs):
                return
            # A killed task leaves its cgroup a moment after the signal: bounded, once per delete.
            await asyncio.sleep(0.01)
        raise RuntimeFailure(
            FailureReason.INTERNAL, f"sandbox {sandbox_id}: processes remain in {', '.join(dirs)}"
        )

    async def status(self, sandbox_id: str) -> SandboxStatus:
        self._require_started()
        _check_id(sandbox_id, pooled=True)
        if sandbox_id in self._pidfds:
            return SandboxStatus.RUNNING
        state = self.store.read(sandbox_id)
        if state is not None:
            pidfd = open_pidfd(state.pid, state.start_time)
            if pidfd is not None:
                os.close(pidfd)
                return SandboxStatus.RUNNING
        return SandboxStatus.EXITED if self._leftovers(sandbox_id) else SandboxStatus.ABSENT

    def private_paths(self) -> tuple[str, ...]:
        config = self.config
        return (config.state_dir, config.workspace_dir, config.run_dir, config.image_cache_dir)

    async def list_sandboxes(self) -> list[str]:
        self._require_started()
        found = set(self.store.ids()) | self._driver().ids() | await self.networks.ids()
        for directory in (self.config.workspace_dir, self.config.run_dir):
            with contextlib.suppress(FileNotFoundError):
                found.update(entry.name for entry in os.scandir(directory) if entry.is_dir())
        # Pooled sandboxes only once dead: live ones are this pool's or another runtime's.
        dead = await self._dead_shells(found)
        return sorted(name for name in found if _ID.fullmatch(name) or name in dead)

    async def update_egress(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        """Replace the sandbox's allowed destinations in one nftables transaction (the first
        rules also give it its link); applied when this returns."""
        self._require_started()
        _check_id(sandbox_id)
        async with self._lock(sandbox_id):
            state = self.store.read(sandbox_id)
            pidfd = open_pidfd(state.pid, state.start_time) if state and state.pid else None
            if state is None or pidfd is None:
                raise RuntimeFailure(FailureReason.INTERNAL, f"sandbox {sandbox_id} is not running")
            try:
                await self.networks.apply(sandbox_id, state.pid, egress)
            finally:
                os.close(pidfd)  # held so far: the pid cannot name another process meanwhile

    async def exits(self) -> AsyncIterator[SandboxExit]:
        """Events of sandboxes whose agent stopped without a delete: while this runtime
        watches, and at start for adopted sandboxes found dead. One consumer; ends on close."""
        while True:
            event = await self._exits.get()
            if event is None:
                return
            yield event

    async def verify_agent(self, sandbox_id: str, address: str) -> bool:
        """Whether the process listening on the agent's socket is the sandbox's PID 1.

        The socket lives in the run directory, which no sandbox sees; this check (the peer's
        pid from ``SO_PEERCRED`` against the pid in the state file, so it holds after a
        restart) also refuses a socket swapped on the host. An agent that does not answer is
        not judged here: the call that follows fails as for any dead agent.
        """
        _check_id(sandbox_id)
        state = self.store.read(sandbox_id)
        if state is None or not state.pid or not address.startswith("unix:"):
            return True
        pid = await peer_pid(address.removeprefix("unix:"))
        if pid is None or pid == state.pid:
            return True
        log.warning(
            "sandbox %s: the socket's listener (pid %d) is not its agent (pid %d)",
            sandbox_id,
            pid,
            state.pid,
        )
        return False

    async def agent_key(self, sandbox_id: str) -> bytes | None:
        _check_id(sandbox_id)
        return self.agent_keys.key_for(sandbox_id).encode()

    # -- watching ----------------------------------------------------------------------------

    async def adopt(self, sandbox_id: str) -> None:
        """Watch a sandbox another process started (its state file names the agent)."""
        self._require_started()
        _check_id(sandbox_id)
        async with self._lock(sandbox_id):
            if sandbox_id not in self._pidfds and sandbox_id not in self._deleting:
                self._adopt(sandbox_id)

    def _adopt(self, sandbox_id: str) -> None:
        state = self.store.read(sandbox_id)
        if state is None or not state.pid:
            return  # a create that crashed before its process: list_sandboxes reports it
        pidfd = open_pidfd(state.pid, state.start_time)
        if pidfd is None:
            self._exits.put_nowait(self._exit_event(state, adopted=True))
            return
        self._pidfds[sandbox_id] = pidfd
        self._watch(sandbox_id, pidfd)

    def _watch(self, sandbox_id: str, pidfd: int) -> None:
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit, sandbox_id)

    def _unwatch(self, sandbox_id: str) -> int | None:
        pidfd = self._pidfds.pop(sandbox_id, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
        return pidfd

    def _on_exit(self, sandbox_id: str) -> None:
        pidfd = self._unwatch(sandbox_id)
        if pidfd is not None:
            os.close(pidfd)
        if sandbox_id in self._deleting:
            return
        state = self.store.read(sandbox_id)
        if state is not None:
            self._exits.put_nowait(self._exit_event(state, adopted=False))

    def _exit_event(self, state: SandboxState, *, adopted: bool) -> SandboxExit:
        when = "while the service was down" if adopted else ""
        oom_kills = self._driver().oom_kills(state.cgroup_dirs)
        if oom_kills:
            return SandboxExit(
                state.sandbox_id,
                FailureReason.OUT_OF_MEMORY,
                f"the agent exited {when}after {oom_kills} OOM kill(s) in the sandbox "
                f"(memory limit {state.memory_limit_bytes} bytes)".replace("  ", " "),
            )
        tail = _log_tail(state.paths.log)
        return SandboxExit(
            state.sandbox_id,
            FailureReason.AGENT_EXITED,
            f"the agent exited {when}".strip() + (f"; agent log: {tail}" if tail else ""),
        )

    # -- helpers -----------------------------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _driver(self) -> CgroupDriver:
        if self._cgroups is None:
            raise RuntimeError("LocalRuntime.start() was not called")
        return self._cgroups

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("LocalRuntime.start() was not called (or close() was)")

    def _paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(
            workspace=os.path.join(self.config.workspace_dir, sandbox_id),
            run=os.path.join(self.config.run_dir, sandbox_id),
        )

    def _leftovers(self, sandbox_id: str) -> bool:
        paths = self._paths(sandbox_id)
        return (
            self.store.path(sandbox_id).exists()
            or os.path.lexists(paths.workspace)
            or os.path.lexists(paths.run)
            or any(os.path.isdir(d) for d in self._driver().dirs_for(sandbox_id))
            or self.networks.has_link(sandbox_id)
        )

    def _resources(self, requested: RuntimeResources) -> RuntimeResources:
        defaults = self.config.default_resources
        return RuntimeResources(
            cpu_millis=requested.cpu_millis or defaults.cpu_millis,
            memory_bytes=requested.memory_bytes or defaults.memory_bytes,
            pids=requested.pids or defaults.pids,
            disk_bytes=requested.disk_bytes or defaults.disk_bytes,
        )
