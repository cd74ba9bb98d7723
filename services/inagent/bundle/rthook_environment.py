"""Runs before the agent's code in the frozen bundle (a PyInstaller runtime hook).

The launcher and the bootloader set `_PYI_*` variables, and a bootloader that re-executes
itself points LD_LIBRARY_PATH at the bundle's own C library. Commands the agent runs belong to
the image, with the image's own loader and libraries: they must inherit none of this, so it is
undone here, before anything is spawned, and the caller's own LD_LIBRARY_PATH comes back.
"""

import os
import sys


def _restore_environment() -> None:
    original = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    current = os.environ.get("LD_LIBRARY_PATH")
    bundle_lib = getattr(sys, "_MEIPASS", None)
    if original is not None:
        os.environ["LD_LIBRARY_PATH"] = original
    elif current is not None and current.split(os.pathsep)[0] == bundle_lib:
        del os.environ["LD_LIBRARY_PATH"]
    for name in [name for name in os.environ if name.startswith("_PYI_")]:
        del os.environ[name]


def _present_as_launcher() -> None:
    # The process was started as lib/orchard-inagent-py through the bundle's loader; show the
    # name people start it by in usage messages and, where the bootloader re-executed itself
    # and so lost the name the launcher gave it, in `ps`.
    launcher = os.path.join(os.path.dirname(os.path.dirname(sys.argv[0])), "orchard-inagent")
    sys.argv[0] = launcher
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write("orchard-inagent")
    except OSError:
        pass


_restore_environment()
_present_as_launcher()
