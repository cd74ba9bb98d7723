"""Trajectories as a dataset: one JSON line per trajectory, for SFT and for evaluation reports.

Each row is built from a rollout's provenance record: its calls rebuilt into the trajectory tree
(`trajectory_tree`), so the token ids, logprobs and masks are the captured ones. Fields:

- `rollout_id`, `trajectory_id`, `task_id`, `harness`, `branch` ("" for the main line),
- `status` (completed, truncated, aborted), `outcome`, `reward` (null when not scored),
  `trainable` (scored, not discarded, main line) and `discard_reason`,
- `weight_versions`: the versions that sampled its turns,
- `messages`: the conversation of its last call plus the reply, in the OpenAI shape,
- `token_ids`, `logprobs` (0 for tokens the policy did not sample), `loss_mask`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from orchard.rollout.provenance import RolloutRecord
from orchard.rollout.trajectory_tree import TreeLimits, build_tree


def rollout_rows(record: RolloutRecord, limits: TreeLimits | None = None) -> list[dict[str, Any]]:
    """The dataset rows of one rollout (none when it made no model call)."""
    if not record.calls:
        return []
    tree = build_tree(record.calls, limits)
    rows = []
    for i, path in enumerate(tree.paths):
        tokens: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        for node, trained in zip(path.nodes, path.trained, strict=True):
            observation = node.observation_token_ids
            tokens += observation
            logprobs += [0.0] * len(observation)
            mask += [0] * len(observation)
            tokens += node.call.output_token_ids
            logprobs += node.call.output_logprobs
            mask += [int(trained)] * len(node.call.output_token_ids)
        last = path.nodes[-1].call
        reply: dict[str, Any] = {"role": "assistant", "content": last.output_text}
        if last.tool_calls:
            reply["tool_calls"] = list(last.tool_calls)
        reward = record.reward.value if record.reward is not None else None
        rows.append(
            {
                "rollout_id": record.rollout_id,
                "trajectory_id": f"{record.rollout_id}/{i}",
                "task_id": record.task_id,
                "harness": record.harness,
                "branch": path.branch,
                "status": record.status.value,
                "outcome": record.outcome,
                "reward": reward,
                "trainable": reward is not None and not tree.discard_reason and not path.branch,
                "discard_reason": tree.discard_reason,
                "weight_versions": sorted({n.call.weight_version for n in path.nodes}),
                "messages": [*last.request_messages, reply],
                "token_ids": tokens,
                "logprobs": logprobs,
                "loss_mask": mask,
            }
        )
    return rows


def export_jsonl(
    records: Iterable[RolloutRecord], path: str, limits: TreeLimits | None = None
) -> int:
    """Writes every trajectory of every record; returns the number of rows."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            for row in rollout_rows(record, limits):
                out.write(json.dumps(row, separators=(",", ":")) + "\n")
                count += 1
    return count
