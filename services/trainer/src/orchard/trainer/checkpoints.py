"""Checkpoints with a version: DeepSpeed state to resume from, a Hugging Face folder to serve.

A checkpoint is one folder, ``<root>/<version>/``, holding

- ``deepspeed/`` — `DeepSpeedEngine.save_checkpoint` output (weights, optimizer, learning-rate
  scheduler, step count), which `load_checkpoint` restores into an engine built with the same
  `EngineConfig`, so training continues exactly where it stopped;
- ``model/`` — the full weights, config and tokenizer (a vision-language model's processor) in
  plain Hugging Face format (`orchard.lm.model_folder.save_model_folder`; gathered from every
  rank under ZeRO-3), which inference engines load;
- ``critic/`` — only for PPO with a value model: the value model's engine, saved like
  ``deepspeed/`` (weights, its own optimizer, schedule and step) and restored by `load_critic`;
  it is never published;
- ``checkpoint.json`` — the manifest (version, step, metadata), written last: a folder without
  it is an unfinished save and is never listed.

`publish_checkpoint` writes the model folder's URL and metadata to the weight registry in
etcd (`orchard.lm.weights.WeightRegistry`); inference engines that follow the registry load it.

Every rank of a world calls `save_checkpoint` and `load_checkpoint` (they are collective); only
rank 0 writes the model folder and the manifest. The manifest's metadata names the world size
it was saved at (``ranks``; 1 when absent). ZeRO stages 1-3 partition the optimizer state by
rank, so a world of another size resumes through DeepSpeed's universal checkpoint format:
`to_universal` converts the ``deepspeed/`` folder (and ``critic/``, with `part=CRITIC_DIR`)
once (rank 0, before the engine is built with `EngineConfig.load_universal`), and
`load_checkpoint` (`load_critic`) reads the converted folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from orchard.lm.model_folder import save_model_folder
from orchard.lm.weights import WeightRegistry, WeightVersion
from orchard.trainer.distributed import import_deepspeed
from orchard.trainer.engine import TrainingEngine

__all__ = [
    "CRITIC_DIR",
    "DEEPSPEED_DIR",
    "MANIFEST",
    "MODEL_DIR",
    "CheckpointError",
    "CheckpointInfo",
    "StoredCheckpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_critic",
    "parse_manifest",
    "publish_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "saved_world_size",
    "step_version",
    "to_universal",
]

MANIFEST = "checkpoint.json"
DEEPSPEED_DIR = "deepspeed"
CRITIC_DIR = "critic"
MODEL_DIR = "model"
_FORMAT = 1
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or does not fit the engine; the message says
    which."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One saved checkpoint (its manifest)."""

    version: str
    """Its name: the folder name, and the weight version it is published as."""
    step: int
    """Optimizer steps taken when it was saved."""
    path: Path
    """The checkpoint folder."""
    created_at: float
    """Unix time the save finished."""
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def deepspeed_dir(self) -> Path:
        return self.path / DEEPSPEED_DIR

    @property
    def model_dir(self) -> Path:
        """The Hugging Face model folder (what `publish_checkpoint` publishes)."""
        return self.path / MODEL_DIR

    @property
    def critic_dir(self) -> Path:
        """The value model's DeepSpeed state (PPO with a critic only)."""
        return self.path / CRITIC_DIR

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _FORMAT,
                "version": self.version,
                "step": self.step,
                "created_at": self.created_at,
                "metadata": dict(self.metadata),
            },
            sort_keys=True,
            indent=1,
        )


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A checkpoint folder in the artifact store, by URL (what the service records and
    publishes; `CheckpointInfo` is the same manifest for a local folder)."""

    url: str
    """The checkpoint folder's URL, ``<checkpoint_url>/<job id>/<version>``."""
    version: str
    step: int
    created_at: float
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def model_url(self) -> str:
        """The Hugging Face model folder's URL (what `publish_checkpoint` publishes)."""
        return f"{self.url}/{MODEL_DIR}"

    @classmethod
    def of(cls, info: CheckpointInfo, url: str) -> StoredCheckpoint:
        return cls(url, info.version, info.step, info.created_at, dict(info.metadata))

    @classmethod
    def from_manifest(cls, text: str | bytes, url: str) -> StoredCheckpoint:
        """The checkpoint at ``url`` whose manifest reads ``text``."""
        return cls(url=url, **_manifest_fields(text, url))


def step_version(step: int, prefix: str = "step") -> str:
    """The conventional version name of a step: ``step-000120`` (``<prefix>-000120``)."""
    return f"{prefix}-{step:06d}"


def save_checkpoint(
    engine: TrainingEngine,
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
    root: str | os.PathLike[str],
    *,
    version: str | None = None,
    metadata: Mapping[str, str] | None = None,
    critic: TrainingEngine | None = None,
) -> CheckpointInfo:
    """Save `engine` at its current step as ``root/<version>/`` (default version:
    `step_version(engine.global_step)`), and `critic`, a value model's engine, in its
    ``critic/`` folder. Collective: every rank calls it.

    The version folder must not exist yet: a saved checkpoint never changes.
    """
    step = engine.global_step
    version = version or step_version(step)
    if not _VERSION.match(version):
        raise CheckpointError(
            f"checkpoint version {version!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    path = Path(root) / version
    # Rank 0 looks before any rank creates the folder, and every rank learns the answer.
    exists = torch.tensor([float(engine.rank == 0 and path.exists())])
    if engine.world_size > 1:
        torch.distributed.all_reduce(exists)
    if exists.item():
        raise CheckpointError(f"{path} exists already; save each checkpoint under a new version")
    path.mkdir(parents=True, exist_ok=True)
    labels = {str(k): str(v) for k, v in (metadata or {}).items()}
    engine.engine.save_checkpoint(
        str(path / DEEPSPEED_DIR), tag=version, client_state={"orchard_version": version}
    )
    if critic is not None:
        critic.engine.save_checkpoint(
            str(path / CRITIC_DIR), tag=version, client_state={"orchard_version": version}
        )
    model_metadata = {**labels, "version": version, "step": str(step)}
    if engine.config.zero_stage == 3:
        deepspeed = import_deepspeed()
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if engine.rank == 0:
                save_model_folder(
                    path / MODEL_DIR, engine.module, tokenizer, metadata=model_metadata
                )
    elif engine.rank == 0:
        save_model_folder(path / MODEL_DIR, engine.module, tokenizer, metadata=model_metadata)
    info = CheckpointInfo(
        version=version, step=step, path=path, created_at=time.time(), metadata=labels
    )
    if engine.rank == 0:
        staging = path / f".{MANIFEST}.tmp"
        staging.write_text(info.to_json())
        staging.rename(path / MANIFEST)
    if engine.world_size > 1:
        torch.distributed.barrier()
    return info


def read_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The manifest of the checkpoint folder `path`."""
    folder = Path(path)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"{folder} is not a finished checkpoint: it has no {MANIFEST} (the save did not "
            "complete, or the path is wrong)"
        )
    return parse_manifest(manifest.read_text(), folder)


def parse_manifest(text: str | bytes, path: Path) -> CheckpointInfo:
    """The manifest ``text`` of the checkpoint folder ``path``."""
    return CheckpointInfo(path=path, **_manifest_fields(text, str(path)))


def _manifest_fields(text: str | bytes, where: str) -> dict[str, Any]:
    try:
        raw: dict[str, Any] = json.loads(text)
        return {
            "version": str(raw["version"]),
            "step": int(raw["step"]),
            "created_at": float(raw["created_at"]),
            "metadata": {str(k): str(v) for k, v in raw.get("metadata", {}).items()},
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}/{MANIFEST} is not a checkpoint manifest: {exc}") from None


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """The finished checkpoints under `root`, oldest step first (unfinished saves left out)."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    found = [read_checkpoint(p) for p in folder.iterdir() if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda c: (c.step, c.created_at))


def saved_world_size(info: CheckpointInfo) -> int:
    """The number of ranks `info` was saved by (1 for checkpoints that do not say)."""
    try:
        return max(1, int(info.metadata.get("ranks", "1")))
    except ValueError:
        return 1


def to_universal(
    info: CheckpointInfo, root: str | os.PathLike[str], *, part: str = DEEPSPEED_DIR
) -> Path:
    """Convert the DeepSpeed state of `info` (its `part` folder: ``deepspeed/``, or
    ``critic/`` for the value model) to a universal checkpoint under ``root`` (replacing an
    earlier conversion there); returns the folder to give `load_checkpoint` (`load_critic`) as
    `universal`. Runs on one process (rank 0), before the engines are built."""
    if not (info.path / part).is_dir():
        raise CheckpointError(f"checkpoint {info.version!r} has no {part}/ folder to convert")
    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal  # noqa: PLC0415

    out = Path(root)
    shutil.rmtree(out, ignore_errors=True)
    arguments = argparse.Namespace(
        input_folder=str(info.path / part / info.version),
        output_folder=str(out / info.version),
        # One worker: the conversion runs in this process, no pool of forked children.
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # Checkpoints of plain models lack the Megatron layout hints; DeepSpeed adds them.
        inject_missing_state=True,
    )
    try:
        with contextlib.redirect_stdout(sys.stderr):
            ds_to_universal.main(arguments)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {info.version!r} saved at {saved_world_size(info)} rank(s) could not "
            f"be converted for another number of ranks: {exc}; resume it at "
            f"{saved_world_size(info)} rank(s)"
        ) from exc
    return out


def load_checkpoint(
    engine: TrainingEngine,
    checkpoint: CheckpointInfo | str | os.PathLike[str],
    *,
    universal: str | os.PathLike[str] | None = None,
) -> int:
    """Restore weights, optimizer, scheduler and step of `checkpoint` into `engine`; returns the
    step. The engine must be built with the same model and `EngineConfig` (ZeRO stage
    included); at another world size (ZeRO 1-3), give the `to_universal` folder as `universal`
    to an engine built with `load_universal`. Collective: every rank calls it."""
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else read_checkpoint(checkpoint)
    _load_engine(engine, info, info.deepspeed_dir, universal)
    if engine.global_step != info.step:
        raise CheckpointError(
            f"checkpoint {info.version!r} was saved at step {info.step} but restored step "
            f"{engine.global_step}"
        )
    return info.step


def load_critic(
    critic: TrainingEngine,
    checkpoint: CheckpointInfo | str | os.PathLike[str],
    *,
    universal: str | os.PathLike[str] | None = None,
) -> int:
    """Restore the value model's weights, optimizer, scheduler and step from the ``critic/``
    folder of `checkpoint` into `critic` (built as it was saved, see `load_checkpoint`); returns
    the value model's own step count. Collective: every rank calls it."""
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else read_checkpoint(checkpoint)
    if not info.critic_dir.is_dir():
        raise CheckpointError(
            f"checkpoint {info.version!r} has no value model ({CRITIC_DIR}/): it was not saved "
            "by a job with ADVANTAGE_ESTIMATOR_CRITIC"
        )
    _load_engine(critic, info, info.critic_dir, universal)
    return critic.global_step


def _load_engine(
    engine: TrainingEngine,
    info: CheckpointInfo,
    folder: Path,
    universal: str | os.PathLike[str] | None,
) -> None:
    loaded, _ = engine.engine.load_checkpoint(
        str(universal if universal is not None else folder),
        tag=info.version,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if loaded is None:
        raise CheckpointError(f"no DeepSpeed checkpoint {info.version!r} in {folder}")


async def publish_checkpoint(
    registry: WeightRegistry,
    checkpoint: CheckpointInfo | StoredCheckpoint,
    *,
    metadata: Mapping[str, str] | None = None,
) -> WeightVersion:
    """Publish `checkpoint`'s model folder as weight version `checkpoint.version`.

    The location is a URL: the stored checkpoint's ``model`` folder, or ``file://`` + the
    local folder's absolute path (on a volume the engines share). The registry record carries
    the checkpoint's metadata, its step and format, plus `metadata`. Publishing the same
    checkpoint again returns the existing record.
    """
    if isinstance(checkpoint, StoredCheckpoint):
        location, where = checkpoint.model_url, checkpoint.url
    else:
        if not (checkpoint.model_dir / "config.json").is_file():
            raise CheckpointError(f"{checkpoint.path} has no model folder to publish")
        location = checkpoint.model_dir.resolve().as_uri()
        where = checkpoint.path.resolve().as_uri()
    labels = {
        **checkpoint.metadata,
        "step": str(checkpoint.step),
        "format": "huggingface",
        "checkpoint": where,
        **{str(k): str(v) for k, v in (metadata or {}).items()},
    }
    return await registry.publish(checkpoint.version, location, labels)
