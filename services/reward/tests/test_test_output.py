"""Parsing real pytest output and JUnit XML, and scoring listed tests from them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchard.core.errors import OrchardError
from orchard.reward.test_output import (
    Outcome,
    ParseError,
    normalize_test_id,
    parse_junit_xml,
    parse_pytest_output,
    register_parser,
)
from orchard.reward.tests_score import RESOLVED, UNRESOLVED, judge_test_run

SAMPLE_TESTS = """
import pytest

def test_pass():
    assert 1 + 1 == 2

def test_fail():
    assert 1 + 1 == 3

@pytest.mark.parametrize("word", ["a b", "c - d"])
def test_param(word):
    assert " " in word

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

def test_error(broken):
    pass

class TestGroup:
    def test_method(self):
        assert True
"""

EXPECTED = {
    "tests/test_sample.py::test_pass": Outcome.PASSED,
    "tests/test_sample.py::test_fail": Outcome.FAILED,
    "tests/test_sample.py::test_param[a b]": Outcome.PASSED,
    "tests/test_sample.py::test_param[c - d]": Outcome.PASSED,
    "tests/test_sample.py::test_xfail": Outcome.PASSED,
    "tests/test_sample.py::test_error": Outcome.ERROR,
    "tests/test_sample.py::TestGroup::test_method": Outcome.PASSED,
}


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A real pytest run over a small test file: its ``-rA -v`` output and its JUnit XML."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_sample.py").write_text(textwrap.dedent(SAMPLE_TESTS))
    report = repo / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-v", "-p", "no:cacheprovider",
         "-o", "addopts=", "--rootdir", str(repo), f"--junitxml={report}", "tests"],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # some tests fail on purpose
    return run.stdout, report.read_text()


def test_pytest_output_gives_every_outcome(sample_run: tuple[str, str]) -> None:
    outcomes = parse_pytest_output(sample_run[0])
    for test_id, outcome in EXPECTED.items():
        assert outcomes[test_id] is outcome, test_id
    # Skips in the summary carry no node id; the verbose line still names the test.
    assert outcomes["tests/test_sample.py::test_skipped"] is Outcome.SKIPPED


def test_junit_xml_gives_the_same_outcomes(sample_run: tuple[str, str]) -> None:
    by_normal = {normalize_test_id(k): v for k, v in parse_junit_xml(sample_run[1]).items()}
    for test_id, outcome in EXPECTED.items():
        assert by_normal[normalize_test_id(test_id)] is outcome, test_id


def test_a_teardown_error_after_a_pass_counts_as_an_error() -> None:
    text = "tests/t.py::test_a PASSED [ 50%]\nERROR tests/t.py::test_a - RuntimeError: teardown\n"
    assert parse_pytest_output(text) == {"tests/t.py::test_a": Outcome.ERROR}


def test_broken_xml_is_a_parse_error_and_entities_are_refused() -> None:
    with pytest.raises(ParseError):
        parse_junit_xml("<testsuite><testcase name='a'>")
    bomb = (
        '<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]>'
        "<testsuite><testcase name='&b;'/></testsuite>"
    )
    with pytest.raises(ParseError):
        parse_junit_xml(bomb)


def test_normalized_ids_match_across_report_kinds() -> None:
    assert normalize_test_id("a/b/test_x.py::C::t[p/q::r]") == "a.b.test_x.C.t[p/q::r]"
    assert normalize_test_id("a.b.test_x.C.t[p/q::r]") == "a.b.test_x.C.t[p/q::r]"


def test_resolved_only_when_every_listed_test_passes(sample_run: tuple[str, str]) -> None:
    output = sample_run[0]
    good = judge_test_run(
        output,
        ["tests/test_sample.py::test_pass"],
        ["tests/test_sample.py::test_param[c - d]", "tests/test_sample.py::TestGroup::test_method"],
    )
    assert good.result.value == RESOLVED
    assert good.result.is_scored
    assert good.result.components["pass_to_pass_passed"] == 2

    for f2p, p2p in (
        (["tests/test_sample.py::test_fail"], []),
        (["tests/test_sample.py::test_pass"], ["tests/test_sample.py::test_error"]),
        (["tests/test_sample.py::test_pass"], ["tests/test_sample.py::test_skipped"]),
        (["tests/test_sample.py::test_not_there"], []),
    ):
        verdict = judge_test_run(output, f2p, p2p)
        assert verdict.result.value == UNRESOLVED, (f2p, p2p)
        assert verdict.result.is_scored

    missing = judge_test_run(output, ["tests/test_sample.py::test_not_there"], [])
    assert missing.fail_to_pass == {"tests/test_sample.py::test_not_there": None}
    assert "not in the report" in missing.result.evidence[0].text


def test_junit_parser_scores_pytest_style_ids(sample_run: tuple[str, str]) -> None:
    verdict = judge_test_run(
        sample_run[1],
        ["tests/test_sample.py::test_pass"],
        ["tests/test_sample.py::TestGroup::test_method"],
        parser="junit",
    )
    assert verdict.result.value == RESOLVED


def test_unreadable_report_is_unresolved_with_the_error_as_evidence() -> None:
    verdict = judge_test_run("not xml", ["t.py::a"], [], parser="junit")
    assert verdict.result.value == UNRESOLVED
    assert any(e.title == "report parse error" for e in verdict.result.evidence)


def test_bad_task_input_is_invalid_argument() -> None:
    with pytest.raises(OrchardError, match="FAIL_TO_PASS"):
        judge_test_run("", [], ["t.py::a"])
    with pytest.raises(OrchardError, match="unknown test output parser 'tap'"):
        judge_test_run("", ["t.py::a"], [], parser="tap")


def test_a_registered_parser_is_used_by_name() -> None:
    def tap(text: str) -> dict[str, Outcome]:
        return {
            line.split(" - ", 1)[1]: Outcome.PASSED if line.startswith("ok") else Outcome.FAILED
            for line in text.splitlines()
            if " - " in line
        }

    register_parser("tap-test", tap)
    with pytest.raises(ValueError, match="registered already"):
        register_parser("tap-test", tap)
    verdict = judge_test_run(
        "ok 1 - t.py::a\nnot ok 2 - t.py::b\n", ["t.py::a"], ["t.py::b"], parser="tap-test"
    )
    assert verdict.result.value == UNRESOLVED
    assert verdict.fail_to_pass == {"t.py::a": Outcome.PASSED}


def test_evidence_is_cut_to_its_limit() -> None:
    verdict = judge_test_run("x" * 100_000, ["t.py::a"], [])
    output = verdict.result.evidence[-1].text
    assert len(output) < 20_000
    assert output.endswith("more characters cut]")


def test_repo_relative_paths_stay_out_of_ids(tmp_path: Path) -> None:
    # A report line with a path but no node id (collection error) names no test.
    text = f"ERROR {tmp_path}/tests/test_x.py - ImportError\n"
    assert parse_pytest_output(text) == {}
