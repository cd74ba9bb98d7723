"""Recipes: the built-in one is valid, and every mistake is named with its key and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.core.config import ConfigError
from orchard.sdk.recipe import (
    BUILTIN_RECIPES,
    CLAW_PASS_MARK,
    DEFAULT_SUCCESS_THRESHOLD,
    STAGES,
    builtin_recipe,
    load_recipe,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_recipe(path)
    return list(caught.value.problems)


def test_the_builtin_recipe_is_valid_and_runs_every_stage(tmp_path: Path) -> None:
    recipe = load_recipe(builtin_recipe(), workdir=tmp_path)
    assert recipe.name == "builtin-swe"
    # every stage but rerank, which is off unless a recipe turns it on
    assert recipe.stages.enabled() == [s for s in STAGES if s != "rerank"]
    assert recipe.tasks.builtin is not None
    assert recipe.student.engine == "local"
    assert recipe.output_dir == tmp_path.resolve() / "runs" / "builtin-swe"


def test_the_builtin_claw_recipe_trains_in_two_programs_and_holds_a_third_out(
    tmp_path: Path,
) -> None:
    recipe = load_recipe(builtin_recipe("claw"), workdir=tmp_path)
    assert recipe.name == "builtin-claw"
    assert recipe.tasks.claw is not None and recipe.tasks.builtin is None
    assert len(recipe.harnesses) == 2
    assert all(h.startswith("program:") for h in recipe.harnesses)
    held_out = recipe.stages.evaluate.harnesses
    assert held_out and not set(held_out) & set(recipe.harnesses)
    assert recipe.evaluated_harnesses == [*recipe.harnesses, *held_out]
    assert recipe.stages.evaluate.attempts_per_task == 3  # pass@3 and pass^3
    assert recipe.stages.evaluate.temperature > 0  # three greedy attempts would be one
    assert "credit" not in recipe.stages.enabled()
    with pytest.raises(ValueError, match="no built-in recipe 'nope'"):
        builtin_recipe("nope")


def test_the_builtin_gui_recipe_drives_browser_episodes_with_a_step_curriculum(
    tmp_path: Path,
) -> None:
    recipe = load_recipe(builtin_recipe("gui"), workdir=tmp_path)
    assert recipe.name == "builtin-gui"
    assert recipe.tasks.gui is not None and recipe.tasks.generated is recipe.tasks.gui
    assert recipe.harnesses == ["builtin:browser-text"]
    assert "credit" not in recipe.stages.enabled()
    rl = recipe.stages.rl
    assert rl.curriculum is not None and rl.curriculum.max_steps == [15, 30]
    assert [rl.budget_at(level).max_steps for level in (0, 1, 5)] == [15, 30, 30]
    assert rl.final_budget.max_steps == 30  # evaluation runs with the last budget
    assert rl.final_budget.max_tokens == rl.budget.max_tokens
    assert rl.from_base and recipe.pass_mark == DEFAULT_SUCCESS_THRESHOLD


def test_the_step_budget_grows_after_saturated_steps_in_a_row() -> None:
    from orchard.sdk.recipe import StepCurriculum

    curriculum = StepCurriculum(max_steps=[15, 30, 45], saturation=0.75, patience=2)
    level, streak = 0, 0
    seen = []
    # unscored steps (None) neither count nor break a streak; a low step breaks it
    for share in (0.8, 0.5, 0.9, None, 1.0, 0.75, 0.75, 0.2, 1.0, 1.0, 1.0):
        level, streak = curriculum.next_level(level, streak, share)
        seen.append(level)
    assert seen == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert StepCurriculum(max_steps=[15, 30]).next_level(0, 0, 0.8) == (1, 0)
    assert StepCurriculum(max_steps=[15, 30]).next_level(0, 0, 0.79) == (0, 0)


def test_minimal_recipe_takes_defaults_and_writes_under_the_working_folder(tmp_path: Path) -> None:
    recipe = load_recipe(
        write(
            tmp_path, "name: mini\ntasks:\n  builtin: {count: 6}\nstages:\n  rl: {enabled: false}\n"
        ),
        workdir=tmp_path / "elsewhere",
    )
    assert recipe.stages.enabled() == ["collect", "credit", "curate", "sft", "evaluate"]
    assert recipe.stages.rl.sampler.n == 8  # the published defaults
    assert (recipe.stages.rl.sampler.rho_min, recipe.stages.rl.sampler.rho_max) == (0.375, 0.625)
    assert recipe.output_dir == (tmp_path / "elsewhere").resolve() / "runs" / "mini"


def test_jsonl_paths_are_relative_to_the_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(
        write(
            tmp_path,
            "name: real\ntasks:\n  jsonl: {sft: a.jsonl, rl: /data/b.jsonl, evaluate: c.jsonl}\n"
            "output_dir: out\n",
        )
    )
    assert recipe.tasks.jsonl is not None
    assert recipe.tasks.jsonl.sft == tmp_path.resolve() / "a.jsonl"
    assert recipe.tasks.jsonl.rl == Path("/data/b.jsonl")
    assert recipe.tasks.jsonl.evaluate == tmp_path.resolve() / "c.jsonl"
    assert recipe.output_dir == tmp_path.resolve() / "out"


def test_every_problem_is_reported_with_its_key_and_line(tmp_path: Path) -> None:
    found = problems(
        write(
            tmp_path,
            "\n".join(
                [
                    "name: Bad Name",  # line 1
                    "tasks:",
                    "  builtin: {count: 24}",
                    "stages:",
                    "  sft:",
                    "    learning_rate: -1",  # line 6
                    "    epoch: 3",  # line 7: a typo
                    "",
                ]
            ),
        )
    )
    assert any(
        p.startswith("name: not a run name") and "got 'Bad Name'" in p and "line 1" in p
        for p in found
    )
    assert any(
        p.startswith("stages.sft.learning_rate: Input should be greater than 0") and "line 6" in p
        for p in found
    ), found
    assert any(
        "stages.sft.epoch: unknown key; did you mean 'epochs'?" in p and "line 7" in p
        for p in found
    ), found


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tasks: {builtin: {}, split: {sft: 0.5, rl: 0.5, evaluate: 0.5}}", "sum to 1.5"),
        ("tasks: {}", "give one of tasks.builtin, tasks.claw, tasks.gui and tasks.jsonl (or"),
        ("tasks: {gui: {}}", "run only in the browser loops"),
        ("tasks: {gui: {count: 6}}", "greater than or equal to 12"),
        ("tasks: {builtin: {}}\nharnesses: [builtin:browser]", "give tasks.gui"),
        (
            "tasks: {gui: {}}\nharnesses: [builtin:browser-text]\n"
            "stages: {evaluate: {harnesses: [builtin:swe]}}",
            "this recipe names builtin:swe",
        ),
        (
            "tasks: {gui: {}}\nharnesses: [builtin:browser-text]",
            "set stages.credit.enabled: false for tasks.gui",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {curriculum: {max_steps: [15]}}}",
            "List should have at least 2 items",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {curriculum: {max_steps: [30, 15]}}}",
            "the step budgets must grow, got [30, 15]",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {curriculum: {max_steps: [0, 15]}}}",
            "every step budget must be at least 1",
        ),
        (
            "tasks: {builtin: {}}\n"
            "stages: {rl: {curriculum: {max_steps: [15, 30]}, budget: {max_steps: 9}}}",
            "leave out rl.budget.max_steps",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {curriculum: {max_steps: [1, 2], saturation: 0}}}",
            "greater than 0",
        ),
        (
            "tasks: {builtin: {}}\nstages: {sft: {enabled: false}, rl: {from_base: true}}",
            "it needs stages.sft",
        ),
        (
            "tasks: {claw: {}, gui: {}}",
            "tasks.gui cannot be joined with other tasks (tasks.claw, tasks.gui): only "
            "tasks.builtin and tasks.claw train together",
        ),
        (
            "tasks: {builtin: {}, jsonl: {evaluate: held.jsonl}}",
            "tasks.jsonl cannot be joined with other tasks",
        ),
        ("tasks: {claw: {count: 5}}", "greater than or equal to 12"),
        (
            "tasks: {claw: {}}\nharnesses: [program:codex]\n"
            "stages: {evaluate: {harnesses: [program:codex]}}",
            "which the recipe trains with",
        ),
        (
            "tasks: {claw: {}}\nharnesses: [program:codex]",
            "set stages.credit.enabled: false",
        ),
        ("tasks: {builtin: {}}\nteacher: {endpoint: ftp://x}", "nor an http(s) URL"),
        ("tasks: {builtin: {}}\nteacher: {api_key_env: 'sk-123 abc'}", "not an environment"),
        ("tasks: {builtin: {}}\nstudent: {engine: vllm}", "Hugging Face model path"),
        ("tasks: {builtin: {}}\nharnesses: [swe]", "program:<name> or external"),
        ("tasks: {builtin: {}}\nstages: {rl: {sampler: {n: 8, n_max: 4}}}", "n_max (4)"),
        (
            "tasks: {builtin: {}}\nstages: {rl: {sampler: {rho_min: 0.7, rho_max: 0.6}}}",
            "rho_min (0.7) is above rho_max (0.6)",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {sampler: {n: 4, n_max: 8, stride: 9}}}",
            "stride (9) must be at most n_max (8)",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {sampler: {kind: fixed, stop_rule: band}}}",
            "stop_rule configure kind: bar, not kind: fixed",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {sampler: {stop_rule: three_of_each}}}",
            "Input should be 'mixed' or 'band'",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {sampler: {member_choice: best}}}",
            "Input should be 'random' or 'ranked'",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {max_sequence_tokens: -1}}",
            "stages.rl.max_sequence_tokens: Input should be greater than or equal to 0",
        ),
        ("tasks: {builtin: {}}\nsuccess_threshold: 1.5", "less than or equal to 1"),
        ("tasks: {builtin: {}}\nsuccess_threshold: -0.1", "greater than or equal to 0"),
        ("tasks: {builtin: {}}\nsuccess_threshold: .nan", "finite number"),
        ("tasks: {builtin: {}}\nsuccess_threshold: .inf", "finite number"),
        ("tasks: {builtin: {}}\nstages: {collect: {enabled: false}}", "sft needs stages.collect"),
        ("tasks: {jsonl: {evaluate: e.jsonl}}", "tasks.jsonl.sft is not given"),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}}}",
            "estimator: opd needs a teacher: give rl.distillation.teacher",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {coef: 2}}}",
            "estimator: opd needs a teacher",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, "
            "distillation: {teacher: {train: builtin:small}}}}",
            "set rl.sampler.kind: fixed",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {distillation: {teacher: {model: builtin:small}}}}",
            "rl.distillation configures the teacher of estimator: opd",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "critic: {gae_lambda: 0.9}, distillation: {teacher: {model: builtin:small}}}}",
            "rl.critic configures the value model of estimator: ppo",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: builtin:small}, coef: 0}}}",
            "stages.rl.distillation.coef: Input should be greater than 0",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: builtin:small}, coef: .inf}}}",
            "stages.rl.distillation.coef: Input should be a finite number",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: builtin:small, model: builtin:small}}}}",
            "give exactly one of teacher.train",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {}}}}",
            "give exactly one of teacher.train",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {model: m, epochs: 3}}}}",
            "teacher.epochs and teacher.learning_rate configure teacher.train",
        ),
        (
            "tasks: {builtin: {}}\nstages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: models/big}}}}",
            "is not a built-in size (e.g. builtin:small); for a model of your own give "
            "teacher.model",
        ),
        (
            "tasks: {builtin: {}}\nstages: {sft: {enabled: false}, curate: {enabled: false}, "
            "rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: builtin:small}}}}",
            "it needs stages.collect and stages.curate",
        ),
        (
            "tasks: {builtin: {}}\nstudent: {model: models/qwen}\n"
            "stages: {rl: {estimator: opd, sampler: {kind: fixed}, "
            "distillation: {teacher: {train: builtin:small}}}}",
            "the teacher must share the student's tokenizer",
        ),
    ],
)
def test_inconsistent_recipes_are_refused_with_a_reason(
    tmp_path: Path, text: str, expected: str
) -> None:
    found = problems(write(tmp_path, f"name: r\n{text}\n"))
    assert any(expected in p for p in found), found


def test_not_yaml_and_not_a_file_are_clear(tmp_path: Path) -> None:
    assert "not valid YAML" in problems(write(tmp_path, "name: [unclosed\n"))[0]
    assert "expected a mapping" in problems(write(tmp_path, "- a\n- b\n"))[0]
    assert "No such file" in problems(tmp_path / "missing.yaml")[0]


def test_one_success_threshold_defaults_to_the_suite_s_pass_mark(tmp_path: Path) -> None:
    swe = load_recipe(write(tmp_path, "name: r\ntasks: {builtin: {}}\n"))
    assert (swe.success_threshold, swe.pass_mark) == (None, DEFAULT_SUCCESS_THRESHOLD)
    assert DEFAULT_SUCCESS_THRESHOLD == 0.5
    claw = load_recipe(builtin_recipe("claw"))
    assert claw.pass_mark == CLAW_PASS_MARK == 0.75
    given = load_recipe(write(tmp_path, "name: r\ntasks: {builtin: {}}\nsuccess_threshold: 0.9\n"))
    assert given.pass_mark == 0.9


def test_the_software_and_claw_suites_train_together(tmp_path: Path) -> None:
    text = "name: r\ntasks: {builtin: {count: 20}, claw: {count: 24, seed: 3}}\n"
    joint = load_recipe(write(tmp_path, text))
    assert joint.tasks.sources == ["builtin", "claw"]
    assert joint.tasks.domains == ["swe", "claw"]
    # The Claw mark holds for both: a software task's reward is 1 or -1, on the same side of it.
    assert joint.pass_mark == CLAW_PASS_MARK
    alone = load_recipe(write(tmp_path, "name: r\ntasks: {claw: {}}\n"))
    assert alone.tasks.domains == ["claw"]


def test_bar_defaults_to_the_mixed_rule_with_random_members_and_a_stride_of_n(
    tmp_path: Path,
) -> None:
    sampler = load_recipe(write(tmp_path, "name: r\ntasks: {builtin: {}}\n")).stages.rl.sampler
    assert (sampler.kind, sampler.stop_rule, sampler.member_choice) == ("bar", "mixed", "random")
    assert (sampler.n, sampler.stride, sampler.stride_or_n, sampler.n_max) == (8, None, 8, 16)
    text = "name: r\ntasks: {builtin: {}}\nstages: {rl: {sampler: {stop_rule: band, stride: 4}}}\n"
    sampler = load_recipe(write(tmp_path, text)).stages.rl.sampler
    assert (sampler.stop_rule, sampler.stride_or_n) == ("band", 4)


def test_opd_takes_a_trained_or_a_given_teacher(tmp_path: Path) -> None:
    trained = load_recipe(
        write(
            tmp_path,
            "name: r\ntasks: {builtin: {}}\nstages:\n  rl:\n    estimator: opd\n"
            "    sampler: {kind: fixed, n: 4}\n"
            "    distillation: {teacher: {train: builtin:small, epochs: 5}}\n",
        )
    )
    rl = trained.stages.rl
    assert rl.estimator == "opd" and rl.distillation is not None
    assert rl.distillation.coef == 1.0 and rl.distillation.teacher is not None
    teacher = rl.distillation.teacher
    assert (teacher.train, teacher.epochs, teacher.learning_rate, teacher.model) == (
        "builtin:small",
        5,
        None,
        None,
    )
    given = load_recipe(
        write(
            tmp_path,
            "name: r\ntasks: {builtin: {}}\nstudent: {model: models/qwen}\nstages:\n"
            "  sft: {enabled: false}\n  rl:\n    estimator: opd\n    sampler: {kind: fixed}\n"
            "    distillation: {teacher: {model: 'file:///store/teacher'}, coef: 0.5}\n",
        )
    )
    assert given.stages.rl.distillation is not None
    assert given.stages.rl.distillation.teacher is not None
    assert given.stages.rl.distillation.teacher.model == "file:///store/teacher"
    assert given.stages.rl.distillation.coef == 0.5


def test_rerank_is_off_by_default_and_its_history_runs_are_relative_to_the_recipe(
    tmp_path: Path,
) -> None:
    plain = load_recipe(write(tmp_path, "name: r\ntasks: {builtin: {}}\n"))
    assert not plain.stages.rerank.enabled and "rerank" not in plain.stages.enabled()
    assert plain.stages.rerank.sources == ["collect", "rl"]
    recipe = load_recipe(
        write(
            tmp_path,
            "name: r\ntasks: {builtin: {}}\nstages:\n  rerank:\n    enabled: true\n"
            "    k: 3\n    history: [runs/first, /data/runs/second]\n",
        )
    )
    rerank = recipe.stages.rerank
    assert rerank.enabled and rerank.k == 3 and recipe.stages.enabled()[-1] == "rerank"
    assert rerank.history == [tmp_path.resolve() / "runs" / "first", Path("/data/runs/second")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("stages: {rerank: {enabled: true, k: 0}}", "greater than or equal to 1"),
        ("stages: {rerank: {enabled: true, k: 65}}", "less than or equal to 64"),
        ("stages: {rerank: {enabled: true, sources: [collect, teacher]}}", "'collect', 'rl'"),
        ("stages: {rerank: {enabled: true, sources: [rl, rl]}}", "a source is named twice"),
        ("stages: {rerank: {enabled: true, sources: []}}", "no history: give sources"),
        ("stages: {rerank: {enabled: true, validation_fraction: 1}}", "less than 1"),
        ("stages: {rerank: {enabled: true, l2: 0}}", "greater than 0"),
        (
            "stages: {evaluate: {enabled: false}, rerank: {enabled: true}}",
            "stages.rerank reranks the evaluated models' attempts: it needs stages.evaluate",
        ),
    ],
)
def test_bad_rerank_settings_are_refused_with_a_reason(
    tmp_path: Path, text: str, expected: str
) -> None:
    found = problems(write(tmp_path, f"name: r\ntasks: {{builtin: {{}}}}\n{text}\n"))
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("name", sorted(BUILTIN_RECIPES))
def test_orchard_recipe_check_describes_every_built_in_recipe(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchard.sdk.cli import main

    assert main(["recipe", "check", str(builtin_recipe(name))]) == 0
    out = capsys.readouterr().out
    assert "tasks " in out and "suite" in out


def test_orchard_recipe_check_describes_a_joint_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchard.sdk.cli import main

    text = "name: r\ntasks: {builtin: {count: 20}, claw: {count: 24, seed: 3}}\n"
    assert main(["recipe", "check", str(write(tmp_path, text))]) == 0
    out = capsys.readouterr().out
    assert "built-in suite, 20 tasks (seed 0) + Claw suite, 24 tasks (seed 3)" in out
