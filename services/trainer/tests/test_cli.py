"""`orchard-trainer sft` as a person runs it: a dataset file in, a log, a plot and a summary out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.trainer.datasets import write_trajectories
from orchard.trainer.telemetry import read_run_log

CLI = [sys.executable, "-m", "orchard.trainer.cli"]
# An engine built earlier in this test process left its launcher variables (and a TCP store on
# MASTER_PORT) behind; the command must start a world of its own.
LAUNCHER = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCHER}


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
        env=ENV,
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
        env=ENV,
    )
    assert proc.returncode == 2
    assert f"{data}:2: not a trajectory" in proc.stderr
    assert not (tmp_path / "run" / "run.jsonl").exists()


def _tool_row(build, tid, task, tool, *, tokens, repository):
    t = build(
        [build.Turn(inputs=list(range(tokens - 1)), outputs=[7])],
        trajectory_id=tid,
        task_id=task,
    )
    t.turns[0].tool_calls.add(id="c", name=tool, arguments_json='{"command": "ls"}')
    t.metadata["repository"] = repository
    return t


def test_curate_command_writes_the_surviving_rows_and_a_report(tmp_path, build):
    from orchard.trainer.datasets import read_trajectories

    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps([{"name": "bash", "parameters": {"type": "object", "required": ["command"]}}])
    )
    rows = [
        _tool_row(build, "a1", "a", "bash", tokens=6, repository="r1"),
        _tool_row(build, "a2", "a", "bash", tokens=4, repository="r1"),
        _tool_row(build, "b1", "b", "python", tokens=4, repository="r1"),
        _tool_row(build, "c1", "c", "bash", tokens=40, repository="r2"),
        _tool_row(build, "d1", "d", "bash", tokens=5, repository="r1"),
        _tool_row(build, "e1", "e", "bash", tokens=5, repository="r2"),
    ]
    data, out, report = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "report.json"
    write_trajectories(data, rows)
    proc = subprocess.run(
        [
            *CLI,
            *("curate", "--data", str(data), "--output", str(out)),
            *("--token-limit", "20", "--tools", f"builtin:swe={tools}", "--parsable"),
            *("--shortest-successful", "--cap-per-source", "1"),
            *("--curation-report", str(report)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    assert [t.id for t in read_trajectories(out)] == ["a2", "e1"]
    summary = json.loads(proc.stdout)
    assert (summary["rows_in"], summary["rows_out"]) == (6, 2)
    steps = [(s["step"].split("(")[0], s["by_reason"]) for s in summary["steps"]]
    assert steps == [
        ("token_limit", {"over_token_limit": 1}),
        ("parsable_actions", {}),
        ("known_tools", {"unknown_tool": 1}),
        ("shortest_successful", {"longer_success": 1}),
        ("cap_per_source", {"over_source_cap": 1}),
    ]
    assert json.loads(report.read_text()) == summary["steps"]
    assert "b1: unknown_tool: turn 0 calls 'python'; the tools are bash" in proc.stderr


def test_curate_command_refuses_bad_settings_with_a_reason(tmp_path, build):
    data = tmp_path / "in.jsonl"
    write_trajectories(data, [build([build.Turn(inputs=[1], outputs=[2])])])
    out = str(tmp_path / "out.jsonl")
    for flags, message in [
        ((), "no curation step chosen"),
        (("--tools", str(tmp_path / "absent.json")), "cannot read tool schema"),
        (("--cap-per-source", "0"), "the cap per source must be at least 1"),
    ]:
        proc = subprocess.run(
            [*CLI, "curate", "--data", str(data), "--output", out, *flags],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=ENV,
        )
        assert proc.returncode == 2, flags
        assert message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_sft_command_trains_on_the_curated_rows(tmp_path, synthetic):
    rows = synthetic(12, seed=3)
    for k, t in enumerate(rows):
        t.metadata["repository"] = f"r{k % 3}"
    data = tmp_path / "data.jsonl"
    write_trajectories(data, rows)
    proc = subprocess.run(
        [
            *CLI,
            *("sft", "--data", str(data), "--output", str(tmp_path / "run"), "--steps", "1"),
            *("--micro-batch", "2", "--vocab-size", "48", "--no-progress"),
            *("--cap-per-source", "2", "--per-turn"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    # Three sources, two rows each; each failed row trains only its rise turn: one sample.
    assert summary["samples"] == 6
    assert summary["curation"][0]["by_reason"] == {"over_source_cap": 6}
