"""Where a recipe run keeps its outputs, and how a stage knows it is already done.

One folder per run (the recipe's ``output_dir``)::

    recipe.json          the validated recipe the run started with
    tasks/               the task manifest and, for the built-in suite, the repositories
    <stage>/             each stage's outputs
    <stage>/done.json    written last, when the stage finished: its summary

A stage whose ``done.json`` exists is not run again: an interrupted run resumes at the first
stage that did not finish. A stage writes into ``<stage>/`` and nothing else, so removing that
folder runs the stage (and only it) again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.sdk.recipe import Recipe

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore

__all__ = ["RecipeMismatch", "RunDir", "StackEndpoints"]


class RecipeMismatch(ValueError):
    """The output folder holds a run of a different recipe."""


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON next to ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _with_new_settings(saved: Any, current: Any) -> Any:
    """A saved recipe with the settings it lacks taken from ``current``: settings added to
    recipes after the run folder was written could not have been set by its run, so a folder
    of an earlier version resumes when nothing it holds changed."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return saved
    return {
        **{k: v for k, v in current.items() if k not in saved},
        **{k: _with_new_settings(v, current.get(k)) for k, v in saved.items()},
    }


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def open(cls, recipe: Recipe) -> RunDir:
        """The run folder of ``recipe`` (created); raises `RecipeMismatch` when it holds a run
        of another recipe, so two recipes never mix their outputs."""
        if recipe.output_dir is None:
            raise ValueError("the recipe has no output_dir; load it with load_recipe")
        run = cls(Path(recipe.output_dir))
        run.root.mkdir(parents=True, exist_ok=True)
        saved = run.root / "recipe.json"
        current = json.loads(recipe.model_dump_json())
        if saved.exists():
            previous = _with_new_settings(json.loads(saved.read_text(encoding="utf-8")), current)
            if previous != current:
                changed = sorted(
                    k for k in {*previous, *current} if previous.get(k) != current.get(k)
                )
                raise RecipeMismatch(
                    f"{run.root} holds a run of a different recipe (it differs in: "
                    f"{', '.join(changed)}); give another output_dir, or remove the folder to "
                    "start over"
                )
        else:
            write_json(saved, current)
        return run

    def claim_seed(self, seed: int) -> None:
        """Record the run's seed (``seed.json``); raises `RecipeMismatch` when the folder
        holds a run with another seed, whose stages' outputs would mix with this one's."""
        saved = self.root / "seed.json"
        if saved.exists():
            previous = json.loads(saved.read_text(encoding="utf-8"))["seed"]
            if previous != seed:
                raise RecipeMismatch(
                    f"{self.root} holds a run with seed {previous}, not {seed}: run it with "
                    f"--seed {previous}, give another output_dir, or remove the folder to start "
                    "over"
                )
        else:
            write_json(saved, {"seed": seed})

    def stage(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def done(self, name: str) -> dict[str, Any] | None:
        """The summary of a finished stage, or None when it has not finished."""
        marker = self.root / name / "done.json"
        if not marker.exists():
            return None
        data: dict[str, Any] = json.loads(marker.read_text(encoding="utf-8"))
        return data

    def finish(self, name: str, summary: Mapping[str, Any]) -> None:
        write_json(self.root / name / "done.json", dict(summary))

    def reset(self, name: str) -> None:
        """Forget a stage's outputs, so it runs again."""
        shutil.rmtree(self.root / name, ignore_errors=True)


NEEDED = ("etcd", "orchard-reward", "orchard-rollout", "orchard-trainer")
"""The components of `orchard up` a recipe talks to besides orchard-env."""


@dataclass(frozen=True)
class StackEndpoints:
    """The running services a recipe talks to."""

    env: str
    """orchard-env's gRPC address."""
    env_token: str
    reward: str
    """orchard-reward's gRPC address."""
    etcd: str
    """etcd's client URL (the weight registry lives there)."""
    trainer: str
    """orchard-trainer's gRPC address (SFT and RL train there)."""
    rollout: str
    """orchard-rollout's gRPC address (the student's rollouts run there)."""
    env_metrics: str = ""
    """HOST:PORT of orchard-env's /metrics, when it exports them (the report reads them)."""
    artifacts: str = ""
    """URL of the artifact store the services share (``file://`` on a shared volume,
    ``s3://...``): what a recipe hands a service (a dataset, a model folder) goes there and is
    named by URL, never by a path on this machine."""

    def artifact_store(self) -> ArtifactStore:
        """The stack's artifact store; raises ValueError saying how to name one when unset."""
        from orchard.core.artifacts import ArtifactStore  # noqa: PLC0415

        if not self.artifacts:
            raise ValueError(
                "the stack names no artifact store: run the services with `orchard up`, which "
                "records one, or give StackEndpoints(artifacts=URL) the URL every service reads"
            )
        return ArtifactStore(self.artifacts)

    @classmethod
    def from_file(cls, path: Path, environ: Mapping[str, str] | None = None) -> StackEndpoints:
        """Services named in a JSON or YAML file (for services on other machines than this
        one): ``env``, ``reward``, ``rollout``, ``trainer`` (gRPC addresses), ``etcd`` (client
        URL), ``artifacts`` (the store's URL), optionally ``env_metrics``; orchard-env's token
        comes from ``$ORCHARD_TOKEN``, never from the file. Raises ValueError naming what is
        missing or unknown."""
        import yaml  # noqa: PLC0415

        environ = os.environ if environ is None else environ
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read the stack file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of service names to addresses")
        needed = {"env", "reward", "rollout", "trainer", "etcd", "artifacts"}
        known = needed | {"env_metrics"}
        missing, unknown = sorted(needed - set(data)), sorted(set(data) - known)
        if missing or unknown:
            raise ValueError(
                f"{path}: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {', '.join(missing)}" if missing else "",
                        f"unknown {', '.join(unknown)} (choose from {', '.join(sorted(known))})"
                        if unknown
                        else "",
                    )
                    if part
                )
            )
        return cls(
            env_token=environ.get("ORCHARD_TOKEN", ""),
            **{key: str(value) for key, value in data.items()},
        )

    @classmethod
    def from_state_dir(cls, state_dir: Path | None = None) -> StackEndpoints:
        """The services ``orchard up`` runs for this state dir (its ``up.json`` and profile;
        orchard-env's metrics address from ``$ORCHARD_ENV_METRICS`` when it exports them);
        raises FileNotFoundError saying to run ``orchard up`` when none runs."""
        from orchard.sdk.connection import read_profile  # noqa: PLC0415
        from orchard.sdk.connection import state_dir as default_state_dir  # noqa: PLC0415

        state = state_dir or default_state_dir()
        up = state / "up.json"
        if not up.exists():
            raise FileNotFoundError(
                f"no Orchard runs for state dir {state}: start it with `orchard up --detach`"
            )
        running = json.loads(up.read_text(encoding="utf-8"))
        components = {c["name"]: c["address"] for c in running.get("components", [])}
        profile = read_profile(state / "profile.json")
        if profile is None:
            raise FileNotFoundError(f"no Orchard profile in {state}: run `orchard up --detach`")
        missing = [n for n in NEEDED if n not in components]
        if missing:
            raise FileNotFoundError(
                f"`orchard up` runs without {', '.join(missing)}; restart it with every service"
            )
        return cls(
            env=profile.endpoint,
            env_token=profile.token or "",
            reward=components["orchard-reward"],
            etcd=components["etcd"],
            trainer=components["orchard-trainer"],
            rollout=components["orchard-rollout"],
            env_metrics=os.environ.get("ORCHARD_ENV_METRICS", ""),
            artifacts=str(running.get("artifacts", "")),
        )
