"""The agent's fork server ("zygote"): one pre-loaded agent that forks per sandbox.

    python -m orchard.inagent.zygote --control-fd 3 --setup PATH/sandbox_init.py

The local sandbox runtime starts one per runtime, outside every sandbox. It imports the agent
completely (every module the agent would otherwise import lazily: after ``pivot_root`` the
host's files are gone) and grpc, loads the runtime's stdlib-only sandbox setup module, freezes
its heap out of the collector (so children do not copy pages to update reference counts of the
preloaded code) and then serves spawn requests. It never starts a gRPC thread or an event loop:
forking is safe only while the process has one thread.

Control: the inherited descriptor is one end of an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair.
A request is one message: a ``marshal`` dict (the runtime's launch plan, without ``ready_fd``)
with two descriptors attached: the write end of the sandbox's ready pipe and a reply socket.
The zygote says ``ready`` on the control socket once, when it has preloaded.
For each, the zygote forks a helper which, like ``sandbox_init.py``'s main, joins the cgroups,
unshares the namespaces and forks again: that child is PID 1 of the new pid namespace. It builds
the root (``sandbox_init.enter_root``) and runs the agent's ``run()`` in place, with the flags
the exec path gives the executable (``sandbox_init.agent_flags``: the listen address through the
run directory's descriptor, ``--ready-fd``), so the ready pipe protocol is the same. ``enter_root``
has by then dropped PID 1's privilege (capabilities, no_new_privs, non-dumpable, seccomp) while it
is one thread; the zygote itself starts with an almost empty environment, so a sandbox's
``/proc/1/environ`` shows nothing of the service's.
The helper sends the child's host pid with a pidfd for it on the reply socket and exits: the
child is reparented to the host's init and depends on neither the zygote nor the service. The
zygote exits when the runtime's end of the control socket closes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.abc
import importlib.util
import logging
import marshal
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["PRELOADED_MODULES", "READY_MESSAGE", "main", "serve"]

PRELOADED_MODULES: tuple[str, ...] = (
    "orchard.inagent.main",
    # The rest of what the agent imports on its first call, on a setting or on an error.
    "orchard.inagent.config_model",
    "orchard.core.config",
    "orchard.core.logging",
    "orchard.core.metrics",
    "grpc_health.v1.health",
    "grpc_health.v1.health_pb2",
    "grpc_health.v1.health_pb2_grpc",
    "grpc_reflection.v1alpha.reflection",
    "grpc_status.rpc_status",
    "google.protobuf.any_pb2",
    "google.protobuf.duration_pb2",
    "google.protobuf.timestamp_pb2",
    "google.rpc.status_pb2",
    "google.rpc.error_details_pb2",
    "yaml",
    # The standard library's own lazy imports on the agent's paths.
    "concurrent.futures.thread",
    "encodings.idna",
    "encodings.latin_1",
    "encodings.ascii",
    "shlex",
)
"""Imported before the first fork; the fork-server test audits that nothing else is needed."""

READY_MESSAGE = b"ready"
"""Sent once on the control socket when the zygote takes requests."""
_MAX_REQUEST_BYTES = 1 << 20
_REAP_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


class LateImportAudit(importlib.abc.MetaPathFinder):
    """Reports every import after the fork (one JSON line on stderr, the sandbox's log).

    Such an import reads the sandbox's root, not the host's: it fails, or loads another copy
    of a module from an image that happens to hold one.
    """

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        line = f'{{"level": "WARNING", "msg": "late import", "module": "{fullname}"}}\n'
        os.write(2, line.encode())


def _load_setup(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("orchard_sandbox_setup", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"orchard-inagent-zygote: cannot load the sandbox setup {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _preload() -> None:
    for name in PRELOADED_MODULES:
        importlib.import_module(name)


def _agent_argv(setup: ModuleType, plan: dict[str, object]) -> list[str]:
    # argv[0] is the bundle's executable on the exec path; here the agent is already loaded.
    argv = [str(arg) for arg in plan["argv"]][1:]  # type: ignore[attr-defined]
    return [*argv, *setup.agent_flags(plan)]


def _run_agent(setup: ModuleType, plan: dict[str, object]) -> int:
    """In the sandbox's PID 1, after ``enter_root``: what the agent's exec would have done."""
    from orchard.inagent.main import run  # noqa: PLC0415 - preloaded, a dictionary lookup

    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in plan["env"].items()})  # type: ignore[attr-defined]
    argv = _agent_argv(setup, plan)
    sys.argv = ["orchard-inagent", *argv]
    sys.meta_path.insert(0, LateImportAudit())
    return run(argv)


def _sandbox_pid1(setup: ModuleType, plan: dict[str, object], ready_fd: int) -> None:
    try:
        setup.enter_root(plan)
        code = _run_agent(setup, plan)
    except setup.SetupError as exc:
        os.write(ready_fd, f"!{exc.reason} {exc}\n".encode())
        code = 1
    except BaseException as exc:  # reported on the ready pipe, then exit
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"!INTERNAL sandbox setup failed: {exc!r}\n".encode())
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)  # never the zygote's own exit handlers


def _helper(
    setup: ModuleType, plan: dict[str, object], ready_fd: int, reply: socket.socket
) -> None:
    """Forked from the zygote: enter the namespaces, fork PID 1, hand its pidfd over, exit."""
    os.setsid()  # no signal to the service's or the zygote's group reaches the sandbox
    plan["ready_fd"] = ready_fd
    try:
        setup.enter_namespaces(list(plan["cgroup_procs"]))  # type: ignore[call-overload]
    except OSError as exc:
        os.write(ready_fd, f"!RESOURCES_UNAVAILABLE {exc}\n".encode())
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        # The reply socket's descriptor is closed by enter_root; a socket object still owning
        # it could later close a reused number, so it lets go first.
        reply.detach()
        _sandbox_pid1(setup, plan, ready_fd)
    os.close(ready_fd)
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(reply, [f"{pid}\n".encode()], [pidfd])
    except OSError:
        # The runtime gave up on this create (its reply end is closed) and has already cleaned
        # up what it knew of: nobody will ever own this PID 1, so it must not outlive us.
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os._exit(1)
    os._exit(0)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(control: socket.socket, setup: ModuleType) -> int:
    """Answer spawn requests until the runtime closes its end; return the exit status."""
    control.settimeout(_REAP_INTERVAL_S)
    while True:
        _reap()
        try:
            data, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST_BYTES, 2)
        except TimeoutError:
            continue
        if not data:
            return 0
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        ready_fd, reply_fd = fds
        plan = marshal.loads(data)
        reply = socket.socket(fileno=reply_fd)
        try:
            pid = os.fork()
        except OSError as exc:
            os.write(ready_fd, f"!RESOURCES_UNAVAILABLE cannot fork the sandbox: {exc}\n".encode())
            pid = -1
        if pid == 0:
            try:
                control.close()
                _helper(setup, plan, ready_fd, reply)
            finally:
                os._exit(1)
        os.close(ready_fd)
        reply.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: preload, then serve the runtime on ``--control-fd``."""
    parser = argparse.ArgumentParser(prog="orchard-inagent-zygote", description=__doc__)
    parser.add_argument("--control-fd", type=int, required=True, metavar="N")
    parser.add_argument("--setup", required=True, metavar="PATH", help="sandbox_init.py")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    setup = _load_setup(args.setup)
    _preload()
    gc.collect()
    gc.freeze()
    control.send(READY_MESSAGE)
    return serve(control, setup)


if __name__ == "__main__":
    sys.exit(main())
