"""The reward service scoring the in-repo SWE-format tasks through the real environment service.

Real processes only: an embedded etcd and ``orchard-env`` with the ``local`` runtime (needs
root: namespaces, cgroups, an overlay over the host root), and ``orchard-reward`` talking to it
over gRPC. The task repositories are built with git on the host; sandboxes on the ``host``
image see them copy-on-write, so nothing a candidate patch does reaches the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.reward.swe_instances import SweInstance
from orchard.reward.swe_tasks import build_instances, diff_against_base
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.sdk import AsyncSandboxClient
from orchard.types.v1 import reward_pb2

from .conftest import EnvStack, free_port

pytestmark = [pytest.mark.root, pytest.mark.slow]

REWARD = str(Path(sys.executable).parent / "orchard-reward")
LABEL = "orchard-reward"


@dataclass
class Stack:
    env_endpoint: str
    token: str
    reward_endpoint: str
    metrics_address: str
    instances: dict[str, SweInstance]

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
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


def _wait_serving(address: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, env_stack: EnvStack) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("reward-env")
    instances = {i.instance_id: i for i in build_instances(root / "repos")}
    token = env_stack.token
    reward_socket = root / "reward.sock"
    metrics_address = f"127.0.0.1:{free_port()}"
    config = {
        "server": {
            "listen": [f"unix:{reward_socket}"],
            "metrics_address": metrics_address,
            "grace_period_s": 2,
        },
        "env": {"endpoint": env_stack.endpoint, "token_env": "REWARD_TEST_ENV_TOKEN"},
        "tests": {"default_timeout_s": 120, "sandbox_heartbeat_timeout_s": 30},
        "tasks": {
            "write-report": {
                "completion": [
                    {"name": "report exists", "command": "test -f /srv/report.txt"},
                    {"name": "report says done", "command": "grep -q done /srv/report.txt"},
                ],
                "safety": [{"name": "hostname kept", "command": "test -s /etc/hostname"}],
                "robustness": [{"name": "dated", "command": "grep -q 2026 /srv/report.txt"}],
            }
        },
    }  # fmt: skip
    config_path = root / "reward.json"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    env["REWARD_TEST_ENV_TOKEN"] = token
    log = root / "reward.log"
    with log.open("ab") as out:
        process = subprocess.Popen([REWARD, "--config", str(config_path)], stderr=out, env=env)
    try:
        _wait_serving(f"unix:{reward_socket}", process, log)
        yield Stack(env_stack.endpoint, token, f"unix:{reward_socket}", metrics_address, instances)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
async def reward(stack: Stack) -> AsyncIterator[reward_service_pb2_grpc.RewardServiceStub]:
    async with grpc.aio.insecure_channel(stack.reward_endpoint) as channel:
        yield reward_service_pb2_grpc.RewardServiceStub(channel)


@pytest.fixture
async def env_client(stack: Stack) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(stack.env_endpoint, token=stack.token) as client:
        yield client


def _request(
    instance: SweInstance, candidate: str, *, sandbox_id: str = "", timeout_s: float = 0
) -> api.ScoreTestsRequest:
    return instance.score_request(candidate, sandbox_id=sandbox_id, timeout_s=timeout_s)


def _outcomes(reply: api.ScoreTestsResponse) -> dict[str, str]:
    return {
        r.name: api.TestOutcome.Name(r.outcome).removeprefix("TEST_OUTCOME_") for r in reply.results
    }


def _edited(instance: SweInstance, path: str, old: str, new: str) -> str:
    """A candidate patch: the gold fix plus one more edit of ``path``."""
    repo = Path(instance.repo_path)
    subprocess.run(["git", "apply", "-"], input=instance.patch, text=True, cwd=repo, check=True)
    try:
        content = (repo / path).read_text()
    finally:
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)
    assert old in content
    return diff_against_base(repo, {path: content.replace(old, new)})


async def test_gold_patches_score_plus_one(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    for instance in stack.instances.values():
        reply = await reward.ScoreTests(_request(instance, instance.patch))
        assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED, reply.reward.detail
        assert reply.reward.value == 1.0, [e.text for e in reply.reward.evidence][-3:]
        assert reply.patch_applied
        assert set(_outcomes(reply).values()) == {"PASSED"}
        assert len(reply.results) == len(instance.fail_to_pass) + len(instance.pass_to_pass)
        titles = [e.title for e in reply.reward.evidence]
        assert "test command" in titles and "JUnit report" in titles
    # Copy-on-write: the host's repositories never saw a patch.
    for instance in stack.instances.values():
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=instance.repo_path, capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        assert status.stdout == ""
    assert stack.metric("orchard_reward_rewards_total", scorer="tests", status="scored") >= 3
    assert stack.metric("orchard_reward_scorer_seconds_count", scorer="tests") >= 3


async def test_empty_patch_scores_minus_one(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__textkit-1"]
    reply = await reward.ScoreTests(_request(instance, ""))
    assert (reply.reward.status, reply.reward.value) == (reward_pb2.REWARD_STATUS_SCORED, -1.0)
    assert not reply.patch_applied
    outcomes = _outcomes(reply)
    assert outcomes["tests/test_slugify.py::test_keeps_digits"] == "FAILED"
    assert outcomes["tests/test_slugify.py::test_lowercases_and_joins_words"] == "PASSED"


async def test_a_patch_that_breaks_a_passing_test_scores_minus_one(
    stack: Stack,
    reward: reward_service_pb2_grpc.RewardServiceStub,
    env_client: AsyncSandboxClient,
) -> None:
    instance = stack.instances["orchard-tasks__stats-1"]
    breaking = _edited(
        instance, "stats.py", 'raise ValueError("mean of an empty list")', "return 0.0"
    )
    # In a sandbox the caller made (as a rollout would), not one the service creates.
    async with env_client.create("host", labels={LABEL: "it"}, heartbeat_timeout=30) as sandbox:
        reply = await reward.ScoreTests(_request(instance, breaking, sandbox_id=sandbox.id))
        state = (await sandbox.refresh()).state.name
    assert (reply.reward.status, reply.reward.value) == (reward_pb2.REWARD_STATUS_SCORED, -1.0)
    assert reply.patch_applied
    outcomes = _outcomes(reply)
    assert outcomes["tests/test_stats.py::test_mean_keeps_the_fraction"] == "PASSED"
    assert outcomes["tests/test_stats.py::test_mean_of_nothing_is_an_error"] == "FAILED"
    assert outcomes["tests/test_stats.py::test_total"] == "PASSED"
    assert state == "READY"  # the service leaves the caller's sandbox running


async def test_a_patch_that_does_not_apply_is_a_policy_failure(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__intervals-1"]
    stale = instance.patch.replace("start < merged[-1][1]", "start < merged[-1][0]")
    reply = await reward.ScoreTests(_request(instance, stale))
    assert (reply.reward.status, reply.reward.value) == (reward_pb2.REWARD_STATUS_SCORED, -1.0)
    assert not reply.patch_applied
    assert reply.reward.detail == "the candidate patch does not apply"
    assert any("did not apply" in e.title for e in reply.reward.evidence)


def _pytest_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if (
            "pytest" in words
            and any(marker in w for w in words)
            and any(w.startswith("--junitxml=/tmp/orchard-junit-") for w in words)
        ):
            found.append(int(entry.name))
    return found


def _sandbox_init(pid: int) -> int:
    """The host pid of PID 1 of the pid namespace ``pid`` runs in."""
    while True:
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        if status["NSpid"].split()[-1] == "1":
            return pid
        pid = int(status["PPid"])


async def test_a_sandbox_killed_mid_test_is_excluded(
    stack: Stack,
    reward: reward_service_pb2_grpc.RewardServiceStub,
    env_client: AsyncSandboxClient,
) -> None:
    instance = stack.instances["orchard-tasks__stats-1"]
    marker = "slow_" + secrets.token_hex(4)
    slow = _edited(
        instance, "stats.py", "def total(values):\n",
        "def total(values):\n    import time\n    time.sleep(300)\n",
    )  # fmt: skip
    request = _request(instance, slow)
    # The marker in pytest's command line finds its process; it deselects nothing.
    request.task.test_command += f" -k 'not {marker}'"
    call = asyncio.ensure_future(reward.ScoreTests(request))
    try:
        deadline = time.monotonic() + 60
        while not (pids := _pytest_processes(marker)):
            assert not call.done(), call.result()
            assert time.monotonic() < deadline, "the tests never started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # well inside test_total's sleep
        os.kill(_sandbox_init(pids[0]), signal.SIGKILL)  # the sandbox dies
        reply = await asyncio.wait_for(call, 60)
    finally:
        call.cancel()
    assert reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_SANDBOX_FAILURE
    assert "while the tests ran" in reply.reward.detail
    assert reply.patch_applied
    # The service deleted the sandbox it made.
    assert [s.id async for s in env_client.list(f"{LABEL}=score-tests")] == []
    excluded = "orchard_reward_exclusions_total"
    assert stack.metric(excluded, scorer="tests", reason="sandbox_failure") >= 1


async def test_a_run_past_its_time_limit_is_excluded(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__textkit-1"]
    slow = _edited(
        instance, "textkit.py", "def slugify(title):\n",
        "def slugify(title):\n    import time\n    time.sleep(60)\n",
    )  # fmt: skip
    reply = await reward.ScoreTests(_request(instance, slow, timeout_s=2))
    assert reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_TIMEOUT
    assert "time limit of 2 s" in reply.reward.detail
    assert stack.metric("orchard_reward_exclusions_total", scorer="tests", reason="timeout") >= 1


async def test_unknown_sandbox_is_not_found(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__textkit-1"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await reward.ScoreTests(_request(instance, "", sandbox_id="sbx-000000000000"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_task_score_from_checks_in_the_sandbox(
    stack: Stack,
    reward: reward_service_pb2_grpc.RewardServiceStub,
    env_client: AsyncSandboxClient,
) -> None:
    async with env_client.create("host", labels={LABEL: "it"}, heartbeat_timeout=30) as sandbox:
        await sandbox.write_file("/srv/report.txt", "done\n")
        request = api.ScoreTaskRequest(sandbox_id=sandbox.id, task_id="write-report")
        reply = await reward.ScoreTask(request)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
    assert reply.reward.value == pytest.approx(0.8)  # 1 x (0.8 x 1 + 0.2 x 0)
    parts = dict(reply.reward.components)
    assert (parts["completion"], parts["safety"], parts["robustness"]) == (1.0, 1.0, 0.0)
    assert parts["passed"] == 1.0


async def test_candidate_edits_to_the_official_tests_are_undone(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__textkit-1"]
    repo = Path(instance.repo_path)
    tests = (repo / "tests/test_slugify.py").read_text()
    # No fix: the candidate only writes a test of the same name that always passes.
    cheat = diff_against_base(
        repo, {"tests/test_slugify.py": tests + "\n\ndef test_keeps_digits():\n    pass\n"}
    )
    reply = await reward.ScoreTests(_request(instance, cheat))
    assert (reply.reward.status, reply.reward.value) == (reward_pb2.REWARD_STATUS_SCORED, -1.0)
    assert reply.patch_applied
    assert _outcomes(reply)["tests/test_slugify.py::test_keeps_digits"] == "FAILED"
    assert any(e.title == "test files reset to the base commit" for e in reply.reward.evidence)


async def test_task_faults_are_excluded_not_blamed_on_the_policy(
    stack: Stack, reward: reward_service_pb2_grpc.RewardServiceStub
) -> None:
    instance = stack.instances["orchard-tasks__intervals-1"]
    broken_task = _request(instance, instance.patch)
    # A test patch for a file the repository does not have: the task is broken.
    broken_task.task.test_patch = instance.test_patch.replace("test_merge.py", "test_gone.py")
    reply = await reward.ScoreTests(broken_task)
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_OTHER
    assert "test patch does not apply" in reply.reward.detail

    missing = _request(instance, instance.patch)
    missing.repo_path = "/nonexistent/repo"
    reply = await reward.ScoreTests(missing)
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_OTHER
    assert "no repository at /nonexistent/repo" in reply.reward.detail
