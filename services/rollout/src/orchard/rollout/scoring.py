"""Scoring a finished rollout in its sandbox, locally or through the reward service.

`LocalScorer` runs a task's command check through the environment service itself. The
`RewardServiceScorer` calls `orchard.reward.v1.RewardService`:

- a `tests` task (SWE-style): the rollout's changes to the repository are taken from the
  sandbox (`git add -A; git diff --cached --binary <base>`), the work tree is reset to the base
  commit, and ScoreTests applies the diff as the candidate patch and runs the tests there;
- a `score_task` task: ScoreTask runs the reward service's checks of that task in the sandbox;
- a `check` task: the command check, run locally as by `LocalScorer`;
- a `gui` task (`judge_episode`): JudgeOutcome with the task's judge, in the format variant
  (+1 when every turn parsed and the judge says success, -1 when the episode ended from
  repeated format failures, 0 otherwise), given the intent, the answer given to ``done``, the
  last screenshots and, for the built-in state judge, the task and its site sandbox.

A reward the service marks EXCLUDED (the sandbox died, a time limit outside the policy's
control) raises `RewardExcluded`: the runner records the rollout as aborted, never as a policy
failure. Transport failures raise `RewardUnavailable` (the runner retries them); a request the
service refuses (bad task settings, unknown task id) raises `InfrastructureError`.
"""

from __future__ import annotations

import shlex
from typing import Protocol

import grpc

from orchard.reward.v1 import reward_service_pb2, reward_service_pb2_grpc
from orchard.rollout.budgets import InfrastructureError
from orchard.rollout.harnesses.episodes import BrowserRun
from orchard.rollout.provenance import FailureLayer, RewardEvidence, RewardRecord
from orchard.rollout.tasks import CommandCheck, ServiceTaskCheck, TaskSpec, TestsCheck
from orchard.sdk import AsyncSandbox
from orchard.tasks.spec import GuiCheck
from orchard.types.v1 import reward_pb2

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
    }
)
DIFF_TIMEOUT_S = 120.0
JUDGED_SCREENSHOTS = 16
"""Most screenshots of an episode's trail sent to the judge (the last ones)."""


class RewardExcluded(Exception):
    """The scorer could give no value for reasons outside the policy."""

    def __init__(self, reason: str, detail: str, evidence: tuple[RewardEvidence, ...] = ()):
        super().__init__(f"reward excluded ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
        self.evidence = evidence


class RewardUnavailable(Exception):
    """The reward service could not be reached or failed on its side; worth retrying."""


class TaskScorer(Protocol):
    """Scores a task in the sandbox the rollout ran in."""

    async def score(self, task: TaskSpec, sandbox: AsyncSandbox) -> RewardRecord:
        """The reward; raises `RewardExcluded`, `RewardUnavailable`, `InfrastructureError`."""
        ...

    async def judge_episode(self, task: TaskSpec, check: GuiCheck, run: BrowserRun) -> RewardRecord:
        """The reward of a GUI task's browser episode, before its sandboxes are deleted;
        raises as `score` does."""
        ...


class LocalScorer:
    """Command checks only, run through the environment service."""

    async def score(self, task: TaskSpec, sandbox: AsyncSandbox) -> RewardRecord:
        if isinstance(task.check, CommandCheck):
            return await score_command(task.check, sandbox)
        raise InfrastructureError(
            FailureLayer.REWARD,
            f"task {task.id!r} is scored by the reward service, and none is configured "
            "(set reward.endpoint)",
            1,
        )

    async def judge_episode(self, task: TaskSpec, check: GuiCheck, run: BrowserRun) -> RewardRecord:
        raise InfrastructureError(
            FailureLayer.REWARD,
            f"GUI task {task.id!r} is judged by the reward service, and none is configured "
            "(set reward.endpoint)",
            1,
        )


async def score_command(check: CommandCheck, sandbox: AsyncSandbox) -> RewardRecord:
    """1 when the check's command exits 0 in the sandbox, else 0, with its output as evidence."""
    result = await sandbox.exec(["/bin/sh", "-c", check.command], timeout=check.timeout_s)
    passed = result.ok
    output = (result.stdout_text + result.stderr_text)[-2000:]
    if passed:
        detail = "the check passed"
    elif result.timed_out:
        detail = "the check timed out"
    else:
        detail = f"the check exited {result.exit_code}"
    return RewardRecord(
        value=1.0 if passed else 0.0,
        scorer="command_check",
        detail=detail,
        evidence=(RewardEvidence(f"$ {check.command}", output),),
    )


def reward_record(reward: reward_pb2.Reward) -> RewardRecord:
    """A SCORED reward as the provenance record keeps it; raises `RewardExcluded` otherwise."""
    evidence = tuple(RewardEvidence(e.title, e.text) for e in reward.evidence)
    if reward.status != reward_pb2.REWARD_STATUS_SCORED:
        reason = (
            reward_pb2.ExclusionReason.Name(reward.exclusion)
            .removeprefix("EXCLUSION_REASON_")
            .lower()
        )
        if reward.status == reward_pb2.REWARD_STATUS_UNSPECIFIED:
            reason = "no_status"
        raise RewardExcluded(reason, reward.detail or "no detail given", evidence)
    return RewardRecord(
        value=reward.value, scorer=reward.scorer, detail=reward.detail, evidence=evidence
    )


async def candidate_patch(sandbox: AsyncSandbox, check: TestsCheck) -> str:
    """Everything the rollout changed in the repository, as a patch against the base commit
    (new files included); the work tree is then reset to the base commit."""
    base = shlex.quote(check.task.base_commit or "HEAD")
    repo = shlex.quote(check.repo_path)
    diff = await sandbox.exec(
        ["/bin/sh", "-c", f"cd {repo} && git add -A && git diff --cached --binary {base}"],
        timeout=DIFF_TIMEOUT_S,
    )
    if not diff.ok:
        raise RewardExcluded(
            "other",
            f"could not take the candidate patch from {check.repo_path}: git exited "
            f"{diff.exit_code}: {diff.stderr_text[-500:]}",
        )
    reset = await sandbox.exec(
        ["/bin/sh", "-c", f"cd {repo} && git reset -q --hard {base} && git clean -qfdx"],
        timeout=DIFF_TIMEOUT_S,
    )
    if not reset.ok:
        raise RewardExcluded(
            "other",
            f"could not reset {check.repo_path} to {base}: git exited {reset.exit_code}: "
            f"{reset.stderr_text[-500:]}",
        )
    return diff.stdout_text


def _rpc_failure(exc: grpc.aio.AioRpcError) -> Exception:
    """What a failed reward call raises: `RewardUnavailable` (retried) for a transport or
    server failure, else `InfrastructureError` (the service refused the request)."""
    message = f"reward service {exc.code().name}: {exc.details()}"
    if exc.code() in RETRYABLE_CODES:
        return RewardUnavailable(message)
    return InfrastructureError(FailureLayer.REWARD, message, 1)


class RewardServiceScorer:
    """`async with RewardServiceScorer("127.0.0.1:7200") as scorer:` scores through the
    reward service at that gRPC address (HOST:PORT or unix:PATH)."""

    def __init__(self, target: str, *, call_timeout_s: float = 3600.0) -> None:
        self.target = target
        self.call_timeout_s = call_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: reward_service_pb2_grpc.RewardServiceStub | None = None
        self._local = LocalScorer()

    async def __aenter__(self) -> RewardServiceScorer:
        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = reward_service_pb2_grpc.RewardServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    @property
    def stub(self) -> reward_service_pb2_grpc.RewardServiceStub:
        if self._stub is None:
            raise RuntimeError("use the RewardServiceScorer inside `async with`")
        return self._stub

    async def score(self, task: TaskSpec, sandbox: AsyncSandbox) -> RewardRecord:
        check = task.check
        if isinstance(check, CommandCheck):
            return await self._local.score(task, sandbox)
        try:
            if isinstance(check, TestsCheck):
                patch = await candidate_patch(sandbox, check)
                request = reward_service_pb2.ScoreTestsRequest(
                    sandbox_id=sandbox.id,
                    task=check.task,
                    candidate_patch=patch,
                    repo_path=check.repo_path,
                )
                if check.timeout_s:
                    request.timeout.FromNanoseconds(int(check.timeout_s * 1e9))
                tests = await self.stub.ScoreTests(request, timeout=self.call_timeout_s)
                return reward_record(tests.reward)
            if isinstance(check, GuiCheck):
                raise InfrastructureError(
                    FailureLayer.REWARD, f"GUI task {task.id!r} is judged on its browser episode", 1
                )
            assert isinstance(check, ServiceTaskCheck)
            scored = await self.stub.ScoreTask(
                reward_service_pb2.ScoreTaskRequest(sandbox_id=sandbox.id, task_id=check.task_id),
                timeout=self.call_timeout_s,
            )
            return reward_record(scored.reward)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_failure(exc) from None

    async def judge_episode(self, task: TaskSpec, check: GuiCheck, run: BrowserRun) -> RewardRecord:
        request = reward_service_pb2.JudgeOutcomeRequest(
            intent=task.instruction,
            final_response=run.response or "",
            screenshots=run.screenshots[-JUDGED_SCREENSHOTS:],
            judge=check.judge,
            format_variant=True,
            policy_format_failures=run.format_failures,
            task_id=check.task_id,
            site_sandbox_id=run.episode.site.id,
            site_port=run.episode.settings.site_port,
        )
        try:
            judged = await self.stub.JudgeOutcome(request, timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_failure(exc) from None
        return reward_record(judged.reward)
