"""Prefix-tree reconstruction on hand-built call logs: a plain run, retries, a compaction and a
sub-agent, branching past the limit, and the protos the trainer reads."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from orchard.rollout.capture import CallRecord
from orchard.rollout.trajectory_tree import TreeLimits, build_tree, tree_trajectories
from orchard.types.v1 import trajectory_pb2

SYSTEM = (1, 2, 3)
TASK = (4, 5)


class CallLog:
    """Builds the calls of one rollout the way a capture proxy would record them."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self._seq = itertools.count()

    def call(
        self,
        prompt: tuple[int, ...],
        output: tuple[int, ...],
        *,
        finish: str = "stop",
        branch: str = "",
        messages: tuple[dict[str, Any], ...] = (),
    ) -> CallRecord:
        seq = next(self._seq)
        record = CallRecord(
            rollout_id="r1",
            call_id=f"c{seq}",
            seq=seq,
            prompt_token_ids=prompt,
            output_token_ids=output,
            output_logprobs=tuple(-0.1 * (i + 1) for i in range(len(output))),
            weight_version="v3",
            finish_reason=finish,
            started_at=1000.0 + seq,
            latency_s=0.25,
            branch=branch,
            request_messages=messages,
            output_text=f"out{seq}",
        )
        self.calls.append(record)
        return record


def history(record: CallRecord) -> tuple[int, ...]:
    return record.prompt_token_ids + record.output_token_ids


def call_ids(tree: Any) -> list[list[str]]:
    return [[n.call.call_id for n in path.nodes] for path in tree.paths]


def test_a_linear_run_is_one_trajectory_with_observations_between_calls() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10, 11))
    b = log.call((*history(a), 20, 21), (12,))
    c = log.call((*history(b), 22), (13, 14))
    tree = build_tree(log.calls)
    assert call_ids(tree) == [["c0", "c1", "c2"]]
    assert tree.discard_reason == ""
    assert [n.observation_token_ids for n in tree.paths[0].nodes] == [
        SYSTEM + TASK,
        (20, 21),
        (22,),
    ]
    assert tree.unique_token_count == len(history(c)) == tree.path_token_count


def test_calls_attach_by_tokens_not_by_arrival_order() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,))
    b = log.call((*history(a), 20), (11,))
    shuffled = [log.calls[1], log.calls[0]]
    tree = build_tree(shuffled)
    assert call_ids(tree) == [["c0", "c1"]]
    assert tree.paths[0].nodes[1].observation_token_ids == (20,)
    assert history(b)[-1] == 11


def test_a_retried_step_keeps_the_attempt_that_continued() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,))
    step = (*history(a), 20)
    log.call(step, (99, 98, 97), finish="length")  # cut off: the harness retries the step
    b2 = log.call(step, (11,))
    log.call((*history(b2), 21), (12,))
    tree = build_tree(log.calls)
    assert call_ids(tree) == [["c0", "c2", "c3"]]
    assert tree.pruned_call_ids == ("c1",)
    assert tree.unique_token_count == len(history(log.calls[-1]))


def test_when_every_attempt_is_a_leaf_the_longest_valid_one_stays() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,))
    step = (*history(a), 20)
    log.call(step, (30, 31, 32, 33), finish="length")  # longest, but cut off
    log.call(step, (40, 41))  # valid and longer than the next one
    log.call(step, (50,))
    tree = build_tree(log.calls)
    assert call_ids(tree) == [["c0", "c2"]]
    assert tree.pruned_call_ids == ("c1", "c3")


def test_a_retry_whose_continuation_was_a_dead_retry_is_pruned_as_a_whole_chain() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,))
    step = (*history(a), 20)
    b1 = log.call(step, (11,))
    # b1's next step is tried once and cut off, then the harness restarts from `step`.
    log.call((*history(b1), 21), (7, 7, 7), finish="length")
    b2 = log.call(step, (12,))
    log.call((*history(b2), 22), (13,))
    tree = build_tree(log.calls)
    # b1 kept a child, so it is not a dead leaf: two real branches remain.
    assert call_ids(tree) == [["c0", "c1", "c2"], ["c0", "c3", "c4"]]
    # The shared first call is trained once, by the first path.
    assert [p.trained for p in tree.paths] == [(True, True, True), (False, True, True)]
    shared = len(history(a)) + 1  # the observation token 20 is shared too
    assert tree.unique_token_count == tree.path_token_count - shared


def test_compaction_is_an_auxiliary_branch_and_the_new_context_a_second_segment() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10, 11))
    b = log.call((*history(a), 20), (12,))
    # The harness asks the model to summarise the history so far ...
    log.call((*history(b), 90, 91), (60, 61, 62), branch="compaction")
    # ... and continues in a new context: the system prompt, the task and the summary.
    d = log.call(SYSTEM + TASK + (60, 61, 62), (13,))
    log.call((*history(d), 23), (14,))
    tree = build_tree(log.calls)
    assert [p.branch for p in tree.paths] == ["", "", "compaction"]
    assert call_ids(tree) == [["c0", "c1"], ["c3", "c4"], ["c0", "c1", "c2"]]
    main_a, main_b, compaction = tree.paths
    assert main_a.trained == (True, True)
    assert main_b.trained == (True, True)
    assert compaction.trained == (False, False, False)
    assert tree.discard_reason == ""


def test_a_sub_agent_is_kept_apart_and_the_main_line_continues_past_it() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,), finish="tool_calls")
    s1 = log.call((7, 8, 9), (70,), branch="subagent:search")
    # A main call never attaches under a sub-agent call, even when its tokens would allow it.
    s2 = log.call((*history(s1), 71), (72,), branch="subagent:search")
    b = log.call((*history(a), 72, 73), (11,))
    tree = build_tree(log.calls)
    assert call_ids(tree) == [["c0", "c3"], ["c1", "c2"]]
    assert tree.paths[1].branch == "subagent:search"
    assert tree.paths[1].trained == (False, False)
    assert tree.unique_token_count == len(history(b)) + len(history(s2))


def test_a_main_call_never_attaches_under_an_auxiliary_one() -> None:
    log = CallLog()
    s = log.call(SYSTEM, (40,), branch="subagent:x")
    log.call((*history(s), 41), (42,))  # main line, its tokens extend the sub-agent's
    tree = build_tree(log.calls)
    assert call_ids(tree) == [["c1"], ["c0"]]
    assert tree.paths[0].nodes[0].observation_token_ids == (*history(s), 41)


def test_a_rollout_branching_past_the_limit_is_discarded_with_the_reason() -> None:
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,))
    for k in range(3):  # three different continuations, each carried further
        b = log.call((*history(a), 20 + k), (30 + k,))
        log.call((*history(b), 40), (50,))
    assert build_tree(log.calls, TreeLimits(max_main_leaves=3)).discard_reason == ""
    tree = build_tree(log.calls, TreeLimits(max_main_leaves=2))
    assert "3 main-line trajectories from one context" in tree.discard_reason
    assert "limit of 2" in tree.discard_reason


def test_a_program_that_rebuilds_its_prompt_every_call_is_not_searching() -> None:
    """Twelve calls that each start a fresh context (OpenClaw drops the block it appended the
    call before) are twelve one-call trajectories, not a search past the limit."""
    log = CallLog()
    for k in range(12):
        log.call((*SYSTEM, *TASK, 100 + k), (10 + k,))
    tree = build_tree(log.calls, TreeLimits(max_main_leaves=2))
    assert tree.discard_reason == ""
    assert len(tree.main_paths) == 12 and all(len(p.nodes) == 1 for p in tree.main_paths)


def test_calls_under_another_system_prompt_are_inferred_auxiliary() -> None:
    """An unmodified program names no branch: a call under another system prompt is a
    sub-agent's (or a side task's), one asking for a summary of the conversation a compaction;
    both are kept out of the loss, and the main line's calls stay trained."""
    main_system = {"role": "system", "content": "You are the main agent."}
    task = {"role": "user", "content": "Reply to Ann."}
    log = CallLog()
    a = log.call(SYSTEM + TASK, (10,), messages=(main_system, task))
    side = log.call(
        (7, 7, 7),
        (8,),
        messages=({"role": "system", "content": "Write a 5-word title."}, task),
    )
    b = log.call((*history(a), 20), (30,), messages=(main_system, task, {"role": "tool"}))
    compact = log.call(
        (*history(b), 99),
        (98,),
        messages=(
            {"role": "system", "content": [{"type": "text", "text": "You summarize."}]},
            {"role": "user", "content": "Summarize the conversation so far for a new session."},
        ),
    )
    declared = log.call((6, 6), (5,), branch="subagent:named", messages=(main_system,))
    tree = build_tree(log.calls)
    by_branch = {p.branch: [n.call.call_id for n in p.nodes] for p in tree.paths}
    assert by_branch[""] == [a.call_id, b.call_id]
    title = next(k for k in by_branch if k.startswith("subagent:") and k != "subagent:named")
    assert by_branch[title] == [side.call_id]
    assert by_branch["compaction"][-1] == compact.call_id
    assert by_branch["subagent:named"] == [declared.call_id]
    main = next(p for p in tree.paths if not p.branch)
    assert all(main.trained)
    assert not any(any(p.trained) for p in tree.paths if p.branch)
    inferred = [n.call for p in tree.paths if p.branch for n in p.nodes if n.call.branch]
    assert {c.metadata.get("branch_inferred") for c in inferred if c.branch != "subagent:named"}
    # Turned off, every call is on the main line (the header-declared branch stays).
    plain = build_tree(log.calls, infer=False)
    assert {p.branch for p in plain.paths} == {"", "subagent:named"}


def test_calls_of_two_rollouts_are_refused() -> None:
    log = CallLog()
    a = log.call(SYSTEM, (1,))
    other = CallRecord(
        **{**{f: getattr(a, f) for f in a.__slots__}, "rollout_id": "r2", "call_id": "x"}
    )
    with pytest.raises(ValueError, match="several rollouts"):
        build_tree([a, other])
    with pytest.raises(ValueError, match="twice"):
        build_tree([a, a])
    with pytest.raises(ValueError, match="at least 1"):
        TreeLimits(max_main_leaves=0)


def test_protos_give_the_full_token_sequence_with_masks_and_auxiliary_kinds() -> None:
    log = CallLog()
    system_msgs = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "fix it"})
    a = log.call(SYSTEM + TASK, (10, 11), finish="tool_calls", messages=system_msgs)
    tool_msgs = (
        *system_msgs,
        {"role": "assistant", "content": "out0"},
        {"role": "tool", "content": "ok: 3 files"},
    )
    b = log.call((*history(a), 20), (12,), messages=tool_msgs)
    log.call((*history(b), 90), (60,), branch="compaction")
    trajectories = tree_trajectories(
        build_tree(log.calls),
        task_id="t1",
        harness="builtin:bash",
        outcome=trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
    )
    main, compaction = trajectories
    tokens: list[int] = []
    for turn in main.turns:
        tokens += [*turn.input_token_ids, *turn.output_token_ids]
    assert tuple(tokens) == history(b)
    assert [list(t.output_loss_mask) for t in main.turns] == [[True, True], [True]]
    assert [t.kind for t in main.turns] == [trajectory_pb2.TURN_KIND_POLICY] * 2
    assert main.turns[0].input_text == "system: be brief\nuser: fix it"
    assert main.turns[1].input_text == "tool: ok: 3 files"
    assert list(main.turns[0].output_logprobs) == pytest.approx([-0.1, -0.2])
    assert main.turns[0].weight_version == "v3"
    assert main.turns[1].start_time.seconds == 1001
    assert main.turns[1].latency.ToMilliseconds() == 250
    assert compaction.metadata["branch"] == "compaction"
    assert compaction.metadata["call_ids"] == "c0,c1,c2"
    assert compaction.turns[-1].kind == trajectory_pb2.TURN_KIND_AUXILIARY
    assert not any(m for t in compaction.turns for m in t.output_loss_mask)
    decoded = tree_trajectories(
        build_tree(log.calls),
        task_id="t1",
        harness="h",
        outcome=trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
        decode=lambda ids: "|".join(map(str, ids)),
    )
    assert decoded[0].turns[1].input_text == "20"
