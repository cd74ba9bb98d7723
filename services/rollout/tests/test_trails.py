"""GUI trails without a browser: what `TrailWriter` writes into a real file:// artifact store,
that a store that refuses it costs the rollout nothing, that the trajectory names the trail, and
that a job asking for trails where no store is configured is refused. Real GUI episodes keeping
trails run in integration/tests/test_gui_rollouts.py."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from orchard.core.artifacts import ArtifactStore
from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.rollout.config import RolloutConfig
from orchard.rollout.harnesses.episodes import BrowserRun, BrowserStep
from orchard.rollout.provenance import RewardRecord, RolloutRecord
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.runs import JobStore, group_proto
from orchard.rollout.samplers import GroupChoice, SampledGroup
from orchard.rollout.service import RolloutManager
from orchard.rollout.tasks import TaskSpec
from orchard.rollout.trails import TrailWriter
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.sdk import AsyncSandboxClient
from orchard.tasks.gui.episode import BrowserEpisode
from orchard.tasks.gui.observation import Observation, TabInfo

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
GUI_TASK = "gui/7/shop/1"


def _task() -> TaskSpec:
    return TaskSpec.from_proto(
        api.RolloutTask(
            id=GUI_TASK,
            instruction="<b>Find</b> the lamp",
            scorer_json=json.dumps({"gui": {"task_id": GUI_TASK}}),
        )
    )


def _step(tool: str, arguments: dict[str, Any], screenshot: bytes | None) -> BrowserStep:
    tab = TabInfo(0, "http://site/lamps", "Lamps", True)
    observation = Observation(
        tool=tool,
        ok=screenshot is not None,
        message="done" if screenshot is not None else "the page did not answer",
        screenshot=screenshot,
        viewport=(800, 600),
        tabs=(tab,),
        error=None if screenshot is not None else "timeout",
    )
    return BrowserStep(tool, arguments, observation)


def _run() -> BrowserRun:
    # The writer reads what the harness left; the episode's sandboxes are gone by then.
    run = BrowserRun(episode=cast(BrowserEpisode, None), start_url="http://site/")
    run.steps += [
        _step("goto_url", {"url": "http://site/"}, PNG),
        _step("click", {"x": 1, "y": 2}, None),
        _step("done", {"response": "the red one"}, PNG + b"2"),
    ]
    run.response = "the red one"
    return run


def _record() -> RolloutRecord:
    record = RolloutRecord(rollout_id="gui-7-shop-1.0.abc", task_id=GUI_TASK, harness="b:b")
    record.outcome = "submitted"
    record.reward = RewardRecord(value=1.0, scorer="gui-state", detail="success")
    return record


async def test_a_trail_is_each_steps_screenshot_and_a_trail_json(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path.as_uri())
    record = _record()
    url = await TrailWriter(store, "job1").keep(record, _task(), _run(), RolloutStatus.COMPLETED)
    folder = tmp_path / "trails" / "job1" / record.rollout_id
    assert url == (folder / "trail.json").as_uri()
    assert sorted(p.name for p in folder.iterdir()) == ["000.png", "002.png", "trail.json"]
    assert (folder / "002.png").read_bytes() == PNG + b"2"
    trail = json.loads((folder / "trail.json").read_text())
    assert {k: trail[k] for k in ("task_id", "gui_task_id", "intent", "start_url")} == {
        "task_id": GUI_TASK,
        "gui_task_id": GUI_TASK,
        "intent": "<b>Find</b> the lamp",
        "start_url": "http://site/",
    }
    assert [(s["tool"], s["screenshot"], s["ok"]) for s in trail["steps"]] == [
        ("goto_url", "000.png", True),
        ("click", None, False),
        ("done", "002.png", True),
    ]
    assert trail["steps"][1]["error"] == "timeout"
    assert (trail["steps"][0]["url"], trail["steps"][0]["title"]) == ("http://site/lamps", "Lamps")
    assert trail["response"] == "the red one"
    assert trail["reward"] == {"value": 1.0, "scorer": "gui-state", "detail": "success"}
    # An aborted rollout's trail says why and shows no reward.
    aborted = await TrailWriter(store, "job2").keep(record, _task(), _run(), RolloutStatus.ABORTED)
    assert json.loads(ArtifactStore(tmp_path.as_uri()).read_bytes(aborted))["reward"] is None


async def test_a_trail_the_store_refuses_is_logged_and_the_rollout_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "trails").write_text("a file where the trails folder should be")
    store = ArtifactStore(tmp_path.as_uri())
    with caplog.at_level(logging.WARNING, "orchard.rollout.trails"):
        url = await TrailWriter(store, "job1").keep(
            _record(), _task(), _run(), RolloutStatus.COMPLETED
        )
    assert url == ""
    assert "its GUI trail was not written" in caplog.text
    # An episode that ran no action leaves no trail.
    empty = BrowserRun(episode=cast(BrowserEpisode, None), start_url="http://site/")
    assert (
        await TrailWriter(store, "j").keep(_record(), _task(), empty, RolloutStatus.ABORTED) == ""
    )


def test_the_trajectory_names_its_trail_and_the_record_keeps_it() -> None:
    record = _record()
    record.status = RolloutStatus.COMPLETED
    record.gui_trail = "file:///store/trails/job1/r/trail.json"
    member = RolloutResult(
        GroupKey(GUI_TASK, "b:b"), 0, RolloutStatus.COMPLETED, 1.0, 3, record.rollout_id, record
    )
    sampled = SampledGroup(
        GroupKey(GUI_TASK, "b:b"), (member,), GroupChoice.ALL, (member,), "fixed_n", 1
    )
    (trajectory,) = group_proto("job1", sampled).trajectories
    assert trajectory.metadata["gui_trail"] == record.gui_trail
    assert RolloutRecord.from_json(record.to_json()).gui_trail == record.gui_trail
    record.gui_trail = ""
    (trajectory,) = group_proto("job1", sampled).trajectories
    assert "gui_trail" not in trajectory.metadata


@pytest.fixture
async def jobs(etcd: EmbeddedEtcd) -> AsyncIterator[JobStore]:
    async with EtcdStore(etcd.endpoint, namespace=f"rollout-test-{uuid.uuid4().hex}/") as store:
        yield JobStore(store)


async def test_keeping_gui_trails_without_an_artifact_store_is_refused(jobs: JobStore) -> None:
    spec = api.RolloutJobSpec(
        tasks=[
            api.RolloutTask(id="t1", instruction="x", scorer_json='{"check": {"command": "true"}}')
        ],
        harnesses=["builtin:bash"],
        keep_gui_trails=True,
    )
    async with AsyncSandboxClient("127.0.0.1:1") as sandboxes:
        manager = RolloutManager(config=RolloutConfig(), jobs=jobs, sandboxes=sandboxes)
        with pytest.raises(OrchardError) as info:
            await manager.create(spec, "r1")
    assert info.value.reason is Reason.FAILED_PRECONDITION
    assert "artifacts.root" in info.value.message and "keep_gui_trails" in info.value.message
