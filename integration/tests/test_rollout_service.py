"""``orchard-rollout`` end to end: jobs through the real environment and reward services.

Real processes: etcd and ``orchard-env`` with the local runtime (root), ``orchard-reward``, and
``orchard-rollout`` itself, talking gRPC. The policy is the scripted one (an OpenAI-compatible
server in a thread of this process) or the local engine on a tiny model built here, behind the
service's capture proxy. Covered: a job run to its end with its groups streamed and resumed by
index, bad input, cancel, and a restart of the service in the middle of a job; two replicas
(a cancel through the other one, a killed owner's job adopted, groups streamed by the replica
that does not run the job, listing by key, ended jobs removed after the retention).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.sdk import SandboxClient
from orchard.types.v1 import reward_pb2

from .conftest import EnvStack, free_port
from .test_rollout_scoring import (
    BIN,
    STATS,
    RewardStack,
    start_reward,
    stats_script,
    stop_process,
    swe_settings,
    wait_serving,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

JOB_LABEL = "orchard-rollout-job"
WEIGHT_VERSION = "tiny-v7"


def calc_task(task_id: str, *, sleep_s: float = 0) -> api.RolloutTask:
    """A command-check task the scripted policy solves with `bash` (after `sleep_s`)."""
    settings = {
        "setup": [f"mkdir -p /srv && echo pending > /srv/{task_id}"],
        "check": {"command": f"grep -q fixed /srv/{task_id}"},
    }
    return api.RolloutTask(
        id=task_id,
        image="host",
        instruction=f"Mark job {task_id} as fixed (sleep {sleep_s}).",
        scorer_json=json.dumps(settings),
    )


def service_script(stats_repo: str, sleeps: dict[str, float]) -> PolicyScript:
    plans = json.loads(json.dumps(_plans(stats_script(stats_repo, 0.5))))
    for task_id, sleep_s in sleeps.items():
        command = f"sleep {sleep_s}; echo fixed > /srv/{task_id}"
        plans.append(
            {
                "match": f"job {task_id} ",
                "solve_rate": 0.5,
                "solution": [
                    {"thought": "Fix it.", "tool": "bash", "arguments": {"command": command}},
                    {"thought": "Fixed.", "tool": "submit", "arguments": {}},
                ],
                "failure": [
                    {"thought": "Skip it.", "tool": "bash",
                     "arguments": {"command": f"sleep {sleep_s}"}},
                    {"thought": "Done.", "tool": "submit", "arguments": {}},
                ],
            }
        )  # fmt: skip
    return PolicyScript.from_json({"plans": plans})


def _plans(script: PolicyScript) -> list[dict[str, Any]]:
    out = []
    for plan in script.plans:
        out.append(
            {
                "match": plan.match,
                "solve_rate": plan.solve_rate,
                "solution": [_step(s) for s in plan.solution],
                "failure": [_step(s) for s in plan.failure],
            }
        )
    return out


def _step(step: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"thought": step.thought}
    if step.tool:
        data.update(tool=step.tool, arguments=step.arguments)
    return data


class PolicyThread:
    """The scripted policy served from a thread with its own event loop."""

    def __init__(self, script: PolicyScript) -> None:
        self.script = script
        self.base_url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ScriptedPolicyServer(self.script, seed=11) as server:
            self.base_url = server.base_url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> PolicyThread:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@dataclass
class RolloutProcess:
    address: str
    metrics_address: str
    config_path: Path
    log: Path
    token: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
        environ["ROLLOUT_TEST_ENV_TOKEN"] = self.token
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(BIN / "orchard-rollout"), "--config", str(self.config_path)],
                stderr=out,
                env=environ,
            )
        wait_serving(self.address, self.process, self.log)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, self.log)
            self.process = None

    def metric(self, name: str, **labels: str) -> float:
        url = f"http://{self.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            metric_name, _, rest = sample.partition("{")
            found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric_name == name and found == wanted:
                return float(value)
        return 0.0


@dataclass
class Services:
    env: EnvStack
    reward: RewardStack
    policy_url: str
    model_folder: str
    root: Path

    def rollout(self, name: str, **overrides: Any) -> RolloutProcess:
        """A rollout service process (not started) with its own etcd namespace per name."""
        address = f"127.0.0.1:{free_port()}"
        metrics = f"127.0.0.1:{free_port()}"
        config: dict[str, Any] = {
            "server": {"listen": [address], "metrics_address": metrics, "grace_period_s": 2},
            "etcd": {"endpoints": [self.env.stack.etcd_endpoint], "namespace": f"rt-{name}/"},
            "env": {"endpoint": self.env.endpoint, "token_env": "ROLLOUT_TEST_ENV_TOKEN"},
            "reward": {"endpoint": self.reward.reward_endpoint},
            "policies": {
                "scripted": {"kind": "openai", "base_url": self.policy_url, "model": "teacher"},
                "tiny": {
                    "kind": "local",
                    "engine": {"model_folder": self.model_folder, "weight_version": WEIGHT_VERSION},
                    "max_tokens_per_call": 12,
                },
            },
            "default_policy": "scripted",
            "defaults": {"create_spread_s": 0.05, "concurrency": 4},
            **overrides,
        }
        path = self.root / f"rollout-{name}.json"
        path.write_text(json.dumps(config))
        return RolloutProcess(
            address, metrics, path, self.root / f"rollout-{name}.log", self.env.token
        )


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, env_stack: EnvStack) -> Iterator[Services]:
    from orchard.lm.model_folder import save_model_folder
    from orchard.lm.models import tiny_causal_lm_for
    from orchard.lm.tokenizer import build_tokenizer
    from orchard.reward.swe_tasks import build_instances

    root = tmp_path_factory.mktemp("rollout-service")
    instances = {i.instance_id: i for i in build_instances(root / "repos")}
    tokenizer = build_tokenizer()
    folder = save_model_folder(
        root / "tiny", tiny_causal_lm_for(tokenizer, context=2048, seed=3), tokenizer
    )
    address, reward_process, reward_log = start_reward(root, env_stack)
    sleeps = {"quick": 0, "slowA": 2, "slowB": 2, "stuck": 60}
    try:
        with PolicyThread(service_script(instances[STATS].repo_path, sleeps)) as policy:
            yield Services(
                env_stack,
                RewardStack(env_stack, address, instances),
                policy.base_url,
                str(folder),
                root,
            )
    finally:
        stop_process(reward_process, reward_log)


@pytest.fixture(scope="module")
def rollout(services: Services) -> Iterator[RolloutProcess]:
    process = services.rollout("main")
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def stub(rollout: RolloutProcess) -> Iterator[rollout_service_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(rollout.address) as channel:
        yield rollout_service_pb2_grpc.RolloutServiceStub(channel)


def fixed_n(n: int, *, keep_all: bool = True) -> api.SamplerConfig:
    return api.SamplerConfig(
        kind=api.SAMPLER_KIND_FIXED_N, group_size=n, keep_uninformative_groups=keep_all
    )


def wait_job(
    stub: rollout_service_pb2_grpc.RolloutServiceStub,
    job_id: str,
    done: Any,
    timeout_s: float = 240,
) -> api.RolloutJob:
    deadline = time.monotonic() + timeout_s
    while True:
        job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job_id), timeout=10).job
        if done(job):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)


def ended(job: api.RolloutJob) -> bool:
    return job.state != api.ROLLOUT_JOB_STATE_RUNNING


def stats_task(services: Services) -> api.RolloutTask:
    instance = services.reward.instances[STATS]
    return api.RolloutTask(
        id="stats",
        image="host",
        instruction=instance.problem_statement,
        scorer_json=json.dumps(swe_settings(instance)),
    )


def test_a_job_runs_to_its_end_and_streams_its_scored_groups(
    services: Services,
    rollout: RolloutProcess,
    stub: rollout_service_pb2_grpc.RolloutServiceStub,
) -> None:
    spec = api.RolloutJobSpec(
        tasks=[calc_task("quick"), stats_task(services)],
        harnesses=["builtin:bash"],
        policy="scripted",
        sampler=fixed_n(4),
        budget=api.RolloutBudget(max_steps=6),
        concurrency=4,
    )
    request_id = uuid.uuid4().hex
    job = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec, request_id=request_id)).job
    assert job.state == api.ROLLOUT_JOB_STATE_RUNNING and job.pairs_total == 2
    # A retry with the same request id is the same job.
    again = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec, request_id=request_id))
    assert again.job.id == job.id
    # The stream ends when the job does.
    streamed = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=300))
    job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id)).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert [m.index for m in streamed] == [0, 1]
    assert (job.groups_emitted, job.pairs_done, job.rollouts_done) == (2, 2, 8)
    assert job.rollouts_started == 8 and job.rollouts_excluded == 0
    groups = {m.group.task_id: m.group for m in streamed}
    assert set(groups) == {"quick", "stats"}
    allowed = {"quick": {0.0, 1.0}, "stats": {-1.0, 1.0}}
    scorers = {"quick": "command_check", "stats": "tests"}
    for task_id, group in groups.items():
        assert group.harness == "builtin:bash" and group.sampler == "fixed_n:all"
        assert len(group.trajectories) == 4
        rewards = [t.reward.value for t in group.trajectories]
        assert {t.reward.status for t in group.trajectories} == {reward_pb2.REWARD_STATUS_SCORED}
        assert set(rewards) <= allowed[task_id], rewards
        assert {t.reward.scorer for t in group.trajectories} == {scorers[task_id]}
        mean = sum(rewards) / 4
        assert [round(t.advantage, 6) for t in group.trajectories] == [
            round(r - mean, 6) for r in rewards
        ]
        positives = sum(r >= 0.5 for r in rewards)
        assert group.positive_fraction == pytest.approx(positives / 4)
        # Streamed although the job keeps every group: it says whether it carries signal.
        assert bool(group.no_signal_reason) == (len(set(rewards)) == 1)
        # The scripted policy is not captured: outcomes and rewards, no turns.
        assert all(not t.turns for t in group.trajectories)
    # A consumer that reconnects resumes at its index; past the end of an ended job is refused.
    rest = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id, start_index=1)))
    assert [(m.index, m.group.id) for m in rest] == [(1, streamed[1].group.id)]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id, start_index=3)))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "emitted 2 groups" in info.value.details()
    # Metrics: every rollout finished as completed, two groups emitted.
    assert (
        rollout.metric("orchard_rollout_rollouts_finished_total", status="completed", layer="") >= 8
    )
    assert rollout.metric("orchard_rollout_groups_emitted_total", sampler="fixed_n") >= 2
    assert rollout.metric("orchard_rollout_step_seconds_count", part="tool") >= 16
    # The sandboxes are gone.
    with SandboxClient(services.env.endpoint, token=services.env.token) as client:
        assert list(client.list({JOB_LABEL: job.id})) == []


def test_the_local_engine_behind_the_capture_proxy_gives_exact_tokens(
    services: Services, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    lookup = api.RolloutTask(
        id="lookup",
        image="host",
        instruction="Say hi.",
        scorer_json=json.dumps({"check": {"command": "false"}}),
    )
    spec = api.RolloutJobSpec(
        tasks=[lookup],
        harnesses=["builtin:tools"],
        policy="tiny",
        sampler=fixed_n(2),
        budget=api.RolloutBudget(max_steps=2),
    )
    job = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec)).job
    streamed = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=300))
    job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id)).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    (message,) = streamed
    trajectories = message.group.trajectories
    assert len(trajectories) == 2
    for trajectory in trajectories:
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED, trajectory.reward
        assert trajectory.reward.value == 0.0
        assert trajectory.turns, "the calls through the proxy were captured"
        for turn in trajectory.turns:
            assert turn.weight_version == WEIGHT_VERSION
            assert 0 < len(turn.output_token_ids) <= 12
            assert len(turn.output_logprobs) == len(turn.output_token_ids)
            assert all(lp <= 0 for lp in turn.output_logprobs)
        assert trajectory.metadata["weight_versions"] == WEIGHT_VERSION
        assert len(trajectory.turns[0].input_token_ids) > 0


def _publish(services: Services, model: str, versions: list[str]) -> None:
    from orchard.core.etcd import EtcdStore
    from orchard.lm.weights import WeightRegistry

    async def go() -> None:
        async with EtcdStore(services.env.stack.etcd_endpoint, namespace="orchard/") as store:
            registry = WeightRegistry(store, model)
            for version in versions:
                # a location is the model folder's URL (the engines read the artifact store)
                await registry.publish(version, Path(services.model_folder).absolute().as_uri())

    asyncio.run(go())


def test_a_job_brings_a_weight_version_from_the_registry_and_its_engine_closes_after_it(
    services: Services,
    rollout: RolloutProcess,
    stub: rollout_service_pb2_grpc.RolloutServiceStub,
) -> None:
    model = f"rt-student-{uuid.uuid4().hex[:8]}"
    _publish(services, model, ["step-1", "step-2"])
    lookup = api.RolloutTask(
        id="lookup",
        image="host",
        instruction="Say hi.",
        scorer_json=json.dumps({"check": {"command": "false"}}),
    )

    def spec(version: str) -> api.RolloutJobSpec:
        return api.RolloutJobSpec(
            tasks=[lookup],
            harnesses=["builtin:tools"],
            policy_spec=api.PolicySpec(
                weights=api.RegistryWeights(model=model, version=version),
                temperature=0.0,
                max_tokens_per_call=10,
            ),
            sampler=fixed_n(2),
            budget=api.RolloutBudget(max_steps=2),
        )

    # The pinned older version and the latest one, at once: one engine each.
    pinned = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec("step-1"))).job
    latest = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec(""))).job
    for started, version in ((pinned, "step-1"), (latest, "step-2")):
        request = api.StreamGroupsRequest(job_id=started.id)
        streamed = list(stub.StreamGroups(request, timeout=300))
        job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=started.id)).job
        assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
        assert job.spec.policy_spec.weights.model == model
        (message,) = streamed
        assert len(message.group.trajectories) == 2
        for trajectory in message.group.trajectories:
            assert trajectory.turns, "the calls of a job's own policy are captured"
            assert {t.weight_version for t in trajectory.turns} == {version}
            assert all(0 < len(t.output_token_ids) <= 10 for t in trajectory.turns)
        # Greedy: both rollouts of the same prompt sampled the same first reply.
        first = [list(t.turns[0].output_token_ids) for t in message.group.trajectories]
        assert first[0] == first[1]
    # No job uses them any more: both engines are closed.
    deadline = time.monotonic() + 30
    while rollout.metric("orchard_rollout_job_policy_engines") != 0:
        assert time.monotonic() < deadline, "the job policies' engines stay up"
        time.sleep(0.2)
    # A version never published is refused before any sandbox starts.
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec("step-9")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'step-9'" in info.value.details() and model in info.value.details()


def test_a_job_brings_an_endpoint_and_its_trajectories_carry_the_conversation(
    services: Services, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    def spec(**endpoint: str) -> api.RolloutJobSpec:
        return api.RolloutJobSpec(
            tasks=[calc_task("quick")],
            harnesses=["builtin:bash"],
            policy_spec=api.PolicySpec(endpoint=api.ChatEndpoint(**endpoint)),
            sampler=fixed_n(2),
            budget=api.RolloutBudget(max_steps=6),
        )

    job = stub.CreateRolloutJob(
        api.CreateRolloutJobRequest(spec=spec(base_url=services.policy_url, model="teacher"))
    ).job
    streamed = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=300))
    job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id)).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    (message,) = streamed
    assert len(message.group.trajectories) == 2
    for trajectory in message.group.trajectories:
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED
        # Not captured: no turns, and the conversation the harness held instead.
        assert not trajectory.turns
        conversation = json.loads(trajectory.conversation_json)
        assert [m["role"] for m in conversation[:3]] == ["system", "user", "assistant"]
        assert "Mark job quick as fixed" in conversation[1]["content"]
        calls = [c for m in conversation for c in m.get("tool_calls") or []]
        assert calls and all(c["function"]["name"] for c in calls)
        assert any(m["role"] == "tool" for m in conversation)
    # A key variable the service does not have, and a URL that is not http(s), are refused.
    variable = f"ORCHARD_TEST_UNSET_{uuid.uuid4().hex[:6].upper()}"
    url = services.policy_url
    refused = [
        ({"base_url": url, "model": "t", "api_key_env": variable}, "FAILED_PRECONDITION", variable),
        ({"base_url": "ftp://127.0.0.1/v1", "model": "t"}, "INVALID_ARGUMENT", "http(s) URL"),
        ({"base_url": url}, "INVALID_ARGUMENT", "endpoint.model is empty"),
    ]
    for endpoint, code, words in refused:
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec(**endpoint)))
        assert info.value.code().name == code
        assert words in info.value.details()


@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        (lambda s: s.ClearField("tasks"), "INVALID_ARGUMENT", "spec.tasks is empty"),
        (lambda s: s.harnesses.append("builtin:nope"), "INVALID_ARGUMENT", "known harnesses"),
        (lambda s: setattr(s, "policy", "gpt-9"), "INVALID_ARGUMENT", "configured policies"),
        (lambda s: setattr(s.tasks[0], "scorer_json", "{"), "INVALID_ARGUMENT", "not JSON"),
        (lambda s: setattr(s.tasks[0], "id", "a/../b"), "INVALID_ARGUMENT", "letters, digits"),
        (lambda s: setattr(s.tasks[0], "id", "a//b"), "INVALID_ARGUMENT", "letters, digits"),
        (lambda s: setattr(s.tasks[0], "id", "/a"), "INVALID_ARGUMENT", "letters, digits"),
        (
            lambda s: s.sampler.CopyFrom(fixed_n(1, keep_all=False)),
            "INVALID_ARGUMENT",
            "carries no signal for training",
        ),
        (lambda s: setattr(s, "concurrency", -1), "INVALID_ARGUMENT", "spec.concurrency"),
    ],
)
def test_bad_input_is_refused_with_what_to_fix(
    stub: rollout_service_pb2_grpc.RolloutServiceStub, change: Any, code: str, words: str
) -> None:
    spec = api.RolloutJobSpec(
        tasks=[calc_task("quick")], harnesses=["builtin:bash"], sampler=fixed_n(2)
    )
    change(spec)
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec))
    assert info.value.code().name == code
    assert words in info.value.details()


def test_unknown_jobs_are_not_found(stub: rollout_service_pb2_grpc.RolloutServiceStub) -> None:
    for call in (
        lambda: stub.GetRolloutJob(api.GetRolloutJobRequest(job_id="nope")),
        lambda: stub.CancelRolloutJob(api.CancelRolloutJobRequest(job_id="nope")),
        lambda: list(stub.StreamGroups(api.StreamGroupsRequest(job_id="nope"))),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no rollout job 'nope'" in info.value.details()


def test_a_cancelled_job_aborts_its_rollouts_and_deletes_their_sandboxes(
    services: Services, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    spec = api.RolloutJobSpec(
        tasks=[calc_task("stuck")], harnesses=["builtin:bash"], sampler=fixed_n(2)
    )
    job = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec)).job
    with SandboxClient(services.env.endpoint, token=services.env.token) as client:
        deadline = time.monotonic() + 60
        while len(list(client.list({JOB_LABEL: job.id}))) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cancelled = stub.CancelRolloutJob(api.CancelRolloutJobRequest(job_id=job.id)).job
        assert cancelled.state == api.ROLLOUT_JOB_STATE_CANCELLED
        assert list(client.list({JOB_LABEL: job.id})) == []
    # Idempotent, and the stream of a cancelled job ends with what it emitted (nothing).
    again = stub.CancelRolloutJob(api.CancelRolloutJobRequest(job_id=job.id)).job
    assert again.state == api.ROLLOUT_JOB_STATE_CANCELLED
    assert list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=30)) == []
    assert cancelled.groups_emitted == 0 and cancelled.rollouts_done == 0


def test_a_restarted_service_resumes_the_job_and_keeps_the_groups_it_emitted(
    services: Services,
) -> None:
    process = services.rollout("restart")
    process.start()
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
            spec = api.RolloutJobSpec(
                tasks=[calc_task("quick"), calc_task("slowA", sleep_s=2), calc_task("slowB")],
                harnesses=["builtin:bash"],
                sampler=fixed_n(2),
                concurrency=2,
            )
            job = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec)).job
            first = wait_job(stub, job.id, lambda j: j.groups_emitted >= 1 or ended(j))
            assert first.state == api.ROLLOUT_JOB_STATE_RUNNING, "the job ended before the restart"
            stream = stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=60)
            before = [next(stream) for _ in range(first.groups_emitted)]
            stream.cancel()
    finally:
        # SIGTERM: the service stops its jobs without ending them.
        process.stop()
    process.start()
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
            listed = stub.ListRolloutJobs(api.ListRolloutJobsRequest()).jobs
            assert [j.id for j in listed] == [job.id]
            assert listed[0].resumes == 1
            assert listed[0].groups_emitted >= first.groups_emitted
            final = wait_job(stub, job.id, ended)
            assert final.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, final.error
            groups = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=30))
        assert [m.index for m in groups] == [0, 1, 2]
        assert sorted(m.group.task_id for m in groups) == ["quick", "slowA", "slowB"]
        assert (final.pairs_done, final.groups_emitted) == (3, 3)
        # What was emitted before the restart is still there, unchanged.
        kept = groups[: first.groups_emitted]
        assert [json_format.MessageToDict(m) for m in kept] == [
            json_format.MessageToDict(m) for m in before
        ]
        with SandboxClient(services.env.endpoint, token=services.env.token) as client:
            assert list(client.list({JOB_LABEL: job.id})) == []
    finally:
        process.stop()


def test_two_replicas_run_each_job_once_and_a_replica_adopts_the_job_of_a_dead_one(
    services: Services,
) -> None:
    first = services.rollout("replicas")
    second = RolloutProcess(
        f"127.0.0.1:{free_port()}",
        f"127.0.0.1:{free_port()}",
        first.config_path.with_name("rollout-replicas-2.json"),
        first.log.with_name("rollout-replicas-2.log"),
        first.token,
    )
    config = json.loads(first.config_path.read_text())
    config["server"] = {"listen": [second.address], "metrics_address": second.metrics_address}
    second.config_path.write_text(json.dumps(config))
    first.start()
    second.start()
    try:
        with (
            grpc.insecure_channel(first.address) as a,
            grpc.insecure_channel(second.address) as b,
        ):
            stub_a = rollout_service_pb2_grpc.RolloutServiceStub(a)
            stub_b = rollout_service_pb2_grpc.RolloutServiceStub(b)
            # A cancel received by the replica that does not run the job reaches the owner.
            stuck = api.RolloutJobSpec(
                tasks=[calc_task("stuck")], harnesses=["builtin:bash"], sampler=fixed_n(2)
            )
            job = stub_a.CreateRolloutJob(api.CreateRolloutJobRequest(spec=stuck)).job
            with SandboxClient(services.env.endpoint, token=services.env.token) as client:
                deadline = time.monotonic() + 60
                while len(list(client.list({JOB_LABEL: job.id}))) < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                cancelled = stub_b.CancelRolloutJob(api.CancelRolloutJobRequest(job_id=job.id))
                assert cancelled.job.state == api.ROLLOUT_JOB_STATE_CANCELLED
                time.sleep(5)  # the owner stops within its watch interval
                assert list(client.list({JOB_LABEL: job.id})) == []
            assert wait_job(stub_a, job.id, ended).state == api.ROLLOUT_JOB_STATE_CANCELLED
            # A replica killed mid-job: the other adopts the job once its lease runs out.
            spec = api.RolloutJobSpec(
                tasks=[calc_task("slowA"), calc_task("slowB")],
                harnesses=["builtin:bash"],
                sampler=fixed_n(2),
            )
            job = stub_a.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec)).job
            wait_job(stub_a, job.id, lambda j: j.rollouts_started >= 2)
            assert first.process is not None
            first.process.kill()
            first.process.wait()
            first.process = None
            final = wait_job(stub_b, job.id, ended, timeout_s=120)
            assert final.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, final.error
            assert (final.resumes, final.groups_emitted) == (1, 2)
    finally:
        first.stop()
        second.stop()


def test_groups_reach_another_replicas_stream_and_ended_jobs_leave_after_the_retention(
    services: Services,
) -> None:
    owner = services.rollout("retention", jobs={"retention_s": 3})
    other = RolloutProcess(
        f"127.0.0.1:{free_port()}",
        f"127.0.0.1:{free_port()}",
        owner.config_path.with_name("rollout-retention-2.json"),
        owner.log.with_name("rollout-retention-2.log"),
        owner.token,
    )
    config = json.loads(owner.config_path.read_text())
    config["server"] = {"listen": [other.address], "metrics_address": other.metrics_address}
    other.config_path.write_text(json.dumps(config))
    owner.start()
    other.start()
    try:
        with (
            grpc.insecure_channel(owner.address) as a,
            grpc.insecure_channel(other.address) as b,
        ):
            stub_a = rollout_service_pb2_grpc.RolloutServiceStub(a)
            stub_b = rollout_service_pb2_grpc.RolloutServiceStub(b)
            spec = api.RolloutJobSpec(
                tasks=[calc_task("quick"), calc_task("slowA", sleep_s=1)],
                harnesses=["builtin:bash"],
                sampler=fixed_n(2),
            )
            jobs = [
                stub_a.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec)).job
                for _ in range(2)
            ]
            # The replica that does not run the job streams its groups as they are written.
            streamed = list(
                stub_b.StreamGroups(api.StreamGroupsRequest(job_id=jobs[1].id), timeout=120)
            )
            assert sorted(m.group.task_id for m in streamed) == ["quick", "slowA"]
            # Listed newest first, one page per job, by key.
            first = stub_b.ListRolloutJobs(api.ListRolloutJobsRequest(page_size=1))
            second = stub_b.ListRolloutJobs(
                api.ListRolloutJobsRequest(page_size=1, page_token=first.next_page_token)
            )
            assert [j.id for j in (*first.jobs, *second.jobs)] == [jobs[1].id, jobs[0].id]
            assert second.next_page_token == ""
            with pytest.raises(grpc.RpcError) as info:
                stub_b.ListRolloutJobs(api.ListRolloutJobsRequest(page_token="10"))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for job in jobs:
                assert wait_job(stub_a, job.id, ended).state == api.ROLLOUT_JOB_STATE_SUCCEEDED
            # Three seconds after they ended both are gone, groups and all, and say so.
            deadline = time.monotonic() + 30
            for job in jobs:
                error = _get_error(stub_b, job.id, deadline)
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
                assert "ended (SUCCEEDED)" in error.details()
                assert "retention of 3 s (jobs.retention_s)" in error.details()
            assert stub_b.ListRolloutJobs(api.ListRolloutJobsRequest()).jobs == []
            removed = sum(r.metric("orchard_rollout_jobs_removed_total") for r in (owner, other))
            assert removed == 2
    finally:
        owner.stop()
        other.stop()


def _get_error(
    stub: rollout_service_pb2_grpc.RolloutServiceStub, job_id: str, deadline: float
) -> grpc.RpcError:
    """The error GetRolloutJob answers once the job is gone (waits for it until `deadline`)."""
    while True:
        try:
            stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job_id), timeout=10)
        except grpc.RpcError as error:
            return error
        assert time.monotonic() < deadline, f"job {job_id} not removed after the retention"
        time.sleep(0.2)
