"""Release one service, or check that every service's version agrees with itself.

    python tools/release.py reward             # what `make release SERVICE=reward` runs
    python tools/release.py reward --draft     # the same, before the CHANGELOG entry is dated
    python tools/release.py --check-versions   # every service; `make versions`, part of `make test`

A release of ``<service>`` at version ``X.Y.Z``, in order, stopping at the first step that fails:

1. Versions agree. ``services/<service>/pyproject.toml`` holds the version (inagent: its
   ``version.py``, which the pyproject names); the top entry of ``services/<service>/CHANGELOG.md``
   is ``## X.Y.Z — <date>``; the chart ``charts/<service>`` has ``version`` and ``appVersion``
   both ``X.Y.Z`` (the chart is released with its service: a chart-only change is a patch
   release of the service); the umbrella chart depends on ``<service>`` at ``X.Y.Z``; every image
   tag the charts' values files pin for the service is ``X.Y.Z``. The tag ``<service>/vX.Y.Z`` does
   not exist yet and X.Y.Z is above the last released version; the work tree is clean.
2. ``buf breaking`` on ``protos/orchard/<service>`` against the last ``<service>/v*`` tag (none
   yet: said so, nothing to compare against).
3. The wheel and sdist with ``python -m build`` into ``dist/release/<service>-X.Y.Z/``.
4. The image with ``tools/images.sh <service>`` where docker or podman runs (it says so where
   none does).
5. The chart rendered and validated as ``make charts`` does (``tools/charts.py``), with its
   standalone and production values.
6. The tag to push.

``--check-versions`` runs the first step's agreement checks (not the release-only ones: an
``unreleased`` CHANGELOG entry is fine there) for every service. ``--draft`` accepts an undated
CHANGELOG entry and a dirty tree, and prints the tag it would make instead of the one to push.

Exit status 0 on success, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
UMBRELLA = "orchard"
INAGENT = "inagent"
_CHANGELOG_ENTRY = re.compile(
    r"^##\s+(?P<version>\S+)(?:\s+[\u2014\u2013-]+\s+(?P<status>.+?))?\s*$"
)
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_VERSION_ASSIGNMENT = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)


class ReleaseError(Exception):
    """A release step failed; each problem is one line a person can act on."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ChangelogEntry:
    version: str
    status: str
    """What follows the version in the heading: a date, or ``unreleased``."""


def services(root: Path) -> list[str]:
    """Every service folder with a pyproject."""
    return sorted(p.parent.name for p in (root / "services").glob("*/pyproject.toml"))


def service_version(root: Path, service: str) -> str:
    """The version the service's pyproject declares, or the file a dynamic version is read from
    (hatch's ``[tool.hatch.version] path``)."""
    path = root / "services" / service / "pyproject.toml"
    project = tomllib.loads(path.read_text())
    version = project.get("project", {}).get("version")
    if isinstance(version, str):
        return version
    source = project.get("tool", {}).get("hatch", {}).get("version", {}).get("path")
    if source:
        found = _VERSION_ASSIGNMENT.search((path.parent / source).read_text())
        if found:
            return found.group(1)
        raise ReleaseError([f"services/{service}/{source}: no __version__ = '...' line"])
    raise ReleaseError([f"services/{service}/pyproject.toml: no project.version"])


def changelog_top(root: Path, service: str) -> ChangelogEntry | None:
    """The first ``## <version> — <status>`` heading of the service's CHANGELOG."""
    path = root / "services" / service / "CHANGELOG.md"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        found = _CHANGELOG_ENTRY.match(line)
        if found:
            return ChangelogEntry(found["version"], (found["status"] or "").strip())
    return None


def _chart(root: Path, name: str) -> dict[str, Any] | None:
    path = root / "charts" / name / "Chart.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _values_files(chart_dir: Path) -> Iterator[Path]:
    yield from sorted(chart_dir.glob("values*.yaml"))
    yield from sorted(chart_dir.glob("ci/*-values.yaml"))


def _dig(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _pinned_tags(root: Path, chart: str, known: list[str]) -> Iterator[tuple[str, str, str]]:
    """(values file, service, tag) for every image tag a chart's values files pin.

    Service charts: ``image.tag`` is the chart's own service, ``sandbox.inagentImage.tag`` the
    inagent's; the umbrella chart has the same under each service's key."""
    own: dict[tuple[str, ...], str] = (
        {(s, "image", "tag"): s for s in known} if chart == UMBRELLA else {("image", "tag"): chart}
    )
    inagent_path = ("sandbox", "inagentImage", "tag")
    own[(("env", *inagent_path) if chart == UMBRELLA else inagent_path)] = INAGENT
    for path in _values_files(root / "charts" / chart):
        values = yaml.safe_load(path.read_text()) or {}
        for keys, service in own.items():
            tag = _dig(values, keys)
            if tag not in (None, ""):
                yield str(path.relative_to(root)), service, str(tag)


def version_problems(root: Path = ROOT, only: str | None = None) -> list[str]:
    """Every disagreement between a service's pyproject, CHANGELOG, chart, the umbrella chart's
    dependency and the image tags the charts pin; for one service with ``only``."""
    problems: list[str] = []
    known = services(root)
    versions: dict[str, str] = {}
    for service in known:
        try:
            versions[service] = service_version(root, service)
        except ReleaseError as exc:
            problems += exc.problems
    umbrella = _chart(root, UMBRELLA)
    dependencies = {d["name"]: str(d["version"]) for d in (umbrella or {}).get("dependencies", [])}
    for service, version in versions.items():
        if only not in (None, service):
            continue
        where = f"services/{service}"
        try:
            Version(version)
        except InvalidVersion:
            problems.append(f"{where}: version {version!r} is not a PEP 440 version")
        entry = changelog_top(root, service)
        if entry is None:
            problems.append(f"{where}/CHANGELOG.md: no '## {version} — <date>' entry")
        elif entry.version != version:
            problems.append(
                f"{where}/CHANGELOG.md: the top entry is {entry.version}, the pyproject says "
                f"{version}: add a '## {version}' entry above it, or fix the pyproject"
            )
        chart = _chart(root, service)
        if chart is not None:
            for key in ("version", "appVersion"):
                if str(chart.get(key)) != version:
                    problems.append(
                        f"charts/{service}/Chart.yaml: {key} {chart.get(key)!r} is not the "
                        f"service version {version!r} (the chart is released with its service)"
                    )
            if umbrella is not None and dependencies.get(service) != version:
                problems.append(
                    f"charts/{UMBRELLA}/Chart.yaml: the {service} dependency is "
                    f"{dependencies.get(service)!r}; want {version!r}"
                )
    charts_dir = root / "charts"
    charts = (
        sorted(p.parent.name for p in charts_dir.glob("*/Chart.yaml"))
        if charts_dir.is_dir()
        else []
    )
    for chart_name in charts:
        for values_file, service, tag in _pinned_tags(root, chart_name, known):
            if only in (None, service) and service in versions and tag != versions[service]:
                problems.append(
                    f"{values_file}: pins the {service} image at {tag!r}; the service is "
                    f"{versions[service]!r} (set it, or leave it empty for the chart's appVersion)"
                )
    return problems


def _git(root: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ReleaseError([f"git {' '.join(args)}: {result.stderr.strip()}"])
    return result.stdout


def released_versions(root: Path, service: str) -> dict[Version, str]:
    """The ``<service>/vX.Y.Z`` tags, by version; tags that are no version are ignored."""
    tags: dict[Version, str] = {}
    for tag in _git(root, "tag", "--list", f"{service}/v*").split():
        try:
            tags[Version(tag.removeprefix(f"{service}/v"))] = tag
        except InvalidVersion:
            continue
    return tags


def last_tag(root: Path, service: str) -> str | None:
    tags = released_versions(root, service)
    return tags[max(tags)] if tags else None


def release_problems(root: Path, service: str, version: str, *, draft: bool) -> list[str]:
    """What only a release needs: a dated CHANGELOG entry, a new version, a clean tree."""
    problems = []
    entry = changelog_top(root, service)
    if not draft and entry is not None and not _DATE.match(entry.status):
        problems.append(
            f"services/{service}/CHANGELOG.md: the top entry '{entry.version} — {entry.status}' "
            f"has no date: write '## {version} — YYYY-MM-DD' to release (or pass --draft)"
        )
    tags = released_versions(root, service)
    if f"{service}/v{version}" in tags.values():
        problems.append(
            f"{service}/v{version} is tagged already: bump the version in "
            f"services/{service}/pyproject.toml, its CHANGELOG and charts/{service}"
        )
    elif tags and max(tags) > Version(version):
        problems.append(
            f"{service} {version} is below the last release {max(tags)}: bump the version"
        )
    if not draft and _git(root, "status", "--porcelain"):
        problems.append("the work tree has uncommitted changes: commit them (or pass --draft)")
    return problems


def buf_breaking(root: Path, service: str, tag: str | None, buf: Path) -> str:
    """``buf breaking`` of the service's protos against ``tag``; what it found, as a line."""
    protos = root / "protos"
    if not (protos / "orchard" / service).is_dir():
        return f"no protos/orchard/{service}: no API to compare"
    if tag is None:
        return f"no {service}/v* tag yet: first release, no earlier API to compare against"
    if not buf.is_file():
        raise ReleaseError([f"{buf} is missing: run `make setup`"])
    git_dir = Path(_git(root, "rev-parse", "--absolute-git-dir").strip())
    result = subprocess.run(
        [
            str(buf.resolve()),
            "breaking",
            "--against",
            f"{git_dir}#tag={tag},subdir=protos",
            "--path",
            f"orchard/{service}",
        ],
        cwd=protos,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        found = (result.stdout + result.stderr).strip().splitlines()
        raise ReleaseError(
            [f"buf breaking against {tag}: {line}" for line in found]
            + [
                f"a wire-incompatible change needs a new package (orchard.{service}.v2), "
                "never an edit of a released v1"
            ]
        )
    return f"buf breaking against {tag}: no breaking change"


def build_distributions(root: Path, service: str, out: Path) -> list[Path]:
    if out.exists():
        shutil.rmtree(out)
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(root / "services" / service)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
        raise ReleaseError([f"python -m build services/{service} failed:", *tail])
    return sorted(out.iterdir())


def build_image(root: Path, service: str) -> str:
    if not (root / "services" / service / "Dockerfile").is_file():
        return f"services/{service} has no Dockerfile: no image"
    result = subprocess.run(
        ["bash", str(root / "tools" / "images.sh"), service],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    if result.returncode != 0:
        raise ReleaseError([f"tools/images.sh {service} failed:", *lines[-15:]])
    return "\n".join(lines)


def render_chart(root: Path, service: str) -> str:
    """The service's chart rendered and validated by ``tools/charts.py --chart <service>``."""
    if not (root / "charts" / service / "Chart.yaml").is_file():
        return f"no chart of its own (charts/{service})"
    result = subprocess.run(
        [sys.executable, str(root / "tools" / "charts.py"), "--chart", service],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    if result.returncode != 0:
        raise ReleaseError([f"tools/charts.py --chart {service}: {line}" for line in lines])
    return lines[-1] if lines else f"charts/{service} rendered"


def release(
    service: str, *, root: Path = ROOT, draft: bool = False, out: Path | None = None
) -> list[str]:
    """Every step of a release; the lines it reports. Raises ReleaseError at the first failure."""
    known = services(root)
    if service not in known:
        raise ReleaseError([f"no service {service!r}: want one of {', '.join(known)}"])
    version = service_version(root, service)
    problems = version_problems(root, only=service)
    problems += release_problems(root, service, version, draft=draft)
    if problems:
        raise ReleaseError(problems)
    places = "pyproject, CHANGELOG, chart, umbrella dependency, pinned image tags"
    if _chart(root, service) is None:
        places = "pyproject, CHANGELOG, pinned image tags (no chart of its own)"
    lines = [f"{service} {version}: versions agree ({places})"]
    lines.append(
        buf_breaking(
            root,
            service,
            last_tag(root, service),
            root / ".tools" / "node_modules" / ".bin" / "buf",
        )
    )
    target = out or root / "dist" / "release" / f"{service}-{version}"
    built = build_distributions(root, service, target)
    lines.append(f"built {', '.join(p.name for p in built)} in {target}")
    lines.append(build_image(root, service))
    lines.append(render_chart(root, service))
    tag = f"{service}/v{version}"
    if draft:
        lines.append(f"draft: a release would tag {tag} (date the CHANGELOG entry, commit, rerun)")
    else:
        lines.append(
            f"tag to push: git tag -a {tag} -m 'orchard-{service} {version}' "
            f"&& git push origin {tag}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service", nargs="?", help="the service to release (services/<name>)")
    parser.add_argument(
        "--check-versions", action="store_true", help="only check every service's versions"
    )
    parser.add_argument(
        "--draft", action="store_true", help="allow an undated CHANGELOG entry and a dirty tree"
    )
    parser.add_argument("--out", type=Path, help="where the wheel and sdist go")
    args = parser.parse_args(argv)
    if args.check_versions:
        problems = version_problems()
        for problem in problems:
            print(f"FAIL {problem}")
        names = services(ROOT)
        print(f"versions: {len(names)} services ({', '.join(names)}), {len(problems)} problems")
        return 1 if problems else 0
    if not args.service:
        parser.error("name a service (make release SERVICE=<name>) or pass --check-versions")
    try:
        for line in release(args.service, draft=args.draft, out=args.out):
            print(f"release: {line}")
    except ReleaseError as exc:
        for problem in exc.problems:
            print(f"release {args.service}: FAIL {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
