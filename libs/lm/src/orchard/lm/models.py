"""Models built from a config in code, so tests and demos never download weights: causal LMs,
and a tiny vision-language model with its processor."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM


def tiny_causal_lm(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 256,
    seed: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2ForCausalLM:
    """A small Qwen2-architecture model with random weights (about 0.1 M parameters by default).

    The seed fixes the initial weights, so two calls with the same arguments give the same model.
    The token ids, when given, go into the config (and so into a saved model folder).
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def tiny_causal_lm_for(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 1024,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """`tiny_causal_lm` sized for `tokenizer` (its whole vocabulary, added tokens included),
    with its bos, eos and pad ids in the config."""
    return tiny_causal_lm(
        len(tokenizer),
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        context=context,
        seed=seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


IMAGE_TOKEN = "<image>"
"""The image token of the tiny vision-language model's processor."""


def tiny_vision_processor(
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    image_size: int = 32,
    patch_size: int = 8,
) -> Any:
    """A LLaVA processor for `tiny_vision_language_model`: a CLIP image processor that resizes
    and crops every image to `image_size` pixels square, `tokenizer` (default: the offline one)
    with the image token added, and the chat template with images
    (`orchard.lm.vision.vision_chat_template`). An image becomes
    (`image_size` / `patch_size`)² image tokens."""
    from transformers import LlavaProcessor  # noqa: PLC0415

    from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415
    from orchard.lm.vision import vision_chat_template  # noqa: PLC0415

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    import transformers  # noqa: PLC0415

    # The PIL backend by name where it exists: the default one wants torchvision, which the
    # CPU build of torch lacks (it falls back with a warning).
    image_processor: Any = getattr(transformers, "CLIPImageProcessorPil", None)
    if image_processor is None:  # pragma: no cover - transformers before the PIL backends
        image_processor = transformers.CLIPImageProcessor
    images = image_processor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
        image_token=IMAGE_TOKEN,
        chat_template=vision_chat_template(IMAGE_TOKEN),
    )


def tiny_vision_language_model(
    processor: Any,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden_size: int = 32,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 2048,
    seed: int = 0,
) -> PreTrainedModel:
    """A small LLaVA model with random weights: a one-layer CLIP vision tower, a projector and
    a Qwen2 language model sized for `processor`'s tokenizer (`tiny_vision_processor`, built
    with the same `image_size` and `patch_size`). Saved with its processor, it is a
    vision-language model folder like a real one, loadable with `AutoModelForImageTextToText`
    and `AutoProcessor`."""
    from transformers import (  # noqa: PLC0415
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = processor.tokenizer
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=vision_hidden_size * 2,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden_size,
    )
    text = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(processor.image_token),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(config)
