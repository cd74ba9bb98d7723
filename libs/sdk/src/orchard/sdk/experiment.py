"""Experiments: one recipe run under several settings ("arms") and several seeds, compared.

An experiment file names a recipe, the settings every run of it gets, the seeds, the arms (each
a name and the settings it changes) and the comparisons to report::

    name: swe-learning
    recipe: builtin:swe                 # or a recipe file, relative to this file
    settings:                           # laid over the recipe for every arm
      tasks.builtin.count: 400
      stages.rl.steps: 20
    seeds: [0, 1, 2]
    arms:
      - name: main
        about: credit-assignment SFT, BAR RL from the SFT model and from the base model
        settings: {stages.rl.from_base: true}
      - name: resolved-only
        about: SFT on resolved trajectories only
        settings: {stages.credit.enabled: false}
    comparisons:
      - name: credit assignment vs resolved-only SFT
        a: main/sft
        b: resolved-only/sft

Settings are nested mappings or dotted keys (``stages.rl.steps: 20`` is ``{stages: {rl:
{steps: 20}}}``); an arm's settings are laid over the experiment's, which are laid over the
recipe's. Every arm's recipe is validated when the file loads, each problem naming the arm.
A comparison names two (arm, model) pairs; the models are those a run evaluates (``base``,
``sft``, ``rl``, ``rl-base``, ...). The runner is ``orchard.recipes.experiment``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from orchard.core.config import (
    ConfigError,
    ConfigModel,
    deep_merge,
    load_document,
    validate_document,
)
from orchard.sdk.recipe import _NAME, BUILTIN_RECIPES, Recipe, builtin_recipe

__all__ = [
    "Arm",
    "Comparison",
    "Experiment",
    "arm_recipe",
    "expand_dotted",
    "load_experiment",
    "recipe_file",
]


def expand_dotted(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with dotted keys made nested (``a.b: 1`` is ``{a: {b: 1}}``), recursively;
    a key given both ways merges."""
    out: dict[str, Any] = {}
    for key, given in settings.items():
        value = expand_dotted(given) if isinstance(given, dict) else given
        parts = str(key).split(".")
        if any(not part for part in parts):
            raise ValueError(f"{key!r} is not a setting: empty part between dots")
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        out = deep_merge(out, {parts[0]: nested})
    return out


def _checked_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            f"not {what}: use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return value


class Arm(ConfigModel):
    """One setting of the experiment: the recipe with ``settings`` laid over it."""

    name: str = Field(description="Names the arm, its runs' folders and its rows in the report.")
    about: str = Field(default="", description="What the arm is, in a line, for the report.")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Recipe settings this arm changes (nested or dotted)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _checked_name(value, "an arm name")

    @field_validator("settings")
    @classmethod
    def _settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        expanded = expand_dotted(value)
        fixed = sorted({"name", "output_dir"} & set(expanded))
        if fixed:
            raise ValueError(
                f"{', '.join(fixed)} cannot be set per arm: the experiment names its runs and "
                "their folders"
            )
        return expanded


class Comparison(ConfigModel):
    """Two evaluated models side by side: ``a`` against ``b``, each ``<arm>/<model>``."""

    name: str = Field(min_length=1, description="What is compared, in a line.")
    a: str = Field(description="<arm>/<model>, e.g. main/sft.")
    b: str = Field(description="<arm>/<model>, e.g. resolved-only/sft.")
    metric: str = Field(
        default="held-out",
        pattern="^(held-out|balanced-groups)$",
        description="held-out: held-out resolve rate (paired by task and seed); "
        "balanced-groups: RL groups with signal per 1,000 rollouts (the models must be rl "
        "or rl-base).",
    )

    domain: Literal["swe", "claw"] | None = Field(
        default=None,
        description="Compare on the held-out tasks of this domain only (a run training on the "
        "software and Claw suites together against one of a single suite).",
    )

    @field_validator("a", "b")
    @classmethod
    def _pair(cls, value: str) -> str:
        arm, sep, model = value.partition("/")
        if not sep or not arm or not model:
            raise ValueError(f"{value!r}: name an arm and a model, as <arm>/<model> (main/sft)")
        return value


class Experiment(ConfigModel):
    """A whole experiment file."""

    name: str = Field(description="Names the experiment, its runs and its output folder.")
    recipe: str = Field(
        default="builtin:swe",
        description=f"builtin:<{'|'.join(BUILTIN_RECIPES)}> or a recipe file (relative to the "
        "experiment's folder).",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Recipe settings every arm gets (nested or dotted)."
    )
    seeds: list[int] = Field(default=[0], min_length=1, description="Each arm runs once per seed.")
    arms: list[Arm] = Field(min_length=1)
    comparisons: list[Comparison] = Field(default_factory=list)
    confidence: float = Field(default=0.95, gt=0, lt=1, description="Of every interval.")
    output_dir: Path | None = Field(
        default=None,
        description="Where the runs and the report go; relative to the experiment's folder. "
        "Default: runs/experiments/<name> under the folder the command starts in.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _checked_name(value, "an experiment name")

    @field_validator("settings")
    @classmethod
    def _settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        return Arm._settings(value)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("a seed is listed twice")
        if any(seed < 0 for seed in value):
            raise ValueError("seeds are whole numbers from 0")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Experiment:
        names = [arm.name for arm in self.arms]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"arm {', '.join(twice)} is listed twice")
        for comparison in self.comparisons:
            for side in (comparison.a, comparison.b):
                arm = side.partition("/")[0]
                if arm not in names:
                    raise ValueError(
                        f"comparison {comparison.name!r} names arm {arm!r}; the arms are "
                        f"{', '.join(names)}"
                    )
        return self

    def arm(self, name: str) -> Arm:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(name)


def recipe_file(experiment: Experiment, base: Path) -> Path:
    """The recipe file the experiment names, a relative path taken from ``base``."""
    if experiment.recipe.startswith("builtin:"):
        return builtin_recipe(experiment.recipe.removeprefix("builtin:"))
    path = Path(experiment.recipe)
    return path if path.is_absolute() else base / path


def run_name(experiment: Experiment, seed: int, shared: dict[str, Any]) -> str:
    """The recipe name of a run: the experiment's, the seed, and a digest of what decides the
    student's weights' lineage in the registry (tasks, harnesses, teacher, student), so arms of
    one seed that share those share the registry models (and so stages copied between them
    name weights that exist), and arms that do not never mix their versions."""
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:6]
    stem = f"{experiment.name}"[: 63 - len(f"-s{seed}-{digest}")]
    return f"{stem}-s{seed}-{digest}"


REGISTRY_KEYS = ("tasks", "harnesses", "teacher", "student")
"""The recipe sections whose values name a run's registry models (see `run_name`)."""


def arm_recipe(
    experiment: Experiment, arm: Arm, seed: int, *, base: Path, output_dir: Path
) -> Recipe:
    """The recipe of ``arm``'s run with ``seed``: the recipe file with the experiment's
    settings, then the arm's, laid over it, named by `run_name`, its outputs in
    ``output_dir/<arm>/seed-<seed>``. Raises `ConfigError` naming the arm."""
    path = recipe_file(experiment, base)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"recipe {path}: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"recipe {path}: expected a mapping of keys at the top level"])
    merged = deep_merge(deep_merge(data, experiment.settings), arm.settings)
    # Validated once as given, so the registry digest reads defaults filled in.
    source = f"arm {arm.name} of experiment {experiment.name}"
    probe = validate_document(Recipe, {**merged, "output_dir": None}, source)
    shared = {key: json.loads(probe.model_dump_json(include={key}))[key] for key in REGISTRY_KEYS}
    merged["name"] = run_name(experiment, seed, shared)
    merged["output_dir"] = None
    recipe = validate_document(Recipe, merged, source)
    recipe_base = path.resolve().parent
    return recipe.resolve_paths(recipe_base, recipe_base).model_copy(
        update={"output_dir": output_dir / arm.name / f"seed-{seed}"}
    )


def load_experiment(
    path: str | os.PathLike[str], workdir: Path | None = None
) -> tuple[Experiment, Path]:
    """The experiment in ``path``, validated with every arm's recipe, and its output folder
    (``output_dir`` from the file's folder; default ``runs/experiments/<name>`` under
    ``workdir``, default the current folder). Raises `ConfigError` naming every problem."""
    path = Path(path)
    experiment = load_document(Experiment, path)
    base = path.resolve().parent
    if experiment.output_dir is None:
        out = (workdir or Path.cwd()).resolve() / "runs" / "experiments" / experiment.name
    else:
        out = (
            experiment.output_dir
            if experiment.output_dir.is_absolute()
            else base / experiment.output_dir
        )
    problems: list[str] = []
    for arm in experiment.arms:
        try:
            arm_recipe(experiment, arm, experiment.seeds[0], base=base, output_dir=out)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return experiment, out
