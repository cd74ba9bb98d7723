"""The RL loop on one accelerator: an inference engine samples groups, DeepSpeed trains a
policy-gradient step on them, the new weights are saved as a model folder and loaded into the
running engine (`load_version`: in place on vLLM with CUDA), and the next step samples with
them. Prints per step the sampled tokens/s, the training step and the weight-sync time, then
one JSON line with the totals; fails (status 1) when a step samples with the wrong version.

    python tools/gpu_check.py --engine vllm      # one GPU (tools/gpu-check.sh sets it up)
    python tools/gpu_check.py --engine local     # the same loop on the CPU engine

The policy is a small model built here (nothing is downloaded); the reward is the share of the
letter "a" in each answer, so it has something to climb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from orchard.lm.chat import ChatRenderer
from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.engines import create_engine
from orchard.rollout.engines.base import Generation, SamplingParams
from orchard.rollout.engines.config import EngineConfig, LocalEngineConfig, VllmEngineConfig
from orchard.trainer.batch import TokenBatch
from orchard.trainer.engine import EngineConfig as TrainConfig
from orchard.trainer.engine import LossFn, TrainingEngine
from orchard.trainer.losses import token_logprobs


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "local"), default="vllm")
    parser.add_argument("--steps", type=int, default=5, help="RL steps (default 5)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size")
    parser.add_argument("--layers", type=int, default=8, help="the model's layers")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    return parser.parse_args(argv)


async def _loop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --engine vllm needs a CUDA GPU; torch sees none")
    tokenizer = build_tokenizer()
    renderer = ChatRenderer(tokenizer)
    context = 512
    model = tiny_causal_lm_for(
        tokenizer,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 256),
        context=context,
    )
    params = sum(p.numel() for p in model.parameters())
    folder = save_model_folder(work / "step-0", model, tokenizer)
    batch_rows = args.prompts * args.group
    config: EngineConfig
    if args.engine == "vllm":
        config = VllmEngineConfig(
            model_folder=str(folder),
            weight_version="step-0",
            reload="in_place",
            max_model_len=context,
            gpu_memory_utilization=0.35,
            enforce_eager=args.eager,
        )
    else:
        config = LocalEngineConfig(
            model_folder=str(folder), weight_version="step-0", max_batch_size=batch_rows
        )
    started = time.perf_counter()
    engine = create_engine(config)
    await engine.start()  # before the trainer touches CUDA: vLLM's workers are processes
    engine_start_s = time.perf_counter() - started
    trainer = TrainingEngine(
        model,
        TrainConfig(
            zero_stage=args.zero_stage,
            micro_batch_size=batch_rows,
            learning_rate=args.lr,
            total_steps=max(args.steps, 1),
        ),
    )
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    prompts = [
        list(renderer.render([{"role": "user", "content": f"Say a {i} times."}]).token_ids)
        for i in range(args.prompts)
    ]
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=1.0, stop_token_ids=tuple(renderer.stop_token_ids)
    )
    steps: list[dict[str, Any]] = []
    try:
        for step in range(1, args.steps + 1):
            version = engine.weight_version
            begun = time.perf_counter()
            generations: list[Generation] = await asyncio.gather(
                *(engine.generate(p, sampling) for p in prompts for _ in range(args.group))
            )
            sample_s = time.perf_counter() - begun
            if any(g.weight_version != version for g in generations):
                raise SystemExit(f"gpu_check: step {step} sampled with another version")
            sampled = sum(len(g.token_ids) for g in generations)
            rewards = []
            for g in generations:
                text = tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
                rewards.append(text.count("a") / max(1, len(text)))
            advantages = []
            for k in range(args.prompts):
                group = rewards[k * args.group : (k + 1) * args.group]
                mean, spread = statistics.fmean(group), statistics.pstdev(group)
                advantages += [(r - mean) / (spread + 1e-6) for r in group]
            rows = [(prompts[i // args.group], g) for i, g in enumerate(generations) if g.token_ids]
            advantage = torch.tensor(
                [advantages[i] for i, g in enumerate(generations) if g.token_ids]
            )
            batch = _batch(rows, pad)
            result = trainer.step([batch], _policy_gradient(advantage))
            begun = time.perf_counter()
            new_folder = save_model_folder(work / f"step-{step}", trainer.module, tokenizer)
            save_s = time.perf_counter() - begun
            await engine.load_version(f"step-{step}", str(new_folder))
            sync_s = time.perf_counter() - begun
            if engine.weight_version != f"step-{step}":
                raise SystemExit(f"gpu_check: step-{step} was not loaded")
            steps.append(
                {
                    "step": step,
                    "reward": statistics.fmean(rewards),
                    "sampled_tokens": sampled,
                    "tokens_per_s": sampled / sample_s,
                    "train_s": result.seconds,
                    "train_tokens_per_s": result.tokens / result.seconds,
                    "loss": result.loss,
                    "logprob_gap": result.extra.get("logprob_gap", float("nan")),
                    "weight_sync_s": sync_s,
                    "save_s": save_s,
                }
            )
            row = steps[-1]
            print(
                f"step {step}: reward {row['reward']:.3f}, {sampled} tokens sampled at "
                f"{row['tokens_per_s']:.0f} tok/s, train {row['train_s']:.2f} s "
                f"({row['train_tokens_per_s']:.0f} tok/s), weight sync {sync_s:.2f} s "
                f"(save {save_s:.2f} s), |trainer - engine logprob| {row['logprob_gap']:.4f}",
                flush=True,
            )
    finally:
        trainer.close()
        await engine.close()
    reload = getattr(engine, "reload_mode", "swap")
    return {
        "engine": args.engine,
        "reload": reload,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model_parameters": params,
        "engine_start_s": engine_start_s,
        "tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in steps),
        "train_tokens_per_s": statistics.fmean(s["train_tokens_per_s"] for s in steps),
        "weight_sync_s": statistics.fmean(s["weight_sync_s"] for s in steps),
        "weight_sync_max_s": max(s["weight_sync_s"] for s in steps),
        "reward_first": steps[0]["reward"],
        "reward_last": steps[-1]["reward"],
        "steps": steps,
    }


def _batch(rows: list[tuple[list[int], Generation]], pad: int) -> TokenBatch:
    """Prompt + answer per row, shifted (position t predicts target t), right-padded; the
    loss mask and the engine's logprobs cover the answer tokens."""
    width = max(len(p) + len(g.token_ids) for p, g in rows) - 1
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad, dtype=torch.long)
    targets = torch.full(shape, pad, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for i, (prompt, generation) in enumerate(rows):
        tokens = torch.tensor(prompt + list(generation.token_ids), dtype=torch.long)
        n, first = len(tokens) - 1, len(prompt) - 1
        input_ids[i, :n], targets[i, :n], attention[i, :n] = tokens[:-1], tokens[1:], 1
        loss_mask[i, first:n] = True
        logprobs[i, first:n] = torch.tensor(generation.logprobs, dtype=torch.float32)
    return TokenBatch(input_ids, attention, targets, loss_mask, logprobs)


def _policy_gradient(advantage: torch.Tensor) -> LossFn:
    """REINFORCE with group-normalized advantages, averaged over answer tokens; also reports
    how far the trainer's logprobs are from the engine's for the same tokens."""

    def loss_fn(logits: torch.Tensor, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = token_logprobs(logits, batch.targets)
        mask = batch.loss_mask.float()
        weights = advantage.to(logp.device).unsqueeze(1) * mask
        loss = -(logp * weights).sum() / mask.sum().clamp(min=1)
        gap = ((logp.detach() - batch.rollout_logprobs).abs() * mask).sum() / mask.sum()
        return loss, {"logprob_gap": float(gap)}

    return loss_fn


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orchard-gpu-check-") as work:
        summary = asyncio.run(_loop(args, Path(work)))
    summary["wall_s"] = time.perf_counter() - started
    print(
        f"{summary['engine']} ({summary['reload']}) on {summary['device']}: "
        f"{summary['tokens_per_s']:.0f} sampled tok/s, {summary['train_tokens_per_s']:.0f} "
        f"trained tok/s, weight sync {summary['weight_sync_s']:.2f} s "
        f"(max {summary['weight_sync_max_s']:.2f} s), reward "
        f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, "
        f"{summary['wall_s']:.0f} s in all"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
