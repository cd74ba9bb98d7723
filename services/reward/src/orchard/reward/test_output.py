"""Per-test outcomes from a test run's output: pytest's report lines and JUnit XML.

Parsers are registered by name (``pytest``, ``junit``); a task names its parser, and other
runners plug in with :func:`register_parser`. A parser maps test ids to outcomes; when one
test shows up more than once (a pass, then an error at teardown) the worse outcome wins.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable

import defusedxml.ElementTree as SafeElementTree

__all__ = [
    "PARSERS",
    "Outcome",
    "ParseError",
    "normalize_test_id",
    "outcomes_for",
    "parse_junit_xml",
    "parse_pytest_output",
    "register_parser",
]


class Outcome(enum.IntEnum):
    """A test's outcome; a larger value is worse, so merging keeps the maximum."""

    PASSED = 1
    SKIPPED = 2
    FAILED = 3
    ERROR = 4

    @property
    def passed(self) -> bool:
        return self is Outcome.PASSED


class ParseError(ValueError):
    """The output is not what the parser reads (e.g. XML that does not parse)."""


Parser = Callable[[str], dict[str, Outcome]]

_PYTEST_WORDS = {
    "PASSED": Outcome.PASSED,
    "XFAIL": Outcome.PASSED,  # an expected failure is the test doing what it says
    "XPASS": Outcome.FAILED,  # strict-xfail semantics: an unexpected pass breaks the contract
    "FAILED": Outcome.FAILED,
    "ERROR": Outcome.ERROR,
    "SKIPPED": Outcome.SKIPPED,
}
_SUMMARY = re.compile(r"^(PASSED|XFAIL|XPASS|FAILED|ERROR|SKIPPED)\s+(.+)$")
_VERBOSE = re.compile(
    r"^(\S+::\S.*?)\s+(PASSED|XFAIL|XPASS|FAILED|ERROR|SKIPPED)(?:\s+\(.*\))?(?:\s+\[\s*\d+%\])?$"
)


def _leading_test_id(rest: str) -> str:
    """The node id at the start of ``rest``; parameter brackets may hold spaces and dashes."""
    depth = 0
    for index, char in enumerate(rest):
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        elif char.isspace() and depth == 0:
            return rest[:index]
    return rest


def _merge(outcomes: dict[str, Outcome], test_id: str, outcome: Outcome) -> None:
    previous = outcomes.get(test_id)
    outcomes[test_id] = outcome if previous is None else max(previous, outcome)


def parse_pytest_output(text: str) -> dict[str, Outcome]:
    """Outcomes from pytest's ``-rA`` short summary and ``-v`` progress lines.

    ``ERROR tests/x.py::t - ...`` and ``tests/x.py::t PASSED [ 50%]`` both count. Skip lines
    of the form ``SKIPPED [1] file:line: reason`` carry no node id and are ignored.
    """
    outcomes: dict[str, Outcome] = {}
    for raw in text.splitlines():
        line = raw.strip()
        summary = _SUMMARY.match(line)
        if summary:
            word, rest = summary.groups()
            if rest.startswith("["):
                continue
            test_id = _leading_test_id(rest)
            if "::" in test_id:
                _merge(outcomes, test_id, _PYTEST_WORDS[word])
            continue
        verbose = _VERBOSE.match(line)
        if verbose:
            _merge(outcomes, verbose.group(1), _PYTEST_WORDS[verbose.group(2)])
    return outcomes


def parse_junit_xml(text: str) -> dict[str, Outcome]:
    """Outcomes from a JUnit XML report, ids as ``classname.name`` (or ``name`` alone).

    Parsed with ``defusedxml``: the report comes from inside a sandbox and is not trusted.
    """
    try:
        root = SafeElementTree.fromstring(text)
    except Exception as exc:  # defusedxml raises ParseError and its own DTD/entity errors
        raise ParseError(f"JUnit XML does not parse: {exc}") from exc
    outcomes: dict[str, Outcome] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "")
        if not name:
            continue
        classname = case.get("classname", "")
        test_id = f"{classname}.{name}" if classname else name
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = Outcome.ERROR
        elif "failure" in tags:
            outcome = Outcome.FAILED
        elif "skipped" in tags:
            # pytest writes an expected failure as <skipped type="pytest.xfail">.
            skipped = case.find("skipped")
            xfail = skipped is not None and skipped.get("type") == "pytest.xfail"
            outcome = Outcome.PASSED if xfail else Outcome.SKIPPED
        else:
            outcome = Outcome.PASSED
        _merge(outcomes, test_id, outcome)
    return outcomes


def normalize_test_id(test_id: str) -> str:
    """One spelling for pytest node ids and JUnit ids, so task lists match either report.

    ``tests/test_x.py::Cls::test_y[a/b]`` and ``tests.test_x.Cls.test_y[a/b]`` both become
    ``tests.test_x.Cls.test_y[a/b]``; the parameter part is kept as it is.
    """
    head, bracket, params = test_id.partition("[")
    if "::" in head:
        path, _, rest = head.partition("::")
        if path.endswith(".py"):
            path = path[: -len(".py")]
        head = path.replace("/", ".") + "." + rest.replace("::", ".")
    return head + bracket + params


PARSERS: dict[str, Parser] = {"pytest": parse_pytest_output, "junit": parse_junit_xml}


def register_parser(name: str, parser: Parser) -> None:
    """Make ``parser`` available to tasks as ``name``; a name cannot be registered twice."""
    if name in PARSERS:
        raise ValueError(f"a test output parser named {name!r} is registered already")
    PARSERS[name] = parser


def outcomes_for(listed: Iterable[str], outcomes: dict[str, Outcome]) -> dict[str, Outcome | None]:
    """The outcome of each listed test (None: not in the report), matched by normalized id."""
    by_normal: dict[str, Outcome] = {}
    for test_id, outcome in outcomes.items():
        _merge(by_normal, normalize_test_id(test_id), outcome)
    return {name: by_normal.get(normalize_test_id(name)) for name in listed}
