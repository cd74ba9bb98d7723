"""Build the self-contained orchard-inagent bundle.

    python services/inagent/bundle/build.py [--entry SCRIPT] [--clean]

Output: services/inagent/dist/orchard-inagent/, replaced whole at the end of a good build:

    orchard-inagent                 static launcher, the thing to execute
    lib/ld-linux-x86-64.so.2        the bundle's own dynamic loader
    lib/libc.so.6, lib/libm.so.6…   every shared library anything in lib/ needs
    lib/orchard-inagent-py          PyInstaller bootloader, started by the launcher via the loader
    lib/…                           libpython, extension modules, the frozen Python code

The bundle needs nothing from the image it runs in (no Python, no C library, no shell) and
writes nothing at run time, so it runs from a read-only mount and from any directory.
Needs gcc with the static C library (Debian: gcc, libc6-dev), binutils (strip) and PyInstaller
in the running interpreter's environment.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUNDLE_SRC = Path(__file__).resolve().parent
SERVICE_DIR = BUNDLE_SRC.parent
BUILD_DIR = SERVICE_DIR / "build"
DIST_DIR = SERVICE_DIR / "dist"
OUTPUT = DIST_DIR / "orchard-inagent"
SPEC = BUNDLE_SRC / "orchard-inagent.spec"
LAUNCHER_SRC = BUNDLE_SRC / "launcher.c"
LAUNCHER_NAME = "orchard-inagent"
FROZEN_NAME = "orchard-inagent-py"
LOADER_NAME = "ld-linux-x86-64.so.2"

# `ldd` lines: "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" or "/lib64/ld-linux… (0x…)".
_LDD_RESOLVED = re.compile(r"^\s*(\S+)\s+=>\s+(/\S+)\s+\(0x[0-9a-f]+\)$")
_LDD_LOADER = re.compile(r"^\s*(/\S*ld-linux\S*)\s+\(0x[0-9a-f]+\)$")
_LDD_MISSING = re.compile(r"^\s*(\S+)\s+=>\s+not found$")


class BuildError(Exception):
    """A build step failed; the message says what to do."""


def log(message: str) -> None:
    print(f"[inagent-bundle] {message}", flush=True)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, text=True, capture_output=True, check=False)
    if result.returncode != 0:
        raise BuildError(
            f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result


def check_tools() -> None:
    missing = [tool for tool in ("gcc", "strip", "ldd") if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install gcc libc6-dev binutils")
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise BuildError("the bundle is built for Linux x86_64 only")
    try:
        import PyInstaller  # noqa: F401, PLC0415
    except ImportError as exc:
        raise BuildError(f"PyInstaller is not installed in {sys.prefix}: {exc}") from exc


def is_elf(path: Path) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"\x7fELF"


def compile_launcher(destination: Path) -> None:
    run(
        [
            "gcc",
            "-static",
            "-Os",
            "-s",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(destination),
            str(LAUNCHER_SRC),
        ]
    )
    needed, loader = system_dependencies(destination)
    if needed or loader is not None:
        raise BuildError(f"{destination} is not static: is libc.a installed (libc6-dev)?")


def freeze(entry: Path, staging: Path, clean: bool) -> Path:
    """Run PyInstaller; returns the directory holding the bootloader and its files."""
    argv = [
        sys.executable,
        "-m",
        "PyInstaller",
        "--noconfirm",
        "--log-level",
        "WARN",
        "--workpath",
        str(BUILD_DIR / "pyinstaller"),
        "--distpath",
        str(staging),
        str(SPEC),
    ]
    if clean:
        argv.insert(3, "--clean")
    env = dict(os.environ, ORCHARD_INAGENT_ENTRY=str(entry))
    log_path = BUILD_DIR / "pyinstaller.log"
    # Pass PyInstaller's warnings through, less the known noise: its pydantic hook asks for
    # pydantic.v1, which the spec leaves out on purpose. The whole output stays in the log.
    with (
        log_path.open("w") as log_file,
        subprocess.Popen(
            argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as process,
    ):
        for line in process.stdout or ():
            log_file.write(line)
            if " INFO: " in line or 'Hidden import "pydantic.v1' in line:
                continue
            print(f"  {line.rstrip()}", flush=True)
    if process.returncode != 0:
        raise BuildError(f"PyInstaller exited {process.returncode}; see {log_path}")
    lib = staging / "lib"
    if not (lib / FROZEN_NAME).is_file():
        raise BuildError(f"PyInstaller produced no {lib / FROZEN_NAME}")
    return lib


def system_dependencies(elf: Path) -> tuple[dict[str, Path], Path | None]:
    """The shared libraries `elf` needs (soname -> host path) and the loader, from ldd."""
    result = subprocess.run(["ldd", str(elf)], text=True, capture_output=True, check=False)
    if result.returncode != 0:  # "not a dynamic executable": static, nothing needed
        return {}, None
    needed: dict[str, Path] = {}
    loader: Path | None = None
    for line in result.stdout.splitlines():
        if missing := _LDD_MISSING.match(line):
            raise BuildError(f"{elf} needs {missing.group(1)}, which this machine does not have")
        if resolved := _LDD_RESOLVED.match(line):
            needed[resolved.group(1)] = Path(resolved.group(2))
        elif found_loader := _LDD_LOADER.match(line):
            loader = Path(found_loader.group(1))
    return needed, loader


def carry_system_libraries(lib: Path) -> list[str]:
    """Copy the loader and every library not yet in `lib` into it; returns what was added."""
    added: list[str] = []
    loader: Path | None = None
    pending = sorted(path for path in lib.rglob("*") if is_elf(path))
    seen: set[str] = set()
    while pending:
        elf = pending.pop()
        needed, elf_loader = system_dependencies(elf)
        loader = loader or elf_loader
        for soname, host_path in sorted(needed.items()):
            if soname in seen:
                continue
            seen.add(soname)
            target = lib / soname
            if target.exists():
                continue
            shutil.copy2(host_path.resolve(), target)
            target.chmod(0o755)
            added.append(soname)
            pending.append(target)
    if loader is None:
        raise BuildError(f"no dynamic loader found for {lib / FROZEN_NAME}")
    shutil.copy2(loader.resolve(), lib / LOADER_NAME)
    (lib / LOADER_NAME).chmod(0o755)
    added.append(LOADER_NAME)
    for name in added:
        if name != LOADER_NAME:
            run(["strip", "--strip-unneeded", str(lib / name)])
    return added


def verify_closure(lib: Path) -> None:
    """Every ELF in `lib`, resolved by the bundle's own loader, must load only from `lib`."""
    loader = lib / LOADER_NAME
    for elf in sorted(path for path in lib.rglob("*") if is_elf(path)):
        if elf.name == LOADER_NAME:
            continue
        result = subprocess.run(
            [str(loader), "--inhibit-cache", "--library-path", str(lib), "--list", str(elf)],
            text=True,
            capture_output=True,
            check=False,
            env={},
        )
        if result.returncode != 0:
            if "not a dynamic executable" in result.stdout + result.stderr:
                continue
            raise BuildError(f"the bundle's loader cannot load {elf}:\n{result.stderr}")
        for line in result.stdout.splitlines():
            outside = _LDD_RESOLVED.match(line)
            if outside and not Path(outside.group(2)).resolve().is_relative_to(lib.resolve()):
                raise BuildError(f"{elf} loads {outside.group(2)} from outside the bundle")
            if _LDD_MISSING.match(line):
                raise BuildError(f"{elf}: {line.strip()}")


def smoke_test(launcher: Path) -> None:
    """Start the bundle once, with an empty environment, far from the build directory."""
    result = subprocess.run(
        [str(launcher), "--help"],
        capture_output=True,
        text=True,
        env={},
        cwd="/",
        timeout=120,
        check=False,
    )
    if result.returncode != 0 or "usage: orchard-inagent" not in result.stdout:
        raise BuildError(
            f"the built bundle does not start ({launcher} --help exited {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )


def tree_size(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def install(staging_root: Path) -> None:
    """Replace the output directory with the staged one (a rename, never half-written)."""
    DIST_DIR.mkdir(parents=True, exist_ok=True)
    previous = DIST_DIR / ".orchard-inagent.previous"
    shutil.rmtree(previous, ignore_errors=True)
    if OUTPUT.exists():
        OUTPUT.rename(previous)
    staging_root.rename(OUTPUT)
    shutil.rmtree(previous, ignore_errors=True)


def build(entry: Path, clean: bool) -> Path:
    started = time.monotonic()
    check_tools()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    staging_root = BUILD_DIR / "staging" / "orchard-inagent"
    shutil.rmtree(staging_root, ignore_errors=True)
    staging_root.mkdir(parents=True)
    log(f"freezing {entry.name} with PyInstaller")
    lib = freeze(entry, staging_root, clean)
    log("carrying the C library and the dynamic loader")
    added = carry_system_libraries(lib)
    log(f"added {', '.join(sorted(added))}")
    verify_closure(lib)
    log("compiling the static launcher")
    compile_launcher(staging_root / LAUNCHER_NAME)
    smoke_test(staging_root / LAUNCHER_NAME)
    install(staging_root)
    size_mib = tree_size(OUTPUT) / 2**20
    log(f"built {OUTPUT} ({size_mib:.1f} MiB) in {time.monotonic() - started:.0f} s")
    return OUTPUT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--entry",
        type=Path,
        default=BUNDLE_SRC / "entry.py",
        help="script the bundle runs (default: entry.py, which calls orchard.inagent.main)",
    )
    parser.add_argument("--clean", action="store_true", help="drop PyInstaller's cache first")
    args = parser.parse_args()
    try:
        build(args.entry.resolve(), args.clean)
    except BuildError as exc:
        print(f"[inagent-bundle] build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
