"""EmbeddedEtcd: a real etcd process that starts fast and leaves nothing behind."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from orchard.core.etcd import (
    BINARY_ENV,
    EmbeddedEtcd,
    EmbeddedEtcdCluster,
    EmbeddedEtcdError,
    EtcdStore,
    EtcdUnavailable,
    find_etcd_binary,
)
from orchard.core.etcd import embedded as embedded_module


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_start_stop_leaves_no_process_and_no_data_dir() -> None:
    etcd = EmbeddedEtcd()
    with etcd:
        pid, data_dir = etcd.pid, etcd.data_dir
        assert pid is not None and data_dir.is_dir()
        assert etcd.endpoint.startswith("http://127.0.0.1:")
        assert 0 < etcd.startup_seconds < 5
    assert _gone(pid)
    assert not data_dir.exists()
    assert etcd.pid is None
    etcd.stop()  # idempotent


async def test_two_servers_at_once_are_independent() -> None:
    async with EmbeddedEtcd() as first, EmbeddedEtcd() as second:
        assert first.endpoint != second.endpoint
        async with EtcdStore(first.endpoint) as a, EtcdStore(second.endpoint) as b:
            await a.put("k", "first")
            assert await b.get("k") is None
        pids = (first.pid, second.pid)
    assert all(pid is not None and _gone(pid) for pid in pids)


async def test_given_data_dir_is_kept_and_state_survives_a_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "etcd-data"
    async with EmbeddedEtcd(data_dir=data_dir) as etcd, EtcdStore(etcd.endpoint) as store:
        await store.put("durable", "yes")
    assert data_dir.is_dir()
    async with EmbeddedEtcd(data_dir=data_dir) as etcd, EtcdStore(etcd.endpoint) as store:
        kv = await store.get("durable")
        assert kv is not None and kv.value == b"yes"


def test_failed_start_reports_the_log_and_cleans_up() -> None:
    etcd = EmbeddedEtcd(extra_args=("--no-such-flag",))
    with pytest.raises(EmbeddedEtcdError, match="no-such-flag"):
        etcd.start()
    assert etcd.pid is None
    with pytest.raises(RuntimeError):
        _ = etcd.data_dir


def test_retries_when_it_loses_a_port_race(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = embedded_module._free_ports
        calls: list[int] = []

        def racy(host: str, count: int) -> list[int]:
            calls.append(count)
            ports = real(host, count)
            return [busy, ports[1]] if len(calls) == 1 else ports

        monkeypatch.setattr(embedded_module, "_free_ports", racy)
        with EmbeddedEtcd() as etcd:
            assert not etcd.endpoint.endswith(f":{busy}")
        assert len(calls) == 2


def test_binary_lookup_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_etcd_binary()
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(BINARY_ENV, str(fake))
    assert find_etcd_binary() == fake
    assert find_etcd_binary(real) == real
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=BINARY_ENV):
        find_etcd_binary()


async def test_a_cluster_survives_its_leader_and_leaves_nothing_behind() -> None:
    cluster = EmbeddedEtcdCluster(3)
    async with cluster:
        pids, workdir = cluster.pids, cluster.workdir
        assert len(pids) == 3 and workdir is not None and workdir.is_dir()
        async with EtcdStore(cluster.endpoints, timeout=2.0) as store:
            await store.put("k", "before")
            leader = cluster.leader()
            cluster.kill_member(leader)
            assert cluster.leader() != leader  # the other two elect a new one
            for _ in range(10):
                try:
                    await store.put("k", "after")
                    break
                except EtcdUnavailable:
                    continue
            cluster.start_member(leader)  # back on its own data
            assert len(cluster.running()) == 3
            kv = await store.get("k")
            assert kv is not None and kv.value == b"after"
    assert all(_gone(pid) for pid in pids)
    assert not workdir.exists()
    cluster.stop()  # idempotent
