"""The test-based reward of a software-engineering task (SWE-bench instance semantics).

Resolved (+1) only when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still
passes; anything else (a test failing, erroring, skipped or missing from the report) is -1.
Running the tests in a sandbox is the caller's job; this module decides from their output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchard.core.errors import OrchardError, Reason
from orchard.reward.outcome import Evidence, ScoreResult, scored
from orchard.reward.test_output import PARSERS, Outcome, ParseError, outcomes_for

__all__ = [
    "RESOLVED",
    "UNRESOLVED",
    "TestVerdict",
    "judge_outcomes",
    "judge_test_run",
    "parser_named",
    "require_fail_to_pass",
]

RESOLVED = 1.0
UNRESOLVED = -1.0
SCORER = "tests"


@dataclass(frozen=True)
class TestVerdict:
    """The reward and the outcome of every listed test (None: not seen in the report)."""

    result: ScoreResult
    fail_to_pass: dict[str, Outcome | None]
    pass_to_pass: dict[str, Outcome | None]


def parser_named(name: str) -> str:
    """``name`` (empty means ``pytest``) if a parser by that name exists, else INVALID_ARGUMENT."""
    chosen = name or "pytest"
    if chosen not in PARSERS:
        known = ", ".join(sorted(PARSERS))
        raise OrchardError(
            Reason.INVALID_ARGUMENT, f"unknown test output parser {chosen!r}; known: {known}"
        )
    return chosen


def require_fail_to_pass(fail_to_pass: Sequence[str]) -> None:
    """INVALID_ARGUMENT when the list is empty: without it no patch can be judged."""
    if not fail_to_pass:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            "the task lists no FAIL_TO_PASS tests: without them a patch cannot be judged",
        )


def judge_test_run(
    output: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    *,
    parser: str = "pytest",
) -> TestVerdict:
    """Score a finished test run from its ``output`` (or JUnit XML, by ``parser``)."""
    require_fail_to_pass(fail_to_pass)
    parse = PARSERS[parser_named(parser)]
    evidence: list[Evidence] = []
    try:
        outcomes = parse(output)
    except ParseError as exc:
        # Unreadable output is the policy's doing as far as we can tell (it may have broken the
        # test runner); the evidence keeps the output for a person to check.
        outcomes = {}
        evidence.append(Evidence.of("report parse error", str(exc)))
    evidence.append(Evidence.of(f"test output ({parser or 'pytest'})", output))
    return judge_outcomes(outcomes, fail_to_pass, pass_to_pass, evidence=tuple(evidence))


def judge_outcomes(
    outcomes: dict[str, Outcome],
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    *,
    evidence: tuple[Evidence, ...] = (),
) -> TestVerdict:
    """Score already parsed outcomes (several reports may be merged into one mapping: ids of
    either spelling match, the worse outcome wins); ``evidence`` follows the listed tests."""
    require_fail_to_pass(fail_to_pass)
    f2p = outcomes_for(fail_to_pass, outcomes)
    p2p = outcomes_for(pass_to_pass, outcomes)
    broken = [name for name, outcome in {**f2p, **p2p}.items() if outcome is not Outcome.PASSED]
    resolved = not broken
    lines = [
        f"{'PASS' if outcome is Outcome.PASSED else 'FAIL'} "
        f"{kind} {name}: {outcome.name if outcome else 'not in the report'}"
        for kind, listing in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p))
        for name, outcome in listing.items()
    ]
    detail = "resolved" if resolved else f"{len(broken)} listed test(s) not passing"
    result = scored(
        SCORER,
        RESOLVED if resolved else UNRESOLVED,
        detail=detail,
        components={
            "fail_to_pass_passed": float(sum(o is Outcome.PASSED for o in f2p.values())),
            "fail_to_pass_total": float(len(f2p)),
            "pass_to_pass_passed": float(sum(o is Outcome.PASSED for o in p2p.values())),
            "pass_to_pass_total": float(len(p2p)),
        },
        evidence=(Evidence.of("listed tests", "\n".join(lines)), *evidence),
    )
    return TestVerdict(result, f2p, p2p)
