"""A seeded capture proxy (`sampling_seed`, a job's `PolicySpec.seed`) samples each call of a
rollout with a seed drawn from the proxy's, the rollout (its id without the random tail the
rollout service gives it) and the call's place: the same rollout draws the same tokens in
another job or a retry, concurrent rollouts do not disturb each other, and other rollouts,
other calls and other seeds draw differently. A seeded script draws its paths the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import openai

from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.proxy.sessions import CaptureSession, rollout_draw_key
from orchard.rollout.scripted_policy import PolicyScript

from .conftest import BASH


async def _draws(
    proxy: CaptureProxy, rollout_ids: Sequence[str], calls: int = 2
) -> dict[str, list[tuple[int, ...]]]:
    """Each rollout's `calls` calls at temperature 2 (one after another within a rollout, the
    rollouts at once): the tokens each sampled."""

    async def rollout(rollout_id: str) -> list[tuple[int, ...]]:
        endpoint = proxy.open_session(rollout_id)
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            for _ in range(calls):
                await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "List the files."}],
                    tools=[BASH],
                    temperature=2.0,
                    max_tokens=12,
                )
        records = await proxy.settle(rollout_id, timeout=30)
        proxy.close_session(rollout_id)
        return [r.output_token_ids for r in sorted(records, key=lambda r: r.seq)]

    found = await asyncio.gather(*(rollout(r) for r in rollout_ids))
    return dict(zip(rollout_ids, found, strict=True))


def test_the_draw_key_drops_only_the_rollout_service_s_random_tail() -> None:
    assert rollout_draw_key("swe-3.1.0a1b2c3d4e") == "swe-3.1"
    assert rollout_draw_key("claw-mail-0.12.ffffffffff") == "claw-mail-0.12"
    assert rollout_draw_key("my-rollout") == "my-rollout"  # a client's own id, whole
    seeds = {
        CaptureSession(r).call_seed(7, c)
        for r in ("t.0.aaaaaaaaaa", "t.1.aaaaaaaaaa", "u.0.aaaaaaaaaa")
        for c in (0, 1)
    }
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert CaptureSession("t.0.aaaaaaaaaa").call_seed(7, 1) == CaptureSession(
        "t.0.bbbbbbbbbb"
    ).call_seed(7, 1)


async def test_a_seeded_proxy_replays_each_rollout_s_draws(engine) -> None:
    config = CaptureProxyConfig(settle_quiet_s=0.05, sampling_seed=11)
    async with CaptureProxy(engine, config) as proxy:
        first = await _draws(proxy, ["task.0.0000000001", "task.1.0000000001"])
        # The same rollouts in another job (new random tails), now beside a third.
        again = await _draws(
            proxy, ["task.1.00000000aa", "other.0.00000000aa", "task.0.00000000aa"]
        )
    assert again["task.0.00000000aa"] == first["task.0.0000000001"]
    assert again["task.1.00000000aa"] == first["task.1.0000000001"]
    zero, one = first["task.0.0000000001"], first["task.1.0000000001"]
    assert zero != one  # another rollout of the task draws differently
    assert zero[0] != zero[1]  # and so does another call of the same rollout
    async with CaptureProxy(engine, config.model_copy(update={"sampling_seed": 12})) as proxy:
        reseeded = await _draws(proxy, ["task.0.0000000001"])
    assert reseeded["task.0.0000000001"] != zero
    async with CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy:
        fresh = await _draws(proxy, ["task.0.0000000001", "task.0.0000000002"])
    assert fresh["task.0.0000000001"] != fresh["task.0.0000000002"]  # unseeded: fresh draws


async def test_a_seeded_script_draws_each_rollout_s_path_from_the_rollout(tokenizer) -> None:
    script = PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "List the files",
                    "solve_rate": 0.5,
                    "solution": [{"thought": "I solve it."}],
                    "failure": [{"thought": "I fail it."}],
                }
            ]
        }
    )

    async def paths(rollout_ids: Sequence[str]) -> list[str]:
        engine = ScriptedEngine(script, tokenizer, seed=3)
        config = CaptureProxyConfig(settle_quiet_s=0.05, sampling_seed=3)
        async with CaptureProxy(engine, config) as proxy:
            drawn = await _draws(proxy, rollout_ids, calls=1)
        return [tokenizer.decode(list(drawn[r][0])) for r in rollout_ids]

    ids = [f"t.{k}.0123456789" for k in range(12)]
    forward = await paths(ids)
    assert {"I solve it." in p for p in forward} == {True, False}
    # Another order and other tails: each rollout keeps its path.
    backward = await paths([f"t.{k}.abcdefabcd" for k in reversed(range(12))])
    assert backward == forward[::-1]
