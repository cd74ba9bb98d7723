"""CallRecord keeps one logprob per sampled token."""

from __future__ import annotations

import pytest

from orchard.rollout.capture import CallRecord


def _record(logprobs: tuple[float, ...]) -> CallRecord:
    return CallRecord(
        rollout_id="r1",
        call_id="c1",
        seq=0,
        prompt_token_ids=(1, 2, 3),
        output_token_ids=(4, 5),
        output_logprobs=logprobs,
        weight_version="v1",
        finish_reason="stop",
        started_at=0.0,
        latency_s=0.01,
    )


def test_one_logprob_per_output_token() -> None:
    assert _record((-0.1, -0.2)).output_logprobs == (-0.1, -0.2)


def test_mismatched_logprobs_are_refused_with_the_counts() -> None:
    with pytest.raises(ValueError, match="1 logprobs for 2 output tokens"):
        _record((-0.1,))
