"""ListTaskSuites on the REAL reward gRPC server: the built-in SWE suite with facts taken from
its generator, so a client checks `tasks.builtin` without importing the generator, and every
fact listed holds for the tasks the generator makes."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.reward.config import RewardConfig
from orchard.reward.main import RewardApplication
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.tasks.swe_suite import generate_suite


async def list_task_suites() -> api.ListTaskSuitesResponse:
    """ListTaskSuites of a real reward server on loopback."""
    config = RewardConfig(server=ServerConfig(listen=["127.0.0.1:0"]))
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            stub = reward_service_pb2_grpc.RewardServiceStub(channel)
            return await stub.ListTaskSuites(api.ListTaskSuitesRequest(), timeout=10)


async def test_list_task_suites_lists_the_builtin_suite_as_its_generator_makes_it() -> None:
    reply = await list_task_suites()

    assert [s.name for s in reply.suites] == ["builtin:claw", "builtin:gui", "builtin:swe"]
    suite = reply.suites[2]
    assert suite.description and suite.scored_by == "ScoreTests"
    assert (suite.min_tasks, suite.max_tasks) == (1, 10_000)
    families = [f.name for f in suite.families]
    assert families == ["boundary", "operator", "off_by_one", "empty_input", "round_trip"]
    assert all(f.description for f in suite.families)

    # What the list says is what the generator does: families cycle in the listed order,
    # with the listed difficulties, and the tasks name the listed parser.
    difficulty = {f.name: f.difficulty for f in suite.families}
    tasks = generate_suite(2 * len(families), seed=4)
    assert [t.family for t in tasks[: len(families)]] == families
    assert all(t.difficulty == difficulty[t.family] for t in tasks)
    assert Counter(t.family for t in tasks) == dict.fromkeys(families, 2)
    assert sorted(difficulty.values()) == [1, 1, 2, 2, 3]
    for count in (suite.min_tasks - 1, suite.max_tasks + 1):
        with pytest.raises(ValueError, match="count must lie in"):
            generate_suite(count)


async def test_list_task_suites_lists_the_claw_suite_as_its_generator_makes_it() -> None:
    from orchard.tasks.claw.suite import generate_suite as generate_claw

    reply = await list_task_suites()
    suite = next(s for s in reply.suites if s.name == "builtin:claw")
    assert suite.scored_by == "ScoreTask" and suite.description
    assert (suite.min_tasks, suite.max_tasks) == (1, 10_000)
    difficulty = {f.name: f.difficulty for f in suite.families}
    assert len(difficulty) == 12 and set(difficulty.values()) == {1, 2, 3}
    assert all(f.description for f in suite.families)
    tasks = generate_claw(24, seed=1)
    assert [t.family for t in tasks[:12]] == [f.name for f in suite.families]
    assert all(t.difficulty == difficulty[t.family] for t in tasks)


async def test_list_task_suites_lists_the_gui_suite_as_its_generator_makes_it() -> None:
    from orchard.tasks.gui.suite import generate_suite as generate_gui

    reply = await list_task_suites()
    suite = next(s for s in reply.suites if s.name == "builtin:gui")
    assert suite.scored_by == "JudgeOutcome" and suite.description
    assert (suite.min_tasks, suite.max_tasks) == (1, 1500)
    difficulty = {f.name: f.difficulty for f in suite.families}
    tasks = generate_gui(len(difficulty), seed=2)
    assert [t.family for t in tasks] == list(difficulty)
    assert all(t.difficulty == difficulty[t.family] for t in tasks)
    assert set(difficulty.values()) == {1, 2, 3}
