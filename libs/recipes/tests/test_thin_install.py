"""orchard-recipes is a thin client: it installs and runs without torch and the service packages.

The dependency closure is what the pyprojects declare: the monorepo distributions by walking
their `dependencies`, the third-party ones from the requirements each installed distribution
declares. A clean venv (`python -m venv --without-pip`) then holds exactly that closure: the
monorepo `src` folders through a .pth, and every file the development venv's third-party
distributions of the closure installed, linked one by one, so a package outside the closure
(torch above all) cannot be imported there. No network.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
HEAVY = {"torch", "transformers", "deepspeed", "ray", "vllm"}
"""What a client install must never pull in."""
SERVICE_DISTRIBUTIONS = {"orchard-lm", "orchard-trainer", "orchard-rollout", "orchard-reward"}


def _key(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _monorepo() -> dict[str, Path]:
    """Every distribution of the repository: its name to the folder of its pyproject."""
    found = {}
    for pyproject in sorted(ROOT.glob("*/*/pyproject.toml")):
        if pyproject.parent.parent.name in ("libs", "services"):
            name = tomllib.loads(pyproject.read_text())["project"]["name"]
            found[_key(name)] = pyproject.parent
    return found


@dataclass
class Closure:
    """The distributions one install brings: monorepo ones (by folder) and third-party ones."""

    monorepo: dict[str, Path]
    third_party: dict[str, metadata.Distribution]

    def names(self) -> set[str]:
        return set(self.monorepo) | set(self.third_party)


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": e}) for e in extras | {""})


def _third_party(names: list[Requirement]) -> dict[str, metadata.Distribution]:
    """The installed distributions these requirements need, recursively, from their metadata."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        requirement = todo.pop()
        key = _key(requirement.name)
        if key in found:
            continue
        dist = metadata.distribution(requirement.name)  # missing: PackageNotFoundError, a failure
        found[key] = dist
        for line in dist.requires or []:
            needed = Requirement(line)
            if _applies(needed, set(requirement.extras)):
                todo.append(needed)
    return found


def declared_closure(distribution: str) -> Closure:
    """Walk the pyprojects from `distribution` (a monorepo one) down to third-party names."""
    repo = _monorepo()
    monorepo: dict[str, Path] = {}
    outside: list[Requirement] = []
    todo = [_key(distribution)]
    while todo:
        key = todo.pop()
        if key in monorepo:
            continue
        monorepo[key] = repo[key]
        project = tomllib.loads((repo[key] / "pyproject.toml").read_text())["project"]
        for line in project.get("dependencies", []):
            requirement = Requirement(line)
            if not _applies(requirement, set()):
                continue
            if _key(requirement.name) in repo:
                todo.append(_key(requirement.name))
            else:
                outside.append(requirement)
    return Closure(monorepo, _third_party(outside))


def test_the_declared_closure_has_no_torch_and_no_service_package() -> None:
    closure = declared_closure("orchard-recipes")
    assert set(closure.monorepo) == {
        "orchard-recipes",
        "orchard-tasks",
        "orchard-sdk",
        "orchard-core",
        "orchard-proto",
    }
    assert closure.names() & (HEAVY | SERVICE_DISTRIBUTIONS) == set()
    assert {"grpcio", "protobuf", "tqdm", "pyyaml"} <= set(closure.third_party)


def _link_files(dist: metadata.Distribution, site: Path) -> None:
    """Link every file `dist` installed into site-packages (scripts and caches left out)."""
    files = dist.files
    assert files is not None, f"{dist.metadata['Name']} lists no installed files (no RECORD)"
    for entry in files:
        parts = Path(str(entry)).parts
        if parts[0] == ".." or "__pycache__" in parts:
            continue
        source = Path(str(dist.locate_file(entry)))
        target = site.joinpath(*parts)
        if source.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)


@dataclass
class CleanVenv:
    python: Path
    home: Path

    def run(
        self, *argv: str, timeout: float = 120.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`python -I ARGV` in the venv, with a bare environment (plus ``env``)."""
        bare = {"PATH": f"{self.python.parent}:/usr/bin:/bin", "HOME": str(self.home)}
        return subprocess.run(
            [str(self.python), "-I", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=bare | (env or {}),
            cwd=self.home,
            check=False,
        )


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CleanVenv]:
    base = tmp_path_factory.mktemp("thin-install")
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    site = Path(purelib)
    assert site.is_dir(), site
    closure = declared_closure("orchard-recipes")
    sources = [str(folder / "src") for folder in closure.monorepo.values()]
    (site / "orchard_closure.pth").write_text("\n".join(sources) + "\n")
    for dist in closure.third_party.values():
        _link_files(dist, site)
    home = base / "home"
    home.mkdir()
    try:
        yield CleanVenv(venv / "bin" / "python", home)
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("name", [*sorted(HEAVY), "orchard.lm", "orchard.trainer.datasets"])
def test_the_clean_venv_cannot_import_what_is_outside_the_closure(
    clean_venv: CleanVenv, name: str
) -> None:
    done = clean_venv.run("-c", f"import {name}")
    assert done.returncode != 0
    assert "ModuleNotFoundError" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "module",
    [
        "orchard.recipes.swe_suite",
        "orchard.recipes.recipe_tasks",
        "orchard.recipes.workspace",
        "orchard.recipes.rollout_client",
        "orchard.recipes.trainer_client",
        "orchard.recipes.stages",
        "orchard.recipes.pipeline",
        "orchard.recipes.value_model",
        "orchard.recipes.rerank",
    ],
)
def test_every_recipes_module_imports_in_the_clean_venv(clean_venv: CleanVenv, module: str) -> None:
    code = (
        f"import sys, {module}; "
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {sorted(HEAVY)!r}))"
    )
    done = clean_venv.run("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_recipe_check_runs_in_the_clean_venv(clean_venv: CleanVenv) -> None:
    done = clean_venv.run("-m", "orchard.sdk.cli", "recipe", "check")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("recipe builtin-swe:"), done.stdout
    assert re.search(r"^  tasks\s+built-in suite", done.stdout, re.MULTILINE), done.stdout
    for stage in ("collect", "credit", "curate", "sft", "rl", "evaluate"):
        assert re.search(rf"^{stage}\s", done.stdout, re.MULTILINE), done.stdout


def test_the_builtin_suite_is_generated_and_materialized_in_the_clean_venv(
    clean_venv: CleanVenv,
) -> None:
    code = (
        "import pathlib, sys\n"
        "from orchard.recipes.swe_suite import generate_suite\n"
        "from orchard.tasks.swe_tasks import materialize\n"
        "task = generate_suite(1, seed=3)[0]\n"
        "instance = materialize(task.blueprint, pathlib.Path(sys.argv[1]))\n"
        "print(instance.instance_id, len(instance.fail_to_pass))\n"
    )
    done = clean_venv.run("-c", code, str(clean_venv.home / "repos"))
    assert done.returncode == 0, done.stderr[-3000:]
    instance_id, fail_to_pass = done.stdout.split()
    assert instance_id and int(fail_to_pass) > 0


def test_the_clean_venv_holds_only_the_closure(clean_venv: CleanVenv) -> None:
    """What importlib.metadata sees there is the third-party closure, and nothing of torch's."""
    code = (
        "from importlib import metadata\n"
        "print(' '.join(sorted(d.metadata['Name'].lower() for d in metadata.distributions())))"
    )
    done = clean_venv.run("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {_key(name) for name in done.stdout.split()}
    closure = declared_closure("orchard-recipes")
    assert seen == set(closure.third_party)


# A reduced recipe: 15 built-in tasks (three per bug family), every stage, small budgets.
REDUCED = {
    "name": "thin",
    "tasks": {
        "builtin": {"count": 15, "seed": 3},
        "split": {"sft": 0.34, "rl": 0.33, "evaluate": 0.33},
    },
    "harnesses": ["builtin:swe"],
    "stages": {
        "collect": {"attempts_per_task": 2, "budget": {"max_steps": 8, "wall_clock_s": 120}},
        "sft": {"epochs": 2, "batch_size": 2, "learning_rate": 0.003, "warmup_steps": 1},
        "rl": {
            "steps": 1,
            "groups_per_step": 1,
            "sampler": {"kind": "fixed", "n": 2},
            "budget": {"max_steps": 3, "max_tokens": 256, "wall_clock_s": 120},
        },
        "evaluate": {"attempts_per_task": 1},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _services(state: Path) -> Iterator[dict[str, str]]:
    """etcd, orchard-env (local runtime), orchard-reward, orchard-rollout and orchard-trainer as
    processes of the development venv, as `orchard up` runs them; the stack file's fields."""
    from orchard.sdk.cli.host_probe import remove_cgroup_parent
    from orchard.sdk.cli.stack import LocalStack

    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    state.mkdir()
    run_dir = Path(tempfile.mkdtemp(prefix="oi-"))  # sandbox socket paths must stay short
    cgroup_parent = f"orchard-test-{uuid.uuid4().hex[:8]}"
    addresses = {name: f"127.0.0.1:{_free_port()}" for name in ("reward", "rollout", "trainer")}
    metrics = f"127.0.0.1:{_free_port()}"
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{_free_port()}",
        token=secrets.token_urlsafe(16),
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
        settings=[f"server.metrics_address={metrics}"],
        services=addresses,
    )
    try:
        stack.start()
        yield {
            "env": stack.endpoint,
            "etcd": stack.etcd_endpoint,
            "artifacts": stack.artifacts_url,
            "env_metrics": metrics,
            **addresses,
            "token": stack.token,
        }
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder for the stack's state, the artifact store and the run, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="orchard-thin-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_reduced_recipe_runs_from_the_clean_venv_against_running_services(
    clean_venv: CleanVenv, scratch: Path
) -> None:
    """`orchard recipe run` from the thin install: every stage talks to the services by gRPC."""
    with _services(scratch / "stack") as fields:
        token = fields.pop("token")
        stack_file = scratch / "stack.json"
        stack_file.write_text(json.dumps(fields))
        recipe_file = scratch / "thin.yaml"
        output = scratch / "run"
        recipe_file.write_text(json.dumps({**REDUCED, "output_dir": str(output)}))
        done = clean_venv.run(
            "-m", "orchard.sdk.cli", "recipe", "run", str(recipe_file),
            "--stack", str(stack_file), "--no-progress", "--workers", "3",
            timeout=1400, env={"ORCHARD_TOKEN": token},
        )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert (output / "tasks" / "tasks.jsonl").read_text().count("\n") == 15
    for stage in ("collect", "credit", "curate", "sft", "rl", "evaluate"):
        assert (output / stage / "done.json").is_file(), (stage, done.stdout[-2000:])
    report = json.loads((output / "report" / "report.json").read_text())
    models = {e["model"]: e for e in report["evaluations"]}
    assert set(models) == {"base", "sft", "rl"}
    assert all(e["attempts"] == 5 for e in models.values()), models
    assert report["services"]["execs"] > 0
    assert "Held-out resolve rate" in (output / "report" / "report.md").read_text()
