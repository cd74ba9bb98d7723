"""What a training run shows people: Prometheus metrics, a JSONL run log, and a plot of it.

Every optimizer step is one `StepRecord`: its mode, step number, loss, learning rate, gradient
norm, tokens, tokens per second, and the loss statistics (entropy, clip fractions, importance
weights, KL, reward mean). `StepRecorder` writes each to

- gauges `orchard_trainer_<what>_<unit>` (labels `job` and `mode`), in a registry of its own or
  the service's, and a counter of steps and tokens;
- the run log, one JSON object per line, which `plot_run_log` turns into a PNG.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from orchard.trainer.engine import StepResult

__all__ = ["GAUGES", "StepRecord", "StepRecorder", "plot_run_log", "read_run_log"]

# (record key, metric name part, help): the gauges every step sets.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss_ratio", "Loss of the last optimizer step."),
    ("learning_rate", "learning_rate_ratio", "Learning rate the last step used."),
    ("grad_norm", "grad_norm_ratio", "Global gradient norm before clipping, last step."),
    ("tokens_per_second", "tokens_per_second", "Tokens processed per second, last step."),
    ("entropy", "entropy_nats", "Mean policy entropy on the loss tokens, last step."),
    ("clip_fraction", "clip_fraction_ratio", "Loss tokens where the ratio clip binds."),
    ("importance_mean", "importance_weight_mean_ratio", "Mean importance weight before the cap."),
    ("importance_min", "importance_weight_min_ratio", "Smallest importance weight."),
    ("importance_max", "importance_weight_max_ratio", "Largest importance weight before the cap."),
    ("importance_capped_fraction", "importance_capped_fraction_ratio", "Tokens the cap lowered."),
    ("kl_mean", "kl_nats", "Mean k3 KL estimate to the reference policy."),
    ("reward_mean", "reward_mean_ratio", "Mean reward of the trajectories in the step."),
    ("value_loss", "value_loss_ratio", "Critic loss of the last step (PPO with a critic)."),
    ("validation_loss", "validation_loss_ratio", "SFT validation loss, last evaluation."),
)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One line of the run log."""

    job: str
    mode: str
    step: int
    loss: float
    learning_rate: float
    grad_norm: float
    loss_tokens: int
    tokens: int
    seconds: float
    tokens_per_second: float
    time: float
    """Unix time the step ended."""
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls, job: str, mode: str, result: StepResult, extra: Mapping[str, float] | None = None
    ) -> StepRecord:
        return cls(
            job=job,
            mode=mode,
            step=result.step,
            loss=result.loss,
            learning_rate=result.learning_rate,
            grad_norm=result.grad_norm,
            loss_tokens=result.loss_tokens,
            tokens=result.tokens,
            seconds=result.seconds,
            tokens_per_second=result.tokens_per_second,
            time=time.time(),
            extra={**result.extra, **(extra or {})},
        )

    def value(self, key: str) -> float | None:
        """A top-level field or a statistic, by name; None when this step has none."""
        if key in self.extra:
            return self.extra[key]
        found = getattr(self, key, None)
        return float(found) if isinstance(found, int | float) else None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "job": self.job,
            "mode": self.mode,
            "step": self.step,
            "loss": self.loss,
            "learning_rate": self.learning_rate,
            "grad_norm": None if math.isnan(self.grad_norm) else self.grad_norm,
            "loss_tokens": self.loss_tokens,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "time": self.time,
            **self.extra,
        }
        return json.dumps(data, separators=(",", ":"))


_TOP_LEVEL = {
    "job", "mode", "step", "loss", "learning_rate", "grad_norm", "loss_tokens", "tokens",
    "seconds", "tokens_per_second", "time",
}  # fmt: skip


def read_run_log(path: Path) -> list[StepRecord]:
    """The records of a run log, in order."""
    records: list[StepRecord] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        data = json.loads(line)
        grad = data.get("grad_norm")
        records.append(
            StepRecord(
                job=str(data["job"]),
                mode=str(data["mode"]),
                step=int(data["step"]),
                loss=float(data["loss"]),
                learning_rate=float(data["learning_rate"]),
                grad_norm=math.nan if grad is None else float(grad),
                loss_tokens=int(data["loss_tokens"]),
                tokens=int(data["tokens"]),
                seconds=float(data["seconds"]),
                tokens_per_second=float(data["tokens_per_second"]),
                time=float(data["time"]),
                extra={k: float(v) for k, v in data.items() if k not in _TOP_LEVEL},
            )
        )
    return records


class StepRecorder:
    """Writes step records to metrics and to the run log; use with `with` or call `close()`."""

    def __init__(
        self,
        run_log: Path | None,
        *,
        metrics: Any | None = None,
    ) -> None:
        """`metrics` is an `orchard.core.metrics.ServiceMetrics` for service "trainer", or None."""
        self.run_log = run_log
        self._handle: IO[str] | None = None
        if run_log is not None:
            run_log.parent.mkdir(parents=True, exist_ok=True)
            self._handle = run_log.open("a", encoding="utf-8")
        self._gauges: dict[str, Any] = {}
        self._steps = None
        self._tokens = None
        if metrics is not None:
            for key, name, doc in GAUGES:
                self._gauges[key] = metrics.gauge(name, doc, ["job", "mode"])
            self._steps = metrics.counter("steps_total", "Optimizer steps taken.", ["job", "mode"])
            self._tokens = metrics.counter(
                "tokens_total", "Tokens processed by optimizer steps.", ["job", "mode"]
            )

    def record(self, record: StepRecord) -> None:
        for key, gauge in self._gauges.items():
            value = record.value(key)
            if value is not None and not math.isnan(value):
                gauge.labels(job=record.job, mode=record.mode).set(value)
        if self._steps is not None and self._tokens is not None:
            self._steps.labels(job=record.job, mode=record.mode).inc()
            self._tokens.labels(job=record.job, mode=record.mode).inc(record.tokens)
        if self._handle is not None:
            self._handle.write(record.to_json() + "\n")
            self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> StepRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# What the plot shows, panel by panel, when the log has it.
_PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("learning_rate", "learning rate"),
    ("entropy", "entropy (nats)"),
    ("reward_mean", "reward mean"),
    ("clip_fraction", "clip fraction"),
    ("importance_mean", "importance weight mean"),
    ("kl_mean", "KL to reference"),
    ("tokens_per_second", "tokens / s"),
)


def plot_run_log(run_log: Path, png: Path) -> list[str]:
    """Draw the run log's curves against the step into `png`; returns the panels drawn."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    records = read_run_log(run_log)
    if not records:
        raise ValueError(f"run log {run_log} has no steps to plot")
    panels = [
        (key, title)
        for key, title in _PANELS
        if any(r.value(key) is not None and not math.isnan(r.value(key) or 0.0) for r in records)
    ]
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.8 * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (key, title) in zip(axes.flat, panels, strict=False):
        points = [(r.step, r.value(key)) for r in records if r.value(key) is not None]
        axis.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.2)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{records[0].job} ({records[0].mode})", fontsize=11)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return [key for key, _ in panels]
