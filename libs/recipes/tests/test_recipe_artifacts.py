"""What a recipe hands the services travels through the stack's artifact store, by URL: the
store is read from ``orchard up``'s record, and the base model and SFT dataset are put there
once per content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchard.lm.model_folder import load_model_folder
from orchard.recipes.stages import StageContext, _put_file, base_model_folder, base_model_url
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.connection import Profile, write_profile
from orchard.sdk.recipe import Recipe

COMPONENTS = [
    {"name": "etcd", "address": "http://127.0.0.1:2379"},
    {"name": "orchard-env", "address": "127.0.0.1:7100"},
    {"name": "orchard-reward", "address": "127.0.0.1:7200"},
    {"name": "orchard-rollout", "address": "127.0.0.1:7300"},
    {"name": "orchard-trainer", "address": "127.0.0.1:7400"},
]


def _context(tmp_path: Path, artifacts: str, model: str = "builtin:tiny") -> StageContext:
    recipe = Recipe.model_validate(
        {"name": "t", "tasks": {"builtin": {"count": 3}}, "student": {"model": model}}
    )
    stack = StackEndpoints(
        env="e", env_token="", reward="r", etcd="x", trainer="t", rollout="o", artifacts=artifacts
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


def test_the_base_model_and_dataset_go_to_the_store_once(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    ctx = _context(tmp_path, store_dir.as_uri())
    url = base_model_url(ctx)
    assert url.startswith(store_dir.as_uri() + "/recipes/models/")
    stored = Path(url.removeprefix("file://"))
    assert load_model_folder(stored).metadata["version"] == "base"
    assert base_model_url(ctx) == url  # the same content keeps its URL; nothing is rewritten
    assert len(list((store_dir / "recipes" / "models").iterdir())) == 1
    assert base_model_folder(ctx).is_dir()  # the local copy stays for the recipe's tokenizer

    data = tmp_path / "sft.jsonl"
    data.write_text('{"id": "a"}\n')
    first = _put_file(ctx, data, "datasets")
    assert first.startswith(store_dir.as_uri() + "/recipes/datasets/") and first.endswith(".jsonl")
    assert Path(first.removeprefix("file://")).read_text() == '{"id": "a"}\n'
    data.write_text('{"id": "b"}\n')
    assert _put_file(ctx, data, "datasets") != first  # new content, new URL; the old one stays
    assert Path(first.removeprefix("file://")).read_text() == '{"id": "a"}\n'


def test_a_model_named_by_url_is_passed_on_as_it_is(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "", model="s3://models/qwen")
    assert base_model_url(ctx) == "s3://models/qwen"
    with pytest.raises(ValueError, match="names no artifact store"):
        base_model_url(_context(tmp_path, ""))
