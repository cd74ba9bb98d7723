"""Configuration of ``orchard-trainer serve``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_TRAINER_CONFIG``),
``ORCHARD_TRAINER_*`` variables, ``--set key=value``, flags.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig

__all__ = ["EtcdConfig", "JobsConfig", "TrainerConfig", "WeightsConfig"]


class EtcdConfig(ConfigModel):
    """Where job records and weight versions live."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="etcd client URLs (http://HOST:PORT); required: `orchard up` starts one.",
    )
    prefix: str = Field(
        default="orchard/trainer/",
        description="Key prefix of the job records (jobs/<id>, requests/<digest>).",
    )
    weights_prefix: str = Field(
        default="orchard/",
        description="Key prefix of the weight registry (weights/<model>/...); inference "
        "engines must follow the same one.",
    )
    timeout_s: float = Field(default=5.0, gt=0, description="Deadline of one etcd call.")


class WeightsConfig(ConfigModel):
    """Where checkpoints go and under which model name versions are published."""

    checkpoint_dir: str = Field(
        default="trainer-checkpoints",
        min_length=1,
        description="Root folder of checkpoints, <checkpoint_dir>/<job id>/<version>/; "
        "inference engines read published model folders from here, so it must be a path "
        "they can reach.",
    )
    registry_model: str = Field(
        default="policy",
        min_length=1,
        description="Model name in the weight registry that jobs publish to.",
    )


class JobsConfig(ConfigModel):
    """Limits on the jobs one replica runs."""

    max_running: int = Field(
        default=2,
        ge=1,
        description="Jobs training at once in this process; more get RESOURCE_EXHAUSTED.",
    )
    max_buffered_samples: int = Field(
        default=100_000,
        ge=1,
        description="Samples a job buffers between steps; SubmitGroups past it fails with "
        "RESOURCE_EXHAUSTED until a Step consumes them.",
    )
    resume_on_start: bool = Field(
        default=True,
        description="On start, jobs left RUNNING or PENDING by a previous process resume from "
        "their last checkpoint (from the start without one); off: they are marked FAILED.",
    )


class TrainerConfig(ServiceConfig):
    """Everything ``orchard-trainer serve`` runs with."""

    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7300"])
    etcd: EtcdConfig = EtcdConfig()
    weights: WeightsConfig = WeightsConfig()
    jobs: JobsConfig = JobsConfig()

    @model_validator(mode="after")
    def _etcd_required(self) -> TrainerConfig:
        if not self.etcd.endpoints:
            raise ValueError(
                "etcd.endpoints is empty: give an etcd URL "
                "(--etcd http://127.0.0.1:2379 or --set etcd.endpoints=http://127.0.0.1:2379)"
            )
        return self
