"""Orchard demo: start the in-sandbox agent and run a short, real session against it.

Run it with `make demo`. Part one starts the self-contained agent bundle when it has been
built (`make inagent-binary`), the Python entry point otherwise, on a Unix socket in a scratch
directory, and drives it over gRPC: agent info, commands, a streamed command, a timeout, an
output cap, a file round trip, and a bad request. Part two (needs root) starts a private etcd and
the environment service with the local runtime and uses sandboxes through the Python SDK.
Everything it starts, it stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "services/inagent/dist/orchard-inagent/orchard-inagent"
BOLD, DIM, GREEN, RED, RESET = "\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[0m"
if not sys.stdout.isatty():
    BOLD = DIM = GREEN = RED = RESET = ""


def step(title: str) -> None:
    print(f"\n{BOLD}▸ {title}{RESET}")


def show(label: str, text: str) -> None:
    print(f"  {DIM}{label:<14}{RESET} {text}")


def command(*argv: str, shell: str = "", timeout_s: float = 0, cap: int = 0) -> exec_pb2.Command:
    cmd = exec_pb2.Command(argv=list(argv), shell=shell, output_limit_bytes=cap)
    if timeout_s:
        cmd.timeout.FromNanoseconds(int(timeout_s * 1e9))
    return cmd


def describe(status: exec_pb2.ExitStatus) -> str:
    took = f"{status.duration.ToNanoseconds() / 1e6:.1f} ms"
    if status.WhichOneof("termination") == "signal":
        how = f"killed by signal {status.signal}"
    else:
        how = f"exit {status.exit_code}"
    return f"{how}{' (timed out)' if status.timed_out else ''} in {took}"


async def wait_serving(channel: grpc.aio.Channel, proc: subprocess.Popen[bytes]) -> float:
    health = health_pb2_grpc.HealthStub(channel)
    start = time.monotonic()
    while time.monotonic() - start < 15:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited early with code {proc.returncode}")
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic() - start
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.01)
    raise SystemExit("the agent did not become ready within 15 s")


async def session(agent: pb_grpc.AgentServiceStub, workdir: Path) -> None:
    step("Agent info")
    reply = await agent.GetAgentInfo(pb.GetAgentInfoRequest())
    show("version", reply.version)
    show("pid", str(reply.pid))
    show("limits", f"timeout {reply.default_timeout.ToSeconds()} s, "
         f"output cap {reply.default_output_limit_bytes // 1024} KiB per stream")  # fmt: skip

    step("Exec a program (argv, no shell)")
    result = (await agent.Exec(pb.ExecRequest(command=command("uname", "-sr")))).result
    show("uname -sr", result.stdout.decode().strip())
    show("status", describe(result.status))

    step("Exec through a shell, with a failing exit code")
    shell = "echo 'to stdout'; echo 'to stderr' >&2; exit 3"
    result = (await agent.Exec(pb.ExecRequest(command=command(shell=shell)))).result
    show("stdout", repr(result.stdout.decode()))
    show("stderr", repr(result.stderr.decode()))
    show("status", describe(result.status))

    step("Stream a command's output as it is written")
    ticker = "for i in 1 2 3 4 5; do echo tick $i; sleep 0.2; done; echo done >&2"
    start = time.monotonic()
    stream = agent.ExecStream(pb.ExecStreamRequest(command=command(shell=ticker)))
    async for message in stream:
        event = message.event
        at = f"+{(time.monotonic() - start) * 1000:6.0f} ms"
        kind = event.WhichOneof("event")
        if kind == "started":
            show(at, f"started, pid {event.started.pid}")
        elif kind in ("stdout", "stderr"):
            for line in getattr(event, kind).decode().splitlines():
                show(at, f"{kind}: {line}")
        elif kind == "exit":
            show(at, describe(event.exit))

    step("A timeout kills the whole process group")
    sleeper = "sleep 30 & sleep 30; echo never"
    limited = command(shell=sleeper, timeout_s=0.5)
    result = (await agent.Exec(pb.ExecRequest(command=limited))).result
    show("command", repr(sleeper))
    show("status", describe(result.status))

    step("Output past the cap is dropped, not buffered")
    flood = command("head", "-c", str(50 * 1024 * 1024), "/dev/zero", cap=1024 * 1024)
    result = (await agent.Exec(pb.ExecRequest(command=flood))).result
    show("printed", f"{result.status.stdout_bytes / 2**20:.0f} MiB")
    kept = len(result.stdout) / 2**20
    show("kept", f"{kept:.0f} MiB, truncated={result.status.stdout_truncated}")

    step("File round trip")
    payload = os.urandom(4 * 1024 * 1024)
    target = workdir / "data" / "blob.bin"

    async def chunks() -> AsyncIterator[pb.WriteFileRequest]:
        header = pb.WriteFileHeader(path=str(target), mode=0o600, make_parents=True)
        yield pb.WriteFileRequest(header=header)
        for offset in range(0, len(payload), 256 * 1024):
            yield pb.WriteFileRequest(data=payload[offset : offset + 256 * 1024])

    written = await agent.WriteFile(chunks())
    local_sum = hashlib.sha256(payload).hexdigest()
    show("wrote", f"{written.info.path} ({written.info.size / 2**20:.0f} MiB, "
         f"mode {written.info.mode:o})")  # fmt: skip
    verdict = "matches" if written.sha256 == local_sum else f"{RED}DIFFERS{RESET}"
    show("sha256", f"{written.sha256[:16]}… {verdict} the local digest")
    back = bytearray()
    async for part in agent.ReadFile(pb.ReadFileRequest(path=str(target))):
        back += part.data
    show("read back", f"{len(back) / 2**20:.0f} MiB, identical={bytes(back) == payload}")
    listing = await agent.ListFiles(pb.ListFilesRequest(path=str(target.parent)))
    show("listing", ", ".join(f"{e.name} ({e.size} B)" for e in listing.entries))

    step("Bad input gets a clear error, and the agent keeps serving")
    for title, call in (
        ("missing binary", agent.Exec(pb.ExecRequest(command=command("no-such-tool")))),
        ("zero timeout", agent.Exec(pb.ExecRequest(command=command("true", timeout_s=1e-10)))),
        ("missing file", agent.StatFile(pb.StatFileRequest(path=str(workdir / "nope")))),
    ):
        try:
            await call
            show(title, f"{RED}unexpectedly succeeded{RESET}")
        except grpc.aio.AioRpcError as error:
            show(title, f"{error.code().name}: {error.details()}")


async def sandboxes() -> None:
    """Part two: the environment service, its local runtime and the SDK."""
    import secrets  # noqa: PLC0415
    import socket  # noqa: PLC0415

    from orchard.sdk import AsyncSandboxClient, Resources  # noqa: PLC0415
    from orchard.sdk.cli.host_probe import remove_cgroup_parent  # noqa: PLC0415
    from orchard.sdk.cli.stack import LocalStack  # noqa: PLC0415

    print(f"\n{BOLD}Orchard — sandboxes through the environment service{RESET}")
    if os.geteuid() != 0:
        show("skipped", "the local runtime needs root (namespaces, cgroups, mounts)")
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = Path(tempfile.mkdtemp(prefix="orchard-demo-stack-"))
    token = secrets.token_urlsafe(24)
    tag = secrets.token_hex(3)
    cgroup_parent, run_dir = f"orchard-demo-{tag}", f"/run/orchard-demo-{tag}"
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{port}",
        token=token,
        runtime={"cgroup_parent": cgroup_parent, "run_dir": run_dir},
    )
    started = time.monotonic()
    await asyncio.to_thread(stack.start)
    try:
        show("serving", f"etcd + orchard-env on 127.0.0.1:{port} after "
             f"{(time.monotonic() - started) * 1000:.0f} ms")  # fmt: skip
        async with AsyncSandboxClient(f"127.0.0.1:{port}", token=token) as client:
            step("Create three sandboxes on the host image at once (256 MiB limit each)")
            started = time.monotonic()
            boxes = await asyncio.gather(
                *(
                    client.create(
                        "host", labels={"demo": tag}, resources=Resources.of(memory="256M")
                    )
                    for _ in range(3)
                )
            )
            show("ready", f"{len(boxes)} sandboxes in {(time.monotonic() - started) * 1000:.0f} ms")
            box = boxes[0]
            for title, shell in (
                ("processes", "ps -e -o pid=,comm= | tr -s ' ' | paste -sd ';'"),
                ("network", "ls /sys/class/net | paste -sd ' '"),
                ("hostname", "hostname"),
            ):
                result = await box.exec(shell)
                show(title, result.stdout.decode().strip() or result.stderr.decode().strip())
            step("Files in one sandbox are invisible to the others")
            await box.write_file("/srv/only-here.txt", b"private\n")
            seen = [
                (await other.exec("cat /srv/only-here.txt 2>&1")).stdout.decode().strip()
                for other in boxes
            ]
            for other, text in zip(boxes, seen, strict=True):
                show(other.id, text)
            step("List by label, then delete")
            listed = [info.id async for info in client.list(f"demo={tag}")]
            show("listed", ", ".join(sorted(listed)))
            await asyncio.gather(*(b.delete() for b in boxes))
            left = [info.id async for info in client.list(f"demo={tag}")]
            show("left", str(len(left)))
    finally:
        await asyncio.to_thread(stack.stop)
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


async def main() -> int:
    scratch = Path(tempfile.mkdtemp(prefix="orchard-demo-"))
    socket_path = scratch / "inagent.sock"
    if BUNDLE.exists():
        argv, kind = [str(BUNDLE)], "self-contained bundle"
    else:
        found = shutil.which("orchard-inagent", path=str(Path(sys.executable).parent))
        argv, kind = [found or "orchard-inagent"], "Python entry point (bundle not built)"
    argv += ["--listen", f"unix:{socket_path}"]
    print(f"{BOLD}Orchard — the in-sandbox agent{RESET}")
    show("agent", f"{Path(argv[0]).name}: {kind}")
    proc = subprocess.Popen(argv, cwd=scratch, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            ready = await wait_serving(channel, proc)
            show("serving", f"on unix:{socket_path.name} after {ready * 1000:.0f} ms")
            await session(pb_grpc.AgentServiceStub(channel), scratch)
        step("Stop the agent (SIGTERM: drain, then exit)")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        show("exit code", f"{GREEN if code == 0 else RED}{code}{RESET}")
        if code != 0:
            return 1
        await sandboxes()
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
