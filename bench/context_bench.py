"""Benchmark the long-context built-in student against tiny: engine prefill and decode, trainer
step and peak memory at the prompt lengths real agent programs send.

    .venv/bin/python bench/context_bench.py [--lengths 4096,16384,32768] [--decode-tokens 16]
        [--repeats 2] [--threads 1] [--skip-pair] [--padded-pair]

Agent programs (OpenClaw, Claude Code, Codex, hermes) send 12-23k tokens of system prompt and
tool schemas per call in Orchard's tokenizer. ``builtin:tiny-32k`` (tiny's shape, a 32,768-token
context) holds them; it is measured at each of ``--lengths`` tokens of context, beside
``builtin:tiny`` at its whole 2,048-token context as the baseline. A row of length N is a prompt
of N - ``--decode-tokens`` random token ids (seeded) followed by ``--decode-tokens`` sampled
ones, so prompt and output fill N.

- engine: the model built as the trainer's PublishModel builds it (``load_policy`` from seed 0,
  saved with ``save_model_folder`` and loaded back with ``load_model_folder``), served by the
  local CPU engine (``LocalEngine``) and asked greedily through ``generate``. Prefill is the
  latency of a request for one token (the prompt's forward pass and one sample); decode is the
  wall time per token after the first of a request for ``--decode-tokens`` tokens, from the
  end of its prefill forward pass (timed by hooks on the model) to its answer: one forward pass
  over the cache of that context and one sample per token. Medians of ``--repeats`` requests
  after one untimed request. At the longest length the long prompt is
  also sent together with a short one (8 tokens), so both form one batch: the engine prefills
  rows of different lengths one by one, so the pair should cost what the long prompt costs
  alone (``--skip-pair`` leaves that row out).
- trainer: one SFT optimizer step on one sequence of N tokens (the last ``--decode-tokens``
  in the loss) through ``TrainingEngine.sft_step`` (DeepSpeed ZeRO 0, torch AdamW, fp32),
  micro-batch 1: forward, backward and the optimizer step. Median of ``--repeats`` steps (the
  first step is one of them). ``--padded-pair`` adds a step on two sequences of 16,384 and
  8,192 tokens in one right-padded micro-batch, which makes the attention build its padding
  mask in full (slow; off by default).

Every measurement runs in a fresh process of its own, which gives its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), in full and above what the process held before
the measured work (interpreter, torch, DeepSpeed for the trainer, the model). Runs use
``--threads`` torch threads (default 1: steadier on a machine shared with other work); the load
average before and after is recorded.

Writes ``bench/results/context.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "context.json"
BASELINE = ("builtin:tiny", 2048)
LONG_MODEL = "builtin:tiny-32k"
SHORT_PROMPT = 8
PADDED_PAIR = (16_384, 8_192)


def _mib(kib: int) -> float:
    return kib / 1024  # ru_maxrss is in KiB on Linux


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _token_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def _engine_child(model: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode of one prompt filling `length` tokens, on the local engine; with
    `args.pair`, the prompt and a short one sent together instead."""
    import torch  # noqa: PLC0415

    from orchard.lm.model_folder import load_model_folder, save_model_folder  # noqa: PLC0415
    from orchard.rollout.engines.base import SamplingParams  # noqa: PLC0415
    from orchard.rollout.engines.local import (  # noqa: PLC0415
        LoadedWeights,
        LocalEngine,
        LocalEngineConfig,
    )
    from orchard.trainer.policy import load_policy  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    policy = load_policy(model, seed=0)
    assert policy.tokenizer is not None  # built-in models carry the offline tokenizer
    vocab = int(policy.model.config.vocab_size)
    prompt = _token_ids(length - args.decode_tokens, vocab, seed=1)
    short = _token_ids(SHORT_PROMPT, vocab, seed=2)
    with tempfile.TemporaryDirectory() as scratch:
        folder = save_model_folder(Path(scratch) / "model", policy.model, policy.tokenizer)
        del policy
        loaded = load_model_folder(folder)
    # Each forward pass the engine makes: (query tokens, start, end), from the model's hooks.
    forwards: list[tuple[int, float, float]] = []
    started_at = [0.0]

    def before(module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        started_at[0] = time.perf_counter()

    def after(module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        forwards.append((int(kwargs["input_ids"].shape[1]), started_at[0], time.perf_counter()))

    loaded.model.register_forward_pre_hook(before, with_kwargs=True)
    loaded.model.register_forward_hook(after, with_kwargs=True)
    weights = LoadedWeights(model=loaded.model, tokenizer=loaded.tokenizer, version="bench")

    async def measure() -> dict[str, Any]:
        async with LocalEngine(LocalEngineConfig(), weights=weights) as engine:

            async def request(max_tokens: int, *, pair: bool = False) -> dict[str, float]:
                params = SamplingParams(max_tokens=max_tokens, temperature=0)
                forwards.clear()
                started = time.perf_counter()
                if pair:
                    done, _ = await asyncio.gather(
                        engine.generate(prompt, params), engine.generate(short, params)
                    )
                else:
                    done = await engine.generate(prompt, params)
                ended = time.perf_counter()
                prefill_end = max(end for q, _, end in forwards if q > 1)
                steps = [end - start for q, start, end in forwards if q == 1]
                tokens = len(done.token_ids)
                return {
                    "latency": ended - started,
                    "prefill_forward": sum(end - start for q, start, end in forwards if q > 1),
                    # the wall time per token after the first: forward pass and sampling
                    "decode_per_token": (ended - prefill_end) / max(tokens - 1, 1),
                    "decode_forward": statistics.median(steps) if steps else 0.0,
                }

            rss_before = _peak_kib()
            await request(2)  # untimed: first-call allocations
            out: dict[str, Any] = {"context_length": engine.context_length}
            if args.pair:
                pairs = [await request(1, pair=True) for _ in range(args.repeats)]
                out["pair_prefill_seconds"] = statistics.median(r["latency"] for r in pairs)
                out["batch_sizes"] = engine.batch_sizes[1:]
            else:
                firsts = [await request(1) for _ in range(args.repeats)]
                decodes = [await request(args.decode_tokens) for _ in range(args.repeats)]
                out["prefill_seconds"] = statistics.median(r["latency"] for r in firsts)
                out["prefill_forward_seconds"] = statistics.median(
                    r["prefill_forward"] for r in firsts
                )
                out["decode_ms_per_token"] = 1000 * statistics.median(
                    r["decode_per_token"] for r in decodes
                )
                out["decode_forward_ms"] = 1000 * statistics.median(
                    r["decode_forward"] for r in decodes
                )
            out["rss_before_mib"] = _mib(rss_before)
            return out

    out = asyncio.run(measure())
    peak = _peak_kib()
    out.update(
        prompt_tokens=len(prompt),
        peak_rss_mib=_mib(peak),
        peak_rss_above_start_mib=_mib(peak) - out["rss_before_mib"],
    )
    return out


def _trainer_child(model: str, lengths: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """SFT steps on one micro-batch of sequences of `lengths` tokens."""
    import torch  # noqa: PLC0415

    from orchard.trainer.batch import collate  # noqa: PLC0415
    from orchard.trainer.engine import EngineConfig, Precision, TrainingEngine  # noqa: PLC0415
    from orchard.trainer.masks import Sample  # noqa: PLC0415
    from orchard.trainer.policy import load_policy  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    policy = load_policy(model, seed=0)
    vocab = int(policy.model.config.vocab_size)
    samples = []
    for k, n in enumerate(lengths):
        loss = args.decode_tokens
        samples.append(
            Sample(
                trajectory_id=f"t{k}",
                token_ids=tuple(_token_ids(n, vocab, seed=3 + k)),
                loss_mask=(False,) * (n - loss) + (True,) * loss,
                rollout_logprobs=(0.0,) * n,
            )
        )
    batch = collate(samples, policy.pad_id)
    engine = TrainingEngine(
        policy.model,
        EngineConfig(
            micro_batch_size=len(lengths),
            learning_rate=1e-4,
            total_steps=args.repeats,
            precision=Precision.FP32,
        ),
    )
    rss_before = _peak_kib()
    try:
        steps = [engine.sft_step([batch]) for _ in range(args.repeats)]
    finally:
        engine.close()
    peak = _peak_kib()
    return {
        "sequence_tokens": lengths,
        "step_seconds": statistics.median(s.seconds for s in steps),
        "step_seconds_all": [s.seconds for s in steps],
        "tokens_per_second": statistics.median(s.tokens_per_second for s in steps),
        "loss": steps[-1].loss,
        "peak_rss_mib": _mib(peak),
        "rss_before_mib": _mib(rss_before),
        "peak_rss_above_start_mib": _mib(peak - rss_before),
    }


def _run_child(part: str, model: str, lengths: list[int], args: argparse.Namespace) -> Any:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable, __file__, "--child", part, model, ",".join(map(str, lengths)),
            "--child-out", out.name, "--decode-tokens", str(args.decode_tokens),
            "--repeats", str(args.repeats), "--threads", str(args.threads),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"the {part} run of {model} at {lengths} failed:\n{done.stderr}")
        return json.loads(Path(out.name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", default="4096,16384,32768", help="context tokens of the tiny-32k rows"
    )
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens sampled a row")
    parser.add_argument("--repeats", type=int, default=2, help="timed requests and steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--skip-pair", action="store_true", help="no long + short batch row")
    parser.add_argument(
        "--padded-pair", action="store_true", help="also train on a padded 16k + 8k micro-batch"
    )
    parser.add_argument(
        "--child", nargs=3, metavar=("PART", "MODEL", "LENGTHS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        part, model, lengths_text = args.child
        lengths = [int(n) for n in lengths_text.split(",")]
        args.pair = part == "pair"
        measured_here = (
            _trainer_child(model, lengths, args)
            if part == "trainer"
            else _engine_child(model, lengths[0], args)
        )
        args.child_out.write_text(json.dumps(measured_here))
        return 0

    import torch  # noqa: PLC0415

    load_before = os.getloadavg()[0]
    rows: list[tuple[str, int]] = [BASELINE]
    rows += [(LONG_MODEL, int(n)) for n in args.lengths.split(",") if n.strip()]
    measured: list[dict[str, Any]] = []
    for model, length in rows:
        row = {
            "model": model,
            "context_tokens": length,
            "engine": _run_child("engine", model, [length], args),
            "trainer": _run_child("trainer", model, [length], args),
        }
        measured.append(row)
        print(f"  measured {model} at {length} tokens", file=sys.stderr)
    longest = max(rows[1:], key=lambda r: r[1]) if len(rows) > 1 else None
    pair = None
    if longest is not None and not args.skip_pair:
        pair = {
            "model": longest[0],
            "long_prompt_tokens": longest[1] - args.decode_tokens,
            "short_prompt_tokens": SHORT_PROMPT,
            **_run_child("pair", longest[0], [longest[1]], args),
        }
    padded = None
    if args.padded_pair:
        padded = {"model": LONG_MODEL, **_run_child("trainer", LONG_MODEL, list(PADDED_PAIR), args)}
    result: dict[str, Any] = {
        "benchmark": "context",
        "baseline": {"model": BASELINE[0], "context_tokens": BASELINE[1]},
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        "memory_measure": "peak RSS of each measurement's own process, ru_maxrss",
        "rows": measured,
        "long_beside_short": pair,
        "trainer_padded_pair": padded,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"context bench: {LONG_MODEL} against {BASELINE[0]} at {BASELINE[1]}, "
        f"{args.decode_tokens} decoded tokens, median of {args.repeats}, {args.threads} "
        f"thread(s), load {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"  {'model':<17} {'tokens':>6} {'prefill s':>10} {'decode ms/tok':>14} "
        f"{'engine RSS':>11} {'train step s':>13} {'train RSS':>10} {'above start':>12}"
    )
    for row in measured:
        engine, trainer = row["engine"], row["trainer"]
        print(
            f"  {row['model']:<17} {row['context_tokens']:>6} {engine['prefill_seconds']:>10.2f} "
            f"{engine['decode_ms_per_token']:>14.1f} {engine['peak_rss_mib']:>7.0f} MiB "
            f"{trainer['step_seconds']:>13.2f} {trainer['peak_rss_mib']:>6.0f} MiB "
            f"{trainer['peak_rss_above_start_mib']:>8.0f} MiB"
        )
    if pair is not None:
        print(
            f"  {pair['long_prompt_tokens']}-token prompt beside an {SHORT_PROMPT}-token one "
            f"(batches {pair['batch_sizes']}): prefill {pair['pair_prefill_seconds']:.2f} s, "
            f"engine RSS {pair['peak_rss_mib']:.0f} MiB"
        )
    if padded is not None:
        print(
            f"  trainer, one padded micro-batch of {PADDED_PAIR[0]} + {PADDED_PAIR[1]} tokens: "
            f"step {padded['step_seconds']:.2f} s, RSS {padded['peak_rss_mib']:.0f} MiB "
            f"({padded['peak_rss_above_start_mib']:.0f} MiB above start)"
        )
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
