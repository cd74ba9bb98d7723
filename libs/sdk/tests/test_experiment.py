"""Experiment files: settings laid over a recipe per arm, run names, and every error a person
can act on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchard.core.config import ConfigError
from orchard.sdk.cli import main
from orchard.sdk.experiment import arm_recipe, expand_dotted, load_experiment

EXPERIMENT = {
    "name": "learning",
    "recipe": "builtin:swe",
    "settings": {"tasks.builtin.count": 40, "stages": {"rl": {"steps": 5}}},
    "seeds": [0, 1],
    "arms": [
        {"name": "main", "about": "the recipe", "settings": {"stages.rl.from_base": True}},
        {"name": "resolved-only", "settings": {"stages.credit.enabled": False}},
        {"name": "fixed-n", "settings": {"stages.rl.sampler.kind": "fixed"}},
        {"name": "bigger", "settings": {"student.model": "builtin:small"}},
    ],
    "comparisons": [
        {"name": "credit vs resolved-only", "a": "main/sft", "b": "resolved-only/sft"},
        {"name": "bar vs fixed", "a": "main/rl", "b": "fixed-n/rl", "metric": "balanced-groups"},
    ],
}


def _write(folder: Path, data: dict[str, object]) -> Path:
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_dotted_keys_nest_and_merge() -> None:
    assert expand_dotted({"a.b.c": 1, "a": {"b": {"d": 2}}, "e": 3}) == {
        "a": {"b": {"c": 1, "d": 2}},
        "e": 3,
    }
    with pytest.raises(ValueError, match="empty part"):
        expand_dotted({"a..b": 1})


def test_each_arm_gets_the_recipe_with_the_experiments_then_its_own_settings(
    tmp_path: Path,
) -> None:
    experiment, out = load_experiment(_write(tmp_path, EXPERIMENT), workdir=tmp_path)
    assert out == tmp_path.resolve() / "runs" / "experiments" / "learning"
    base = tmp_path
    main_arm = arm_recipe(experiment, experiment.arm("main"), 0, base=base, output_dir=out)
    assert main_arm.tasks.builtin is not None and main_arm.tasks.builtin.count == 40
    assert main_arm.stages.rl.steps == 5 and main_arm.stages.rl.from_base
    # What the built-in recipe sets and nobody changed stays.
    assert main_arm.stages.sft.epochs > 1 and main_arm.stages.credit.enabled
    assert main_arm.output_dir == out / "main" / "seed-0"
    fixed = arm_recipe(experiment, experiment.arm("fixed-n"), 0, base=base, output_dir=out)
    assert fixed.stages.rl.sampler.kind == "fixed" and not fixed.stages.rl.from_base
    # Arms of one seed with the same tasks, harnesses, teacher and student share the registry
    # models (their copied stages name weights that exist there); another student or another
    # seed does not.
    assert fixed.name == main_arm.name and fixed.name.startswith("learning-s0-")
    bigger = arm_recipe(experiment, experiment.arm("bigger"), 0, base=base, output_dir=out)
    assert bigger.name != main_arm.name
    again = arm_recipe(experiment, experiment.arm("main"), 1, base=base, output_dir=out)
    assert again.name != main_arm.name and again.output_dir == out / "main" / "seed-1"


def test_a_recipe_file_beside_the_experiment(tmp_path: Path) -> None:
    (tmp_path / "small.yaml").write_text(
        yaml.safe_dump({"name": "small", "tasks": {"builtin": {"count": 12}}}), encoding="utf-8"
    )
    data = {**EXPERIMENT, "recipe": "small.yaml", "settings": {}, "output_dir": "out"}
    experiment, out = load_experiment(_write(tmp_path, data))
    assert out == tmp_path / "out"
    recipe = arm_recipe(experiment, experiment.arm("main"), 1, base=tmp_path, output_dir=out)
    assert recipe.tasks.builtin is not None and recipe.tasks.builtin.count == 12


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"arms": [{"name": "main", "settings": {"stages.sft.epochs": 0}}]},
            "arm main of experiment learning",
        ),
        ({"arms": [{"name": "main", "settings": {"name": "x"}}]}, "cannot be set per arm"),
        ({"arms": [{"name": "a"}, {"name": "a"}]}, "listed twice"),
        ({"seeds": [1, 1]}, "a seed is listed twice"),
        ({"seeds": []}, "seeds"),
        (
            {
                "arms": [{"name": "a"}],
                "comparisons": [{"name": "c", "a": "a/sft", "b": "b/sft"}],
            },
            "names arm 'b'",
        ),
        ({"arms": [{"name": "a"}], "comparisons": [{"name": "c", "a": "a", "b": "a/sft"}]},
         "<arm>/<model>"),
        ({"recipe": "missing.yaml"}, "missing.yaml"),
        ({"arms": [{"name": "Main"}]}, "not an arm name"),
        ({"arms": [{"name": "a", "settings": {"stages.rl.sampler.kind": "both"}}]}, "kind"),
    ],
)  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, change: dict[str, object], message: str) -> None:
    data = {**EXPERIMENT, "comparisons": [], **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_experiment(_write(tmp_path, data), workdir=tmp_path)


def test_orchard_experiment_check_lists_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, EXPERIMENT)
    assert main(["experiment", "check", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "resolved-only" in shown and "stages.credit.enabled=False" in shown
    assert "compare: credit vs resolved-only: main/sft vs resolved-only/sft" in shown
    bad = _write(tmp_path, {**EXPERIMENT, "seeds": [2, 2]})
    assert main(["experiment", "check", str(bad)]) == 2
    assert "a seed is listed twice" in capsys.readouterr().err


def test_orchard_experiment_run_names_an_unknown_arm_or_seed_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, EXPERIMENT)
    assert main(["experiment", "run", str(path), "--arm", "nope", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert "has no arm or seed nope, 7" in err and "its arms are main, resolved-only" in err


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_the_shipped_experiment_files_load(path: Path, tmp_path: Path) -> None:
    experiment, _ = load_experiment(path, workdir=tmp_path)
    assert len(experiment.arms) >= 2 and experiment.comparisons
