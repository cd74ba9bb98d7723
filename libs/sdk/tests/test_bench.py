"""``orchard bench env``: the memory cap and the readers it rests on (no root), and a small real
run against a private stack (root, slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.sdk.cli.bench import percentile
from orchard.sdk.cli.host_probe import (
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
        [*CLI, "--sandboxes", "3", "--execs-per-sandbox", "2", "--json", str(out)],
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
