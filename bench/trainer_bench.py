"""Benchmark the trainer's SFT and RL steps against a plain PyTorch loop on the same model and data.

    .venv/bin/python bench/trainer_bench.py [--steps 20] [--warmup-steps 3] [--micro-batch 8]
        [--accumulate 1] [--turns 4] [--rounds 2] [--zero-stage 0] [--threads 1]

The model is ``builtin:tiny`` (the Qwen2 model built in code, with the offline tokenizer's
vocabulary). The data are synthetic multi-turn trajectories (``--turns`` turns of 48 input and
16 output tokens each, drawn from a seeded generator), the same for every run. Two runners:

- the trainer: SFT through ``TrainingEngine.sft_step`` (DeepSpeed, ZeRO ``--zero-stage``,
  torch AdamW, cosine schedule, gradient clipping) on micro-batches from ``MicroBatchPlan``; RL
  through ``rl_update`` (old log-probabilities recomputed with the current weights, then one
  step of the clipped objective with truncated importance weights) on batches of
  ``build_rl_batch`` (groups of four per task, two rewarded);
- a plain PyTorch loop on its own copy of the same model and the same micro-batches: for SFT
  ``sft_loss``, ``backward``, global-norm clipping, ``torch.optim.AdamW`` and the same schedule,
  no DeepSpeed; for RL the same recomputation under ``no_grad`` and the same ``policy_loss``.

Tokens/s counts real (unpadded) input tokens of the micro-batches over the wall time of the
measured steps (after ``--warmup-steps`` untimed ones); for RL the time includes the
recomputation of the old log-probabilities. The plain loop computes only its loss; the
engine's step also gathers its statistics (entropy, gradient norm, clip fractions, importance
weights). The ratio comes from a paired run: both runners in one process, their steps
alternating, so both see the same load on the machine. Each runner also runs alone in a fresh
process of its own, which gives its peak memory — the process's peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), in full and above what it held before its
first step (interpreter, torch, DeepSpeed when imported, the model and the data) — and its
tokens/s alone. ``--rounds`` repeats all of it and reports medians (and each round's ratio).
Runs use ``--threads`` torch threads (default 1: on a machine shared with other work, more
threads than free cores slow a small model down several times over); the load average before
and after is recorded. The last loss of each runner is reported too: the engine and the plain
loop train the same numbers, so they should agree.

The service trains on a worker group (``orchard.trainer.workers``): rank processes that the
controller drives over a socket. ``--ranks`` (default ``1,2``) runs SFT through that path, as
the service does (a ``WorkerGroup`` of ``RankTrainer`` processes, one ``run_steps`` command per
step, each rank on its share of the plan's micro-batches with ``--threads`` torch threads),
once per rank count, in the same run, paired the same way: the controller alternates a step of
the group with a step of a plain loop of its own, so they never compute at the same time. The
group's tokens/s counts all ranks' tokens over the controller's wall time per step (command
round trip included), beside the plain loop's, as ``group / plain``.

Writes ``bench/results/trainer.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "trainer.json"
MODEL = "builtin:tiny"
INPUT_TOKENS, OUTPUT_TOKENS, GROUP = 48, 16, 4
LR = 1e-3


def _mib(kib: int) -> float:
    return kib / 1024  # ru_maxrss is in KiB on Linux


def _trajectories(n: int, turns: int, vocab: int, seed: int) -> list[Any]:
    from orchard.types.v1 import reward_pb2, trajectory_pb2  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for k in range(n):
        t = trajectory_pb2.Trajectory(
            id=f"t{k}", rollout_id=f"r{k}", task_id=f"task{k // GROUP}", harness="builtin:swe"
        )
        for index in range(turns):
            t.turns.add(
                index=index,
                kind=trajectory_pb2.TURN_KIND_POLICY,
                input_token_ids=[rng.randrange(10, vocab) for _ in range(INPUT_TOKENS)],
                output_token_ids=[rng.randrange(10, vocab) for _ in range(OUTPUT_TOKENS)],
                output_logprobs=[-rng.uniform(0.5, 6.0) for _ in range(OUTPUT_TOKENS)],
            )
        t.reward.status = reward_pb2.REWARD_STATUS_SCORED
        t.reward.value = float(k % 2 == 0)  # two of four succeed: every advantage is +-1
        t.outcome = trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED
        out.append(t)
    return out


StepFn = Callable[[int], tuple[float, int, float]]
"""step index -> (seconds, tokens, loss)."""


def _child(mode: str, runner: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: `mode` sft|rl, `runner` engine|plain|paired.

    `paired` builds both runners, each on its own copy of the same model, and alternates their
    steps, so both see the same load on the machine; its ratio is the one reported.
    """
    import torch  # noqa: PLC0415
    from transformers import get_cosine_schedule_with_warmup  # noqa: PLC0415

    from orchard.trainer.batch import collate  # noqa: PLC0415
    from orchard.trainer.losses import policy_loss, sft_loss, token_logprobs  # noqa: PLC0415
    from orchard.trainer.masks import build_sft_samples  # noqa: PLC0415
    from orchard.trainer.microbatches import MicroBatchPlan  # noqa: PLC0415
    from orchard.trainer.policy import load_policy  # noqa: PLC0415
    from orchard.trainer.rl import RlConfig, build_rl_batch  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    total = args.warmup_steps + args.steps
    per_step = args.micro_batch * args.accumulate
    policy = load_policy(MODEL, seed=0)
    vocab = policy.model.config.vocab_size
    trajectories = _trajectories(total * per_step, args.turns, vocab, seed=1)
    rl_config = RlConfig()
    steps: list[list[Any]] = []
    rl_batches: list[Any] = []
    if mode == "sft":
        plan = MicroBatchPlan(
            build_sft_samples(trajectories).samples,
            micro_batch_size=args.micro_batch,
            gradient_accumulation=args.accumulate,
            world_size=1,
            pad_id=policy.pad_id,
            seed=0,
        )
        steps = [plan.for_step(s, 0) for s in range(total)]
    else:
        rl_batches = [
            build_rl_batch(trajectories[s * per_step : (s + 1) * per_step], rl_config)
            for s in range(total)
        ]
    closers: list[Callable[[], None]] = []

    def engine_runner(model: Any) -> StepFn:
        from orchard.trainer.engine import EngineConfig, Precision, TrainingEngine  # noqa: PLC0415
        from orchard.trainer.rl import rl_update  # noqa: PLC0415

        config = EngineConfig(
            zero_stage=args.zero_stage,
            micro_batch_size=args.micro_batch,
            gradient_accumulation=args.accumulate,
            learning_rate=LR,
            warmup_steps=1,
            total_steps=total,
            precision=Precision.FP32,
        )
        engine = TrainingEngine(model, config)
        closers.append(engine.close)

        def step(s: int) -> tuple[float, int, float]:
            started = time.perf_counter()
            if mode == "sft":
                results = [engine.sft_step(steps[s])]
            else:
                results = rl_update(engine, rl_batches[s], rl_config, pad_id=policy.pad_id)
            elapsed = time.perf_counter() - started
            return elapsed, sum(r.tokens for r in results), results[-1].loss

        return step

    def plain_runner(model: Any) -> StepFn:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999))
        schedule = get_cosine_schedule_with_warmup(optimizer, 1, total)

        def forward(m: Any) -> Any:
            return model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits

        def step(s: int) -> tuple[float, int, float]:
            started = time.perf_counter()
            old: list[Any] = []
            advantages: list[Any] = []
            if mode == "sft":
                micro = steps[s]
            else:
                batch = rl_batches[s]
                n = args.micro_batch
                pieces = [range(k * n, (k + 1) * n) for k in range(args.accumulate)]
                micro = [collate([batch.samples[i] for i in p], policy.pad_id) for p in pieces]
                advantages = [torch.tensor([batch.advantages[i] for i in p]) for p in pieces]
                torch.nn.Module.eval(model)
                with torch.no_grad():
                    old = [token_logprobs(forward(m), m.targets) for m in micro]
                torch.nn.Module.train(model)
            loss_sum = 0.0
            for k, m in enumerate(micro):
                logits = forward(m)
                if mode == "sft":
                    loss = sft_loss(logits, m.targets, m.loss_mask)
                else:
                    loss = policy_loss(
                        token_logprobs(logits, m.targets),
                        old[k],
                        advantages[k],
                        m.loss_mask,
                        config=rl_config.loss,
                        rollout_logprobs=m.rollout_logprobs,
                    ).loss
                torch.autograd.backward(loss / len(micro))
                loss_sum += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - started
            return elapsed, sum(int(m.attention_mask.sum()) for m in micro), loss_sum / len(micro)

        return step

    def group_runner(ranks: int) -> StepFn:
        """SFT through a worker group of `ranks` processes, as the trainer service runs a job:
        one `run_steps` command per step; all ranks' tokens over the controller's wall time."""
        from orchard.trainer.datasets import write_trajectories  # noqa: PLC0415
        from orchard.trainer.rank import RankSetup  # noqa: PLC0415
        from orchard.trainer.v1 import trainer_service_pb2 as api  # noqa: PLC0415
        from orchard.trainer.workers import WorkerGroup, WorkerGroupConfig  # noqa: PLC0415

        scratch = tempfile.TemporaryDirectory()
        closers.append(scratch.cleanup)
        data = Path(scratch.name) / "data.jsonl"
        write_trajectories(data, trajectories)
        spec = api.TrainingJobSpec(
            mode=api.TRAINING_MODE_SFT,
            model=MODEL,
            zero_stage=args.zero_stage,
            learning_rate=LR,
            warmup_steps=1,
            total_steps=total,
            micro_batch_size=args.micro_batch,
            gradient_accumulation=args.accumulate,
            ranks=ranks,
        )
        setup = RankSetup(
            job_id="bench",
            spec=spec.SerializeToString(),
            model=MODEL,
            scratch=scratch.name,
            rank=0,
            world_size=ranks,
            master_addr="127.0.0.1",
            master_port=0,
            dataset=str(data),
        )
        started = time.perf_counter()
        group, _ = WorkerGroup.start(
            "bench", setup, WorkerGroupConfig(ranks=ranks, threads_per_rank=args.threads)
        )
        group_start[0] = time.perf_counter() - started
        closers.insert(0, group.close)

        def step(s: int) -> tuple[float, int, float]:
            started = time.perf_counter()
            (result,) = group.call("run_steps", steps=1)
            return time.perf_counter() - started, result.tokens, result.loss

        return step

    group_start = [0.0]
    if runner.startswith("group"):
        names = ["group", "plain"]
    else:
        names = ["engine", "plain"] if runner == "paired" else [runner]
    runners: dict[str, StepFn] = {}
    for k, name in enumerate(names):
        model = policy.model if k == 0 else load_policy(MODEL, seed=0).model
        if name == "group":
            runners[name] = group_runner(int(runner.removeprefix("group")))
        else:
            runners[name] = engine_runner(model) if name == "engine" else plain_runner(model)
    n_params = sum(p.numel() for p in policy.model.parameters())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    records: dict[str, list[tuple[float, int, float]]] = {name: [] for name in names}
    try:
        for s in range(total):
            order = names if s % 2 == 0 else names[::-1]
            for name in order:
                records[name].append(runners[name](s))
    finally:
        for close in closers:
            close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, Any] = {"parameters": n_params, "threads": torch.get_num_threads()}
    for name, rows in records.items():
        measured = rows[args.warmup_steps :]
        out[name] = {
            "tokens_per_second": sum(t for _, t, _ in measured) / sum(x for x, _, _ in measured),
            "step_seconds_p50": statistics.median(x for x, _, _ in measured),
            "tokens_per_step": statistics.mean(t for _, t, _ in measured),
            "last_loss": rows[-1][2],
        }
    if runner.startswith("group"):
        out["group"]["start_seconds"] = group_start[0]
    elif runner != "paired":
        out[runner].update(
            peak_rss_mib=_mib(peak),
            rss_before_steps_mib=_mib(rss_before),
            peak_rss_above_start_mib=_mib(peak - rss_before),
        )
    return out


def _run_child(mode: str, runner: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable, __file__, "--child", mode, runner, "--child-out", out.name,
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--micro-batch", str(args.micro_batch), "--accumulate", str(args.accumulate),
            "--turns", str(args.turns), "--zero-stage", str(args.zero_stage),
            "--threads", str(args.threads),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the {mode} {runner} run failed:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--turns", type=int, default=4, help="turns per trajectory")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=2, help="repeats of the runs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (1: steadier when shared)"
    )
    parser.add_argument(
        "--ranks", default="1,2", help="rank counts of the worker-group SFT runs (comma list)"
    )
    parser.add_argument("--child", nargs=2, metavar=("MODE", "RUNNER"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rank_counts = [int(n) for n in args.ranks.split(",") if n.strip()]
    if args.child:
        mode, runner = args.child
        args.child_out.write_text(json.dumps(_child(mode, runner, args)))
        return 0

    import deepspeed  # noqa: PLC0415
    import torch  # noqa: PLC0415

    load_before = os.getloadavg()[0]
    paired: dict[str, list[dict[str, Any]]] = {"sft": [], "rl": []}
    alone: dict[tuple[str, str], list[dict[str, Any]]] = {}
    groups: dict[int, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        order = ["plain", "engine"] if round_ % 2 == 0 else ["engine", "plain"]
        for mode in ("sft", "rl"):
            paired[mode].append(_run_child(mode, "paired", args))
            for runner in order:
                run = _run_child(mode, runner, args)
                alone.setdefault((mode, runner), []).append(run[runner])
        for ranks in rank_counts:
            groups.setdefault(ranks, []).append(_run_child("sft", f"group{ranks}", args))
    first = paired["sft"][0]

    def combined(mode: str, runner: str) -> dict[str, Any]:
        rounds = [r[runner] for r in paired[mode]]
        out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        out["tokens_per_second_rounds"] = [r["tokens_per_second"] for r in rounds]
        by_itself = alone[mode, runner]
        out["tokens_per_second_alone"] = statistics.median(
            r["tokens_per_second"] for r in by_itself
        )
        out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in by_itself)
        out["rss_before_steps_mib"] = statistics.median(
            r["rss_before_steps_mib"] for r in by_itself
        )
        out["peak_rss_above_start_mib"] = max(r["peak_rss_above_start_mib"] for r in by_itself)
        return out

    sequence_tokens = args.turns * (INPUT_TOKENS + OUTPUT_TOKENS)
    result: dict[str, Any] = {
        "model": MODEL,
        "parameters": first["parameters"],
        "sequence_tokens": sequence_tokens,
        "micro_batch": args.micro_batch,
        "accumulate": args.accumulate,
        "zero_stage": args.zero_stage,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "rounds": args.rounds,
        "threads": first["threads"],
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        "throughput_measure": "paired: engine and plain steps alternate in one process",
        "memory_measure": "peak RSS of each runner's own process, resource.getrusage ru_maxrss",
    }
    for mode in ("sft", "rl"):
        ratios = [
            r["engine"]["tokens_per_second"] / r["plain"]["tokens_per_second"] for r in paired[mode]
        ]
        result[mode] = {
            "engine": combined(mode, "engine"),
            "plain_pytorch": combined(mode, "plain"),
            "engine_over_plain_tokens_per_second": statistics.median(ratios),
            "ratio_rounds": ratios,
        }
    result["sft"]["worker_group"] = {
        str(ranks): {
            "tokens_per_second": statistics.median(r["group"]["tokens_per_second"] for r in runs),
            "plain_tokens_per_second": statistics.median(
                r["plain"]["tokens_per_second"] for r in runs
            ),
            "step_seconds_p50": statistics.median(r["group"]["step_seconds_p50"] for r in runs),
            "tokens_per_step": runs[0]["group"]["tokens_per_step"],
            "start_seconds": statistics.median(r["group"]["start_seconds"] for r in runs),
            "last_loss": runs[-1]["group"]["last_loss"],
            "group_over_plain_tokens_per_second": statistics.median(
                r["group"]["tokens_per_second"] / r["plain"]["tokens_per_second"] for r in runs
            ),
            "ratio_rounds": [
                r["group"]["tokens_per_second"] / r["plain"]["tokens_per_second"] for r in runs
            ],
        }
        for ranks, runs in groups.items()
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"trainer bench: {MODEL} ({result['parameters'] / 1e6:.2f} M parameters), "
        f"{args.micro_batch} x {sequence_tokens} tokens per micro-batch, {args.steps} steps, "
        f"ZeRO {args.zero_stage}, {result['threads']} thread(s), median of {args.rounds} rounds, "
        f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = (
        f"  {'step':<5} {'runner':<15} {'tokens/s':>9} {'alone':>7} {'s/step':>7} "
        f"{'peak RSS':>10} {'above start':>12} {'last loss':>10}"
    )
    print(header)
    for mode in ("sft", "rl"):
        for key, name in (("engine", "TrainingEngine"), ("plain_pytorch", "plain PyTorch")):
            r = result[mode][key]
            print(
                f"  {mode:<5} {name:<15} {r['tokens_per_second']:>9.0f} "
                f"{r['tokens_per_second_alone']:>7.0f} "
                f"{r['step_seconds_p50']:>7.3f} {r['peak_rss_mib']:>7.0f} MiB "
                f"{r['peak_rss_above_start_mib']:>8.0f} MiB {r['last_loss']:>10.4f}"
            )
        ratio = result[mode]["engine_over_plain_tokens_per_second"]
        spread = ", ".join(f"{x:.2f}" for x in result[mode]["ratio_rounds"])
        print(f"  {mode:<5} {'engine / plain':<15} {ratio:>8.2f}x  (rounds: {spread})")
    print("  worker group (the service's path), paired with a plain loop in its controller:")
    for ranks, r in result["sft"]["worker_group"].items():
        name = f"{ranks} rank" + ("s" if ranks != "1" else "")
        spread = ", ".join(f"{x:.2f}" for x in r["ratio_rounds"])
        print(
            f"  {'sft':<5} {name:<15} {r['tokens_per_second']:>9.0f} {'':>7} "
            f"{r['step_seconds_p50']:>7.3f} {'':>10} {'':>12} {r['last_loss']:>10.4f}   "
            f"plain {r['plain_tokens_per_second']:.0f} tok/s: "
            f"{r['group_over_plain_tokens_per_second']:.2f}x (rounds: {spread}), "
            f"start {r['start_seconds']:.1f} s"
        )
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
