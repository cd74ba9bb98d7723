"""``orchard-trainer``: offline SFT, dataset curation, plots of run logs, and the service.

::

    orchard-trainer serve --listen 127.0.0.1:7300 --etcd http://127.0.0.1:2379
    orchard-trainer worker --listen 0.0.0.0:7400 --key-file /etc/orchard-trainer/worker-key

    orchard-trainer sft --data trajectories.jsonl --model builtin:tiny --output runs/sft1 \\
        --steps 200 --lr 3e-3 --warmup 20 --micro-batch 16 --accumulate 2 --zero-stage 2
    orchard-trainer curate --data trajectories.jsonl --output curated.jsonl \\
        --token-limit 8192 --tools tools.json --parsable --shortest-successful --cap-per-source 50
    orchard-trainer plot runs/sft1/run.jsonl runs/sft1/run.png

The curation flags work on `sft` too (it then trains on the curated rows). The steps run in a
fixed order: token limit, parsable actions, known tools, shortest success per task, cap per
source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _add_curation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("curation (rows dropped before any sample is cut)")
    g.add_argument("--token-limit", type=int, default=None, help="drop rows over N tokens in all")
    g.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="[HARNESS=]FILE",
        help="JSON tool schema (a list of tools, or {'tools': [...]}); drop rows calling other "
        "tools or with arguments off the schema; HARNESS= limits it to that harness's rows "
        "(repeatable)",
    )
    g.add_argument(
        "--no-argument-check", action="store_true", help="with --tools, check tool names only"
    )
    g.add_argument("--parsable", action="store_true", help="drop rows with unparsable actions")
    g.add_argument(
        "--shortest-successful",
        action="store_true",
        help="keep only the shortest successful trajectory per task",
    )
    g.add_argument("--cap-per-source", type=int, default=None, help="most rows per source")
    g.add_argument(
        "--source-key", default="repository", help="metadata key naming the source of a row"
    )
    g.add_argument("--curation-report", type=Path, default=None, help="write the report (JSON)")


def _curation_steps(args: argparse.Namespace) -> list[Any]:
    from orchard.trainer import curation  # noqa: PLC0415

    steps: list[curation.CurationStep] = []
    if args.token_limit is not None:
        steps.append(curation.TokenLimit(args.token_limit))
    if args.parsable:
        steps.append(curation.ParsableActions())
    if args.tools:
        schemas: dict[str | None, curation.ToolSchema] = {}
        for spec in args.tools:
            harness, sep, file = spec.partition("=")
            if not sep:
                harness, file = "", spec
            key = harness if sep else None
            if key in schemas:
                raise curation.CurationError(f"--tools given twice for {key or 'all harnesses'}")
            schemas[key] = curation.load_tool_schema(Path(file))
        steps.append(curation.KnownTools(schemas, check_arguments=not args.no_argument_check))
    if args.shortest_successful:
        steps.append(curation.ShortestSuccessful())
    if args.cap_per_source is not None:
        steps.append(curation.CapPerSource(args.cap_per_source, args.source_key))
    return curation.default_order(steps)


def _report_curation(args: argparse.Namespace, result: Any, command: str) -> list[Any]:
    reports = [r.as_dict() for r in result.reports]
    if args.curation_report is not None:
        args.curation_report.write_text(json.dumps(reports, indent=2) + "\n", encoding="utf-8")
    if result.reports:
        print(f"orchard-trainer {command}: curation\n{result.summary()}", file=sys.stderr)
    return reports


def _sft_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on a trajectory dataset (JSONL)")
    p.add_argument("--data", type=Path, required=True, help="JSONL, one Trajectory per line")
    p.add_argument("--model", default="builtin:tiny", help="builtin:<size> or a local HF dir")
    p.add_argument("--output", type=Path, required=True, help="directory for log, plot, weights")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global norm clip; 0 is off")
    p.add_argument("--max-tokens", type=int, default=None, help="context window of a sample")
    p.add_argument(
        "--drop-long", action="store_true", help="drop over-long samples (default: left-truncate)"
    )
    p.add_argument(
        "--drop-over",
        type=int,
        default=None,
        help="drop samples over N tokens, whatever --drop-long says (truncate the rest)",
    )
    p.add_argument("--per-turn", action="store_true", help="one sample per trained turn")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="embedding size of a builtin model for synthetic token ids (default: the tokenizer's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_curation_args(p)


def _curate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("curate", help="filter a trajectory dataset (JSONL) into a new one")
    p.add_argument("--data", type=Path, required=True, help="JSONL, one Trajectory per line")
    p.add_argument("--output", type=Path, required=True, help="JSONL of the rows that survive")
    _add_curation_args(p)


def _run_curate(args: argparse.Namespace) -> int:
    from orchard.trainer.curation import CurationError, curate  # noqa: PLC0415
    from orchard.trainer.datasets import (  # noqa: PLC0415
        DatasetError,
        read_trajectories,
        write_trajectories,
    )

    try:
        steps = _curation_steps(args)
        if not steps:
            raise CurationError("no curation step chosen (see --help for the flags)")
        if args.output.resolve() == args.data.resolve():
            raise CurationError("--output must not be the --data file")
        result = curate(read_trajectories(args.data), steps)
        written = write_trajectories(args.output, result.rows)
        reports = _report_curation(args, result, "curate")
    except (CurationError, DatasetError, OSError) as exc:
        print(f"orchard-trainer curate: {exc}", file=sys.stderr)
        return 2
    rows_in = reports[0]["rows_in"]
    print(json.dumps({"rows_in": rows_in, "rows_out": written, "steps": reports}, indent=2))
    return 0


def _run_sft(args: argparse.Namespace) -> int:
    from orchard.trainer.curation import CurationError  # noqa: PLC0415
    from orchard.trainer.datasets import DatasetError  # noqa: PLC0415
    from orchard.trainer.engine import EngineConfig, Precision  # noqa: PLC0415
    from orchard.trainer.masks import Overflow, SampleConfig  # noqa: PLC0415
    from orchard.trainer.policy import PolicyError  # noqa: PLC0415
    from orchard.trainer.sft import SftRunConfig, run_offline_sft  # noqa: PLC0415

    try:
        config = SftRunConfig(
            data=args.data,
            model=args.model,
            output_dir=args.output,
            engine=EngineConfig(
                zero_stage=args.zero_stage,
                micro_batch_size=args.micro_batch,
                gradient_accumulation=args.accumulate,
                learning_rate=args.lr,
                warmup_steps=args.warmup,
                total_steps=args.steps,
                weight_decay=args.weight_decay,
                gradient_clipping=args.clip_grad,
                precision=Precision(args.precision),
                seed=args.seed,
            ),
            samples=SampleConfig(
                context_window=args.max_tokens,
                overflow=Overflow.DROP if args.drop_long else Overflow.TRUNCATE_LEFT,
                per_turn=args.per_turn,
                drop_over=args.drop_over,
            ),
            vocab_size=args.vocab_size,
            progress=not args.no_progress,
            curation=tuple(_curation_steps(args)),
        )
        result = run_offline_sft(config)
        curation = None
        if result.curation is not None:
            curation = _report_curation(args, result.curation, "sft")
    except (ValueError, DatasetError, PolicyError, CurationError, OSError) as exc:
        print(f"orchard-trainer sft: {exc}", file=sys.stderr)
        return 2
    if not result.steps:
        print("orchard-trainer sft: nothing to do (already at --steps)", file=sys.stderr)
        return 0
    summary = {
        "samples": result.samples,
        "skipped": dict(result.skipped),
        "curation": curation,
        "steps": len(result.steps),
        "first_loss": result.steps[0].loss,
        "last_loss": result.steps[-1].loss,
        "run_log": str(result.run_log),
        "plot": None if result.plot is None else str(result.plot),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from orchard.trainer.telemetry import plot_run_log  # noqa: PLC0415

    try:
        panels = plot_run_log(args.run_log, args.png)
    except (OSError, ValueError) as exc:
        print(f"orchard-trainer plot: {exc}", file=sys.stderr)
        return 2
    print(f"{args.png}: {', '.join(panels)}")
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from orchard.core.logging import configure_logging  # noqa: PLC0415
    from orchard.trainer.rank_worker import run_worker  # noqa: PLC0415

    if not args.key_file:
        print(
            "orchard-trainer worker: give the shared key's file (--key-file FILE or "
            "$ORCHARD_TRAINER_WORKER_KEY_FILE)",
            file=sys.stderr,
        )
        return 2
    configure_logging("trainer-worker", args.log_level)
    return run_worker(args.listen, args.key_file, stop_timeout_s=args.stop_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # The service parses its own configuration flags (--config, --set, --listen, ...).
        from orchard.trainer.main import serve  # noqa: PLC0415

        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="orchard-trainer", description="Orchard trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the TrainerService (see `orchard-trainer serve --help`)")
    worker = sub.add_parser(
        "worker",
        help="a standing worker that runs one rank of one job at a time for the trainer "
        "service (workers.kind: pods)",
    )
    worker.add_argument(
        "--listen", default="0.0.0.0:7400", metavar="HOST:PORT", help="address to listen on"
    )
    worker.add_argument(
        "--key-file",
        default=os.environ.get("ORCHARD_TRAINER_WORKER_KEY_FILE", ""),
        metavar="FILE",
        help="file holding the key shared with the trainer service "
        "(default: $ORCHARD_TRAINER_WORKER_KEY_FILE)",
    )
    worker.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long a rank may take to exit when its job ends before it is killed",
    )
    worker.add_argument("--log-level", default="INFO", help="logging level")
    _sft_parser(sub)
    _curate_parser(sub)
    plot = sub.add_parser("plot", help="draw a run log (run.jsonl) as a PNG")
    plot.add_argument("run_log", type=Path)
    plot.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _run_worker(args)
    if args.command == "sft":
        return _run_sft(args)
    if args.command == "curate":
        return _run_curate(args)
    return _run_plot(args)


if __name__ == "__main__":
    sys.exit(main())
