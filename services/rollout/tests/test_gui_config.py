"""Where browser sandboxes find the browser folder (`GuiConfig`): the folder `make gui-browser`
built on this host under the local runtime's ``host`` image, or /opt/orchard-browser in any
other image (the browser image of images/gui-browser, as the rollout chart names it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from orchard.rollout.config import GuiConfig, RolloutConfig
from orchard.rollout.harnesses.browser import browser_harnesses
from orchard.tasks.gui.browser_dir import IMAGE_BROWSER_DIR

IMAGE = "ghcr.io/orchard-dev/orchard-gui-browser:0.1.0"


def test_the_host_image_offers_browsers_only_with_a_folder_of_this_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ORCHARD_GUI_BROWSER_DIR", raising=False)
    assert GuiConfig().resolved_browser_dir() == ""
    assert browser_harnesses(GuiConfig()) == {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ORCHARD_GUI_BROWSER_DIR", "gui-browser")
    # A relative folder is this host's, seen at its absolute path in the host image.
    assert GuiConfig().resolved_browser_dir() == f"{tmp_path}/gui-browser"
    assert GuiConfig(browser_dir="/srv/gui").resolved_browser_dir() == "/srv/gui"


def test_a_browser_image_needs_no_folder_of_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # The variable names a folder of this host: it means nothing inside another image.
    monkeypatch.setenv("ORCHARD_GUI_BROWSER_DIR", "/srv/host-only/gui-browser")
    config = RolloutConfig(
        gui={"image": IMAGE, "browser_user": 10001, "chromium_sandbox": False, "keep_last": 2}
    ).gui
    assert config.resolved_browser_dir() == IMAGE_BROWSER_DIR
    harnesses = browser_harnesses(config)
    assert sorted(harnesses) == ["builtin:browser", "builtin:browser-text"]
    settings = harnesses["builtin:browser"].settings
    assert (settings.browser_dir, settings.image, settings.site_image) == (
        IMAGE_BROWSER_DIR,
        IMAGE,
        "",
    )
    assert (settings.browser_user, settings.chromium_sandbox) == (10001, False)
    assert harnesses["builtin:browser-text"].keep_last == 2


@pytest.mark.parametrize(
    ("gui", "words"),
    [
        ({"browser_dir": ".cache/gui-browser"}, "not an absolute path"),
        ({"image": IMAGE, "site_image": "host"}, "set browser_dir"),
        ({"site_image": IMAGE}, "different paths"),
    ],
)
def test_folder_settings_that_cannot_work_are_config_errors(
    gui: dict[str, str], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        RolloutConfig(gui=gui)


def test_one_folder_path_for_two_images_is_accepted() -> None:
    config = GuiConfig(image=IMAGE, site_image="registry.example/sites:1", browser_dir="/opt/b")
    assert config.resolved_browser_dir() == "/opt/b"
