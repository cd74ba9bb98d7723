"""A personal-assistant task's checks run in its sandbox, combined into the task score.

Each configured check is a shell command; it passes when it exits 0. Completion, safety and
robustness are each the fraction of their checks that pass (a part without checks counts 1.0)
and :func:`orchard.reward.task_score.task_score` combines them. A check past its time limit,
or a sandbox that fails while checks run, makes the whole score EXCLUDED: a missing answer is
not a failed one.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchard.reward.config import CheckConfig, TaskChecksConfig
from orchard.reward.outcome import Evidence, Exclusion, ScoreResult, excluded, scored
from orchard.reward.task_score import SCORER, task_score
from orchard.sdk import errors
from orchard.sdk.aio import AsyncSandbox

__all__ = ["score_task_in_sandbox"]


class _Excluded(Exception):
    def __init__(self, why: Exclusion, detail: str) -> None:
        super().__init__(detail)
        self.why = why


async def _fraction(
    sandbox: AsyncSandbox, part: str, checks: Sequence[CheckConfig], evidence: list[Evidence]
) -> float:
    if not checks:
        return 1.0
    passed = 0
    for check in checks:
        try:
            result = await sandbox.exec(
                check.command, cwd=check.working_dir or None, timeout=check.timeout_s
            )
        except errors.FileNotFound as exc:  # the working directory is gone: the check fails
            evidence.append(Evidence.of(f"{part} {check.name}: FAIL", str(exc)))
            continue
        except errors.ServiceError as exc:
            raise _Excluded(
                Exclusion.SANDBOX_FAILURE, f"the sandbox failed during {part} check {check.name}"
                f": {exc}",
            ) from None  # fmt: skip
        output = (result.stdout_text + result.stderr_text).strip()
        if result.timed_out:
            evidence.append(Evidence.of(f"{part} {check.name}: timed out", output))
            raise _Excluded(
                Exclusion.TIMEOUT,
                f"{part} check {check.name} passed its time limit of {check.timeout_s:g} s",
            )
        ok = result.exit_code == 0 and not result.signal
        passed += ok
        verdict = "PASS" if ok else f"FAIL (exit {result.exit_code}, signal {result.signal})"
        evidence.append(
            Evidence.of(f"{part} {check.name}: {verdict}", f"$ {check.command}\n{output}")
        )
    return passed / len(checks)


async def score_task_in_sandbox(sandbox: AsyncSandbox, task: TaskChecksConfig) -> ScoreResult:
    """The task score from the checks, or EXCLUDED (timeout, sandbox failure)."""
    evidence: list[Evidence] = []
    try:
        safety = await _fraction(sandbox, "safety", task.safety, evidence)
        completion = await _fraction(sandbox, "completion", task.completion, evidence)
        robustness = await _fraction(sandbox, "robustness", task.robustness, evidence)
    except _Excluded as exc:
        return excluded(SCORER, exc.why, str(exc), evidence=tuple(evidence))
    result = task_score(safety=safety, completion=completion, robustness=robustness)
    return scored(
        SCORER, result.value, detail=result.detail, components=result.components,
        evidence=tuple(evidence),
    )  # fmt: skip
