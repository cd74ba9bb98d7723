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

A pooled sandbox ("shell", ``plan["claim_fifo"]`` set) is built before any request names it:
everything up to the pivot into its root, then it writes the line ``#shell`` on the ready
descriptor and waits on the FIFO for its claim, a ``marshal`` dict of :data:`CLAIMED` (what the
request decides: hostname, working directory, the agent's argv and env, the privilege options),
which the runtime writes and closes. Only then does it set the hostname, enter the working
directory and give up privilege, exactly as a fresh sandbox does. End-of-file without a claim
(the runtime closed the pool, or died) ends the shell.

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
SYS_CAPSET = 126  # x86_64
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
O_PATH = 0o10000000
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
        18,  # SYS_CHROOT
        29,  # AUDIT_WRITE
        31,  # SETFCAP
    }
)
CAP_NET_RAW = 13  # kept only when the plan asks for raw sockets

# The seccomp profile (x86_64 numbers; <asm/unistd_64.h>). Denied with EPERM: kernel surface a
# container needs no part of (modules, kexec, keyrings, bpf, perf, userfaultfd, io_uring,
# mounting, swap, clocks, reboot). Most also need a capability the sandbox lacks; the filter
# holds even where a kernel lets an unprivileged caller in. ptrace stays allowed (debuggers
# work; the agent is non-dumpable, so it is out of reach).
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
DENIED_SYSCALLS = {
    "syslog": 103,
    "uselib": 134,
    "vhangup": 153,
    "pivot_root": 155,
    "_sysctl": 156,
    "adjtimex": 159,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "create_module": 174,
    "init_module": 175,
    "delete_module": 176,
    "get_kernel_syms": 177,
    "query_module": 178,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "quotactl_fd": 443,
}
SYS_SETNS = 308  # denied unless user namespaces are allowed (entering one is their use)
SYS_UNSHARE = 272
SYS_CLONE = 56
# clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc fall back to clone.
SYS_CLONE3 = 435
CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38

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
# Files that show the host kernel's memory, keys or timers (kpage*: every physical page's flags
# and users, an aid to memory side channels): /dev/null bound over each.
PROC_MASKED = (
    "kcore",
    "keys",
    "timer_list",
    "sched_debug",
    "kallsyms",
    "kpageflags",
    "kpagecount",
    "kpagecgroup",
    "latency_stats",
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


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
    lower_dirs = [str(layer) for layer in plan["lower_dirs"]]  # type: ignore[attr-defined]
    for layer in lower_dirs:
        # Resolved and checked by the runtime; a symlink swapped in since would redirect it.
        if os.path.realpath(layer) != layer:
            raise SetupError(
                "IMAGE_NOT_ALLOWED", f"the image path {layer} changed since it was checked"
            )
    layers = ":".join(lower_dirs)
    options = f"lowerdir={layers},upperdir={plan['upper_dir']},workdir={plan['work_dir']}"
    try:
        mount("overlay", root, "overlay", 0, options)
    except OSError as exc:
        raise SetupError("IMAGE_INVALID", f"cannot mount the overlay root: {exc}") from exc
    ensure_dir(f"{root}/.orchard/inagent")
    bind(str(plan["agent_bundle"]), f"{root}/.orchard/inagent", read_only=True)
    build_dev(root)
    build_proc_and_sys(root)
    ensure_dir(f"{root}/tmp", 0o1777)
    # The host image would otherwise show the service's own state and other sandboxes.
    mask_paths(root, plan.get("masked_dirs", ()))  # type: ignore[arg-type]
    ensure_dir(f"{root}{plan['working_dir']}")
    return root


def mask_paths(root: str, paths: list[str]) -> None:
    """Hide host paths under ``root``: an empty read-only tmpfs over a directory, /dev/null
    over a file. A missing path becomes an empty directory first (in the writable layer), so
    what the host creates there later stays hidden. A path reached through a symlink in the
    root is skipped: nothing of the host's shows under that name, and a link (from a fork's
    copied layer) must not lead a mount or mkdir out of the root."""
    done: list[str] = []
    for path in sorted(paths):
        if any(path == parent or path.startswith(parent + "/") for parent in done):
            continue
        target = _unlinked(root, path)
        if target is None:
            continue
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0,mode=755")
        else:
            mount(f"{root}/dev/null", target, None, MS_BIND)
        done.append(path)


def _unlinked(root: str, path: str) -> str | None:
    """``root + path`` with no symlink on the way (missing directories made), else None."""
    current = root
    for name in path.strip("/").split("/"):
        current = f"{current}/{name}"
        if os.path.islink(current):
            return None
        if not os.path.lexists(current):
            os.mkdir(current, 0o755)
    return current


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


def kept_capabilities(plan: dict[str, object]) -> frozenset[int]:
    """The capabilities commands (and so the agent) keep in this sandbox."""
    if plan.get("raw_sockets"):
        return KEPT_CAPABILITIES | {CAP_NET_RAW}
    return KEPT_CAPABILITIES


def drop_capabilities(last_cap: int, kept: frozenset[int]) -> None:
    """Trim every capability set of this (single-threaded) process to ``kept``."""
    for cap in range(last_cap + 1):
        if cap not in kept:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    mask = sum(1 << cap for cap in kept)
    header = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0))
    # Two 32-bit halves of (effective, permitted, inheritable); none inheritable.
    low, high = mask & 0xFFFFFFFF, mask >> 32
    data = ctypes.create_string_buffer(struct.pack("6I", low, low, 0, high, high, 0))
    _check(int(_libc.syscall(SYS_CAPSET, header, data)), "capset")


def seccomp_program(*, user_namespaces: bool) -> bytes:
    """The sandbox's seccomp filter as ``struct sock_filter[]`` (classic BPF)."""
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno_ret = 0x7FFF0000, 0x00050000
    denied = sorted(DENIED_SYSCALLS.values()) + ([] if user_namespaces else [SYS_SETNS])
    # (code, true target, false target, k); targets are labels, resolved below.
    program: list[tuple[int, str | None, str | None, int]] = [
        (ld_abs, None, None, 4),  # seccomp_data.arch
        (jeq, "native", "enosys", AUDIT_ARCH_X86_64),
        (ld_abs, None, None, 0),  # seccomp_data.nr
    ]
    labels = {"native": 2}
    program.append((jge, "deny", None, X32_SYSCALL_BIT))
    program += [(jeq, "deny", None, number) for number in denied]
    program.append((jeq, "enosys", None, SYS_CLONE3))
    if not user_namespaces:
        program += [(jeq, "flags", None, SYS_UNSHARE), (jeq, "flags", None, SYS_CLONE)]
    program.append((ret, None, None, allow))
    labels["flags"] = len(program)
    program += [
        (ld_abs, None, None, 16),  # low half of seccomp_data.args[0]: the clone flags
        (jset, "deny", None, CLONE_NEWUSER),
        (ret, None, None, allow),
    ]
    labels["deny"] = len(program)
    program.append((ret, None, None, errno_ret | EPERM))
    labels["enosys"] = len(program)
    program.append((ret, None, None, errno_ret | ENOSYS))
    out = bytearray()
    for index, (code, true, false, k) in enumerate(program):
        jt = labels[true] - index - 1 if true else 0
        jf = labels[false] - index - 1 if false else 0
        out += struct.pack("HBBI", code, jt, jf, k)
    return bytes(out)


def install_seccomp(program: bytes) -> None:
    """Load ``program`` for this process and every one it starts (needs no_new_privs)."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    result = _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer), 0, 0)
    _check(result, "install the seccomp filter")


def give_up_privilege(plan: dict[str, object], last_cap: int) -> None:
    """Leave PID 1 with no more than a command gets: capabilities, no_new_privs, seccomp."""
    drop_capabilities(last_cap, kept_capabilities(plan))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    # Not inherited by commands (exec makes them dumpable again); an exec of the agent resets
    # it, so the agent sets it again itself.
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "make PID 1 non-dumpable")
    install_seccomp(seccomp_program(user_namespaces=bool(plan.get("user_namespaces"))))


def agent_flags(plan: dict[str, object]) -> list[str]:
    """The flags the agent gets from this setup: where it listens (gRPC, and the exec lane
    when the plan names one) and whom it tells."""
    listen_fd = int(plan["listen_dir_fd"])  # type: ignore[call-overload]
    lane = plan.get("lane_name")
    return [
        "--listen",
        f"unix:/proc/self/fd/{listen_fd}/{plan['socket_name']}",
        *(("--lane", f"unix:/proc/self/fd/{listen_fd}/{lane}") if lane else ()),
        "--listen-dir-fd",
        str(listen_fd),
        "--ready-fd",
        str(plan["ready_fd"]),
    ]


SHELL_READY = b"#shell\n"
"""Written on the ready descriptor by a pooled sandbox once it waits for its claim."""
CLAIMED = ("hostname", "working_dir", "argv", "env", "raw_sockets", "user_namespaces")
"""The plan entries a claim sets; everything else of the plan was fixed when the shell was built."""
_MAX_CLAIM_BYTES = 1 << 20


def wait_for_claim(ready_fd: int, claim_fd: int) -> dict[str, object]:
    """As a pooled PID 1: say so, then read the claim to end-of-file."""
    os.write(ready_fd, SHELL_READY)
    os.set_blocking(claim_fd, True)
    chunks = []
    size = 0
    while chunk := os.read(claim_fd, 65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > _MAX_CLAIM_BYTES:
            raise SetupError("INTERNAL", "the claim of a pooled sandbox is too large")
    os.close(claim_fd)
    if not chunks:
        raise SetupError("INTERNAL", "the pooled sandbox was released unclaimed")
    claim = marshal.loads(b"".join(chunks))
    if not isinstance(claim, dict) or sorted(claim) != sorted(CLAIMED):
        raise SetupError("INTERNAL", "malformed claim of a pooled sandbox")
    return claim


def set_hostname(name: str) -> None:
    hostname = name.encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")


def enter_root(plan: dict[str, object]) -> None:
    """As PID 1 of the new namespaces: build the root, pivot into it and give up privilege.

    Leaves open only 0 (``/dev/null``), 1 and 2 (the log), the ready descriptor and the run
    directory's (``plan["listen_dir_fd"]``, set here), both inheritable. Also used by the
    agent's fork server, which then runs the agent in place.
    """
    ready_fd = int(plan["ready_fd"])  # type: ignore[call-overload]
    log_fd = os.open(str(plan["log_file"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    null_fd = os.open("/dev/null", os.O_RDONLY)
    listen_fd = os.open(str(plan["run_dir"]), O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    claim_fifo = str(plan.get("claim_fifo") or "")
    # Not blocking: with the runtime gone (no writer) the read below sees end-of-file at once.
    claim_fd = os.open(claim_fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC) if claim_fifo else -1
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as file:
        last_cap = int(file.read())
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if not claim_fifo:
        set_hostname(str(plan["hostname"]))
    root = build_root(plan)
    pivot_into(root)
    if not claim_fifo:
        os.chdir(str(plan["working_dir"]))
    loopback_up()
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    kept = sorted(fd for fd in (ready_fd, listen_fd, claim_fd) if fd >= 0)
    for low, high in _gaps(3, 65536, kept):
        os.closerange(low, high)
    if claim_fifo:
        plan.update(wait_for_claim(ready_fd, claim_fd))
        set_hostname(str(plan["hostname"]))
        # Inside the pivoted root: a symlink in the image cannot lead this out of it.
        ensure_dir(str(plan["working_dir"]))
        os.chdir(str(plan["working_dir"]))
    os.set_inheritable(ready_fd, True)
    os.set_inheritable(listen_fd, True)
    plan["listen_dir_fd"] = listen_fd
    give_up_privilege(plan, last_cap)


def _gaps(low: int, high: int, kept: list[int]) -> list[tuple[int, int]]:
    """The ranges of ``[low, high)`` around the numbers in ``kept`` (sorted)."""
    ranges = []
    for number in kept:
        ranges.append((low, number))
        low = number + 1
    ranges.append((low, high))
    return [(a, b) for a, b in ranges if a < b]


def become_agent(plan: dict[str, object]) -> None:
    """Runs as PID 1 of the new namespaces; returns only by raising."""
    enter_root(plan)
    argv = [str(arg) for arg in plan["argv"]]  # type: ignore[attr-defined]
    argv += agent_flags(plan)
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
