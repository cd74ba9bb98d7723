"""Curation steps on hand-built rows: exactly which rows survive each step, and why."""

from __future__ import annotations

import json

import pytest

from orchard.lm.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from orchard.trainer.curation import (
    CapPerSource,
    CurationError,
    KnownTools,
    ParsableActions,
    ShortestSuccessful,
    TokenLimit,
    ToolSchema,
    curate,
    default_order,
    load_tool_schema,
    token_count,
)
from orchard.types.v1 import trajectory_pb2

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "run a command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
SUBMIT = {"name": "submit", "parameters": {"type": "object", "properties": {}}}


def ids(rows):
    return [r.id for r in rows]


def with_call(t, turn, name, arguments):
    t.turns[turn].tool_calls.add(id=f"c{turn}", name=name, arguments_json=arguments)
    return t


@pytest.fixture
def row(build):
    def make(tid, *, tokens=4, reward=1.0, task="task", source=None, harness="builtin:swe", **kw):
        half = tokens // 2
        t = build(
            [build.Turn(inputs=list(range(half)), outputs=list(range(tokens - half)))],
            trajectory_id=tid,
            task_id=task,
            reward=reward,
            harness=harness,
            **kw,
        )
        if source is not None:
            t.metadata["repository"] = source
        return t

    return make


def test_token_limit_counts_inputs_and_outputs_of_every_turn(build, row):
    two_turns = build(
        [build.Turn(inputs=[1, 2], outputs=[3]), build.Turn(inputs=[4], outputs=[5, 6])],
        trajectory_id="two",
    )
    assert token_count(two_turns) == 6
    result = curate([row("a", tokens=5), two_turns, row("c", tokens=7)], [TokenLimit(6)])
    assert ids(result.rows) == ["a", "two"]
    (report,) = result.reports
    assert (report.rows_in, report.kept) == (3, 2)
    assert [(d.trajectory_id, d.reason, d.detail) for d in report.dropped] == [
        ("c", "over_token_limit", "7 tokens > 6")
    ]
    with pytest.raises(CurationError, match="at least 1"):
        TokenLimit(0)


def test_known_tools_drops_unknown_names_and_off_schema_arguments(row):
    schema = ToolSchema.of([BASH, SUBMIT])
    rows = [
        with_call(row("ok"), 0, "bash", '{"command": "ls"}'),
        with_call(row("submit"), 0, "submit", "{}"),
        with_call(row("unknown"), 0, "rm_everything", "{}"),
        with_call(row("missing_arg"), 0, "bash", "{}"),
        with_call(row("wrong_type"), 0, "bash", '{"command": 3}'),
        with_call(row("bad_json"), 0, "bash", "{not json"),  # ParsableActions' job
        row("no_calls"),
    ]
    result = curate(rows, [KnownTools({None: schema})])
    assert ids(result.rows) == ["ok", "submit", "bad_json", "no_calls"]
    drops = {d.trajectory_id: d for d in result.reports[0].dropped}
    assert drops["unknown"].reason == "unknown_tool"
    assert drops["unknown"].detail == "turn 0 calls 'rm_everything'; the tools are bash, submit"
    assert drops["missing_arg"].reason == "arguments_off_schema"
    assert "'command' is a required property" in drops["missing_arg"].detail
    assert drops["wrong_type"].reason == "arguments_off_schema"
    assert result.reports[0].by_reason == {"unknown_tool": 1, "arguments_off_schema": 2}

    names_only = curate(rows, [KnownTools({None: schema}, check_arguments=False)])
    assert "missing_arg" in ids(names_only.rows) and "unknown" not in ids(names_only.rows)


def test_known_tools_uses_the_schema_of_each_rows_harness(row):
    swe = ToolSchema.of([BASH])
    web = ToolSchema.of([{"name": "click", "parameters": {"type": "object"}}])
    rows = [
        with_call(row("swe_bash", harness="builtin:swe"), 0, "bash", '{"command": "ls"}'),
        with_call(row("swe_click", harness="builtin:swe"), 0, "click", "{}"),
        with_call(row("web_click", harness="web"), 0, "click", "{}"),
        with_call(row("web_bash", harness="web"), 0, "bash", '{"command": "ls"}'),
        with_call(row("other", harness="external:x"), 0, "anything", "{}"),
    ]
    per_harness = curate(rows, [KnownTools({"builtin:swe": swe, "web": web})])
    assert ids(per_harness.rows) == ["swe_bash", "web_click", "other"]
    fallback = curate(rows, [KnownTools({"web": web, None: swe})])
    assert ids(fallback.rows) == ["swe_bash", "web_click"]


def test_auxiliary_turns_are_not_held_to_the_policy_tool_schema(build):
    t = build(
        [build.Turn(inputs=[1], outputs=[2], auxiliary=True), build.Turn(inputs=[3], outputs=[4])],
        trajectory_id="aux",
    )
    with_call(t, 0, "summarize", "[]")
    kept = curate([t], [KnownTools({None: ToolSchema.of([BASH])}), ParsableActions()])
    assert ids(kept.rows) == ["aux"]


def test_parsable_actions_drops_bad_arguments_broken_blocks_and_empty_tool_finishes(row):
    good_block = f'{TOOL_CALL_OPEN}\n{{"name": "bash", "arguments": {{"command": "ls"}}}}\n'
    good = with_call(row("good"), 0, "bash", '{"command": "ls"}')
    good.turns[0].output_text = good_block + TOOL_CALL_CLOSE
    good.turns[0].finish_reason = "tool_calls"
    not_json = with_call(row("not_json"), 0, "bash", '{"command": ')
    a_list = with_call(row("a_list"), 0, "bash", '["ls"]')
    broken = row("broken_block")
    broken.turns[0].output_text = f"{TOOL_CALL_OPEN}\n{{bash ls}}\n{TOOL_CALL_CLOSE}"
    cut_off = row("cut_off")
    cut_off.turns[0].output_text = good_block  # sampling stopped inside the block
    empty_finish = row("empty_finish")
    empty_finish.turns[0].finish_reason = "tool_calls"
    plain = row("plain")
    plain.turns[0].output_text = "I think the bug is in parse()."
    result = curate(
        [good, not_json, a_list, broken, cut_off, empty_finish, plain], [ParsableActions()]
    )
    assert ids(result.rows) == ["good", "plain"]
    drops = {d.trajectory_id: (d.reason, d.detail) for d in result.reports[0].dropped}
    assert drops["not_json"][0] == "unparsable_arguments"
    assert drops["a_list"] == (
        "unparsable_arguments",
        "turn 0: the arguments of 'bash' are a JSON list, not an object",
    )
    assert drops["broken_block"][0] == "unparsable_tool_call"
    assert drops["cut_off"][0] == "unparsable_tool_call"
    assert drops["empty_finish"] == (
        "unparsable_tool_call",
        "turn 0 finished for tool calls but none was parsed",
    )


def test_shortest_successful_keeps_one_success_per_task_and_the_failures(row):
    rows = [
        row("a_long", task="a", tokens=9),
        row("a_fail", task="a", tokens=2, reward=0.0, rise=[(0, 0)]),
        row("a_short", task="a", tokens=5),
        row("a_tie", task="a", tokens=5),
        row("b_only", task="b", tokens=20),
        row("b_excluded", task="b", tokens=1, excluded=True),
        row("c_fail", task="c", tokens=3, reward=0.0),
    ]
    result = curate(rows, [ShortestSuccessful()])
    assert ids(result.rows) == ["a_fail", "a_short", "b_only", "b_excluded", "c_fail"]
    assert [(d.trajectory_id, d.reason, d.detail) for d in result.reports[0].dropped] == [
        ("a_long", "longer_success", "task 'a': 9 tokens; kept 'a_short' with 5"),
        ("a_tie", "longer_success", "task 'a': 5 tokens; kept 'a_short' with 5"),
    ]
    only_successes = curate(rows, [ShortestSuccessful(keep_failed=False)])
    assert ids(only_successes.rows) == ["a_short", "b_only"]
    assert only_successes.reports[0].by_reason == {"longer_success": 2, "not_successful": 3}
    # The edge: a reward of 1.0 is at a threshold of 1.0, so it is still a success.
    assert ids(curate(rows, [ShortestSuccessful(success_threshold=1.0)]).rows) == ids(result.rows)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_success_threshold_outside_0_1_is_refused(threshold):
    with pytest.raises(ValueError, match=r"success_threshold must be a number in \[0, 1\]"):
        ShortestSuccessful(success_threshold=threshold)


def test_the_success_threshold_is_the_one_rule_at_its_edge(row):
    """Reward exactly at the threshold is a success; just below it is not (the same `>=` the
    samplers, credit assignment, SFT masks and evaluation use)."""
    rows = [
        row("at", task="t", tokens=9, reward=0.5),
        row("below", task="t", tokens=2, reward=0.49999),
    ]
    result = curate(rows, [ShortestSuccessful(keep_failed=False)])
    assert ids(result.rows) == ["at"]
    result = curate(rows, [ShortestSuccessful(success_threshold=0.49999, keep_failed=False)])
    assert ids(result.rows) == ["below"]


def test_a_pass_mark_and_per_harness_keep_each_program_s_shortest_pass(row):
    """Claw rows: a partial score is not a success (the pass mark is 0.75), and each agent
    program keeps its own shortest pass, since each teaches its own tool calls."""
    rows = [
        row("cc_long", task="t", tokens=30, harness="program:claude-code"),
        row("cc_short", task="t", tokens=20, harness="program:claude-code", reward=0.8),
        row("cx_partial", task="t", tokens=4, harness="program:codex", reward=0.6),
        row("cx_pass", task="t", tokens=12, harness="program:codex", reward=0.75),
    ]
    step = ShortestSuccessful(success_threshold=0.75, per_harness=True)
    result = curate(rows, [step])
    assert ids(result.rows) == ["cc_short", "cx_partial", "cx_pass"]
    assert [(d.trajectory_id, d.detail) for d in result.reports[0].dropped] == [
        ("cc_long", "task 't' in program:claude-code: 30 tokens; kept 'cc_short' with 20")
    ]
    assert step.name == (
        "shortest_successful(success_threshold=0.75, keep_failed=True, per_harness=True)"
    )
    # At the default threshold (0.5) and across programs the partial Codex row wins the task.
    assert ids(curate(rows, [ShortestSuccessful()]).rows) == ["cx_partial"]


def test_cap_per_source_keeps_the_first_rows_of_each_source(row):
    rows = [
        row("x1", source="org/x"),
        row("y1", source="org/y"),
        row("x2", source="org/x"),
        row("none"),
        row("x3", source="org/x"),
        row("y2", source="org/y"),
        row("y3", source="org/y"),
    ]
    result = curate(rows, [CapPerSource(2)])
    assert ids(result.rows) == ["x1", "y1", "x2", "none", "y2"]
    assert [(d.trajectory_id, d.detail) for d in result.reports[0].dropped] == [
        ("x3", "repository 'org/x' has 2 already"),
        ("y3", "repository 'org/y' has 2 already"),
    ]
    by_site = curate(rows, [CapPerSource(1, key="website")])
    assert len(by_site.rows) == len(rows)  # no row has a website
    with pytest.raises(CurationError, match="at least 1"):
        CapPerSource(0)


def test_steps_compose_in_order_and_each_reports_on_what_reached_it(row):
    rows = [
        with_call(row("a_short_bad", task="a", tokens=4, source="r1"), 0, "nope", "{}"),
        row("a_mid", task="a", tokens=6, source="r1"),
        row("a_long", task="a", tokens=8, source="r1"),
        row("b_huge", task="b", tokens=50, source="r1"),
        row("b_ok", task="b", tokens=10, source="r1"),
        row("c_ok", task="c", tokens=4, source="r1"),
        row("d_ok", task="d", tokens=4, source="r2"),
    ]
    steps = default_order(
        [
            CapPerSource(1),
            ShortestSuccessful(),
            KnownTools({None: ToolSchema.of([BASH])}),
            TokenLimit(20),
        ]
    )
    assert [type(s).__name__ for s in steps] == [
        "TokenLimit",
        "KnownTools",
        "ShortestSuccessful",
        "CapPerSource",
    ]
    result = curate(rows, steps)
    # The unknown-tool row goes before choosing the shortest, so a_mid stands for task a.
    assert ids(result.rows) == ["a_mid", "d_ok"]
    assert [(r.rows_in, r.kept) for r in result.reports] == [(7, 6), (6, 5), (5, 4), (4, 2)]
    summary = result.summary()
    assert "token_limit(max_tokens=20): 7 in, 6 kept, 1 dropped (over_token_limit 1)" in summary
    assert "b_huge: over_token_limit: 50 tokens > 20" in summary
    assert "cap_per_source(cap=1, key='repository'): 4 in, 2 kept, 2 dropped" in summary
    as_json = result.reports[3].as_dict()
    assert as_json["by_reason"] == {"over_source_cap": 2}
    assert [e["trajectory_id"] for e in as_json["examples"]["over_source_cap"]] == ["b_ok", "c_ok"]


def test_tool_schema_files_are_read_or_refused_with_the_reason(tmp_path):
    listed = tmp_path / "tools.json"
    listed.write_text(json.dumps([BASH, SUBMIT]))
    assert sorted(load_tool_schema(listed).parameters) == ["bash", "submit"]
    wrapped = tmp_path / "task.json"
    wrapped.write_text(json.dumps({"tools": [SUBMIT]}))
    assert list(load_tool_schema(wrapped).parameters) == ["submit"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "x", "parameters": {"type": "no such type"}}]))
    with pytest.raises(CurationError, match="tool 'x': its parameters are not a JSON schema"):
        load_tool_schema(bad)
    nameless = tmp_path / "nameless.json"
    nameless.write_text(json.dumps({"tools": [{"parameters": {}}]}))
    with pytest.raises(CurationError, match="needs a name"):
        load_tool_schema(nameless)
    with pytest.raises(CurationError, match="cannot read tool schema"):
        load_tool_schema(tmp_path / "absent.json")


def test_curation_leaves_the_rows_themselves_unchanged(row):
    t = with_call(row("t", source="r"), 0, "bash", '{"command": "ls"}')
    before = t.SerializeToString()
    result = curate([t], [TokenLimit(100), KnownTools({None: ToolSchema.of([BASH])})])
    assert result.rows[0].SerializeToString() == before
    assert isinstance(result.rows[0], trajectory_pb2.Trajectory)
