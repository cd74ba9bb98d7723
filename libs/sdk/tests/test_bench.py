"""``orchard bench env``: the memory cap and the readers it rests on (no root), and a small real
run against a private stack (root, slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchard.sdk.cli.bench import lifecycle_cpu, percentile
from orchard.sdk.cli.host_probe import (
    CpuAccounting,
    CpuTimes,
    SandboxCgroups,
    mem_available_bytes,
    plan_concurrency,
    pss_bytes,
)

MiB = 1 << 20
CLI = [sys.executable, "-m", "orchard.sdk.cli", "bench", "env"]


def _meminfo(tmp_path: Path, available_kib: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(
        "MemTotal:       24000000 kB\n"
        "MemFree:        20000000 kB\n"
        f"MemAvailable:   {available_kib} kB\n"
        "Buffers:          100000 kB\n"
    )
    return str(path)


def test_mem_available_reads_kib_as_bytes(tmp_path: Path) -> None:
    assert mem_available_bytes(_meminfo(tmp_path, 1000)) == 1000 * 1024
    (tmp_path / "bad").write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        mem_available_bytes(str(tmp_path / "bad"))


def test_all_at_once_when_memory_suffices(tmp_path: Path) -> None:
    available = mem_available_bytes(_meminfo(tmp_path, 16 * 1024 * 1024))  # 16 GiB
    plan = plan_concurrency(1000, 10 * MiB, available)
    assert (plan.concurrency, plan.capped_by_memory) == (1000, False)
    assert plan.explain() == ""


def test_capped_at_seventy_percent_of_mem_available(tmp_path: Path) -> None:
    available = mem_available_bytes(_meminfo(tmp_path, 1024 * 1024))  # 1 GiB
    plan = plan_concurrency(1000, 10 * MiB, available)
    # 70% of 1024 MiB is 716.8 MiB: 71 sandboxes of 10 MiB.
    assert (plan.concurrency, plan.capped_by_memory) == (71, True)
    assert "capped at 71 (asked 1000)" in plan.explain()
    assert "70% of MemAvailable (1024 MiB)" in plan.explain()


def test_cap_never_below_one_and_never_above_the_request() -> None:
    assert plan_concurrency(50, 10 * MiB, 1 * MiB).concurrency == 1
    assert plan_concurrency(5, 0, 1 * MiB).concurrency == 5
    exactly = plan_concurrency(7, 10 * MiB, 100 * MiB)  # 70 MiB fits exactly 7
    assert (exactly.concurrency, exactly.capped_by_memory) == (7, False)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(101)], 99) == 99.0


def test_pss_of_this_process_and_of_a_missing_one() -> None:
    # Linux 4.14 and later have it; every machine that runs these tests does.
    assert Path("/proc/self/smaps_rollup").exists(), "no /proc/PID/smaps_rollup on this kernel"
    assert pss_bytes(os.getpid()) > MiB
    assert pss_bytes(2**22 + 12345) == 0


def test_sandbox_cgroups_found_by_name(tmp_path: Path) -> None:
    sandbox = tmp_path / "pids" / "svc" / "orchard" / "sbx-1"
    sandbox.mkdir(parents=True)
    (sandbox / "cgroup.procs").write_text("11\n12\n")
    finder = SandboxCgroups(roots=[str(tmp_path / "pids")])
    assert finder.locate("sbx-1")
    assert finder.pids(["sbx-1", "sbx-2"]) == {"sbx-1": {11, 12}}
    assert not SandboxCgroups(roots=[str(tmp_path / "pids")]).locate("sbx-9")


def test_lifecycle_cpu_splits_by_process() -> None:
    delta = {
        "bench_client": CpuTimes(1.0, 0.5),
        "orchard_env": CpuTimes(2.0, 1.0),
        "cgroup_orchard-env": CpuTimes(5.0, 4.0),  # orchard-env and all it started
        "cgroup_etcd": CpuTimes(0.5, 0.5),
        "host": CpuTimes(20.0, 10.0),
    }
    split = lifecycle_cpu(delta, 10)
    assert split["sandboxes"] == {"user": 300.0, "system": 300.0, "total": 600.0}
    # client + the orchard-env group (service and sandboxes) + etcd, per sandbox, in ms
    assert split["all"]["total"] == (1.5 + 9.0 + 1.0) * 100
    assert split["host"]["total"] == 3000.0
    without_groups = lifecycle_cpu({**delta, "cgroup_orchard-env": None}, 10)  # type: ignore[dict-item]
    assert "sandboxes" not in without_groups
    assert "cpuacct" in without_groups["method"]


@pytest.mark.root
def test_cpu_accounting_counts_a_child_and_its_descendants() -> None:
    accounting = CpuAccounting(f"orchard-bench-test-{os.getpid()}")
    assert accounting.available, "no writable cgroup v1 cpuacct hierarchy on this host"
    # A shell that, once moved, starts a busy child: the child inherits the group.
    shell = subprocess.Popen(
        ["sh", "-c", "read go; i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"],
        stdin=subprocess.PIPE,
    )
    try:
        assert accounting.add("work", shell.pid)
        assert accounting.read("work") is not None
        assert shell.stdin is not None
        shell.stdin.write(b"go\n")
        shell.stdin.close()
        assert shell.wait(timeout=60) == 0
        used = accounting.read("work")
        assert used is not None and used.total > 0.05, used
        assert accounting.read("missing") is None
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        accounting.remove()
    time.sleep(0.05)
    assert not os.path.exists(accounting.base)


@pytest.mark.root
@pytest.mark.slow
def test_small_real_run_on_a_private_stack(tmp_path: Path) -> None:
    from orchard.core.etcd import find_etcd_binary

    try:
        find_etcd_binary()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (`make setup` installs etcd)")
    out = tmp_path / "env.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_ENV_")}
    run = subprocess.run(
        [
            *CLI,
            *("--sandboxes", "3", "--execs-per-sandbox", "2", "--json", str(out)),
            *("--exec-sandboxes", "2", "--exec-calls", "5", "--exec-sustained", "10"),
            *("--exec-concurrency", "2", "--exec-burst", "6", "--ready-repeats", "2"),
            *("--fork", "2", "--curve", "2,3", "--profile"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    for key in (
        "sandboxes",
        "execs",
        "success_rate",
        "wall_seconds",
        "create_p50_ms",
        "ready_p50_ms",
        "exec_p50_ms",
        "exec_p99_ms",
        "delete_p50_ms",
        "leaked",
        "peak_rss_mb",
        "idle_sandbox_mb",
        "memory_method",
        "concurrency_capped_by_memory",
        "baseline",
    ):
        assert key in result, key
    assert (result["sandboxes"], result["execs"]) == (3, 6)
    assert result["success_rate"] == 1.0
    assert result["leaked"] == 0, result["leaked_detail"]
    assert result["peak_rss_mb"] > 0 and result["idle_sandbox_mb"] > 0
    assert result["baseline"]["execs"] == 6
    assert "success rate" in run.stdout and "exec p50 vs subprocess.run" in run.stdout
    # The figures, each beside its floor.
    figures = result["figures"]
    exec_ = figures["exec"]
    assert exec_["single_round_trip_p50_ms"] > 0 and exec_["floor"]["single_round_trip_p50_ms"] > 0
    assert exec_["sustained"]["execs_per_second"] > 0 and exec_["floor"]["execs_per_second"] > 0
    assert exec_["burst"]["calls"] == 6 and exec_["burst"]["p50_ms"] > 0
    assert set(exec_["sustained"]["cpu_ms_per_exec"]) >= {"client", "orchard_env", "agents", "all"}
    assert figures["ready"]["create_to_ready_p50_ms"] > 0
    assert figures["ready"]["floor"]["p50_ms"] > 0, figures["ready"]["floor"]
    assert figures["fork"]["count"] == 2 and figures["fork"]["fork_speedup"] > 0, figures["fork"]
    # The cost curve ran both sizes; the CPU per lifecycle includes the sandboxes' (cpuacct).
    assert [entry["sandboxes"] for entry in result["curve"]] == [2, 3]
    assert result["curve"][0]["success_rate"] == 1.0
    cpu = result["cpu_ms_per_lifecycle"]
    assert cpu["sandboxes"]["total"] > 0 and cpu["all"]["total"] > cpu["sandboxes"]["total"]
    assert "CPU ms per exec (all)" in run.stdout and "create -> READY" in run.stdout
    # py-spy flame graphs beside the JSON: orchard-env (lifecycle and exec) and one agent.
    assert set(result["profiles"]) == {"orchard-env", "orchard-env-exec", "agent"}, result["notes"]
    for name in result["profiles"].values():
        assert (tmp_path / name).read_text().lstrip().startswith("<?xml")
