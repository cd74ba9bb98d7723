"""Recipes: one YAML file that says what to train, on which tasks, and how.

A recipe names the tasks (the built-in software-engineering suite, the built-in Claw suite of
personal-assistant tasks, both together, the built-in GUI suite of web tasks, or
SWE-bench-format JSONL files),
the harnesses that drive them (built-in loops, the browser loops, or unmodified agent programs
such as ``program:claude-code``), the teacher
that collects the first trajectories, the student model, and the stages in their fixed order::

    collect -> credit -> curate -> sft -> rl -> evaluate -> rerank

Each stage has its own section; a stage left out keeps its defaults, and ``enabled: false``
skips it. :func:`load_recipe` validates the whole file and reports every problem at once with
its key and line; :func:`builtin_recipe` is the recipe ``make demo`` runs.

Example::

    name: swe-small
    tasks:
      builtin: {count: 24, seed: 7}
      split: {sft: 0.5, rl: 0.25, evaluate: 0.25}
    harnesses: [builtin:swe]
    teacher: {endpoint: builtin:scripted}
    student: {model: builtin:tiny}
    stages:
      sft: {epochs: 4, learning_rate: 0.001}
      rl: {steps: 6, sampler: {kind: bar, n: 8}}
"""

from __future__ import annotations

import itertools
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from orchard.core.config import ConfigModel, load_document
from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD

__all__ = [
    "BROWSER_HARNESSES",
    "BUILTIN_RECIPES",
    "CLAW_PASS_MARK",
    "DEFAULT_SUCCESS_THRESHOLD",
    "DOMAINS",
    "STAGES",
    "BuiltinTasks",
    "ClawTasks",
    "GuiTasks",
    "JsonlTasks",
    "Recipe",
    "Rerank",
    "RlRubric",
    "RubricDimension",
    "StepCurriculum",
    "builtin_recipe",
    "load_recipe",
]

STAGES = ("collect", "credit", "curate", "sft", "rl", "evaluate", "rerank")
"""The stages, in the order a recipe runs them."""


CLAW_PASS_MARK = 0.75
"""The Claw suite's own success threshold: a task passes at a task score of 0.75 (orchard-reward's
ScoreTask)."""

BROWSER_HARNESSES = ("builtin:browser", "builtin:browser-text")
"""The loops that drive the GUI suite's browser episodes (screenshots; page text), and only
those."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_HARNESS = re.compile(r"^(builtin|external|program):[a-z0-9][a-z0-9._-]*$")


class BuiltinTasks(ConfigModel):
    """The software-engineering suite generated in code: small Python repositories, each with a
    real bug and real tests, of graded difficulty."""

    count: int = Field(default=24, ge=3, le=10_000, description="How many tasks to generate.")
    seed: int = Field(
        default=0, description="Seed of the generator; the same seed gives the same tasks."
    )


class ClawTasks(ConfigModel):
    """The Claw suite generated in code: personal-assistant tasks on mail, calendar, contacts,
    notes and documents served inside each sandbox, of graded difficulty, scored by the reward
    service's checks (completion, safety, robustness)."""

    count: int = Field(default=96, ge=12, le=960, description="How many tasks to generate.")
    seed: int = Field(
        default=0, description="Seed of the generator; the same seed gives the same tasks."
    )


class GuiTasks(ConfigModel):
    """The GUI suite generated in code: web tasks on small sites (shop, booking, wiki, forms,
    tabs) served in a sandbox of their own, driven through a browser sandbox, scored by the
    reward service's built-in state judge on the site's server-side state."""

    count: int = Field(default=60, ge=12, le=1500, description="How many tasks to generate.")
    seed: int = Field(
        default=0, description="Seed of the generator; the same seed gives the same tasks."
    )


class JsonlTasks(ConfigModel):
    """SWE-bench-format JSONL files, one per split; their images must be reachable by the
    environment service."""

    sft: Path | None = Field(default=None, description="Tasks the teacher collects SFT data on.")
    rl: Path | None = Field(default=None, description="Tasks reinforcement learning samples from.")
    evaluate: Path = Field(description="Held-out tasks every model is evaluated on.")


class TaskSplit(ConfigModel):
    """How the built-in suite is divided; the fractions sum to 1."""

    sft: float = Field(default=0.5, ge=0, le=1)
    rl: float = Field(default=0.25, ge=0, le=1)
    evaluate: float = Field(default=0.25, gt=0, le=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> TaskSplit:
        total = self.sft + self.rl + self.evaluate
        if not math.isclose(total, 1.0, abs_tol=1e-9):
            raise ValueError(f"sft + rl + evaluate must sum to 1, they sum to {total:g}")
        return self


_SOURCES = ("builtin", "claw", "gui", "jsonl")
_JOINABLE = ("builtin", "claw")
"""The suites a recipe may train on together (one student, one run, per-domain results)."""

DOMAINS = {"builtin": "swe", "claw": "claw", "gui": "gui", "jsonl": "swe"}
"""The domain of each task source: software engineering, personal assistant, web (GUI)."""


class Tasks(ConfigModel):
    """Where the tasks come from: one of ``builtin``, ``claw``, ``gui`` and ``jsonl``, or
    ``builtin`` and ``claw`` together (one student trained on both domains at once, every
    result also given per domain)."""

    builtin: BuiltinTasks | None = None
    claw: ClawTasks | None = None
    gui: GuiTasks | None = None
    jsonl: JsonlTasks | None = None
    split: TaskSplit = TaskSplit()

    @model_validator(mode="after")
    def _one_source(self) -> Tasks:
        given = self.sources
        if not given:
            raise ValueError(
                "give one of tasks.builtin, tasks.claw, tasks.gui and tasks.jsonl (or "
                "tasks.builtin and tasks.claw together, to train on both domains at once)"
            )
        alone = [s for s in given if s not in _JOINABLE]
        if len(given) > 1 and alone:
            raise ValueError(
                f"tasks.{alone[0]} cannot be joined with other tasks ("
                + ", ".join(f"tasks.{s}" for s in given)
                + "): only tasks.builtin and tasks.claw train together (GUI tasks run only "
                "in the browser loops; JSONL files are a split of their own)"
            )
        if self.jsonl is not None and "split" in self.model_fields_set:
            raise ValueError("tasks.split divides a built-in suite; JSONL files are the split")
        return self

    @property
    def sources(self) -> list[str]:
        """The task sources given, in the order tasks are listed (builtin, claw, gui, jsonl)."""
        return [s for s in _SOURCES if getattr(self, s) is not None]

    @property
    def domains(self) -> list[str]:
        """The domains the tasks are of ("swe", "claw", "gui"), one per source."""
        return [DOMAINS[s] for s in self.sources]

    @property
    def generated(self) -> BuiltinTasks | ClawTasks | GuiTasks | None:
        """A built-in suite the tasks come from, if any (the first, when two are joined)."""
        return self.builtin or self.claw or self.gui

    @property
    def pass_mark(self) -> float | None:
        """The suites' own success threshold, when one defines it (Claw: 0.75). Joined with
        the software suite it holds for both: a software task's reward is 1 (resolved) or -1,
        on the same side of 0.75 as of the default 0.5."""
        return CLAW_PASS_MARK if self.claw is not None else None


def _check_harnesses(value: list[str]) -> list[str]:
    for name in value:
        if not _HARNESS.match(name):
            raise ValueError(
                f"{name!r} is not a harness name: use builtin:<name>, program:<name> or "
                "external:<name>"
            )
    if len(set(value)) != len(value):
        raise ValueError("a harness is named twice")
    return value


def _check_endpoint(value: str, builtin: tuple[str, ...]) -> str:
    if value in builtin:
        return value
    url = urlparse(value)
    if url.scheme not in ("http", "https") or not url.netloc:
        choices = ", ".join(builtin)
        raise ValueError(
            f"neither {choices} nor an http(s) URL of an OpenAI-compatible API "
            "(e.g. http://127.0.0.1:8000/v1)"
        )
    return value


class Teacher(ConfigModel):
    """The model that collects the first trajectories, behind an OpenAI-compatible API."""

    endpoint: str = Field(
        default="builtin:scripted",
        description='"builtin:scripted" (a scripted policy the rollout service plays from the '
        "job spec: no model, no network) or the base URL of an OpenAI-compatible chat API.",
    )
    model: str = Field(
        default="scripted-teacher", min_length=1, description="Model name sent with calls."
    )
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key; never the key itself."
    )
    mistake_rate: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="The scripted GUI teacher's chance, per click, typing or choosing step, of "
        "a wrong action in its place (half of them corrected, half left as slips): episodes "
        "that recover, and some that fail.",
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        return _check_endpoint(value, ("builtin:scripted",))

    @field_validator("api_key_env")
    @classmethod
    def _key_env(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError("not an environment variable name (give the name, not the key)")
        return value


class Student(ConfigModel):
    """The model that is trained."""

    model: str = Field(
        default="builtin:tiny",
        description='"builtin:tiny" (a small model built in code) or the path of a Hugging '
        "Face model directory.",
    )
    engine: Literal["local", "vllm"] = Field(
        default="local", description="local: the CPU engine; vllm: vLLM on GPUs."
    )

    @model_validator(mode="after")
    def _engine_fits(self) -> Student:
        if self.engine == "vllm" and self.model.startswith("builtin:"):
            raise ValueError("the vllm engine serves a Hugging Face model path, not builtin:tiny")
        return self


class Budget(ConfigModel):
    """Limits of one rollout."""

    max_steps: int = Field(default=20, ge=1, description="Agent steps (model calls).")
    max_tokens: int = Field(
        default=8192, ge=16, description="Tokens sampled over the whole rollout."
    )
    wall_clock_s: float = Field(default=600.0, gt=0, description="Seconds from start to reward.")
    max_tokens_per_call: int = Field(
        default=192,
        ge=1,
        le=32768,
        description="Tokens one student call samples at most (the teacher is not bound by it).",
    )


class Stage(ConfigModel):
    """What every stage has."""

    enabled: bool = True


class Collect(Stage):
    """The teacher attempts the SFT tasks."""

    attempts_per_task: int = Field(default=2, ge=1, le=64)
    budget: Budget = Budget()


class Credit(Stage):
    """Retrospective credit assignment on failed teacher trajectories."""

    judge_endpoint: str = Field(
        default="builtin:scripted",
        description='"builtin:scripted" (the reward service\'s scripted credit judge, named '
        '"scripted" there) or the base URL of an OpenAI-compatible judge.',
    )
    judge_model: str = Field(default="scripted-judge", min_length=1)
    epsilon: float = Field(
        default=0.05, gt=0, lt=1, description="Least rise of V that marks a step."
    )

    @field_validator("judge_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        return _check_endpoint(value, ("builtin:scripted",))


class Curate(Stage):
    """Filters between collection and SFT."""

    max_tokens: int = Field(default=4096, ge=16, description="Drop trajectories longer than this.")
    drop_unparsable: bool = True
    drop_unknown_tools: bool = True
    shortest_success_per_task: bool = True
    cap_per_source: int | None = Field(
        default=None, ge=1, description="Most trajectories per repository."
    )


class Sft(Stage):
    """Supervised fine-tuning on the curated trajectories."""

    epochs: int = Field(default=3, ge=1, le=1000)
    learning_rate: float = Field(default=1e-3, gt=0, lt=1)
    batch_size: int = Field(default=8, ge=1)
    gradient_accumulation: int = Field(default=1, ge=1)
    warmup_steps: int = Field(default=10, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    per_turn_samples: bool = False
    validation_fraction: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Share of the SFT tasks held out as a validation set (whole tasks, drawn "
        "with the run's seed): the trainer evaluates their loss after each epoch and the stage "
        "hands on the epoch with the lowest one. 0 turns validation off (the last epoch is "
        "handed on).",
    )
    patience: int = Field(
        default=0,
        ge=0,
        description="Early stopping: end SFT after this many epochs in a row without a lower "
        "validation loss; 0: run every epoch (the best one is still the one handed on).",
    )


_BAR_ONLY = ("stop_rule", "member_choice")
"""Sampler settings that only kind: bar takes (the older ones are ignored by kind: fixed)."""


class Sampler(ConfigModel):
    """How RL groups are sampled. A rollout succeeded when its reward is at or above the
    recipe's success threshold (`Recipe.pass_mark`)."""

    kind: Literal["bar", "fixed"] = Field(
        default="bar", description="bar: Balanced Adaptive Rollout; fixed: fixed-N with filtering."
    )
    n: int = Field(default=8, ge=2, description="Trajectories per group.")
    n_max: int = Field(default=16, ge=2, description="Most rollouts per task (bar).")
    stride: int | None = Field(
        default=None,
        ge=1,
        description="Rollouts per stride (bar), at most n_max; the stop rule is checked after "
        "each, so below n_max a task that meets it early costs fewer rollouts. Default: n.",
    )
    stop_rule: Literal["mixed", "band"] = Field(
        default="mixed",
        description="When bar stops running rollouts of a task. mixed: once its rollouts hold "
        "at least one success and one failure (and n rollouts); the group is then as close to "
        "the middle of [rho_min, rho_max] as they allow. band: once a group of n scored "
        "rollouts with its fraction of successes in [rho_min, rho_max] can be assembled (3 of "
        "each for n = 8).",
    )
    member_choice: Literal["random", "ranked"] = Field(
        default="random",
        description="Which rollouts become a bar group's members, among the successes and "
        "among the failures. random: drawn with the run's seed; ranked: completed before "
        "truncated, shorter before longer.",
    )
    rho_min: float = Field(default=0.375, ge=0, le=1)
    rho_max: float = Field(default=0.625, ge=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> Sampler:
        if self.n_max < self.n:
            raise ValueError(f"n_max ({self.n_max}) must be at least n ({self.n})")
        if self.stride is not None and self.stride > self.n_max:
            raise ValueError(f"stride ({self.stride}) must be at most n_max ({self.n_max})")
        if self.rho_min > self.rho_max:
            raise ValueError(f"rho_min ({self.rho_min}) is above rho_max ({self.rho_max})")
        given = [name for name in _BAR_ONLY if name in self.model_fields_set]
        if self.kind == "fixed" and given:
            raise ValueError(f"{', '.join(given)} configure kind: bar, not kind: fixed")
        return self

    @property
    def stride_or_n(self) -> int:
        """Rollouts per stride: ``stride`` when given, else ``n``."""
        return self.n if self.stride is None else self.stride


class Critic(ConfigModel):
    """The value model of ``estimator: ppo``."""

    learning_rate: float = Field(
        default=0.0, ge=0, lt=1, description="Peak learning rate; 0: the stage's learning_rate."
    )
    pretrain_steps: int = Field(
        default=8,
        ge=0,
        description="Value-model-only steps on the first step's rollouts (the starting "
        "model's own), so the first policy update uses fitted values.",
    )
    steps_per_update: int = Field(
        default=1, ge=1, description="Value-model steps after each policy step."
    )
    gae_lambda: float = Field(default=1.0, ge=0, le=1, description="GAE lambda.")


_BUILTIN_MODEL = re.compile(r"^builtin:[a-z0-9][a-z0-9-]*$")


class OpdTeacher(ConfigModel):
    """The teacher of ``estimator: opd``: ``train`` (a built-in model the recipe trains itself)
    or ``model`` (an existing one). Its tokenizer must be the student's: the teacher scores the
    student's own token ids."""

    train: str | None = Field(
        default=None,
        description='A built-in size ("builtin:small": hidden 128, 4 layers; every built-in '
        "size shares the built-in student's tokenizer) that the rl stage first trains by SFT, "
        "with stages.sft's settings, on the same curated teacher trajectories the student's "
        'SFT uses, publishes as "<recipe>-opd-teacher" and evaluates as "opd-teacher".',
    )
    epochs: int | None = Field(
        default=None, ge=1, le=1000, description="The teacher's SFT epochs; default: stages.sft's."
    )
    learning_rate: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="The teacher's SFT peak learning rate; default: stages.sft's.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="An existing teacher: a built-in size, the artifact URL of a Hugging Face "
        "model folder (a published weight version's location is one) or the path of such a "
        'folder; published as "<recipe>-opd-teacher" and evaluated as "opd-teacher".',
    )

    @model_validator(mode="after")
    def _one_teacher(self) -> OpdTeacher:
        if (self.train is None) == (self.model is None):
            raise ValueError(
                "give exactly one of teacher.train (a built-in size the recipe trains, e.g. "
                "builtin:small) and teacher.model (an existing model)"
            )
        if self.train is None and (self.epochs or self.learning_rate):
            raise ValueError("teacher.epochs and teacher.learning_rate configure teacher.train")
        if self.train is not None and not _BUILTIN_MODEL.match(self.train):
            raise ValueError(
                f"teacher.train {self.train!r} is not a built-in size (e.g. builtin:small); "
                "for a model of your own give teacher.model"
            )
        return self


class Distillation(ConfigModel):
    """On-policy distillation (``estimator: opd``): a teacher scores every token the student
    sampled, and each token's advantage is ``coef`` x (teacher log-probability - student
    log-probability): the student is pulled toward the teacher on its own trajectories."""

    teacher: OpdTeacher | None = Field(
        default=None, description="The teacher: {train: builtin:<size>} or {model: ...}."
    )
    coef: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Scale of the teacher-minus-student log-ratio that is the advantage.",
    )


class StepCurriculum(ConfigModel):
    """A step budget that grows as the policy learns: RL steps run with the first of
    ``max_steps`` as the rollouts' step budget, and move to the next one once the training
    reward saturates, i.e. the share of a step's scored rollouts that succeeded is at or above
    ``saturation`` for ``patience`` steps in a row. Evaluation runs with the last one."""

    max_steps: list[int] = Field(
        min_length=2, description="The step budgets in the order RL uses them, e.g. [15, 30]."
    )
    saturation: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Share of a step's scored rollouts that succeeded at which the training "
        "reward counts as saturated.",
    )
    patience: int = Field(
        default=1, ge=1, description="Saturated steps in a row before the budget grows."
    )

    @field_validator("max_steps")
    @classmethod
    def _growing(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value):
            raise ValueError("every step budget must be at least 1")
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"the step budgets must grow, got {value}")
        return value

    def next_level(self, level: int, streak: int, success_share: float | None) -> tuple[int, int]:
        """(level, streak) after an RL step at budget ``max_steps[level]`` whose scored
        rollouts succeeded in ``success_share`` of cases (None: none was scored, which neither
        counts toward saturation nor breaks a streak)."""
        if success_share is None:
            return level, streak
        streak = streak + 1 if success_share >= self.saturation else 0
        if streak >= self.patience and level + 1 < len(self.max_steps):
            return level + 1, 0
        return level, streak


SCRIPTED_RUBRIC_IDS = ("R1", "R2", "R3", "R4", "R5", "R6", "R7")
"""The dimensions the reward service's scripted rubric grader grades: its default rubric's."""
_JUDGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class RubricDimension(ConfigModel):
    """One dimension of the rubric RL grades trajectories on."""

    id: str = Field(min_length=1, description="Its id, e.g. R1.")
    text: str = Field(
        default="",
        description="What the grader looks for; empty: the text of the reward service's "
        "configured rubric dimension of this id.",
    )
    weight: float = Field(ge=0, le=1, allow_inf_nan=False, description="Share of the total.")


class RlRubric(ConfigModel):
    """Rubric-based process reward: each scored RL trajectory is also graded by orchard-reward's
    GradeRubric, and trains on ``(1 - weight) x outcome + weight x rubric``. Success, resolve
    counts and sampling stay on the outcome; a trajectory the judge cannot grade is left out of
    training, never scored 0."""

    weight: float = Field(
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="The rubric's share of the reward trained on, in (0, 1]; 1: the rubric alone.",
    )
    judge: str = Field(
        description='"builtin:scripted" (the reward service\'s scripted rubric grader, a '
        'deterministic stand-in for a judge model, named "scripted" there) or the name of a '
        "judge configured in orchard-reward (its judges.<name>).",
    )
    dimensions: list[RubricDimension] | None = Field(
        default=None,
        description="The rubric; weights sum to 1. Default: the reward service's configured "
        "rubric (R1 patch quality 0.15, R2-R7 self-verification).",
    )

    @field_validator("judge")
    @classmethod
    def _judge(cls, value: str) -> str:
        if value == "builtin:scripted":
            return value
        if urlparse(value).scheme in ("http", "https"):
            raise ValueError(
                "name a judge configured in orchard-reward (add it to its judges.<name> with "
                "this base_url), not a URL; or builtin:scripted"
            )
        if value.startswith("builtin:"):
            raise ValueError(
                f"{value!r} grades no rubric: the built-in rubric judge is builtin:scripted"
            )
        if not _JUDGE_NAME.match(value):
            raise ValueError(
                "neither builtin:scripted nor a judge name (letters, digits, '.', '_', '-'; "
                "as configured in orchard-reward's judges)"
            )
        return value

    @field_validator("dimensions")
    @classmethod
    def _rubric(cls, value: list[RubricDimension] | None) -> list[RubricDimension] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("give at least one dimension, or leave dimensions out")
        ids = [d.id for d in value]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"dimension {', '.join(twice)} appears twice")
        total = math.fsum(d.weight for d in value)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            listing = ", ".join(f"{d.id}={d.weight:g}" for d in value)
            raise ValueError(
                f"the dimensions' weights must sum to 1, they sum to {total:g} ({listing})"
            )
        return value

    @model_validator(mode="after")
    def _scripted_grades_its_own(self) -> RlRubric:
        if self.judge == "builtin:scripted" and self.dimensions:
            unknown = [d.id for d in self.dimensions if d.id not in SCRIPTED_RUBRIC_IDS]
            if unknown:
                raise ValueError(
                    f"builtin:scripted grades the default rubric's dimensions "
                    f"({', '.join(SCRIPTED_RUBRIC_IDS)}) only, not {', '.join(unknown)}: use "
                    "those ids or name a model judge"
                )
        return self

    @property
    def service_judge(self) -> str:
        """The judge's name in orchard-reward (``scripted`` for builtin:scripted)."""
        return "scripted" if self.judge == "builtin:scripted" else self.judge


class Rl(Stage):
    """Policy-gradient training on the RL tasks, starting from the SFT model."""

    steps: int = Field(default=4, ge=1)
    estimator: Literal["grpo", "ppo", "opd"] = Field(
        default="grpo",
        description="grpo: group-relative advantages over the (task, harness) groups' "
        "trajectories; ppo: per-token advantages from a value model the stage pretrains on "
        "the first step's rollouts (`critic`); opd: on-policy distillation, per-token "
        "advantages from a teacher's log-probabilities of the student's own samples "
        "(`distillation`), no reward needed (every group trains).",
    )
    critic: Critic = Critic()
    distillation: Distillation | None = Field(
        default=None, description="The teacher of estimator: opd and its coefficient."
    )
    groups_per_step: int = Field(default=4, ge=1)
    learning_rate: float = Field(default=5e-4, gt=0, lt=1)
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    clip_high: float = Field(default=0.28, gt=0, lt=10)
    kl_coef: float = Field(default=0.0, ge=0)
    max_staleness: int = Field(
        default=1, ge=0, description="Oldest weight version a batch may use."
    )
    max_sequence_tokens: int = Field(
        default=0,
        ge=0,
        description="Most tokens of one trajectory a training step reads (0: all): a longer "
        "one keeps its last tokens (its final turns), so an agent program's long prompt costs "
        "no more than this.",
    )
    sampler: Sampler = Sampler()
    rubric: RlRubric | None = Field(
        default=None,
        description="Rubric-based process reward: {weight, judge, dimensions}; each trajectory "
        "trains on (1 - weight) x outcome + weight x rubric.",
    )
    budget: Budget = Budget()
    curriculum: StepCurriculum | None = Field(
        default=None,
        description="Grow the rollouts' step budget once the training reward saturates "
        "(it then sets budget.max_steps, step by step).",
    )
    from_base: bool = Field(
        default=False,
        description="Also run RL from the base model, with the same settings, tasks and "
        'seeds, evaluated as "rl-base" beside "rl" (RL from the SFT model): what SFT adds '
        "before RL. Needs stages.sft.",
    )
    select: Literal["validation", "last"] = Field(
        default="validation",
        description=(
            "Which weights the stage hands on. validation: the starting model and every RL "
            "version are run greedily on the RL tasks, and the best wins (a tie goes to the "
            "later version), so RL never hands on weights that do worse than its start on "
            "the tasks it trained on. last: the last version, unchecked."
        ),
    )

    @model_validator(mode="after")
    def _critic_needs_ppo(self) -> Rl:
        if "critic" in self.model_fields_set and self.estimator != "ppo":
            raise ValueError("rl.critic configures the value model of estimator: ppo")
        if self.distillation is not None and self.estimator != "opd":
            raise ValueError("rl.distillation configures the teacher of estimator: opd")
        if self.estimator == "opd":
            if self.distillation is None or self.distillation.teacher is None:
                raise ValueError(
                    "estimator: opd needs a teacher: give rl.distillation.teacher, "
                    "{train: builtin:small} (trained by the recipe on its curated teacher "
                    "trajectories) or {model: <artifact URL or model folder>}"
                )
            if self.sampler.kind != "fixed":
                raise ValueError(
                    "estimator: opd learns from every group, successes and failures alike: "
                    "set rl.sampler.kind: fixed (bar would spend rollouts up to n_max looking "
                    "for groups of mixed outcome)"
                )
        if self.curriculum is not None and "max_steps" in self.budget.model_fields_set:
            raise ValueError(
                "rl.curriculum.max_steps sets the step budget: leave out rl.budget.max_steps"
            )
        return self

    @model_validator(mode="after")
    def _rubric_shapes_a_reward(self) -> Rl:
        if self.rubric is not None and self.estimator == "opd":
            raise ValueError(
                "rl.rubric shapes the reward the policy trains on; estimator: opd trains on "
                "none: leave one of them out"
            )
        return self

    def budget_at(self, level: int) -> Budget:
        """The rollout budget at curriculum level ``level`` (the budget as given without a
        curriculum)."""
        if self.curriculum is None:
            return self.budget
        steps = self.curriculum.max_steps[min(level, len(self.curriculum.max_steps) - 1)]
        return self.budget.model_copy(update={"max_steps": steps})

    @property
    def final_budget(self) -> Budget:
        """The budget evaluation runs with: the curriculum's last step budget, if any."""
        return self.budget_at(len(self.curriculum.max_steps) - 1 if self.curriculum else 0)


class Evaluate(Stage):
    """Held-out resolve rate of each model, on every harness of the recipe and on
    ``harnesses`` (evaluated only: never used in collection or training); with
    ``attempts_per_task`` k > 1 the report gives pass@k and pass^k per harness."""

    attempts_per_task: int = Field(default=1, ge=1, le=64)
    harnesses: list[str] = Field(
        default=[],
        description="Harnesses the models are evaluated on besides the recipe's own (held "
        "out from training: how the model does in an agent program it never trained in).",
    )
    confidence: float = Field(
        default=0.95, gt=0, lt=1, description="Level of the intervals reported."
    )
    temperature: float = Field(default=0.0, ge=0)

    @field_validator("harnesses")
    @classmethod
    def _harnesses(cls, value: list[str]) -> list[str]:
        return _check_harnesses(value)


class Rerank(Stage):
    """Best-of-k by a value model: a small model trained on rollouts of earlier policies (the
    teacher's, the RL steps') predicts whether a trajectory succeeded; the evaluated policy
    makes ``k`` attempts at every held-out task and the one it scores highest is kept. The
    report sets pass@1, random-of-k, value-reranked and oracle pass@k side by side."""

    enabled: bool = False
    k: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Attempts per held-out task (and harness) to pick from, sampled at the "
        "evaluate stage's temperature; the evaluate stage's own attempts are reused when it "
        "made at least k.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="The evaluated model whose attempts are reranked (base, sft, rl, rl-base). "
        "Default: the run's last model of its main line (rl, else sft, else base).",
    )
    sources: list[Literal["collect", "rl", "evaluate"]] = Field(
        default=["collect", "rl"],
        description="Which rollouts of earlier policies the value model trains on, in this run "
        "and in each ``history`` run: collect (the teacher's), rl (the RL steps' groups and "
        "validation runs, both lines), evaluate (the other models' held-out attempts: the same "
        "tasks as the reranked ones, so off by default). Rollouts of the reranked model's own "
        "weights are never used.",
    )
    history: list[Path] = Field(
        default=[],
        description="Run folders of earlier runs whose rollouts join the history; relative to "
        "the recipe's folder.",
    )
    ngrams: int = Field(
        default=2, ge=1, le=3, description="Longest word n-gram of the value model's features."
    )
    buckets: int = Field(
        default=2**18,
        ge=2**8,
        le=2**22,
        description="Size of the hashed feature space (one weight per bucket).",
    )
    l2: float = Field(
        default=1e-3, gt=0, lt=10, description="L2 penalty of the logistic regression."
    )
    validation_fraction: float = Field(
        default=0.25,
        gt=0,
        lt=1,
        description="Share of the history's tasks (whole tasks, drawn with the run's seed) held "
        "out to measure the value model before it is refitted on all of the history.",
    )

    @field_validator("sources")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a source is named twice")
        return value

    @model_validator(mode="after")
    def _has_history(self) -> Rerank:
        if self.enabled and not self.sources and not self.history:
            raise ValueError("no history: give sources, history runs, or both")
        return self


class Stages(ConfigModel):
    """The stages; each one left out keeps its defaults."""

    collect: Collect = Collect()
    credit: Credit = Credit()
    curate: Curate = Curate()
    sft: Sft = Sft()
    rl: Rl = Rl()
    evaluate: Evaluate = Evaluate()
    rerank: Rerank = Rerank()

    def enabled(self) -> list[str]:
        """Names of the stages that run, in order."""
        return [name for name in STAGES if getattr(self, name).enabled]


class Recipe(ConfigModel):
    """A whole recipe."""

    name: str = Field(description="Names the run and its output folder.")
    tasks: Tasks
    harnesses: list[str] = Field(default=["builtin:swe"], min_length=1)
    success_threshold: float | None = Field(
        default=None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="The reward at or above which a rollout succeeded, in [0, 1]: what BAR "
        "counts as a success, what credit assignment treats as failed (below it), which "
        "trajectories SFT trains on whole and curation compares, and what evaluation counts as "
        f"resolved. Default: the task suite's pass mark (Claw: {CLAW_PASS_MARK}), else "
        f"{DEFAULT_SUCCESS_THRESHOLD}.",
    )
    teacher: Teacher = Teacher()
    student: Student = Student()
    stages: Stages = Stages()
    output_dir: Path | None = Field(
        default=None,
        description="Where stage outputs go; relative to the recipe's folder. Default: "
        "runs/<name> under the folder the run starts in.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                "not a run name: use 1-63 lowercase letters, digits, '.', '_' or '-', starting "
                "with a letter or digit (e.g. swe-small)"
            )
        return value

    @field_validator("harnesses")
    @classmethod
    def _harnesses(cls, value: list[str]) -> list[str]:
        return _check_harnesses(value)

    @property
    def pass_mark(self) -> float:
        """The run's one success threshold: ``success_threshold`` when given, else the task
        suite's pass mark, else :data:`DEFAULT_SUCCESS_THRESHOLD`. A rollout succeeded when its
        reward is at or above it; every stage sends it to the services."""
        if self.success_threshold is not None:
            return self.success_threshold
        suite = self.tasks.pass_mark
        return DEFAULT_SUCCESS_THRESHOLD if suite is None else suite

    @property
    def evaluated_harnesses(self) -> list[str]:
        """Every harness the evaluate stage runs: the recipe's, then the held-out ones."""
        return [*self.harnesses, *self.stages.evaluate.harnesses]

    @model_validator(mode="after")
    def _stages_fit(self) -> Recipe:
        stages = self.stages
        if not stages.evaluate.enabled and not stages.sft.enabled and not stages.rl.enabled:
            raise ValueError("nothing to do: enable at least one of sft, rl and evaluate")
        if stages.sft.enabled and not stages.collect.enabled:
            raise ValueError("stages.sft needs stages.collect (SFT trains on what it collects)")
        if stages.rl.enabled and stages.rl.from_base and not stages.sft.enabled:
            raise ValueError(
                "stages.rl.from_base runs RL from the base model beside RL from the SFT model: "
                "it needs stages.sft (without SFT, RL starts from the base model anyway)"
            )
        teacher = stages.rl.distillation.teacher if stages.rl.distillation else None
        if stages.rl.enabled and teacher is not None and teacher.train is not None:
            if not (stages.collect.enabled and stages.curate.enabled):
                raise ValueError(
                    f"stages.rl.distillation.teacher.train trains {teacher.train} on the curated "
                    "teacher trajectories: it needs stages.collect and stages.curate"
                )
            if not self.student.model.startswith("builtin:"):
                raise ValueError(
                    f"stages.rl.distillation.teacher.train ({teacher.train}) has the built-in "
                    f"tokenizer, and student.model {self.student.model!r} may not: the teacher "
                    "must share the student's tokenizer; give teacher.model a model that does"
                )
        if stages.rerank.enabled and not stages.evaluate.enabled:
            raise ValueError(
                "stages.rerank reranks the evaluated models' attempts: it needs stages.evaluate"
            )
        held_out = set(self.harnesses) & set(stages.evaluate.harnesses)
        if held_out:
            raise ValueError(
                f"stages.evaluate.harnesses names {', '.join(sorted(held_out))}, which the recipe "
                "trains with: list there only harnesses held out from training"
            )
        browsers = [h for h in self.evaluated_harnesses if h in BROWSER_HARNESSES]
        others = [h for h in self.evaluated_harnesses if h not in BROWSER_HARNESSES]
        if self.tasks.gui is not None and others:
            raise ValueError(
                f"GUI tasks run only in the browser loops ({', '.join(BROWSER_HARNESSES)}); "
                f"this recipe names {', '.join(others)}"
            )
        if self.tasks.gui is None and browsers:
            raise ValueError(
                f"{', '.join(browsers)} drive the GUI suite's browser episodes: give tasks.gui"
            )
        if self.tasks.gui is not None and stages.credit.enabled and stages.collect.enabled:
            raise ValueError(
                "stages.credit judges software and assistant trajectories, not browser "
                "episodes: set stages.credit.enabled: false for tasks.gui"
            )
        programs = [h for h in self.harnesses if h.startswith("program:")]
        if programs and stages.credit.enabled and stages.collect.enabled:
            raise ValueError(
                f"stages.credit needs the teacher's conversations, which agent programs "
                f"({', '.join(programs)}) do not give: set stages.credit.enabled: false"
            )
        if self.tasks.generated is not None:
            split = self.tasks.split
            if stages.rl.enabled and split.rl == 0:
                raise ValueError("stages.rl is on but tasks.split.rl is 0")
            if stages.collect.enabled and split.sft == 0:
                raise ValueError("stages.collect is on but tasks.split.sft is 0")
        if self.tasks.jsonl is not None:
            if stages.collect.enabled and self.tasks.jsonl.sft is None:
                raise ValueError("stages.collect is on but tasks.jsonl.sft is not given")
            if stages.rl.enabled and self.tasks.jsonl.rl is None:
                raise ValueError("stages.rl is on but tasks.jsonl.rl is not given")
        return self

    def resolve_paths(self, base: Path, workdir: Path) -> Recipe:
        """The recipe with relative paths taken from ``base`` (the recipe's folder) and the
        default output folder under ``workdir``."""

        def at(path: Path | None) -> Path | None:
            return None if path is None or path.is_absolute() else base / path

        update: dict[str, object] = {"output_dir": at(self.output_dir) or self.output_dir}
        if self.output_dir is None:
            update["output_dir"] = workdir / "runs" / self.name
        if self.tasks.jsonl is not None:
            jsonl = self.tasks.jsonl
            files = {
                split: at(getattr(jsonl, split)) or getattr(jsonl, split)
                for split in ("sft", "rl", "evaluate")
            }
            update["tasks"] = self.tasks.model_copy(
                update={"jsonl": jsonl.model_copy(update=files)}
            )
        rerank = self.stages.rerank
        if rerank.history:
            runs = [at(run) or run for run in rerank.history]
            update["stages"] = self.stages.model_copy(
                update={"rerank": rerank.model_copy(update={"history": runs})}
            )
        return self.model_copy(update=update)


def load_recipe(path: str | os.PathLike[str], workdir: Path | None = None) -> Recipe:
    """The recipe in ``path``, validated, with relative paths taken from its folder; without an
    ``output_dir`` its outputs go to ``runs/<name>`` under ``workdir`` (default: the current
    folder).

    Raises :class:`orchard.core.config.ConfigError` naming every problem with its line.
    """
    path = Path(path)
    base = path.resolve().parent
    return load_document(Recipe, path).resolve_paths(base, (workdir or Path.cwd()).resolve())


BUILTIN_RECIPES = ("swe", "claw", "gui")
"""The recipes shipped with the SDK: ``swe`` is the one ``make demo`` runs."""


def builtin_recipe(name: str = "swe") -> Path:
    """A shipped recipe's file. ``swe`` (what ``make demo`` runs): the built-in
        software-engineering suite, the scripted teacher, the tiny student, every stage, sized to
        finish on two CPU cores. ``claw``: the Claw suite through unmodified agent programs (two to
        train with, a third held out), a long-context student (``make demo-claw``). ``gui``: the GUI
    suite's web tasks in browser sandboxes, the page as text for the CPU student, a step-budget
    curriculum in RL, RL from the SFT model and from the base model (``make demo-gui``)."""
    if name not in BUILTIN_RECIPES:
        raise ValueError(f"no built-in recipe {name!r}: there are {', '.join(BUILTIN_RECIPES)}")
    return Path(str(resources.files("orchard.sdk").joinpath(f"recipes/builtin-{name}.yaml")))
