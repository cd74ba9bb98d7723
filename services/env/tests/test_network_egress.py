"""Egress rules of the real ``local`` runtime, end to end through the service (needs root).

The destinations live in a network namespace of the test's own, linked to the host by a veth
pair: A (two ports) and B (one port) on addresses from the test's block. Nothing is ever sent
beyond that namespace, the sandboxes' links and loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.runtime.base import RuntimeFailure, RuntimeUnavailable
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

pytestmark = [pytest.mark.root]

POOL = "10.214.0.0/20"  # the sandboxes' links
HOST_END = "10.214.200.1"  # the destination namespace's link, outside the pool
A = "10.214.200.2"
B = "10.214.200.3"
LISTENER = """
import socket, selectors, sys
sel = selectors.DefaultSelector()
for address, port, tag in (("{a}", 8001, b"A1"), ("{a}", 8002, b"A2"), ("{b}", 8001, b"B1")):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(64)
    sel.register(sock, selectors.EVENT_READ, tag)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.sendall(key.data)
        conn.close()
"""
# Prints one word per target: its tag, or "--" when nothing answered within a second.
PROBE = f"""
probe() {{ timeout 1 bash -c "exec 3<>/dev/tcp/$1/$2 && head -c2 <&3" 2>/dev/null || echo --; }}
probe {A} 8001 >/tmp/1 & probe {A} 8002 >/tmp/2 & probe {B} 8001 >/tmp/3 & wait
echo $(cat /tmp/1) $(cat /tmp/2) $(cat /tmp/3)
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def destinations() -> Iterator[None]:
    """A namespace with listeners on A:8001, A:8002 and B:8001, reached through the host."""
    name = f"orctest-{secrets.token_hex(4)}"
    link = f"otd{secrets.token_hex(5)}"
    listener = None
    ip("netns", "add", name)
    try:
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("addr", "add", f"{HOST_END}/29", "dev", link)
        ip("link", "set", link, "up")
        # Replies from the destinations are forwarded back to the sandboxes' links.
        Path(f"/proc/sys/net/ipv4/conf/{link}/forwarding").write_text("1")
        ip("-n", name, "addr", "add", f"{A}/29", "dev", "eth0")
        ip("-n", name, "addr", "add", f"{B}/29", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "route", "add", "default", "via", HOST_END)
        listener = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-c", LISTENER.format(a=A, b=B)],
            stdout=subprocess.PIPE,
        )
        assert listener.stdout is not None and listener.stdout.readline() == b"ready\n"
        yield
    finally:
        if listener is not None:
            listener.kill()
            listener.wait()
        subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        ip("netns", "del", name)


@dataclass
class Network:
    runtime: Any
    table: str


@pytest.fixture
async def network(tmp_path: Path) -> AsyncIterator[Network]:
    async with running_network(tmp_path) as made:
        yield made


@contextlib.asynccontextmanager
async def running_network(tmp_path: Path, pool: str = POOL) -> AsyncIterator[Network]:
    """A real local runtime with sandbox links from ``pool`` on a table of its own."""
    from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
    from orchard.env.runtime.local.config import LocalNetwork

    run_dir = tempfile.mkdtemp(prefix="orc-")
    table = f"orchtest{secrets.token_hex(4)}"
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        network=LocalNetwork(
            pool=pool,
            nft_table=table,
            host_forwarding=False,
            claims_dir=str(tmp_path / "claims"),
        ),
    )
    runtime = LocalRuntime(config)
    try:
        await runtime.start()
    except RuntimeUnavailable as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.fail(f"the local runtime cannot run here: {exc}")
    try:
        yield Network(runtime, table)
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        assert _links(table) == []
        assert await runtime.networks.ids() == set()
        await runtime.networks.close_table()
        await runtime.close()
        cgroups = getattr(runtime, "_cgroups", None)
        for parent in getattr(cgroups, "parents", ()):
            if os.path.isdir(parent):
                os.rmdir(parent)
        shutil.rmtree(run_dir, ignore_errors=True)


def _links(table: str) -> list[str]:
    """Host ends of this runtime's sandbox links."""
    found = []
    for entry in os.scandir("/sys/class/net"):
        alias = Path(entry.path, "ifalias")
        owned = alias.exists() and alias.read_text().startswith(f"{table}/")
        if entry.name.startswith("orc") and owned:
            found.append(entry.name)
    return found


def _chains(table: str) -> str:
    done = subprocess.run(
        ["nft", "list", "table", "inet", table], capture_output=True, text=True, check=False
    )
    return done.stdout


def allow(destination: str, *ports: int, expire_in_s: float | None = None) -> env_pb2.NetworkPolicy:
    rule = env_pb2.EgressRule(destination=destination, ports=ports, protocol=env_pb2.PROTOCOL_TCP)
    if expire_in_s is not None:
        rule.expire_time.FromNanoseconds(int((time.time() + expire_in_s) * 1e9))
    return env_pb2.NetworkPolicy(egress=[rule])


async def probe(env: Any, sandbox_id: str) -> str:
    result = await env.shell(sandbox_id, PROBE)
    assert result.status.exit_code == 0, result
    return str(result.stdout.decode().strip())


async def test_network_default_policy_reaches_nothing_but_lo(
    env_factory: Any, network: Network, destinations: None
) -> None:
    env = await env_factory(runtime=network.runtime)
    sandbox = await env.ready(image="host")
    interfaces = await env.shell(sandbox.id, "ls /sys/class/net")
    assert interfaces.stdout.split() == [b"lo"]
    assert await probe(env, sandbox.id) == "-- -- --"
    assert _links(network.table) == []


async def test_network_allows_one_destination_port_only(
    env_factory: Any, network: Network, destinations: None
) -> None:
    env = await env_factory(runtime=network.runtime)
    sandbox = await env.ready(image="host", network_policy=allow(A, 8001))
    assert await probe(env, sandbox.id) == "A1 -- --"
    # No CAP_NET_ADMIN inside: the sandbox cannot touch its address or routes.
    change = await env.shell(sandbox.id, "ip route del default || ip addr flush dev eth0")
    assert change.status.exit_code != 0 and b"not permitted" in change.stderr
    # The host itself is not reachable either: a listener on the link's host end.
    record = network.runtime.networks._read(sandbox.id)
    server = await asyncio.start_server(lambda r, w: w.close(), record.host_address, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        host = await env.shell(
            sandbox.id, f"timeout 1 bash -c '</dev/tcp/{record.host_address}/{port}'; echo $?"
        )
        assert host.stdout.strip() == b"124"  # dropped, not refused, not accepted
    finally:
        server.close()
        await server.wait_closed()


async def test_network_sandboxes_cannot_reach_each_other(
    env_factory: Any, network: Network, destinations: None
) -> None:
    env = await env_factory(runtime=network.runtime)
    wide = env_pb2.NetworkPolicy(
        egress=[env_pb2.EgressRule(destination=POOL), env_pb2.EgressRule(destination=A)]
    )
    first = await env.ready(image="host", network_policy=wide)
    second = await env.ready(image="host", network_policy=wide)
    other = network.runtime.networks._read(second.id).sandbox_address
    script = (
        f"timeout 1 bash -c '</dev/tcp/{A}/9'; echo $?; "  # allowed, nothing listens: refused
        f"timeout 1 bash -c '</dev/tcp/{other}/9'; echo $?"  # the other sandbox: dropped
    )
    result = await env.shell(first.id, script)
    assert result.stdout.split() == [b"1", b"124"]


async def test_network_allowance_expires(
    env_factory: Any, network: Network, destinations: None
) -> None:
    env = await env_factory(runtime=network.runtime)
    expires = time.time() + 3
    sandbox = await env.ready(image="host", network_policy=allow(A, 8001, expire_in_s=3))
    assert time.time() < expires - 1.2, "the sandbox took too long to start for this test"
    assert await probe(env, sandbox.id) == "A1 -- --"
    await asyncio.sleep(expires - time.time() + 0.1)
    assert await probe(env, sandbox.id) == "-- -- --"


async def test_network_update_policy_through_the_service(
    env_factory: Any, network: Network, destinations: None
) -> None:
    env = await env_factory(runtime=network.runtime)
    sandbox = await env.ready(image="host", network_policy=allow(B, 8001))
    assert await probe(env, sandbox.id) == "-- -- B1"
    started = time.monotonic()
    reply = await env.stub.UpdateNetworkPolicy(
        api.UpdateNetworkPolicyRequest(sandbox_id=sandbox.id, network_policy=allow(A, 8001)),
        metadata=env.md(),
    )
    update_s = time.monotonic() - started
    assert reply.sandbox.spec.network_policy == allow(A, 8001)
    assert not reply.HasField("next_expire_time")
    assert await probe(env, sandbox.id) == "A1 -- --"
    got = await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    assert got.sandbox.spec.network_policy == allow(A, 8001)
    # A sandbox without a link gets one on its first rules; an empty policy denies all again.
    plain = await env.ready(image="host")
    expiring = allow(A, 8002, expire_in_s=60)
    reply = await env.stub.UpdateNetworkPolicy(
        api.UpdateNetworkPolicyRequest(sandbox_id=plain.id, network_policy=expiring),
        metadata=env.md(),
    )
    assert reply.next_expire_time == expiring.egress[0].expire_time
    assert await probe(env, plain.id) == "-- A2 --"
    await env.stub.UpdateNetworkPolicy(
        api.UpdateNetworkPolicyRequest(sandbox_id=plain.id), metadata=env.md()
    )
    assert await probe(env, plain.id) == "-- -- --"
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=plain.id), metadata=env.md())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.UpdateNetworkPolicy(
            api.UpdateNetworkPolicyRequest(sandbox_id=plain.id), metadata=env.md()
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        bad = env_pb2.NetworkPolicy(egress=[env_pb2.EgressRule(destination="no such host!")])
        await env.stub.UpdateNetworkPolicy(
            api.UpdateNetworkPolicyRequest(sandbox_id=sandbox.id, network_policy=bad),
            metadata=env.md(),
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert update_s < 1.0


async def test_network_cleanup_and_leftovers(
    env_factory: Any, network: Network, destinations: None
) -> None:
    runtime = network.runtime
    env = await env_factory(runtime=runtime)
    kept = await env.ready(image="host", network_policy=allow(A, 8001))
    gone = await env.ready(image="host", network_policy=allow(A, 8001))
    assert len(_links(network.table)) == 2
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=gone.id), metadata=env.md())
    assert len(_links(network.table)) == 1
    assert f"sandbox-{gone.id}" not in _chains(network.table)
    assert f"sandbox-{kept.id}" in _chains(network.table)
    # A chain whose record was lost is still found, and deleting the sandbox removes it.
    (Path(runtime.config.state_dir) / "network" / f"{kept.id}.json").unlink()
    assert kept.id in await runtime.list_sandboxes()
    await runtime.delete(kept.id)
    assert _links(network.table) == []
    assert "sandbox-" not in _chains(network.table)
    assert "allow-" not in _chains(network.table)
    assert not any((Path(runtime.config.state_dir) / "network").iterdir())


async def test_two_runtimes_on_one_table_share_the_pool_and_never_take_each_others_sandboxes(
    tmp_path: Path,
) -> None:
    # Two orchard-env processes on one host with the default table: before, each claimed
    # addresses in its own state folder (both could hand out the same link) and listed the
    # other's chains and links as its own leftovers, which its reconcile then removed.
    from orchard.env.runtime.local.config import LocalNetwork
    from orchard.env.runtime.local.network import SandboxNetworks

    table = f"orchtest{secrets.token_hex(4)}"
    config = LocalNetwork(
        pool="10.215.0.0/30", nft_table=table, claims_dir=str(tmp_path / "claims")
    )  # two links in all
    first = SandboxNetworks(config, str(tmp_path / "one"))
    second = SandboxNetworks(config, str(tmp_path / "two"))
    a = first._allocate("sbx-a")
    b = second._allocate("sbx-b")
    assert {a.slot, b.slot} == {0, 1}
    assert a.sandbox_address != b.sandbox_address
    with pytest.raises(RuntimeFailure, match="no free address"):
        first._allocate("sbx-c")
    assert await first.ids() == {"sbx-a"}
    assert await second.ids() == {"sbx-b"}
    # A runtime removed with its state leaves stale claims: they are taken over.
    shutil.rmtree(tmp_path / "two")
    assert first._allocate("sbx-c").slot == b.slot
    await first.remove("sbx-a")
    await first.remove("sbx-c")
    assert not any((tmp_path / "claims" / table).iterdir())


# -- one sandbox reaching another ------------------------------------------------------------

BETA_TOKEN = "beta-token"  # the second tenant of the tests' configuration (conftest)
# Two listeners in the serving sandbox; it accepts peers on the first only.
SITE = """
import os, socket, selectors
sel = selectors.DefaultSelector()
for port, tag in ((8080, b"S0"), (8081, b"S1")):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(64)
    sel.register(sock, selectors.EVENT_READ, tag)
open("/tmp/listening", "w").close()
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.sendall(key.data)
        conn.close()
"""


def peer_rule(
    sandbox_id: str, *ports: int, expire_in_s: float | None = None
) -> env_pb2.NetworkPolicy:
    policy = allow(f"sandbox:{sandbox_id}", *ports, expire_in_s=expire_in_s)
    policy.egress[0].protocol = env_pb2.PROTOCOL_UNSPECIFIED
    return policy


async def serve_site(env: Any, sandbox_id: str) -> None:
    started = await env.shell(
        sandbox_id,
        f"cat > /tmp/site.py <<'PY'\n{SITE}PY\n"
        "setsid python3 /tmp/site.py </dev/null >/dev/null 2>&1 &\n"
        "for i in $(seq 100); do [ -e /tmp/listening ] && exit 0; sleep 0.05; done; exit 1",
    )
    assert started.status.exit_code == 0, started


async def probe_site(env: Any, sandbox_id: str, address: str) -> str:
    """What the site's two ports answer, as seen from ``sandbox_id``; "--" for nothing."""
    script = (
        f'probe() {{ timeout 1 bash -c "exec 3<>/dev/tcp/{address}/$1 && head -c2 <&3" '
        "2>/dev/null || echo --; }\n"
        "probe 8080 >/tmp/p0 & probe 8081 >/tmp/p1 & wait\necho $(cat /tmp/p0) $(cat /tmp/p1)"
    )
    result = await env.shell(sandbox_id, script)
    assert result.status.exit_code == 0, result
    return str(result.stdout.decode().strip())


async def test_network_a_sandbox_reaches_another_only_through_a_peer_rule_while_it_lasts(
    env_factory: Any, network: Network
) -> None:
    env = await env_factory(runtime=network.runtime)
    site = await env.ready(
        image="host", network_policy=env_pb2.NetworkPolicy(ingress_ports=[8080, 8082])
    )
    address = site.network_address
    assert address == network.runtime.networks._read(site.id).sandbox_address
    await serve_site(env, site.id)
    # A rule with no ports gets every port the site accepts on (8080, 8082), never 8081.
    browser = await env.ready(image="host", network_policy=peer_rule(site.id, expire_in_s=4))
    expires = time.time() + 4
    assert browser.network_address == ""  # it accepts nothing: no address to publish
    wide = env_pb2.NetworkPolicy(
        egress=[env_pb2.EgressRule(destination="0.0.0.0/0"), env_pb2.EgressRule(destination=POOL)]
    )
    stranger = await env.ready(image="host", network_policy=wide)
    assert time.time() < expires - 1.5, "the sandboxes took too long to start for this test"
    assert await probe_site(env, browser.id, address) == "S0 --"
    # An address rule covering the site, however wide, allows nothing into it.
    assert await probe_site(env, stranger.id, address) == "-- --"
    # The site answers its peer but opens nothing itself, not even back to it.
    mine = network.runtime.networks._read(browser.id).sandbox_address
    back = await env.shell(site.id, f"timeout 1 bash -c '</dev/tcp/{mine}/22'; echo $?")
    assert back.stdout.strip() == b"124"
    await asyncio.sleep(expires - time.time() + 0.2)
    assert await probe_site(env, browser.id, address) == "-- --"


async def test_network_an_allowance_outliving_its_peer_reaches_no_later_sandbox(
    env_factory: Any, tmp_path: Path
) -> None:
    # Two links in the pool: the site's successor must get the site's address.
    async with running_network(tmp_path, pool="10.214.16.0/30") as network:
        env = await env_factory(runtime=network.runtime)
        accepts = env_pb2.NetworkPolicy(ingress_ports=[8080])
        site = await env.ready(image="host", network_policy=accepts)
        browser = await env.ready(image="host", network_policy=peer_rule(site.id, 8080))
        await serve_site(env, site.id)
        assert await probe_site(env, browser.id, site.network_address) == "S0 --"
        await env.stub.DeleteSandbox(
            api.DeleteSandboxRequest(sandbox_id=site.id), metadata=env.md()
        )
        successor = await env.ready(image="host", network_policy=accepts)
        assert successor.network_address == site.network_address
        await serve_site(env, successor.id)
        assert await probe_site(env, browser.id, successor.network_address) == "-- --"
        for sandbox in (browser, successor):
            await env.stub.DeleteSandbox(
                api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
            )


async def test_network_peer_rules_are_refused_with_what_to_fix(
    env_factory: Any, network: Network
) -> None:
    env = await env_factory(runtime=network.runtime)
    site = await env.ready(image="host", network_policy=env_pb2.NetworkPolicy(ingress_ports=[8080]))
    plain = await env.ready(image="host")
    await serve_site(env, site.id)
    browser = await env.ready(image="host", network_policy=peer_rule(site.id, 8080))
    beta = dataclasses.replace(env, token=BETA_TOKEN)

    async def refused(call: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        return caught.value.code(), caught.value.details() or ""

    def update(who: Any, sandbox_id: str, policy: env_pb2.NetworkPolicy) -> Any:
        request = api.UpdateNetworkPolicyRequest(sandbox_id=sandbox_id, network_policy=policy)
        return who.stub.UpdateNetworkPolicy(request, metadata=who.md())

    def create(who: Any, policy: env_pb2.NetworkPolicy) -> Any:
        spec = env_pb2.SandboxSpec(image="host", network_policy=policy)
        return who.stub.CreateSandbox(api.CreateSandboxRequest(spec=spec), metadata=who.md())

    code, text = await refused(create(env, peer_rule("sbx-000000000000")))
    assert code == grpc.StatusCode.NOT_FOUND and "sbx-000000000000" in text
    # Another tenant's sandbox is as unknown as one that never existed.
    code, _ = await refused(create(beta, peer_rule(site.id, 8080)))
    assert code == grpc.StatusCode.NOT_FOUND
    code, text = await refused(update(env, browser.id, peer_rule(site.id, 8081)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "ports 8080, none of 8081" in text
    code, text = await refused(update(env, browser.id, peer_rule(plain.id)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no ingress_ports" in text
    code, text = await refused(update(env, browser.id, peer_rule(browser.id)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "itself" in text
    code, text = await refused(update(env, browser.id, peer_rule("")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "names no sandbox id" in text
    changed = env_pb2.NetworkPolicy(ingress_ports=[9000])
    code, text = await refused(update(env, site.id, changed))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fixed at create (8080)" in text
    code, text = await refused(create(env, env_pb2.NetworkPolicy(ingress_ports=[0])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ingress_ports" in text
    # None of that lost the allowance in place, nor the site's ports.
    assert await probe_site(env, browser.id, site.network_address) == "S0 --"
    kept = await update(env, site.id, env_pb2.NetworkPolicy())
    assert list(kept.sandbox.spec.network_policy.ingress_ports) == [8080]
    assert await probe_site(env, browser.id, site.network_address) == "S0 --"
