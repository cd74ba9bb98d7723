"""tools/release.py on a copy of the tree's release metadata in a temporary git repository, and
one draft release of a real service."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"


def _load_release() -> Any:
    spec = importlib.util.spec_from_file_location("orchard_release", ROOT / "tools" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


release = _load_release()


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """The files a release compares (pyprojects, CHANGELOGs, charts' metadata and values,
    protos), copied from this checkout into a fresh git repository with one commit."""
    root = tmp_path / "repo"
    patterns = [
        "services/*/pyproject.toml",
        "services/*/CHANGELOG.md",
        "services/inagent/src/orchard/inagent/version.py",
        "charts/*/Chart.yaml",
        "charts/*/values*.yaml",
        "charts/*/ci/*-values.yaml",
        "protos/buf.yaml",
        "protos/orchard/**/*.proto",
    ]
    for pattern in patterns:
        for source in ROOT.glob(pattern):
            target = root / source.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    git(root.parent, "init", "-q", "-b", "main", str(root))
    git(root, "config", "user.email", "release@test.invalid")
    git(root, "config", "user.name", "release test")
    commit(root, "the tree as it is")
    yield root


def commit(root: Path, message: str) -> None:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)


def edit(root: Path, path: str, old: str, new: str) -> None:
    file = root / path
    text = file.read_text()
    assert old in text, f"{path} has no {old!r}"
    file.write_text(text.replace(old, new, 1))


def test_this_checkout_agrees_with_itself() -> None:
    assert release.version_problems(ROOT) == []
    assert set(release.services(ROOT)) >= {"env", "inagent", "reward", "rollout", "trainer"}


def test_a_copy_agrees_before_any_edit(tree: Path) -> None:
    assert release.version_problems(tree) == []


@pytest.mark.parametrize(
    ("path", "old", "new", "expected"),
    [
        (
            "charts/reward/Chart.yaml",
            'appVersion: "0.1.0"',
            'appVersion: "0.0.9"',
            "charts/reward/Chart.yaml: appVersion '0.0.9' is not the service version '0.1.0'",
        ),
        (
            "charts/rollout/Chart.yaml",
            "version: 0.1.0",
            "version: 0.1.1",
            "charts/rollout/Chart.yaml: version '0.1.1' is not the service version '0.1.0'",
        ),
        (
            "services/trainer/CHANGELOG.md",
            "## 0.1.0",
            "## 0.2.0",
            "services/trainer/CHANGELOG.md: the top entry is 0.2.0, the pyproject says 0.1.0",
        ),
        (
            "charts/orchard/Chart.yaml",
            "  - name: trainer\n    version: 0.1.0",
            "  - name: trainer\n    version: 0.0.1",
            "charts/orchard/Chart.yaml: the trainer dependency is '0.0.1'; want '0.1.0'",
        ),
        (
            "charts/env/values-production.yaml",
            'tag: "0.1.0"}',
            'tag: "0.0.7"}',
            "charts/env/values-production.yaml: pins the inagent image at '0.0.7'",
        ),
        (
            "services/inagent/src/orchard/inagent/version.py",
            '"0.1.0"',
            '"0.2.0"',
            "services/inagent/CHANGELOG.md: the top entry is 0.1.0, the pyproject says 0.2.0",
        ),
    ],
)
def test_each_disagreement_is_named(
    tree: Path, path: str, old: str, new: str, expected: str
) -> None:
    edit(tree, path, old, new)
    problems = release.version_problems(tree)
    assert any(expected in p for p in problems), problems


def test_a_version_bumped_in_the_pyproject_only_names_every_place_left_behind(
    tree: Path,
) -> None:
    edit(tree, "services/env/pyproject.toml", 'version = "0.1.0"', 'version = "0.2.0"')
    problems = release.version_problems(tree, only="env")
    joined = "\n".join(problems)
    for place in (
        "services/env/CHANGELOG.md",
        "charts/env/Chart.yaml: version",
        "charts/env/Chart.yaml: appVersion",
        "charts/orchard/Chart.yaml: the env dependency",
        "charts/env/values-production.yaml: pins the env image",
    ):
        assert place in joined, problems
    # Other services are not env's business with only=env.
    assert not any("reward" in p for p in problems)


def bump(root: Path, service: str, old: str, new: str, status: str) -> None:
    edit(root, f"services/{service}/pyproject.toml", f'version = "{old}"', f'version = "{new}"')
    edit(
        root, f"services/{service}/CHANGELOG.md", f"## {old} ", f"## {new} — {status}\n\n## {old} "
    )
    chart = f"charts/{service}/Chart.yaml"
    edit(root, chart, f"version: {old}", f"version: {new}")
    edit(root, chart, f'appVersion: "{old}"', f'appVersion: "{new}"')
    edit(
        root,
        "charts/orchard/Chart.yaml",
        f"  - name: {service}\n    version: {old}",
        f"  - name: {service}\n    version: {new}",
    )


def test_a_release_needs_a_dated_entry_a_new_version_and_a_clean_tree(tree: Path) -> None:
    problems = release.release_problems(tree, "reward", "0.1.0", draft=False)
    assert any("has no date: write '## 0.1.0 — YYYY-MM-DD'" in p for p in problems), problems
    assert release.release_problems(tree, "reward", "0.1.0", draft=True) == []

    edit(tree, "services/reward/CHANGELOG.md", "## 0.1.0 — unreleased", "## 0.1.0 — 2026-12-03")
    assert any(
        "uncommitted changes" in p
        for p in release.release_problems(tree, "reward", "0.1.0", draft=False)
    )
    commit(tree, "reward 0.1.0")
    assert release.release_problems(tree, "reward", "0.1.0", draft=False) == []

    git(tree, "tag", "reward/v0.1.0")
    problems = release.release_problems(tree, "reward", "0.1.0", draft=False)
    assert problems == [
        "reward/v0.1.0 is tagged already: bump the version in services/reward/pyproject.toml, "
        "its CHANGELOG and charts/reward"
    ]
    git(tree, "tag", "reward/v0.3.0")
    git(tree, "tag", "reward/vnot-a-version")
    assert release.last_tag(tree, "reward") == "reward/v0.3.0"
    bump(tree, "reward", "0.1.0", "0.2.0", "2026-12-04")
    commit(tree, "reward 0.2.0")
    assert release.version_problems(tree, only="reward") == []
    assert release.release_problems(tree, "reward", "0.2.0", draft=False) == [
        "reward 0.2.0 is below the last release 0.3.0: bump the version"
    ]


def test_buf_breaking_compares_against_the_last_tag(tree: Path) -> None:
    assert BUF.is_file(), f"{BUF} is missing: `make setup` installs buf"
    assert "no env/v* tag yet" in release.buf_breaking(tree, "env", None, BUF)
    git(tree, "tag", "env/v0.1.0")

    proto = "protos/orchard/env/v1/env.proto"
    edit(
        tree,
        proto,
        "string owner_id = 8;",
        "string owner_id = 8;\n  // A new field.\n  string note = 99;",
    )
    commit(tree, "a new field")
    assert release.buf_breaking(tree, "env", "env/v0.1.0", BUF) == (
        "buf breaking against env/v0.1.0: no breaking change"
    )
    edit(tree, proto, "string owner_id = 8;", "string owner = 8;")
    commit(tree, "a renamed field")
    with pytest.raises(release.ReleaseError) as caught:
        release.buf_breaking(tree, "env", "env/v0.1.0", BUF)
    problems = caught.value.problems
    assert any('changed name from "owner_id" to "owner"' in p for p in problems), problems
    assert "needs a new package (orchard.env.v2)" in problems[-1]
    # Another service's contract is untouched by env's change.
    git(tree, "tag", "reward/v0.1.0")
    assert "no breaking change" in release.buf_breaking(tree, "reward", "reward/v0.1.0", BUF)


def test_release_refuses_an_unknown_service_and_stops_at_disagreement(tree: Path) -> None:
    with pytest.raises(release.ReleaseError, match="no service 'nope': want one of env"):
        release.release("nope", root=tree)
    edit(tree, "charts/trainer/Chart.yaml", 'appVersion: "0.1.0"', 'appVersion: "0.0.1"')
    with pytest.raises(release.ReleaseError) as caught:
        release.release("trainer", root=tree, draft=True, out=tree / "out")
    assert any("appVersion '0.0.1'" in p for p in caught.value.problems)
    assert not (tree / "out").exists(), "nothing is built when versions disagree"


@pytest.mark.slow
def test_a_draft_release_builds_and_renders(tmp_path: Path) -> None:
    lines = release.release("reward", draft=True, out=tmp_path / "dist")
    built = sorted(p.name for p in (tmp_path / "dist").iterdir())
    assert built == ["orchard_reward-0.1.0-py3-none-any.whl", "orchard_reward-0.1.0.tar.gz"]
    text = "\n".join(lines)
    assert "reward 0.1.0: versions agree" in text
    assert "charts: 2 renderings" in text and ", 0 failed" in text
    assert lines[-1].startswith("draft: a release would tag reward/v0.1.0")
