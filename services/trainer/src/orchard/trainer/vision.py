"""Vision-language students: screenshots travel with the tokens into SFT.

A student that is a Hugging Face vision-language model folder (`config.json` with a
``vision_config``, and a processor) is loaded by `orchard.trainer.policy.load_policy` with
`AutoModelForImageTextToText` and `AutoProcessor`. PrepareDataset renders a teacher's GUI
conversation with the processor's chat template (`orchard.lm.vision.VisionChatRenderer`): each
screenshot's image token is expanded into the tokens of its features, and the rendered row keeps
its conversation, so the screenshots (data URLs) travel with the row. SFT samples are cut from
the turns as for a text model (`orchard.trainer.masks`: the loss on assistant tokens only, by
turn and credit), and `VisionInputs` gives each sample the screenshots whose tokens it holds;
a micro-batch runs them through the processor into ``pixel_values`` (and whatever else the model
family takes) beside the token ids.

A sample cut on the left (longer than the context window) never keeps part of a screenshot's
tokens: the cut moves right past them, and the screenshot is left out with the oldest context.

The vision encoder is frozen (`freeze_vision_encoder`): its parameters keep
``requires_grad=False``, so the optimizer never sees them. The projector between it and the
language model, and the language model, train.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from orchard.lm.chat import ChatFormatError
from orchard.lm.vision import VisionChatRenderer, decode_image_url, message_image_urls
from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.masks import (
    Sample,
    SampleConfig,
    SampleSet,
    Skip,
    SkipReason,
    TrajectoryError,
    sft_samples,
)
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "FrozenVision",
    "VisionInputs",
    "VisionSample",
    "freeze_vision_encoder",
    "row_images",
]

VISION_ENCODERS = ("vision_tower", "visual", "vision_model", "vision_encoder")
"""Names of the vision encoder module in the families transformers ships (LLaVA and most
others: ``vision_tower``; Qwen2-VL: ``visual``; Idefics3/SmolVLM: ``vision_model``)."""
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector")
"""Names of the projector into the language model's embeddings; inside an encoder (Qwen2-VL's
``visual.merger``) it stays trainable too."""
_DEFAULT = SampleConfig()


@dataclass(frozen=True, slots=True)
class FrozenVision:
    """What `freeze_vision_encoder` froze."""

    encoders: tuple[str, ...]
    """The frozen modules, by name in the model."""
    frozen: int
    """Parameters (numbers, not tensors) frozen."""
    trainable: int
    """Parameters left to train (projector and language model)."""


def freeze_vision_encoder(model: torch.nn.Module) -> FrozenVision:
    """Set ``requires_grad=False`` on the vision encoder's parameters, a projector inside it
    excepted; raises `ValueError` when the model has no module named like an encoder."""
    encoders: list[str] = []
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in VISION_ENCODERS and not any(name.startswith(e + ".") for e in encoders):
            encoders.append(name)
    if not encoders:
        raise ValueError(
            f"{type(model).__name__} has no vision encoder module named one of "
            f"{', '.join(VISION_ENCODERS)}; cannot freeze it"
        )
    for encoder in encoders:
        for name, parameter in model.get_submodule(encoder).named_parameters():
            if not any(part in PROJECTORS for part in name.split(".")):
                parameter.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return FrozenVision(tuple(encoders), frozen, trainable)


@dataclass(frozen=True, slots=True)
class VisionSample(Sample):
    """A sample with the encoded bytes of the images whose tokens it holds, in their order."""

    images: tuple[bytes, ...] = ()


def row_images(row: trajectory_pb2.Trajectory) -> list[bytes]:
    """The images of a row's conversation (kept by PrepareDataset for a vision-language
    student), in the order the template renders them; raises `TrajectoryError` for a
    conversation that is not JSON messages or an image that is not a data URL."""
    if not row.conversation_json:
        return []
    try:
        messages = json.loads(row.conversation_json)
    except json.JSONDecodeError as exc:
        raise TrajectoryError(
            f"trajectory {row.id!r}: conversation_json is not JSON ({exc.msg})"
        ) from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TrajectoryError(f"trajectory {row.id!r}: conversation_json is not chat messages")
    try:
        return [decode_image_url(url) for url in message_image_urls(messages)]
    except ChatFormatError as exc:
        raise TrajectoryError(f"trajectory {row.id!r}: {exc}") from None


def _tokens(row: trajectory_pb2.Trajectory) -> list[int]:
    ids: list[int] = []
    for turn in row.turns:
        ids.extend(turn.input_token_ids)
        ids.extend(turn.output_token_ids)
    return ids


class VisionInputs:
    """SFT samples and micro-batches of a vision-language student (see the module docstring)."""

    def __init__(self, renderer: VisionChatRenderer) -> None:
        self.renderer = renderer
        self.image_token_id = renderer.image_token_id

    def sft_samples(
        self, row: trajectory_pb2.Trajectory, config: SampleConfig = _DEFAULT
    ) -> list[Sample | Skip]:
        """`masks.sft_samples` of the row, each with the images whose tokens it holds; raises
        `TrajectoryError` when the row's image tokens are not its images' (another model's
        rendering, or a conversation changed after it)."""
        built = sft_samples(row, config)
        if not any(isinstance(b, Sample) for b in built):
            return built
        images = row_images(row)
        tokens = _tokens(row)
        positions = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        try:
            counts = [self.renderer.image_tokens(image) for image in images]
        except ChatFormatError as exc:
            raise TrajectoryError(f"trajectory {row.id!r}: {exc}") from None
        if sum(counts) != len(positions) or 0 in counts:
            raise TrajectoryError(
                f"trajectory {row.id!r}: its turns hold {len(positions)} image token(s), and its "
                f"conversation's {len(images)} image(s) make {sum(counts)} under this model's "
                "processor: the row was rendered for another model, or its conversation changed"
            )
        spans: list[tuple[int, int]] = []  # first and last token of each image
        offset = 0
        for count in counts:
            spans.append((positions[offset], positions[offset + count - 1]))
            offset += count
        return [b if isinstance(b, Skip) else self._with_images(b, images, spans) for b in built]

    @staticmethod
    def _with_images(
        sample: Sample,
        images: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
    ) -> VisionSample | Skip:
        cut = sample.truncated
        end = cut + len(sample.token_ids)
        for first, last in spans:
            if first < cut <= last:  # the cut splits an image: leave all of it out
                cut = last + 1
        drop = cut - sample.truncated
        mask = sample.loss_mask[drop:]
        if not any(mask[1:]):
            return Skip(sample.trajectory_id, SkipReason.NO_LOSS_TOKENS)
        kept = tuple(
            image
            for image, (first, last) in zip(images, spans, strict=True)
            if cut <= first and last < end
        )
        return VisionSample(
            trajectory_id=sample.trajectory_id,
            token_ids=sample.token_ids[drop:],
            loss_mask=mask,
            rollout_logprobs=sample.rollout_logprobs[drop:],
            truncated=cut,
            turn=sample.turn,
            images=kept,
        )

    def build_sft_samples(
        self, rows: Iterable[trajectory_pb2.Trajectory], config: SampleConfig = _DEFAULT
    ) -> SampleSet:
        """SFT samples of a dataset with their images, and skip counts by reason."""
        samples: list[Sample] = []
        skipped: Counter[SkipReason] = Counter()
        for row in rows:
            for built in self.sft_samples(row, config):
                if isinstance(built, Skip):
                    skipped[built.reason] += 1
                else:
                    samples.append(built)
        return SampleSet(tuple(samples), skipped)

    def collate(self, samples: Sequence[Sample], pad_id: int) -> TokenBatch:
        """`batch.collate` of the samples, with the model inputs of their images (none when no
        sample holds one)."""
        batch = collate(samples, pad_id=pad_id)
        images = [s.images for s in samples if isinstance(s, VisionSample) and s.images]
        if not images:
            return batch
        try:
            inputs = self.renderer.pixel_inputs(images)
        except ChatFormatError as exc:
            raise TrajectoryError(str(exc)) from None
        return TokenBatch(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            targets=batch.targets,
            loss_mask=batch.loss_mask,
            rollout_logprobs=batch.rollout_logprobs,
            model_inputs=inputs,
        )
