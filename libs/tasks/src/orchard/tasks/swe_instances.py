"""Task instances in SWE-bench format, read from JSONL.

One JSON object per line with ``instance_id``, ``repo``, ``base_commit``, ``patch`` (the gold
patch), ``test_patch``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of test ids, or JSON
strings holding them, as the published datasets have them) and ``image`` (where the
repository is ready at the base commit; may be empty when the caller brings its own sandbox).
Optional: ``problem_statement``, ``repo_path`` (default ``/testbed``), ``test_command`` and
``parser``. Other keys (``version``, ``hints_text``, ...) are ignored.

Every mistake is an :class:`InstanceFormatError` naming the source, the line and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.reward.v1 import reward_service_pb2

__all__ = [
    "DEFAULT_REPO_PATH",
    "InstanceFormatError",
    "SweInstance",
    "load_instances",
    "parse_instance",
    "read_instances",
    "write_instances",
]

DEFAULT_REPO_PATH = "/testbed"
_REQUIRED_TEXT = ("instance_id", "repo", "base_commit", "patch", "test_patch")
_OPTIONAL_TEXT = ("image", "problem_statement", "repo_path", "test_command", "parser")


class InstanceFormatError(ValueError):
    """A line that is not a usable instance; ``line`` is 1-based, ``field`` may be empty."""

    def __init__(self, source: str, line: int, field_name: str, problem: str) -> None:
        where = f"{source}:{line}" + (f": {field_name}" if field_name else "")
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.line = line
        self.field = field_name


@dataclass(frozen=True)
class SweInstance:
    """One software-engineering task: a repository at a commit, a gold patch, tests."""

    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    image: str = ""
    problem_statement: str = ""
    repo_path: str = DEFAULT_REPO_PATH
    test_command: str = ""
    parser: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Keys of the source line this class does not model, kept as they were."""

    def to_task(self) -> reward_service_pb2.TestTask:
        """The ``orchard.reward.v1.TestTask`` of ScoreTests."""
        return reward_service_pb2.TestTask(
            instance_id=self.instance_id,
            repo=self.repo,
            base_commit=self.base_commit,
            test_patch=self.test_patch,
            fail_to_pass=list(self.fail_to_pass),
            pass_to_pass=list(self.pass_to_pass),
            test_command=self.test_command,
            parser=self.parser,
            image=self.image,
        )

    def score_request(
        self, candidate_patch: str, *, sandbox_id: str = "", timeout_s: float = 0
    ) -> reward_service_pb2.ScoreTestsRequest:
        """A ScoreTests request for ``candidate_patch``: in ``sandbox_id``, or (empty) in a
        sandbox the service creates from :attr:`image`; ``timeout_s`` 0 is the service's."""
        request = reward_service_pb2.ScoreTestsRequest(
            sandbox_id=sandbox_id,
            task=self.to_task(),
            candidate_patch=candidate_patch,
            repo_path=self.repo_path,
        )
        if timeout_s:
            request.timeout.FromNanoseconds(int(timeout_s * 1e9))
        return request

    def to_json(self) -> dict[str, Any]:
        """The SWE-bench line (test lists as JSON strings, as the datasets write them)."""
        record: dict[str, Any] = dict(self.extra)
        record.update(
            instance_id=self.instance_id,
            repo=self.repo,
            base_commit=self.base_commit,
            patch=self.patch,
            test_patch=self.test_patch,
            FAIL_TO_PASS=json.dumps(list(self.fail_to_pass)),
            PASS_TO_PASS=json.dumps(list(self.pass_to_pass)),
            image=self.image,
            problem_statement=self.problem_statement,
            repo_path=self.repo_path,
            test_command=self.test_command,
            parser=self.parser,
        )
        return record


def _test_list(raw: Any, error: Any) -> tuple[str, ...]:
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise error(f"a JSON-encoded list of test ids does not parse: {exc.msg}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise error(f"expected a list of non-empty test ids, got {_show(raw)}")
    return tuple(value)


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_instance(record: Any, *, source: str = "<instance>", line: int = 1) -> SweInstance:
    """One instance from a decoded JSON line; raises :class:`InstanceFormatError`."""
    if not isinstance(record, dict):
        raise InstanceFormatError(source, line, "", f"expected a JSON object, got {_show(record)}")

    def fail(name: str) -> Any:
        return lambda problem: InstanceFormatError(source, line, name, problem)

    text: dict[str, str] = {}
    for name in _REQUIRED_TEXT:
        if name not in record:
            raise InstanceFormatError(source, line, name, "missing")
        if not isinstance(record[name], str):
            raise fail(name)(f"expected a string, got {_show(record[name])}")
        text[name] = record[name]
    for name in ("instance_id", "base_commit"):
        if not text[name].strip():
            raise InstanceFormatError(source, line, name, "empty")
    for name in _OPTIONAL_TEXT:
        value = record.get(name)
        if value is not None and not isinstance(value, str):
            raise fail(name)(f"expected a string, got {_show(value)}")
        text[name] = value or ""
    lists: dict[str, tuple[str, ...]] = {}
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if name not in record:
            raise InstanceFormatError(source, line, name, "missing")
        lists[name] = _test_list(record[name], fail(name))
    if not lists["FAIL_TO_PASS"]:
        raise InstanceFormatError(source, line, "FAIL_TO_PASS", "empty: nothing would be judged")
    repo_path = text["repo_path"] or DEFAULT_REPO_PATH
    if not repo_path.startswith("/"):
        raise InstanceFormatError(source, line, "repo_path", f"must be absolute, got {repo_path!r}")
    known = {*_REQUIRED_TEXT, *_OPTIONAL_TEXT, "FAIL_TO_PASS", "PASS_TO_PASS"}
    return SweInstance(
        instance_id=text["instance_id"],
        repo=text["repo"],
        base_commit=text["base_commit"],
        patch=text["patch"],
        test_patch=text["test_patch"],
        fail_to_pass=lists["FAIL_TO_PASS"],
        pass_to_pass=lists["PASS_TO_PASS"],
        image=text["image"],
        problem_statement=text["problem_statement"],
        repo_path=repo_path,
        test_command=text["test_command"],
        parser=text["parser"],
        extra={k: v for k, v in record.items() if k not in known},
    )


def read_instances(lines: Iterable[str], *, source: str = "<lines>") -> Iterator[SweInstance]:
    """Instances from JSONL text, one per non-blank line; instance ids must be unique."""
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InstanceFormatError(
                source, number, "", f"not JSON: {exc.msg} at column {exc.colno}"
            ) from None
        instance = parse_instance(record, source=source, line=number)
        first = seen.setdefault(instance.instance_id, number)
        if first != number:
            raise InstanceFormatError(
                source, number, "instance_id",
                f"{instance.instance_id!r} appears already on line {first}",
            )  # fmt: skip
        yield instance


def load_instances(path: str | os.PathLike[str]) -> list[SweInstance]:
    """Every instance of a JSONL file; raises :class:`InstanceFormatError` or ``OSError``."""
    file = Path(path)
    with file.open(encoding="utf-8") as lines:
        return list(read_instances(lines, source=str(file)))


def write_instances(instances: Sequence[SweInstance], path: str | os.PathLike[str]) -> None:
    """Write ``instances`` as SWE-bench JSONL (readable again by :func:`load_instances`)."""
    with Path(path).open("w", encoding="utf-8") as out:
        for instance in instances:
            out.write(json.dumps(instance.to_json()) + "\n")
