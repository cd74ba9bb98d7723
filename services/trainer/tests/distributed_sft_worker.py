"""One rank of an offline SFT run, as its own process: the 2-process test starts two of these.

python distributed_sft_worker.py DATA OUT_JSON RANK WORLD PORT ACCUMULATION ZERO_STAGE STEPS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchard.trainer.distributed import ProcessGroupSpec
from orchard.trainer.engine import EngineConfig
from orchard.trainer.sft import SftRunConfig, run_offline_sft


def main() -> None:
    data, out, rank, world, port, accumulation, stage, steps = sys.argv[1:]
    config = SftRunConfig(
        data=Path(data),
        model="builtin:tiny",
        output_dir=Path(out).parent / f"rank{rank}",
        engine=EngineConfig(
            zero_stage=int(stage),
            micro_batch_size=8,
            gradient_accumulation=int(accumulation),
            learning_rate=3e-3,
            warmup_steps=2,
            total_steps=int(steps),
        ),
        vocab_size=48,
        progress=False,
        plot=False,
    )
    spec = ProcessGroupSpec(rank=int(rank), world_size=int(world), master_port=int(port))
    result = run_offline_sft(config, process_group=spec)
    losses = [s.loss for s in result.steps]
    Path(out).write_text(json.dumps({"losses": losses, "tokens": [s.tokens for s in result.steps]}))


if __name__ == "__main__":
    main()
