"""The service's parts without the environment service: spec validation, the job store in a
REAL etcd (the session's embedded one), and groups as the consumer sees them."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.rollout.capture import CallRecord
from orchard.rollout.config import RolloutConfig
from orchard.rollout.provenance import FailureLayer, InfraFailure, RewardRecord, RolloutRecord
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.runs import JobCancelled, JobState, JobStore, group_proto
from orchard.rollout.samplers import (
    BalancedAdaptiveSampler,
    FixedNSampler,
    GroupChoice,
    MemberChoice,
    SampledGroup,
    StopRule,
)
from orchard.rollout.service import builtin_harnesses, validate_spec
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.types.v1 import reward_pb2, trajectory_pb2

CHECK = json.dumps({"check": {"command": "true"}})
TESTS = json.dumps({"tests": {"instance_id": "x", "base_commit": "abc", "fail_to_pass": ["t::a"]}})


def spec(**changes: Any) -> api.RolloutJobSpec:
    base = api.RolloutJobSpec(
        tasks=[api.RolloutTask(id="t1", instruction="do it", scorer_json=CHECK)],
        harnesses=["builtin:bash"],
    )
    for name, value in changes.items():
        if name in ("tasks", "harnesses"):
            del getattr(base, name)[:]
            getattr(base, name).extend(value)
        elif name in ("policy_spec", "sampler"):
            getattr(base, name).CopyFrom(value)
        else:
            setattr(base, name, value)
    return base


def validate(s: api.RolloutJobSpec, **config: Any) -> Any:
    return validate_spec(s, RolloutConfig(**config), builtin_harnesses(60))


def test_a_spec_gets_the_configured_defaults() -> None:
    valid = validate(spec())
    assert valid.pairs == [GroupKey("t1", "builtin:bash")]
    assert valid.policy == "local" and valid.concurrency == 8
    assert (valid.budget.max_steps, valid.budget.max_duration_s) == (30, 600.0)
    assert valid.sampler == BalancedAdaptiveSampler()
    assert valid.group_filter is not None


def test_an_unset_sampler_is_bar_with_the_mixed_rule_random_members_and_threshold_0_5() -> None:
    sampler = validate(spec()).sampler
    assert isinstance(sampler, BalancedAdaptiveSampler)
    assert (sampler.stop_rule, sampler.member_choice) == (StopRule.MIXED, MemberChoice.RANDOM)
    assert (sampler.group_size, sampler.stride, sampler.max_rollouts) == (8, 8, 16)
    assert sampler.positive_threshold == 0.5 and sampler.seed is None


@pytest.mark.parametrize("kind", [api.SAMPLER_KIND_FIXED_N, api.SAMPLER_KIND_BAR])
@pytest.mark.parametrize("threshold", [0.0, 0.75, 1.0])
def test_the_success_threshold_sent_is_the_one_the_sampler_applies(
    kind: int, threshold: float
) -> None:
    config = api.SamplerConfig(kind=kind, group_size=4, positive_threshold=threshold)
    sampler = validate(spec(sampler=config)).sampler
    assert isinstance(sampler, FixedNSampler | BalancedAdaptiveSampler)
    assert sampler.positive_threshold == threshold  # 0 too: the field's presence is tracked


def test_bar_options_travel_in_the_sampler_config() -> None:
    config = api.SamplerConfig(
        kind=api.SAMPLER_KIND_BAR,
        group_size=4,
        max_rollouts=12,
        stride=3,
        stop_rule=api.BAR_STOP_RULE_BAND,
        member_choice=api.BAR_MEMBER_CHOICE_RANKED,
        seed=42,
    )
    sampler = validate(spec(sampler=config)).sampler
    assert sampler == BalancedAdaptiveSampler(
        group_size=4,
        max_rollouts=12,
        stride=3,
        stop_rule=StopRule.BAND,
        member_choice=MemberChoice.RANKED,
        seed=42,
    )
    config.stop_rule = api.BAR_STOP_RULE_MIXED
    config.member_choice = api.BAR_MEMBER_CHOICE_RANDOM
    sampler = validate(spec(sampler=config)).sampler
    assert isinstance(sampler, BalancedAdaptiveSampler)
    assert (sampler.stop_rule, sampler.member_choice) == (StopRule.MIXED, MemberChoice.RANDOM)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            api.SamplerConfig(positive_threshold=1.5),
            "positive_threshold must be a number in [0, 1]",
        ),
        (api.SamplerConfig(positive_threshold=float("nan")), "got nan"),
        (api.SamplerConfig(positive_threshold=-0.5, kind=api.SAMPLER_KIND_FIXED_N), "got -0.5"),
        (api.SamplerConfig(stop_rule=7), "stop_rule 7 is not MIXED or BAND"),  # type: ignore[arg-type]
        (
            api.SamplerConfig(member_choice=9),  # type: ignore[arg-type]
            "member_choice 9 is not RANDOM or RANKED",
        ),
        (api.SamplerConfig(stride=-1), "stride must be at least 1"),
    ],
)
def test_bad_sampler_configs_are_invalid_arguments(config: api.SamplerConfig, words: str) -> None:
    with pytest.raises(OrchardError) as info:
        validate(spec(sampler=config))
    assert info.value.reason is Reason.INVALID_ARGUMENT
    assert words in info.value.message


def test_keeping_every_group_turns_the_filter_off() -> None:
    s = spec()
    s.sampler.keep_uninformative_groups = True
    s.sampler.kind = api.SAMPLER_KIND_FIXED_N
    s.sampler.group_size = 3
    valid = validate(s)
    assert valid.group_filter is None and valid.sampler.name == "fixed_n"


@pytest.mark.parametrize(
    ("s", "reason", "words"),
    [
        (spec(harnesses=["builtin:nope"]), Reason.INVALID_ARGUMENT, "known harnesses"),
        (spec(policy="nope"), Reason.INVALID_ARGUMENT, "configured policies: local"),
        (
            spec(tasks=[api.RolloutTask(id="t", instruction="i", scorer_json=TESTS)]),
            Reason.FAILED_PRECONDITION,
            "set reward.endpoint",
        ),
        (
            spec(tasks=[api.RolloutTask(id="t", instruction="i", scorer_json="{}")]),
            Reason.INVALID_ARGUMENT,
            "exactly one of",
        ),
        (
            spec(
                tasks=[
                    api.RolloutTask(id="t", instruction="i", scorer_json=CHECK),
                    api.RolloutTask(id="t", instruction="i", scorer_json=CHECK),
                ]
            ),
            Reason.INVALID_ARGUMENT,
            "appears twice",
        ),
        (spec(concurrency=100_000), Reason.INVALID_ARGUMENT, "spec.concurrency"),
    ],
)
def test_bad_specs_say_what_to_fix(s: api.RolloutJobSpec, reason: Reason, words: str) -> None:
    with pytest.raises(OrchardError) as info:
        validate(s)
    assert info.value.reason is reason
    assert words in info.value.message


@pytest.mark.parametrize(
    "task_id", ["claw/0/reply_mail/3", "a.b:c-d_e", "x" * 200, "swe/django__django-1234"]
)
def test_task_ids_may_be_paths_of_plain_segments(task_id: str) -> None:
    s = spec(tasks=[api.RolloutTask(id=task_id, instruction="i", scorer_json=CHECK)])
    assert list(validate(s).tasks) == [task_id]


@pytest.mark.parametrize(
    "task_id",
    ["", "/abs", "a//b", "a/../b", "a/./b", "..", "a/", "a b", "a\x1fb", "x" * 201, "a/.hidden"],
)
def test_task_ids_with_empty_dot_or_odd_segments_are_refused(task_id: str) -> None:
    s = spec(tasks=[api.RolloutTask(id=task_id, instruction="i", scorer_json=CHECK)])
    with pytest.raises(OrchardError) as info:
        validate(s)
    assert info.value.reason is Reason.INVALID_ARGUMENT
    assert "in segments joined by '/'" in info.value.message


def test_a_tests_task_is_accepted_with_a_reward_service() -> None:
    s = spec(tasks=[api.RolloutTask(id="t", instruction="i", scorer_json=TESTS)])
    valid = validate(s, reward={"endpoint": "127.0.0.1:7200"})
    check = valid.tasks["t"].check
    assert check.task.base_commit == "abc" and list(check.task.fail_to_pass) == ["t::a"]
    assert check.repo_path == "/testbed"


def weights(model: str = "run-student", version: str = "v1", **fields: Any) -> api.PolicySpec:
    return api.PolicySpec(weights=api.RegistryWeights(model=model, version=version), **fields)


def test_one_rollout_per_task_is_an_evaluation_never_a_training_group() -> None:
    single = api.SamplerConfig(kind=api.SAMPLER_KIND_FIXED_N, group_size=1)
    with pytest.raises(OrchardError, match="carries no signal"):
        validate(spec(sampler=single))
    single.keep_uninformative_groups = True
    valid = validate(spec(sampler=single))
    assert valid.group_filter is None and valid.sampler.group_size == 1


def test_a_job_brings_its_own_weight_version() -> None:
    valid = validate(spec(policy_spec=weights(temperature=0.0, max_tokens_per_call=64)))
    key = valid.job_policy
    assert valid.policy == "" and key is not None
    assert (key.model, key.version, key.temperature, key.max_tokens_per_call) == (
        "run-student",
        "v1",
        0.0,
        64,
    )
    # Unset temperature and output budget: sampling at 1 with the service's call budget.
    key = validate(spec(policy_spec=weights(version=""))).job_policy
    assert key is not None and (key.version, key.temperature, key.max_tokens_per_call) == (
        "",
        1.0,
        1024,
    )


def test_a_job_brings_an_endpoint_with_its_key_named_not_given() -> None:
    endpoint = api.ChatEndpoint(
        base_url="https://api.example.com/v1", model="big", api_key_env="TEACHER_KEY"
    )
    key = validate(spec(policy_spec=api.PolicySpec(endpoint=endpoint))).job_policy
    assert key is not None
    assert (key.base_url, key.model, key.api_key_env) == (
        "https://api.example.com/v1",
        "big",
        "TEACHER_KEY",
    )
    assert key.name == "big at https://api.example.com/v1"
    bad = api.ChatEndpoint(base_url="https://api.example.com/v1", model="m", api_key_env="A-B")
    with pytest.raises(OrchardError, match="not an environment variable name"):
        validate(spec(policy_spec=api.PolicySpec(endpoint=bad)))


@pytest.mark.parametrize(
    ("s", "config", "reason", "words"),
    [
        (spec(policy="local", policy_spec=weights()), {}, Reason.INVALID_ARGUMENT, "one of them"),
        (spec(policy_spec=api.PolicySpec()), {}, Reason.INVALID_ARGUMENT, "needs weights"),
        (
            spec(policy_spec=api.PolicySpec(endpoint=api.ChatEndpoint(base_url="127.0.0.1:80"))),
            {},
            Reason.INVALID_ARGUMENT,
            "http(s) URL",
        ),
        (spec(policy_spec=weights(model="a/b")), {}, Reason.INVALID_ARGUMENT, "model name"),
        (
            spec(policy_spec=weights(temperature=2.5)),
            {},
            Reason.INVALID_ARGUMENT,
            "must lie in [0, 2]",
        ),
        (
            spec(policy_spec=weights()),
            {"job_policies": {"allow": False}},
            Reason.FAILED_PRECONDITION,
            "job_policies.allow is false",
        ),
    ],
)
def test_bad_job_policies_say_what_to_fix(
    s: api.RolloutJobSpec, config: dict[str, Any], reason: Reason, words: str
) -> None:
    with pytest.raises(OrchardError) as info:
        validate(s, **config)
    assert info.value.reason is reason
    assert words in info.value.message


def test_a_task_goes_to_a_job_and_back_unchanged() -> None:
    from orchard.rollout.harnesses.tools import CommandTool
    from orchard.rollout.tasks import TaskSpec

    tool = CommandTool.from_declaration(
        {
            "name": "lookup",
            "description": "look a word up",
            "parameters": {"type": "object", "properties": {}},
            "command": ["/bin/cat"],
            "timeout_s": 5,
        }
    )
    tests = TaskSpec.from_settings("t", "fix it", json.loads(TESTS) | {"workdir": "/testbed"})
    tasks = [
        tests,
        TaskSpec.from_settings(
            "c", "check it", {"check": {"command": "true", "timeout_s": 9}, "setup": ["mkdir /w"]}
        ),
        TaskSpec.from_settings("s", "score it", {"score_task": "calc-1", "memory": "256M"}),
        TaskSpec("g", "use the tool", tests.check, image="img:1", tools=(tool,)),
    ]
    for task in tasks:
        assert TaskSpec.from_proto(task.to_proto()) == task
    with pytest.raises(ValueError, match="absolute"):
        TaskSpec.from_settings("t", "i", json.loads(CHECK) | {"workdir": "testbed"})


def test_a_job_record_read_again_gives_its_own_copy_of_the_current_spec() -> None:
    # Reads of a job record reuse the parsed spec while its JSON form is unchanged: each read
    # still gets a message of its own, and a record whose spec changed is parsed anew.
    spec = api.RolloutJobSpec(tasks=[api.RolloutTask(id="t1", instruction="fix")])
    text = JobState(id="job-copy", spec=spec).to_json()
    first, second = JobState.from_json(text), JobState.from_json(text)
    assert first.spec == spec and second.spec == spec
    first.spec.tasks[0].instruction = "changed by a reader"
    assert second.spec.tasks[0].instruction == "fix"
    assert JobState.from_json(text).spec.tasks[0].instruction == "fix"
    spec.tasks.add(id="t2", instruction="more")
    assert [
        t.id for t in JobState.from_json(JobState(id="job-copy", spec=spec).to_json()).spec.tasks
    ] == ["t1", "t2"]


def test_a_task_workdir_is_where_the_shell_runs_unless_the_harness_has_its_own() -> None:
    from orchard.rollout.harnesses.bash_react import shell_harness
    from orchard.rollout.harnesses.tools import BashTool

    harness = builtin_harnesses(60)["builtin:swe"]
    moved = harness.in_directory("/testbed")
    assert [t.cwd for t in moved.tools if isinstance(t, BashTool)] == ["/testbed"]
    assert harness.in_directory("") is harness
    own = shell_harness(cwd="/repo").in_directory("/testbed")
    assert [t.cwd for t in own.tools if isinstance(t, BashTool)] == ["/repo"]


@pytest.fixture
async def jobs(etcd: EmbeddedEtcd) -> AsyncIterator[JobStore]:
    async with EtcdStore(etcd.endpoint, namespace=f"rollout-test-{uuid.uuid4().hex}/") as store:
        yield JobStore(store)


async def test_jobs_and_their_groups_live_in_etcd(jobs: JobStore) -> None:
    job = JobState(id="j1", spec=spec(), request_id="r1", pairs_total=2)
    assert (await jobs.create(job)).id == "j1"
    # The same request id returns the job it created.
    again = await jobs.create(JobState(id="j2", spec=spec(), request_id="r1"))
    assert again.id == "j1"
    assert await jobs.get("j2") is None
    for task_id in ("a", "b", "c"):
        job.pairs_done.append(task_id)
        group = trajectory_pb2.TrajectoryGroup(id=f"g-{task_id}", task_id=task_id)
        await jobs.emit(job, group)
    stored = await jobs.get("j1")
    assert stored is not None
    assert (stored.groups_emitted, stored.pairs_done) == (3, ["a", "b", "c"])
    assert stored.spec == spec() and stored.state == api.ROLLOUT_JOB_STATE_RUNNING
    assert [(i, g.id) for i, g in await jobs.groups("j1", 0)] == [
        (0, "g-a"),
        (1, "g-b"),
        (2, "g-c"),
    ]
    assert [(i, g.id) for i, g in await jobs.groups("j1", 2, page_size=1)] == [(2, "g-c")]
    assert await jobs.groups("j1", 3) == []
    proto = stored.to_proto()
    assert (proto.pairs_total, proto.pairs_done, proto.groups_emitted) == (2, 3, 3)
    # Once cancelled, the runner's writes are refused: the cancel is never overwritten.
    await jobs.mark_cancelled("j1")
    with pytest.raises(JobCancelled):
        await jobs.emit(job, trajectory_pb2.TrajectoryGroup(id="late"))
    with pytest.raises(JobCancelled):
        await jobs.put_running(job)
    assert job.groups_emitted == 3
    assert [g.id for _, g in await jobs.groups("j1", 0)] == ["g-a", "g-b", "g-c"]


def _call(rollout_id: str, seq: int, prompt: tuple[int, ...], out: tuple[int, ...]) -> CallRecord:
    return CallRecord(
        rollout_id=rollout_id,
        call_id=f"{rollout_id}-{seq}",
        seq=seq,
        prompt_token_ids=prompt,
        output_token_ids=out,
        output_logprobs=tuple(-0.5 for _ in out),
        weight_version="v3",
        finish_reason="stop",
        started_at=1.0 + seq,
        latency_s=0.1,
    )


def _member(index: int, status: RolloutStatus, reward: float | None) -> RolloutResult:
    rollout_id = f"t.{index}"
    record = RolloutRecord(rollout_id=rollout_id, task_id="t", harness="builtin:bash")
    record.status = status
    record.outcome = "submitted"
    if reward is not None:
        record.reward = RewardRecord(value=reward, scorer="tests", detail="ok")
        record.calls = [
            _call(rollout_id, 0, (1, 2, 3), (10, 11)),
            _call(rollout_id, 1, (1, 2, 3, 10, 11, 4), (12,)),
        ]
    else:
        record.failure = InfraFailure(FailureLayer.REWARD, "reward excluded (timeout): slow", 1)
    return RolloutResult(
        GroupKey("t", "builtin:bash"), index, status, reward, 3, rollout_id, payload=record
    )


def test_a_group_carries_the_captured_tokens_rewards_and_advantages() -> None:
    members = (
        _member(0, RolloutStatus.COMPLETED, 1.0),
        _member(1, RolloutStatus.COMPLETED, -1.0),
        _member(2, RolloutStatus.ABORTED, None),
    )
    sampled = SampledGroup(
        GroupKey("t", "builtin:bash"), members, GroupChoice.RELAXED, members, "bar", 0.5
    )
    group = group_proto("job1", sampled)
    assert (group.sampler, group.positive_fraction) == ("bar:relaxed", 0.5)
    first, second, aborted = group.trajectories
    assert [list(t.output_token_ids) for t in first.turns] == [[10, 11], [12]]
    # The second turn's input is only what was added after the first call's output.
    assert list(first.turns[1].input_token_ids) == [4]
    assert (first.reward.value, first.advantage) == (1.0, 1.0)
    assert (second.reward.value, second.advantage) == (-1.0, -1.0)
    assert first.metadata["weight_versions"] == "v3"
    assert aborted.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert aborted.reward.exclusion == reward_pb2.EXCLUSION_REASON_ABORTED
    assert "reward: reward excluded (timeout)" in aborted.reward.detail
    assert aborted.advantage == 0.0 and not aborted.turns
    assert aborted.outcome == trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED
    assert {t.group_id for t in group.trajectories} == {group.id}
    assert group.no_signal_reason == ""  # two scored members, rewarded differently
    # A group whose scored members all got one reward says why it carries no signal.
    same = (_member(0, RolloutStatus.COMPLETED, 1.0), _member(1, RolloutStatus.COMPLETED, 1.0))
    sampled = SampledGroup(GroupKey("t", "builtin:bash"), same, GroupChoice.ALL, same, "fixed_n", 1)
    assert "no variance" in group_proto("job1", sampled).no_signal_reason
    one = (_member(0, RolloutStatus.COMPLETED, 1.0), _member(1, RolloutStatus.ABORTED, None))
    sampled = SampledGroup(GroupKey("t", "builtin:bash"), one, GroupChoice.ALL, one, "fixed_n", 1)
    assert "fewer than 2" in group_proto("job1", sampled).no_signal_reason


async def test_job_policies_share_an_engine_and_wait_for_a_free_one() -> None:
    """The engine pool of job policies: jobs of one key share one engine, the last user closes
    it, and a key beyond `max_engines` waits until one closes. The engines are stand-ins that
    record their closing; the real ones run in integration/tests/test_rollout_service.py."""
    import asyncio

    from orchard.rollout.engine_pool import EnginePool, StartedPolicy
    from orchard.rollout.harnesses.tool_loop import ModelEndpoint
    from orchard.rollout.metrics import RolloutMetrics
    from orchard.rollout.service import JobPolicyKey

    closed: list[str] = []

    class Recorded(StartedPolicy):
        async def close(self) -> None:
            closed.append(self.endpoint.model)

    class Pool(EnginePool):
        async def start_job_policy(self, key: JobPolicyKey) -> StartedPolicy:
            started.append(key.version)
            return Recorded(ModelEndpoint("http://127.0.0.1:1/v1", key.version))

    started: list[str] = []
    pool = Pool(RolloutConfig(job_policies={"max_engines": 1}), RolloutMetrics(None))
    one, two = (JobPolicyKey("m", v, 1.0, 64) for v in ("v1", "v2"))
    first = await pool.acquire(one)
    again = await pool.acquire(one)
    assert first is again and started == ["v1"]
    waiting = asyncio.create_task(pool.acquire(two))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "a second engine started beyond max_engines"
    await pool.release(one, first)
    await asyncio.sleep(0.05)
    assert not waiting.done() and closed == [], "released while a job still used it"
    await pool.release(one, again)
    second = await asyncio.wait_for(waiting, 5)
    assert closed == ["v1"] and started == ["v1", "v2"]
    assert second.endpoint.model == "v2"
    await pool.release(two, second)
    assert closed == ["v1", "v2"]
    engines = pool.metrics.registry.get_sample_value("orchard_rollout_job_policy_engines")
    assert engines == 0
    # An endpoint is the job's own: never shared, closed when its job ends.
    endpoint = JobPolicyKey("m", "", 1.0, 64, base_url="http://127.0.0.1:1/v1")
    mine, yours = await pool.acquire(endpoint), await pool.acquire(endpoint)
    assert mine is not yours and started[-2:] == ["", ""]
    await pool.release(endpoint, mine)
    assert closed[-1] == "" and len(closed) == 3


def test_rollout_ids_of_any_task_id_open_a_capture_session() -> None:
    from orchard.rollout.proxy.sessions import ROLLOUT_ID
    from orchard.rollout.results import GroupKey
    from orchard.rollout.runner import new_rollout_id

    for task_id in ("claw/0/reply_mail/3", "-x y", "swe.1", "ü" * 300):
        rollout_id = new_rollout_id(GroupKey(task_id, "bash"), 2)
        assert ROLLOUT_ID.match(rollout_id), rollout_id
    assert new_rollout_id(GroupKey("claw/0/a/3", "h"), 2).startswith("claw-0-a-3.2.")
