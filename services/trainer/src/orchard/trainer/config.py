"""Configuration of ``orchard-trainer serve``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_TRAINER_CONFIG``),
``ORCHARD_TRAINER_*`` variables, ``--set key=value``, flags.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from orchard.core.artifacts import ArtifactError, ArtifactsConfig, ArtifactStore, parse_url
from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig

__all__ = [
    "ArtifactsConfig",
    "EtcdConfig",
    "JobsConfig",
    "PodWorkersConfig",
    "RayWorkersConfig",
    "TrainerConfig",
    "WeightsConfig",
    "WorkersConfig",
]


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

    checkpoint_url: str = Field(
        default="",
        description="URL under artifacts.root where checkpoints are stored, "
        "<checkpoint_url>/<job id>/<version>/; published weight locations point into it, so "
        "inference engines must reach it. Empty: <artifacts.root>/checkpoints.",
    )
    scratch_dir: str = Field(
        default="trainer-scratch",
        min_length=1,
        description="Local folder of this process: a checkpoint is written here, then put in "
        "the store, and downloaded checkpoints are cached here; never read by another service. "
        "With `workers.kind` ray on a cluster or pods, the ranks write here too: an absolute "
        "path on a volume they mount at the same path.",
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
    max_preparing: int = Field(
        default=2,
        ge=1,
        description="PrepareDataset calls rendering at once in this process (each takes a "
        "core); more get RESOURCE_EXHAUSTED.",
    )
    resume_on_start: bool = Field(
        default=True,
        description="On start, jobs left RUNNING or PENDING by a previous process resume from "
        "their last checkpoint (from the start without one); off: they are marked FAILED.",
    )


class RayWorkersConfig(ConfigModel):
    """Ranks as Ray actors (`workers.kind: ray`)."""

    address: str = Field(
        default="",
        description="A Ray cluster to join (e.g. ray://head:10001); empty starts a local Ray "
        "on 127.0.0.1, ended with the service. On a cluster, `weights.scratch_dir` and model "
        "folders must be on a volume every node mounts.",
    )
    cpus_per_rank: float = Field(default=1.0, gt=0, description="CPUs Ray reserves per rank.")
    gpus_per_rank: float = Field(default=0.0, ge=0, description="GPUs Ray reserves per rank.")
    init_cpus: int | None = Field(
        default=None, ge=1, description="CPUs a local Ray offers (unset: the machine's)."
    )


class PodWorkersConfig(ConfigModel):
    """Ranks on standing worker Pods (`workers.kind: pods`), each running
    ``orchard-trainer worker``."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="The workers as HOST:PORT (e.g. trainer-workers-0.trainer-workers:7400); "
        "a job of N ranks takes the first N that are free, rank 0's host is the rendezvous "
        "address. The trainer's scratch folder (`weights.scratch_dir`) and the artifact store "
        "must be mounted at the same paths in the workers.",
    )
    key_file: str = Field(
        default="",
        description="File holding the key shared with the workers (at least 16 bytes); both "
        "sides prove it before anything else is exchanged.",
    )
    rendezvous_port: int = Field(
        default=29500,
        ge=0,
        lt=65536,
        description="torch.distributed port on rank 0's worker; 0: a free port that worker names.",
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a worker may take to accept a job."
    )

    @model_validator(mode="after")
    def _endpoints_parse(self) -> PodWorkersConfig:
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"workers.pods.endpoints: {endpoint!r} is not HOST:PORT")
        return self


class WorkersConfig(ConfigModel):
    """The worker group each job trains on: rank processes this service starts and drives."""

    ranks: int = Field(
        default=1,
        ge=1,
        description="Ranks (training processes) of a job whose spec leaves `ranks` at 0.",
    )
    max_ranks: int = Field(
        default=8,
        ge=1,
        description="Most ranks one job may ask for; more is INVALID_ARGUMENT.",
    )
    start_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long the ranks of a job may take to load the model and build the "
        "engine before the job fails.",
    )
    stop_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a rank may take to exit when its job ends before it is killed.",
    )
    threads_per_rank: int = Field(
        default=0,
        ge=0,
        description="CPU threads of torch in each rank; 0: the machine's cores divided by "
        "the job's ranks (with Ray: `ray.cpus_per_rank`).",
    )
    kind: Literal["subprocess", "ray", "pods"] = Field(
        default="subprocess",
        description="`subprocess` (the default: ranks are processes this service starts on "
        "its machine), `ray` (ranks are Ray actors in a placement group) or `pods` (ranks "
        "run on standing worker Pods, see `workers.pods`).",
    )
    ray: RayWorkersConfig = Field(
        default_factory=RayWorkersConfig, description="Where Ray ranks run."
    )
    pods: PodWorkersConfig = Field(
        default_factory=PodWorkersConfig, description="Where ranks on worker Pods run."
    )

    @model_validator(mode="after")
    def _pods_named(self) -> WorkersConfig:
        if self.kind == "pods" and (not self.pods.endpoints or not self.pods.key_file):
            raise ValueError(
                "workers.kind is pods: give the workers (workers.pods.endpoints) and the file "
                "of their shared key (workers.pods.key_file)"
            )
        return self

    @model_validator(mode="after")
    def _ray_installed(self) -> WorkersConfig:
        if self.kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "workers.kind is ray but Ray is not installed: pip install 'orchard-trainer[ray]'"
            )
        return self


class TrainerConfig(ServiceConfig):
    """Everything ``orchard-trainer serve`` runs with."""

    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7300"])
    etcd: EtcdConfig = EtcdConfig()
    artifacts: ArtifactsConfig = Field(
        default_factory=ArtifactsConfig,
        description="The artifact store: models and datasets jobs name must lie under its root "
        "or allowed prefixes; checkpoints and published weights are written under its root.",
    )
    weights: WeightsConfig = WeightsConfig()
    jobs: JobsConfig = JobsConfig()
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _etcd_required(self) -> TrainerConfig:
        if not self.etcd.endpoints:
            raise ValueError(
                "etcd.endpoints is empty: give an etcd URL "
                "(--etcd http://127.0.0.1:2379 or --set etcd.endpoints=http://127.0.0.1:2379)"
            )
        return self

    @model_validator(mode="after")
    def _default_ranks_allowed(self) -> TrainerConfig:
        if self.workers.ranks > self.workers.max_ranks:
            raise ValueError(
                f"workers.ranks ({self.workers.ranks}) must not exceed workers.max_ranks "
                f"({self.workers.max_ranks})"
            )
        return self

    @model_validator(mode="after")
    def _scratch_shared_with_pods(self) -> TrainerConfig:
        if self.workers.kind == "pods" and not self.weights.scratch_dir.startswith("/"):
            raise ValueError(
                f"workers.kind is pods: weights.scratch_dir ({self.weights.scratch_dir!r}) must "
                "be an absolute path on a volume the worker Pods mount at the same path"
            )
        return self

    @model_validator(mode="after")
    def _checkpoints_in_the_store(self) -> TrainerConfig:
        if self.weights.checkpoint_url:
            try:
                url = parse_url(self.weights.checkpoint_url, what="weights.checkpoint_url")
            except ArtifactError as exc:
                raise ValueError(exc.message) from None
            if not url.is_under(parse_url(self.artifacts.root)):
                raise ValueError(
                    f"weights.checkpoint_url {url.url!r} must lie under artifacts.root "
                    f"{self.artifacts.root!r}: engines read published weights from the store"
                )
        return self

    def checkpoint_url(self) -> str:
        """The URL checkpoints are stored under (canonical)."""
        if self.weights.checkpoint_url:
            return parse_url(self.weights.checkpoint_url).url
        return ArtifactStore(self.artifacts.root).url("checkpoints")
