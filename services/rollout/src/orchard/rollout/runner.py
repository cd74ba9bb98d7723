"""Runs one rollout end to end: sandbox, setup, harness, reward, capture, provenance.

`RolloutRunner` is the `RunRollout` callable the samplers take. Per rollout it creates a sandbox
through the environment service (after a random delay against bursts, retried per layer), runs
the task's setup, drives the harness under the wall-clock budget, scores the task's check in the
sandbox, collects the captured calls when a capture source is given, and deletes the sandbox.

A GUI task (`GuiCheck`) runs in a browser episode instead: its site sandbox and its browser
sandbox (`orchard.tasks.gui.episode`), opened with the browser harness's settings, the browser on
the task's start page; the reward service's JudgeOutcome scores it before both are deleted. With
a `TrailWriter` (a job that keeps GUI trails) its screenshot trail is then written to the
artifact store and the record carries the trail's URL (`RolloutRecord.gui_trail`).

Every infrastructure failure is recorded with its layer and the rollout comes back ABORTED (no
reward, never trained); so does a reward the scorer EXCLUDED (layer `reward`). A budget that
runs out comes back TRUNCATED and is still scored. A setup killed for memory is retried once in a
fresh sandbox with twice the memory.

A runner in another process than the capture proxy (a Ray worker) gets a `RolloutSession` the
caller opened for the rollout; the caller then takes the calls with `collect_calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import re
import ssl
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import openai

from orchard.rollout.budgets import InfrastructureError, LayeredRetries, RolloutBudget, with_retries
from orchard.rollout.capture import CallRecord
from orchard.rollout.harnesses.browser import BrowserHarness
from orchard.rollout.harnesses.episodes import BrowserRun
from orchard.rollout.harnesses.kinds import Harness
from orchard.rollout.harnesses.sandboxed import SandboxedProgramHarness
from orchard.rollout.harnesses.tool_loop import HarnessContext, ModelEndpoint
from orchard.rollout.provenance import FailureLayer, InfraFailure, RewardRecord, RolloutRecord
from orchard.rollout.proxy.sessions import CaptureNotSettled
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.scoring import LocalScorer, RewardExcluded, RewardUnavailable, TaskScorer
from orchard.rollout.task_files import FileSource, TaskFilesError, place_files
from orchard.rollout.tasks import TaskSpec
from orchard.rollout.trails import TrailWriter
from orchard.sdk import AsyncSandbox, AsyncSandboxClient, Resources
from orchard.sdk import errors as sdk_errors
from orchard.tasks.gui.episode import BrowserEpisode, BrowserUnavailable
from orchard.tasks.gui.suite import task_by_id
from orchard.tasks.spec import GuiCheck

if TYPE_CHECKING:
    from orchard.rollout.proxy.server import CaptureProxy

log = logging.getLogger(__name__)

SANDBOX_CREATE_RETRYABLE: tuple[type[Exception], ...] = (
    sdk_errors.Unavailable,
    sdk_errors.ResourceExhausted,
    sdk_errors.SandboxFailed,
    sdk_errors.DeadlineExceeded,
    sdk_errors.Internal,
)
KILL_SIGNAL = 9
EPISODE_SCORING_S = 120.0
"""How long a browser episode's allowance outlives the rollout's budget (its scoring)."""
ROLLOUT_LABEL = "orchard-rollout"
"""Label on a rollout's sandboxes (`rollout_label` of its id)."""


class CaptureSource(Protocol):
    """Where the captured calls of a rollout come from (the capture proxy's sessions)."""

    def open(self, rollout_id: str) -> str:
        """Start capturing the rollout's calls; returns the base URL its harness talks to."""
        ...

    async def settle(self, rollout_id: str) -> list[CallRecord]:
        """The rollout's calls once their count is stable and none is pending; raises
        `CaptureNotSettled` when they do not settle in time."""
        ...

    def close(self, rollout_id: str) -> None:
        """Stop capturing (idempotent)."""
        ...


@dataclass(slots=True)
class ProxyCapture:
    """The capture proxy as a runner's capture source: a session per rollout, its calls taken
    once settled. Harnesses reach the proxy (and through it the engine) at the session URL."""

    proxy: CaptureProxy
    settle_timeout_s: float = 30.0

    def open(self, rollout_id: str) -> str:
        return self.proxy.open_session(rollout_id).base_url

    async def settle(self, rollout_id: str) -> list[CallRecord]:
        return list(await self.proxy.settle(rollout_id, self.settle_timeout_s))

    def close(self, rollout_id: str) -> None:
        with contextlib.suppress(KeyError):
            self.proxy.close_session(rollout_id)


@dataclass(frozen=True, slots=True)
class RolloutSession:
    """A capture session the caller opened for one rollout (picklable): the rollout's id and
    the URL its harness talks to. The caller settles and closes it (`collect_calls`)."""

    rollout_id: str
    base_url: str


_UNSAFE_IN_ID = re.compile(r"[^A-Za-z0-9._:-]")


def new_rollout_id(key: GroupKey, index: int) -> str:
    """A fresh id for rollout `index` of a pair (a retry gets a new one). Characters a capture
    session's id (a URL path segment) cannot hold become '-' (claw ids hold '/')."""
    task = _UNSAFE_IN_ID.sub("-", key.task_id)[:160]
    if not task[:1].isalnum():
        task = f"t{task}"
    return f"{task}.{index}.{uuid.uuid4().hex[:10]}"


def rollout_label(rollout_id: str) -> str:
    """The ``orchard-rollout`` label value on the sandboxes of a rollout."""
    return rollout_id[:63].replace(".", "-")


async def collect_calls(result: RolloutResult, capture: CaptureSource) -> RolloutResult:
    """`result` with the calls its rollout made through `capture` (a session the caller opened
    with `capture.open`): what the runner does itself when it owns the capture. Calls that do
    not settle abort a rollout that would otherwise be scored (layer `inference`)."""
    record: RolloutRecord = result.payload
    try:
        record.calls = await capture.settle(result.rollout_id)
    except CaptureNotSettled as exc:
        if result.status is RolloutStatus.ABORTED:
            return result
        record.failure = InfraFailure(FailureLayer.INFERENCE, str(exc), 1)
        record.status = RolloutStatus.ABORTED
        record.reward = None
        return dataclasses.replace(result, status=RolloutStatus.ABORTED, reward=None)
    length = sum(len(c.output_token_ids) for c in record.calls) or record.sampled_tokens
    return dataclasses.replace(result, length=length)


class _OutOfMemory(Exception):
    pass


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every rollout's client: building one (the system's trusted
    certificates) costs about 70 ms of CPU, which a client of its own per rollout paid."""
    return ssl.create_default_context()


def _double(memory: str) -> str:
    match = re.fullmatch(r"(\d+)([KMGT]?)i?B?", memory.strip(), re.IGNORECASE)
    if not match:
        return memory
    return f"{int(match.group(1)) * 2}{match.group(2).upper()}"


@dataclass(slots=True)
class RolloutRunner:
    sandboxes: AsyncSandboxClient
    endpoint: ModelEndpoint
    harnesses: Mapping[str, Harness]
    tasks: Mapping[str, TaskSpec]
    budget: RolloutBudget = field(default_factory=RolloutBudget)
    retries: LayeredRetries = field(default_factory=LayeredRetries)
    capture: CaptureSource | None = None
    scorer: TaskScorer = field(default_factory=LocalScorer)
    """Scores a task in its sandbox; `RewardServiceScorer` for tests and reward-service tasks."""
    seed: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels put on every sandbox (e.g. the run id)."""
    files: FileSource | None = None
    """Where task archives (`TaskSpec.files`) are read from: the service's artifact store."""
    records: list[RolloutRecord] = field(default_factory=list)
    """Every rollout's provenance record, in finishing order (when `keep_records`)."""
    keep_records: bool = True
    """False: records only travel in the results (a long-lived runner keeps none)."""
    trails: TrailWriter | None = None
    """Where the screenshot trails of GUI episodes go; None: none is kept."""
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def __call__(
        self, key: GroupKey, index: int, *, session: RolloutSession | None = None
    ) -> RolloutResult:
        """Runs rollout `index` of `key`; with `session`, under that id and talking to that URL
        (the caller owns the capture), else under a new id through this runner's capture."""
        harness = self.harnesses.get(key.harness)
        task = self.tasks.get(key.task_id)
        if harness is None or task is None:
            raise KeyError(f"no harness {key.harness!r} or no task {key.task_id!r} to run")
        harness = harness.in_directory(task.workdir)
        rollout_id = session.rollout_id if session is not None else new_rollout_id(key, index)
        memory = task.memory
        for attempt in range(2):
            record = RolloutRecord(rollout_id=rollout_id, task_id=key.task_id, harness=key.harness)
            try:
                result = await self._run(
                    key=key,
                    index=index,
                    task=task,
                    harness=harness,
                    record=record,
                    memory=memory,
                    session=session,
                )
            except _OutOfMemory:
                if attempt == 0 and memory:
                    log.info(
                        "rollout %s: setup ran out of memory at %s, retrying", rollout_id, memory
                    )
                    memory = _double(memory)
                    continue
                record.failure = InfraFailure(
                    FailureLayer.SANDBOX_CREATE,
                    f"setup ran out of memory at {memory or 'default'}",
                    attempt + 1,
                )
                result = self._finish(key, index, record, RolloutStatus.ABORTED)
            if self.keep_records:
                self.records.append(record)
            return result
        raise AssertionError("unreachable")

    async def _create(self, task: TaskSpec, record: RolloutRecord, memory: str) -> AsyncSandbox:
        await asyncio.sleep(self._rng.uniform(0, self.retries.create_spread_s))
        resources = Resources.of(memory=memory) if memory else None
        labels = {**self.labels, ROLLOUT_LABEL: rollout_label(record.rollout_id)}

        async def attempt(_: int) -> AsyncSandbox:
            return await self.sandboxes.create(image=task.image, labels=labels, resources=resources)

        return await with_retries(
            FailureLayer.SANDBOX_CREATE,
            self.retries.sandbox_create,
            attempt,
            retryable=SANDBOX_CREATE_RETRYABLE,
            rng=self._rng,
        )

    async def _open_episode(
        self, task: TaskSpec, check: GuiCheck, harness: Harness, record: RolloutRecord
    ) -> BrowserRun:
        """The GUI task's browser episode, its browser on the task's start page."""
        if not isinstance(harness, BrowserHarness):
            raise InfrastructureError(
                FailureLayer.HARNESS,
                f"task {task.id!r} is a GUI task and {harness.name} is no browser harness",
                1,
            )
        try:
            gui = task_by_id(check.task_id)
        except ValueError as exc:
            raise InfrastructureError(FailureLayer.SANDBOX_CREATE, str(exc), 1) from None
        await asyncio.sleep(self._rng.uniform(0, self.retries.create_spread_s))
        labels = {**self.labels, ROLLOUT_LABEL: rollout_label(record.rollout_id)}
        settings = dataclasses.replace(harness.settings, labels=labels)
        lifetime_s = self.budget.max_duration_s + EPISODE_SCORING_S

        async def attempt(_: int) -> BrowserEpisode:
            try:
                return await BrowserEpisode.open(
                    self.sandboxes,
                    settings,
                    sites=[gui.site],
                    worlds={gui.site: gui.initial_state},
                    lifetime_s=lifetime_s,
                )
            except BrowserUnavailable as exc:
                raise InfrastructureError(FailureLayer.SANDBOX_CREATE, str(exc), 1) from None
            except sdk_errors.PermissionDenied as exc:
                raise InfrastructureError(
                    FailureLayer.SANDBOX_CREATE,
                    f"the environment service refused the browser sandbox: {exc} (Chromium's "
                    "own sandbox needs user namespaces: allow them to this service, or turn "
                    "chromium_sandbox off in its gui settings)",
                    1,
                ) from None

        episode = await with_retries(
            FailureLayer.SANDBOX_CREATE,
            self.retries.sandbox_create,
            attempt,
            retryable=SANDBOX_CREATE_RETRYABLE,
            rng=self._rng,
        )
        record.sandbox_ids += [episode.site.id, episode.browser.id]
        return BrowserRun(episode, gui.start_url(episode.base_url))

    async def _place_files(self, sandbox: AsyncSandbox, task: TaskSpec) -> None:
        if self.files is None:
            raise InfrastructureError(
                FailureLayer.SANDBOX_CREATE,
                f"task {task.id!r} brings files but this runner has no artifact store",
                1,
            )
        try:
            await place_files(sandbox, task.files, self.files)
        except TaskFilesError as exc:
            raise InfrastructureError(FailureLayer.SANDBOX_CREATE, str(exc), 1) from exc

    async def _run(
        self,
        *,
        key: GroupKey,
        index: int,
        task: TaskSpec,
        harness: Harness,
        record: RolloutRecord,
        memory: str,
        session: RolloutSession | None = None,
    ) -> RolloutResult:
        status = RolloutStatus.ABORTED
        capture = self.capture if session is None else None
        sandbox: AsyncSandbox | None = None
        browser: BrowserRun | None = None
        capturing = False
        program_failure: InfrastructureError | None = None
        try:
            if isinstance(task.check, GuiCheck):
                browser = await self._open_episode(task, task.check, harness, record)
                sandbox = browser.episode.browser
            else:
                sandbox = await self._create(task, record, memory)
                record.sandbox_ids.append(sandbox.id)
            if task.files:
                await self._place_files(sandbox, task)
            for command in task.setup:
                setup = await sandbox.exec(["/bin/sh", "-c", command], timeout=300)
                if setup.signal == KILL_SIGNAL and not setup.timed_out:
                    raise _OutOfMemory()
                if not setup.ok:
                    raise InfrastructureError(
                        FailureLayer.SANDBOX_CREATE,
                        f"setup command {command!r} exited {setup.exit_code}: "
                        f"{setup.stderr_text[-500:]}",
                        1,
                    )
            if session is not None:
                base_url = session.base_url
            elif capture is not None:
                base_url = capture.open(record.rollout_id)
                capturing = True
            else:
                base_url = self.endpoint.for_rollout(record.rollout_id)
            client = openai.AsyncOpenAI(
                base_url=base_url,
                api_key=self.endpoint.api_key,
                max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(verify=_tls_context()),
            )
            try:
                ctx = HarnessContext(
                    rollout_id=record.rollout_id,
                    instruction=task.instruction,
                    sandbox=sandbox,
                    client=client,
                    endpoint=self.endpoint,
                    budget=self.budget,
                    retries=self.retries,
                    record=record,
                    rng=self._rng,
                    tools=task.tools,
                    mcp_servers=task.mcp_servers,
                    browser=browser,
                )
                try:
                    async with asyncio.timeout(self.budget.max_duration_s):
                        outcome = await harness.run(ctx)
                    record.outcome = outcome.outcome
                    status = (
                        RolloutStatus.TRUNCATED if outcome.truncated else RolloutStatus.COMPLETED
                    )
                except TimeoutError:
                    record.outcome = "time_limit"
                    status = RolloutStatus.TRUNCATED
                except InfrastructureError as exc:
                    if not (
                        capture is not None
                        and isinstance(harness, SandboxedProgramHarness)
                        and exc.layer is FailureLayer.HARNESS
                    ):
                        raise
                    program_failure = exc  # judged by its calls, once they settle
            finally:
                await client.close()
            if capture is not None:
                try:
                    record.calls = await capture.settle(record.rollout_id)
                except CaptureNotSettled as exc:
                    raise InfrastructureError(FailureLayer.INFERENCE, str(exc), 1) from None
                if program_failure is not None:
                    if not record.calls or record.calls[-1].finish_reason != "length":
                        raise program_failure
                    # The program gave up because the policy's last answer was cut at its
                    # tokens per call (Claude Code and Codex exit 1 on such answers): the
                    # policy's doing, scored as a truncated rollout, never an exclusion.
                    record.outcome = "token_limit"
                    status = RolloutStatus.TRUNCATED
                if not record.calls and isinstance(harness, SandboxedProgramHarness):
                    # The program ran but its model was never asked (it could not reach the
                    # proxy, or failed before its first call): nothing the policy did to score.
                    output = record.tool_events[-1].output[-500:] if record.tool_events else ""
                    raise InfrastructureError(
                        FailureLayer.INFERENCE,
                        f"{harness.name} ended without one model call reaching the capture "
                        f"proxy: {output.strip() or 'it printed nothing'}",
                        1,
                    )
            scored_in = sandbox

            async def score(_: int) -> RewardRecord:
                if browser is not None:
                    assert isinstance(task.check, GuiCheck)
                    return await self.scorer.judge_episode(task, task.check, browser)
                return await self.scorer.score(task, scored_in)

            record.reward = await with_retries(
                FailureLayer.REWARD,
                self.retries.reward,
                score,
                retryable=(
                    sdk_errors.Unavailable,
                    sdk_errors.Internal,
                    sdk_errors.DeadlineExceeded,
                    RewardUnavailable,
                ),
                rng=self._rng,
            )
        except RewardExcluded as exc:
            record.failure = InfraFailure(FailureLayer.REWARD, str(exc), 1)
            status = RolloutStatus.ABORTED
        except InfrastructureError as exc:
            record.failure = InfraFailure(exc.layer, exc.error, exc.attempts)
            status = RolloutStatus.ABORTED
        except asyncio.CancelledError:
            record.failure = InfraFailure(FailureLayer.CANCELLED, "the rollout was cancelled", 1)
            record.reward = None
            self._finish(key, index, record, RolloutStatus.ABORTED)
            if self.keep_records:
                self.records.append(record)
            raise
        except sdk_errors.OrchardSDKError as exc:
            # A sandbox call outside the retried layers (setup) failed: infrastructure.
            record.failure = InfraFailure(FailureLayer.TOOL_EXEC, f"{type(exc).__name__}: {exc}", 1)
            status = RolloutStatus.ABORTED
        finally:
            if capturing and capture is not None:
                capture.close(record.rollout_id)
            if browser is not None:
                try:
                    await asyncio.shield(browser.episode.close())
                except sdk_errors.OrchardSDKError as exc:
                    log.warning(
                        "rollout %s: episode sandboxes %s not deleted: %s",
                        record.rollout_id,
                        ", ".join(record.sandbox_ids),
                        exc,
                    )
            elif sandbox is not None:
                try:
                    await asyncio.shield(sandbox.delete())
                except sdk_errors.OrchardSDKError as exc:
                    log.warning(
                        "rollout %s: sandbox %s not deleted: %s", record.rollout_id, sandbox.id, exc
                    )
        if status is RolloutStatus.ABORTED:
            record.reward = None
        if browser is not None and self.trails is not None:
            # After the sandboxes are gone: the trail is in memory, and writing it must not
            # hold them (and the site's network allowance) any longer.
            record.gui_trail = await self.trails.keep(record, task, browser, status)
        return self._finish(key, index, record, status)

    def _finish(
        self, key: GroupKey, index: int, record: RolloutRecord, status: RolloutStatus
    ) -> RolloutResult:
        record.status = status
        record.ended_at = time.time()
        reward = record.reward.value if record.reward is not None else None
        if status is RolloutStatus.ABORTED:
            reward = None
        length = sum(len(c.output_token_ids) for c in record.calls) or record.sampled_tokens
        return RolloutResult(
            key, index, status, reward, length, rollout_id=record.rollout_id, payload=record
        )
