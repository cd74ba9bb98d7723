"""The scripted rubric grader: GradeRubric answered by a judge of kind ``scripted``.

A deterministic stand-in for a judge model, so the rubric process reward runs offline (the
built-in suites, recipes with ``judge: builtin:scripted``, tests). It reads the trajectory's
tool calls turn by turn, sorts each into what it does (reads code, runs the tests, runs other
code, edits a file, reviews the diff, submits) with the result the next turn saw (``exit code
N``, else pytest's summary), and grades each dimension of the default rubric by id from those
actions:

- R1 patch quality: an edit that touched a file the task names (any non-test file when it
  names none): 0.6; no test file edited: 0.4; no edit at all: 0.
- R2 reproduced first: a run that failed before the first edit: 1; a run that did not fail:
  0.5; only reading the code before editing: 0.25.
- R3 ran the tests: any test run: 1.
- R4 wrote a test: an edit of a test file with a passing test run after it: 1; without: 0.5.
- R5 edge cases: after the first edit, a check of its own (``python -c``, a script, chosen
  tests with ``-k`` or ``::``): 1; only whole test runs: 0.5.
- R6 re-ran the tests after the last edit: they passed: 1; their result is not in the
  transcript: 0.5; they failed and the agent stopped there: 0.25.
- R7 reviewed the diff: ``git diff``/``git status``/``git show`` or reading an edited file
  after the last edit: 1.

Every grade cites the turn it rests on (-1: the whole trajectory), as a model's grades do. It
sees only tool calls (text that merely names a command is not an action) and knows nothing a
model would understand of the code: a heuristic, not a judgement. Dimensions of other ids are
refused, since there is nothing here to grade them with.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from orchard.core.errors import OrchardError, Reason
from orchard.reward.outcome import ScoreResult
from orchard.reward.rubric import Dimension, Grade, combine, validate_rubric
from orchard.types.v1 import trajectory_pb2

__all__ = ["GRADED_IDS", "Action", "actions_of", "grade_scripted", "require_graded"]

Kind = Literal["read", "test", "run", "edit", "review", "submit", "other"]
Result = Literal["pass", "fail", "unknown"]

STAND_IN = "scripted rubric grader, a deterministic stand-in for a judge model"

_TEST = re.compile(
    r"\b(py\.?test|unittest|tox|nox)\b|\bmake\s+(test|check)\b|"
    r"\b(npm|yarn|pnpm)\s+(run\s+)?test\b|\bgo\s+test\b|\bcargo\s+test\b"
)
_IN_PLACE = re.compile(r"\b(sed|perl)\s+(-[A-Za-z]*i|--in-place)")
_REDIRECT = re.compile(r"(?<![0-9&>])>{1,2}\s*(?!&)([^\s;&|<>()]+)")
_OTHER_EDIT = re.compile(r"(^|[;&|]\s*)(patch|git\s+apply)\b")
_TEE = re.compile(r"\btee\s+(?:-a\s+)?([^\s;&|<>()]+)")
_CODE_FILE = re.compile(r"\.(py|pyi|js|ts|go|rs|java|c|cc|cpp|h|rb|cfg|toml|ini)$")
_REVIEW = re.compile(r"\bgit\s+(diff|status|show)\b")
_READ = re.compile(r"\b(cat|head|tail|less|more|grep|rg|nl|find|ls|wc|awk)\b|\bsed\s+-n\b")
_RUN = re.compile(r"(^|&&|;|\|\|)\s*(python[0-9.]*|node|bash\s+\S+\.sh|\./[\w./-]+)(\s|$)")
_TARGETED = re.compile(r"\s-k\s|::|\bpython[0-9.]*\s+-c\b")
_EXIT = re.compile(r"\bexit code (-?\d+)\b|\btimed out\b")
_PYTEST_FAIL = re.compile(r"\b\d+ (failed|errors?)\b")
_PYTEST_PASS = re.compile(r"\b\d+ passed\b")
_PATH = re.compile(
    r"(?<![\w/.-])((?:[\w.*-]+/)*[\w*-]+\.(?:py|pyi|js|ts|go|rs|java|c|cc|cpp|h|rb))\b"
)
_TEST_FILE = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)test_[^/]*$|_test\.[a-z]+$|(^|/)conftest\.py$"
)
_EDIT_TOOLS = frozenset({"edit", "create", "str_replace", "write", "write_file", "apply_patch"})
_READ_TOOLS = frozenset({"view", "read", "read_file", "open"})
_SHELL_TOOLS = frozenset({"bash", "shell", "sh", "exec", "run", "terminal"})
_UNKNOWN_PATH = "(a patch)"


@dataclass(frozen=True)
class Action:
    """One tool call of the policy: what it does, on which files, and what came back."""

    turn: int
    kind: Kind
    text: str
    """The command or the call, as the evidence quotes it."""
    paths: tuple[str, ...] = ()
    """Files it edits (edits) or names (reads)."""
    result: Result = "unknown"
    """Of a command: whether it succeeded, from the next turn's observation."""


def _quote(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _command_paths(command: str) -> tuple[str, ...]:
    """Files an in-place ``sed``/``perl``, a redirect or ``tee`` writes (a redirect or ``tee``
    only counts for a code file: a log it writes is no edit)."""
    written = [m.group(1) for m in (*_REDIRECT.finditer(command), *_TEE.finditer(command))]
    paths = [path for path in written if _CODE_FILE.search(path)]
    if _IN_PLACE.search(command):
        try:
            words = shlex.split(command)
        except ValueError:
            words = command.split()
        scripted = False
        for position, word in enumerate(words):
            if word in ("sed", "perl") and position + 1 < len(words):
                rest = words[position + 1 :]
                scripted = any(w in ("-e", "--expression") for w in rest)
                operands = [w for w in rest if not w.startswith("-")]
                for operand in operands[0 if scripted else 1 :]:
                    if operand in ("&&", "||", ";", "|"):
                        break
                    paths.append(operand)
                break
    if not paths and _OTHER_EDIT.search(command):
        paths.append(_UNKNOWN_PATH)
    return tuple(dict.fromkeys(paths))


def _result(observation: str, nth: int) -> Result:
    exits = list(_EXIT.finditer(observation))
    if exits:
        found = exits[nth] if nth < len(exits) else exits[0]
        if found.group(1) is None:
            return "fail"  # timed out
        return "pass" if int(found.group(1)) == 0 else "fail"
    if _PYTEST_FAIL.search(observation):
        return "fail"
    if _PYTEST_PASS.search(observation):
        return "pass"
    return "unknown"


def _shell_actions(turn: int, command: str, result: Result) -> list[Action]:
    quoted = _quote(command)
    edited = _IN_PLACE.search(command) or _OTHER_EDIT.search(command) or _command_paths(command)
    out: list[Action] = []
    if edited:
        out.append(Action(turn, "edit", quoted, _command_paths(command) or (_UNKNOWN_PATH,)))
    if _TEST.search(command):
        out.append(Action(turn, "test", quoted, result=result))
    elif _REVIEW.search(command):
        out.append(Action(turn, "review", quoted))
    elif _RUN.search(command) and not edited:
        out.append(Action(turn, "run", quoted, result=result))
    elif _READ.search(command) and not edited:
        out.append(Action(turn, "read", quoted, tuple(m.group(1) for m in _PATH.finditer(command))))
    if not out:
        out.append(Action(turn, "other", quoted))
    return out


def actions_of(trajectory: trajectory_pb2.Trajectory) -> list[Action]:
    """The policy's tool calls in order (auxiliary turns are not the policy's actions)."""
    turns = list(trajectory.turns)
    actions: list[Action] = []
    for index, turn in enumerate(turns):
        if turn.kind == trajectory_pb2.TURN_KIND_AUXILIARY:
            continue
        observation = turns[index + 1].input_text if index + 1 < len(turns) else ""
        commands = 0
        for call in turn.tool_calls:
            try:
                arguments = json.loads(call.arguments_json or "{}")
            except json.JSONDecodeError:
                arguments = {}
            if not isinstance(arguments, dict):
                arguments = {}
            name = call.name.lower()
            path = str(arguments.get("path") or arguments.get("file") or "")
            command = arguments.get("command") or arguments.get("cmd")
            if name == "submit":
                actions.append(Action(index, "submit", "submit"))
            elif name in _EDIT_TOOLS:
                actions.append(Action(index, "edit", f"{name} {path}", (path or _UNKNOWN_PATH,)))
            elif name in _READ_TOOLS:
                actions.append(Action(index, "read", f"{name} {path}", (path,) if path else ()))
            elif name in _SHELL_TOOLS and isinstance(command, str) and command.strip():
                actions += _shell_actions(index, command, _result(observation, commands))
                commands += 1
            else:
                actions.append(
                    Action(index, "other", _quote(f"{call.name}({call.arguments_json})"))
                )
    return actions


def task_files(task: str) -> tuple[str, ...]:
    """Source files the task text names (e.g. ``src/pkg/rules.py``)."""
    return tuple(dict.fromkeys(m.group(1) for m in _PATH.finditer(task)))


def _is_test(path: str) -> bool:
    return bool(_TEST_FILE.search(path))


def _names(path: str, files: Sequence[str]) -> bool:
    """``path`` (perhaps a glob, as ``src/*/rules.py``) is one of ``files``."""
    return any(
        fnmatch.fnmatch(f, path) or fnmatch.fnmatch(path, f) or f.endswith("/" + path)
        for f in files
    )


@dataclass(frozen=True)
class _Story:
    """The actions of one trajectory, and where its edits fall."""

    actions: list[Action]
    files: tuple[str, ...]

    @property
    def edits(self) -> list[int]:
        return [i for i, a in enumerate(self.actions) if a.kind == "edit"]

    def of(self, kinds: Sequence[Kind], start: int = 0, end: int | None = None) -> list[Action]:
        return [a for a in self.actions[start:end] if a.kind in kinds]


def _patch_quality(story: _Story) -> Grade:
    if not story.edits:
        return Grade(0.0, "no tool call edits a file in any turn: there is no patch", -1)
    edits = [story.actions[i] for i in story.edits]
    edited = [p for a in edits for p in a.paths]
    tests = [p for p in edited if _is_test(p)]
    known = [p for p in edited if p != _UNKNOWN_PATH]
    if story.files:
        on_task = any(_names(p, story.files) for p in known)
        where = f"the task names {', '.join(story.files)}"
    else:
        on_task = any(not _is_test(p) for p in known)
        where = "the task names no file"
    score = (0.6 if on_task else 0.0) + (0.0 if tests else 0.4)
    hit = next((a for a in edits if any(_names(p, story.files) for p in a.paths)), edits[-1])
    verdict = "touches the task's code" if on_task else "does not touch the task's code"
    touched = f"; edits test file(s) {', '.join(tests)}" if tests else "; no test file edited"
    return Grade(score, f"turn {hit.turn}: `{hit.text}` {verdict} ({where}){touched}", hit.turn)


def _reproduced(story: _Story) -> Grade:
    first = story.edits[0] if story.edits else None
    runs = story.of(("test", "run"), 0, first)
    failing = next((a for a in runs if a.result == "fail"), None)
    if failing:
        return Grade(
            1.0, f"turn {failing.turn}: `{failing.text}` fails before any edit", failing.turn
        )
    if runs:
        run = runs[0]
        return Grade(
            0.5, f"turn {run.turn}: `{run.text}` ran before any edit but did not fail", run.turn
        )
    reads = story.of(("read",), 0, first)
    if reads and first is not None:
        read = reads[0]
        return Grade(
            0.25,
            f"turn {read.turn}: `{read.text}` read the code before editing; nothing ran",
            read.turn,
        )
    return Grade(0.0, "nothing was run (or read) before the first edit", -1)


def _ran_tests(story: _Story) -> Grade:
    tests = story.of(("test",))
    if tests:
        return Grade(1.0, f"turn {tests[0].turn}: `{tests[0].text}` runs the tests", tests[0].turn)
    return Grade(0.0, "no tool call runs the tests in any turn", -1)


def _wrote_test(story: _Story) -> Grade:
    for i in story.edits:
        edit = story.actions[i]
        if any(_is_test(p) for p in edit.paths):
            after = [a for a in story.of(("test",), i + 1) if a.result == "pass"]
            if after:
                return Grade(
                    1.0,
                    f"turn {edit.turn}: `{edit.text}` edits a test; it passes at turn "
                    f"{after[-1].turn}",
                    edit.turn,
                )
            return Grade(
                0.5, f"turn {edit.turn}: `{edit.text}` edits a test, never seen passing", edit.turn
            )
    return Grade(0.0, "no edit touches a test file", -1)


def _edge_cases(story: _Story) -> Grade:
    if not story.edits:
        return Grade(0.0, "no edit: no change to check", -1)
    after = story.of(("test", "run"), story.edits[0] + 1)
    own = next((a for a in after if a.kind == "run" or _TARGETED.search(a.text)), None)
    if own:
        return Grade(1.0, f"turn {own.turn}: `{own.text}` checks the change itself", own.turn)
    if after:
        return Grade(
            0.5,
            f"turn {after[0].turn}: `{after[0].text}` runs the tests, no check of its own",
            after[0].turn,
        )
    return Grade(0.0, "nothing was run after the first edit", -1)


def _reran_tests(story: _Story) -> Grade:
    if not story.edits:
        return Grade(0.0, "no edit: nothing to re-run the tests after", -1)
    last_edit = story.actions[story.edits[-1]]
    after = story.of(("test",), story.edits[-1] + 1)
    if not after:
        return Grade(
            0.0, f"no test run after the last edit (turn {last_edit.turn})", last_edit.turn
        )
    last = after[-1]
    if last.result == "pass":
        return Grade(1.0, f"turn {last.turn}: `{last.text}` passes after the last edit", last.turn)
    if last.result == "fail":
        return Grade(
            0.25, f"turn {last.turn}: `{last.text}` fails and the agent stopped there", last.turn
        )
    return Grade(0.5, f"turn {last.turn}: `{last.text}` ran; its result is not in the transcript",
                 last.turn)  # fmt: skip


def _reviewed(story: _Story) -> Grade:
    if not story.edits:
        return Grade(0.0, "no edit: no diff to review", -1)
    edited = {p for i in story.edits for p in story.actions[i].paths}
    for action in story.actions[story.edits[-1] + 1 :]:
        reads_edit = action.kind == "read" and any(_names(p, list(edited)) for p in action.paths)
        if action.kind == "review" or reads_edit:
            return Grade(
                1.0, f"turn {action.turn}: `{action.text}` reviews the change", action.turn
            )
    last = story.actions[story.edits[-1]].turn
    return Grade(0.0, f"the diff was not looked at after the last edit (turn {last})", last)


GRADERS: dict[str, Callable[[_Story], Grade]] = {
    "R1": _patch_quality,
    "R2": _reproduced,
    "R3": _ran_tests,
    "R4": _wrote_test,
    "R5": _edge_cases,
    "R6": _reran_tests,
    "R7": _reviewed,
}
GRADED_IDS = tuple(GRADERS)
"""The dimensions it grades: the default rubric's."""


def require_graded(dimensions: Sequence[Dimension], reason: Reason) -> None:
    """``reason`` (INVALID_ARGUMENT for a request's rubric, FAILED_PRECONDITION for the
    configured one) when a dimension is not one it grades."""
    unknown = [d.id for d in dimensions if d.id not in GRADERS]
    if unknown:
        raise OrchardError(
            reason,
            f"the scripted rubric grader grades the default rubric's dimensions "
            f"({', '.join(GRADED_IDS)}) only, not {', '.join(unknown)}: use those ids or name a "
            "model judge",
        )


def grade_scripted(
    trajectory: trajectory_pb2.Trajectory,
    *,
    task: str,
    dimensions: Sequence[Dimension],
    reason: Reason = Reason.INVALID_ARGUMENT,
) -> ScoreResult:
    """The rubric reward of ``trajectory`` from its actions; ``task`` names the files to fix."""
    if not trajectory.turns:
        raise OrchardError(Reason.INVALID_ARGUMENT, "the trajectory is empty: nothing to grade")
    rubric = validate_rubric(dimensions)
    require_graded(rubric, reason)
    story = _Story(actions_of(trajectory), task_files(task))
    grades = {d.id: GRADERS[d.id](story) for d in rubric}
    result = combine(rubric, grades)
    return replace(result, detail=f"{result.detail}, by the {STAND_IN}")
