"""Fixtures of the orchard-lm tests: the offline tokenizer, built once per session."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from orchard.lm.tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()
