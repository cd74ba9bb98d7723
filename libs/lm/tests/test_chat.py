"""The chat template, renderer and parser: exact prompt text, tool calls that survive a round
trip, history that re-renders as the tokens the model sampled, and bad input named precisely."""

from __future__ import annotations

import json

import pytest

from orchard.lm.chat import (
    IM_END,
    ChatFormatError,
    ChatRenderer,
    ToolCall,
    format_assistant_text,
    parse_assistant_text,
)

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


def test_prompt_text_is_chatml(renderer):
    text = renderer.render_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_are_declared_in_the_system_turn(renderer):
    text = renderer.render_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ls"}], [BASH]
    )
    head, _, rest = text.partition("<tools>\n")
    assert head.startswith("<|im_start|>system\nBe brief.\n\n")
    line, _, rest = rest.partition("\n</tools>")
    assert json.loads(line) == BASH
    assert rest.count("<|im_start|>system") == 0
    assert text.endswith("<|im_start|>user\nls<|im_end|>\n<|im_start|>assistant\n")
    # Without a system message the tools get a system turn of their own.
    alone = renderer.render_text([{"role": "user", "content": "ls"}], [BASH])
    assert alone.startswith("<|im_start|>system\nYou can call tools.")


def test_tool_results_and_calls_in_history(renderer):
    text = renderer.render_text(
        [
            {"role": "user", "content": "list"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        ],
        [BASH],
        add_generation_prompt=False,
    )
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
    )


def test_a_sampled_turn_renders_back_as_the_same_tokens(renderer, tokenizer):
    """Token-in, token-out across turns: prompt + sampled tokens is a prefix of the next prompt."""
    messages = [{"role": "user", "content": "Run ls, then say done."}]
    prompt = renderer.render(messages, [BASH]).token_ids
    sampled_text = format_assistant_text("I will look.", [ToolCall("bash", '{"command": "ls"}')])
    sampled = tokenizer.encode(sampled_text + IM_END, add_special_tokens=False)
    _, turn = renderer.parse(sampled)
    assert turn.content == "I will look."
    history = [
        *messages,
        {
            "role": "assistant",
            "content": turn.content,
            "tool_calls": [c.openai(f"call_{i}") for i, c in enumerate(turn.tool_calls)],
        },
        {"role": "tool", "content": "a.py"},
    ]
    following = renderer.render(history, [BASH]).token_ids
    assert following[: len(prompt) + len(sampled)] == (*prompt, *sampled)


def test_parse_content_and_calls():
    turn = parse_assistant_text(
        'Let me check.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
    )
    assert turn.content == "Let me check."
    assert turn.tool_calls == (
        ToolCall("bash", '{"command": "ls -la"}'),
        ToolCall("submit", "{}"),
    )
    assert turn.unparsed_tool_calls == 0
    assert turn.tool_calls[0].openai("call_7") == {
        "id": "call_7",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
    }


def test_parse_a_list_of_calls_and_string_arguments():
    # SmolLM2 writes a JSON list; some models write the arguments as a JSON string.
    turn = parse_assistant_text(
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, '
        '{"name": "b", "arguments": "{\\"y\\": 2}"}]</tool_call>'
    )
    assert turn.tool_calls == (ToolCall("a", '{"x": 1}'), ToolCall("b", '{"y": 2}'))
    assert turn.content == ""


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        '<tool_call>\n{"name": "bash", "arguments": {"command": "l',
    ],
)
def test_invalid_or_cut_off_calls_stay_text(text):
    turn = parse_assistant_text(text)
    assert turn.tool_calls == ()
    assert turn.content == text
    assert turn.unparsed_tool_calls == 1


def test_plain_text_is_kept_verbatim():
    assert parse_assistant_text("  two spaces\n").content == "  two spaces\n"


@pytest.mark.parametrize(
    ("messages", "tools", "match"),
    [
        ([], None, "at least one message"),
        ([{"role": "robot", "content": "x"}], None, r"messages\[0\].role"),
        ([{"role": "user", "content": 3}], None, r"messages\[0\].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], None, "only text parts"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{"}}]}],
            None,
            r"tool_calls\[0\].function.arguments is not valid JSON",
        ),
        ([{"role": "user", "content": "x"}], [{"type": "function"}], r"tools\[0\].function"),
    ],
)
def test_bad_input_names_the_field(renderer, messages, tools, match):
    with pytest.raises(ChatFormatError, match=match):
        renderer.render(messages, tools)


def test_text_parts_are_joined(renderer):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert renderer.render_text([{"role": "user", "content": parts}]) == renderer.render_text(
        [{"role": "user", "content": "ab"}]
    )


def test_prompt_ids_hold_the_control_tokens(renderer, tokenizer):
    ids = renderer.render([{"role": "user", "content": "Hi"}]).token_ids
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 2
    assert renderer.stop_token_ids[0] == tokenizer.convert_tokens_to_ids(IM_END)
    assert (
        renderer.decode(
            [*tokenizer.encode("ok", add_special_tokens=False), *renderer.stop_token_ids[:1]]
        )
        == "ok"
    )
