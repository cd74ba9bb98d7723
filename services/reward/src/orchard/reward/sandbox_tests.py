"""Running a software-engineering task's tests in a sandbox, through the environment service.

The steps, each recorded as evidence: the candidate patch is applied (``git apply``, else
``patch``); the files the task's test patch touches are reset to the base commit (so a
candidate cannot pre-empt or break the official tests) and the test patch is applied; the tests
run under a time limit with JUnit XML written beside pytest's report; both reports are parsed,
merged and judged by :func:`orchard.reward.tests_score.judge_outcomes`.

Who is to blame decides the status:

- a candidate patch that does not apply is the policy's failure: -1;
- the sandbox dying, vanishing or becoming unreachable at any step is EXCLUDED
  (sandbox failure); so is a run that hits its time limit (timeout): a time limit is an
  infrastructure budget, and a slow machine must not teach the policy that its patch was wrong;
- a test patch that does not apply at the base commit is the task's fault: EXCLUDED (other).
"""

from __future__ import annotations

import logging
import re
import shlex
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from orchard.reward.outcome import Evidence, Exclusion, ScoreResult, excluded, scored
from orchard.reward.test_output import PARSERS, Outcome, ParseError
from orchard.reward.tests_score import (
    SCORER,
    UNRESOLVED,
    TestVerdict,
    judge_outcomes,
    parser_named,
    require_fail_to_pass,
)
from orchard.sdk import errors
from orchard.sdk.aio import AsyncSandbox
from orchard.sdk.types import ExecResult, SandboxState
from orchard.tasks.commands import JUNIT_ENV, pytest_command

__all__ = [
    "JUNIT_ENV",
    "TestRun",
    "TestRunResult",
    "patched_paths",
    "pytest_command",
    "run_tests_in_sandbox",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_PLUS_FILE = re.compile(r"^\+\+\+ (?:b/)?(\S+)")
_MINUS_FILE = re.compile(r"^--- (?:a/)?(\S+)")
# Quick calls around the run (file writes, state checks) need no minutes.
_STEP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TestRun:
    """What to run: one task instance against one candidate patch."""

    __test__ = False  # not a pytest test class

    repo_path: str
    candidate_patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    timeout_s: float
    base_commit: str = ""
    test_command: str = ""
    """A shell command; empty runs pytest on the files the listed tests live in."""
    parser: str = "pytest"
    python: str = "python3"
    output_limit_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class TestRunResult:
    """The reward, the outcome of every listed test (when the tests ran) and whether the
    candidate patch applied."""

    __test__ = False

    result: ScoreResult
    verdict: TestVerdict | None
    patch_applied: bool


class _SandboxLost(Exception):
    """The sandbox failed under us; the message says at which step."""


@dataclass
class _Progress:
    """What happened so far: kept when the sandbox fails halfway."""

    evidence: list[Evidence]
    patch_applied: bool = False


def patched_paths(diff: str) -> list[str]:
    """Repository-relative paths a unified diff touches, in order, without duplicates."""
    paths: list[str] = []
    for line in diff.splitlines():
        match = _DIFF_GIT.match(line)
        found: list[str] = []
        if match:
            found = [match.group(1), match.group(2)]
        else:
            for pattern in (_MINUS_FILE, _PLUS_FILE):
                header = pattern.match(line)
                if header and header.group(1) != "/dev/null":
                    found.append(header.group(1))
        for path in found:
            if path not in paths:
                paths.append(path)
    return paths


async def run_tests_in_sandbox(sandbox: AsyncSandbox, run: TestRun) -> TestRunResult:
    """Apply, run, parse and judge; never raises for a sandbox that fails (EXCLUDED instead).

    Raises ``OrchardError(INVALID_ARGUMENT)`` for an empty FAIL_TO_PASS list or an unknown
    parser, before touching the sandbox.
    """
    require_fail_to_pass(run.fail_to_pass)
    parser = parser_named(run.parser)
    progress = _Progress([])
    try:
        return await _run(sandbox, run, parser, progress)
    except _SandboxLost as exc:
        evidence = tuple(progress.evidence)
        return TestRunResult(
            excluded(SCORER, Exclusion.SANDBOX_FAILURE, str(exc), evidence=evidence),
            None,
            progress.patch_applied,
        )


async def _run(
    sandbox: AsyncSandbox, run: TestRun, parser: str, progress: _Progress
) -> TestRunResult:
    evidence = progress.evidence
    if not await _call(sandbox, "find the repository", sandbox.exists(run.repo_path)):
        detail = f"no repository at {run.repo_path} in sandbox {sandbox.id}"
        return TestRunResult(
            excluded(SCORER, Exclusion.OTHER, detail, evidence=tuple(evidence)), None, False
        )

    if not run.candidate_patch.strip():
        evidence.append(Evidence.of("candidate patch", "empty: nothing to apply"))
    else:
        try:
            applied = await _call(
                sandbox,
                "apply the candidate patch",
                sandbox.apply_diff(run.candidate_patch, cwd=run.repo_path),
            )
        except errors.PatchFailed as exc:
            if not exc.tool:  # neither git nor patch in the image: not the policy's doing
                return TestRunResult(
                    excluded(SCORER, Exclusion.OTHER, str(exc), evidence=tuple(evidence)),
                    None,
                    False,
                )
            evidence.append(Evidence.of(f"candidate patch did not apply ({exc.tool})", str(exc)))
            evidence.append(Evidence.of("candidate patch", run.candidate_patch))
            result = scored(
                SCORER, UNRESOLVED, detail="the candidate patch does not apply",
                components={"patch_applied": 0.0}, evidence=tuple(evidence),
            )  # fmt: skip
            return TestRunResult(result, None, False)
        progress.patch_applied = True
        evidence.append(Evidence.of("candidate patch applied", _output(applied) or "(no output)"))

    if run.test_patch.strip():
        paths = patched_paths(run.test_patch)
        if run.base_commit and paths:
            reset = await _exec(sandbox, _reset_script(run.base_commit, paths), run.repo_path)
            evidence.append(Evidence.of("test files reset to the base commit", _output(reset)))
        try:
            await _call(
                sandbox,
                "apply the test patch",
                sandbox.apply_diff(run.test_patch, cwd=run.repo_path),
            )
        except errors.PatchFailed as exc:
            detail = "the task's test patch does not apply at the base commit"
            evidence.append(Evidence.of(detail, str(exc)))
            return TestRunResult(
                excluded(SCORER, Exclusion.OTHER, detail, evidence=tuple(evidence)),
                None,
                progress.patch_applied,
            )

    junit_path = f"/tmp/orchard-junit-{uuid.uuid4().hex[:12]}.xml"
    command = run.test_command or pytest_command(run.python, (*run.fail_to_pass, *run.pass_to_pass))
    evidence.append(Evidence.of("test command", f"cd {run.repo_path} && {command}"))
    try:
        tests = await sandbox.exec(
            command,
            cwd=run.repo_path,
            env={JUNIT_ENV: junit_path},
            timeout=run.timeout_s,
            output_limit=run.output_limit_bytes,
        )
    except errors.ServiceError as exc:
        raise _SandboxLost(f"the sandbox failed while the tests ran: {exc}") from None
    output = _output(tests)
    evidence.append(Evidence.of(f"test output (exit {_exit(tests)})", output))
    if tests.timed_out:
        detail = f"the test run passed its time limit of {run.timeout_s:g} s"
        return TestRunResult(
            excluded(SCORER, Exclusion.TIMEOUT, detail, evidence=tuple(evidence)),
            None,
            progress.patch_applied,
        )
    if tests.signal or tests.exit_code is None or tests.exit_code >= 128:
        await _still_ready(sandbox, "while the tests ran")

    junit = await _read_junit(sandbox, junit_path)
    outcomes, notes = _parse(parser, output, junit)
    evidence.extend(notes)
    verdict = judge_outcomes(outcomes, run.fail_to_pass, run.pass_to_pass, evidence=tuple(evidence))
    result = verdict.result
    components = {**result.components, "patch_applied": float(progress.patch_applied)}
    result = scored(
        SCORER, result.value, detail=result.detail, components=components,
        evidence=result.evidence,
    )  # fmt: skip
    return TestRunResult(result, verdict, progress.patch_applied)


def _reset_script(base_commit: str, paths: Sequence[str]) -> str:
    # A path in the base commit gets its base content back; one the test patch creates goes.
    base = shlex.quote(base_commit)
    lines = [
        f"if git cat-file -e {base}:{shlex.quote(path)} 2>/dev/null; then "
        f"git checkout -q {base} -- {shlex.quote(path)}; else rm -f -- {shlex.quote(path)}; fi"
        for path in paths
    ]
    return "\n".join(["git rev-parse --is-inside-work-tree >/dev/null 2>&1 || exit 0", *lines])


def _parse(
    parser: str, output: str, junit: str | None
) -> tuple[dict[str, Outcome], list[Evidence]]:
    """Outcomes from the text output (for text parsers) and the JUnit report, merged."""
    outcomes: dict[str, Outcome] = {}
    notes: list[Evidence] = []
    sources: list[tuple[str, str]] = []
    if parser == "junit":
        if junit is None:
            notes.append(Evidence.of("JUnit report", f"missing: nothing written to ${JUNIT_ENV}"))
        else:
            sources.append(("junit", junit))
    else:
        sources.append((parser, output))
        if junit is not None:
            sources.append(("junit", junit))
    for name, text in sources:
        try:
            parsed = PARSERS[name](text)
        except ParseError as exc:
            notes.append(Evidence.of(f"{name} report parse error", str(exc)))
            continue
        for test_id, outcome in parsed.items():
            previous = outcomes.get(test_id)
            outcomes[test_id] = outcome if previous is None else max(previous, outcome)
    if junit is not None:
        notes.append(Evidence.of("JUnit report", junit))
    return outcomes, notes


async def _read_junit(sandbox: AsyncSandbox, path: str) -> str | None:
    try:
        data = await _call(sandbox, "read the JUnit report", sandbox.read_file(path))
    except errors.FileNotFound:
        return None
    await _exec(sandbox, f"rm -f -- {shlex.quote(path)}", "/")
    return data.decode("utf-8", errors="replace")


async def _exec(sandbox: AsyncSandbox, script: str, cwd: str) -> ExecResult:
    return await _call(
        sandbox, f"run {script.splitlines()[-1][:60]!r}",
        sandbox.exec(script, cwd=cwd, timeout=_STEP_TIMEOUT_S),
    )  # fmt: skip


async def _call(sandbox: AsyncSandbox, step: str, call: Awaitable[T]) -> T:
    """Await ``call``; an environment-service failure becomes :class:`_SandboxLost`.

    ``FileNotFound`` and ``PatchFailed`` pass through: they are answers, not failures.
    """
    try:
        return await call
    except (errors.FileNotFound, errors.PatchFailed):
        raise
    except errors.ServiceError as exc:
        raise _SandboxLost(f"the sandbox failed ({step}): {exc}") from None


async def _still_ready(sandbox: AsyncSandbox, when: str) -> None:
    """Raise :class:`_SandboxLost` unless the sandbox is still READY (a killed run is the
    sandbox's doing when the sandbox itself is gone)."""
    try:
        info = await sandbox.refresh()
    except errors.ServiceError as exc:
        raise _SandboxLost(f"the sandbox failed {when}: {exc}") from None
    if info.state is not SandboxState.READY:
        reason = info.failure_message or info.failure_reason or "no longer READY"
        raise _SandboxLost(f"the sandbox is {info.state.name} {when}: {reason}")


def _output(result: ExecResult) -> str:
    text = result.stdout_text
    if result.stderr_text:
        text += ("\n" if text else "") + result.stderr_text
    return text


def _exit(result: ExecResult) -> str:
    if result.timed_out:
        return "timed out"
    if result.signal:
        return f"signal {result.signal}"
    return str(result.exit_code)
