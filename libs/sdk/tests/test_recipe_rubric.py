"""`stages.rl.rubric`: the rubric process reward's settings, and the mistakes named with their
key and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.core.config import ConfigError
from orchard.sdk.recipe import SCRIPTED_RUBRIC_IDS, load_recipe

HEAD = "name: rpr\ntasks: {builtin: {count: 12}}\nstages:\n  rl:\n"


def _write(tmp_path: Path, rl: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(HEAD + rl)
    return path


def _problems(tmp_path: Path, rl: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_recipe(_write(tmp_path, rl), workdir=tmp_path)
    return list(caught.value.problems)


def test_rubric_is_off_unless_given_and_names_the_service_judge(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, "    steps: 2\n"), workdir=tmp_path)
    assert recipe.stages.rl.rubric is None
    recipe = load_recipe(
        _write(tmp_path, "    rubric: {weight: 0.3, judge: builtin:scripted}\n"), workdir=tmp_path
    )
    rubric = recipe.stages.rl.rubric
    assert rubric is not None and rubric.weight == 0.3 and rubric.dimensions is None
    assert rubric.service_judge == "scripted"
    recipe = load_recipe(
        _write(
            tmp_path,
            "    rubric:\n      weight: 1\n      judge: hosted\n      dimensions:\n"
            "        - {id: R1, weight: 0.25}\n"
            "        - {id: Q9, text: The agent explained its fix., weight: 0.75}\n",
        ),
        workdir=tmp_path,
    )
    rubric = recipe.stages.rl.rubric
    assert rubric is not None and rubric.service_judge == "hosted"
    assert [(d.id, d.text, d.weight) for d in rubric.dimensions or ()] == [
        ("R1", "", 0.25),
        ("Q9", "The agent explained its fix.", 0.75),
    ]


@pytest.mark.parametrize(
    ("rl", "message"),
    [
        (
            "    rubric: {weight: 0, judge: builtin:scripted}\n",
            "weight: Input should be greater than 0",
        ),
        (
            "    rubric: {weight: 1.5, judge: builtin:scripted}\n",
            "weight: Input should be less than",
        ),
        ("    rubric: {weight: 0.3}\n", "rubric.judge: Field required"),
        ("    rubric: {judge: builtin:scripted}\n", "rubric.weight: Field required"),
        (
            "    rubric: {weight: 0.3, judge: 'http://127.0.0.1:8000/v1'}\n",
            "name a judge configured in orchard-reward",
        ),
        ("    rubric: {weight: 0.3, judge: builtin:gui-state}\n", "grades no rubric"),
        ("    rubric: {weight: 0.3, judge: 'my judge'}\n", "neither builtin:scripted nor a judge"),
        (
            "    rubric: {weight: 0.3, judge: hosted, dimensions: [{id: R1, weight: 0.5},"
            " {id: R2, weight: 0.4}]}\n",
            "weights must sum to 1, they sum to 0.9 (R1=0.5, R2=0.4)",
        ),
        (
            "    rubric: {weight: 0.3, judge: hosted, dimensions: [{id: R1, weight: 0.5},"
            " {id: R1, weight: 0.5}]}\n",
            "dimension R1 appears twice",
        ),
        ("    rubric: {weight: 0.3, judge: hosted, dimensions: []}\n", "at least one dimension"),
        (
            "    rubric: {weight: 0.3, judge: builtin:scripted, dimensions: [{id: Q9, text: x,"
            " weight: 1}]}\n",
            "builtin:scripted grades the default rubric's dimensions (R1, R2",
        ),
        (
            "    rubric: {weight: 0.3, judge: builtin:scripted, wieght: 2}\n",
            "rubric.wieght: unknown key; did you mean 'weight'?",
        ),
    ],
)
def test_mistakes_are_named_with_what_to_do(tmp_path: Path, rl: str, message: str) -> None:
    found = _problems(tmp_path, rl)
    assert any(message in p and "line 5" in p for p in found), found


def test_the_rubric_does_not_go_with_distillation(tmp_path: Path) -> None:
    found = _problems(
        tmp_path,
        "    estimator: opd\n    sampler: {kind: fixed}\n"
        "    distillation: {teacher: {train: builtin:small}}\n"
        "    rubric: {weight: 0.3, judge: builtin:scripted}\n",
    )
    assert any("estimator: opd trains on none" in p for p in found), found


def test_the_scripted_ids_are_the_default_rubric() -> None:
    assert SCRIPTED_RUBRIC_IDS == ("R1", "R2", "R3", "R4", "R5", "R6", "R7")
