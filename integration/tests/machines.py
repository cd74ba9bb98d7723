"""Separate machines on one host: each a network namespace on a subnet the test makes, with a
private mount namespace, its own /tmp and a read-only view of everything else.

A `Subnet` is a bridge in a namespace of its own (the switch); each `Machine` is joined to it by
a veth pair and has an address on the subnet and its own loopback. A process started on a machine
(`Machine.popen`) sees:

- ``/tmp``: an empty tmpfs of its own (what it writes there no other machine can open);
- ``/tmp/machine``: the machine's folder on the host (configs in, outputs the test reads out);
- ``/tmp/orchard-artifacts``: the one folder every machine shares, the artifact store
  (``file:///tmp/orchard-artifacts``), when the subnet has one;
- ``/dev/shm``: a tmpfs of its own;
- everything else read-only (the installed software, the host image's files); software that
  lives under /tmp on the host (a checkout and its virtual environment, an interpreter) is
  bound back at its own path, read-only, so a machine runs what the test runs wherever it is.

So a service can reach another only through the subnet (dialing 127.0.0.1 finds nothing of
another machine's) and can read what another wrote only through the artifact store. Cgroups and
/proc stay the host's: the local runtime needs them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["STORE_MOUNT", "Machine", "Subnet", "subnet"]

STORE_MOUNT = "/tmp/orchard-artifacts"
"""Where every machine sees the shared artifact store."""
MACHINE_MOUNT = "/tmp/machine"
"""Where a machine sees its own folder on the host."""

# The machine's first process: builds its mount view and holds it for the machine's lifetime.
_ENTER = r"""
set -eu
mount --make-rprivate /
mount -t tmpfs -o mode=0755,size=64k orchard-stage /mnt
mkdir /mnt/machine /mnt/store
mount --bind "$ORCHARD_MACHINE_DIR" /mnt/machine
if [ -n "${ORCHARD_STORE_DIR:-}" ]; then mount --bind "$ORCHARD_STORE_DIR" /mnt/store; fi
keep() {  # each line of $ORCHARD_KEEP_DIRS with a number: "N PATH"
  printf '%s\n' "${ORCHARD_KEEP_DIRS:-}" | grep -n . | sed 's/:/ /' || true
}
keep | while read -r n dir; do mkdir "/mnt/keep$n"; mount --bind "$dir" "/mnt/keep$n"; done
mount -t tmpfs -o mode=1777 orchard-tmp /tmp
mkdir /tmp/machine /tmp/orchard-artifacts /tmp/home
mount --move /mnt/machine /tmp/machine
if [ -n "${ORCHARD_STORE_DIR:-}" ]; then mount --move /mnt/store /tmp/orchard-artifacts; fi
keep | while read -r n dir; do
  mkdir -p "$dir"; mount --move "/mnt/keep$n" "$dir"; mount -o remount,bind,ro "$dir"
done
umount /mnt
mount -t tmpfs -o mode=1777 orchard-shm /dev/shm
mount -o remount,bind,ro /
echo ready
exec sleep infinity
"""
_HOME = {"HOME": "/tmp/home", "TMPDIR": "/tmp", "XDG_CACHE_HOME": "/tmp/home/.cache"}


def _software_under_tmp() -> list[str]:
    """The folders of the software the test runs (this checkout, its virtual environment, the
    interpreter) that lie under a folder each machine replaces (/tmp, /dev/shm), outermost only."""
    checkout = Path(__file__).resolve().parents[2]
    candidates = {checkout, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    hidden = [
        path
        for path in candidates
        if any(path.is_relative_to(root) for root in (Path("/tmp"), Path("/dev/shm")))
        and path not in (Path("/tmp"), Path("/dev/shm"))
    ]
    outermost = [
        path for path in hidden if not any(path != o and path.is_relative_to(o) for o in hidden)
    ]
    return sorted(str(path) for path in outermost)


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed: {result.stderr.strip()}")


@dataclass
class Machine:
    """One machine of a `Subnet`: a network namespace with an address, a host folder."""

    name: str
    netns: str
    address: str
    folder: Path
    """The machine's folder on the host, seen inside as /tmp/machine."""
    store: Path | None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    init: subprocess.Popen[bytes] | None = None

    def boot(self) -> None:
        """Start the machine's first process, which makes its mount view and keeps it."""
        environ = {**os.environ, "ORCHARD_MACHINE_DIR": str(self.folder)}
        environ["ORCHARD_STORE_DIR"] = str(self.store) if self.store else ""
        environ["ORCHARD_KEEP_DIRS"] = "\n".join(_software_under_tmp())
        command = ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount"]
        command += ["--propagation", "private", "sh", "-c", _ENTER]
        init = subprocess.Popen(
            command,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert init.stdout is not None
        line = init.stdout.readline().decode(errors="replace")
        if line.strip() != "ready":
            init.kill()
            rest = init.communicate()[0].decode(errors="replace")
            raise RuntimeError(f"machine {self.name} did not start: {line}{rest}")
        self.init = init

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[bytes] | int | None = None,
        stderr: IO[bytes] | int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this machine (in its network and mount namespaces, HOME and
        TMPDIR under its /tmp); it is stopped when the subnet goes."""
        assert self.init is not None, "boot() the machine first"
        environ = {**os.environ, **_HOME, **(env or {})}
        command = [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            f"--mount=/proc/{self.init.pid}/ns/mnt",
            *argv,
        ]
        process = subprocess.Popen(
            command, env=environ, stdout=stdout, stderr=stderr, start_new_session=True
        )
        self.processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this machine to its end; its output as text."""
        process = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            raise
        return subprocess.CompletedProcess(argv, process.returncode, out.decode(errors="replace"))

    def stop(self) -> None:
        """Stop what runs on this machine: SIGTERM, then SIGKILL after 15 s."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self.init is not None:
            self.init.kill()
            self.init.communicate()
            self.init = None


@dataclass
class Subnet:
    """A /24 with a switch namespace and the machines joined to it."""

    tag: str
    network: ipaddress.IPv4Network
    root: Path
    store: Path | None
    machines: dict[str, Machine] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"orchard-{self.tag}-sw"

    def machine(self, name: str) -> Machine:
        """A new machine named ``name`` (letters and digits) joined to the switch."""
        index = len(self.machines) + 2
        netns = f"orchard-{self.tag}-{name}"
        address = str(self.network.network_address + index)
        outside = f"o{self.tag}{index}"
        _ip("netns", "add", netns)
        machine = Machine(name, netns, address, self.root / name, self.store)
        self.machines[name] = machine
        machine.folder.mkdir(parents=True, exist_ok=True)
        # Made inside the two namespaces: the host's own namespace never holds either end.
        _ip(
            "link",
            "add",
            outside,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns,
            netns=self.switch,
        )
        _ip("link", "set", outside, "master", "br0", netns=self.switch)
        _ip("link", "set", outside, "up", netns=self.switch)
        _ip("addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        machine.boot()
        return machine

    def close(self) -> None:
        for machine in reversed(list(self.machines.values())):
            machine.stop()
        for machine in self.machines.values():
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", machine.netns)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.switch)


def _free_network() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route of this host covers."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, check=True
    ).stdout
    taken = []
    for line in routes.splitlines():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(line.split()[0], strict=False))
    rng = random.Random()
    for _ in range(100):
        candidate = ipaddress.IPv4Network(f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(t) for t in taken if t.version == 4 and t.prefixlen):
            return candidate
    raise RuntimeError("no free 10.x.y.0/24 on this host")


@contextlib.contextmanager
def subnet(root: Path, *, store: Path | None = None) -> Iterator[Subnet]:
    """A subnet of machines whose folders live under ``root``; ``store``, when given, is the
    artifact store every machine shares. Everything is removed at the end."""
    tag = uuid.uuid4().hex[:6]
    net = Subnet(tag, _free_network(), root, store)
    _ip("netns", "add", net.switch)
    try:
        _ip("link", "add", "br0", "type", "bridge", netns=net.switch)
        _ip("link", "set", "br0", "up", netns=net.switch)
        yield net
    finally:
        net.close()
