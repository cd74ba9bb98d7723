"""Task files: a task's archive in the artifact store is unpacked into each rollout's REAL
sandbox before setup (the way a recipe's repositories travel to another machine), and an
archive URL outside the store is refused, so a job cannot make the service read its host's
files."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchard.core.artifacts import ArtifactStore
from orchard.rollout.harnesses.bash_react import bash_react_harness
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.provenance import FailureLayer
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.scripted_policy import ScriptedPolicyServer
from orchard.rollout.task_files import StoreFiles
from orchard.rollout.tasks import TaskFile, TaskSpec
from orchard.sdk import AsyncSandboxClient, RetryPolicy

from .test_harness_env import CALC, FAST_RETRIES, plans

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _archive(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _calc_task(url: str) -> TaskSpec:
    return TaskSpec.from_settings(
        "calc",
        "Please fix calc: add(a, b) in /srv/task/calc.py must return the sum.",
        {
            "files": [{"url": url, "path": "/srv/task"}],
            "check": {
                "command": "cd /srv/task && python3 -c 'import calc; assert calc.add(2, 3) == 5'"
            },
        },
    )


@pytest.fixture
async def sandboxes(env_service: dict[str, Any]) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(
        profile=env_service["profile"], retry=RetryPolicy(initial_backoff=0.05)
    ) as client:
        yield client
        assert [s.id async for s in client.list()] == []


def _runner(
    sandboxes: AsyncSandboxClient, base_url: str, task: TaskSpec, store: ArtifactStore
) -> RolloutRunner:
    return RolloutRunner(
        sandboxes=sandboxes,
        endpoint=ModelEndpoint(base_url=base_url, model="teacher"),
        harnesses={"builtin:bash": bash_react_harness()},
        tasks={task.id: task},
        retries=FAST_RETRIES,
        files=StoreFiles(store),
        seed=5,
    )


async def test_a_task_archive_is_unpacked_before_the_harness_runs(
    sandboxes: AsyncSandboxClient, tmp_path: Path
) -> None:
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    url = store.url("tasks", "calc.tar")
    store.write_bytes(url, _archive({"calc.py": "def add(a, b):\n    return a - b\n"}))
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        result = await _runner(sandboxes, policy.base_url, _calc_task(url), store)(
            GroupKey("calc", "builtin:bash"), 0
        )
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0), result.payload
    # The harness read the unpacked file at the path the task named, then fixed it there.
    view = result.payload.tool_events[0]
    assert view.tool == "view" and "return a - b" in str(view), view
    assert CALC.startswith("/srv/task/")


async def test_an_archive_outside_the_store_is_refused(
    sandboxes: AsyncSandboxClient, tmp_path: Path
) -> None:
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    secret = tmp_path / "host-secret.tar"
    secret.write_bytes(_archive({"calc.py": "stolen = True\n"}))
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        result = await _runner(sandboxes, policy.base_url, _calc_task(f"file://{secret}"), store)(
            GroupKey("calc", "builtin:bash"), 0
        )
    assert result.status == RolloutStatus.ABORTED
    failure = result.payload.failure
    assert failure is not None
    assert failure.layer == FailureLayer.SANDBOX_CREATE
    assert "outside" in failure.error or "not allowed" in failure.error, failure.error


async def test_a_missing_archive_aborts_the_rollout(
    sandboxes: AsyncSandboxClient, tmp_path: Path
) -> None:
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        result = await _runner(
            sandboxes, policy.base_url, _calc_task(store.url("tasks", "gone.tar")), store
        )(GroupKey("calc", "builtin:bash"), 0)
    assert result.status == RolloutStatus.ABORTED
    assert result.payload.failure is not None
    assert "gone.tar" in result.payload.failure.error


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"url": "file:///x.tar"}, "must be a list"),
        ([{"url": "/srv/x.tar", "path": "/srv"}], "artifact URL"),
        ([{"url": "file:///x.tar", "path": "srv"}], "absolute"),
        ([{"url": "file:///x.tar", "path": "/srv", "mode": 7}], "each of"),
    ],
)
def test_bad_files_settings_say_what_is_wrong(files: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TaskSpec.from_settings("t", "do it", {"files": files, "check": {"command": "true"}})


def test_files_survive_the_round_trip_through_the_proto() -> None:
    task = TaskSpec.from_settings(
        "t",
        "do it",
        {"files": [{"url": "file:///s/a.tar", "path": "/testbed"}], "check": {"command": "true"}},
    )
    assert task.files == (TaskFile("file:///s/a.tar", "/testbed"),)
    assert TaskSpec.from_proto(task.to_proto()) == task
