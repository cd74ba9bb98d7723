"""The experiment runner's parts that need no service: which stages two runs share, the copy,
the paired comparison, and the report from finished run folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchard.recipes.experiment import (
    ModelRow,
    paired_difference,
    share_stages,
    stage_keys,
    task_domain,
    write_experiment_report,
)
from orchard.sdk.experiment import arm_recipe, load_experiment
from orchard.sdk.recipe import STAGES

EXPERIMENT = {
    "name": "exp",
    "settings": {"tasks.builtin.count": 12},
    "seeds": [0, 1],
    "arms": [
        {"name": "main"},
        {"name": "fixed", "settings": {"stages.rl.sampler.kind": "fixed"}},
        {"name": "no-credit", "settings": {"stages.credit.enabled": False}},
        {
            "name": "no-credit-fixed",
            "settings": {"stages.credit.enabled": False, "stages.rl.sampler.kind": "fixed"},
        },
    ],
    "comparisons": [
        {"name": "credit helps SFT", "a": "main/sft", "b": "no-credit/sft"},
        {"name": "bar vs fixed", "a": "main/rl", "b": "fixed/rl", "metric": "balanced-groups"},
        {"name": "rl vs sft", "a": "main/rl", "b": "main/sft"},
    ],
}


@pytest.fixture
def loaded(tmp_path: Path) -> tuple[Any, Path]:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(EXPERIMENT), encoding="utf-8")
    return load_experiment(path, workdir=tmp_path)


def _saved(experiment: Any, arm: str, seed: int, out: Path) -> tuple[dict[str, Any], Path]:
    """A run folder as `run_recipe` starts it: recipe.json and seed.json."""
    recipe = arm_recipe(experiment, experiment.arm(arm), seed, base=out, output_dir=out)
    folder = Path(recipe.output_dir)
    folder.mkdir(parents=True)
    saved = json.loads(recipe.model_dump_json())
    (folder / "recipe.json").write_text(json.dumps(saved))
    (folder / "seed.json").write_text(json.dumps({"seed": seed}))
    return saved, folder


def _finish(folder: Path, stage: str, summary: dict[str, Any], **files: str) -> None:
    (folder / stage).mkdir(parents=True, exist_ok=True)
    (folder / stage / "done.json").write_text(json.dumps(summary))
    for name, text in files.items():
        (folder / stage / name).write_text(text)


def test_a_stage_key_covers_the_settings_of_every_stage_up_to_it(loaded: Any) -> None:
    experiment, out = loaded
    main, _ = _saved(experiment, "main", 0, out)
    fixed, _ = _saved(experiment, "fixed", 0, out)
    credit, _ = _saved(experiment, "no-credit", 0, out)
    other_seed, _ = _saved(experiment, "main", 1, out)
    a, b, c = stage_keys(main, 0), stage_keys(fixed, 0), stage_keys(credit, 0)
    same_as_fixed = [s for s in STAGES if a[s] == b[s]]
    assert same_as_fixed == ["collect", "credit", "curate", "sft"]
    assert [s for s in STAGES if a[s] == c[s]] == ["collect"]
    # The run's name and folder are not inputs of any stage; its seed is of all.
    assert stage_keys({**main, "name": "x", "output_dir": "y"}, 0) == a
    assert all(v != stage_keys(other_seed, 1)[k] for k, v in a.items())


def test_an_arm_takes_the_stages_it_shares_with_an_earlier_one(loaded: Any) -> None:
    experiment, out = loaded
    _, main = _saved(experiment, "main", 0, out)
    _finish(main, "collect", {"rollouts": 8}, **{"groups.jsonl": "teacher"})
    _finish(main, "credit", {"credited": 2})
    _finish(main, "curate", {"kept": 5})
    _finish(main, "sft", {"weights": {"version": "job-a-step-9", "location": "file:///w"}})
    _finish(main, "rl", {"weights": {"version": "job-b-step-2", "location": "file:///r"}})
    for model, version in (("base", "base"), ("sft", "job-a-step-9"), ("rl", "job-b-step-2")):
        (main / "evaluate").mkdir(exist_ok=True)
        (main / "evaluate" / f"{model}.json").write_text(
            json.dumps({"model": model, "weight_version": version, "resolved": 1})
        )
        (main / "evaluate" / f"{model}.groups.jsonl").write_text(model)
    _, other_seed = _saved(experiment, "fixed", 1, out)
    _, fixed = _saved(experiment, "fixed", 0, out)
    shared = share_stages(fixed, [other_seed, main])
    assert shared["stages"] == {s: "main/seed-0" for s in ("collect", "credit", "curate", "sft")}
    assert (fixed / "collect" / "groups.jsonl").read_text() == "teacher"
    assert not (fixed / "rl").exists()
    # The base and SFT models' held-out evaluations come along (same weights, same evaluation
    # settings); the other arm's RL model is not this arm's.
    assert shared["evaluations"] == {"base": "main/seed-0", "sft": "main/seed-0"}
    assert sorted(p.name for p in (fixed / "evaluate").iterdir()) == [
        "base.groups.jsonl", "base.json", "sft.groups.jsonl", "sft.json",
    ]  # fmt: skip
    assert json.loads((fixed / "shared.json").read_text()) == shared
    # An arm that differs at credit shares only the teacher's collection; a stage it finished
    # itself is never replaced.
    _, no_credit = _saved(experiment, "no-credit", 0, out)
    assert share_stages(no_credit, [main])["stages"] == {"collect": "main/seed-0"}
    assert share_stages(no_credit, [main])["evaluations"] == {"base": "main/seed-0"}
    (no_credit / "collect" / "groups.jsonl").write_text("mine")
    share_stages(no_credit, [main])
    assert (no_credit / "collect" / "groups.jsonl").read_text() == "mine"
    # Another seed shares nothing.
    assert share_stages(other_seed, [main]) == {"stages": {}, "evaluations": {}}


def test_a_stage_turned_off_in_both_runs_does_not_end_the_sharing(loaded: Any) -> None:
    experiment, out = loaded
    _, first = _saved(experiment, "no-credit", 0, out)
    _finish(first, "collect", {})
    _finish(first, "curate", {"kept": 5})
    _finish(first, "sft", {"weights": {"version": "job-a-step-9"}})
    _, second = _saved(experiment, "no-credit-fixed", 0, out)
    # No credit stage ran in either (it is off): curate and SFT are still the same.
    assert share_stages(second, [first])["stages"] == {
        s: "no-credit/seed-0" for s in ("collect", "curate", "sft")
    }
    assert not (second / "credit").exists()


def test_an_evaluation_of_other_weights_is_not_copied(loaded: Any) -> None:
    experiment, out = loaded
    _, main = _saved(experiment, "main", 0, out)
    _finish(main, "collect", {})
    (main / "evaluate").mkdir()
    (main / "evaluate" / "sft.json").write_text(json.dumps({"weight_version": "job-a-step-9"}))
    _, fixed = _saved(experiment, "fixed", 0, out)
    _finish(fixed, "sft", {"weights": {"version": "job-z-step-1"}})
    assert share_stages(fixed, [main])["evaluations"] == {}


def _row(arm: str, model: str, results: dict[tuple[int, str], tuple[int, int]]) -> ModelRow:
    row = ModelRow(arm, model, per_task=dict(results))
    for (seed, _), (c, n) in results.items():
        have = row.per_seed.get(seed, (0, 0))
        row.per_seed[seed] = (have[0] + c, have[1] + n)
    return row


def test_the_paired_difference_and_its_interval() -> None:
    tasks = [f"t{i}" for i in range(40)]
    better = _row("a", "rl", {(s, t): (1, 1) for s in (0, 1) for t in tasks})
    worse = _row(
        "b", "rl", {(s, t): (int(i % 4 == 0), 1) for s in (0, 1) for i, t in enumerate(tasks)}
    )
    result = paired_difference(better, worse, confidence=0.95)
    assert result is not None
    assert result["difference"] == pytest.approx(0.75)
    low, high = result["interval"]
    assert 0.5 < low <= 0.75 <= high <= 1.0
    assert (result["pairs"], result["tasks"], result["a_better"], result["b_better"]) == (
        80,
        40,
        60,
        0,
    )
    same = paired_difference(better, better, confidence=0.95)
    assert same is not None and same["interval"] == [0.0, 0.0]
    # Deterministic, and only the (seed, task) pairs both evaluated count.
    assert paired_difference(better, worse, confidence=0.95) == result
    partial = _row("c", "rl", {(0, "t0"): (0, 1)})
    only = paired_difference(better, partial, confidence=0.95)
    assert only is not None and only["pairs"] == 1 and only["difference"] == 1.0
    assert paired_difference(better, _row("d", "rl", {(5, "x"): (1, 1)}), confidence=0.95) is None


def test_a_comparison_on_one_domain_pairs_that_domain_s_tasks_only() -> None:
    """A joint run (software and Claw tasks) against a run of one suite: the software tasks
    pair whatever the filter, and within the joint run the Claw tasks are set apart."""
    swe = [f"repo-{i}" for i in range(10)]
    claw = [f"claw/0/mail/{i}" for i in range(10)]
    joint = _row("joint", "sft", {(0, t): (1, 1) for t in swe} | {(0, t): (0, 1) for t in claw})
    alone = _row("swe", "sft", {(0, t): (0, 1) for t in swe})
    on_swe = joint.of_domain("swe")
    assert (on_swe.resolved, on_swe.attempts) == (10, 10)
    on_claw = joint.of_domain("claw")
    assert (on_claw.resolved, on_claw.attempts, on_claw.rates()) == (0, 10, [0.0])
    result = paired_difference(joint.of_domain("swe"), alone, confidence=0.95)
    assert result is not None and (result["pairs"], result["difference"]) == (10, 1.0)
    assert paired_difference(joint.of_domain("claw"), alone, confidence=0.95) is None
    assert task_domain("gui/1/shop/2") == "gui" and task_domain("astropy__x-1") == "swe"


def _report_json(models: dict[str, list[int]], tasks: dict[str, dict[str, list[int]]]) -> str:
    return json.dumps(
        {
            "evaluations": [
                {
                    "model": model,
                    "resolved": resolved,
                    "attempts": attempts,
                    "harnesses": [{"harness": "builtin:swe", "tasks": tasks[model]}],
                }
                for model, (resolved, attempts) in models.items()
            ]
        }
    )


def test_the_report_from_finished_runs(loaded: Any) -> None:
    experiment, out = loaded
    tasks = [f"t{i}" for i in range(20)]
    for arm, sft_wins, rl_wins in (("main", 12, 18), ("no-credit", 6, 18), ("fixed", 12, 10)):
        for seed in (0, 1):
            run = out / arm / f"seed-{seed}"
            (run / "report").mkdir(parents=True)
            per = {
                "base": {t: [1, 0] for t in tasks},
                "sft": {t: [1, int(i < sft_wins)] for i, t in enumerate(tasks)},
                "rl": {t: [1, int(i < rl_wins)] for i, t in enumerate(tasks)},
            }
            counts = {m: [sum(c for _, c in v.values()), len(v)] for m, v in per.items()}
            (run / "report" / "report.json").write_text(_report_json(counts, per))
            (run / "report" / "report.md").write_text("# run\n")
            kept = 3 if arm == "main" else 1
            _finish(
                run,
                "rl",
                {
                    "steps": [
                        {"step": 1, "reward_mean": -0.5 + seed},
                        {"step": 2, "reward_mean": 0.2},
                    ],
                    "groups": [{"rollouts": 10, "kept": i < kept} for i in range(4)],
                },
            )
    (out / "fixed" / "seed-1" / "report" / "report.md").unlink()
    path = write_experiment_report(experiment, out, source="recipes/exp.yaml")
    text = path.read_text()
    data = json.loads((path.parent / "experiment.json").read_text())
    main_sft = next(m for m in data["models"] if (m["arm"], m["model"]) == ("main", "sft"))
    assert (main_sft["resolved"], main_sft["attempts"], main_sft["seed_mean"]) == (24, 40, 0.6)
    assert main_sft["seed_sd"] == 0.0 and main_sft["interval"][0] < 0.6 < main_sft["interval"][1]
    verdicts = {c["name"]: c["verdict"] for c in data["comparisons"]}
    assert verdicts["credit helps SFT"] == "main/sft better"
    assert verdicts["rl vs sft"] == "main/rl better"
    assert verdicts["bar vs fixed"] == "75.0 vs 25.0 groups with signal per 1,000 rollouts"
    assert "| main | sft | 12/20, 12/20 | 24/40 (60.0%) |" in text
    assert "orchard experiment run recipes/exp.yaml" in text
    assert "- fixed/seed-1: not finished" in text
    assert "[main/seed-0](../main/seed-0/report/report.md)" in text
    assert (path.parent / "held-out.png").stat().st_size > 0
    assert (path.parent / "rl-reward.png").stat().st_size > 0
    assert data["curves"]["main/rl"]["1"] == [[1, 0.5], [2, 0.2]]


def test_a_joint_arm_gets_rows_per_domain_and_domain_comparisons_pair_its_tasks(
    tmp_path: Path,
) -> None:
    data = {
        "name": "joint",
        "settings": {"tasks.builtin.count": 12, "tasks.claw.count": 24},
        "arms": [{"name": "joint"}, {"name": "swe-only", "settings": {"tasks.claw": None}}],
        "comparisons": [
            {"name": "joint vs alone", "a": "joint/sft", "b": "swe-only/sft", "domain": "swe"}
        ],
    }
    path = tmp_path / "joint.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    experiment, out = load_experiment(path, workdir=tmp_path)
    swe = [f"repo-{i}" for i in range(10)]
    claw = [f"claw/0/mail/{i}" for i in range(10)]
    runs = {
        "joint": {t: [1, 1] for t in swe} | {t: [1, int(i < 3)] for i, t in enumerate(claw)},
        "swe-only": {t: [1, 0] for t in swe},
    }
    for arm, tasks in runs.items():
        run = out / arm / "seed-0" / "report"
        run.mkdir(parents=True)
        resolved = sum(c for _, c in tasks.values())
        (run / "report.json").write_text(
            _report_json({"sft": [resolved, len(tasks)]}, {"sft": tasks})
        )
        (run / "report.md").write_text("# run\n")
    report = write_experiment_report(experiment, out)
    text = report.read_text()
    assert (
        "| joint | sft (claw tasks) | 3/10 |" in text
        and "| joint | sft (swe tasks) | 10/10 |" in text
    )
    assert "| swe-only | sft | 0/10 |" in text and "swe-only | sft (" not in text
    assert "| joint vs alone (swe tasks) | joint/sft | swe-only/sft | +100.0 |" in text


def test_a_comparison_without_results_says_so(loaded: Any) -> None:
    experiment, out = loaded
    text = write_experiment_report(experiment, out).read_text()
    assert "not measured: a side has no finished evaluation" in text
    assert "not measured: a side ran no RL" in text
