"""A recipe's tasks: the built-in suite materialized as git repositories, the Claw suite (or
both together), the GUI suite, or SWE-bench JSONL.

`prepare_tasks` writes ``tasks/tasks.jsonl`` (one SWE-bench line per task with its split, and
its family and difficulty for the built-in suite) and, for the built-in suite, the repositories
under ``tasks/repos``, each also packed as a tar archive into the artifact store (named by its
content, so a second run reuses it); a second call reads the manifest back, so a resumed run
works on the same tasks. `task_spec` turns a task into what the rollout runner drives: the
problem statement as the instruction, the repository at ``/testbed`` in the sandbox (the
archive's URL, which orchard-rollout unpacks there: no path of this machine reaches a service),
and ScoreTests through the reward service as the check. A Claw task is its id (the suite
regenerates it from the id, as orchard-reward does to score it) and the URLs of its tools'
archive in the store; its spec seeds the apps' state in the sandbox and is scored by ScoreTask.
A GUI task is its id too: orchard-rollout serves its site in a sandbox of its own and drives a
browser sandbox through it; orchard-reward's built-in state judge scores it (JudgeOutcome).
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import shutil
import sys
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchard.recipes.swe_suite import Split, SuiteTask, generate_suite, split_suite
from orchard.recipes.workspace import RunDir
from orchard.sdk.recipe import Recipe
from orchard.tasks.claw import specs as claw_specs
from orchard.tasks.claw import suite as claw_suite
from orchard.tasks.gui import suite as gui_suite
from orchard.tasks.spec import GuiCheck, TaskFile, TaskSpec, TestsCheck
from orchard.tasks.swe_instances import (
    DEFAULT_REPO_PATH,
    SweInstance,
    load_instances,
    parse_instance,
)
from orchard.tasks.swe_tasks import materialize

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore

__all__ = ["SPLITS", "RecipeTask", "prepare_tasks", "task_spec"]

SPLITS: tuple[Split, ...] = ("sft", "rl", "evaluate")
WORKDIR = DEFAULT_REPO_PATH
"""Where the repository is in every rollout sandbox (as SWE-bench images hold it)."""


@dataclass(frozen=True)
class RecipeTask:
    split: str
    instance: SweInstance | None
    """The SWE-bench instance; None for a Claw or GUI task."""
    family: str = ""
    """The built-in suites' family; empty for JSONL tasks."""
    difficulty: int = 0
    """1-3 for the built-in suites; 0 unknown."""
    archive_url: str = ""
    """The repository as a tar archive in the artifact store (built-in suite), unpacked at
    ``/testbed`` in each sandbox; empty: the image holds the repository."""
    claw_id: str = ""
    """A Claw task's id (``claw/<seed>/<family>/<n>``); empty for software tasks."""
    files: tuple[TaskFile, ...] = ()
    """A Claw task's tools, as archives in the artifact store."""
    gui_id: str = ""
    """A GUI task's id (``gui/<seed>/<family>/<n>``); empty for other tasks."""

    @property
    def id(self) -> str:
        if self.instance is None:
            return self.gui_id or self.claw_id
        return self.instance.instance_id

    @property
    def instruction(self) -> str:
        if self.gui_id:
            return gui_suite.task_by_id(self.gui_id).intent
        if self.instance is None:
            return claw_suite.task_by_id(self.claw_id).instruction
        return self.instance.problem_statement or f"Resolve {self.id}."

    @property
    def domain(self) -> str:
        """ "gui", "claw" or "swe" (software engineering: the built-in suite and JSONL)."""
        if self.gui_id:
            return "gui"
        return "claw" if self.instance is None else "swe"

    @property
    def source(self) -> str:
        """What trajectories are capped per (curation's ``cap_per_source``): a software task's
        repository, a Claw or GUI task's family."""
        return self.family if self.instance is None else self.instance.repo

    def to_json(self) -> dict[str, object]:
        common: dict[str, object] = {
            "orchard_split": self.split,
            "orchard_family": self.family,
            "orchard_difficulty": self.difficulty,
        }
        if self.gui_id:
            return {"orchard_gui_id": self.gui_id, **common}
        if self.instance is None:
            files = [{"url": f.url, "path": f.path} for f in self.files]
            return {"orchard_claw_id": self.claw_id, "orchard_files": files, **common}
        return {**self.instance.to_json(), **common, "orchard_archive_url": self.archive_url}


def _builtin(recipe: Recipe, repos: Path) -> list[RecipeTask]:
    assert recipe.tasks.builtin is not None
    spec = recipe.tasks.builtin
    suite = generate_suite(spec.count, seed=spec.seed)
    splits = split_suite(suite, _fractions(recipe), seed=spec.seed)
    out: list[RecipeTask] = []
    for name in SPLITS:
        for task in splits[name]:
            out.append(_materialized(name, task, repos))
    return out


def _materialized(split: str, task: SuiteTask, repos: Path) -> RecipeTask:
    # The sandboxes run the `host` image: the test command runs this interpreter (it has
    # pytest), which the environment service's machine has at the same path.
    instance = materialize(task.blueprint, repos, python=sys.executable, image="host")
    return RecipeTask(split, instance, task.family, task.difficulty)


def pack_repository(folder: Path) -> bytes:
    """``folder`` as an uncompressed tar archive whose bytes depend on its content only (sorted
    names, no owners or times), so the same repository always gets the same URL."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(folder.rglob("*")):
            info = archive.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isreg():
                with path.open("rb") as handle:
                    archive.addfile(info, handle)
            else:
                archive.addfile(info)
    return buffer.getvalue()


def _published(task: RecipeTask, store: ArtifactStore) -> RecipeTask:
    """``task`` with its repository packed into ``store`` (once per content)."""
    assert task.instance is not None  # a software task of the built-in suite
    data = pack_repository(Path(task.instance.repo_path))
    digest = hashlib.sha256(data).hexdigest()[:24]
    url = store.url("tasks", f"{task.id}-{digest}.tar")
    if not store.exists(url):
        store.write_bytes(url, data)
    return replace(task, archive_url=url)


def _fractions(recipe: Recipe) -> dict[Split, float]:
    """``tasks.split`` as the generated suites' ``split_suite`` takes it."""
    split = recipe.tasks.split
    return {"sft": split.sft, "rl": split.rl, "evaluate": split.evaluate}


def _claw(recipe: Recipe, store: ArtifactStore) -> list[RecipeTask]:
    assert recipe.tasks.claw is not None
    spec = recipe.tasks.claw
    suite = claw_suite.generate_suite(spec.count, seed=spec.seed)
    splits = claw_suite.split_suite(suite, _fractions(recipe), seed=spec.seed)
    files = claw_specs.publish_archives(store)
    return [
        RecipeTask(name, None, t.family, t.difficulty, claw_id=t.id, files=files)
        for name in SPLITS
        for t in splits[name]
    ]


def _gui(recipe: Recipe) -> list[RecipeTask]:
    assert recipe.tasks.gui is not None
    spec = recipe.tasks.gui
    suite = gui_suite.generate_suite(spec.count, seed=spec.seed)
    splits = gui_suite.split_suite(suite, _fractions(recipe), seed=spec.seed)
    return [
        RecipeTask(name, None, t.family, t.difficulty, gui_id=t.id)
        for name in SPLITS
        for t in splits[name]
    ]


def _from_manifest(data: dict[str, object], source: str, line: int) -> RecipeTask:
    split = str(data.pop("orchard_split"))
    family = str(data.pop("orchard_family", ""))
    difficulty = int(str(data.pop("orchard_difficulty", 0)))
    gui_id = data.pop("orchard_gui_id", None)
    if gui_id is not None:
        return RecipeTask(split, None, family, difficulty, gui_id=str(gui_id))
    claw_id = data.pop("orchard_claw_id", None)
    if claw_id is not None:
        entries = data.pop("orchard_files", [])
        assert isinstance(entries, list)
        files = tuple(TaskFile(str(f["url"]), str(f["path"])) for f in entries)
        return RecipeTask(split, None, family, difficulty, claw_id=str(claw_id), files=files)
    return RecipeTask(
        split=split,
        family=family,
        difficulty=difficulty,
        archive_url=str(data.pop("orchard_archive_url", "")),
        instance=parse_instance(data, source=source, line=line),
    )


def _jsonl(recipe: Recipe) -> list[RecipeTask]:
    assert recipe.tasks.jsonl is not None
    out: list[RecipeTask] = []
    for name in SPLITS:
        path = getattr(recipe.tasks.jsonl, name)
        if path is None:
            continue
        out += [RecipeTask(name, instance) for instance in load_instances(path)]
    return out


def prepare_tasks(
    recipe: Recipe, run: RunDir, store: ArtifactStore | None = None
) -> dict[str, list[RecipeTask]]:
    """The recipe's tasks by split (made once, then read from the run folder); the built-in
    suite's repositories go into ``store``, which it then needs."""
    folder = run.root / "tasks"
    manifest = folder / "tasks.jsonl"
    tasks: list[RecipeTask] = []
    if manifest.exists():
        with manifest.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                tasks.append(_from_manifest(json.loads(line), str(manifest), number))
    else:
        # The manifest is written last: without it, repositories found here are what an
        # interrupted preparation left, made again from the same seed.
        shutil.rmtree(folder / "repos", ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        if recipe.tasks.generated is not None and recipe.tasks.gui is None and store is None:
            raise ValueError(
                "the built-in suite's repositories and the Claw suite's tools travel through "
                "the artifact store: give prepare_tasks the stack's store"
            )
        if recipe.tasks.builtin:
            assert store is not None
            tasks += [_published(t, store) for t in _builtin(recipe, folder / "repos")]
        if recipe.tasks.claw:
            assert store is not None
            tasks += _claw(recipe, store)
        if recipe.tasks.gui:
            tasks += _gui(recipe)
        if recipe.tasks.jsonl:
            tasks += _jsonl(recipe)
        staging = manifest.with_suffix(".partial")
        with staging.open("w", encoding="utf-8") as handle:
            for task in tasks:
                handle.write(json.dumps(task.to_json(), sort_keys=True) + "\n")
        staging.rename(manifest)
    by_split: dict[str, list[RecipeTask]] = {name: [] for name in SPLITS}
    for task in tasks:
        by_split[task.split].append(task)
    return by_split


def task_spec(task: RecipeTask, *, memory: str = "") -> TaskSpec:
    """What the rollout runner drives for ``task``: its repository at ``/testbed`` (unpacked
    there from the artifact store for the built-in suite), scored by ScoreTests, with the
    harness's shell in the repository; or a Claw task's apps, seeded, scored by ScoreTask; or a
    GUI task's browser episode, scored by the reward service's built-in state judge."""
    instance = task.instance
    if task.gui_id:
        return TaskSpec(
            id=task.gui_id,
            instruction=task.instruction,
            check=GuiCheck(task.gui_id),
            image="host",
            memory=memory,
        )
    if instance is None:
        return claw_specs.task_spec(claw_suite.task_by_id(task.claw_id), task.files, memory=memory)
    setup: list[str] = []
    files: tuple[TaskFile, ...] = ()
    if task.archive_url:
        files = (TaskFile(task.archive_url, WORKDIR),)
    elif instance.repo_path != WORKDIR:
        raise ValueError(
            f"task {task.id}: its repository is at {instance.repo_path}, a path of this "
            f"machine; give it an image that holds it at {WORKDIR}"
        )
    if (instance.image or "host") == "host":
        # The host image has no `python` of its own on the sandbox's PATH: give it this
        # interpreter (it has pytest), inside the sandbox's copy-on-write layer only.
        setup.append(f"ln -sf {shlex.quote(sys.executable)} /usr/local/bin/python")
    return TaskSpec(
        id=instance.instance_id,
        instruction=instance.problem_statement or f"Resolve {instance.instance_id}.",
        check=TestsCheck(task=instance.to_task(), repo_path=WORKDIR),
        image=instance.image or "host",
        setup=tuple(setup),
        files=files,
        memory=memory,
        workdir=WORKDIR,
    )
