"""tools/gpu-check.sh stops at once, installing nothing, where there is no GPU; the RL loop it
runs (tools/gpu_check.py) runs for real on the CPU engine here: every step samples, trains with
DeepSpeed, saves and loads a new version, and the trainer's logprobs match the engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("smi", "words"),
    [
        ("orchard-no-such-nvidia-smi", "no NVIDIA GPU here"),
        ("false", "cannot reach a GPU"),  # a driver that does not answer
    ],
)
def test_the_gpu_check_fails_loudly_without_a_gpu(tmp_path: Path, smi: str, words: str) -> None:
    venv = tmp_path / "venv"
    env = {**os.environ, "NVIDIA_SMI": smi, "GPU_CHECK_VENV": str(venv)}
    done = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("gpu-check: ") and words in done.stderr
    assert not venv.exists()


def test_the_rl_loop_runs_on_the_cpu_engine(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable, str(REPO / "tools" / "gpu_check.py"), "--engine", "local",
            "--steps", "2", "--prompts", "3", "--group", "4", "--max-tokens", "12",
            "--hidden", "128", "--layers", "2",
        ],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["engine"], summary["device"]) == ("local", "cpu")
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    for step in summary["steps"]:
        assert step["sampled_tokens"] > 0 and step["tokens_per_s"] > 0
        assert step["weight_sync_s"] >= step["save_s"] > 0
        # the trainer scores the sampled tokens as the engine did (same weights, fp32)
        assert step["logprob_gap"] < 1e-4
    assert "weight sync" in done.stdout
    # the model folders are removed (torch may leave its own compile cache folder)
    assert list(tmp_path.glob("orchard-gpu-check-*")) == []
