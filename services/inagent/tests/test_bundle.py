"""The self-contained bundle runs in images that have no Python, no C library, even no shell.

Each test builds a minimal root filesystem under tmp_path, starts the bundled agent as the first
process of fresh pid, mount, uts, ipc and net namespaces chrooted into it, and drives it over a
Unix socket the host can reach. The bundle is (re)built once per session when it is missing or
older than the sources. The chroot tests need root (namespaces, mounts, device nodes) and a
static busybox (Debian: busybox-static) and skip, saying why, without them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc
from orchard.inagent.version import __version__
from orchard.types.v1 import exec_pb2

# A (re)build of the bundle in the session fixture takes about 20 s of the first test's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVICE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = SERVICE_DIR.parent.parent
BUNDLE_DIR = SERVICE_DIR / "dist" / "orchard-inagent"
LAUNCHER = BUNDLE_DIR / "orchard-inagent"
BUILD_SCRIPT = SERVICE_DIR / "bundle" / "build.py"
BUNDLE_SOURCES = [
    SERVICE_DIR / "bundle",
    SERVICE_DIR / "src",
    REPO_ROOT / "libs" / "core" / "src",
    REPO_ROOT / "libs" / "proto" / "src",
]
BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "ls", "cat", "echo", "sleep", "env", "touch", "true", "false", "ps"]
# The device nodes every OCI runtime gives a container (gRPC needs /dev/urandom).
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
START_TIMEOUT_S = 30.0
# Only the host's tools are used outside the chroot; nothing of the host leaks into the agent.
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


def _newest_mtime(paths: list[Path]) -> float:
    newest = 0.0
    for root in paths:
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                newest = max(newest, path.stat().st_mtime)
    return newest


@pytest.fixture(scope="session")
def bundle() -> Path:
    """The built bundle directory; built here when missing or older than its sources."""
    if sys.platform != "linux":
        pytest.skip("the bundle is Linux-only")
    fresh = LAUNCHER.is_file() and LAUNCHER.stat().st_mtime >= _newest_mtime(BUNDLE_SOURCES)
    if not fresh:
        if shutil.which("gcc") is None:
            pytest.fail("bundle not built and gcc missing: `make setup` installs gcc, libc6-dev")
        result = subprocess.run(
            [sys.executable, str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if result.returncode != 0:
            pytest.fail(f"building the bundle failed:\n{result.stdout}\n{result.stderr}")
    return BUNDLE_DIR


@pytest.fixture(scope="session")
def busybox() -> Path:
    # What `make setup` installs: missing here, the setup is broken and the tests fail.
    if os.geteuid() != 0:
        pytest.fail("needs root: namespaces, mounts and device nodes")
    for tool in ("unshare", "mount"):
        if shutil.which(tool, path=HOST_ENV["PATH"]) is None:
            pytest.fail(f"{tool} missing (util-linux)")
    if not BUSYBOX.is_file():
        pytest.fail(f"{BUSYBOX} missing: apt-get install busybox-static")
    if elf_interpreter(BUSYBOX) is not None:
        pytest.fail(f"{BUSYBOX} is dynamically linked: install busybox-static, not busybox")
    return BUSYBOX


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, removed afterwards: root filesystems hold device nodes and bundle copies."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def elf_interpreter(path: Path) -> str | None:
    """The PT_INTERP (dynamic loader) an ELF file asks for; None when static or not ELF."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only: the bundle is x86_64
        return None
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        entry = phoff + index * phentsize
        (p_type,) = struct.unpack_from("<I", data, entry)
        if p_type == 3:  # PT_INTERP
            (offset,) = struct.unpack_from("<Q", data, entry + 8)
            (size,) = struct.unpack_from("<Q", data, entry + 32)
            return data[offset : offset + size].rstrip(b"\0").decode()
    return None


def make_devices(rootfs: Path) -> None:
    dev = rootfs / "dev"
    dev.mkdir()
    for name, (major, minor) in DEVICES.items():
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def busybox_rootfs(root: Path, busybox: Path) -> Path:
    """A root filesystem with a static busybox and its applets, nothing else."""
    for name in ("bin", "proc", "tmp", "workspace", "run/orchard", ".orchard/inagent"):
        (root / name).mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    make_devices(root)
    return root


@dataclass
class Sandbox:
    """The agent running as pid 1 of its own namespaces; `socket` is its address on the host."""

    process: subprocess.Popen[bytes]
    socket: Path
    log: Path

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def agent_pid(self) -> int | None:
        """Host pid of the agent (unshare's forked child), while it runs."""
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            return int(children.read_text().split()[0])
        return None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def health_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(sandbox: Sandbox) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if sandbox.process.poll() is not None:
            pytest.fail(f"the agent exited {sandbox.process.returncode}:\n{sandbox.log_text()}")
        if sandbox.socket.exists() and health_serving(sandbox.target):
            return
        time.sleep(0.02)
    pytest.fail(f"the agent was not SERVING within {START_TIMEOUT_S} s:\n{sandbox.log_text()}")


@contextlib.contextmanager
def run_sandbox(
    rootfs: Path,
    setup: list[str],
    agent: str,
    socket_dir: Path,
    *,
    workdir: str = "/",
    mount_proc: bool = True,
) -> Iterator[Sandbox]:
    """Start `agent` chrooted into `rootfs` after the host-side `setup` commands.

    The setup commands run inside the new mount namespace (so their mounts vanish with it);
    the agent gets only the flags below, an empty-ish environment and `workdir` as its cwd.
    """
    script = "\n".join(
        [
            "set -e",
            *setup,
            f"mount -t proc proc '{rootfs}/proc'" if mount_proc else "",
            f"exec unshare --root='{rootfs}' --wd='{workdir}' {agent}"
            " --listen unix:/run/orchard/agent.sock",
        ]
    )
    log = socket_dir.parent / "agent.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--mount",
                "--uts",
                "--ipc",
                "--net",
                "--kill-child",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=HOST_ENV,
        )
    sandbox = Sandbox(process=process, socket=socket_dir / "agent.sock", log=log)
    try:
        wait_serving(sandbox)
        yield sandbox
    finally:
        pid = sandbox.agent_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # pid 1 of the namespace: its exit ends them all
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()  # --kill-child takes the namespace's pid 1 with it
            process.wait(timeout=15)
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(rootfs) not in mounts, "a mount outlived the sandbox"


@contextlib.contextmanager
def connect(sandbox: Sandbox) -> Iterator[inagent_service_pb2_grpc.AgentServiceStub]:
    with grpc.insecure_channel(sandbox.target) as channel:
        yield inagent_service_pb2_grpc.AgentServiceStub(channel)


def exec_argv(
    stub: inagent_service_pb2_grpc.AgentServiceStub, argv: list[str]
) -> exec_pb2.ExecResult:
    reply = stub.Exec(
        inagent_service_pb2.ExecRequest(command=exec_pb2.Command(argv=argv)), timeout=30
    )
    result: exec_pb2.ExecResult = reply.result
    return result


def exec_shell(stub: inagent_service_pb2_grpc.AgentServiceStub, shell: str) -> exec_pb2.ExecResult:
    reply = stub.Exec(
        inagent_service_pb2.ExecRequest(command=exec_pb2.Command(shell=shell)), timeout=30
    )
    result: exec_pb2.ExecResult = reply.result
    return result


def files_outside(rootfs: Path, bundle_path: Path) -> list[Path]:
    return [
        path
        for path in rootfs.rglob("*")
        if not path.is_relative_to(bundle_path) and not path.is_relative_to(rootfs / "proc")
    ]


@pytest.mark.root
def test_bundle_serves_in_busybox_image_without_python_or_glibc(
    scratch: Path, bundle: Path, busybox: Path
) -> None:
    rootfs = busybox_rootfs(scratch / "rootfs", busybox)
    bundle_mount = rootfs / ".orchard" / "inagent"
    # The local runtime's way: the bundle bind-mounted read-only, the image otherwise untouched.
    setup = [
        f"mount --bind '{bundle}' '{bundle_mount}'",
        f"mount -o remount,bind,ro '{bundle_mount}'",
    ]
    with (
        run_sandbox(
            rootfs,
            setup,
            "/.orchard/inagent/orchard-inagent",
            rootfs / "run" / "orchard",
            workdir="/workspace",
        ) as sandbox,
        connect(sandbox) as stub,
    ):
        echoed = exec_argv(stub, ["busybox", "echo", "hi"])
        assert echoed.status.exit_code == 0
        assert echoed.stdout == b"hi\n"

        shelled = exec_shell(stub, 'echo "$((6 * 7)) from $(cat /proc/1/comm)"; exit 3')
        assert shelled.status.exit_code == 3
        assert shelled.stdout == b"42 from orchard-inagent\n"

        # Commands get the image's environment, not the bundle's loader settings.
        environment = exec_argv(stub, ["env"]).stdout.decode()
        assert "LD_LIBRARY_PATH" not in environment
        assert "_PYI_" not in environment

        content = b"written through the agent\n" * 1000
        written = stub.WriteFile(
            iter(
                [
                    inagent_service_pb2.WriteFileRequest(
                        header=inagent_service_pb2.WriteFileHeader(
                            path="notes/a.txt", make_parents=True
                        )
                    ),
                    inagent_service_pb2.WriteFileRequest(data=content[:7000]),
                    inagent_service_pb2.WriteFileRequest(data=content[7000:]),
                ]
            ),
            timeout=30,
        )
        assert written.info.size == len(content)
        read_back = b"".join(
            chunk.data
            for chunk in stub.ReadFile(
                inagent_service_pb2.ReadFileRequest(path="/workspace/notes/a.txt"), timeout=30
            )
        )
        assert read_back == content
        assert (rootfs / "workspace" / "notes" / "a.txt").read_bytes() == content
        assert exec_argv(stub, ["cat", "notes/a.txt"]).stdout == content

        info = stub.GetAgentInfo(inagent_service_pb2.GetAgentInfoRequest(), timeout=30)
        assert info.pid == 1
        assert info.version == __version__
        assert info.working_dir == "/workspace"

        # The bundle is mounted read-only and the agent still runs: it writes nothing there.
        touched = exec_argv(stub, ["touch", "/.orchard/inagent/probe"])
        assert touched.status.exit_code != 0

    # The image holds no Python and no C library: the agent brought its own.
    assert elf_interpreter(rootfs / "bin" / "busybox") is None
    for path in files_outside(rootfs, bundle_mount):
        name = path.name
        assert not name.startswith(("libc.so", "ld-linux", "libpython", "python")), path
        if path.is_file() and not path.is_symlink():
            assert elf_interpreter(path) is None, f"{path} is dynamically linked"


@pytest.mark.root
def test_bundle_starts_in_image_without_shell(scratch: Path, bundle: Path, busybox: Path) -> None:
    rootfs = scratch / "rootfs"
    for name in ("proc", "run/orchard", "opt/tools"):
        (rootfs / name).mkdir(parents=True)
    make_devices(rootfs)
    # A static binary under another name: busybox started as `echo` is just echo.
    shutil.copy2(busybox, rootfs / "opt" / "tools" / "echo")
    # The Kubernetes way: the bundle copied into the image, here at an arbitrary path.
    shutil.copytree(bundle, rootfs / "opt" / "agent", symlinks=True)
    socket_dir = scratch / "sockets"
    socket_dir.mkdir()
    # The whole image read-only; only the socket directory is writable (from the host).
    setup = [
        f"mount --bind '{rootfs}' '{rootfs}'",
        f"mount -o remount,bind,ro '{rootfs}'",
        f"mount --bind '{socket_dir}' '{rootfs}/run/orchard'",
    ]
    assert not (rootfs / "bin").exists()
    with (
        run_sandbox(rootfs, setup, "/opt/agent/orchard-inagent", socket_dir) as sandbox,
        connect(sandbox) as stub,
    ):
        echoed = exec_argv(stub, ["/opt/tools/echo", "no", "shell", "needed"])
        assert echoed.status.exit_code == 0
        assert echoed.stdout == b"no shell needed\n"

        with pytest.raises(grpc.RpcError) as missing_shell:
            exec_shell(stub, "echo hi")
        assert missing_shell.value.code() == grpc.StatusCode.NOT_FOUND

        info = stub.GetAgentInfo(inagent_service_pb2.GetAgentInfoRequest(), timeout=30)
        assert info.pid == 1

    for path in files_outside(rootfs, rootfs / "opt" / "agent"):
        assert path.name not in ("sh", "bash", "ash", "dash"), path


def test_bundle_gives_commands_the_callers_library_path(scratch: Path, bundle: Path) -> None:
    """The bundle's loader settings stay out of commands; the caller's own come back."""
    socket_path = scratch / "agent.sock"
    env = {**HOST_ENV, "LD_LIBRARY_PATH": "/opt/custom/lib", "MARKER": "kept"}
    with (scratch / "agent.log").open("wb") as log:
        process = subprocess.Popen(
            [str(bundle / "orchard-inagent"), "--listen", f"unix:{socket_path}"],
            cwd=scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    sandbox = Sandbox(process=process, socket=socket_path, log=scratch / "agent.log")
    try:
        wait_serving(sandbox)
        with connect(sandbox) as stub:
            lines = exec_argv(stub, ["env"]).stdout.decode().splitlines()
            info = stub.GetAgentInfo(inagent_service_pb2.GetAgentInfoRequest(), timeout=30)
    finally:
        process.terminate()
        process.wait(timeout=15)
    assert "LD_LIBRARY_PATH=/opt/custom/lib" in lines
    assert "MARKER=kept" in lines
    assert not [line for line in lines if line.startswith(("_PYI_", "LD_LIBRARY_PATH_ORIG"))]
    assert info.pid == process.pid
    assert info.working_dir == str(scratch)


@pytest.mark.root
def test_bundle_starts_without_proc(scratch: Path, bundle: Path, busybox: Path) -> None:
    """Without /proc the launcher finds its directory from argv[0] and nothing re-executes."""
    rootfs = busybox_rootfs(scratch / "rootfs", busybox)
    shutil.copytree(bundle, rootfs / ".orchard" / "inagent", dirs_exist_ok=True, symlinks=True)
    with (
        run_sandbox(
            rootfs,
            [],
            "/.orchard/inagent/orchard-inagent",
            rootfs / "run" / "orchard",
            mount_proc=False,
        ) as sandbox,
        connect(sandbox) as stub,
    ):
        assert not (rootfs / "proc" / "self").exists()
        echoed = exec_argv(stub, ["echo", "no", "proc"])
        assert echoed.stdout == b"no proc\n"
        info = stub.GetAgentInfo(inagent_service_pb2.GetAgentInfoRequest(), timeout=30)
        assert info.pid == 1
