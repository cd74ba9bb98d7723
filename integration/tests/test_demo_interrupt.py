"""`make demo` stopped by SIGTERM while sandboxes run: it exits at once with 143 and leaves no
process of its stack (etcd, orchard-env, orchard-reward, orchard-rollout, orchard-trainer,
sandboxes) and no cgroup behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CGROUPS = Path("/sys/fs/cgroup")


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _demo_cgroups() -> set[str]:
    """Demo cgroup parents, on cgroup v2 (one tree) or v1 (one tree per controller)."""
    return {
        p.name for pattern in ("orchard-demo-*", "*/orchard-demo-*") for p in CGROUPS.glob(pattern)
    }


def test_sigterm_mid_collect_stops_the_whole_stack(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the demo's local runtime needs root: run the tests as root")
    out = tmp_path / "demo"
    before = _demo_cgroups()
    log = (tmp_path / "demo.log").open("w+")
    demo = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "demo.py"), "--out", str(out), "--workers", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        # Wait until the teacher's rollouts run (sandboxes exist), then stop it.
        deadline = time.monotonic() + 180
        collect = out / "builtin-swe" / "collect"
        while time.monotonic() < deadline and demo.poll() is None:
            if collect.is_dir() and _demo_cgroups() - before:
                break
            time.sleep(0.5)
        assert demo.poll() is None, Path(log.name).read_text()[-3000:]
        assert _demo_cgroups() - before, "the demo never started sandboxes"
        time.sleep(3)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=90) == 143, Path(log.name).read_text()[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        log.close()
    # Give exiting children a moment to be reaped.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _processes_naming(str(out)):
        time.sleep(0.2)
    assert _processes_naming(str(out)) == []
    assert _demo_cgroups() - before == set()
    assert not (out / "builtin-swe" / "collect" / "done.json").exists()
