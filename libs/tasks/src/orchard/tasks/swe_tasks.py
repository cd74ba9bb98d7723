"""Small software-engineering tasks built in code: tiny git repositories with a real bug.

A :class:`RepoBlueprint` is the whole task in source form: the files at the base commit (the
bug and the tests that already pass), the files the fix changes, and the tests the task adds.
:func:`materialize` turns it into a real git repository at a deterministic base commit (fixed
author and dates, so the commit id is the same on every machine) and returns a
:class:`~orchard.tasks.swe_instances.SweInstance` whose gold patch and test patch are what
``git diff`` says, with FAIL_TO_PASS and PASS_TO_PASS lists. The repository stays at the base
commit, so a sandbox on the ``host`` image sees it there (copy-on-write: the sandbox's edits
never reach the host).

:data:`BUILTIN_BLUEPRINTS` holds a few; a larger suite adds its own blueprints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchard.tasks.commands import pytest_command
from orchard.tasks.swe_instances import SweInstance

__all__ = [
    "BUILTIN_BLUEPRINTS",
    "RepoBlueprint",
    "build_instances",
    "diff_against_base",
    "materialize",
]

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "Orchard Tasks",
    "GIT_AUTHOR_EMAIL": "tasks@orchard.invalid",
    "GIT_COMMITTER_NAME": "Orchard Tasks",
    "GIT_COMMITTER_EMAIL": "tasks@orchard.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}

# No installed plugin is loaded (pytest 8.4 and newer): a blueprint's tests need none, and
# loading them costs most of a small test run.
_PYTEST_CONFIG = (
    '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "--disable-plugin-autoload"\n'
)


@dataclass(frozen=True)
class RepoBlueprint:
    """A task in source form. Paths are repository-relative; file contents are text."""

    instance_id: str
    repo: str
    problem_statement: str
    base_files: Mapping[str, str]
    """The repository at the base commit: the bug, and tests that already pass."""
    fix: Mapping[str, str]
    """Files as the gold patch leaves them."""
    tests: Mapping[str, str]
    """Test files as the test patch leaves them."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    extra_files: Mapping[str, str] = field(default_factory=dict)


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    done = subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "core.autocrlf=false", *args],
        cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout


def _write(repo: Path, files: Mapping[str, str | None]) -> None:
    for relative, content in files.items():
        target = repo / relative
        if content is None:
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def diff_against_base(repo: str | os.PathLike[str], changes: Mapping[str, str | None]) -> str:
    """The unified diff (``git diff`` format, ``a/`` and ``b/`` prefixes) that turns the
    repository's HEAD into HEAD with ``changes`` (path → new content, None deletes). The
    repository is left as it was."""
    root = Path(repo)
    head = _git(root, "rev-parse", "HEAD").strip()
    try:
        _write(root, changes)
        _git(root, "add", "-A")
        return _git(root, "diff", "--cached", "--no-color", "--no-ext-diff", head)
    finally:
        _git(root, "reset", "-q", "--hard", head)
        _git(root, "clean", "-fdq")


def materialize(
    blueprint: RepoBlueprint,
    parent: str | os.PathLike[str],
    *,
    python: str = sys.executable,
    image: str = "host",
) -> SweInstance:
    """Create the repository in ``parent/<instance_id>`` and return its instance.

    ``python`` is the interpreter the test command runs inside the sandbox; it needs pytest
    (the default, this interpreter, is visible in a ``host``-image sandbox). The instance's
    ``repo_path`` is the repository's absolute path, so a ``host``-image sandbox finds it.
    """
    repo = Path(parent).resolve() / blueprint.instance_id
    if repo.exists():
        raise FileExistsError(f"{repo} exists already; materialize into an empty folder")
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    _write(repo, {"pyproject.toml": _PYTEST_CONFIG, **blueprint.base_files})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{blueprint.repo}: base of {blueprint.instance_id}")
    base_commit = _git(repo, "rev-parse", "HEAD").strip()
    gold = diff_against_base(repo, dict(blueprint.fix))
    test_patch = diff_against_base(repo, dict(blueprint.tests))
    return SweInstance(
        instance_id=blueprint.instance_id,
        repo=blueprint.repo,
        base_commit=base_commit,
        patch=gold,
        test_patch=test_patch,
        fail_to_pass=blueprint.fail_to_pass,
        pass_to_pass=blueprint.pass_to_pass,
        image=image,
        problem_statement=blueprint.problem_statement,
        repo_path=str(repo),
        test_command=pytest_command(python, (*blueprint.fail_to_pass, *blueprint.pass_to_pass)),
        parser="pytest",
    )


def build_instances(
    parent: str | os.PathLike[str],
    blueprints: Sequence[RepoBlueprint] | None = None,
    *,
    python: str = sys.executable,
    image: str = "host",
) -> list[SweInstance]:
    """Materialize every blueprint (default: :data:`BUILTIN_BLUEPRINTS`) under ``parent``."""
    chosen = BUILTIN_BLUEPRINTS if blueprints is None else blueprints
    return [materialize(b, parent, python=python, image=image) for b in chosen]


# ---------------------------------------------------------------------------------------------
# The built-in tasks: each bug is a real one people write, each test a real pytest test.

_STATS_BASE = '''\
"""Summary statistics of a list of numbers."""


def total(values):
    return sum(values)


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return total(values) // len(values)
'''

_STATS_FIXED = _STATS_BASE.replace("total(values) // len(values)", "total(values) / len(values)")

_STATS_TESTS_BASE = """\
import pytest

from stats import mean, total


def test_total():
    assert total([1, 2, 3]) == 6


def test_mean_of_even_total():
    assert mean([2, 4]) == 3


def test_mean_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        mean([])
"""

_STATS_TESTS = (
    _STATS_TESTS_BASE
    + """

def test_mean_keeps_the_fraction():
    assert mean([1, 2]) == 1.5


@pytest.mark.parametrize("values, expected", [([1, 2, 4], 7 / 3), ([0.5, 0.25], 0.375)])
def test_mean_is_exact(values, expected):
    assert mean(values) == pytest.approx(expected)
"""
)

_SLUG_BASE = '''\
"""Turning titles into URL slugs."""

import re


def slugify(title):
    words = re.sub(r"[^a-z]+", "-", title.lower())
    return words.strip("-")
'''

_SLUG_FIXED = _SLUG_BASE.replace('r"[^a-z]+"', 'r"[^a-z0-9]+"')

_SLUG_TESTS_BASE = """\
from textkit import slugify


def test_lowercases_and_joins_words():
    assert slugify("Hello World") == "hello-world"


def test_strips_separators_at_the_edges():
    assert slugify("  --Orchard!  ") == "orchard"
"""

_SLUG_TESTS = (
    _SLUG_TESTS_BASE
    + """

def test_keeps_digits():
    assert slugify("Top 10 Pears of 2026") == "top-10-pears-of-2026"
"""
)

_INTERVALS_BASE = '''\
"""Merging closed intervals [start, end]."""


def merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''

_INTERVALS_FIXED = _INTERVALS_BASE.replace("start < merged[-1][1]", "start <= merged[-1][1]")

_INTERVALS_TESTS_BASE = """\
from intervals import merge


def test_nothing_to_merge():
    assert merge([]) == []


def test_disjoint_intervals_stay_apart():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_overlapping_intervals_merge():
    assert merge([(1, 4), (2, 3), (3, 8)]) == [(1, 8)]
"""

_INTERVALS_TESTS = (
    _INTERVALS_TESTS_BASE
    + """

class TestClosedIntervals:
    def test_touching_intervals_merge(self):
        assert merge([(1, 2), (2, 3)]) == [(1, 3)]

    def test_a_point_touching_an_interval_merges(self):
        assert merge([(4, 4), (1, 4)]) == [(1, 4)]
"""
)

BUILTIN_BLUEPRINTS: tuple[RepoBlueprint, ...] = (
    RepoBlueprint(
        instance_id="orchard-tasks__stats-1",
        repo="orchard-tasks/stats",
        problem_statement="mean([1, 2]) returns 1 instead of 1.5: the mean drops the fraction.",
        base_files={"stats.py": _STATS_BASE, "tests/test_stats.py": _STATS_TESTS_BASE},
        fix={"stats.py": _STATS_FIXED},
        tests={"tests/test_stats.py": _STATS_TESTS},
        fail_to_pass=(
            "tests/test_stats.py::test_mean_keeps_the_fraction",
            "tests/test_stats.py::test_mean_is_exact[values0-2.3333333333333335]",
            "tests/test_stats.py::test_mean_is_exact[values1-0.375]",
        ),
        pass_to_pass=(
            "tests/test_stats.py::test_total",
            "tests/test_stats.py::test_mean_of_even_total",
            "tests/test_stats.py::test_mean_of_nothing_is_an_error",
        ),
    ),
    RepoBlueprint(
        instance_id="orchard-tasks__textkit-1",
        repo="orchard-tasks/textkit",
        problem_statement='slugify("Top 10 Pears") gives "top-pears": digits are dropped.',
        base_files={"textkit.py": _SLUG_BASE, "tests/test_slugify.py": _SLUG_TESTS_BASE},
        fix={"textkit.py": _SLUG_FIXED},
        tests={"tests/test_slugify.py": _SLUG_TESTS},
        fail_to_pass=("tests/test_slugify.py::test_keeps_digits",),
        pass_to_pass=(
            "tests/test_slugify.py::test_lowercases_and_joins_words",
            "tests/test_slugify.py::test_strips_separators_at_the_edges",
        ),
    ),
    RepoBlueprint(
        instance_id="orchard-tasks__intervals-1",
        repo="orchard-tasks/intervals",
        problem_statement="merge([(1, 2), (2, 3)]) keeps two intervals; closed intervals that "
        "touch must merge into (1, 3).",
        base_files={"intervals.py": _INTERVALS_BASE, "tests/test_merge.py": _INTERVALS_TESTS_BASE},
        fix={"intervals.py": _INTERVALS_FIXED},
        tests={"tests/test_merge.py": _INTERVALS_TESTS},
        fail_to_pass=(
            "tests/test_merge.py::TestClosedIntervals::test_touching_intervals_merge",
            "tests/test_merge.py::TestClosedIntervals::test_a_point_touching_an_interval_merges",
        ),
        pass_to_pass=(
            "tests/test_merge.py::test_nothing_to_merge",
            "tests/test_merge.py::test_disjoint_intervals_stay_apart",
            "tests/test_merge.py::test_overlapping_intervals_merge",
        ),
    ),
)
