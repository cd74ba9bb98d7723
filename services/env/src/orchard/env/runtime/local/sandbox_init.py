"""What runs inside a new sandbox before its agent: namespaces, cgroups, the root, then exec.

The local runtime starts this file as a script (``python -S -E sandbox_init.py PLAN``, the plan a
hex-encoded ``marshal`` dict) in a new session, so it imports nothing but a few C-level standard
modules and costs little more than a bare interpreter (no json, re, enum). It joins the sandbox's
cgroups, unshares the pid, mount, net, uts and ipc namespaces and forks: the child is PID 1 of the
new pid namespace. The child builds the root (overlay over the image, the agent bundle and the run
directory bound in, ``/dev``, ``/proc``, ``/sys``), pivots into it, brings ``lo`` up, drops the
capabilities that reach past the namespaces, and replaces itself with the agent, which thus stays
PID 1.

The parent prints the child's host pid on stdout and waits for its stdin to close before it exits:
while it lives the pid cannot be reused, so the runtime can open a pidfd for it safely. The child is
then reparented to the host's init; nothing of it depends on the service.

Protocol on the ready descriptor (``plan["ready_fd"]``, inherited by the agent as
``--ready-fd``): the agent writes its addresses and closes it; a failure before the agent
starts is one line ``!REASON message`` (``REASON`` a ``FailureReason`` value).

Python 3.11 has no ``os.unshare``, hence ``ctypes`` for ``unshare``, ``mount``, ``umount2``,
``pivot_root`` and ``sethostname``.
"""

from __future__ import annotations

import _socket  # the C module: `socket` would import enum, re and selectors
import ctypes
import errno
import fcntl
import marshal
import os
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

SYS_PIVOT_ROOT = 155  # x86_64
PR_CAPBSET_DROP = 24
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# Capabilities the sandbox keeps (a container engine's usual default, minus CAP_MKNOD: there is
# no device cgroup here to stop a new node for the host's disk).
KEPT_CAPABILITIES = frozenset(
    {
        0,  # CHOWN
        1,  # DAC_OVERRIDE
        3,  # FOWNER
        4,  # FSETID
        5,  # KILL
        6,  # SETGID
        7,  # SETUID
        8,  # SETPCAP
        10,  # NET_BIND_SERVICE
        13,  # NET_RAW
        18,  # SYS_CHROOT
        29,  # AUDIT_WRITE
        31,  # SETFCAP
    }
)

DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
    "core": "/proc/kcore",
}
# Kernel knobs a root process could turn to reach the host (core_pattern, sysrq, ...).
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "kallsyms")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """A step failed; ``reason`` is the FailureReason value the runtime reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    result = _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data))
    _check(result, f"mount {fstype or source} on {target}")


def bind(source: str, target: str, *, read_only: bool, recursive: bool = False) -> None:
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        mount(None, target, None, flags)


def ensure_dir(path: str, mode: int = 0o755) -> None:
    try:
        os.makedirs(path, mode, exist_ok=True)
    except FileExistsError as exc:
        raise SetupError(
            "IMAGE_INVALID", f"{path} exists in the image and is not a directory"
        ) from exc


def ensure_file(path: str) -> None:
    if not os.path.exists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def build_dev(root: str) -> None:
    dev = f"{root}/dev"
    ensure_dir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536k")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"{dev}/{name}", 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(f"{dev}/{name}", 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    for name in ("pts", "shm", "mqueue"):
        os.mkdir(f"{dev}/{name}", 0o1777 if name == "shm" else 0o755)
    mount(
        "devpts",
        f"{dev}/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )
    mount("shm", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777")
    mount("mqueue", f"{dev}/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def build_proc_and_sys(root: str) -> None:
    proc = f"{root}/proc"
    ensure_dir(proc)
    mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        if os.path.exists(f"{proc}/{name}"):
            bind(f"{proc}/{name}", f"{proc}/{name}", read_only=True, recursive=True)
    for name in PROC_MASKED:
        if os.path.isfile(f"{proc}/{name}"):
            mount(f"{root}/dev/null", f"{proc}/{name}", None, MS_BIND)
    ensure_dir(f"{root}/sys")
    mount("sysfs", f"{root}/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def build_root(plan: dict[str, object]) -> str:
    root = str(plan["root"])
    layers = ":".join(str(layer) for layer in plan["lower_dirs"])  # type: ignore[attr-defined]
    options = f"lowerdir={layers},upperdir={plan['upper_dir']},workdir={plan['work_dir']}"
    try:
        mount("overlay", root, "overlay", 0, options)
    except OSError as exc:
        raise SetupError("IMAGE_INVALID", f"cannot mount the overlay root: {exc}") from exc
    orchard = f"{root}/.orchard"
    for name in ("inagent", "run"):
        ensure_dir(f"{orchard}/{name}")
    bind(str(plan["agent_bundle"]), f"{orchard}/inagent", read_only=True)
    bind(str(plan["run_dir"]), f"{orchard}/run", read_only=False)
    build_dev(root)
    build_proc_and_sys(root)
    ensure_dir(f"{root}/tmp", 0o1777)
    for path in plan.get("masked_dirs", ()):  # type: ignore[attr-defined]
        # The host image would otherwise show this runtime's own state and other sandboxes.
        if os.path.isdir(f"{root}{path}"):
            mount("tmpfs", f"{root}{path}", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0")
    ensure_dir(f"{root}{plan['working_dir']}")
    return root


def pivot_into(root: str) -> None:
    os.chdir(root)
    _check(int(_libc.syscall(SYS_PIVOT_ROOT, b".", b".")), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def loopback_up() -> None:
    sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        sock.close()


def drop_capabilities(last_cap: int) -> None:
    for cap in range(last_cap + 1):
        if cap not in KEPT_CAPABILITIES:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")


def enter_root(plan: dict[str, object]) -> None:
    """As PID 1 of the new namespaces: build the root, pivot into it and trim capabilities.

    Leaves open only 0 (``/dev/null``), 1 and 2 (the log) and the ready descriptor, which it
    makes inheritable. Also used by the agent's fork server, which then runs the agent in place.
    """
    ready_fd = int(plan["ready_fd"])  # type: ignore[call-overload]
    log_fd = os.open(str(plan["log_file"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    null_fd = os.open("/dev/null", os.O_RDONLY)
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as file:
        last_cap = int(file.read())
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    hostname = str(plan["hostname"]).encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    root = build_root(plan)
    pivot_into(root)
    os.chdir(str(plan["working_dir"]))
    loopback_up()
    drop_capabilities(last_cap)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, ready_fd)
    os.closerange(ready_fd + 1, 65536)
    os.set_inheritable(ready_fd, True)


def become_agent(plan: dict[str, object]) -> None:
    """Runs as PID 1 of the new namespaces; returns only by raising."""
    enter_root(plan)
    ready_fd = int(plan["ready_fd"])  # type: ignore[call-overload]
    argv = [str(arg) for arg in plan["argv"]]  # type: ignore[attr-defined]
    argv += ["--ready-fd", str(ready_fd)]
    env = {str(k): str(v) for k, v in plan["env"].items()}  # type: ignore[attr-defined]
    try:
        os.execve(argv[0], argv, env)
    except OSError as exc:
        raise SetupError("INTERNAL", f"cannot start the agent {argv[0]}: {exc}") from exc


def join_cgroups(procs_files: list[str]) -> None:
    pid = str(os.getpid())
    for path in procs_files:
        with open(path, "w", encoding="ascii") as file:
            file.write(pid)


def enter_namespaces(procs_files: list[str]) -> None:
    """Join the sandbox's cgroups and unshare its namespaces; the next fork is its PID 1."""
    join_cgroups(procs_files)
    flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID
    _check(_libc.unshare(flags), "unshare")


def main() -> int:
    plan = marshal.loads(bytes.fromhex(sys.argv[1]))
    ready_fd = int(plan["ready_fd"])
    try:
        enter_namespaces(list(plan["cgroup_procs"]))
    except OSError as exc:
        os.write(ready_fd, f"!RESOURCES_UNAVAILABLE {exc}\n".encode())
        return 1
    pid = os.fork()
    if pid == 0:
        try:
            become_agent(plan)
        except SetupError as exc:
            os.write(ready_fd, f"!{exc.reason} {exc}\n".encode())
        except BaseException as exc:
            os.write(ready_fd, f"!INTERNAL sandbox setup failed: {exc!r}\n".encode())
        os._exit(1)
    os.close(ready_fd)
    sys.stdout.write(f"{pid}\n")
    sys.stdout.flush()
    sys.stdin.read()  # the runtime closes it once it holds a pidfd for the child
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        sys.exit(1)
