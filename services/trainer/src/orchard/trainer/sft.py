"""Offline SFT: a trajectory dataset in, a trained policy, a run log and a plot out.

The run reads the JSONL dataset, runs its curation steps when it has any
(`orchard.trainer.curation`), cuts SFT samples with their loss masks
(`orchard.trainer.masks`), plans micro-batches for every (step, rank)
(`orchard.trainer.microbatches`), and runs `total_steps` optimizer steps through the DeepSpeed
engine with a progress bar on rank 0. Every step goes to the run log (`run.jsonl` in the output
directory) and, when given, to Prometheus gauges; the run ends with a plot of the log
(`run.png`) when matplotlib is installed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from orchard.trainer.curation import CurationResult, CurationStep, curate
from orchard.trainer.datasets import read_trajectories
from orchard.trainer.distributed import ProcessGroupSpec
from orchard.trainer.engine import EngineConfig, StepResult, TrainingEngine
from orchard.trainer.masks import SampleConfig
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import load_policy
from orchard.trainer.telemetry import StepRecord, StepRecorder, plot_run_log

__all__ = ["SftRunConfig", "SftRunResult", "run_offline_sft"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SftRunConfig:
    """One offline SFT run."""

    data: Path
    """JSONL of `orchard.types.v1.Trajectory`."""
    model: str
    """`builtin:<size>` or a local Hugging Face model directory (a vision-language model's
    too: its samples carry their screenshots, `orchard.trainer.vision`)."""
    output_dir: Path
    """Run log, plot and checkpoints go here."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    samples: SampleConfig = field(default_factory=SampleConfig)
    vocab_size: int | None = None
    """Embedding size of a built-in model for synthetic token ids; None: the offline
    tokenizer's vocabulary (a loaded model brings its own)."""
    job: str = "sft"
    """Name of the run in the log and the metrics."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    plot: bool = True
    curation: Sequence[CurationStep] = ()
    """Steps that filter the dataset's rows, in order, before samples are cut."""


@dataclass(frozen=True, slots=True)
class SftRunResult:
    steps: list[StepResult]
    samples: int
    skipped: Counter[str]
    run_log: Path | None
    plot: Path | None
    engine: TrainingEngine | None = field(default=None, repr=False)
    """The engine, still open, when the caller asked to keep it."""
    curation: CurationResult | None = field(default=None, repr=False)
    """What the curation steps kept and dropped (None without steps)."""


def run_offline_sft(
    config: SftRunConfig,
    *,
    process_group: ProcessGroupSpec | None = None,
    metrics: Any | None = None,
    keep_engine: bool = False,
    on_step: Callable[[StepResult], None] | None = None,
) -> SftRunResult:
    """Train, log, plot; returns the steps' results (and the open engine with `keep_engine`)."""
    rows = read_trajectories(config.data)
    curated = None
    if config.curation:
        curated = curate(rows, config.curation)
        log.info("sft curation\n%s", curated.summary())
    policy = load_policy(config.model, vocab_size=config.vocab_size, seed=config.engine.seed)
    # The policy cuts the samples: a vision-language model's carry their screenshots.
    sample_set = policy.build_sft_samples(rows if curated is None else curated.rows, config.samples)
    skipped = Counter({str(reason): n for reason, n in sample_set.skipped.items()})
    log.info(
        "sft samples",
        extra={"samples": len(sample_set.samples), "skipped": dict(skipped)},
    )
    engine = TrainingEngine(policy.model, config.engine, process_group=process_group)
    plan = MicroBatchPlan(
        sample_set.samples,
        micro_batch_size=config.engine.micro_batch_size,
        gradient_accumulation=config.engine.gradient_accumulation,
        world_size=engine.world_size,
        pad_id=policy.pad_id,
        seed=config.engine.seed,
        collate_fn=policy.collate,
    )
    main_rank = engine.rank == 0
    run_log = config.output_dir / "run.jsonl" if main_rank else None
    if run_log is not None and run_log.exists():
        run_log.unlink()
    results: list[StepResult] = []
    try:
        with (
            StepRecorder(run_log, metrics=metrics if main_rank else None) as recorder,
            tqdm(
                total=config.engine.total_steps,
                desc=f"sft {config.job}",
                unit="step",
                disable=not (config.progress and main_rank),
            ) as bar,
        ):
            for step in range(engine.global_step, config.engine.total_steps):
                result = engine.sft_step(plan.for_step(step, engine.rank))
                results.append(result)
                recorder.record(StepRecord.of(config.job, "sft", result))
                bar.set_postfix(
                    loss=f"{result.loss:.4f}",
                    lr=f"{result.learning_rate:.2e}",
                    tok_s=f"{result.tokens_per_second:.0f}",
                    epoch=f"{plan.epoch_of(step):.2f}",
                )
                bar.update(1)
                if on_step is not None:
                    on_step(result)
        plot = None
        if run_log is not None and config.plot and results:
            plot = _plot(run_log, config.output_dir / "run.png")
    except BaseException:
        engine.close()
        raise
    if not keep_engine:
        engine.close()
    torch.distributed.barrier()
    return SftRunResult(
        steps=results,
        samples=len(sample_set.samples),
        skipped=skipped,
        run_log=run_log,
        plot=plot,
        engine=engine if keep_engine else None,
        curation=curated,
    )


def _plot(run_log: Path, png: Path) -> Path | None:
    try:
        plot_run_log(run_log, png)
    except ImportError:
        log.warning("matplotlib is not installed; no plot of the run log")
        return None
    return png
