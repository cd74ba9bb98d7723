"""What a recipe hands the services travels through the stack's artifact store, by URL: the
store is read from ``orchard up``'s record, the SFT dataset is put there once per content, and
the base model is built and published by orchard-trainer (PublishModel), never by the recipe."""

from __future__ import annotations

import ast
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.lm.model_folder import load_model_folder
from orchard.recipes import stages
from orchard.recipes.stages import StageContext, _put_file, base_model_url
from orchard.recipes.weights_client import WeightsError, WeightVersions
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.connection import Profile, write_profile
from orchard.sdk.recipe import Recipe
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig
from orchard.trainer.main import TrainerApplication
from orchard.trainer.policy import load_policy

COMPONENTS = [
    {"name": "etcd", "address": "http://127.0.0.1:2379"},
    {"name": "orchard-env", "address": "127.0.0.1:7100"},
    {"name": "orchard-reward", "address": "127.0.0.1:7200"},
    {"name": "orchard-rollout", "address": "127.0.0.1:7300"},
    {"name": "orchard-trainer", "address": "127.0.0.1:7400"},
]


def _context(
    tmp_path: Path,
    artifacts: str,
    model: str = "builtin:tiny",
    *,
    trainer: str = "t",
    name: str = "t",
) -> StageContext:
    recipe = Recipe.model_validate(
        {"name": name, "tasks": {"builtin": {"count": 3}}, "student": {"model": model}}
    )
    stack = StackEndpoints(
        env="e",
        env_token="",
        reward="r",
        etcd="x",
        trainer=trainer,
        rollout="o",
        artifacts=artifacts,
    )
    (tmp_path / "run").mkdir(exist_ok=True)
    return StageContext(recipe=recipe, run=RunDir(tmp_path / "run"), stack=stack, tasks={})


def test_the_store_is_read_from_orchard_up(tmp_path: Path) -> None:
    write_profile(Profile(endpoint="127.0.0.1:7100", token="t0ken"), tmp_path / "profile.json")
    up = {"pid": 1, "components": COMPONENTS, "artifacts": "file:///srv/orchard/artifacts"}
    (tmp_path / "up.json").write_text(json.dumps(up))
    stack = StackEndpoints.from_state_dir(tmp_path)
    assert stack.artifacts == "file:///srv/orchard/artifacts"
    assert stack.artifact_store().root_url == "file:///srv/orchard/artifacts"
    del up["artifacts"]  # an `orchard up` of before: the recipe says what is missing
    (tmp_path / "up.json").write_text(json.dumps(up))
    with pytest.raises(ValueError, match="names no artifact store"):
        StackEndpoints.from_state_dir(tmp_path).artifact_store()


def test_the_dataset_goes_to_the_store_once(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    ctx = _context(tmp_path, store_dir.as_uri())
    data = tmp_path / "sft.jsonl"
    data.write_text('{"id": "a"}\n')
    first = _put_file(ctx, data, "datasets")
    assert first.startswith(store_dir.as_uri() + "/recipes/datasets/") and first.endswith(".jsonl")
    assert Path(first.removeprefix("file://")).read_text() == '{"id": "a"}\n'
    data.write_text('{"id": "b"}\n')
    assert _put_file(ctx, data, "datasets") != first  # new content, new URL; the old one stays
    assert Path(first.removeprefix("file://")).read_text() == '{"id": "a"}\n'


@pytest.fixture
async def trainer(etcd: EmbeddedEtcd, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """A real orchard-trainer on loopback (its registry in a real etcd): address, store URL."""
    namespace = f"recipe-{uuid.uuid4().hex}/"
    store = (tmp_path / "store").as_uri()
    config = TrainerConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        etcd=EtcdConfig(
            endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
        ),
        artifacts=ArtifactsConfig(root=store),
        weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
    )
    server = TrainerApplication(config).server()
    await server.start()
    await server.set_serving()
    try:
        yield server.addresses[0], store
    finally:
        await server.stop()
        async with EtcdStore([etcd.endpoint], namespace=namespace) as kv:
            await kv.delete_prefix("")


async def test_the_trainer_builds_and_publishes_the_base_model(trainer, tmp_path: Path) -> None:
    """The recipe never builds a model: orchard-trainer builds the built-in student from the
    run's seed, once, and publishes it as "base" of the run's model."""
    address, store = trainer
    ctx = _context(tmp_path, store, trainer=address)
    ctx.seed = 5
    url = await base_model_url(ctx)
    assert url.startswith(store + "/models/tiny-")
    assert await base_model_url(ctx) == url  # idempotent: no second build, the same version
    assert len(list((tmp_path / "store" / "models").iterdir())) == 1
    saved = load_model_folder(Path(url.removeprefix("file://"))).model.state_dict()
    built = load_policy("builtin:tiny", seed=5).model.state_dict()
    assert all(torch.equal(saved[k], built[k]) for k in built)  # what SFT used to start from
    async with WeightVersions(address) as weights:
        base = await weights.get(ctx.registry_model, "base")
        assert base is not None and base.location == url and base.number == 1
        assert await weights.get(ctx.registry_model, "step-1") is None
        assert [v.version for v in await weights.list(ctx.registry_model)] == ["base"]
    assert "torch" not in _stages_imports()


async def test_a_model_named_by_url_or_folder_is_published_as_it_is(
    trainer, tmp_path: Path
) -> None:
    address, store = trainer
    built = await base_model_url(_context(tmp_path, store, trainer=address, name="a"))
    by_url = _context(tmp_path, store, model=built, trainer=address, name="b")
    assert await base_model_url(by_url) == built
    # a folder of this machine goes into the store first: the trainer never reads this host
    folder = tmp_path / "local-model"
    shutil.copytree(Path(built.removeprefix("file://")), folder)
    by_folder = _context(tmp_path, store, model=str(folder), trainer=address, name="c")
    uploaded = await base_model_url(by_folder)
    assert uploaded.startswith(store + "/recipes/models/") and uploaded != built
    with pytest.raises(WeightsError, match="NOT_FOUND"):
        missing = _context(tmp_path, store, model=built + "-gone", trainer=address, name="d")
        await base_model_url(missing)


def _stages_imports() -> set[str]:
    """Top-level modules stages.py imports."""
    tree = ast.parse(Path(stages.__file__).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0] if node.module != "orchard" else node.module)
    return names
