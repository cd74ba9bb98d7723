"""``orchard.reward.v1.RewardService``: every RPC validates, calls a library scorer, and
answers with an ``orchard.types.v1.Reward``.

Bad input is INVALID_ARGUMENT with a message that says what to fix (raised as
``OrchardError``, turned into a status by the server's error interceptor). What the judge or
the sandbox fails to give is never an error: it is an EXCLUDED reward with the reason and the
evidence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from orchard.core.errors import OrchardError, Reason
from orchard.reward import convert
from orchard.reward.claw_tasks import builtin_task_checks, is_claw_id
from orchard.reward.config import RewardConfig
from orchard.reward.credit import require_failed, validate_epsilon, validate_success_threshold
from orchard.reward.gui_state import (
    GUI_STATE_JUDGE,
    gui_task,
    judge_site_state,
    site_port,
    site_sandbox,
)
from orchard.reward.judge_client import Judge
from orchard.reward.judged import (
    assign_credit,
    grade_rubric,
    judge_outcome,
    require_outcome_inputs,
)
from orchard.reward.metrics import RewardMetrics
from orchard.reward.outcome import Exclusion, ScoreResult, excluded, scored
from orchard.reward.rubric import Dimension
from orchard.reward.sandbox_tests import TestRun, TestRunResult, run_tests_in_sandbox
from orchard.reward.scripted_rubric import grade_scripted
from orchard.reward.task_checks import score_task_in_sandbox
from orchard.reward.task_suites import task_suites
from orchard.reward.tests_score import SCORER as TESTS_SCORER
from orchard.reward.tests_score import parser_named, require_fail_to_pass
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.sdk import errors
from orchard.sdk.aio import AsyncSandbox, AsyncSandboxClient
from orchard.sdk.types import SandboxState

__all__ = ["RewardResources", "RewardServicer"]

log = logging.getLogger(__name__)


@dataclass
class RewardResources:
    """What the RPCs use, opened when the server starts: judges by name and the environment
    service client (None when no endpoint is configured)."""

    judges: Mapping[str, Judge]
    env: AsyncSandboxClient | None


def _invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


class RewardServicer(reward_service_pb2_grpc.RewardServiceServicer):
    """The RPC handlers; :meth:`attach` gives them their resources once the server started."""

    def __init__(self, config: RewardConfig, metrics: RewardMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._resources: RewardResources | None = None

    def attach(self, resources: RewardResources | None) -> None:
        self._resources = resources

    @property
    def resources(self) -> RewardResources:
        if self._resources is None:
            raise OrchardError(Reason.UNAVAILABLE, "the reward service is starting or stopping")
        return self._resources

    def _judge(self, name: str, *, credit: bool = False, rubric: bool = False) -> Judge:
        """The judge named (empty: the default); a scripted one only for credit questions and
        rubric grades (its scripted rubric grader)."""
        chosen = name or self.config.default_judge
        judge = self.resources.judges.get(chosen)
        if judge is None:
            known = ", ".join(sorted(self.resources.judges))
            if chosen == GUI_STATE_JUDGE:
                raise _invalid(
                    f"judge {GUI_STATE_JUDGE} answers JudgeOutcome only; configured judges: {known}"
                )
            raise _invalid(
                f"unknown judge {chosen!r}; configured judges: {known}; built in, for "
                f"JudgeOutcome: {GUI_STATE_JUDGE} (a built-in GUI task's check on its site's "
                "server-side state: task_id, site_sandbox_id)"
            )
        if judge.scripted and not (credit or rubric):
            models = sorted(n for n, j in self.resources.judges.items() if not j.scripted)
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                f"judge {chosen!r} is the scripted judge: it answers AssignCredit and "
                f"GradeRubric only; name a model judge ({', '.join(models) or 'none configured'})",
            )
        return judge

    def _env(self) -> AsyncSandboxClient:
        client = self.resources.env
        if client is None:
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                "no environment service is configured: set env.endpoint "
                "(ORCHARD_REWARD_ENV__ENDPOINT) to run tests and checks in sandboxes",
            )
        return client

    def _record(self, result: ScoreResult, started: float) -> None:
        self.metrics.record(result, time.monotonic() - started)
        if not result.is_scored:
            log.info(
                "reward excluded",
                extra={
                    "scorer": result.scorer,
                    "reason": result.exclusion.value if result.exclusion else "",
                    "detail": result.detail,
                },
            )

    # -- ScoreTests --------------------------------------------------------------------------

    def _test_run(self, request: api.ScoreTestsRequest) -> TestRun:
        if not request.HasField("task"):
            raise _invalid("task is required: the SWE-bench instance to score")
        task = request.task
        require_fail_to_pass(list(task.fail_to_pass))
        parser = parser_named(task.parser)
        tests = self.config.tests
        timeout_s = tests.default_timeout_s
        if request.HasField("timeout"):
            timeout_s = request.timeout.ToNanoseconds() / 1e9
            if not 0 < timeout_s <= tests.max_timeout_s:
                raise _invalid(
                    f"timeout must lie in (0, {tests.max_timeout_s:g}] seconds, got {timeout_s:g}"
                )
        repo_path = request.repo_path or tests.default_repo_path
        if not repo_path.startswith("/"):
            raise _invalid(f"repo_path must be an absolute path, got {repo_path!r}")
        if not request.sandbox_id and not task.image:
            raise _invalid(
                "name the sandbox holding the repository (sandbox_id), or give task.image to "
                "create one from"
            )
        return TestRun(
            repo_path=repo_path,
            candidate_patch=request.candidate_patch,
            test_patch=task.test_patch,
            fail_to_pass=tuple(task.fail_to_pass),
            pass_to_pass=tuple(task.pass_to_pass),
            timeout_s=timeout_s,
            base_commit=task.base_commit,
            test_command=task.test_command,
            parser=parser,
            python=tests.python,
            output_limit_bytes=tests.output_limit_bytes,
        )

    async def ScoreTests(
        self, request: api.ScoreTestsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api.ScoreTestsResponse:
        run = self._test_run(request)
        client = self._env()
        started = time.monotonic()
        if request.sandbox_id:
            outcome = await self._tests_in_existing(client, request.sandbox_id, run)
        else:
            outcome = await self._tests_in_new(client, request.task, run)
        self._record(outcome.result, started)
        response = api.ScoreTestsResponse(
            reward=convert.reward_message(outcome.result), patch_applied=outcome.patch_applied
        )
        if outcome.verdict is not None:
            for listing in (outcome.verdict.fail_to_pass, outcome.verdict.pass_to_pass):
                for name, test in listing.items():
                    response.results.add(name=name, outcome=convert.outcome_message(test))
        return response

    async def _tests_in_existing(
        self, client: AsyncSandboxClient, sandbox_id: str, run: TestRun
    ) -> TestRunResult:
        sandbox = await self._sandbox(client, sandbox_id)
        try:
            if sandbox.state is not SandboxState.READY:
                info = sandbox.info
                why = info.failure_message or info.failure_reason or "not running"
                detail = f"sandbox {sandbox_id} is {sandbox.state.name}: {why}"
                return TestRunResult(
                    excluded(TESTS_SCORER, Exclusion.SANDBOX_FAILURE, detail), None, False
                )
            return await run_tests_in_sandbox(sandbox, run)
        finally:
            await sandbox.close()

    async def _tests_in_new(
        self, client: AsyncSandboxClient, task: api.TestTask, run: TestRun
    ) -> TestRunResult:
        try:
            sandbox = await client.create(
                image=task.image,
                labels={"orchard-reward": "score-tests"},
                heartbeat_timeout=self.config.tests.sandbox_heartbeat_timeout_s,
            )
        except errors.InvalidArgument as exc:
            raise _invalid(f"task.image {task.image!r}: {exc.message}") from None
        except errors.ResourceExhausted as exc:
            raise OrchardError(
                Reason.RESOURCE_EXHAUSTED, f"no sandbox for the tests now: {exc.message}"
            ) from None
        except (errors.ServiceError, errors.SandboxFailed) as exc:
            detail = f"no sandbox could be started from {task.image!r}: {exc}"
            return TestRunResult(
                excluded(TESTS_SCORER, Exclusion.SANDBOX_FAILURE, detail), None, False
            )
        try:
            return await run_tests_in_sandbox(sandbox, run)
        finally:
            try:
                await sandbox.delete()
            except errors.OrchardSDKError as exc:
                log.warning("cannot delete sandbox %s: %s", sandbox.id, exc)

    async def _sandbox(self, client: AsyncSandboxClient, sandbox_id: str) -> AsyncSandbox:
        try:
            return await client.get(sandbox_id)
        except errors.NotFound:
            raise OrchardError(
                Reason.NOT_FOUND, f"no sandbox {sandbox_id!r}", metadata={"sandbox_id": sandbox_id}
            ) from None
        except errors.InvalidArgument as exc:
            raise _invalid(f"sandbox_id {sandbox_id!r}: {exc.message}") from None
        except errors.Unavailable as exc:
            raise OrchardError(
                Reason.UNAVAILABLE, f"the environment service is unreachable: {exc.message}"
            ) from None

    # -- JudgeOutcome ------------------------------------------------------------------------

    async def JudgeOutcome(
        self, request: api.JudgeOutcomeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api.JudgeOutcomeResponse:
        if request.judge == GUI_STATE_JUDGE:
            return await self._judge_site_state(request)
        judge = self._judge(request.judge)
        started = time.monotonic()
        result = await judge_outcome(
            judge,
            intent=request.intent,
            final_response=request.final_response,
            screenshots=list(request.screenshots),
            last_screenshots=self.config.last_screenshots,
            format_variant=request.format_variant,
            policy_format_failures=request.policy_format_failures,
            format_failure_limit=self.config.format_failure_limit,
        )
        self._record(result, started)
        return api.JudgeOutcomeResponse(reward=convert.reward_message(result))

    async def _judge_site_state(self, request: api.JudgeOutcomeRequest) -> api.JudgeOutcomeResponse:
        """The state judge (`orchard.reward.gui_state`): a site sandbox that is gone or not
        READY is EXCLUDED, not NOT_FOUND as in ScoreTask (the episode lost it)."""
        require_outcome_inputs(request.intent, request.policy_format_failures)
        task = gui_task(request.task_id)
        if not request.site_sandbox_id:
            raise _invalid(
                f"judge {GUI_STATE_JUDGE} needs site_sandbox_id: the episode's site sandbox"
            )
        port = site_port(request.site_port)
        client = self._env()
        started = time.monotonic()
        sandbox = await site_sandbox(client, request.site_sandbox_id)
        if isinstance(sandbox, ScoreResult):
            result = sandbox
        else:
            try:
                result = await judge_site_state(
                    sandbox,
                    task,
                    final_response=request.final_response,
                    port=port,
                    screenshots=len(request.screenshots),
                    format_variant=request.format_variant,
                    policy_format_failures=request.policy_format_failures,
                    format_failure_limit=self.config.format_failure_limit,
                )
            finally:
                await sandbox.close()
        self._record(result, started)
        return api.JudgeOutcomeResponse(reward=convert.reward_message(result))

    # -- GradeRubric -------------------------------------------------------------------------

    async def GradeRubric(
        self, request: api.GradeRubricRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api.GradeRubricResponse:
        dimensions = self._rubric(request.dimensions)
        judge = self._judge(request.judge, rubric=True)
        task = convert.task_text(request.trajectory, request.task)
        started = time.monotonic()
        if judge.scripted:
            # The configured rubric is the operator's to fix; a request's, the caller's.
            reason = Reason.INVALID_ARGUMENT if request.dimensions else Reason.FAILED_PRECONDITION
            result = grade_scripted(
                request.trajectory, task=task, dimensions=dimensions, reason=reason
            )
        else:
            steps = convert.transcript(request.trajectory)
            result = await grade_rubric(judge, steps, task=task, dimensions=dimensions)
        self._record(result, started)
        return api.GradeRubricResponse(reward=convert.reward_message(result))

    def _rubric(self, given: Sequence[api.RubricDimension]) -> tuple[Dimension, ...]:
        """The request's rubric (a dimension without text takes the configured one's of its
        id), else the configured rubric."""
        configured = {d.id: d for d in self.config.rubric_dimensions()}
        dimensions = []
        for d in given:
            text = d.text
            if not text.strip():
                known = configured.get(d.id)
                if known is None:
                    raise _invalid(
                        f"rubric dimension {d.id!r} has no text and the configured rubric has "
                        f"no dimension of that id ({', '.join(configured)}): give its text"
                    )
                text = known.text
            dimensions.append(Dimension(d.id, text, d.weight))
        return tuple(dimensions) or tuple(configured.values())

    # -- ScoreTask ---------------------------------------------------------------------------

    async def ScoreTask(
        self, request: api.ScoreTaskRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api.ScoreTaskResponse:
        task = self.config.tasks.get(request.task_id)
        if task is None and is_claw_id(request.task_id):
            task = builtin_task_checks(request.task_id)
        if task is None:
            known = ", ".join(sorted(self.config.tasks)) or "none configured"
            raise _invalid(
                f"unknown task_id {request.task_id!r}; known tasks: {known}, and the built-in "
                "Claw suite's claw/<seed>/<family>/<n>"
            )
        if not request.sandbox_id:
            raise _invalid("sandbox_id is required: the sandbox holding the task's final state")
        client = self._env()
        started = time.monotonic()
        sandbox = await self._sandbox(client, request.sandbox_id)
        try:
            if sandbox.state is not SandboxState.READY:
                detail = f"sandbox {sandbox.id} is {sandbox.state.name}"
                result = excluded("task_score", Exclusion.SANDBOX_FAILURE, detail)
            else:
                result = await score_task_in_sandbox(sandbox, task)
        finally:
            await sandbox.close()
        self._record(result, started)
        return api.ScoreTaskResponse(reward=convert.reward_message(result))

    # -- AssignCredit ------------------------------------------------------------------------

    async def AssignCredit(
        self, request: api.AssignCreditRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api.AssignCreditResponse:
        epsilon = (
            validate_epsilon(request.epsilon) if request.epsilon else self.config.credit.epsilon
        )
        threshold = validate_success_threshold(
            request.success_threshold if request.HasField("success_threshold") else None
        )
        require_failed(request.trajectory, threshold)
        steps = convert.transcript(request.trajectory)
        judge = self._judge(request.judge, credit=True)
        failure = request.failure or request.trajectory.reward.detail or "the task was not solved"
        started = time.monotonic()
        answer = await assign_credit(
            judge,
            steps,
            task=convert.task_text(request.trajectory, request.task),
            failure=failure,
            epsilon=epsilon,
            rules=self.config.credit.rules(),
        )
        if answer.curve is None:
            missing = answer.exclusion or excluded(
                "credit", Exclusion.JUDGE_UNAVAILABLE, "the judge gave no value curve"
            )
            self._record(missing, started)
            return api.AssignCreditResponse(reward=convert.reward_message(missing))
        segments = len(answer.curve.rise_segments)
        result = scored(
            "credit",
            0.0,
            detail=f"value curve over {len(steps)} turns, {segments} rise segment(s)",
            components={"rise_segments": float(segments)},
        )
        self._record(result, started)
        return api.AssignCreditResponse(
            credit=convert.credit_message(answer.curve, f"judge:{judge.model}"),
            reward=convert.reward_message(result),
        )

    async def ListTaskSuites(
        self, request: api.ListTaskSuitesRequest, context: grpc.aio.ServicerContext
    ) -> api.ListTaskSuitesResponse:
        return api.ListTaskSuitesResponse(suites=task_suites())
