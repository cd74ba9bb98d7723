"""GUI rollouts end to end: browser episodes run by ``orchard-rollout`` and judged by
``orchard-reward``'s built-in state judge.

Real processes: etcd and ``orchard-env`` with the local runtime (root; its tenant may give
sandboxes user namespaces, for Chromium's own sandbox), ``orchard-reward`` and
``orchard-rollout``, talking gRPC. Each rollout is a site sandbox and a browser sandbox (Debian's
Chromium as an unprivileged user, the browser folder from ``make gui-browser``). The policy is
the built-in GUI suite's scripted teacher, which the rollout service plays itself
(``policy_spec.scripted.gui_teacher``), or a script that never calls a tool. A job that keeps GUI
trails leaves them in the rollout service's artifact store (a file:// folder here), and the
report's trail page made from one opens in a real headless Chromium.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from playwright.sync_api import sync_playwright

from orchard.core.artifacts import ArtifactStore
from orchard.recipes.trails import TrailChoice, write_trail_pages
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.sdk import SandboxClient
from orchard.tasks.gui.browser import OFFLINE_CHROMIUM_ARGS
from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir
from orchard.tasks.gui.suite import GuiTask, generate_suite
from orchard.types.v1 import reward_pb2, trajectory_pb2

from .conftest import EnvStack, free_port, private_stack
from .test_rollout_scoring import start_reward, stop_process
from .test_rollout_service import RolloutProcess

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUITE_SEED = 7
JOB_LABEL = "orchard-rollout-job"
VISION_JUDGE = "vision"
"""A judge of orchard-reward's config: an OpenAI-compatible vision endpoint (here the reward
tests' scripted chat server on loopback, a stand-in for a vision-language model, which this
machine cannot serve)."""


def _scripted_chat_server() -> Any:
    """The reward tests' scripted OpenAI-compatible server module (loaded from its file: the
    tests folder is not a package)."""
    path = ROOT / "services" / "reward" / "tests" / "scripted_chat_server.py"
    spec = importlib.util.spec_from_file_location("scripted_chat_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


CHAT = _scripted_chat_server()


@dataclass
class GuiServices:
    env: EnvStack
    rollout: RolloutProcess
    tasks: list[GuiTask]
    artifacts: Path
    """The rollout service's artifact store (file://), where kept GUI trails go."""
    vision: Any
    """The vision judge's endpoint (a scripted chat server), configured in orchard-reward as
    `VISION_JUDGE`."""


def easy_tasks() -> list[GuiTask]:
    """Two difficulty-1 tasks of the suite on different sites."""
    chosen: dict[str, GuiTask] = {}
    for task in generate_suite(60, SUITE_SEED):
        if task.difficulty == 1 and task.site not in chosen and task.family != "warmup":
            chosen[task.site] = task
    return list(chosen.values())[:2]


@pytest.fixture(scope="module")
def gui_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuiServices]:
    folder = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (folder / LAUNCHER).exists():
        build_browser_dir(folder)
    root = tmp_path_factory.mktemp("gui-rollouts")
    artifacts = root / "artifacts"
    artifacts.mkdir()
    with (
        CHAT.scripted_chat_server() as vision,
        private_stack(tmp_path_factory, settings=['privileges.user_namespaces=["*"]']) as env,
    ):
        judge = {"base_url": vision.base_url, "model": "vlm-test", "timeout_s": 10.0}
        reward_address, reward_process, reward_log = start_reward(
            root, env, judges={VISION_JUDGE: judge}, default_judge=VISION_JUDGE
        )
        address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        config: dict[str, Any] = {
            "server": {"listen": [address], "metrics_address": metrics, "grace_period_s": 2},
            "etcd": {"endpoints": [env.stack.etcd_endpoint], "namespace": "rt-gui/"},
            "env": {"endpoint": env.endpoint, "token_env": "ROLLOUT_TEST_ENV_TOKEN"},
            "reward": {"endpoint": reward_address},
            "gui": {"browser_dir": str(folder.absolute()), "keep_last": 2},
            "artifacts": {"root": artifacts.as_uri()},
            "defaults": {"create_spread_s": 0.05, "concurrency": 2},
        }
        path = root / "rollout.json"
        path.write_text(json.dumps(config))
        rollout = RolloutProcess(address, metrics, path, root / "rollout.log", env.token)
        rollout.start()
        try:
            yield GuiServices(env, rollout, easy_tasks(), artifacts, vision)
        finally:
            rollout.stop()
            stop_process(reward_process, reward_log)


@pytest.fixture
def stub(gui_services: GuiServices) -> Iterator[rollout_service_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(gui_services.rollout.address) as channel:
        yield rollout_service_pb2_grpc.RolloutServiceStub(channel)


def gui_task(task: GuiTask, **gui: str) -> api.RolloutTask:
    return api.RolloutTask(
        id=task.id,
        image="host",
        instruction=task.intent,
        scorer_json=json.dumps({"gui": {"task_id": task.id, **gui}}),
    )


def run_job(
    stub: rollout_service_pb2_grpc.RolloutServiceStub, spec: api.RolloutJobSpec
) -> tuple[api.RolloutJob, list[api.TrajectoryGroup]]:
    job = stub.CreateRolloutJob(
        api.CreateRolloutJobRequest(spec=spec, request_id=uuid.uuid4().hex)
    ).job
    streamed = list(stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=600))
    job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id)).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    return job, [m.group for m in streamed]


def fixed_n(n: int) -> api.SamplerConfig:
    return api.SamplerConfig(
        kind=api.SAMPLER_KIND_FIXED_N, group_size=n, keep_uninformative_groups=True
    )


def test_the_scripted_teacher_solves_easy_tasks_the_state_judge_scores_them_trails_kept(
    gui_services: GuiServices,
    stub: rollout_service_pb2_grpc.RolloutServiceStub,
    tmp_path: Path,
) -> None:
    tasks = gui_services.tasks
    spec = api.RolloutJobSpec(
        tasks=[gui_task(t) for t in tasks],
        harnesses=["builtin:browser-text"],
        policy_spec=api.PolicySpec(
            scripted=api.ScriptedPolicy(
                gui_teacher=api.GuiTeacher(suite_seed=SUITE_SEED, count=60), seed=3
            )
        ),
        sampler=fixed_n(1),
        budget=api.RolloutBudget(max_steps=12),
        concurrency=2,
        keep_gui_trails=True,
    )
    started = time.monotonic()
    job, groups = run_job(stub, spec)
    wall_s = time.monotonic() - started
    assert (job.rollouts_done, job.rollouts_excluded) == (len(tasks), 0), wall_s
    by_task = {g.task_id: g for g in groups}
    assert set(by_task) == {t.id for t in tasks}
    for task in tasks:
        # One rollout; replacing its earlier pages by placeholders rewrites the prompt, so its
        # captured turns split into more than one trajectory, all with the rollout's reward.
        trajectories = by_task[task.id].trajectories
        assert len({t.rollout_id for t in trajectories}) == 1
        assert {t.reward.value for t in trajectories} == {1.0}
        assert sum(len(t.turns) for t in trajectories) >= 2
        trajectory = trajectories[-1]
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED, trajectory.reward
        assert trajectory.reward.value == 1.0, trajectory.reward.detail
        assert "success" in trajectory.reward.detail
        conversation = json.loads(trajectory.conversation_json)
        # The intent, then the start page as text, then one action per assistant turn.
        assert conversation[1] == {"role": "user", "content": task.intent}
        assert "page text:" in conversation[2]["content"]
        calls = [m["tool_calls"] for m in conversation if m.get("tool_calls")]
        assert calls and all(len(c) == 1 for c in calls)
        assert calls[-1][0]["function"]["name"] == "done"
        # Only the last two pages stay whole; earlier ones are placeholders.
        pages = [m["content"] for m in conversation[2:] if m["role"] in ("tool", "user")]
        whole = [p for p in pages if "page text:\n" in p]
        assert len(whole) == min(2, len(pages))
    with SandboxClient(gui_services.env.endpoint, token=gui_services.env.token) as client:
        assert list(client.list({JOB_LABEL: job.id})) == []
    check_trails(gui_services, job, groups, tmp_path)


def check_trails(
    gui_services: GuiServices,
    job: api.RolloutJob,
    groups: list[api.TrajectoryGroup],
    tmp_path: Path,
) -> None:
    """The job kept GUI trails: each rollout's trail.json and screenshots are in the rollout
    service's store, its trajectories name the trail, and the report's page made from it shows
    every screenshot in Chromium."""
    tasks = {t.id: t for t in gui_services.tasks}
    store = ArtifactStore(gui_services.artifacts.as_uri())
    choices = []
    for group in groups:
        task = tasks[group.task_id]
        (rollout_id,) = {t.rollout_id for t in group.trajectories}
        url = store.url("trails", job.id, rollout_id, "trail.json")
        assert {t.metadata["gui_trail"] for t in group.trajectories} == {url}
        trail = json.loads(store.read_bytes(url))
        assert (trail["job_id"], trail["rollout_id"]) == (job.id, rollout_id)
        assert (trail["task_id"], trail["gui_task_id"]) == (task.id, task.id)
        assert trail["intent"] == task.intent
        assert trail["start_url"].startswith("http://")
        assert (trail["status"], trail["outcome"]) == ("completed", "submitted")
        assert trail["reward"]["value"] == 1.0 and "success" in trail["reward"]["detail"]
        steps = trail["steps"]
        assert steps[0]["tool"] == "goto_url"
        assert steps[0]["arguments"] == {"url": trail["start_url"]}
        assert steps[-1]["tool"] == "done"
        assert trail["response"] == steps[-1]["arguments"]["response"]
        assert len(steps) >= 3 and all(step["ok"] for step in steps)
        assert all(step["url"].startswith("http://") and step["tabs"] for step in steps)
        # Every action's screenshot, as the browser took it, beside trail.json.
        names = [step["screenshot"] for step in steps]
        assert names == [f"{i:03d}.png" for i in range(len(steps))]
        folder = gui_services.artifacts / "trails" / job.id / rollout_id
        assert sorted(p.name for p in folder.iterdir()) == [*names, "trail.json"]
        for name in names:
            assert (folder / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        choices.append(
            TrailChoice("base", task.id, group.harness, rollout_id, url, 1.0, resolved=True)
        )

    # The report's pages made from these trails: every screenshot loads in Chromium.
    links = write_trail_pages(choices, store, tmp_path / "report")
    assert len(links) == len(tasks)
    args = [*OFFLINE_CHROMIUM_ARGS, *(["--no-sandbox"] if os.geteuid() == 0 else [])]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=args
        )
        try:
            page = browser.new_page()
            for link in links:
                page.goto((tmp_path / "report" / link.page).as_uri())
                page.wait_for_load_state("load")
                widths = page.evaluate("[...document.images].map(i => i.naturalWidth)")
                assert len(widths) == link.steps and min(widths) > 0, widths
                assert (
                    page.locator(f"#step-{link.steps - 1} .action").inner_text().startswith("done(")
                )
        finally:
            browser.close()


def test_a_vision_judge_is_asked_with_the_intent_the_answer_and_the_screenshot_trail(
    gui_services: GuiServices, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    """A GUI task naming a configured judge is scored by JudgeOutcome against that endpoint:
    it gets the task's intent, the episode's answer and the last screenshots as PNG images;
    its verdict is the reward (+1 success with every turn parsed, 0 a failure), and a judge
    that gives no verdict excludes the rollout instead of scoring it."""
    server = gui_services.vision
    server.requests.clear()
    server.play(
        CHAT.Step(reply='{"success": true, "reason": "done as asked"}'),
        CHAT.Step(reply='{"success": false, "reason": "not what was asked"}'),
    )
    task = gui_services.tasks[0]
    spec = api.RolloutJobSpec(
        tasks=[gui_task(task, judge=VISION_JUDGE)],
        harnesses=["builtin:browser-text"],
        policy_spec=api.PolicySpec(
            scripted=api.ScriptedPolicy(
                gui_teacher=api.GuiTeacher(suite_seed=SUITE_SEED, count=60), seed=5
            )
        ),
        sampler=fixed_n(2),
        budget=api.RolloutBudget(max_steps=12),
        concurrency=1,  # one verdict after the other: the script's order
    )
    job, groups = run_job(stub, spec)
    assert (job.rollouts_done, job.rollouts_excluded) == (2, 0)
    rewards = {t.rollout_id: t.reward for g in groups for t in g.trajectories}
    assert sorted(r.value for r in rewards.values()) == [0.0, 1.0]
    assert all(r.status == reward_pb2.REWARD_STATUS_SCORED for r in rewards.values())
    assert len(server.requests) == 2
    for request in server.requests:
        assert request["model"] == "vlm-test"
        parts = request["messages"][-1]["content"]
        text = " ".join(p["text"] for p in parts if p["type"] == "text")
        assert task.intent in text
        images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        # Every action's screenshot (the start page, the actions, done), at most the last 16.
        assert 3 <= len(images) <= 16
        assert all(url.startswith("data:image/png;base64,") for url in images)

    # No verdict at all (the endpoint fails every attempt): excluded, never a low score.
    server.requests.clear()
    spec.sampler.CopyFrom(fixed_n(1))
    job, groups = run_job(stub, spec)
    assert (job.rollouts_done, job.rollouts_excluded) == (1, 1)
    (trajectory,) = {t.rollout_id: t for g in groups for t in g.trajectories}.values()
    assert trajectory.reward.status != reward_pb2.REWARD_STATUS_SCORED
    assert server.requests  # it was asked, and failed


def test_a_policy_that_never_acts_ends_on_format_failures_scored_minus_one(
    gui_services: GuiServices, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    task = gui_services.tasks[0]
    mute = api.ScriptedPlan(
        match=task.intent[:20],
        solve_rate=1.0,
        solution=[api.ScriptedStep(thought="I am thinking about it.")],
        failure=[api.ScriptedStep(thought="I give up.")],
    )
    spec = api.RolloutJobSpec(
        tasks=[gui_task(task)],
        harnesses=["builtin:browser-text"],
        policy_spec=api.PolicySpec(scripted=api.ScriptedPolicy(plans=[mute])),
        sampler=fixed_n(1),
        budget=api.RolloutBudget(max_steps=12),
    )
    job, groups = run_job(stub, spec)
    (trajectory,) = groups[0].trajectories
    assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED, trajectory.reward
    assert trajectory.reward.value == -1.0, trajectory.reward.detail
    # The harness ended the episode itself: completed, not a budget that ran out.
    assert trajectory.outcome == trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED
    conversation = json.loads(trajectory.conversation_json)
    assert sum(m["role"] == "assistant" for m in conversation) == 3
    # The job did not ask for trails: none is named, none written.
    assert "gui_trail" not in trajectory.metadata
    assert not (gui_services.artifacts / "trails" / job.id).exists()


def test_gui_tasks_and_harnesses_that_do_not_fit_are_refused(
    gui_services: GuiServices, stub: rollout_service_pb2_grpc.RolloutServiceStub
) -> None:
    task = gui_services.tasks[0]
    plain = api.RolloutTask(
        id="plain", instruction="echo", scorer_json=json.dumps({"check": {"command": "true"}})
    )
    cases = [
        (
            api.RolloutJobSpec(tasks=[gui_task(task)], harnesses=["builtin:bash"]),
            "runs with browser harnesses only",
        ),
        (
            api.RolloutJobSpec(tasks=[gui_task(task), plain], harnesses=["builtin:browser"]),
            "is not one",
        ),
        (
            api.RolloutJobSpec(
                tasks=[
                    api.RolloutTask(
                        id="gui-bad",
                        instruction="x",
                        scorer_json=json.dumps({"gui": {"task_id": "gui/7/nosuch/0"}}),
                    )
                ],
                harnesses=["builtin:browser"],
            ),
            "nosuch",
        ),
        (
            api.RolloutJobSpec(
                tasks=[
                    api.RolloutTask(
                        id="gui-setup",
                        instruction="x",
                        scorer_json=json.dumps({"gui": {"task_id": task.id}, "setup": ["echo hi"]}),
                    )
                ],
                harnesses=["builtin:browser"],
            ),
            "takes no setup",
        ),
    ]
    for spec, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in info.value.details()
    harnesses = stub.ListHarnesses(api.ListHarnessesRequest()).harnesses
    browser = {h.name: h for h in harnesses}["builtin:browser"]
    assert len(json.loads(browser.tools_json)) == 13 and "screenshot" in browser.system_prompt
