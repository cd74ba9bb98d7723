"""The run report: what a recipe run did and whether it helped, as Markdown with PNG plots.

:class:`RunReport` holds the numbers a run gathers (held-out resolve counts per model, loss and
reward curves, sampler group statistics, trajectory counts, what the services' metrics say,
the screenshot trail pages of a few GUI episodes when the run kept them);
:func:`write_report` turns it into ``report.md`` and ``report.json`` plus the plots beside them.
Resolve rates carry Wilson score intervals, which stay inside [0, 1] and behave at 0 and at n
successes, where the normal approximation does not. A model evaluated on several harnesses has
a row per harness with pass@k and pass^k (`orchard.sdk.passk`). The plots need matplotlib (the
``report`` extra); without it the report is written with tables only and says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from orchard.sdk.passk import PassK, estimate_pass_k

__all__ = [
    "TRAILS_INDEX",
    "Curve",
    "GroupStats",
    "HarnessEvaluation",
    "ModelEvaluation",
    "RerankFigure",
    "Reranking",
    "RlRun",
    "RlStep",
    "RubricReward",
    "RubricRewardStep",
    "RunReport",
    "ServiceStats",
    "TrailLink",
    "TrajectoryCounts",
    "histogram_quantile",
    "service_stats_from_metrics",
    "wilson_interval",
    "write_report",
]


def wilson_interval(successes: float, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) when there were no trials.
    ``successes`` may be fractional (a mean of per-trial values in [0, 1] times ``trials``)."""
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if trials == 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    # At 0 and at n successes the bound is exactly 0 (or 1); computed, it is off by rounding.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return (low, high)


@dataclass(frozen=True, slots=True)
class HarnessEvaluation:
    """Held-out attempts of one model through one harness, with each task's counts."""

    harness: str
    """e.g. "program:codex"."""
    resolved: int
    attempts: int
    """Scored attempts; excluded ones are not among them."""
    held_out: bool = False
    """The harness was not used in training: evaluated only."""
    excluded: int = 0
    """Attempts without a score (infrastructure failures), left out of every number."""
    k: int = 1
    """The k of pass@k and pass^k: the attempts made per task."""
    tasks: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Task id to (scored attempts n, successes c)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"harness {self.harness!r}: k must be at least 1, got {self.k}")

    @property
    def rate(self) -> float:
        return self.resolved / self.attempts if self.attempts else 0.0

    @property
    def pass_k(self) -> PassK:
        """pass@k and pass^k over the tasks with k scored attempts."""
        return estimate_pass_k(self.tasks, self.k)


@dataclass(frozen=True, slots=True)
class ModelEvaluation:
    """Held-out attempts of one model."""

    model: str
    """e.g. "base", "sft", "rl"."""
    resolved: int
    attempts: int
    weight_version: str = ""
    harnesses: tuple[HarnessEvaluation, ...] = ()
    """The same attempts split by harness; empty for a run that did not record them."""
    domains: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """The same attempts split by domain ("swe", "claw"): (resolved, attempts) each; given
    when the run's tasks are of more than one domain."""

    @property
    def rate(self) -> float:
        return self.resolved / self.attempts if self.attempts else 0.0


@dataclass(frozen=True, slots=True)
class Curve:
    """One series over training steps."""

    name: str
    """e.g. "sft loss"."""
    steps: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"curve {self.name!r}: {len(self.steps)} steps for {len(self.values)} values"
            )


@dataclass(frozen=True, slots=True)
class GroupStats:
    """What a sampler produced."""

    sampler: str
    groups: int
    rollouts: int
    """Every rollout run for the groups, kept or not."""
    kept_groups: int
    """Groups the group filter kept (they carry signal)."""
    mean_positive_fraction: float
    """Over the kept groups."""
    choices: Mapping[str, int] = field(default_factory=dict)
    """How groups were assembled, e.g. {"balanced": 5, "relaxed": 1}."""


@dataclass(frozen=True, slots=True)
class RlStep:
    """One RL step as the report shows it."""

    step: int
    rollouts: int
    """Rollouts the step's rollout job ran (its cost, groups not taken included)."""
    reward_mean: float | None = None
    """Over the step's scored rollouts; None: none was scored."""
    loss: float | None = None
    """None: no update this step."""
    distill_reverse_kl: float | None = None
    """On-policy distillation: the trainer's mean student-minus-teacher log-probability over
    the step's loss tokens (the reverse-KL estimate training lowers)."""
    published: str | None = None
    """The weight version the step published."""


ESTIMATORS = {
    "grpo": "group-relative advantages over each group's rewards",
    "ppo": "per-token advantages from a value model",
    "opd": "on-policy distillation: each token the student sampled has the advantage "
    "coef x (teacher - student log-probability); no reward is needed",
}
"""What each RL estimator is, in words."""


@dataclass(frozen=True, slots=True)
class RlRun:
    """How the RL stage trained and what each of its steps did."""

    estimator: str
    """"grpo", "ppo" or "opd"."""
    sampler: str = ""
    steps: tuple[RlStep, ...] = ()
    teacher: str = ""
    """On-policy distillation: the teacher in words (size, how it was trained, its figures)."""
    verdict: str = ""
    """What RL did to the held-out resolve rate, in words."""

    @property
    def rollouts(self) -> int:
        return sum(s.rollouts for s in self.steps)


@dataclass(frozen=True, slots=True)
class RubricRewardStep:
    """One RL step's figures under the rubric process reward."""

    step: int
    outcome_mean: float | None
    """Mean outcome reward of the step's scored rollouts (what success is decided on)."""
    rubric_mean: float | None
    """Mean rubric score of the rollouts graded this step; None: none was."""
    graded: int
    excluded: int
    """Rollouts the judge did not grade: left out of training, never scored 0."""
    groups_with_signal_by_outcome: int = 0
    groups_with_signal: int = 0
    """Groups whose combined rewards differ (what trains)."""


@dataclass(frozen=True, slots=True)
class RubricReward:
    """Rubric-based process reward in RL (`stages.rl.rubric`): each trajectory trained on
    ``(1 - weight) x outcome + weight x rubric``."""

    judge: str
    weight: float
    stand_in: bool
    """The judge is the reward service's scripted rubric grader, not a model."""
    line: str = "rl"
    """The line of weights ("rl", or "rl from base")."""
    steps: tuple[RubricRewardStep, ...] = ()


@dataclass(frozen=True, slots=True)
class TrajectoryCounts:
    """Where the trajectories of a run went."""

    resolved: int = 0
    unresolved: int = 0
    credit_assigned: int = 0
    """Failed trajectories that got rise segments and entered SFT."""
    excluded: Mapping[str, int] = field(default_factory=dict)
    """Trajectories without a reward, by reason (sandbox failure, timeout, judge unavailable)."""


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """What the environment service's metrics said at the end of the run."""

    sandboxes_created: int
    sandboxes_failed: Mapping[str, int]
    sandboxes_reaped: int
    execs: int
    exec_p50_s: float | None
    exec_p95_s: float | None


@dataclass(frozen=True, slots=True)
class TrailLink:
    """The page of one evaluated GUI episode's screenshot trail (`orchard.recipes.trails`)."""

    model: str
    task_id: str
    harness: str
    reward: float | None
    resolved: bool
    steps: int
    page: str
    """Relative to the report folder, e.g. "trails/base/1-gui-7-shop-3.html"."""


@dataclass(frozen=True, slots=True)
class RunReport:
    """Everything the report shows."""

    title: str
    evaluations: tuple[ModelEvaluation, ...] = ()
    curves: tuple[Curve, ...] = ()
    groups: tuple[GroupStats, ...] = ()
    trajectories: TrajectoryCounts = TrajectoryCounts()
    services: ServiceStats | None = None
    stage_seconds: Mapping[str, float] = field(default_factory=dict)
    confidence: float = 0.95
    notes: tuple[str, ...] = ()
    trails: tuple[TrailLink, ...] = ()
    """Screenshot trail pages already written in the report folder (their index beside them,
    `TRAILS_INDEX`); empty: the section is left out."""
    rl: RlRun | None = None
    """The RL stage's estimator and steps; None: no RL stage ran."""
    rerank: Reranking | None = None
    """Best-of-k by a value model (the rerank stage); None: the stage did not run."""
    rubric: tuple[RubricReward, ...] = ()
    """The rubric process reward of each RL line that had one; empty: RL ran without."""


@dataclass(frozen=True, slots=True)
class RerankFigure:
    """One of the rerank stage's four figures: a share of the held-out (task, harness) pairs."""

    name: str
    """"pass@1", "random-of-k", "value-reranked" or "oracle pass@k"."""
    successes: float
    """Sum over the pairs of each pair's value in [0, 1] (random-of-k's is c / k)."""
    tasks: int

    @property
    def rate(self) -> float:
        return self.successes / self.tasks if self.tasks else 0.0


RERANK_MEANINGS = {
    "pass@1": "one attempt per task (the first of the k): what a single try gets",
    "random-of-k": "one of the k attempts picked at random, in expectation (c / k per task)",
    "value-reranked": "the attempt the value model scores highest",
    "oracle pass@k": "any of the k attempts succeeded: the most any picker can get",
}
"""The rerank figures in plain words."""


@dataclass(frozen=True, slots=True)
class Reranking:
    """Best-of-k by a value model trained on earlier policies' rollouts."""

    model: str
    k: int
    figures: tuple[RerankFigure, ...]
    """pass@1, random-of-k, value-reranked (absent without a value model), oracle pass@k."""
    tasks_short: int = 0
    """(task, harness) pairs with fewer than k scored attempts, left out."""
    history: str = ""
    """What the value model trained on, in words."""
    value_model: str = ""
    """How it was measured on held-out tasks of the history, or why there is none."""
    evaluation_auc: float | None = None
    """Its AUC on the reranked model's attempts (trained on earlier policies)."""
    within_task_accuracy: float | None = None
    """Among pairs of attempts at one task with different outcomes: how often the success
    scored higher."""
    verdict: str = ""
    notes: tuple[str, ...] = ()


TRAILS_INDEX = "trails/index.html"
"""Where the index of the trail pages lies in the report folder."""


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile from cumulative ``(upper_bound, count)`` buckets, interpolated linearly
    inside a bucket as PromQL's ``histogram_quantile`` does; None without observations."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: its bound is all that is known
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return ordered[-1][0]


def service_stats_from_metrics(text: str) -> ServiceStats:
    """Sandbox counts and exec latency from the env service's Prometheus text exposition."""
    created = reaped = execs = 0
    failed: dict[str, int] = {}
    exec_buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "orchard_env_create_seconds_count":
                created += int(sample.value)
            elif sample.name == "orchard_env_sandboxes_reaped_total":
                reaped += int(sample.value)
            elif sample.name == "orchard_env_sandboxes_failed_total":
                reason = sample.labels.get("reason", "")
                failed[reason] = failed.get(reason, 0) + int(sample.value)
            elif sample.name == "orchard_env_exec_seconds_count":
                execs += int(sample.value)
            elif sample.name == "orchard_env_exec_seconds_bucket":
                bound = float(sample.labels["le"])  # summed over status codes
                exec_buckets[bound] = exec_buckets.get(bound, 0.0) + sample.value
    buckets = list(exec_buckets.items())
    return ServiceStats(
        sandboxes_created=created,
        sandboxes_failed=failed,
        sandboxes_reaped=reaped,
        execs=execs,
        exec_p50_s=histogram_quantile(0.5, buckets),
        exec_p95_s=histogram_quantile(0.95, buckets),
    )


def write_report(report: RunReport, folder: Path) -> Path:
    """Write ``report.md``, ``report.json`` and the plots into ``folder``; returns the
    Markdown file."""
    folder.mkdir(parents=True, exist_ok=True)
    plots = _plots(report, folder)
    lines = [f"# {report.title}", ""]
    lines += _evaluation_section(report, plots)
    lines += _rl_section(report.rl)
    lines += _rubric_section(report.rubric, report.rl is not None)
    lines += _curves_section(report, plots)
    lines += _groups_section(report)
    lines += _trajectories_section(report.trajectories)
    lines += _services_section(report.services)
    lines += _trails_section(report.trails)
    lines += _rerank_section(report.rerank, report.confidence)
    if report.stage_seconds:
        lines += ["## Time per stage", "", "| stage | seconds |", "|---|---:|"]
        lines += [f"| {name} | {s:.1f} |" for name, s in report.stage_seconds.items()]
        lines.append("")
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    markdown = folder / "report.md"
    markdown.write_text("\n".join(lines))
    (folder / "report.json").write_text(json.dumps(_as_json(report), indent=2) + "\n")
    return markdown


def _evaluation_section(report: RunReport, plots: Mapping[str, str]) -> list[str]:
    if not report.evaluations:
        return []
    level = f"{report.confidence:.0%}"
    lines = [
        "## Held-out resolve rate",
        "",
        f"| model | weights | resolved | attempts | rate | {level} interval |",
        "|---|---|---:|---:|---:|---|",
    ]
    for e in report.evaluations:
        low, high = wilson_interval(e.resolved, e.attempts, report.confidence)
        lines.append(
            f"| {e.model} | {e.weight_version or '-'} | {e.resolved} | {e.attempts} | "
            f"{e.rate:.1%} | {low:.1%} to {high:.1%} |"
        )
    lines.append("")
    lines += _domain_table(report)
    lines += _harness_table(report)
    if "evaluation" in plots:
        lines += [f"![held-out resolve rate]({plots['evaluation']})", ""]
    return lines


def _domain_table(report: RunReport) -> list[str]:
    rows = [(e.model, d, counts) for e in report.evaluations for d, counts in e.domains.items()]
    if not rows:
        return []
    level = f"{report.confidence:.0%}"
    lines = [
        "### By domain",
        "",
        "One student trained on the tasks of every domain at once; its held-out attempts on "
        "each domain's tasks.",
        "",
        f"| model | domain | resolved | attempts | rate | {level} interval |",
        "|---|---|---:|---:|---:|---|",
    ]
    for model, domain, (resolved, attempts) in rows:
        low, high = wilson_interval(resolved, attempts, report.confidence)
        rate = f"{resolved / attempts:.1%}" if attempts else "-"
        interval = f"{low:.1%} to {high:.1%}" if attempts else "-"
        lines.append(f"| {model} | {domain} | {resolved} | {attempts} | {rate} | {interval} |")
    return [*lines, ""]


def _harness_table(report: RunReport) -> list[str]:
    rows = [(e.model, h) for e in report.evaluations for h in e.harnesses]
    if not rows:
        return []
    ks = {h.k for _, h in rows}
    same_k = len(ks) == 1
    k_label = str(next(iter(ks))) if same_k else "k"
    level = f"{report.confidence:.0%}"
    lines = [
        "### By harness",
        "",
        f"pass@{k_label}: at least one of {k_label} attempts at a task succeeds; "
        f"pass^{k_label}: all {k_label} do. Unbiased estimates from each task's scored "
        f"attempts, averaged over the tasks that had at least {k_label} (the tasks column); "
        "tasks with fewer are left out, counted as short.",
        "",
        f"| model | harness | resolved | attempts | excluded | rate | {level} interval | "
        f"pass@{k_label} | pass^{k_label} | tasks |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]

    def percent(value: float | None, k: int) -> str:
        if value is None:
            return "-"
        return f"{value:.1%}" if same_k else f"{value:.1%} (k={k})"

    for model, h in rows:
        low, high = wilson_interval(h.resolved, h.attempts, report.confidence)
        estimate = h.pass_k
        harness = f"{h.harness} (held out)" if h.held_out else h.harness
        rate = f"{h.rate:.1%}" if h.attempts else "-"
        interval = f"{low:.1%} to {high:.1%}" if h.attempts else "-"
        tasks = str(estimate.tasks_used)
        if estimate.tasks_short:
            tasks += f" ({estimate.tasks_short} short)"
        lines.append(
            f"| {model} | {harness} | {h.resolved} | {h.attempts} | {h.excluded} | {rate} | "
            f"{interval} | {percent(estimate.pass_at_k, h.k)} | "
            f"{percent(estimate.pass_hat_k, h.k)} | {tasks} |"
        )
    lines.append("")
    if any(h.k > 1 for _, h in rows):
        lines += [
            "The intervals take every attempt as independent; attempts at the same task are "
            "not, so with several attempts per task they are narrower than they should be.",
            "",
        ]
    return lines


def _rl_section(rl: RlRun | None) -> list[str]:
    if rl is None:
        return []
    what = ESTIMATORS.get(rl.estimator, rl.estimator)
    per_step = ", ".join(str(s.rollouts) for s in rl.steps) or "-"
    lines = [
        "## Reinforcement learning",
        "",
        f"- estimator: {rl.estimator} ({what})"
        + (f"; sampler: {rl.sampler}" if rl.sampler else ""),
    ]
    if rl.teacher:
        lines.append(f"- teacher: {rl.teacher}")
    lines.append(
        f"- rollouts run: {rl.rollouts} over {len(rl.steps)} step(s) (per step: {per_step}; "
        "those of groups a step did not take included)"
    )
    if rl.verdict:
        lines.append(f"- {rl.verdict}")
    lines.append("")
    if not rl.steps:
        return lines
    distilled = any(s.distill_reverse_kl is not None for s in rl.steps)

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    head = "| step | rollouts | reward mean | loss |"
    rule = "|---:|---:|---:|---:|"
    if distilled:
        head += " distill reverse KL |"
        rule += "---:|"
    lines += [head + " published |", rule + "---|"]
    for s in rl.steps:
        row = f"| {s.step} | {s.rollouts} | {number(s.reward_mean)} | {number(s.loss)} |"
        if distilled:
            row += f" {number(s.distill_reverse_kl)} |"
        lines.append(row + f" {s.published or '-'} |")
    return [*lines, ""]


def _rubric_section(lines_of_weights: Sequence[RubricReward], under_rl: bool) -> list[str]:
    if not lines_of_weights:
        return []
    lines = ["### Rubric process reward" if under_rl else "## Reinforcement learning", ""]
    for r in lines_of_weights:
        judge = r.judge + (
            " (the reward service's scripted rubric grader: a deterministic stand-in for a "
            "judge model, grading from the agent's tool calls)"
            if r.stand_in
            else ""
        )
        lines += [
            f"- {r.line}: rubric process reward on, weight {r.weight:g}, judge {judge}: each "
            f"trajectory trained on (1 - {r.weight:g}) x outcome + {r.weight:g} x rubric; "
            "success, resolve counts and sampling used the outcome alone; a trajectory the "
            "judge did not grade was left out of training, never scored 0",
        ]
    lines += [
        "",
        "| line | step | mean outcome reward | mean rubric score | graded | excluded "
        "| groups with signal (outcome / combined) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for r in lines_of_weights:
        for s in r.steps:
            lines.append(
                f"| {r.line} | {s.step} | {number(s.outcome_mean)} | {number(s.rubric_mean)} | "
                f"{s.graded} | {s.excluded} | {s.groups_with_signal_by_outcome} / "
                f"{s.groups_with_signal} |"
            )
    return [*lines, ""]


def _curves_section(report: RunReport, plots: Mapping[str, str]) -> list[str]:
    if not report.curves:
        return []
    lines = [
        "## Training curves",
        "",
        "| series | steps | first | last | min |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in report.curves:
        if c.values:
            lines.append(
                f"| {c.name} | {len(c.values)} | {c.values[0]:.4g} | {c.values[-1]:.4g} | "
                f"{min(c.values):.4g} |"
            )
        else:
            lines.append(f"| {c.name} | 0 | - | - | - |")
    lines.append("")
    if "curves" in plots:
        lines += [f"![training curves]({plots['curves']})", ""]
    return lines


def _groups_section(report: RunReport) -> list[str]:
    if not report.groups:
        return []
    lines = [
        "## Sampler groups",
        "",
        "| sampler | groups | kept | rollouts | rollouts per kept group | mean positive fraction "
        "| how assembled |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for g in report.groups:
        per_kept = f"{g.rollouts / g.kept_groups:.1f}" if g.kept_groups else "-"
        choices = ", ".join(f"{k} {v}" for k, v in sorted(g.choices.items())) or "-"
        lines.append(
            f"| {g.sampler} | {g.groups} | {g.kept_groups} | {g.rollouts} | {per_kept} | "
            f"{g.mean_positive_fraction:.3f} | {choices} |"
        )
    return [*lines, ""]


def _trajectories_section(counts: TrajectoryCounts) -> list[str]:
    excluded = sum(counts.excluded.values())
    lines = [
        "## Trajectories",
        "",
        "| resolved | unresolved | credit-assigned | excluded |",
        "|---:|---:|---:|---:|",
        f"| {counts.resolved} | {counts.unresolved} | {counts.credit_assigned} | {excluded} |",
        "",
    ]
    if counts.excluded:
        lines += ["Excluded, by reason (never scored as policy failures):", ""]
        lines += [f"- {reason}: {n}" for reason, n in sorted(counts.excluded.items())]
        lines.append("")
    return lines


def _services_section(stats: ServiceStats | None) -> list[str]:
    if stats is None:
        return []

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    failed = ", ".join(f"{r} {n}" for r, n in sorted(stats.sandboxes_failed.items())) or "none"
    return [
        "## Sandboxes and exec (from the environment service's metrics)",
        "",
        f"- sandboxes created: {stats.sandboxes_created}; failed: {failed}; "
        f"reaped after expiry: {stats.sandboxes_reaped}",
        f"- commands run: {stats.execs}; exec latency p50 {ms(stats.exec_p50_s)}, "
        f"p95 {ms(stats.exec_p95_s)} (from histogram buckets)",
        "",
    ]


def _markdown_text(text: str) -> str:
    """Text for a Markdown table cell or link text: no markup, no inline HTML."""
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("|", "\\|")
        .replace("[", "\\[")
        .replace("]", "\\]")
        .replace("`", "\\`")
        .replace("\n", " ")
    )


def _rerank_section(rerank: Reranking | None, confidence: float) -> list[str]:
    if rerank is None:
        return []
    level = f"{confidence:.0%}"
    tasks = rerank.figures[0].tasks if rerank.figures else 0
    lines = [
        f"## Best-of-{rerank.k} by a value model ({rerank.model})",
        "",
        f"The {rerank.model} model made {rerank.k} attempts at each of {tasks} held-out "
        "(task, harness) pairs"
        + (f" ({rerank.tasks_short} more had fewer scored attempts and are left out)"
           if rerank.tasks_short else "")
        + ". A value model trained only on earlier policies' rollouts scores every attempt.",
        "",
        f"| figure | what it is | rate | {level} interval |",
        "|---|---|---:|---|",
    ]  # fmt: skip
    for f in rerank.figures:
        low, high = wilson_interval(f.successes, f.tasks, confidence)
        lines.append(
            f"| {f.name} | {RERANK_MEANINGS.get(f.name, '')} | {f.rate:.1%} | "
            f"{low:.1%} to {high:.1%} |"
        )
    lines.append("")

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    if rerank.verdict:
        lines.append(f"- {rerank.verdict}")
    if rerank.history:
        lines.append(f"- history: {rerank.history}")
    if rerank.value_model:
        lines.append(f"- value model: {rerank.value_model}")
    lines.append(
        f"- on the {rerank.model} model's attempts (a policy it never saw): AUC "
        f"{number(rerank.evaluation_auc)}, within-task ranking accuracy "
        f"{number(rerank.within_task_accuracy)} (0.5 is chance; - : not defined, e.g. no "
        "success or no failure among the attempts)"
    )
    lines += [f"- {note}" for note in rerank.notes]
    return [*lines, ""]


def _trails_section(trails: Sequence[TrailLink]) -> list[str]:
    if not trails:
        return []
    lines = [
        "## GUI episodes: screenshot trails",
        "",
        f"A few evaluated episodes per model, each action with its result and screenshot: "
        f"[all trails]({TRAILS_INDEX}).",
        "",
        "| model | task | harness | reward | resolved | steps | trail |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for t in trails:
        reward = "-" if t.reward is None else f"{t.reward:g}"
        lines.append(
            f"| {_markdown_text(t.model)} | {_markdown_text(t.task_id)} | "
            f"{_markdown_text(t.harness)} | {reward} | {'yes' if t.resolved else 'no'} | "
            f"{t.steps} | [page]({t.page}) |"
        )
    return [*lines, ""]


def _plots(report: RunReport, folder: Path) -> dict[str, str]:
    """PNG plots by section; empty when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional, and slow to import

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
    except ImportError:
        return {}
    made: dict[str, str] = {}
    harnesses = _harness_names(report)
    if len(harnesses) > 1:
        made["evaluation"] = _plot_by_harness(report, harnesses, folder, pyplot)
    elif report.evaluations:
        figure, axes = pyplot.subplots(figsize=(5, 3.2))
        names = [e.model for e in report.evaluations]
        rates = [e.rate for e in report.evaluations]
        intervals = [
            wilson_interval(e.resolved, e.attempts, report.confidence) for e in report.evaluations
        ]
        below = [max(0.0, r - lo) for r, (lo, _) in zip(rates, intervals, strict=True)]
        above = [max(0.0, hi - r) for r, (_, hi) in zip(rates, intervals, strict=True)]
        errors = [below, above]
        axes.bar(names, rates, yerr=errors, capsize=6, color="#4c8c4a")
        axes.set_ylim(0, 1)
        axes.set_ylabel("resolve rate")
        axes.set_title(f"Held-out resolve rate ({report.confidence:.0%} Wilson intervals)")
        made["evaluation"] = _save(figure, folder / "resolve_rate.png", pyplot)
    if report.curves:
        figure, all_axes = pyplot.subplots(
            len(report.curves), 1, figsize=(6, 2.2 * len(report.curves)), squeeze=False
        )
        for axes, curve in zip(all_axes[:, 0], report.curves, strict=True):
            axes.plot(curve.steps, curve.values, marker="." if len(curve.values) < 50 else None)
            axes.set_title(curve.name, fontsize=10)
            axes.set_xlabel("step")
        made["curves"] = _save(figure, folder / "curves.png", pyplot)
    return made


def _harness_names(report: RunReport) -> list[str]:
    """Every harness any model was evaluated on, in the order they first appear."""
    names: dict[str, None] = {}
    for e in report.evaluations:
        for h in e.harnesses:
            names.setdefault(h.harness, None)
    return list(names)


def _plot_by_harness(report: RunReport, harnesses: Sequence[str], folder: Path, pyplot: Any) -> str:
    """Resolve rate per model, one bar per harness (held-out ones hatched), with intervals."""
    models = [e.model for e in report.evaluations]
    width = 0.8 / len(harnesses)
    figure, axes = pyplot.subplots(
        figsize=(max(6.0, 1.2 + len(models) * len(harnesses) * 0.45), 4.0)
    )
    colours = ["#4c8c4a", "#3b6ea5", "#c0793a", "#8a5a9e", "#a03c3c", "#5a8f8f", "#7f7f3f"]
    for i, name in enumerate(harnesses):
        xs: list[float] = []
        rates: list[float] = []
        below: list[float] = []
        above: list[float] = []
        held_out = False
        for x, e in enumerate(report.evaluations):
            row = next((h for h in e.harnesses if h.harness == name), None)
            if row is None or not row.attempts:
                continue
            held_out = held_out or row.held_out
            low, high = wilson_interval(row.resolved, row.attempts, report.confidence)
            xs.append(x - 0.4 + width * (i + 0.5))
            rates.append(row.rate)
            below.append(max(0.0, row.rate - low))
            above.append(max(0.0, high - row.rate))
        if not xs:
            continue
        axes.bar(
            xs,
            rates,
            width=width * 0.95,
            yerr=[below, above],
            capsize=3,
            color=colours[i % len(colours)],
            hatch="//" if held_out else None,
            edgecolor="white" if held_out else None,
            label=f"{name} (held out)" if held_out else name,
        )
    axes.set_xticks(range(len(models)), models)
    axes.set_ylim(0, 1)
    axes.set_ylabel("resolve rate")
    axes.set_title(
        f"Held-out resolve rate by harness ({report.confidence:.0%} Wilson intervals)", fontsize=10
    )
    if axes.get_legend_handles_labels()[0]:
        axes.legend(
            fontsize=8,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12),
            ncol=min(3, len(harnesses)),
            frameon=False,
        )
    return _save(figure, folder / "resolve_rate.png", pyplot)


def _save(figure: object, path: Path, pyplot: object) -> str:
    figure.tight_layout()  # type: ignore[attr-defined]
    figure.savefig(path, dpi=110)  # type: ignore[attr-defined]
    pyplot.close(figure)  # type: ignore[attr-defined]
    return path.name


def _as_json(report: RunReport) -> dict[str, object]:
    data = asdict(report)
    if report.rerank is not None:
        data["rerank"]["figures"] = [
            {
                **asdict(f),
                "rate": f.rate,
                "interval": list(wilson_interval(f.successes, f.tasks, report.confidence)),
            }
            for f in report.rerank.figures
        ]
    data["evaluations"] = [
        {
            **asdict(e),
            "rate": e.rate,
            "interval": list(wilson_interval(e.resolved, e.attempts, report.confidence)),
            "harnesses": [_harness_json(h, report.confidence) for h in e.harnesses],
            "domains": {
                domain: {
                    "resolved": resolved,
                    "attempts": attempts,
                    "interval": list(wilson_interval(resolved, attempts, report.confidence)),
                }
                for domain, (resolved, attempts) in e.domains.items()
            },
        }
        for e in report.evaluations
    ]
    return data


def _harness_json(h: HarnessEvaluation, confidence: float) -> dict[str, object]:
    estimate = h.pass_k
    return {
        **asdict(h),
        "tasks": {task: list(counts) for task, counts in h.tasks.items()},
        "rate": h.rate,
        "interval": list(wilson_interval(h.resolved, h.attempts, confidence)),
        "pass_at_k": estimate.pass_at_k,
        "pass_hat_k": estimate.pass_hat_k,
        "tasks_used": estimate.tasks_used,
        "tasks_short": estimate.tasks_short,
    }
