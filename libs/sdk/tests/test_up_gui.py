"""``orchard up`` and the GUI domain, before anything starts: which browser folder it gives
orchard-rollout (``--gui-browser``, ``$ORCHARD_GUI_BROWSER_DIR``, the checkout's
``.cache/gui-browser``), and what it says when there is none or no Chromium. The stack it then
starts with one is tested in test_real_service.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.sdk.cli import build_parser, main
from orchard.sdk.cli import up as up_module
from orchard.sdk.cli.sandbox import UsageError
from orchard.sdk.cli.up import BROWSER_LAUNCHER, UpError, _browser_folder

ROOT = Path(__file__).resolve().parents[3]


def folder(tmp_path: Path, name: str = "gui-browser") -> Path:
    """A folder with the launcher, as `make gui-browser` leaves it (enough to be found)."""
    launcher = tmp_path / name / BROWSER_LAUNCHER
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/usr/bin/env python3\n")
    return tmp_path / name


def found(*argv: str, environ: dict[str, str] | None = None) -> Path | None:
    args = build_parser().parse_args(["up", *argv])
    return _browser_folder(args, environ or {})


@pytest.fixture
def chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Chromium where orchard up looks, whatever this host has."""
    binary = tmp_path / "chromium"
    binary.touch()
    monkeypatch.setattr(up_module, "CHROMIUM", binary)
    return binary


@pytest.fixture
def no_checkout_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkout's .cache/gui-browser, not built."""
    missing = tmp_path / "checkout" / ".cache" / "gui-browser"
    monkeypatch.setattr(up_module, "_checkout_browser_folder", lambda: missing)
    return missing


def test_the_launcher_is_the_one_the_browser_folder_has() -> None:
    from orchard.tasks.gui.browser_dir import LAUNCHER

    assert BROWSER_LAUNCHER == LAUNCHER
    # This orchard-sdk runs from a checkout: its folder is where `make gui-browser` builds it.
    assert up_module._checkout_browser_folder() == ROOT / ".cache" / "gui-browser"


def test_the_flag_then_the_variable_then_the_checkout(
    tmp_path: Path, chromium: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, variable, checkout = folder(tmp_path, "a"), folder(tmp_path, "b"), folder(tmp_path, "c")
    monkeypatch.setattr(up_module, "_checkout_browser_folder", lambda: checkout)
    environ = {"ORCHARD_GUI_BROWSER_DIR": str(variable)}
    assert found("--gui-browser", str(flag), environ=environ) == flag
    assert found(environ=environ) == variable
    assert found() == checkout
    assert found("--gui") == checkout
    assert found("--no-gui", environ=environ) is None
    # A relative folder is taken from here, and given to orchard-rollout absolute.
    monkeypatch.chdir(tmp_path)
    assert found("--gui-browser", "a") == flag


def test_without_a_folder_the_gui_is_off_unless_asked_for(
    chromium: Path, no_checkout_folder: Path
) -> None:
    assert found() is None
    with pytest.raises(UpError, match="make gui-browser") as caught:
        found("--gui")
    assert str(no_checkout_folder) in str(caught.value)


def test_a_named_folder_that_is_none_is_an_error(tmp_path: Path, chromium: Path) -> None:
    with pytest.raises(UpError, match=r"--gui-browser: .* is not a browser folder .*gui-browser"):
        found("--gui-browser", str(tmp_path))
    with pytest.raises(UpError, match=r"\$ORCHARD_GUI_BROWSER_DIR: .* not a browser folder"):
        found(environ={"ORCHARD_GUI_BROWSER_DIR": str(tmp_path / "nothing")})


def test_no_chromium_turns_the_gui_off_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built = folder(tmp_path)
    monkeypatch.setattr(up_module, "_checkout_browser_folder", lambda: built)
    monkeypatch.setattr(up_module, "CHROMIUM", tmp_path / "no-chromium")
    assert found() is None
    assert "browser harnesses off: no Chromium" in capsys.readouterr().err
    with pytest.raises(UpError, match="apt-get install"):
        found("--gui")
    with pytest.raises(UpError, match="need Chromium"):
        found("--gui-browser", str(built))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--no-gui", "--gui-browser", "/x"), "contradict"),
        (("--gui", "--without", "rollout"), "drop --without rollout"),
    ],
)
def test_flags_that_contradict_are_usage_errors(argv: tuple[str, ...], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        found(*argv)


def test_orchard_up_stops_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    status = main(["up", "--state-dir", str(state), "--gui-browser", str(tmp_path / "none")])
    assert status == 1
    assert "is not a browser folder" in capsys.readouterr().err
    assert not state.exists()
