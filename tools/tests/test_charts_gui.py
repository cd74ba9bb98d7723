"""The browser image and the GUI domain in the charts: tools/images.sh builds images/gui-browser
with orchard-rollout (tagged with its version), `make charts` lints its Dockerfile, and the check
of the rollout chart's gui section catches a rendering the browser image cannot serve."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROWSER_DOCKERFILE = "images/gui-browser/Dockerfile"


def _load_charts() -> Any:
    spec = importlib.util.spec_from_file_location("orchard_charts", ROOT / "tools" / "charts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


charts = _load_charts()
Docs = list[dict[str, Any]]


def images(*names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "images.sh"), "--list", *names],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_the_browser_image_ships_with_the_rollout_service() -> None:
    version = metadata.version("orchard-rollout")
    listed = images("rollout")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        f"services/rollout/Dockerfile ghcr.io/orchard-dev/orchard-rollout:{version}",
        f"{BROWSER_DOCKERFILE} ghcr.io/orchard-dev/orchard-gui-browser:{version}",
    ]
    every = images().stdout.splitlines()
    assert [line.split()[0] for line in every].count(BROWSER_DOCKERFILE) == 1
    assert {line.split()[0] for line in every} >= {
        str(path.relative_to(ROOT)) for path in ROOT.glob("services/*/Dockerfile")
    }
    assert images("reward").stdout.split()[0] == "services/reward/Dockerfile"
    unknown = images("browser")
    assert unknown.returncode == 1 and "images/browser/Dockerfile" in unknown.stderr


def test_make_charts_lints_the_browser_image_with_the_rollout() -> None:
    assert ROOT / BROWSER_DOCKERFILE in charts.dockerfiles_of("rollout")
    assert ROOT / BROWSER_DOCKERFILE in charts.dockerfiles_of(None)
    assert ROOT / BROWSER_DOCKERFILE not in charts.dockerfiles_of("reward")


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="orchard-charts-test-") as tmp:
        yield Path(tmp)


def render(workdir: Path, **gui: Any) -> Docs:
    import helm_python as helm

    values = charts.deep_merge(
        charts.load_values(charts.CHARTS / "rollout", ("ci/gui-values.yaml",)), {"gui": gui}
    )
    loaded = helm.Chart.load(charts.staged_chart("rollout", workdir))
    try:
        rendered = loaded.render(values, name="orchard", namespace="orchard", is_install=True)
    finally:
        loaded.close()
    return [doc for _, doc in charts.documents(rendered)]


def failures(docs: Docs) -> list[str]:
    report = charts.Report()
    charts.check_gui("orchard-env.orchard.svc:7100", chromium_sandbox=False)(docs, report, "gui")
    return list(report.failures)


def test_the_gui_rendering_passes(workdir: Path) -> None:
    assert failures(render(workdir)) == []


@pytest.mark.parametrize(
    ("gui", "expected"),
    [
        ({"browserUser": 65534}, "not the browser image's user (10001)"),
        ({"browserImage": {"tag": "0.0.9"}}, "not the browser image at"),
        ({"enabled": False}, "want both browser harnesses"),
    ],
)
def test_a_gui_rendering_the_image_cannot_serve_is_caught(
    workdir: Path, gui: dict[str, Any], expected: str
) -> None:
    found = failures(render(workdir, **gui))
    assert any(expected in failure for failure in found), found
