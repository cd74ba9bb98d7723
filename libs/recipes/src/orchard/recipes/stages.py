"""The stages of a recipe run, each reading the outputs of the ones before it from the run folder.

- **collect**: a rollout job in orchard-rollout of the teacher (an endpoint, or the scripted
  teacher the rollout service plays from the job spec) on every SFT task ``attempts_per_task``
  times through the harness, in sandboxes of the environment service, scored by the reward
  service's ScoreTests; orchard-trainer renders its conversations in the student's tokens
  (PrepareDataset: the student's tokenizer is the trainer's).
- **curate**: successful trajectories (and failed ones with credit, when the credit stage gave
  some) filtered for SFT by orchard-trainer's curation (PrepareDataset), which also counts the
  SFT samples the job will build.
- **sft**: an SFT job in orchard-trainer (DeepSpeed engine) on the curated trajectories, stepped
  to its end and published to the weight registry under the run's model.
- **rl**: an RL job in orchard-trainer, starting from the SFT model; each step is a rollout job
  in orchard-rollout of the current weight version on part of the RL tasks, its sampler
  assembling groups (the student sampling on the service's local engine behind its capture
  proxy: exact tokens and logprobs); the first groups with signal go to the training job,
  which takes one optimizer step and publishes the version the next step samples. With
  ``select: validation`` the stage then runs the SFT model and every RL version greedily on the
  RL tasks (rollout jobs too) and hands on the best.
  With ``estimator: opd`` the training job distills from a teacher instead (every group
  trains, scored or not), the teacher first trained by SFT on the curated set when the recipe
  says so (`opd_teacher`), published under a registry model of its own.
- **evaluate**: every model (base, sft, rl, and the OPD teacher) attempts every held-out task
  in a rollout job of its weight version; resolved counts.

Each stage function takes a `StageContext` and returns the summary `done.json` keeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tqdm import tqdm

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.recipes.recipe_tasks import RecipeTask, task_spec
from orchard.recipes.rollout_client import RolloutJobs
from orchard.recipes.rubric import rubric_rewards
from orchard.recipes.swe_suite import teacher_script
from orchard.recipes.trails import keeps_trails
from orchard.recipes.trails import main_line as _main_line
from orchard.recipes.trainer_client import TrainerJobs, step_entry
from orchard.recipes.weights_client import WeightVersions
from orchard.recipes.workspace import RunDir, StackEndpoints, write_json
from orchard.reward.v1 import reward_service_pb2
from orchard.rollout.v1 import rollout_service_pb2 as rollout_api
from orchard.sdk.recipe import Budget, Recipe
from orchard.trainer.v1 import trainer_service_pb2 as trainer_api
from orchard.types.v1 import reward_pb2, trajectory_pb2

__all__ = [
    "StageContext",
    "harnesses_for",
    "run_collect",
    "run_credit",
    "run_curate",
    "run_evaluate",
    "run_rl",
    "run_sft",
]

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    recipe: Recipe
    run: RunDir
    stack: StackEndpoints
    tasks: dict[str, list[RecipeTask]]
    progress: bool = True
    workers: int = 4
    """Rollouts that run at once."""
    seed: int = 0
    notes: list[str] = field(default_factory=list)
    lineage: str = ""
    """Names a second line of weights of the run (``from-base``: RL from the base model;
    ``opd-teacher``: the OPD teacher), which gets a registry model of its own; empty: the
    run's main line."""
    model: str = ""
    """The model the line starts from when it is not the recipe's student (the OPD teacher's
    built-in size, or its given model); empty: ``student.model``."""

    @property
    def pass_mark(self) -> float:
        """The run's one success threshold (`Recipe.pass_mark`): a rollout whose reward is at or
        above it succeeded. Every RPC that decides success is sent it: the samplers, credit
        assignment, PrepareDataset (curation, SFT sample counts) and the SFT job; evaluation
        counts resolved rollouts by it."""
        return self.recipe.pass_mark

    @property
    def registry_model(self) -> str:
        """The line's name in the weight registry: one per run and line of weights
        (``<recipe>-opd-teacher`` for the OPD teacher, which is no student)."""
        if self.lineage == OPD_TEACHER:
            return f"{self.recipe.name}-{OPD_TEACHER}"
        return f"{self.recipe.name}-student" + (f"-{self.lineage}" if self.lineage else "")

    def line(self, lineage: str, model: str = "") -> StageContext:
        """The same run on another line of weights (its own registry model), starting from
        ``model`` (empty: the student)."""
        return replace(self, lineage=lineage, model=model)


async def harnesses_for(ctx: StageContext) -> dict[str, rollout_api.Harness]:
    """The recipe's harnesses as orchard-rollout drives them (ListHarnesses: name, system
    prompt, tools); raises ValueError for one the service does not drive."""
    async with RolloutJobs(ctx.stack.rollout) as rollouts:
        known = await rollouts.harnesses()
    for name in ctx.recipe.evaluated_harnesses:
        if name not in known:
            raise ValueError(
                f"harness {name!r} is not one orchard-rollout at {ctx.stack.rollout} drives; "
                f"it drives: {', '.join(sorted(known)) or 'none'}"
            )
    return {name: known[name] for name in ctx.recipe.harnesses}


def _bar(ctx: StageContext, total: int, desc: str) -> tqdm[Any]:
    return tqdm(total=total, desc=desc, unit="rollout", disable=not ctx.progress, leave=True)


def _tools_of(harness: rollout_api.Harness) -> list[dict[str, Any]]:
    """The harness's tools as its model sees them (OpenAI `tools` entries)."""
    tools: list[dict[str, Any]] = json.loads(harness.tools_json or "[]")
    return tools


# -- rollout jobs in orchard-rollout ------------------------------------------------------------


def _job_spec(
    ctx: StageContext,
    tasks: Sequence[RecipeTask],
    policy: rollout_api.PolicySpec,
    sampler: rollout_api.SamplerConfig,
    budget: Budget,
    *,
    harnesses: Sequence[str] = (),
) -> rollout_api.RolloutJobSpec:
    """A rollout job of ``harnesses`` (default: the recipe's) on ``tasks``, ``ctx.workers``
    rollouts at once."""
    return rollout_api.RolloutJobSpec(
        tasks=[task_spec(t).to_proto() for t in tasks],
        harnesses=list(harnesses or ctx.recipe.harnesses),
        policy_spec=policy,
        sampler=sampler,
        budget=_budget_proto(budget),
        concurrency=ctx.workers,
    )


def _every_group(n: int, mark: float) -> rollout_api.SamplerConfig:
    """``n`` rollouts per task, every group streamed (collect and evaluation runs), successes
    counted at ``mark``."""
    return rollout_api.SamplerConfig(
        kind=rollout_api.SAMPLER_KIND_FIXED_N,
        group_size=n,
        keep_uninformative_groups=True,
        positive_threshold=mark,
    )


def _budget_proto(budget: Budget) -> rollout_api.RolloutBudget:
    proto = rollout_api.RolloutBudget(max_steps=budget.max_steps, max_tokens=budget.max_tokens)
    proto.max_duration.FromNanoseconds(int(budget.wall_clock_s * 1e9))
    return proto


def _student_policy(
    ctx: StageContext, version: str, temperature: float, max_tokens_per_call: int, seed: int
) -> rollout_api.PolicySpec:
    """The run's student at ``version`` of its registry model, on orchard-rollout's engine,
    its token draws seeded with ``seed`` (each rollout's calls draw from it, the rollout and
    the call: `PolicySpec.seed`)."""
    return rollout_api.PolicySpec(
        weights=rollout_api.RegistryWeights(model=ctx.registry_model, version=version),
        temperature=temperature,
        max_tokens_per_call=max_tokens_per_call,
        seed=seed,
    )


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for one use (a stage, a step) of a run seeded with ``seed``: the same
    run draws the same, each use draws its own."""
    key = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def _rollout_bar(ctx: StageContext, total: int, desc: str) -> tuple[tqdm[Any], Any]:
    """A progress bar and the callback that moves it from a job's counters."""
    bar = _bar(ctx, total, desc)

    def progress(job: rollout_api.RolloutJob) -> None:
        bar.n = min(total, int(job.rollouts_done)) if total else int(job.rollouts_done)
        bar.set_postfix(groups=job.groups_emitted, excluded=job.rollouts_excluded, refresh=True)

    return bar, progress


def _scored(trajectory: trajectory_pb2.Trajectory) -> bool:
    return trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED


def _distillable(trajectory: trajectory_pb2.Trajectory) -> bool:
    """What on-policy distillation trains on: captured turns of a rollout neither excluded nor
    aborted, whether or not it was scored."""
    return (
        bool(trajectory.turns)
        and trajectory.reward.status != reward_pb2.REWARD_STATUS_EXCLUDED
        and trajectory.outcome != trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED
    )


def _resolved(
    trajectory: trajectory_pb2.Trajectory, mark: float = DEFAULT_SUCCESS_THRESHOLD
) -> bool:
    """Scored at or above the success threshold ``mark``: the one rule of success."""
    return _scored(trajectory) and trajectory.reward.value >= mark


def group_counts(
    groups: Sequence[trajectory_pb2.TrajectoryGroup], mark: float = DEFAULT_SUCCESS_THRESHOLD
) -> dict[str, Any]:
    """Rollouts of the groups, resolved (a reward of ``mark`` or more), unresolved and excluded
    (by the layer that failed)."""
    rollouts = [t for g in groups for t in _main_line(g)]
    excluded: Counter[str] = Counter(
        t.metadata.get("failure_layer", "scoring") for t in rollouts if not _scored(t)
    )
    resolved = sum(_resolved(t, mark) for t in rollouts)
    return {
        "rollouts": len(rollouts),
        "resolved": resolved,
        "unresolved": len(rollouts) - resolved - sum(excluded.values()),
        "excluded": dict(excluded),
    }


def _write_groups(path: Path, groups: Sequence[trajectory_pb2.TrajectoryGroup]) -> None:
    with path.open("a", encoding="utf-8") as out:
        for group in groups:
            out.write(json_format.MessageToJson(group, indent=None) + "\n")


def read_groups(path: Path) -> list[trajectory_pb2.TrajectoryGroup]:
    """The groups a stage wrote (``groups.jsonl``, one JSON object per line)."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json_format.Parse(line, trajectory_pb2.TrajectoryGroup()) for line in lines if line]


# -- collect -------------------------------------------------------------------------------------


def _teacher(ctx: StageContext, tasks: Sequence[RecipeTask]) -> rollout_api.PolicySpec:
    """The teacher as orchard-rollout runs it: the recipe's endpoint (its key in the variable
    `teacher.api_key_env` of the rollout service's environment), or the scripted teacher for the
    run's tasks, which the rollout service plays itself (the script travels in the job spec)."""
    teacher = ctx.recipe.teacher
    gui = ctx.recipe.tasks.gui
    if teacher.endpoint == "builtin:scripted" and gui is not None:
        # The rollout service plays the GUI suite's teacher itself, page by page: it needs the
        # suite, not a script.
        script = rollout_api.ScriptedPolicy(
            model=teacher.model,
            seed=ctx.seed,
            gui_teacher=rollout_api.GuiTeacher(
                suite_seed=gui.seed, count=gui.count, mistake_rate=teacher.mistake_rate
            ),
        )
        return rollout_api.PolicySpec(scripted=script, temperature=1.0)
    if teacher.endpoint == "builtin:scripted":
        plans = _scripted_plans(ctx, tasks)
        script = _scripted_policy({"model": teacher.model, "plans": plans}, seed=ctx.seed)
        return rollout_api.PolicySpec(scripted=script, temperature=1.0)
    endpoint = rollout_api.ChatEndpoint(
        base_url=teacher.endpoint, model=teacher.model, api_key_env=teacher.api_key_env or ""
    )
    return rollout_api.PolicySpec(endpoint=endpoint, temperature=1.0)


def _scripted_plans(ctx: StageContext, tasks: Sequence[RecipeTask]) -> list[dict[str, Any]]:
    """The scripted teacher's plans for `tasks`, software and Claw tasks alike (each plan
    is matched by its task's instruction, so one script serves a joint run's two suites)."""
    plans: list[dict[str, Any]] = []
    claw = [t for t in tasks if t.domain == "claw"]
    if claw:
        from orchard.tasks.claw.suite import task_by_id  # noqa: PLC0415
        from orchard.tasks.claw.teacher import teacher_script as claw_script  # noqa: PLC0415

        plans += claw_script([task_by_id(t.id) for t in claw])["plans"]
    software = {t.id for t in tasks if t.domain == "swe"}
    if software:
        from orchard.recipes.swe_suite import generate_suite  # noqa: PLC0415

        spec = ctx.recipe.tasks.builtin
        if spec is None:
            raise ValueError(
                "the scripted teacher knows only the built-in suites; give teacher.endpoint an "
                "OpenAI-compatible URL for JSONL tasks"
            )
        suite = generate_suite(spec.count, seed=spec.seed)
        plans += teacher_script([t for t in suite if t.instance_id in software])["plans"]
    return plans


def _scripted_policy(script: dict[str, Any], seed: int) -> rollout_api.ScriptedPolicy:
    """`teacher_script`'s plans as the rollout service takes them."""

    def steps(items: Sequence[dict[str, Any]]) -> list[rollout_api.ScriptedStep]:
        return [
            rollout_api.ScriptedStep(
                thought=step["thought"],
                tool=step.get("tool", ""),
                arguments_json=json.dumps(step.get("arguments", {})) if step.get("tool") else "",
            )
            for step in items
        ]

    plans = [
        rollout_api.ScriptedPlan(
            match=plan["match"],
            solve_rate=plan["solve_rate"],
            solution=steps(plan["solution"]),
            failure=steps(plan["failure"]),
        )
        for plan in script["plans"]
    ]
    return rollout_api.ScriptedPolicy(model=script.get("model", ""), plans=plans, seed=seed)


async def _collect(ctx: StageContext, out: Path) -> dict[str, Any]:
    """A rollout job of the teacher on the SFT tasks; each scored conversation rendered in the
    student's tokens."""
    stage = ctx.recipe.stages.collect
    tasks = ctx.tasks["sft"]
    total = len(tasks) * len(ctx.recipe.harnesses) * stage.attempts_per_task
    policy = _teacher(ctx, tasks)
    sampler = _every_group(stage.attempts_per_task, ctx.pass_mark)
    spec = _job_spec(ctx, tasks, policy, sampler, stage.budget)
    bar, progress = _rollout_bar(ctx, total, "collect")
    with bar:
        async with RolloutJobs(ctx.stack.rollout) as rollouts:
            job, groups = await rollouts.run(
                spec, f"{ctx.recipe.name}-collect-{uuid.uuid4().hex}", progress=progress
            )
    path = out / "groups.jsonl"
    path.unlink(missing_ok=True)
    _write_groups(path, groups)
    repository = {t.id: t.source for t in tasks}
    rows = []
    for group in groups:
        for source in _main_line(group):
            if not _scored(source) or not (source.conversation_json or source.turns):
                continue
            row = trajectory_pb2.Trajectory()
            row.CopyFrom(source)
            if row.conversation_json:
                # The trainer renders the conversation in the student's tokenizer; the captured
                # turns are in the built-in one.
                del row.turns[:]
            row.metadata["repository"] = repository.get(group.task_id, "")
            rows.append(row)
    # In an order of their content, not of their finishing: the dataset, and so the SFT job's
    # batches, are the same whichever rollout finished first.
    rows.sort(key=lambda r: (r.task_id, r.harness, _content_key(r)))
    # The conversations as orchard-rollout gave them; the trainer renders them.
    conversations = out / "conversations.jsonl"
    _write_trajectories(conversations, rows)
    result = await _prepare(ctx, conversations, out / "trajectories.jsonl", "collect")
    return {
        **group_counts(groups, ctx.pass_mark),
        "trajectories": result.rows_kept,
        **_unrendered(result),
        "rollout_job": job.id,
    }


async def _harness_tools(ctx: StageContext) -> list[trainer_api.HarnessTools]:
    """The tools each harness declares to the model: the student's chat template renders them
    into every prompt, so the trainer renders the teacher's conversations with them."""
    return [
        trainer_api.HarnessTools(harness=name, tools_json=json.dumps(_tools_of(harness)))
        for name, harness in (await harnesses_for(ctx)).items()
    ]


async def _prepare(
    ctx: StageContext,
    rows: Path,
    copy: Path,
    stage: str,
    curation: trainer_api.CurationSettings | None = None,
) -> trainer_api.PrepareDatasetResult:
    """orchard-trainer's PrepareDataset on the trajectories in `rows` (put in the stack's
    artifact store): conversations rendered in the student's tokens, curated when `curation`
    is given; the dataset it wrote is copied to `copy`, for people and later stages to read."""
    store = ctx.stack.artifact_store()
    output = f"{ctx.recipe.name}-{stage}-{uuid.uuid4().hex}.jsonl"
    request = prepare_request(
        ctx,
        model=await base_model_url(ctx),
        trajectories=_put_file(ctx, rows, "trajectories"),
        tools=await _harness_tools(ctx),
        output=store.url("recipes", "datasets", output),
        curation=curation,
    )
    bar = tqdm(total=0, desc=f"{stage}: prepare", unit="row", disable=not ctx.progress)

    def progress(update: trainer_api.PrepareDatasetProgress) -> None:
        bar.total = int(update.rows_total)
        bar.n = int(update.rows_done)
        bar.refresh()

    with bar:
        async with TrainerJobs(ctx.stack.trainer) as trainer:
            result = await trainer.prepare_dataset(request, progress)
    staging = copy.with_suffix(".partial")
    with store.open_read(result.dataset) as source, staging.open("wb") as target:
        shutil.copyfileobj(source, target)
    staging.rename(copy)
    return result


def prepare_request(
    ctx: StageContext,
    *,
    model: str,
    trajectories: str,
    tools: Sequence[trainer_api.HarnessTools],
    output: str,
    curation: trainer_api.CurationSettings | None = None,
) -> trainer_api.PrepareDatasetRequest:
    """PrepareDataset of ``trajectories`` for ``model``, with the run's success threshold (it
    decides curation's successes and the SFT samples counted)."""
    request = trainer_api.PrepareDatasetRequest(
        model=model,
        trajectories=trajectories,
        tools=tools,
        output=output,
        source_model=ctx.recipe.teacher.model,
        examples_per_reason=2,
        success_threshold=ctx.pass_mark,
    )
    if curation is not None:
        request.curation.CopyFrom(curation)
    return request


def _unrendered(result: trainer_api.PrepareDatasetResult) -> dict[str, Any]:
    """The rows the trainer could not render, counted by reason with the first few named."""
    if not result.rows_unrendered:
        return {}
    return {
        "unrendered": int(result.rows_unrendered),
        "unrendered_by_reason": {k: int(v) for k, v in result.unrendered_by_reason.items()},
        "unrendered_examples": [
            {"trajectory_id": u.trajectory_id, "reason": u.reason, "detail": u.detail}
            for u in result.unrendered[:3]
        ],
    }


def _write_trajectories(path: Path, rows: Sequence[trajectory_pb2.Trajectory]) -> None:
    """JSON Lines of trajectories, one compact object a line, renamed into place whole."""
    staging = path.with_suffix(".partial")
    with staging.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json_format.MessageToJson(row, indent=None) + "\n")
    staging.rename(path)


def _read_trajectories(path: Path) -> list[trajectory_pb2.Trajectory]:
    """The trajectories a stage wrote (``_write_trajectories``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json_format.Parse(line, trajectory_pb2.Trajectory()) for line in lines if line.strip()]


def run_collect(ctx: StageContext) -> dict[str, Any]:
    out = ctx.run.stage("collect")
    return asyncio.run(_collect(ctx, out))


# -- credit --------------------------------------------------------------------------------------


def _statements(ctx: StageContext) -> dict[str, str]:
    """Each SFT task's problem statement, which the credit judge reads as the task."""
    return {t.id: t.instruction for t in ctx.tasks["sft"]}


SCRIPTED_JUDGE = "scripted"
"""The reward service's scripted credit judge (a judge of kind scripted; `orchard up` has it)."""


async def _credit_by_service(
    ctx: StageContext,
    failed: Sequence[trajectory_pb2.Trajectory],
    bar: tqdm[Any],
    judge: str = "",
) -> tuple[list[trajectory_pb2.Trajectory], Counter[str]]:
    """AssignCredit through the reward service with its judge named `judge` (empty: its
    default judge)."""
    import grpc  # noqa: PLC0415

    from orchard.reward.v1 import reward_service_pb2_grpc  # noqa: PLC0415
    from orchard.types.v1 import reward_pb2  # noqa: PLC0415

    statement = _statements(ctx)
    credited: list[trajectory_pb2.Trajectory] = []
    excluded: Counter[str] = Counter()
    gate = asyncio.Semaphore(ctx.workers)
    async with grpc.aio.insecure_channel(ctx.stack.reward) as channel:
        stub = reward_service_pb2_grpc.RewardServiceStub(channel)

        async def one(row: trajectory_pb2.Trajectory) -> None:
            async with gate:
                try:
                    reply = await stub.AssignCredit(
                        credit_request(ctx, row, statement.get(row.task_id, ""), judge),
                        timeout=600,
                    )
                except grpc.aio.AioRpcError as exc:
                    if judge and "unknown judge" in (exc.details() or ""):
                        raise RuntimeError(
                            f"the reward service at {ctx.stack.reward} has no judge {judge!r}: "
                            f"add judges.{judge}: {{kind: scripted}} to its configuration "
                            f"(orchard up does); it said: {exc.details()}"
                        ) from None
                    raise
            bar.update(1)
            if reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED:
                reason = reward_pb2.ExclusionReason.Name(reply.reward.exclusion)
                excluded[reason.removeprefix("EXCLUSION_REASON_").lower()] += 1
                return
            row.credit.CopyFrom(reply.credit)
            credited.append(row)

        await asyncio.gather(*(one(r) for r in failed))
    return credited, excluded


def credit_request(
    ctx: StageContext, row: trajectory_pb2.Trajectory, task: str, judge: str
) -> reward_service_pb2.AssignCreditRequest:
    """AssignCredit of the failed ``row`` with the run's epsilon and success threshold."""
    return reward_service_pb2.AssignCreditRequest(
        trajectory=row,
        epsilon=ctx.recipe.stages.credit.epsilon,
        task=task,
        failure=row.reward.detail,
        judge=judge,
        success_threshold=ctx.pass_mark,
    )


def failed_rows(
    rows: Sequence[trajectory_pb2.Trajectory], mark: float
) -> list[trajectory_pb2.Trajectory]:
    """The scored rows below the success threshold ``mark``: what credit assignment is for."""
    return [r for r in rows if _scored(r) and not _resolved(r, mark)]


async def _credit(ctx: StageContext, out: Path) -> dict[str, Any]:
    stage = ctx.recipe.stages.credit
    rows = _read_trajectories(ctx.run.root / "collect" / "trajectories.jsonl")
    failed = failed_rows(rows, ctx.pass_mark)
    with _bar(ctx, len(failed), "credit") as bar:
        scripted = stage.judge_endpoint == "builtin:scripted"
        judge = SCRIPTED_JUDGE if scripted else ""
        credited, excluded = await _credit_by_service(ctx, failed, bar, judge)
    with_segments = [r for r in credited if r.credit.rise_segments]
    _write_trajectories(out / "trajectories.jsonl", sorted(credited, key=lambda t: t.id))
    summary: dict[str, Any] = {
        "failed": len(failed),
        "credited": len(with_segments),
        "no_rise": len(credited) - len(with_segments),
        "excluded": dict(excluded),
        "judge": stage.judge_endpoint,
    }
    if excluded and not credited:
        summary["note"] = (
            f"credit assignment gave nothing: the judge answered none of {len(failed)} failed "
            f"trajectories ({', '.join(excluded)}); failed trajectories then carry no loss in SFT"
        )
    return summary


def run_credit(ctx: StageContext) -> dict[str, Any]:
    """Rise segments for the failed teacher trajectories from the reward service's
    AssignCredit: with its scripted judge (``builtin:scripted``), else with its default judge."""
    out = ctx.run.stage("credit")
    return asyncio.run(_credit(ctx, out))


# -- curate --------------------------------------------------------------------------------------


def run_curate(ctx: StageContext) -> dict[str, Any]:
    """orchard-trainer's curation (PrepareDataset) over the collected trajectories
    (credit-assigned ones in place of their originals when the credit stage ran); failed
    trajectories without rise segments pass here and carry no loss in SFT. The dataset stays
    in the artifact store (its URL in the summary, for the SFT job), a copy in ``sft.jsonl``."""
    stage = ctx.recipe.stages.curate
    rows = _read_trajectories(ctx.run.root / "collect" / "trajectories.jsonl")
    credited = ctx.run.root / "credit" / "trajectories.jsonl"
    if credited.exists():
        by_id = {t.id: t for t in _read_trajectories(credited)}
        rows = [by_id.get(t.id, t) for t in rows]
    out = ctx.run.stage("curate")
    given = out / "input.jsonl"
    _write_trajectories(given, rows)
    curation = trainer_api.CurationSettings(
        max_tokens=stage.max_tokens,
        drop_unparsable=stage.drop_unparsable,
        drop_unknown_tools=stage.drop_unknown_tools,
        shortest_success_per_task=stage.shortest_success_per_task,
        cap_per_source=stage.cap_per_source or 0,
        source_key="repository",
        # Several programs: each keeps its shortest success (each teaches its own tool calls).
        per_harness=len(ctx.recipe.harnesses) > 1,
    )
    result = asyncio.run(_prepare(ctx, given, out / "sft.jsonl", "curate", curation))
    (out / "report.txt").write_text(result.curation_summary + "\n", encoding="utf-8")
    return {
        "input": len(rows),
        "kept": int(result.rows_kept),
        "samples": int(result.sft_samples),
        "dataset": result.dataset,
        **_unrendered(result),
        "steps": [_step_summary(r) for r in result.curation],
    }


def _step_summary(report: trainer_api.CurationStepReport) -> dict[str, Any]:
    """One curation step's report as ``done.json`` keeps it."""
    examples: dict[str, list[dict[str, str]]] = {}
    for drop in report.examples:
        examples.setdefault(drop.reason, []).append(
            {"trajectory_id": drop.trajectory_id, "detail": drop.detail}
        )
    return {
        "step": report.step,
        "rows_in": int(report.rows_in),
        "kept": int(report.kept),
        "dropped": int(report.dropped),
        "by_reason": {k: int(v) for k, v in sorted(report.dropped_by_reason.items())},
        "examples": examples,
    }


# -- sft -----------------------------------------------------------------------------------------


async def base_model_url(ctx: StageContext) -> str:
    """The untrained student's artifact URL: what SFT starts from and the base line of the
    evaluation, published as version "base" (`_publish_base`)."""
    return str((await _publish_base(ctx))["location"])


def _content_digest(paths: Sequence[tuple[str, Path]]) -> str:
    """A digest of files and their names: artifacts never change, so content names them."""
    digest = hashlib.sha256()
    for name, path in sorted(paths):
        digest.update(name.encode() + b"\0")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _put_folder(ctx: StageContext, folder: Path, kind: str) -> str:
    """`folder` in the stack's artifact store (once per content); its URL."""
    store = ctx.stack.artifact_store()
    files = [(p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file()]
    url = store.url("recipes", kind, _content_digest(files))
    if not store.exists(url):
        store.put_dir(folder, url)
    return url


def _put_file(ctx: StageContext, path: Path, kind: str) -> str:
    """The file `path` in the stack's artifact store (once per content); its URL."""
    store = ctx.stack.artifact_store()
    url = store.url("recipes", kind, f"{_content_digest([(path.name, path)])}{path.suffix}")
    if not store.exists(url):
        with path.open("rb") as source, store.open_write(url) as target:
            shutil.copyfileobj(source, target)
    return url


SFT_STEPS_PER_CALL = 12
"""Optimizer steps per Step call of an SFT job: often enough for the progress bar."""


def sft_spec(
    ctx: StageContext,
    dataset: str,
    steps: int,
    *,
    validate: bool = True,
    learning_rate: float | None = None,
) -> trainer_api.TrainingJobSpec:
    """The SFT job of ``steps`` optimizer steps on ``dataset`` (the URL of the dataset the
    trainer prepared: by URL, never a path), with the run's success threshold, the one its
    PrepareDataset counted samples with, and a seed drawn from the run's. With ``validate``
    and a `validation_fraction`, the trainer holds that share of the dataset's tasks out (with
    the job's seed) and evaluates their loss after every epoch, stopping after `patience`
    epochs without a new best when that is set. The model is the published base, filled in
    later. ``learning_rate`` overrides stages.sft's (an OPD teacher's own); a line of weights
    other than the main one draws a seed of its own."""
    stage = ctx.recipe.stages.sft
    spec = trainer_api.TrainingJobSpec(
        mode=trainer_api.TRAINING_MODE_SFT,
        model="",
        zero_stage=stage.zero_stage,
        learning_rate=stage.learning_rate if learning_rate is None else learning_rate,
        warmup_steps=min(stage.warmup_steps, steps),
        total_steps=steps,
        micro_batch_size=stage.batch_size,
        gradient_accumulation=stage.gradient_accumulation,
        dataset=dataset,
        weight_model=ctx.registry_model,
        success_threshold=ctx.pass_mark,
        seed=derived_seed(ctx.seed, "sft", *([ctx.lineage] if ctx.lineage else [])),
    )
    if validate and stage.validation_fraction > 0:
        spec.validation.CopyFrom(
            trainer_api.ValidationConfig(
                fraction=stage.validation_fraction, patience=stage.patience
            )
        )
    return spec


def trainable_tasks(rows: Sequence[trajectory_pb2.Trajectory], mark: float) -> set[str]:
    """The tasks of curated rows an SFT job trains on: those with a success (reward at or
    above ``mark``) or a failure with credit rise segments."""
    return {r.task_id for r in rows if _resolved(r, mark) or r.credit.rise_segments}


def run_sft(ctx: StageContext) -> dict[str, Any]:
    return train_sft(ctx, ctx.run.stage("sft"))


def train_sft(
    ctx: StageContext,
    out: Path,
    *,
    epochs: int | None = None,
    learning_rate: float | None = None,
) -> dict[str, Any]:
    """SFT of ``ctx``'s model (the student, or the OPD teacher on its line) on the curated
    dataset, with stages.sft's settings (``epochs`` and ``learning_rate`` override theirs),
    published under ``ctx``'s registry model; its step log in ``out/run.jsonl``."""
    stage = ctx.recipe.stages.sft
    epochs = stage.epochs if epochs is None else epochs
    curated = ctx.run.done("curate") or {}
    if not curated.get("dataset"):
        raise RuntimeError(
            f"the curate stage left no dataset URL: run it again (remove {ctx.run.root / 'curate'})"
        )
    # Counted by the trainer when it prepared the dataset: the schedule is sized in epochs
    # of samples (a failed row without rise segments gives none).
    samples = int(curated.get("samples", 0))
    if not samples:
        raise RuntimeError(
            "curation kept no trajectory to train on: the teacher resolved nothing; look at "
            f"{ctx.run.root / 'collect' / 'groups.jsonl'}"
        )
    steps = max(1, epochs * samples // (stage.batch_size * stage.gradient_accumulation))
    tasks = trainable_tasks(
        _read_trajectories(ctx.run.root / "curate" / "sft.jsonl"), ctx.pass_mark
    )
    # Whole tasks are held out: it takes two, one to train on and one to validate on.
    validate = stage.validation_fraction > 0 and len(tasks) >= 2
    spec = sft_spec(
        ctx, str(curated["dataset"]), steps, validate=validate, learning_rate=learning_rate
    )
    log_path = out / "run.jsonl"
    log_path.unlink(missing_ok=True)

    async def go() -> dict[str, Any]:
        spec.model = await base_model_url(ctx)
        async with TrainerJobs(ctx.stack.trainer) as trainer:
            job = await trainer.create(
                spec, request_id=f"{ctx.registry_model}-sft-{time.time_ns()}"
            )
            losses: list[float] = []
            version = ""
            bar = tqdm(total=steps, desc=f"sft {job.id}", unit="step", disable=not ctx.progress)
            with bar, log_path.open("a", encoding="utf-8") as run_log:
                while len(losses) < steps:
                    n = min(SFT_STEPS_PER_CALL, steps - len(losses))
                    last = len(losses) + n == steps
                    # With validation the best checkpoint is published, not the last one.
                    response = await trainer.step(job.id, n, publish=last and not validate)
                    for metrics in response.steps:
                        run_log.write(json.dumps(step_entry(metrics), sort_keys=True) + "\n")
                        losses.append(metrics.loss)
                    run_log.flush()
                    bar.update(len(response.steps))
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
                    version = response.weight_version or version
                    if len(response.steps) < n:
                        break  # early stopping ended the job
            summary: dict[str, Any] = {}
            if validate:
                ended = await trainer.get(job.id)
                summary["validation"] = validation_summary(ended.validation)
                best = await trainer.publish_checkpoint(job.id, ended.validation.best_step)
                version = best.weight_version
        async with WeightVersions(ctx.stack.trainer) as weights:
            published = await weights.get(ctx.registry_model, version)
        if published is None:
            raise RuntimeError(f"orchard-trainer reported version {version!r}, not in the registry")
        if not validate:
            summary["validation"] = {
                "off": "stages.sft.validation_fraction is 0"
                if not stage.validation_fraction
                else f"the curated rows hold {len(tasks)} task(s) to train on; holding whole "
                "tasks out takes two"
            }
        return {
            "job": job.id,
            "samples": samples,
            "steps": len(losses),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "weights": _weights_summary(published),
            **summary,
        }

    return asyncio.run(go())


def validation_summary(progress: trainer_api.ValidationProgress) -> dict[str, Any]:
    """An SFT job's validation as ``done.json`` keeps it: every evaluation, the best one (the
    checkpoint the stage hands on) and whether early stopping ended the job."""
    points = [
        {"step": int(p.step), "epoch": p.epoch, "loss": p.loss, "loss_tokens": int(p.loss_tokens)}
        for p in progress.points
    ]
    best = next((p for p in points if p["step"] == progress.best_step), None)
    return {
        "held_out_tasks": list(progress.held_out_tasks),
        "trajectories": int(progress.trajectories),
        "samples": int(progress.samples),
        "training_samples": int(progress.training_samples),
        "points": points,
        "best_step": int(progress.best_step),
        "best_epoch": best["epoch"] if best else None,
        "best_loss": progress.best_loss if best else None,
        "stopped_early": progress.stopped_early,
    }


# -- evaluate ------------------------------------------------------------------------------------


FROM_BASE = "from-base"
"""The line of weights of RL from the base model (`Rl.from_base`), evaluated as "rl-base"."""

OPD_TEACHER = "opd-teacher"
"""The line of weights of the OPD teacher (`Rl.distillation`), evaluated as "opd-teacher"."""


def models_to_evaluate(ctx: StageContext) -> list[tuple[str, str, str]]:
    """(name, weight version, line of weights) of each model the run has produced, base
    first; two names may share a version (an RL stage that handed on the SFT weights)."""
    out = [("base", "base", "")]
    for name in ("sft", "rl"):
        done = ctx.run.done(name)
        if done and done.get("weights"):
            out.append((name, str(done["weights"]["version"]), ""))
    from_base = ((ctx.run.done("rl") or {}).get("from_base") or {}).get("weights")
    if from_base:
        out.append(("rl-base", str(from_base["version"]), FROM_BASE))
    teacher = ((ctx.run.done("rl") or {}).get("distillation") or {}).get("teacher") or {}
    if teacher.get("weights"):
        out.append((OPD_TEACHER, str(teacher["weights"]["version"]), OPD_TEACHER))
    return out


async def _evaluate_model(
    ctx: StageContext,
    name: str,
    version: str,
    out: Path,
    *,
    split: str = "evaluate",
    attempts: int | None = None,
) -> dict[str, Any]:
    """A rollout job of ``version`` on the tasks of ``split`` with the evaluation's settings, on
    every evaluated harness (the recipe's own and, on the held-out tasks, the held-out ones);
    its groups go to ``out/<name>.groups.jsonl``."""
    stage = ctx.recipe.stages.evaluate
    tasks = ctx.tasks[split]
    n = attempts or stage.attempts_per_task
    harnesses = ctx.recipe.evaluated_harnesses if split == "evaluate" else ctx.recipe.harnesses
    budget = ctx.recipe.stages.rl.final_budget
    # Every model draws with the same seed: the same rollouts share their random numbers, so
    # the models' numbers differ by the models, not the draws.
    seed = derived_seed(ctx.seed, "student", split)
    policy = _student_policy(ctx, version, stage.temperature, budget.max_tokens_per_call, seed)
    spec = _job_spec(
        ctx, tasks, policy, _every_group(n, ctx.pass_mark), budget, harnesses=harnesses
    )
    # The held-out GUI episodes keep their screenshot trails: the report shows a few.
    spec.keep_gui_trails = split == "evaluate" and keeps_trails(tasks)
    desc = f"evaluate {name}" if split == "evaluate" else f"validate {name} on {split}"
    total = len(tasks) * len(harnesses) * n
    bar, progress = _rollout_bar(ctx, total, desc)
    with bar:
        async with RolloutJobs(ctx.stack.rollout) as rollouts:
            job, groups = await rollouts.run(
                spec, f"{ctx.recipe.name}-{desc}-{uuid.uuid4().hex}", progress=progress
            )
    path = out / f"{name}.groups.jsonl"
    path.unlink(missing_ok=True)
    _write_groups(path, groups)
    counts = group_counts(groups, ctx.pass_mark)
    family = {t.id: t.family or "all" for t in tasks}
    domain = {t.id: t.domain for t in tasks}
    by_family: dict[str, list[int]] = {}
    by_domain: dict[str, list[int]] = {}
    for group in groups:
        for trajectory in _main_line(group):
            if _scored(trajectory):
                won = int(_resolved(trajectory, ctx.pass_mark))
                for tally, key in (
                    (by_family, family.get(group.task_id, "all")),
                    (by_domain, domain.get(group.task_id, "swe")),
                ):
                    entry = tally.setdefault(key, [0, 0])
                    entry[0] += won
                    entry[1] += 1
    return {
        "model": name,
        "weight_version": version,
        "rollout_job": job.id,
        "resolved": counts["resolved"],
        "attempts": counts["resolved"] + counts["unresolved"],
        "excluded": counts["excluded"],
        "by_family": {
            k: {"resolved": v[0], "attempts": v[1]} for k, v in sorted(by_family.items())
        },
        "by_domain": {
            k: {"resolved": v[0], "attempts": v[1]} for k, v in sorted(by_domain.items())
        },
        "by_harness": by_harness(groups, harnesses, set(ctx.recipe.harnesses), ctx.pass_mark),
    }


def by_harness(
    groups: Sequence[trajectory_pb2.TrajectoryGroup],
    harnesses: Sequence[str],
    trained: set[str],
    mark: float,
) -> dict[str, dict[str, Any]]:
    """Per harness: resolved and scored attempts, excluded ones, whether it is held out from
    training, and per task its scored attempts n and successes c (what pass@k and pass^k are
    estimated from)."""
    out: dict[str, dict[str, Any]] = {
        h: {"held_out": h not in trained, "resolved": 0, "attempts": 0, "excluded": 0, "tasks": {}}
        for h in harnesses
    }
    for group in groups:
        entry = out.setdefault(
            group.harness,
            {"held_out": group.harness not in trained, "resolved": 0, "attempts": 0,
             "excluded": 0, "tasks": {}},
        )  # fmt: skip
        for trajectory in _main_line(group):
            if not _scored(trajectory):
                entry["excluded"] += 1
                continue
            won = _resolved(trajectory, mark)
            task = entry["tasks"].setdefault(group.task_id, [0, 0])
            task[0] += 1
            task[1] += int(won)
            entry["attempts"] += 1
            entry["resolved"] += int(won)
    return out


def _same_weights(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether (version, line) ``a`` and ``b`` name the same weights: the same version of one
    line, or the base version of two lines that both start from the student (RL from the base
    model that never updated publishes the very base model, built from the same seed)."""
    if a[0] != b[0]:
        return False
    return a[1] == b[1] or (a[0] == "base" and {a[1], b[1]} <= {"", FROM_BASE})


def run_evaluate(ctx: StageContext) -> dict[str, Any]:
    out = ctx.run.stage("evaluate")
    asyncio.run(_publish_base(ctx))
    results: dict[str, dict[str, Any]] = {}
    for name, version, lineage in models_to_evaluate(ctx):
        earlier = next(
            (
                n
                for n, r in results.items()
                if _same_weights((r["weight_version"], r.get("line", "")), (version, lineage))
            ),
            None,
        )
        if earlier is not None:
            # The same weights: the same numbers, said so rather than sampled again.
            results[name] = {**results[earlier], "model": name, "same_weights_as": earlier}
            results[name].pop("line", None)
            if lineage:
                results[name]["line"] = lineage
            continue
        cached = out / f"{name}.json"
        if cached.exists():
            results[name] = json.loads(cached.read_text(encoding="utf-8"))
            continue
        results[name] = asyncio.run(_evaluate_model(ctx.line(lineage), name, version, out))
        if lineage:
            results[name]["line"] = lineage
        write_json(cached, results[name])
    return {"models": results}


# -- rl ------------------------------------------------------------------------------------------


_STOP_RULES = {
    "mixed": rollout_api.BAR_STOP_RULE_MIXED,
    "band": rollout_api.BAR_STOP_RULE_BAND,
}
_MEMBER_CHOICES = {
    "random": rollout_api.BAR_MEMBER_CHOICE_RANDOM,
    "ranked": rollout_api.BAR_MEMBER_CHOICE_RANKED,
}


def rl_sampler(ctx: StageContext, step: int = 0) -> rollout_api.SamplerConfig:
    """The RL stage's sampler settings for ``step``, with the run's success threshold and, for
    BAR's random members, a seed drawn from the run's seed and the step (each step draws anew,
    the same run draws the same)."""
    spec = ctx.recipe.stages.rl.sampler
    if spec.kind == "fixed":
        return _every_group(spec.n, ctx.pass_mark)
    return rollout_api.SamplerConfig(
        kind=rollout_api.SAMPLER_KIND_BAR,
        group_size=spec.n,
        max_rollouts=spec.n_max,
        stride=spec.stride_or_n,
        rho_min=spec.rho_min,
        rho_max=spec.rho_max,
        positive_threshold=ctx.pass_mark,
        keep_uninformative_groups=True,
        stop_rule=_STOP_RULES[spec.stop_rule],
        member_choice=_MEMBER_CHOICES[spec.member_choice],
        seed=_step_seed(ctx.seed, step),
    )


def _step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for RL step ``step`` of a run seeded with ``seed``."""
    return derived_seed(seed, "rl", step)


async def _rl(
    ctx: StageContext, trainer: TrainerJobs, job_id: str, start: str, out: Path
) -> dict[str, Any]:
    """Each step: a rollout job of the current version on part of the RL tasks, stopped once
    it has emitted the step's groups with signal; those go to the training job, which takes
    one optimizer step and publishes the version the next step samples."""
    stage = ctx.recipe.stages.rl
    tasks = {t.id: t for t in ctx.tasks["rl"]}
    order_of = [t.id for t in ctx.tasks["rl"]]
    pairs_per_task = len(ctx.recipe.harnesses)
    steps_log = out / "steps.jsonl"
    steps_log.unlink(missing_ok=True)
    groups_log = out / "groups.jsonl"
    groups_log.unlink(missing_ok=True)
    summary: dict[str, Any] = {"steps": [], "groups": [], "weights": None}
    every_group: list[trajectory_pb2.TrajectoryGroup] = []
    current = start
    rotation = random.Random(ctx.seed)
    level, streak = 0, 0
    """Where the step-budget curriculum stands (`StepCurriculum.next_level`)."""

    def trains(group: trajectory_pb2.TrajectoryGroup) -> bool:
        """GRPO learns from groups whose rewards differ; PPO's value model gives every scored
        rollout an advantage of its own (its reward minus the value), so any scored group;
        OPD's teacher scores every token, so any group with a rollout that is not excluded,
        scored or not."""
        if stage.estimator == "ppo":
            return any(_scored(t) for t in group.trajectories)
        if stage.estimator == "opd":
            return any(_distillable(t) for t in group.trajectories)
        return not group.no_signal_reason

    async with (
        WeightVersions(ctx.stack.trainer) as weights,
        RolloutJobs(ctx.stack.rollout) as rollouts,
    ):
        bar = tqdm(total=stage.steps, desc="rl", unit="step", disable=not ctx.progress)
        with bar:
            for step in range(stage.steps):
                order = list(order_of)
                rotation.shuffle(order)
                # A step samples at most twice the tasks it needs: a step whose groups all
                # come out without signal costs a bounded number of rollouts.
                chosen = order[: max(1, (2 * stage.groups_per_step) // pairs_per_task)]
                budget = stage.budget_at(level)
                spec = _job_spec(
                    ctx,
                    [tasks[i] for i in chosen],
                    _student_policy(
                        ctx,
                        current,
                        1.0,
                        stage.budget.max_tokens_per_call,
                        derived_seed(ctx.seed, "student", "rl", step),
                    ),
                    rl_sampler(ctx, step),
                    budget,
                )
                started = time.monotonic()

                def progress(job: rollout_api.RolloutJob) -> None:
                    bar.set_postfix(rollouts=job.rollouts_done, groups=job.groups_emitted)

                pairs = [(t, h) for t in chosen for h in ctx.recipe.harnesses]

                def enough(
                    groups: list[trajectory_pb2.TrajectoryGroup],
                    pairs: list[tuple[str, str]] = pairs,
                ) -> bool:
                    return in_pair_order(groups, pairs, trains, stage.groups_per_step)[1]

                job, emitted = await rollouts.run(
                    spec,
                    f"{ctx.recipe.name}-rl-{step}-{uuid.uuid4().hex}",
                    progress=progress,
                    enough=enough,
                )
                # The service streams every group and says which carry no signal. What the
                # step takes and reports does not depend on which groups finished first.
                groups, _ = in_pair_order(emitted, pairs, trains, stage.groups_per_step, ended=True)
                # stages.rl.rubric: the groups train on outcome and rubric combined (rubric.py).
                shaped = await rubric_rewards(ctx, groups, out, step + 1)
                kept = [_sorted_members(g) for g in shaped.groups if trains(g)]
                kept = kept[: stage.groups_per_step]
                trained = {g.id for g in kept}
                every_group += groups
                _write_groups(groups_log, groups)
                submitted = (
                    await trainer.submit(job_id, kept)
                    if kept
                    else trainer_api.SubmitGroupsResponse()
                )
                scored = [t for g in groups for t in _main_line(g) if _scored(t)]
                entry: dict[str, Any] = {
                    "step": step + 1,
                    "max_steps": budget.max_steps,
                    "success_share": (
                        sum(_resolved(t, ctx.pass_mark) for t in scored) / len(scored)
                        if scored
                        else None
                    ),
                    "rollout_job": job.id,
                    "sampled": current,
                    "groups_kept": len(kept),
                    "groups_dropped": len(groups) - len(kept),
                    "rollouts": sum(int(g.rollouts_run) for g in groups),
                    "rollouts_run_by_job": int(job.rollouts_done),
                    "samples": submitted.trajectories_trainable,
                    "reward_mean": _mean([t.reward.value for t in scored]),
                    "skipped": submitted.trajectories_skipped,
                    "seconds_sampling": round(time.monotonic() - started, 2),
                    **shaped.log,
                }
                summary["groups"] += [
                    {
                        "task": g.task_id,
                        "choice": g.sampler.partition(":")[2] or g.sampler,
                        "members": len(_main_line(g)),
                        "rollouts": g.rollouts_run,
                        "positive_fraction": g.positive_fraction,
                        "kept": g.id in trained,
                    }
                    for g in groups
                ]
                if submitted.trajectories_trainable:
                    response = await trainer.step(job_id, 1, publish=True)
                    metrics = step_entry(response.steps[-1])
                    entry.update(loss=metrics.pop("loss"), metrics=metrics)
                    published = await weights.get(ctx.registry_model, response.weight_version)
                    if published is None:
                        raise RuntimeError(
                            f"orchard-trainer reported version {response.weight_version!r}, "
                            "not in the registry"
                        )
                    current = published.version
                    summary["weights"] = _weights_summary(published)
                    entry["published"] = published.version
                    entry["weights"] = summary["weights"]
                else:
                    entry["published"] = None
                    entry["note"] = "no group carried signal: no update this step"
                if stage.curriculum is not None:
                    grown = stage.curriculum.next_level(level, streak, entry["success_share"])
                    if grown[0] != level:
                        entry["curriculum"] = (
                            f"the training reward saturated: the step budget grows from "
                            f"{budget.max_steps} to {stage.budget_at(grown[0]).max_steps}"
                        )
                    level, streak = grown
                summary["steps"].append(entry)
                with steps_log.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(entry, sort_keys=True) + "\n")
                bar.update(1)
                reward = entry["reward_mean"]
                bar.set_postfix(
                    reward="-" if reward is None else f"{reward:.2f}", groups=entry["groups_kept"]
                )
    summary.update(group_counts(every_group, ctx.pass_mark))
    summary["rollout_budget"] = rollout_budget(summary["steps"])
    return summary


def rollout_budget(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rollouts an RL run used, per step and in all, whatever its estimator: what puts two
    runs (e.g. OPD and GRPO with BAR) side by side at the same budget. ``run`` counts every
    rollout the steps' jobs ran (those of groups not taken included): the cost; ``in_groups``
    those of the groups the steps took."""
    run = [int(s["rollouts_run_by_job"]) for s in steps]
    in_groups = [int(s["rollouts"]) for s in steps]
    return {
        "steps": len(steps),
        "run_per_step": run,
        "run": sum(run),
        "in_groups_per_step": in_groups,
        "in_groups": sum(in_groups),
        "trained_per_step": [int(s["samples"]) for s in steps],
    }


def in_pair_order(
    emitted: Sequence[trajectory_pb2.TrajectoryGroup],
    pairs: Sequence[tuple[str, str]],
    trains: Callable[[trajectory_pb2.TrajectoryGroup], bool],
    wanted: int,
    *,
    ended: bool = False,
) -> tuple[list[trajectory_pb2.TrajectoryGroup], bool]:
    """The groups an RL step takes, whatever order the rollout job emitted them in: those of
    the step's (task, harness) pairs in the step's order, up to the `wanted`-th that `trains`;
    and whether they are all in. While the job runs (`ended` false) a pair that has not
    emitted its group yet holds up the ones after it; once the job `ended`, such a pair is
    passed over."""
    by_pair = {(g.task_id, g.harness): g for g in emitted}
    taken: list[trajectory_pb2.TrajectoryGroup] = []
    training = 0
    for pair in pairs:
        group = by_pair.get(pair)
        if group is None:
            if ended:
                continue
            return taken, False
        taken.append(group)
        training += trains(group)
        if training == wanted:
            return taken, True
    return taken, False


def _sorted_members(group: trajectory_pb2.TrajectoryGroup) -> trajectory_pb2.TrajectoryGroup:
    """`group` with its trajectories in an order of their content, not of their finishing:
    the trainer's batches then hold the same samples in the same order."""
    out = trajectory_pb2.TrajectoryGroup()
    out.CopyFrom(group)
    members = sorted(out.trajectories, key=_content_key)
    del out.trajectories[:]
    out.trajectories.extend(members)
    return out


def _content_key(trajectory: trajectory_pb2.Trajectory) -> tuple[Any, ...]:
    return (
        trajectory.reward.value,
        [[*turn.input_token_ids, -1, *turn.output_token_ids] for turn in trajectory.turns],
        trajectory.conversation_json,
        trajectory.id,
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_rl(ctx: StageContext) -> dict[str, Any]:
    """RL from the SFT model (from the base model without SFT); with ``rl.from_base`` also,
    with the same settings, tasks and seeds, from the base model (under ``rl/from-base``, its
    own registry model), so the report sets what SFT adds before RL beside RL alone."""
    sft = ctx.run.done("sft")
    out = ctx.run.stage("rl")
    # With estimator: opd, the teacher first (trained here when the recipe says so); both
    # lines of weights distill from the same one.
    teacher = (
        opd_teacher(ctx, out / OPD_TEACHER) if ctx.recipe.stages.rl.estimator == "opd" else None
    )
    if sft:
        # a published location is already an artifact URL
        summary = _run_rl(ctx, dict(sft["weights"]), out, teacher)
    else:
        summary = _run_rl(ctx, _base_weights(ctx), out, teacher)
    if ctx.recipe.stages.rl.from_base and sft:
        line = ctx.line(FROM_BASE)
        folder = out / FROM_BASE
        folder.mkdir(parents=True, exist_ok=True)
        summary["from_base"] = _run_rl(line, _base_weights(line), folder, teacher)
    return summary


def opd_teacher(ctx: StageContext, out: Path) -> dict[str, Any]:
    """The teacher of estimator: opd, published as a version of ``<recipe>-opd-teacher``:
    with ``teacher.train``, that built-in size trained by SFT (`train_sft`, stages.sft's
    settings) on the curated teacher trajectories the student's SFT uses; with
    ``teacher.model``, that model as it is. Kept in ``out/teacher.json``: a resumed rl stage
    does not train it again."""
    kept = out / "teacher.json"
    if kept.exists():
        cached: dict[str, Any] = json.loads(kept.read_text(encoding="utf-8"))
        return cached
    distillation = ctx.recipe.stages.rl.distillation
    if distillation is None or distillation.teacher is None:
        raise ValueError("estimator: opd needs stages.rl.distillation.teacher")
    config = distillation.teacher
    if config.train is not None and not (ctx.run.done("curate") or {}).get("dataset"):
        raise RuntimeError(
            f"stages.rl.distillation.teacher.train trains {config.train} on the curated "
            "teacher trajectories, and this run has none: run the collect and curate stages "
            "first"
        )
    out.mkdir(parents=True, exist_ok=True)
    teacher: dict[str, Any]
    if config.train is not None:
        line = ctx.line(OPD_TEACHER, config.train)
        sft = ctx.recipe.stages.sft
        epochs = config.epochs or sft.epochs
        learning_rate = config.learning_rate or sft.learning_rate
        trained = train_sft(line, out, epochs=epochs, learning_rate=learning_rate)
        teacher = {
            "model": config.train,
            "trained": f"SFT, {epochs} epochs at learning rate {learning_rate:g}, on the "
            "curated teacher trajectories",
            "epochs": epochs,
            "learning_rate": learning_rate,
            **trained,
        }
    else:
        line = ctx.line(OPD_TEACHER, config.model or "")
        teacher = {
            "model": config.model,
            "trained": "given (not trained by this run)",
            "weights": asyncio.run(_publish_base(line)),
        }
    teacher["registry_model"] = line.registry_model
    write_json(kept, teacher)
    return teacher


def _base_weights(ctx: StageContext) -> dict[str, Any]:
    """The base model published as version "base" of ``ctx``'s registry model."""
    return asyncio.run(_publish_base(ctx))


def rl_spec(
    ctx: StageContext, start: str, teacher: dict[str, Any] | None = None
) -> trainer_api.TrainingJobSpec:
    """The RL job from the weights at ``start`` (an artifact URL) with the stage's estimator;
    with estimator: opd, ``teacher`` is `opd_teacher`'s published teacher."""
    stage = ctx.recipe.stages.rl
    spec = trainer_api.TrainingJobSpec(
        mode=trainer_api.TRAINING_MODE_RL,
        model=start,
        learning_rate=stage.learning_rate,
        total_steps=stage.steps,
        micro_batch_size=8,
        policy_loss=trainer_api.PolicyLossConfig(
            clip_low=stage.clip_low, clip_high=stage.clip_high, kl_coef=stage.kl_coef
        ),
        max_staleness=stage.max_staleness,
        skip_stale=True,
        weight_model=ctx.registry_model,
        max_sequence_tokens=stage.max_sequence_tokens,
        seed=derived_seed(ctx.seed, "rl"),
    )
    if stage.estimator == "ppo":
        spec.advantage_estimator = trainer_api.ADVANTAGE_ESTIMATOR_CRITIC
        spec.critic.CopyFrom(
            trainer_api.CriticConfig(
                learning_rate=stage.critic.learning_rate,
                steps_per_update=stage.critic.steps_per_update,
                gae_lambda=stage.critic.gae_lambda,
                value_pretrain_steps=stage.critic.pretrain_steps,
            )
        )
    elif stage.estimator == "opd":
        if teacher is None or stage.distillation is None:
            raise ValueError("estimator: opd needs its teacher (opd_teacher)")
        spec.advantage_estimator = trainer_api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION
        spec.distillation.CopyFrom(
            trainer_api.DistillationConfig(
                teacher=str(teacher["weights"]["location"]),
                coef=stage.distillation.coef,
                seed=ctx.seed,
            )
        )
    else:
        spec.advantage_estimator = trainer_api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE
    return spec


def _run_rl(
    ctx: StageContext, first: dict[str, Any], out: Path, teacher: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The RL stage from the published weights ``first`` (version and location), its outputs
    in ``out``; ``teacher``: the OPD teacher (`opd_teacher`) with estimator: opd."""
    stage = ctx.recipe.stages.rl
    start_version = str(first["version"])
    spec = rl_spec(ctx, str(first["location"]), teacher)

    async def go() -> dict[str, Any]:
        async with TrainerJobs(ctx.stack.trainer) as trainer:
            job = await trainer.create(spec, request_id=f"{ctx.registry_model}-rl-{time.time_ns()}")
            try:
                summary = await _rl(ctx, trainer, job.id, start_version, out)
            finally:
                # Steps without signal leave steps unused: the job ends here, either way.
                await trainer.cancel(job.id)
            return {"job": job.id, "estimator": stage.estimator, **summary}

    summary = asyncio.run(go())
    if teacher is not None and stage.distillation is not None:
        summary["distillation"] = {"coef": stage.distillation.coef, "teacher": teacher}
    versions = [s["weights"] for s in summary["steps"] if s.get("published")]
    if stage.select == "validation" and versions:
        summary.update(_validate(ctx, [first, *versions], out / "validation"))
        # Greedy runs that pick the weights, not training: counted apart.
        summary["rollout_budget"]["validation"] = sum(
            int(v["attempts"]) for v in summary["validation"]["scores"].values()
        )
    if summary["weights"] is None:
        # No update happened: the RL model is the model it started from, said so.
        summary["weights"] = dict(first)
        summary["note"] = (
            f"no RL step had a group with signal; the RL model is the {start_version} model"
        )
    return summary


def pick_validated(resolved: Sequence[int]) -> int:
    """Index of the candidate to hand on, given each one's resolved count (the starting model
    first, then the RL versions in order): the most resolved, a tie going to the later RL
    version; the starting model only when it is strictly better than every RL version."""
    if not resolved:
        raise ValueError("no candidate to pick from")
    ranks = [(count, index if index else -1) for index, count in enumerate(resolved)]
    return max(range(len(ranks)), key=ranks.__getitem__)


def _validate(ctx: StageContext, candidates: Sequence[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Greedy resolve rate of each candidate (the starting model first, then the RL versions
    in order) on the RL tasks; the best one's weights, a tie going to the later version."""
    out.mkdir(parents=True, exist_ok=True)
    scores: dict[str, dict[str, Any]] = {}
    for weights in candidates:
        version = str(weights["version"])
        result = asyncio.run(_evaluate_model(ctx, version, version, out, split="rl", attempts=1))
        write_json(out / f"{version}.json", result)
        scores[version] = {"resolved": result["resolved"], "attempts": result["attempts"]}
    chosen = candidates[pick_validated([s["resolved"] for s in scores.values()])]
    version = str(chosen["version"])
    table = ", ".join(f"{v} {s['resolved']}/{s['attempts']}" for v, s in scores.items())
    start = str(candidates[0]["version"])
    if version == start:
        verdict = f"no RL version did as well as {start}, so the RL model is the {start} model"
    else:
        verdict = f"the RL model is {version}"
    return {
        "validation": {"split": "rl", "scores": scores, "chosen": version},
        "weights": dict(chosen),
        "note": f"RL validation, greedy on the {len(ctx.tasks['rl'])} RL tasks: {table}; "
        + verdict,
    }


async def _publish_base(ctx: StageContext) -> dict[str, Any]:
    """The untrained student published as version "base" of the run's model by
    orchard-trainer's PublishModel: a built-in model is built there from the run's seed (as a
    training job builds it), a URL published as it is, a local folder first put in the stack's
    artifact store (engines read the store, not this host). Idempotent: a resumed run gets
    the same version. A line with a model of its own (`StageContext.model`) publishes that."""
    model = ctx.model or ctx.recipe.student.model
    if not model.startswith("builtin:") and "://" not in model:
        model = _put_folder(ctx, Path(model), "models")
    async with WeightVersions(ctx.stack.trainer) as weights:
        published = await weights.publish_model(model, ctx.registry_model, "base", ctx.seed)
    return _weights_summary(published)


def _weights_summary(published: trainer_api.WeightVersion) -> dict[str, Any]:
    """A published version as ``done.json`` keeps it."""
    return {
        "version": published.version,
        "number": int(published.number),
        "location": published.location,
    }
