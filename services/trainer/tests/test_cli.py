"""`orchard-trainer sft` as a person runs it: a dataset file in, a log, a plot and a summary out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.trainer.datasets import write_trajectories
from orchard.trainer.telemetry import read_run_log

CLI = [sys.executable, "-m", "orchard.trainer.cli"]


@pytest.mark.slow
def test_sft_command_trains_and_writes_log_plot_and_summary(tmp_path, synthetic):
    data = tmp_path / "data.jsonl"
    write_trajectories(data, synthetic(24, seed=5))
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *CLI,
            *("sft", "--data", str(data), "--output", str(out), "--steps", "4"),
            *("--micro-batch", "4", "--accumulate", "2", "--zero-stage", "1"),
            *("--vocab-size", "48", "--lr", "5e-3", "--warmup", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert summary["samples"] == 24
    assert summary["steps"] == 4
    records = read_run_log(Path(summary["run_log"]))
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert records[0].learning_rate == 0.0 and records[1].learning_rate == pytest.approx(5e-3)
    assert Path(summary["plot"]).read_bytes()[:4] == b"\x89PNG"
    # The progress bar went to stderr.
    assert "sft sft" in proc.stderr and "4/4" in proc.stderr


def test_sft_command_names_the_bad_line_of_a_dataset(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "t0"}\n{"id": "t1", "turns": "not a list"}\n')
    proc = subprocess.run(
        [*CLI, "sft", "--data", str(data), "--output", str(tmp_path / "run"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert f"{data}:2: not a trajectory" in proc.stderr
    assert not (tmp_path / "run" / "run.jsonl").exists()
