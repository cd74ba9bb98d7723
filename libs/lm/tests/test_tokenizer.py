"""The offline tokenizer: deterministic, byte-level (any text round-trips), one id per control
token, and the same ids after a save and a load through plain Hugging Face classes."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from orchard.lm.chat import IM_END, IM_START, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from orchard.lm.tokenizer import (
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TokenizerConfig,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    training_corpus,
)

TEXTS = [
    "Hello, world! Run the tests.",
    'def f(x):\n    return {"a": [1, 2, 3]}\n',
    "Ünïcödé — 日本語 🍎 tabs\tand\nnewlines  ",
    "",
]


def test_two_builds_are_identical(tokenizer):
    again = build_tokenizer()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert list(training_corpus(50, 0)) == list(training_corpus(50, 0))
    assert list(training_corpus(50, 0)) != list(training_corpus(50, 1))


def test_vocabulary_size_and_merges(tokenizer):
    assert len(tokenizer) == TokenizerConfig().vocab_size
    # Learned merges make common words single tokens, not bytes.
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1
    assert len(tokenizer.encode(" return", add_special_tokens=False)) == 1


def test_too_small_a_vocabulary_is_refused():
    with pytest.raises(ValueError, match="below the"):
        build_tokenizer(TokenizerConfig(vocab_size=100))


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_control_and_markup_tokens_are_one_id_each(tokenizer):
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(token) in ids, token
        assert len(ids) == 3, (token, ids)
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token_id is not None
    # Decoding for people drops control tokens and keeps the tool markup.
    ids = tokenizer.encode(f"{IM_START}x{TOOL_CALL_OPEN}{{}}{TOOL_CALL_CLOSE}{IM_END}")
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == f"x{TOOL_CALL_OPEN}{{}}{TOOL_CALL_CLOSE}"
    )


def test_saved_tokenizer_loads_with_the_same_ids(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    for loaded in (
        load_tokenizer(tmp_path / "tok"),
        AutoTokenizer.from_pretrained(tmp_path / "tok"),
    ):
        assert len(loaded) == len(tokenizer)
        assert loaded.chat_template == tokenizer.chat_template
        assert loaded.eos_token_id == tokenizer.eos_token_id
        for text in TEXTS:
            assert loaded.encode(text) == tokenizer.encode(text)
