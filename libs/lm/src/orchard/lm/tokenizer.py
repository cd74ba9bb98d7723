"""The offline tokenizer: byte-level BPE trained in code, saved and loaded as a Hugging Face
tokenizer, so the trainer and the inference engines read the very same files.

Nothing is downloaded: the training corpus is generated here from a fixed seed (chat phrases,
shell commands, Python, JSON tool calls), and training on it is deterministic, so two builds with
the same `TokenizerConfig` give identical vocabularies.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from orchard.lm.chat import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    chat_template,
)

SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
"""Control tokens: never produced by the byte-level BPE, removed by `skip_special_tokens`."""

MARKUP_TOKENS: tuple[str, ...] = (
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOLS_OPEN,
    TOOLS_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
)
"""Tool markup: one token each, kept when decoding so the parser sees them."""


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """How the offline tokenizer is built."""

    vocab_size: int = 2048
    """Total vocabulary, the special and markup tokens included."""
    corpus_lines: int = 6000
    """Lines of generated text the BPE merges are learned from."""
    seed: int = 0
    """Seed of the generated corpus; the same seed gives the same vocabulary."""
    model_max_length: int = 4096
    """What the tokenizer reports as the longest input the model takes."""


_WORD_TEXT = """\
the a an of to in and or is are was be this that it for on with as by at from file files
line lines test tests run running error errors fix fixed value values function return
returns list dict string number result results output input read write open close
directory path command shell python code change changes bug issue patch repo user
assistant system tool tools call calls answer question please thanks ok yes no check
found not empty missing import module class method name names first last next step steps
done task tasks submit view edit create delete move copy search find print passed failed
pass fail install package version build make start stop wait time data
should would could must can will may might have has had do does did get got set use used
when where what which who why how because before after while until again also only just
every each some any all none many more most less least other same different new old
true false null self cls args kwargs lambda yield async await raise try except finally
def elif else assert global del pass break continue range len int str float bool tuple
items keys sorted reversed enumerate zip map filter sum min max abs round format join split
strip replace startswith endswith lower upper append extend insert remove pop update
count index total amount price quantity order orders item cost rate score scores point
points limit limits size length width height offset start end begin finish left right
parse parser parsed encode decode encoded decoded load save dump config settings option
options default defaults setup teardown fixture fixtures mock assertion failure failures
expected actual got instead wrong correct broken works working worked please thank you
report reports summary session platform collected warning warnings deprecated skipped
traceback recent most line lines raised exception exceptions stack frame frames source
repository commit branch merge rebase diff status log clone push pull fetch remote origin
server client request response header headers body query json yaml text bytes buffer
stream streams socket port host address network timeout retry retries cache memory disk
process thread threads worker workers queue job jobs task schedule scheduler event events
user users group groups owner permission permissions access token tokens key secret
number numbers zero one two three four five six seven eight nine ten hundred thousand
largest smallest greater smaller equal above below between inside outside within without
"""
_WORDS = _WORD_TEXT.split()
_COMMANDS = (
    "ls -la",
    "cat README.md",
    "grep -rn TODO src",
    "python -m pytest -q",
    "git status",
    "git diff",
    "pip install -e .",
    "sed -n 1,40p main.py",
    "find . -name '*.py'",
    "echo done",
    "cd /workspace && make test",
    "head -n 20 setup.cfg",
    "wc -l src/app.py",
    "mkdir -p build",
    "rm -rf build",
)
_TOOL_NAMES = ("bash", "view_file", "edit_file", "submit", "search", "get_weather", "calculator")
_PYTHON = (
    "def {n}(x):\n    return x + {k}\n",
    "import os\nimport sys\n\nprint(sys.argv[{k}])\n",
    "class {N}:\n    def __init__(self, value):\n        self.value = value\n",
    "for i in range({k}):\n    print(i, {n}(i))\n",
    "if {n} is None:\n    raise ValueError('{n} is missing')\n",
    "with open('{n}.txt') as f:\n    data = f.read()\n",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", "?", "!", ":", ","))


def _tool_call(rng: random.Random) -> str:
    name = rng.choice(_TOOL_NAMES)
    if name == "bash":
        arguments: dict[str, object] = {"command": rng.choice(_COMMANDS)}
    elif name in ("view_file", "edit_file"):
        arguments = {"path": f"src/{rng.choice(_WORDS)}.py", "line": rng.randint(1, 400)}
    else:
        arguments = {"query": _sentence(rng), "limit": rng.randint(1, 10)}
    call = json.dumps({"name": name, "arguments": arguments})
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


def _python(rng: random.Random) -> str:
    name = rng.choice(_WORDS)
    return rng.choice(_PYTHON).format(n=name, N=name.capitalize(), k=rng.randint(0, 99))


def _line(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return f"{IM_START}{rng.choice(('user', 'assistant', 'system', 'tool'))}\n{_sentence(rng)}"
    if kind == 1:
        return f"$ {rng.choice(_COMMANDS)}\n{_sentence(rng)}"
    if kind == 2:
        return _tool_call(rng)
    if kind == 3:
        return _python(rng)
    if kind == 4:
        return " ".join(str(rng.randint(0, 10_000)) for _ in range(rng.randint(1, 6)))
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))


def training_corpus(lines: int, seed: int) -> Iterator[str]:
    """The generated text the BPE merges are learned from; the same arguments, the same text."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield _line(rng)


def train_tokenizer(config: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    """Train the byte-level BPE (the `tokenizers` object) on the generated corpus."""
    reserved = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if config.vocab_size < reserved + len(alphabet):
        raise ValueError(
            f"vocab_size {config.vocab_size} is below the {reserved + len(alphabet)} tokens every "
            "byte-level vocabulary needs (256 bytes plus the special and markup tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    # The built-in models are Qwen2 models, and Hugging Face loaders (`AutoTokenizer`, vLLM)
    # rebuild a Qwen2 model's tokenizer with the Qwen2 class, which sets its own normalizer and
    # pre-tokenizer over whatever tokenizer.json says. Using the same two here makes every
    # loader split text into the very tokens the trainer saw.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(config.corpus_lines, config.seed), trainer)
    # Markup is added after training as plain (not special) tokens, so decoding keeps it for
    # the parser; added tokens are split out before BPE, so no merge can swallow them.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def build_tokenizer(config: TokenizerConfig = TokenizerConfig()) -> PreTrainedTokenizerFast:
    """The offline tokenizer as a Hugging Face tokenizer with the chat template attached.

    `<|endoftext|>` is the pad and bos token, `<|im_end|>` the end of an assistant turn (eos).
    """
    backend = train_tokenizer(config)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        model_max_length=config.model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> Path:
    """Write the tokenizer in Hugging Face format (tokenizer.json and its config)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer written by `save_tokenizer` (or any fast Hugging Face tokenizer folder)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"{directory} does not hold a fast tokenizer")
    return tokenizer
