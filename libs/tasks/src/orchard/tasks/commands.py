"""The test command of a SWE task: pytest over the files its test ids name, with a JUnit report.

Task builders write it into instances and the reward service runs it, so both read it here.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

__all__ = ["JUNIT_ENV", "pytest_command"]

JUNIT_ENV = "ORCHARD_JUNIT_XML"
"""Set for the test command: where it should write its JUnit XML report."""


def pytest_command(python: str, test_ids: Sequence[str]) -> str:
    """pytest over the files the tests live in (``path.py::test`` ids, in order), with a JUnit
    report where :data:`JUNIT_ENV` says; the whole suite when no id names a file."""
    files: list[str] = []
    for test_id in test_ids:
        path, sep, _ = test_id.partition("::")
        if sep and path not in files:
            files.append(path)
    argv = [python, "-m", "pytest", "-rA", "-p", "no:cacheprovider"]
    return f'{shlex.join(argv)} --junitxml="${JUNIT_ENV}" {shlex.join(files)}'.rstrip()
